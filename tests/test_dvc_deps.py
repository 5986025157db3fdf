"""dvc.yaml's dependencies are exactly as wide as the code and the params each stage uses.

Code: a stage's code deps are exactly the repo files its entry module (``python -m
stages.<name>``) executes: imports followed transitively, at module level and inside
functions, with the packages' ``__init__.py`` files. Params: a stage lists each key of its
sections that can change its outputs, params.yaml holds every such key (a key missing
there is invisible to DVC), and every config field is either listed or named in
NON_OUTPUT_KEYS below with the reason.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from demo_repo import DATA_STAGES, copy_repo

from lmforge.config import Params, load_params, yaml_keys

REPO = Path(__file__).resolve().parents[1]
# In-repo top-level packages and the folder each lives in.
PACKAGE_DIRS = {"stages": ".", "lmforge": "src"}
# dvc.yaml deps under these folders are code; the others (data/, models/) are not compared.
CODE_ROOTS = ("stages", "src")

# Config fields that cannot change a stage's outputs, so no stage lists them and editing
# them reruns nothing. Every other field must be a param dep of its stage.
# The loop's cadence keys, the same for every training stage after pretraining.
TUNING_CADENCE = {
    "log_every": "logging cadence", "eval_every": "val cadence",
    "sample_every": "sampling cadence", "sample_prompts": "MLflow samples only",
    "ckpt_every": "checkpoint cadence", "light_every": "model-only snapshot cadence",
    "keep_last": "checkpoint pruning", "max_bad_steps": "abort threshold",
    "self_check": "pre-flight check"}
NON_OUTPUT_KEYS: dict[str, dict[str, str]] = {
    # Worker processes return results in input order (lmforge.parallel.imap_ordered):
    # the same bytes on any count.
    "ingest": {"num_workers": "worker count"},
    "filter": {"num_workers": "worker count"},
    "dedup": {"num_workers": "worker count"},
    "mix": {"num_workers": "worker count"},
    "decontam": {"num_workers": "worker count"},
    "shards": {"num_workers": "worker count"},
    # Where the per-part tasks run: the executor yields results in task order, so the
    # local pool and a Ray cluster write the same bytes (tests/test_executor_ray.py).
    "executor": {k: "where the data stages' tasks run" for k in
                 ("kind", "address", "num_cpus", "memory_mb", "max_retries")},
    "train": {
        # Cadence: the weights are the same; plots/train.tsv, plots/val.tsv and
        # train_loss in metrics/train.json keep the cadence the run was trained with.
        "log_every": "logging cadence",
        "eval_every": "val-loss cadence (the final val loss is always measured)",
        # MLflow-only samples, from their own generator: training RNG untouched.
        "sample_every": "sampling cadence",
        "sample_prompts": "MLflow samples only",
        # Checkpoints are not a DVC output, and a resumed run ends bit-identical.
        "ckpt_every": "checkpoint cadence",
        "light_every": "model-only snapshot cadence",
        "keep_last": "checkpoint pruning",
        # A finished run never hit the limit; a stopped one wrote no outputs.
        "max_bad_steps": "abort threshold",
        # Runs before training on its own model, before the seed is set.
        "self_check": "pre-flight check",
    },
    # Fine-tuning's and DPO's knobs are train's: the same reasons (DPO's evaluation runs
    # the frozen reference and draws no random numbers, so eval_every is cadence too).
    "sft": dict(TUNING_CADENCE),
    "dpo": dict(TUNING_CADENCE),
    # Read by `lmforge mix sweep` / `mix fit`, which queue experiments with their own -S
    # overrides of the stages' keys; no stage reads this section.
    "mix_sweep": {k: "the mixture sweep's own settings" for k in (
        "proxies", "seed", "concentration", "bounds", "proxy_model", "max_steps",
        "micro_batch_size", "eval_batches", "jobs", "name", "objective", "objective_weights",
        "target_domain", "max_increase", "candidates", "top_k", "min_rank_corr")},
    # Everything else changes outputs, kernels and thread counts included: torch splits
    # CPU reductions by thread (train.num_threads), unigram tokenizers depend on
    # sentencepiece's threads (tokenizer.num_threads), and compile, fused_loss,
    # activation_checkpointing, nproc and probe_micro_batch change float rounding.
}

# The params sections a stage reads; its param deps come from these only.
STAGE_SECTIONS = {"train": {"model", "train"},
                  # The forgetting pass scores like evaluate (evaluate.max_batches).
                  "evaluate_post": {"evaluate_post", "evaluate"},
                  # The evaluation sets those sections name, checked against the training
                  # text; mix's val split (by mix's keys) is held out, no training text.
                  "decontam": {"decontam", "harness", "evaluate_post", "mix"}}


# --------------------------------------------------------------------------- code deps


def module_file(name: str, root: Path = REPO) -> Path | None:
    """The file of in-repo module ``name`` (``a.b``: a/b.py or a/b/__init__.py), or None."""
    parts = name.split(".")
    if parts[0] not in PACKAGE_DIRS:
        return None
    stem = root.joinpath(PACKAGE_DIRS[parts[0]], *parts)
    for path in (stem.with_suffix(".py"), stem / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_names(path: Path, name: str) -> set[str]:
    """Modules ``path`` (module ``name``) may import, anywhere in its code.

    ``from a import b`` yields ``a`` and ``a.b`` (b may be a submodule); relative
    imports are resolved against the module's package.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def executed_files(entry: str, root: Path = REPO) -> set[str]:
    """Repo files (relative paths) that running module ``entry`` may execute."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name, root)
        if path is None:  # third-party, stdlib, or a name imported from a module
            continue
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(imported_names(path, name))
    files = (module_file(n, root) for n in seen)
    return {p.relative_to(root).as_posix() for p in files if p is not None}


def load_stages() -> dict[str, dict]:
    return yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


STAGES = load_stages()


def entry_module(stage: dict) -> str:
    match = re.fullmatch(r"python -m (stages\.\w+)", stage["cmd"].strip())
    assert match, f"cmd {stage['cmd']!r}: expected 'python -m stages.<name>'"
    return match.group(1)


def is_code(dep: str) -> bool:
    return dep.split("/")[0] in CODE_ROOTS


def dep_files(dep: str, root: Path = REPO) -> set[str]:
    """A dep as files: itself, or every file under it (what DVC hashes)."""
    path = root / dep
    if path.is_dir():
        return {p.relative_to(root).as_posix() for p in path.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    return {dep}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_code_deps_are_exactly_the_imported_modules(name):
    stage = STAGES[name]
    listed = set().union(*(dep_files(d) for d in stage["deps"] if is_code(d)))
    imported = executed_files(entry_module(stage))
    missing, extra = sorted(imported - listed), sorted(listed - imported)
    assert not missing and not extra, (
        f"dvc.yaml stage {name!r}: list exactly the files it imports.\n"
        f"  imported but not a dep (a change would not rerun it): {missing}\n"
        f"  a dep but never imported (a change reruns it for nothing): {extra}")


@pytest.mark.parametrize("name", sorted(STAGES))
def test_code_deps_exist(name):
    for dep in STAGES[name]["deps"]:
        if is_code(dep):
            assert (REPO / dep).exists(), f"dvc.yaml stage {name!r}: {dep} does not exist"


def test_walker_follows_lazy_relative_and_submodule_imports(tmp_path):
    """The import walk itself, on a made-up package (so the tests above are not vacuous)."""
    files = {
        "stages/__init__.py": "",
        "stages/run.py": "from lmforge.pkg import sub\n",
        "src/lmforge/__init__.py": "",
        "src/lmforge/pkg/__init__.py": "",
        "src/lmforge/pkg/sub.py": "def f():\n    from . import lazy\n    import lmforge.deep.leaf\n",
        "src/lmforge/pkg/lazy.py": "from .sibling import x\nimport os\n",
        "src/lmforge/pkg/sibling.py": "x = 1\n",
        "src/lmforge/pkg/unused.py": "",
        "src/lmforge/deep/__init__.py": "",
        "src/lmforge/deep/leaf.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    expected = set(files) - {"src/lmforge/pkg/unused.py"}
    assert executed_files("stages.run", tmp_path) == expected


def test_lazy_imports_of_the_real_stages_are_seen():
    # Imported inside functions (pipeline.py, telemetry.py): a walk of module-level
    # imports would miss them.
    assert "src/lmforge/train/selfcheck.py" in executed_files("stages.train")
    assert "src/lmforge/tracking.py" in executed_files("stages.train")
    # mix.py is imported by mix and by decontam (which holds mix's val split out of the
    # training text), so editing it reruns those two only.
    owners = {n for n, s in STAGES.items() if "src/lmforge/data/mix.py" in
              executed_files(entry_module(s))}
    assert owners == {"mix", "decontam"}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_directory_deps_only_where_every_file_is_imported(name):
    stage = STAGES[name]
    imported = executed_files(entry_module(stage))
    for dep in stage["deps"]:
        if is_code(dep) and (REPO / dep).is_dir():
            unused = sorted(dep_files(dep) - imported)
            assert not unused, (f"dvc.yaml stage {name!r}: directory {dep} holds files the "
                                f"stage never imports ({unused}); list its files instead")


# --------------------------------------------------------------------------- params


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Params)}


def fields_of(section: str) -> set[str]:
    """The section's params.yaml keys (sft names its max_lr field ``lr``)."""
    return set(yaml_keys(SECTIONS[section]))


def listed_keys(stage: dict) -> set[tuple[str, str]]:
    """(section, key) pairs a stage's ``params`` names; a bare section names all its keys."""
    keys = set()
    for entry in stage.get("params", []):
        assert isinstance(entry, str), f"params entry {entry!r}: expected 'section.key'"
        section, _, key = entry.partition(".")
        keys.update((section, k) for k in ([key] if key else fields_of(section)))
    return keys


def test_non_output_keys_are_config_fields():
    for section, keys in NON_OUTPUT_KEYS.items():
        assert set(keys) <= fields_of(section), f"{section}: stale NON_OUTPUT_KEYS entry"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_params_come_from_its_own_sections(name):
    sections = STAGE_SECTIONS.get(name, {name})
    for section, key in listed_keys(STAGES[name]):
        assert section in sections, f"dvc.yaml stage {name!r} lists {section}.{key}"
        assert key in fields_of(section), (
            f"dvc.yaml stage {name!r} lists {section}.{key}, which is no config field")


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_config_field_is_a_param_dep_or_named_as_non_output(section):
    listed = {k for s in STAGES.values() for sec, k in listed_keys(s) if sec == section}
    non_output = set(NON_OUTPUT_KEYS.get(section, {}))
    both = sorted(listed & non_output)
    assert not both, f"{section}: {both} are both param deps and in NON_OUTPUT_KEYS"
    unaccounted = sorted(fields_of(section) - listed - non_output)
    assert not unaccounted, (
        f"{section}: config field(s) {unaccounted} are no stage's param dep, so DVC would "
        f"not rerun anything when they change. If a field can change its stage's outputs, "
        f"add '{section}.<key>' to that stage's params in dvc.yaml and the key with its "
        f"default to params.yaml; if it cannot, add it to NON_OUTPUT_KEYS in "
        f"tests/test_dvc_deps.py with the reason.")


def test_params_yaml_lists_every_key():
    # DVC sees only keys present in params.yaml: a listed key missing there stops
    # `dvc repro`, and a key a user adds later would not be recorded.
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    for section in SECTIONS:
        missing = sorted(fields_of(section) - set(raw.get(section) or {}))
        assert not missing, (f"params.yaml: {section} lacks {missing}; add each with its "
                             f"default from src/lmforge/config/")
    load_params(REPO / "params.yaml")  # and it still loads


# --------------------------------------------------------------------------- with DVC

# The stages run for real below: the data stages and the tokenizer, seconds on a slice.
TOUCH_STAGES = DATA_STAGES


def dvc(root: Path, *args: str) -> str:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PYTHONPATH=str(root / "src"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["dvc", *args], cwd=root, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{out[-3000:]}"
    return out


def changed_stages(root: Path) -> dict[str, list]:
    """``dvc status``: what each changed stage reports, by stage name."""
    return json.loads(dvc(root, "status", "--json"))


def set_param(root: Path, section: str, key: str, value: object) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text(encoding="utf-8"))
    params[section][key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True),
                    encoding="utf-8")


@pytest.fixture(scope="module")
def data_pipeline(demo_data_repo, tmp_path_factory) -> Path:
    """A git+DVC repo with this dvc.yaml's data and tokenizer stages, reproduced on a
    slice: a copy of the session's demo repo (conftest), with those stages only."""
    root = copy_repo(demo_data_repo[0], tmp_path_factory.mktemp("deps"))
    pipeline = yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))
    pipeline["stages"] = {n: s for n, s in pipeline["stages"].items() if n in TOUCH_STAGES}
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False), encoding="utf-8")
    assert changed_stages(root) == {}
    return root


@pytest.mark.slow
def test_editing_mix_py_reruns_only_mix(data_pipeline):
    root = data_pipeline
    with (root / "src/lmforge/data/mix.py").open("a", encoding="utf-8") as f:
        f.write("# touched\n")
    # `dvc status` names the stages whose own deps changed; later stages rerun only if
    # mix's outputs change, which a comment does not. (Observed first, asserted after,
    # so a failure leaves the repo reproduced for the other test.)
    status = changed_stages(root)
    ran = set(re.findall(r"Running stage '(\w+)'", dvc(root, "repro")))
    assert set(status) == {"decontam", "mix"}, status
    assert "src/lmforge/data/mix.py" in json.dumps(status["mix"])
    assert ran == {"decontam", "mix"}


@pytest.mark.slow
def test_worker_count_reruns_nothing_but_a_seed_does(data_pipeline):
    root = data_pipeline
    original = (root / "params.yaml").read_text(encoding="utf-8")
    set_param(root, "ingest", "num_workers", 2)
    after_workers = changed_stages(root)
    set_param(root, "mix", "seed", 99)  # the control: a listed key is seen
    after_seed = changed_stages(root)
    (root / "params.yaml").write_text(original, encoding="utf-8")
    assert after_workers == {}
    assert set(after_seed) == {"decontam", "mix"}, after_seed  # the val split moves
    assert "mix.seed" in json.dumps(after_seed["mix"])


def test_dvc_parses_its_yaml_with_ruamels_c_loader():
    """Every dvc command parses dvc.yaml and dvc.lock (2,700 lines) with ruamel.yaml's
    safe loader, several times; pure Python (ruamel.yaml.clib missing) made `dvc status`
    1.6x slower. The loader DVC builds must be the C one."""
    from dvc.utils.serialize._yaml import parse_yaml
    from ruamel.yaml import YAML

    assert YAML(typ="safe").Parser.__module__.endswith("_ruamel_yaml")
    lock = (REPO / "dvc.lock").read_text(encoding="utf-8")
    assert parse_yaml(lock, "dvc.lock")["stages"].keys() >= {"train", "evaluate"}
