"""lmforge: raw text to a trained small language model, as a reproducible DVC pipeline."""

__version__ = "0.1.0"
