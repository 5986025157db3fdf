"""Exports of a model folder: Hugging Face (``export_hf``/``import_hf``) and GGUF
(``export_gguf``)."""

from lmforge.export.gguf import export_gguf
from lmforge.export.hf import add_export_parser, add_import_parser, export_hf, import_hf

__all__ = ["add_export_parser", "add_import_parser", "export_gguf", "export_hf", "import_hf"]
