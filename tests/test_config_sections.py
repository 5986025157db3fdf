"""Every params section's errors name the key the user wrote: ``section.key`` as in
params.yaml (``dpo.beta1``, ``sft.lr``, ``dpo.lora.rank``), never another section's
name or a class name."""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from pathlib import Path

import pytest
import yaml

from lmforge.config import (
    DpoConfig,
    Params,
    RopeScalingConfig,
    from_dict,
    load_params,
    section_name,
    yaml_keys,
)
from lmforge.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

# One impossible value per section of Params: (section, key, value). A section added to
# Params without a row here fails test_every_section_has_a_bad_value.
BAD = [
    ("ingest", "part_docs", 0),
    ("filter", "min_chars", 0),
    ("dedup", "rows", 0),
    ("decontam", "min_ngram", 99),
    ("mix", "max_epochs", 0.5),
    ("tokenizer", "vocab_size", 100),
    ("shards", "shard_tokens", 0),
    ("executor", "num_cpus", 0),
    ("model", "dropout", 1.0),
    ("train", "beta1", 1.5),
    ("evaluate", "batch_size", 0),
    ("sft_data", "val_fraction", 0.7),
    ("sft", "lr", 2.0),
    ("dpo_data", "seq_len", 0),
    ("dpo", "beta1", 1.5),
    ("evaluate_post", "max_new_tokens", 0),
    ("harness", "batch_size", 0),
    ("mix_sweep", "proxies", 0),
]
# Keys a section inherits or nests, where a wrong name used to slip in.
NESTED = [
    ("sft", "beta2", 1.0, "sft.beta2"),
    ("dpo", "label_smoothing", 1.0, "dpo.label_smoothing"),
    ("dpo", "muon_momentum", 1.0, "dpo.muon_momentum"),
    ("dpo", "lr", 0.0, "dpo.lr"),
    ("dpo", "lora", {"rank": 0}, "dpo.lora.rank"),
    ("sft", "lora", {"dropout": 1.0}, "sft.lora.dropout"),
    ("train", "lora", {"targets": []}, "train.lora.targets"),
    ("model", "rope_scaling", {"factor": 0.5}, "model.rope_scaling"),
    ("model", "norm_eps", 0.0, "model.norm_eps"),
    ("filter", "domains", {"web": {"max_loss": 2.0}}, "filter.domains.web.max_loss"),
]


@functools.cache
def _demo() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))


def demo() -> dict:
    return copy.deepcopy(_demo())


def error_of(tmp_path: Path, section: str, key: str, value: object) -> str:
    data = demo()
    data.setdefault(section, {})[key] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    message = str(err.value)
    assert "\n" not in message
    return message.removeprefix(f"{path}: ")


def test_every_section_has_a_bad_value():
    assert [s for s, _, _ in BAD] == [f.name for f in dataclasses.fields(Params)]


@pytest.mark.parametrize(("section", "key", "value"), BAD, ids=[f"{s}.{k}" for s, k, _ in BAD])
def test_error_names_the_section_and_key(tmp_path, section, key, value):
    assert error_of(tmp_path, section, key, value).startswith(f"{section}.{key}")


@pytest.mark.parametrize(("section", "key", "value", "named"), NESTED,
                         ids=[n for *_, n in NESTED])
def test_inherited_and_nested_keys_name_their_own_section(tmp_path, section, key, value, named):
    assert error_of(tmp_path, section, key, value).startswith(named)


def _numeric_keys() -> list[tuple[str, str]]:
    """Every int or float key of every section (as params.yaml spells it)."""
    out = []
    for f in dataclasses.fields(Params):
        cls = f.default_factory
        hints = typing.get_type_hints(cls)
        names = {v: k for k, v in yaml_keys(cls).items()}
        out += [(f.name, names[n]) for n, tp in hints.items()
                if n in names and tp in (int, float)]
    return out


@pytest.mark.parametrize(("section", "key"), _numeric_keys(),
                         ids=[f"{s}.{k}" for s, k in _numeric_keys()])
def test_a_negative_number_is_refused_by_its_own_key_or_allowed(section, key):
    """-1 in any numeric key: allowed (a seed), or an error that names that key."""
    data = demo()
    data[section] = {**(data.get(section) or {}), key: -1}
    try:  # load_params without the file: from_dict and validate are what it runs
        from_dict(Params, data, "").validate()
    except ConfigError as e:
        message = str(e)
        # The key itself, or (a warmup of -1 steps) the section's own keys only.
        assert message.startswith(f"{section}.{key}") or (
            message.startswith(f"{section}.") and f"{section}.{key}" in message), message


def test_section_name_is_derived_from_params_outside_a_check():
    p = Params()
    assert section_name(p.dpo) == "dpo" and section_name(p.harness) == "harness"
    assert section_name(p.dpo_data) == "dpo_data" and section_name(p.mix_sweep) == "mix_sweep"
    # A class held in several places is named by its first, unless it is being checked.
    assert section_name(p.model.rope_scaling or RopeScalingConfig()) == "model.rope_scaling"
    with pytest.raises(ConfigError, match=r"^dpo\.beta1: 1\.5 must be in \[0, 1\)"):
        DpoConfig(beta1=1.5).validate()
