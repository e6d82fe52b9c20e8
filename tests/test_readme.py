"""Every command line README shows parses: its command exists and takes each flag given (the
examples cannot rot as flags change; a flag placed after `run`'s script, which goes to the
script, shows as the script's own argument)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from launch import parser

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


def bench_readme_commands() -> list[tuple[str, list[str]]]:
    """(script, the flags its line shows) for each `python bench/NAME.py ...` line of
    bench/README.md's code blocks."""
    found, inside = [], False
    for line in (ROOT / "bench" / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        code = line.split("  #")[0].strip()
        if inside and code.startswith("python bench/"):
            script = code.split()[1]
            found.append((script, [w.strip("[]") for w in code.split()[2:] if w.lstrip("[").startswith("--")]))
    return found


def test_bench_readme_shows_every_benchmark():
    shown = {script for script, _ in bench_readme_commands()}
    scripts = {f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py") if p.name not in ("__init__.py", "report.py")}
    helpers = {"bench/suite.py", "bench/operands.py", "bench/stress.py", "bench/commands.py", "bench/read_speed.py"}
    assert scripts - helpers <= shown


@pytest.mark.parametrize("script, flags", bench_readme_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_bench_readme_command_line_takes_its_flags(script, flags):
    """Each flag bench/README.md shows is one the script's --help lists (read as text: a
    benchmark's --help imports only its own module)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    listed = {w.strip(",[]") for w in done.stdout.split() if w.startswith(("--", "[--"))}
    assert set(flags) <= listed, f"{script}: {sorted(set(flags) - listed)} not among {sorted(listed)}"
