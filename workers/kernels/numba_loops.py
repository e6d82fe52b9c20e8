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


# -- block-quantized matrix times a few rows of x (decode), reading the workers' blocks ----------
# x (m, blocks, 32) float32; w (n, block bytes, blocks) uint8, the planar layout of
# split_state/quant.py: byte p of every block of a row lies contiguous, so the innermost loops run
# over blocks and LLVM vectorizes them (one vector load widens 16 or 64 quants at once); out
# (m, n). `half` maps a float16's 16 bits to its float32 value (a 256 KiB table, cheaper than
# converting bits in the loop). GROUP rows of w go through together: each x value loaded serves
# all of them. Measured on SmolLM2's 30 Q4_1 layers streamed from memory (one AVX-512 core, one
# token): 27 ms against 69 ms for the block-by-block loop this replaces, which did not vectorize. fastmath lets LLVM
# reorder the sums (within float32 rounding of the BLAS path's). The activations stay float32:
# quantizing them to int8 (llama.cpp's Q8 activations) was ~10 % faster here but moves the
# logits by ~0.5 %, and the native path must give the float32 path's tokens.

fast = numba.njit(cache=True, nogil=True, fastmath=True)
GROUP = 4


@fast
def _planar_x(x):
    """x (m, blocks, 32) -> (m, 32, blocks) and each block's sum (m, blocks)."""
    m, blocks = x.shape[0], x.shape[1]
    xt = np.empty((m, 32, blocks), np.float32)
    sums = np.zeros((m, blocks), np.float32)
    for i in range(m):
        for b in range(blocks):
            for j in range(32):
                xt[i, j, b] = x[i, b, j]
                sums[i, b] += x[i, b, j]
    return xt, sums


@fast
def _scale(half, w, r, at, b):
    return half[np.int32(w[r, at, b]) | (np.int32(w[r, at + 1, b]) << 8)]


@fast
def q4_rows(x, w, half, with_min, out):
    """q4_1 (with_min: d * nibble + m) or q4_0 (d * (nibble - 8)); nibble j of a block: the low
    half of quant byte j is value j, the high half value j + 16."""
    m, blocks, n = x.shape[0], x.shape[1], w.shape[0]
    xt, sums = _planar_x(x)
    q0 = 4 if with_min else 2
    acc = np.empty((GROUP, blocks), np.float32)
    for r0 in range(0, n, GROUP):
        g = min(GROUP, n - r0)
        for i in range(m):
            acc[:] = 0
            if g == GROUP:
                for j in range(16):
                    for b in range(blocks):
                        lo, hi = xt[i, j, b], xt[i, j + 16, b]
                        a, c, e, f = w[r0, q0 + j, b], w[r0 + 1, q0 + j, b], w[r0 + 2, q0 + j, b], w[r0 + 3, q0 + j, b]
                        acc[0, b] += np.float32(a & 15) * lo + np.float32(a >> 4) * hi
                        acc[1, b] += np.float32(c & 15) * lo + np.float32(c >> 4) * hi
                        acc[2, b] += np.float32(e & 15) * lo + np.float32(e >> 4) * hi
                        acc[3, b] += np.float32(f & 15) * lo + np.float32(f >> 4) * hi
            else:
                for k in range(g):
                    for j in range(16):
                        for b in range(blocks):
                            q = w[r0 + k, q0 + j, b]
                            acc[k, b] += np.float32(q & 15) * xt[i, j, b] + np.float32(q >> 4) * xt[i, j + 16, b]
            for k in range(g):
                total = np.float32(0.0)
                for b in range(blocks):
                    d = _scale(half, w, r0 + k, 0, b)
                    offset = _scale(half, w, r0 + k, 2, b) if with_min else np.float32(-8.0) * d
                    total += d * acc[k, b] + offset * sums[i, b]
                out[i, r0 + k] = total


# q8_0 has its own loop, though its shape repeats q4_rows': one loop with the format as a runtime
# branch per block ran 2.2x slower. `signed`: w viewed as int8, for the quants.
@fast
def q8_0_rows(x, w, signed, half, out):
    m, blocks, n = x.shape[0], x.shape[1], w.shape[0]
    xt, _ = _planar_x(x)
    acc = np.empty((GROUP, blocks), np.float32)
    for r0 in range(0, n, GROUP):
        g = min(GROUP, n - r0)
        for i in range(m):
            acc[:] = 0
            if g == GROUP:
                for j in range(32):
                    for b in range(blocks):
                        v = xt[i, j, b]
                        acc[0, b] += np.float32(signed[r0, 2 + j, b]) * v
                        acc[1, b] += np.float32(signed[r0 + 1, 2 + j, b]) * v
                        acc[2, b] += np.float32(signed[r0 + 2, 2 + j, b]) * v
                        acc[3, b] += np.float32(signed[r0 + 3, 2 + j, b]) * v
            else:
                for k in range(g):
                    for j in range(32):
                        for b in range(blocks):
                            acc[k, b] += np.float32(signed[r0 + k, 2 + j, b]) * xt[i, j, b]
            for k in range(g):
                total = np.float32(0.0)
                for b in range(blocks):
                    total += _scale(half, w, r0 + k, 0, b) * acc[k, b]
                out[i, r0 + k] = total


# -- dequantizing tiles for prefill's BLAS products ---------------------------------------------
@fast
def dequantize_rows(w, start, half, kind, out):
    """Rows [start, start + len(out)) of planar w as float32 values in (value j, block b) order:
    out[r, j * blocks + b] is value j of block b (x is permuted to match, see numba_cpu.qmatmul).
    kind: 0 q4_0, 1 q4_1, 2 q8_0. The inner loops run over contiguous blocks."""
    blocks = w.shape[2]
    signed = w.view(np.int8)
    scale = np.empty(blocks, np.float32)
    offset = np.zeros(blocks, np.float32)
    q0 = 4 if kind == 1 else 2
    for r in range(out.shape[0]):
        row = start + r
        for b in range(blocks):
            scale[b] = _scale(half, w, row, 0, b)
            if kind == 1:
                offset[b] = _scale(half, w, row, 2, b)
            elif kind == 0:
                offset[b] = np.float32(-8.0) * scale[b]
        if kind == 2:
            for j in range(32):
                for b in range(blocks):
                    out[r, j * blocks + b] = scale[b] * np.float32(signed[row, 2 + j, b])
        else:
            for j in range(16):
                for b in range(blocks):
                    q = w[row, q0 + j, b]
                    out[r, j * blocks + b] = scale[b] * np.float32(q & 15) + offset[b]
                    out[r, (j + 16) * blocks + b] = scale[b] * np.float32(q >> 4) + offset[b]
