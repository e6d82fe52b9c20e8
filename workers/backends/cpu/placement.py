"""Where a tensor a CPU worker keeps starts in memory: its bytes copied to READ_SKEW bytes past a
cache line's start, every time.

The integer products read a weight's byte rows (64 bytes each) in long runs, and how fast they
read them depends on where the weight starts. One-row products of the 1.7B shape's decode step
(every weight once, from DRAM; a Zen 4 class VM with AVX-512 VNNI, 2026-12-04, quiet), GB/s with
the weight's first byte 0 / 16 / 32 / 48 bytes past a cache line's start, one thread: q4_k 12.1 /
16.1 / 12.8 / 16.9, q5_k 15.4 / 17.2 / 15.6 / 17.4, q6_k 16.3 / 18.4 / 17.4 / 18.5, q8_0 18.2 /
21.8 / 17.9 / 20.1, q4_0 20.6 / 19.5 / 20.3 / 19.6, q5_0 24.2 / 22.8 / 24.7 / 22.9; two threads
q4_k 21.4 / 27.1 / 22.9 / 26.2. Starts a multiple of 32 bytes in are the slow ones
for the K-quants and Q8_0 (the weights of Q4_K_M files); the legacy nibble types lose ~5 % off
them. Why is not pinned down: shifting the products' own scratch (32-byte aligned numba arrays)
by 16 bytes changed nothing.

NumPy gives a large array (glibc maps it, workers/store.py) 16 bytes past a page, but a small one
(SmolLM2's 576-wide weights, under a MiB) comes from the heap at any multiple of 16: which case
a weight got differed from process to process. Here every kept tensor gets the fast start.
"""

from __future__ import annotations

import numpy as np

CACHE_LINE = 64
READ_SKEW = 16


def resident_copy(array: np.ndarray) -> np.ndarray:
    """A copy of `array` (C order, its shape and dtype) whose first byte lies READ_SKEW bytes past
    a cache line's start, in memory NumPy owns (the products pack weights in place: packing.py)."""
    buffer = np.empty(array.nbytes + CACHE_LINE, np.uint8)
    start = (READ_SKEW - buffer.ctypes.data) % CACHE_LINE
    copy = buffer[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    np.copyto(copy, array)
    return copy
