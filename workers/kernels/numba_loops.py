"""The numba loops behind workers/kernels/numba_cpu.py, compiled on first import (from the
on-disk cache after the first time on a machine). Imported only when a program that uses them
is loaded, so workers that never run a decoder never pay for numba."""

from __future__ import annotations

import math

import numba
import numpy as np

jit = numba.njit(cache=True, nogil=True)


@jit
def rms_norm_mul_rows(x, weight, eps, out):  # (rows, n), (1 or rows, n)
    rows, n = x.shape
    for r in range(rows):
        acc = 0.0
        for i in range(n):
            v = np.float64(x[r, i])
            acc += v * v
        scale = 1.0 / math.sqrt(acc / n + eps)
        w = weight[r % weight.shape[0]]
        for i in range(n):
            out[r, i] = np.float32(x[r, i] * scale) * w[i]


@jit
def rope_rows(x, cos, sin, neox, out):  # x (tokens, heads, d); cos, sin (tokens, d / 2)
    tokens, heads, d = x.shape
    half = d // 2
    for t in range(tokens):
        for h in range(heads):
            for i in range(half):
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = x[t, h, ia], x[t, h, ib]
                c, s = cos[t, i], sin[t, i]
                out[t, h, ia] = a * c - b * s
                out[t, h, ib] = a * s + b * c


def warm() -> None:
    """Compile (or load from the cache) every loop for the argument types the kernels pass."""
    x = np.ones((2, 4), np.float32)
    rms_norm_mul_rows(x, np.ones((1, 4), np.float32), 1e-5, np.empty_like(x))
    y = np.ones((1, 2, 4), np.float32)
    rope_rows(y, np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32), False, np.empty_like(y))


warm()
