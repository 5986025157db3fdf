"""Under DVC, a stage's ``init_from`` must be one of that stage's deps in dvc.yaml.

Why: ``tokenizer.init_from``, ``train.init_from``, ``sft.init_from`` and ``dpo.init_from``
are params, so DVC records the path string, not the files behind it. A folder edited in
place (``models/base`` imported again) then leaves ``dvc status`` "up to date" and the
stage's outputs stale. dvc.yaml cannot add the dep for the user: DVC 3 cannot template an
optional dep (``- ${tokenizer.init_from}`` with the default null breaks every dvc
command, treeverse/dvc#8036; lists, foreach and vars cannot help), so the stage checks
instead and stops before any work, in one line naming the dep to add.

Only under DVC (``DVC_STAGE``, which DVC sets in every stage command's environment,
names the stage it runs): ``lmforge train`` and tests calling the stages' functions
have no dvc.yaml to keep true. The dvc.yaml read is the one in the working directory,
where DVC runs our stages' commands: for ``dvc exp run --queue`` that is the
experiment's temporary copy of the repo, with its own dvc.yaml.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from lmforge.errors import InputError

# ``lmforge mix sweep``'s frozen tokenizers (mixture/sweep.py imports this): every proxy
# it queues sets ``tokenizer.init_from`` to an absolute path under the original repo's
# <SWEEP_TOKENIZERS>/<name>/. No dvc.yaml can list it (a proxy runs in a temporary copy
# made from the committed dvc.yaml), and it needs no listing: the sweep copies the
# workspace's tokenizer there once and never rewrites it (a changed workspace tokenizer
# is reported, not re-frozen), and the copy's sha256 is part of the sweep's key, hence of
# every proxy's name. There is no edit in place for `dvc status` to miss.
SWEEP_TOKENIZERS = "models/mix_sweep"


def running_stage() -> str | None:
    """The name of the dvc.yaml stage DVC is running in this process, or None outside DVC.

    DVC sets ``DVC_STAGE`` to the stage's address: its name for the root dvc.yaml, else
    ``<path>/dvc.yaml:<name>``.
    """
    address = os.environ.get("DVC_STAGE")
    return address.rsplit(":", 1)[-1] if address else None


def repo_roots() -> list[Path]:
    """The folders a path inside the repo is relative to: the working directory (the
    stage's, a queued experiment's temporary copy included) and ``DVC_ROOT`` (the
    original repo, where the sweep's frozen tokenizers are), each as given and resolved."""
    roots: list[Path] = []
    for root in (os.getcwd(), os.environ.get("DVC_ROOT")):
        for form in (root, root and os.path.realpath(root)):
            if form and Path(form) not in roots:
                roots.append(Path(form))
    return roots


def normalise(path: str, roots: Sequence[Path]) -> str:
    """``path`` as a dvc.yaml dep names it: relative to the first root it lies in (a
    relative path is relative to ``roots[0]``), POSIX-style; else absolute, as DVC keeps an
    external dep."""
    given = Path(path)
    absolute = Path(os.path.normpath(given if given.is_absolute() else roots[0] / given))
    # The resolved form too: the working directory is resolved (/private/var on macOS)
    # while a path may be typed through a symlink (/var).
    for form in (absolute, Path(os.path.realpath(absolute))):
        for root in roots:
            if form.is_relative_to(root):
                return form.relative_to(root).as_posix()
    return absolute.as_posix()


def within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies under it (both normalised; ``.`` is every path)."""
    return folder == "." or path == folder or path.startswith(folder.rstrip("/") + "/")


def covered(path: str, deps: Iterable[str], roots: Sequence[Path]) -> bool:
    """Whether one of ``deps`` (as written in dvc.yaml) is ``path`` or a folder above it."""
    target = normalise(path, roots)
    return any(within(target, normalise(dep, roots)) for dep in deps)


def stage_deps(stage: str) -> list[str] | None:
    """The paths ``stage`` of the working directory's dvc.yaml depends on (as DVC reads
    them, ``${...}`` resolved; params files left out), or None where DVC cannot say."""
    from dvc.dependency.param import ParamsDependency  # ~0.2 s: only when checking
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    dvcfile = Path.cwd() / "dvc.yaml"
    if not dvcfile.is_file():
        return None
    try:
        with Repo() as repo:
            loaded = repo.stage.load_one(str(dvcfile), stage)
    except DvcException:
        return None
    return [dep.def_path for dep in loaded.deps if not isinstance(dep, ParamsDependency)]


def written_deps(stage: str) -> list[str]:
    """The plain paths ``stage`` lists in the working directory's dvc.yaml as written
    (``${...}`` left unresolved, so a miss here is not yet a verdict); [] without one."""
    import yaml

    try:
        text = (Path.cwd() / "dvc.yaml").read_text(encoding="utf-8")
        entry = (yaml.safe_load(text) or {}).get("stages", {}).get(stage) or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    deps = entry.get("deps") if isinstance(entry, dict) else None
    return [d for d in deps or [] if isinstance(d, str)]


def require_dependency(section: str, path: str | None) -> None:
    """Under DVC, stop with one line unless ``path`` (``<section>.init_from``) is one of
    the running stage's deps in dvc.yaml, or lies in a folder that is.

    Paths compare normalised relative to the repo root (an absolute path inside the repo
    counts as its relative form; one outside must be listed as is). Nothing is checked
    outside DVC, when ``path`` is unset, for the mix sweep's frozen tokenizers, or when
    the stage is not in the working directory's dvc.yaml.
    """
    stage = running_stage()
    if not path or stage is None:
        return
    roots = repo_roots()
    where = normalise(path, roots)
    if within(where, SWEEP_TOKENIZERS):
        return
    # dvc.yaml as written first (milliseconds): sft and dpo read their listed defaults on
    # every run; DVC's own loader (~0.3 s) only when a dep may be a ${...} template.
    if covered(path, written_deps(stage), roots):
        return
    deps = stage_deps(stage)
    if deps is None or covered(path, deps, roots):
        return
    raise InputError(f"{section}.init_from: {path} is not a dependency of the {stage} stage, "
                     f"so dvc status would not see it change: add \"- {where}\" under "
                     f"stages.{stage}.deps in dvc.yaml")
