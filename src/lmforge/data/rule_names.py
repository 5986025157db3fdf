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
