"""Errors a user can act on: each prints as one line, never a traceback."""

from __future__ import annotations


class LmforgeError(Exception):
    """Base for errors that a stage reports as a single line and exits non-zero."""


class ConfigError(LmforgeError):
    """params.yaml is malformed, names an unknown key, or holds an impossible value."""


class InputError(LmforgeError):
    """An input path is missing, unreadable, or of a kind the stage cannot read."""
