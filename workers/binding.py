"""Binding a worker to the cores the coordinator gave it (see meta.launchers.worker_cpus).

This module imports nothing that starts threads: the worker binds itself before BLAS and
ZeroMQ start theirs, since a thread keeps the CPUs of the thread that started it.
"""

from __future__ import annotations

import os

from transport.environment import CPUS_ENV


def bind_from_env() -> None:
    cpus = os.environ.get(CPUS_ENV)
    if cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})


def bound() -> bool:
    """Whether the coordinator gave this worker its own cores (it does only when this host's
    workers fit its cores once)."""
    return bool(os.environ.get(CPUS_ENV))
