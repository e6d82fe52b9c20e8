"""Every command line README shows parses: its command exists and takes each flag given (the
examples cannot rot as flags change; a flag placed after `run`'s script, which goes to the
script, shows as the script's own argument)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from cli import parser

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    lines, inside = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        code = line.split("  #")[0].strip()
        if inside and code.startswith("python launch.py "):
            lines.append(code)
    return lines


def test_readme_shows_commands():
    assert len(readme_commands()) >= 8


@pytest.mark.parametrize("line", readme_commands())
def test_every_readme_command_line_parses(line):
    argv = shlex.split(line)[2:]  # past `python launch.py`
    args, unknown = parser().parse_known_args(argv)
    assert unknown == [], f"{line}: unknown {unknown}"
    if args.command == "run":  # the coordinator's options go before the script
        assert not any(a.startswith("-") for a in args.script_args), f"{line}: options after the script"
