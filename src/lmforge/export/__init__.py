"""Hugging Face Llama format, both ways: ``export_hf`` and ``import_hf``."""

from lmforge.export.hf import add_export_parser, add_import_parser, export_hf, import_hf

__all__ = ["add_export_parser", "add_import_parser", "export_hf", "import_hf"]
