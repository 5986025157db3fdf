"""The names params.yaml may use for filter rules, their groups and PII kinds: data only.

``lmforge.config`` validates ``filter.rules``, ``filter.skip`` and ``filter.pii_kinds``
against these, so loading params imports no rule code: every stage loads params, and
a stage's DVC deps are the modules it imports, so editing a rule reruns only filter
(and what reads filter's outputs). ``rulebook.rule`` refuses a rule not declared here,
and tests/test_data_filters.py checks that the registry and this module agree exactly.
"""

from __future__ import annotations

# Group -> its rules, in the order they run (a rule's group is ``Rule.group``).
RULE_GROUPS: dict[str, tuple[str, ...]] = {
    "basic": ("min_chars", "hash_line_ratio", "char_repeat", "control_chars", "boilerplate"),
    "gopher_quality": (
        "gopher_min_words", "gopher_max_words", "gopher_min_avg_word_length",
        "gopher_max_avg_word_length", "gopher_symbol_ratio", "gopher_bullet_lines",
        "gopher_ellipsis_lines", "gopher_alpha_words", "gopher_stop_words",
    ),
    "gopher_repetition": (
        "gopher_dup_lines", "gopher_dup_paragraphs", "gopher_dup_line_chars",
        "gopher_dup_paragraph_chars",
        *(f"gopher_top_{n}gram" for n in (2, 3, 4)),
        *(f"gopher_dup_{n}gram" for n in range(5, 11)),
    ),
    "c4": ("c4_lorem_ipsum", "c4_curly_bracket", "c4_javascript_lines", "c4_policy_lines",
           "c4_min_sentences"),
    "fineweb": ("fineweb_line_punct", "fineweb_short_lines", "fineweb_dup_line_chars",
                "fineweb_list_ratio"),
    "code_generated": ("code_generated_header", "code_lock_file", "code_max_line_length",
                       "code_mean_line_length"),
}
# Rule name -> its group.
RULE_GROUP: dict[str, str] = {r: g for g, rules in RULE_GROUPS.items() for r in rules}
RULE_NAMES: frozenset[str] = frozenset(RULE_GROUP)

# Kinds of personal data lmforge.data.pii finds, in its order.
PII_KINDS: tuple[str, ...] = ("email", "phone", "ip", "cn_id")


def unknown_rules(names: list[str]) -> list[str]:
    """The names in ``names`` that are neither rules nor groups of rules."""
    return [n for n in names if n not in RULE_NAMES and n not in RULE_GROUPS]

# Language codes ``filter.languages`` may name: the 176 labels of fastText's lid.176
# model (ISO 639-1 where there is one, else 639-3 or a Wikipedia code), which
# lmforge.data.langid predicts; ``und`` is a text it cannot tell (no letters).
_LID176 = (
    "af als am an ar arz as ast av az azb ba bar bcl be bg bh bn bo bpy br bs bxr ca cbk "
    "ce ceb ckb co cs cv cy da de diq dsb dty dv el eml en eo es et eu fa fi fr frr fy ga "
    "gd gl gn gom gu gv he hi hif hr hsb ht hu hy ia id ie ilo io is it ja jbo jv ka kk km "
    "kn ko krc ku kv kw ky la lb lez li lmo lo lrc lt lv mai mg mhr min mk ml mn mr mrj ms "
    "mt mwl my myv mzn nah nap nds ne new nl nn no oc or os pa pam pfl pl pms pnb ps pt qu "
    "rm ro ru rue sa sah sc scn sco sd sh si sk sl so sq sr su sv sw ta te tg th tk tl tr "
    "tt tyv ug uk ur uz vec vep vi vls vo wa war wuu xal xmf yi yo yue zh und")
LANGUAGE_CODES: frozenset[str] = frozenset(_LID176.split())
