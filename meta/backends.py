"""The backends the workers can run on this host, asked of them: the coordinator does not import
the workers (meta/ and workers/ are siblings over transport/), so before it starts workers it
runs `python -m workers --backends` once and reads their answer (about 0.2 s; with CuPy
installed, its import time too). `auto` is the highest-priority backend with a device here.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from split_state.errors import MetaError

ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Backend:
    name: str
    priority: int  # `auto` picks the highest-priority backend with devices
    host_threads: bool  # computes on host cores: CPU workers split the cores (BLAS threads)
    device_count: int  # 0: unusable here
    default_workers: int  # workers to start when the user names none


@functools.cache
def local_backends() -> dict[str, Backend]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-P", "-m", "workers", "--backends"]
    asked = "could not ask the workers which backends this host has"
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MetaError(f"{asked}: {exc}") from None
    try:
        return {b["name"]: Backend(**b) for b in json.loads(out.stdout)}
    except (ValueError, TypeError, KeyError) as exc:
        raise MetaError(f"{asked}: {exc!r} {out.stderr.strip().splitlines()[-1:]}") from None


def resolve(name: str) -> Backend:
    """Backend `name` here (`auto`: the best one with a device), or a MetaError saying why not."""
    known = local_backends()
    if name == "auto":
        usable = [b for b in known.values() if b.device_count > 0]
        return max(usable, key=lambda b: b.priority)
    if name not in known:
        raise MetaError(f"unknown backend {name!r}; choose one of {', '.join(sorted(known))}")
    backend = known[name]
    if backend.device_count == 0:
        raise MetaError(
            f"--backend {name}: no device is visible (is its package installed? pip install -e '.[{name}]')"
        )
    return backend
