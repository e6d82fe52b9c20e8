"""One arena per worker for the intermediates of every loaded program.

A worker runs one program at a time, so all programs share the same memory: the arena is as
large as the largest memory plan among the loaded programs, charged to the store's budget when
a program is loaded (Executor.load raises OutOfMemory then, never during a run), and shrinks when the program that
needed the most is unloaded. A reallocation bumps `generation`: programs bound to the old memory
bind again before their next run.
"""

from __future__ import annotations

from math import prod

import numpy as np

from workers.store import TensorStore

ALIGN = 64  # bytes: every buffer starts on a cache line


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    def __init__(self, xp, store: TensorStore):
        self.xp, self.store = xp, store
        self.memory = xp.empty(0, xp.uint8)
        self.generation = 0

    @property
    def nbytes(self) -> int:
        return int(self.memory.nbytes)

    def resize(self, nbytes: int) -> None:
        """Make the arena exactly `nbytes` (the largest plan loaded). The caller has checked the
        budget (Executor.load, with the program's other buffers)."""
        if nbytes == self.nbytes:
            return
        self.memory = self.xp.empty(0, self.xp.uint8)  # the old memory goes before the new comes
        self.memory = self.xp.empty(nbytes, self.xp.uint8)
        # written once now, at load: a fresh allocation's pages are mapped at their first write,
        # which would otherwise fall in the first run (a warmed-up model's first prompt)
        self.memory.fill(0)
        self.store.arena = nbytes
        self.generation += 1

    def view(self, offset: int, shape: tuple[int, ...], dtype):
        nbytes = prod(shape) * np.dtype(dtype).itemsize
        return self.memory[offset : offset + nbytes].view(dtype).reshape(shape)
