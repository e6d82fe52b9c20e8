"""A built wheel holds every package of the project and runs from another directory (`demo`,
and `generate -n 4` where the model is installed), with the repository nowhere on the path (CI
installs with -e, which never shows a package left out)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1200)
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("split_state", "transport", "workers", "meta", "models", "bench", "cli")


def test_the_wheel_holds_every_package_and_its_demo_runs_from_elsewhere(tmp_path):
    # from a copy of the sources alone: a build/ folder left by an earlier build would lend the
    # wheel what the project's metadata no longer finds
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "results", "tests")
    shutil.copytree(ROOT, source, ignore=skip)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("meta_tp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        str(init.relative_to(ROOT))
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert expected <= names, sorted(expected - names)
    assert "launch.py" in names and not any(n.startswith("tests/") for n in names)
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-P", "-c", "import workers.planes, cli; print(workers.planes.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0 and where.stdout.startswith(str(site)), where.stdout + where.stderr
    # a fresh install has no numba cache of its own: its workers compile the CPU loops first
    # (about two minutes on a quiet 2-core machine, one worker at a time: compile_lock.py)
    demo = subprocess.run(
        [str(site / "bin" / "meta-tp"), "demo", "--workers", "2"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert demo.returncode == 0, demo.stdout[-1500:] + demo.stderr[-1500:]
    pytest.importorskip("gguf")
    generate = subprocess.run(
        [str(site / "bin" / "meta-tp"), "generate", "Hello", "-n", "4", "--workers", "1", "--no-warmup"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert generate.returncode == 0 or "default model is missing" in generate.stderr, generate.stderr[-1500:]
