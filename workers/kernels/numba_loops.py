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


# -- block-quantized matrix times a few rows of x (decode), reading the file's blocks ----------
# x (m, blocks, 32) float32, w (n, blocks, block bytes) uint8, out (m, n); `half` maps a float16's
# 16 bits to its float32 value (a 256 KiB table, cheaper than converting bits in the loop).
# fastmath lets LLVM reorder the sums (within float32 rounding of the BLAS path's); the nibble
# unpacking still does not vectorize: about 0.5 ns per Q4_1 weight, slower than float32 BLAS.

fast = numba.njit(cache=True, nogil=True, fastmath=True)


@fast
def _block_sums(x):
    m, blocks = x.shape[0], x.shape[1]
    sums = np.empty((m, blocks), np.float32)
    for i in range(m):
        for b in range(blocks):
            s = np.float32(0.0)
            for j in range(32):
                s += x[i, b, j]
            sums[i, b] = s
    return sums


@fast
def _half(half, w, r, b, at):
    return half[np.int32(w[r, b, at]) | (np.int32(w[r, b, at + 1]) << 8)]


@fast
def q4_rows(x, w, half, with_min, out):
    """q4_1 (with_min: d * nibble + m) or q4_0 (d * (nibble - 8))."""
    m, blocks = x.shape[0], x.shape[1]
    sums = _block_sums(x)
    start = 4 if with_min else 2
    for r in range(w.shape[0]):
        for i in range(m):
            acc = np.float32(0.0)
            for b in range(blocks):
                s = np.float32(0.0)
                for j in range(16):
                    q = np.int32(w[r, b, start + j])
                    s += np.float32(q & 15) * x[i, b, j] + np.float32(q >> 4) * x[i, b, j + 16]
                d = _half(half, w, r, b, 0)
                offset = _half(half, w, r, b, 2) if with_min else np.float32(-8.0) * d
                acc += d * s + offset * sums[i, b]
            out[i, r] = acc


# q8_0 has its own loop, though its shape repeats q4_rows': one loop with the format as a runtime
# branch per block ran 2.2x slower (1.27 ms against 0.57 ms for a 1536 x 576 Q4_1 matrix)
@fast
def q8_0_rows(x, w, half, out):
    m, blocks = x.shape[0], x.shape[1]
    for r in range(w.shape[0]):
        for i in range(m):
            acc = np.float32(0.0)
            for b in range(blocks):
                s = np.float32(0.0)
                for j in range(32):
                    q = np.int32(w[r, b, 2 + j])
                    s += np.float32(q - 256 if q > 127 else q) * x[i, b, j]
                acc += _half(half, w, r, b, 0) * s
            out[i, r] = acc
