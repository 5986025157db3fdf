"""Where a tokenizer lives on disk: its defining file, its identity, the files to copy.

A tokenizer is a sentencepiece ``tokenizer.model`` or a Hugging Face ``tokenizer.json``
with the files transformers keeps beside it (``tokenizer_config.json`` holds the
bos/eos/pad tokens and the chat template). Its identity -- the "tokenizer sha256" of run
fingerprints, shard headers and model config.json -- is the sha256 of the defining file
alone, so a sentencepiece pipeline keeps the identities it always had.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from lmforge.errors import InputError

SP_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
# Kept beside tokenizer.json and copied with it, as they are (whichever exist).
# tokenizer.model too: folders such as Mistral's ship both, and transformers reads the json.
# generation_config.json: the model's sampling defaults and stop ids travel with its
# tokenizer and chat template, so a fine-tune of an imported model exports them as they
# came in (the tokenizer stage's copy is what save_model puts beside trained weights).
HF_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json", SP_FILE)


def find_tokenizer(path: str | Path) -> Path | None:
    """The defining file at ``path`` (a file, or a folder's tokenizer.json, else its
    tokenizer.model), or None when there is none."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for name in (HF_FILE, SP_FILE):
            if (path / name).is_file():
                return path / name
    return None


def locate_tokenizer(path: str | Path) -> Path:
    """:func:`find_tokenizer`, or an ``InputError`` naming ``path``."""
    found = find_tokenizer(path)
    if found is None:
        what = "a folder without" if Path(path).is_dir() else "no such file or folder; expected"
        raise InputError(f"{path}: no tokenizer ({what} {HF_FILE} or {SP_FILE})")
    return found


def is_hf_file(path: Path) -> bool:
    """Whether the defining file ``path`` is a Hugging Face tokenizer.json."""
    return path.suffix == ".json"


def tokenizer_sha256(path: str | Path) -> str:
    """The tokenizer's identity: sha256 of its defining file (``path`` or in the folder)."""
    file = locate_tokenizer(path)
    h = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_files(path: str | Path) -> dict[str, Path]:
    """``{name in the copy: source}``: the defining file under its canonical name, and for
    a tokenizer.json the companions found beside it."""
    file = locate_tokenizer(path)
    if not is_hf_file(file):
        return {SP_FILE: file}
    files = {HF_FILE: file}
    for name in HF_COMPANIONS:
        if (file.parent / name).is_file():
            files[name] = file.parent / name
    return files


def copy_tokenizer(path: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer at ``path`` into ``out_dir`` as it is; return the names written."""
    out_dir = Path(out_dir)
    files = tokenizer_files(path)
    for name, source in files.items():
        shutil.copyfile(source, out_dir / name)
    return sorted(files)
