"""Binding a worker to the cores the coordinator gave it (see meta.launchers.worker_cpus), and
how its thread pools wait when they are done (`quiet_pools`).

This module imports nothing that starts threads: the worker binds itself before BLAS and
ZeroMQ start theirs, since a thread keeps the CPUs of the thread that started it.
"""

from __future__ import annotations

import os

from transport.environment import CPUS_ENV, INTEGER_DECODE_ENV, INTEGER_DECODE_SPIN, POOL_SPIN, POOL_SPIN_ENV

# A worker's two thread pools take turns within a step: BLAS's (OpenBLAS's own threads: float32
# weights' products, prefill's tiles) and numba's OpenMP pool (the quantized decode products,
# attention). Each spins on its cores after its work, waiting for more: OpenBLAS's threads 2**28
# cycles (a whole core for ~0.1 s after each call, measured), libgomp's 300,000 turns (~1 ms).
# The other pool's threads then wait for the scheduler: float32 decode on 1 worker with 2 threads
# took 263 ms a SmolLM2 token instead of ~30, and a 1.7B-shaped prefill ran at 18 tok/s on 2
# threads against 28 on 1 and 38 with these bounds. OpenBLAS's threads go to sleep at once
# (2**4 cycles, its least); numba's spin 3,000 turns, which keep them awake over the
# microseconds between a decode step's loops (the native decode: 128-129 tok/s against 126-130
# spinning the default, 66 not spinning at all). Each library reads its variable when it loads
# (NumPy's import; numba's first loop): set before both. A user's own value stands.
# (transport/environment.py's POOL_SPIN; a worker of two or more threads whose decode runs no
# BLAS spins longer: INTEGER_DECODE_SPIN, where the coordinator says so.)
QUIET_POOLS = {"OPENBLAS_THREAD_TIMEOUT": "4", POOL_SPIN_ENV: POOL_SPIN}


def quiet_pools() -> None:
    pools = dict(QUIET_POOLS)
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # its threads (transport.environment.BLAS_THREAD_VARS)
    if os.environ.get(INTEGER_DECODE_ENV) == "1" and threads.isdigit() and int(threads) > 1:
        pools[POOL_SPIN_ENV] = INTEGER_DECODE_SPIN
    for name, value in pools.items():
        os.environ.setdefault(name, value)


def bind_from_env() -> None:
    cpus = os.environ.get(CPUS_ENV)
    if cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})


def bound() -> bool:
    """Whether the coordinator gave this worker its own cores (it does only when this host's
    workers fit its cores once)."""
    return bool(os.environ.get(CPUS_ENV))
