"""Shared benchmark output: an aligned table on stdout and a JSON file."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from cli.display import table  # noqa: F401 - the one table printer, which the benchmarks print with
from transport.environment import BLAS_THREAD_VARS


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_json(path: str | Path | None, name: str, results: Any) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), "results": results}, indent=2))
    print(f"wrote {path}")


def reap(procs, seconds: float) -> None:
    """Wait up to `seconds` for each process to exit (the coordinator told it to go), then kill
    what is left: a bench leaves no worker running."""
    for proc in procs:
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def free_port() -> int:
    """A TCP port of the loopback free now (a server or a cluster binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} GiB"


def cli(doc: str, name: str, run, show, argv: list[str] | None = None, extra=None) -> int:
    """The common benchmark command line: --quick, --json PATH, plus `extra(parser)` options;
    `run(args)` measures, `show(results)` prints the table."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    results = run(args)
    show(results)
    write_json(args.json, name, results)
    return 0


@contextlib.contextmanager
def _blas_threads(threads: int):
    """The environment a spawned process reads its BLAS thread count from at start (the only
    reliable way to fix it), set while it starts."""
    saved = {v: os.environ.get(v) for v in BLAS_THREAD_VARS}
    os.environ.update({v: str(threads) for v in BLAS_THREAD_VARS})
    try:
        yield
    finally:
        for v, value in saved.items():
            if value is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = value


def in_process_with_threads(target, args: tuple, threads: int, timeout: float = 1800):
    """Run `target(*args, queue)` in a spawned process whose BLAS uses `threads` threads; return
    what it put on the queue."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with _blas_threads(threads):
        proc = ctx.Process(target=target, args=(*args, out), name=target.__name__)
        proc.start()
    try:
        result = _reply(out, proc, timeout)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return result


class ChildFailed(RuntimeError):
    """A benchmark's child process died, or outlived its deadline, before it answered."""


def _reply(replies, proc, timeout: float):
    """The next reply of child `proc`, or ChildFailed as soon as it is dead (a crash in a library
    it runs, SIGILL from a build for another CPU, kills it without a word) or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return replies.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            if not proc.is_alive() and replies.empty():
                code = proc.exitcode
                how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"status {code}"
                raise ChildFailed(f"child {proc.name} died with {how} before it answered") from None
            if time.monotonic() >= deadline:
                raise ChildFailed(f"child {proc.name} did not answer within {timeout:.0f} s") from None


# OpenBLAS's threads (and llama.cpp's) spin after a parallel call, 2**28 cycles by default
# (OPENBLAS_THREAD_TIMEOUT): about 0.1 s here. Measured on 2 cores: a 2-worker prefill timed right
# after the 2-thread reference's took 260 ms, 231 ms after a 0.3 s pause, its workers waiting on
# each other at the all-reduces of the first layers while a spinning thread held a core. A
# comparison gives that time back before the next side runs (ours spin 50 us, then sleep).
SETTLE_S = 0.3


def paired_ratio(reference_s: list[float], ours_s: list[float]) -> float | None:
    """The median of reference / ours over pairs timed one right after the other (None without a
    reference): a busy neighbour slows a pair alike, where it may slow one side's median alone."""
    return float(statistics.median([r / s for r, s in zip(reference_s, ours_s)])) if reference_s else None


class ThreadedChild:
    """A spawned process whose BLAS uses `threads` threads, kept up to answer requests:
    `target(*args, requests, replies)` answers each request until it reads None. A benchmark
    alternates with it round by round, so a busy neighbour slows both sides alike."""

    def __init__(self, target, args: tuple, threads: int, timeout: float = 1800, settle: float = SETTLE_S):
        ctx = mp.get_context("spawn")
        self.requests, self.replies, self.timeout, self.settle = ctx.Queue(), ctx.Queue(), timeout, settle
        with _blas_threads(threads):
            self.proc = ctx.Process(target=target, args=(*args, self.requests, self.replies), name=target.__name__)
            self.proc.start()

    def ask(self, *request):
        """The child's answer, once its threads have settled (`settle` seconds after it)."""
        self.requests.put(request)
        reply = _reply(self.replies, self.proc, self.timeout)
        time.sleep(self.settle)
        return reply

    def close(self) -> None:
        self.requests.put(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def __enter__(self) -> ThreadedChild:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
