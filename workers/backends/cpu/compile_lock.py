"""One process of a machine compiles numba's loops at a time; the others wait, then load them.

A cold `numba_cpu.prepare()` compiles every loop (113-125 s on one core of the 2-core machine);
workers started together would each compile all of them at once, so N workers on C cores took
about N / C times that before the first program could load (4 workers on 2 cores: over four
minutes). Behind this lock the first compiles into numba's cache and the rest read it (1-3 s).

The lock is an advisory `flock` on a file beside numba's cache: the kernel drops it when its
holder exits or dies, so a killed compiler never blocks the next one. The wait has a deadline
all the same; past it a process compiles alongside rather than wait without end. Where there is
no `fcntl` (Windows) or no writable folder, each process compiles for itself, as numba alone
would.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

WAIT_S = 900.0
LOCK_NAME = "meta-tp-compile.lock"


def cache_folder(module_file: str | None) -> Path | None:
    """Where numba caches the loops of a module: NUMBA_CACHE_DIR (numba then reads and writes
    there alone), else the __pycache__ beside its source (numba's own choice while that is
    writable); None for a module with no source file and no NUMBA_CACHE_DIR."""
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    if chosen:
        return Path(chosen)
    return Path(module_file).parent / "__pycache__" if module_file else None


def _open_lock_file(folder: Path) -> int | None:
    for place in (folder, Path(tempfile.gettempdir())):
        try:
            place.mkdir(parents=True, exist_ok=True)
            return os.open(place / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # read-only install: try the temporary folder
            continue
    return None


@contextlib.contextmanager
def one_at_a_time(folder: Path, wait_s: float = WAIT_S, poll_s: float = 0.05) -> Iterator[bool]:
    """Hold the machine's compile lock for the block; yields whether it is held (False: no
    fcntl, no folder, or `wait_s` passed)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    fd = _open_lock_file(folder)
    if fd is None:
        yield False
        return
    try:
        deadline, held = time.monotonic() + wait_s, False
        while not held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(poll_s)
        yield held
    finally:
        os.close(fd)  # closing the file releases the lock
