"""``ms-memopt --help`` and ``ms-memopt COMMAND --help`` for every registered command.

argparse %-formats help strings, so a bare ``%`` in any help text (``"20% of ..."``) kills
``--help`` with a TypeError. The commands are read from the parser the CLI builds, so a new
command is covered without editing this file.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ms_memopt.cli import _build_parser

REPO = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    parser, _ = _build_parser([])
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subparsers) == 1, "the ms-memopt parser has one set of subcommands"
    return sorted(subparsers[0].choices)


def _help(*argv: str) -> subprocess.CompletedProcess:
    """The real entry point in a fresh interpreter (each command imports only its own module)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="100")
    return subprocess.run([sys.executable, "-m", "ms_memopt", *argv, "--help"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=REPO)


def test_commands_are_discovered():
    commands = _commands()
    assert {"replay", "simulate", "pack"} <= set(commands)


def test_top_level_help():
    proc = _help()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ms-memopt "), proc.stdout
    assert "Traceback" not in proc.stderr
    for command in _commands():
        assert command in proc.stdout


@pytest.mark.parametrize("command", _commands())
def test_command_help(command):
    proc = _help(command)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: ms-memopt {command} "), proc.stdout
    assert "Traceback" not in proc.stderr
