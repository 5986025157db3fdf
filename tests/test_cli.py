"""The ``lmforge`` command line: one table of commands, each parser built only when needed."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from lmforge.cli import COMMANDS, build_parser


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_table_entry_adds_the_command_it_names(name):
    assert _commands(build_parser([name, "--help"])) == {"generate", name}


def test_help_and_a_misspelt_command_list_every_command():
    every = {"generate", *COMMANDS}
    assert _commands(build_parser(["--help"])) == every
    assert _commands(build_parser(["mixx"])) == every
    assert _commands(build_parser([])) == every


def test_a_light_command_does_not_import_torch():
    """`lmforge mix ...` must not pay the 2-3 s of torch's import for the other commands."""
    code = ("import sys; from lmforge.cli import build_parser; "
            "build_parser(['mix', 'fit']).parse_args(['mix', 'fit']); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert proc.stdout.strip() == "False"
