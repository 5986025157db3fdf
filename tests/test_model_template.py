"""A model's own chat template: our ids equal transformers' ``apply_chat_template`` for
every conversation shape the records accept, and the loss mask covers exactly each
assistant turn's content and its end-of-turn token (ChatML as SmolLM2 and Qwen2.5 write
it, Llama 3's headers)."""

from __future__ import annotations

import json

import pytest

from lmforge.errors import InputError
from lmforge.finetune.model_template import (
    NOT_PREFIX,
    ModelTemplate,
    TemplateError,
    read_template,
    special_tokens,
)

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
SMOLLM2 = (  # SmolLM2-135M-Instruct's own template, as its tokenizer_config.json has it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN25 = (  # Qwen2.5's, without the tool-calling branches
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
    "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou "
    "are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or "
    "(message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = (  # Llama-3-8B-Instruct's
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
    "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
TEMPLATES = {"smollm2": (SMOLLM2, "<|im_start|>", "<|im_end|>", "<|im_end|>"),
             "qwen2.5": (QWEN25, None, "<|im_end|>", "<|im_end|>"),
             "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>")}
CONVERSATIONS = [
    [("user", "What is the capital of France?"), ("assistant", "Paris.")],
    [("system", "Answer in one word."), ("user", "Capital of Italy?"), ("assistant", "Rome")],
    [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Say 2+2."),
     ("assistant", "  4 \n")],
    [("system", "Be terse."), ("user", "红色的反义词？"), ("assistant", "没有固定的反义词。"),
     ("user", "def f():\n    return 1"), ("assistant", "It returns 1.\r\n")],
]


@pytest.fixture(scope="module")
def backend():
    """A byte-level BPE with the chat tokens, as open models ship (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [t for c in CONVERSATIONS for _, t in c] * 20 + ["system user assistant"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def hf_tokenizer(backend, kind: str):
    template, bos, eos, _ = TEMPLATES[kind]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=template)


def ours(backend, kind: str) -> ModelTemplate:
    template, bos, eos, _ = TEMPLATES[kind]
    tokens = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    specials = frozenset(backend.token_to_id(t) for t in SPECIALS)
    return ModelTemplate(template, kind, lambda text: backend.encode(
        text, add_special_tokens=False).ids, specials, tokens,
        frozenset({backend.token_to_id(eos)}))


def reference(tok, turns, add_generation_prompt: bool = False) -> list[int]:
    messages = [{"role": r, "content": c} for r, c in turns]
    out = tok.apply_chat_template(messages, tokenize=True,
                                  add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("kind", list(TEMPLATES))
@pytest.mark.parametrize("turns", CONVERSATIONS, ids=["single", "system", "multi", "mixed"])
def test_ids_equal_apply_chat_template_and_the_mask_is_each_reply_and_its_end(
        backend, kind, turns):
    tok, template = hf_tokenizer(backend, kind), ours(backend, kind)
    ids, mask = template.render(turns)
    assert ids == reference(tok, turns)
    # The masked runs, decoded: each assistant turn's content (as the template writes
    # it: Llama 3 trims it) and its end-of-turn token, in order, nothing else.
    runs, run = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    end = TEMPLATES[kind][3]
    replies = [c.strip() if kind == "llama3" else c for r, c in turns if r == "assistant"]
    assert [backend.decode(r, skip_special_tokens=False) for r in runs] == [
        reply + end for reply in replies]
    # The prompt the model answers from.
    for k in range(1, len(turns) + 1, 2):
        prompt = turns[:k] if turns[k - 1][0] != "assistant" else turns[:k - 1]
        assert template.generation_prompt(prompt) == reference(tok, prompt, True)
    assert template.stop_ids == {backend.token_to_id(end)}


QWEN3 = (  # Qwen3's kind: only the last assistant turn gets an (empty) reasoning block
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_rewrites_earlier_turns_trains_one_example_per_turn(backend):
    template = ModelTemplate(QWEN3, "qwen3", lambda t: backend.encode(
        t, add_special_tokens=False).ids, frozenset(backend.token_to_id(t) for t in SPECIALS),
        {"eos_token": "<|im_end|>"})
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                               eos_token="<|im_end|>", chat_template=QWEN3)
    ids, mask = template.render(CONVERSATIONS[0])  # one reply: the prefixes hold
    assert [(ids, mask)] == template.examples(CONVERSATIONS[0])
    with pytest.raises(TemplateError) as bad:  # one sequence cannot mask both replies
        template.render(CONVERSATIONS[2])
    assert bad.value.reason == NOT_PREFIX and "turn 2" in bad.value.detail
    # As training data: one example per reply, each the conversation up to that reply as
    # transformers renders it, the mask on that reply (its empty reasoning block, content
    # and <|im_end|>) alone.
    turns = CONVERSATIONS[2]
    parts = template.examples(turns)
    replies = [k for k, (role, _) in enumerate(turns) if role == "assistant"]
    assert len(parts) == len(replies)
    for (ids, mask), k in zip(parts, replies, strict=True):
        assert ids == reference(tok, turns[:k + 1])
        start = len(reference(tok, turns[:k], add_generation_prompt=True))
        learned = backend.decode([i for i, m in zip(ids, mask, strict=True) if m],
                                 skip_special_tokens=False)
        assert learned == "<think>\n\n</think>\n\n" + turns[k][1] + "<|im_end|>"
        assert not any(mask[:start])


def test_a_template_whose_turns_end_in_no_special_token_is_refused(backend):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(InputError, match="ends in no special token"):
        ModelTemplate(plain, "plain.jinja", lambda t: backend.encode(t).ids,
                      frozenset(backend.token_to_id(t) for t in SPECIALS), {})


def test_the_template_and_tokens_are_read_as_transformers_writes_them(tmp_path, backend):
    tok = hf_tokenizer(backend, "smollm2")
    tok.save_pretrained(tmp_path / "tok")
    found = read_template(tmp_path / "tok")
    assert found is not None and found[0] == SMOLLM2
    assert special_tokens(tmp_path / "tok")["eos_token"] == "<|im_end|>"
    (tmp_path / "old").mkdir()  # transformers 4: the template inside tokenizer_config.json
    (tmp_path / "old" / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "default", "template": LLAMA3}, {"name": "x", "template": ""}],
        "eos_token": {"content": "<|eot_id|>"}}))
    assert read_template(tmp_path / "old")[0] == LLAMA3
    assert special_tokens(tmp_path / "old") == {"eos_token": "<|eot_id|>"}
    assert read_template(tmp_path) is None
