"""Workers of one machine compile numba's loops one at a time (workers/backends/cpu/compile_lock.py)."""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.backends.cpu import compile_lock

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent

# a process that holds the lock for argv[2] seconds: one line as it takes it, one as it lets go
HOLDER = """
import sys, time
from pathlib import Path
from workers.backends.cpu import compile_lock
with compile_lock.one_at_a_time(Path(sys.argv[1])) as held:
    print(held, time.time(), flush=True)
    time.sleep(float(sys.argv[2]))
    print(time.time(), flush=True)
"""


def test_processes_that_compile_together_take_turns(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path), "0.6"], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    spans = []
    for proc in procs:
        out, _ = proc.communicate(timeout=30)
        held, start, end = out.split()  # (the two lines' three words)
        assert held == "True"
        spans.append((float(start), float(end)))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, f"two processes held the lock at once: {spans}"


def test_a_lock_held_past_the_deadline_is_waited_for_no_longer(tmp_path):
    fd = os.open(tmp_path / compile_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a compiler that never finishes
    try:
        began = time.monotonic()
        with compile_lock.one_at_a_time(tmp_path, wait_s=0.3) as held:
            waited = time.monotonic() - began
        assert held is False and 0.3 <= waited < 5
    finally:
        os.close(fd)
    with compile_lock.one_at_a_time(tmp_path, wait_s=0.3) as held:  # released with its holder
        assert held is True


def test_the_lock_is_released_when_its_holder_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), "60"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().split()[0] == "True"  # it holds the lock now
        with compile_lock.one_at_a_time(tmp_path, wait_s=0.2) as held:
            assert held is False  # held by the live process
        holder.kill()
        holder.wait(10)
        with compile_lock.one_at_a_time(tmp_path, wait_s=5) as held:
            assert held is True
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()


def test_the_cache_folder_is_numbas(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert compile_lock.cache_folder("/src/pkg/loops.py") == Path("/src/pkg/__pycache__")
    assert compile_lock.cache_folder(None) is None
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert compile_lock.cache_folder("/src/pkg/loops.py") == tmp_path
    assert compile_lock.cache_folder(None) == tmp_path
