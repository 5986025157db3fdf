"""params.yaml loading: types, unknown keys, impossible values, each a one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmforge.config import load_params
from lmforge.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def demo() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))


def test_repo_params_load():
    params = load_params(REPO / "params.yaml")
    assert params.model.n_embd % params.model.n_head == 0
    assert set(params.mix.weights) == {s.domain for s in params.ingest.sources}


def test_scientific_notation_without_dot_is_a_number(tmp_path):
    data = demo()
    data["train"]["max_lr"] = "5e-4"  # YAML 1.1 reads this as a string
    assert load_params(write(tmp_path, data)).train.max_lr == pytest.approx(5e-4)


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("train", "max_lrr", 1e-3, "train.max_lrr: unknown key; did you mean 'max_lr'?"),
        ("model", "n_embd", 250, "model.n_embd: 250 is not divisible by model.n_head=4"),
        ("model", "n_embd", 36, "head_dim 9 is odd"),
        ("train", "micro_batch_size", "sixteen", "train.micro_batch_size: expected an integer"),
        ("train", "precision", "bf61", "did you mean 'bf16'?"),
        ("tokenizer", "byte_fallback", "yes", "tokenizer.byte_fallback: expected true or false"),
        ("dedup", "bands", 64, "dedup.bands * dedup.rows = 512 exceeds dedup.num_perm=128"),
        ("mix", "val_fraction", 1.5, "mix.val_fraction: 1.5 must be in (0, 1)"),
    ],
)
def test_bad_value_names_key(tmp_path, section, key, value, message):
    data = demo()
    data[section][key] = value
    with pytest.raises(ConfigError) as err:
        load_params(write(tmp_path, data))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_weights_must_cover_domains(tmp_path):
    data = demo()
    del data["mix"]["weights"]["math"]
    with pytest.raises(ConfigError, match=r"mix.weights: no weight for domain\(s\) math"):
        load_params(write(tmp_path, data))


def test_invalid_yaml_names_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  max_lr: [1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"params.yaml: line \d+, column \d+: invalid YAML"):
        load_params(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")


def test_stage_prints_one_line_not_traceback(tmp_path):
    """A stage run with a malformed params file exits 2 with one line on stderr."""
    data = demo()
    data["model"]["n_head"] = 3
    write(tmp_path, data)
    proc = subprocess.run(
        [sys.executable, "-c", "from lmforge.stage import run_stage; run_stage(lambda p: None)"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: params.yaml: model.n_embd: 256 is not divisible")


def test_missing_required_key_is_one_line(tmp_path):
    data = demo()
    del data["ingest"]["sources"][0]["domain"]
    with pytest.raises(ConfigError, match=r"ingest.sources\[0\].domain: required key missing"):
        load_params(write(tmp_path, data))


@pytest.mark.parametrize(("key", "value", "message"), [
    ("prompts", ["ok", ""], "evaluate.prompts: a prompt is empty"),
    ("temperatures", [0.5, float("nan")], "evaluate.temperatures"),
])
def test_evaluate_prompts_and_temperatures(tmp_path, key, value, message):
    data = demo()
    data["evaluate"][key] = value
    with pytest.raises(ConfigError, match=message):
        load_params(write(tmp_path, data))


def test_literal_choices_are_typed():
    from lmforge.config import TrainConfig, from_dict

    assert from_dict(TrainConfig, {"compile": False}, "train.").compile is False
    assert from_dict(TrainConfig, {"compile": "auto"}, "train.").compile == "auto"
    with pytest.raises(ConfigError, match=r"train.compile: 0 is not one of auto, True, False"):
        from_dict(TrainConfig, {"compile": 0}, "train.")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("rules", ["min_chars", "gopher_nope"],
     r"filter.rules: unknown rule\(s\) gopher_nope \(known: boilerplate, c4_curly_bracket, "),
    ("skip", ["c4", "nope"], r"filter.skip: unknown rule\(s\) nope \(known: .*, or a group\)"),
    ("pii_kinds", ["email", "passport"],
     r"filter.pii_kinds: unknown kind\(s\) passport \(known: email, phone, ip, cn_id\)"),
])
def test_unknown_filter_rule_or_pii_kind_is_one_line(tmp_path, key, value, message):
    data = demo()
    data["filter"][key] = value
    with pytest.raises(ConfigError, match=message) as err:
        load_params(write(tmp_path, data))
    assert "\n" not in str(err.value)


def test_loading_params_imports_no_filter_rule_code():
    """Every stage loads params and its DVC code deps are what it imports, so validating
    rule names and PII kinds must not import the rules (a rule edit would rerun train)."""
    code = ("import sys; from lmforge.config import load_params; load_params('params.yaml'); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('lmforge'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=True)
    config = {f"lmforge.config.{m}" for m in ("checks", "data", "evaluation", "loader",
                                               "mixture", "model", "params",
                                               "post_training", "train")}
    assert set(proc.stdout.split()) == {"lmforge", "lmforge.config", "lmforge.data",
                                        "lmforge.data.rule_names", "lmforge.errors", *config}
