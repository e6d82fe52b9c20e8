"""The memory's read speed beside a decode: what a memory-bound decode step streams against.

A decode token reads every weight once, so tokens/s times the bytes a token reads is the speed
at which a decoder streams its weights. On a 2-core VM that speed moves by a quarter from
minute to minute (the host's other tenants share the memory), so a decode rate alone does not
say whether a product is slow or the memory is busy: a plain read of as many bytes, on the same
threads, in the same rounds, does. It is a reference, not a hard ceiling: one thread's NumPy sum
is one stream, and llama.cpp's one-thread q4_k decode has read 19.1 GB/s beside its 16.2.
"""

from __future__ import annotations

import threading
import time

import numpy as np

LEAST_BYTES = 64 << 20  # past any last-level cache of the machines we run on
MOST_BYTES = 1 << 30


def token_bytes(model) -> int:
    """The bytes of a GGUF model's tensors (models.gguf_model.GGUFModel) one decode token reads:
    every tensor once, but of the token embedding only a row where the file has an output head
    of its own (a tied embedding is the head, read whole)."""
    untied = not model.config.tied
    return sum(t.nbytes for name, t in model.tensors.items() if not (untied and name == "token_embd.weight"))


def read_through(part: np.ndarray) -> None:
    """Every byte of `part` read once (a sum: NumPy's pairwise one runs at the memory's speed)."""
    part.sum()


class PlainRead:
    """A buffer of about `nbytes` (LEAST_BYTES to MOST_BYTES), every page touched, and the time
    to read it once on `threads` threads: NumPy sums of equal parts, one a thread (its reductions
    run without the GIL)."""

    def __init__(self, nbytes: int, threads: int):
        size = min(max(nbytes, LEAST_BYTES), MOST_BYTES) // 4
        self.buffer = np.ones(size, np.float32)  # written: untouched pages would all read the zero page
        self.parts = np.array_split(self.buffer, max(1, threads))

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def seconds(self) -> float:
        if len(self.parts) == 1:
            start = time.perf_counter()
            read_through(self.parts[0])
            return time.perf_counter() - start
        workers = [threading.Thread(target=read_through, args=(part,)) for part in self.parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    def gb_per_s(self, seconds: float) -> float:
        return self.nbytes / seconds / 1e9
