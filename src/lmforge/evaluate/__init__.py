"""Evaluation: loss, perplexity and bits-per-byte per domain; samples from fixed prompts."""

from lmforge.evaluate.samples import samples_markdown
from lmforge.evaluate.scoring import SplitScore, score_split

__all__ = ["SplitScore", "score_split", "samples_markdown"]
