"""The activation rows of a product quantized once into llama.cpp's 8-bit partner types, as its
CPU backend makes them on x86 (ggml-cpu/arch/x86/quants.c, ggml-quants.c's q8_K reference):

- Q8_0 / Q8_1, 32 values: amax = max |x|, d = amax / 127 stored as float16, q = round half to
  even of x * (127 / amax) (0 where amax is 0); Q8_1 also s = float16(d * sum q), d unrounded.
- Q8_K, 256 values: max = the first value of largest |x|, iscale = -127 / max, q = min(127,
  round half to even of iscale * x), d = 1 / iscale (float32), and each 16 values' sum of q.

Every quantity is float32 arithmetic in ggml's order, so these are its bits. numba has no float16:
`round_half` rounds a float32 to the nearest float16 value with integer operations on its bits.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

jit = numba.njit(cache=True, nogil=True)  # no fastmath: the rounding is ggml's, step for step
# twins over the worker's threads (row_threads.py): each row the one-thread loop on that row
row_parallel = numba.njit(cache=True, nogil=True, parallel=True)
inline = numba.njit(cache=True, nogil=True, inline="always")


@intrinsic
def _bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return numba.types.int32(numba.types.float32), codegen


@intrinsic
def _from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return numba.types.float32(numba.types.int32), codegen


HALF_TINY = np.float32(2.0**-14)  # the least normal float16
HALF_ULP_TINY = np.float32(2.0**24)  # subnormal float16s are multiples of 2**-24
HALF_OVERFLOW = np.float32(65520.0)  # from here a float32 rounds to float16 infinity


@inline
def round_half(value):
    """The float16 nearest float32 `value` (ties to even), as float32: IEEE's conversion."""
    magnitude = abs(value)
    if magnitude != magnitude:
        return value
    if magnitude >= HALF_OVERFLOW:
        rounded = np.float32(np.inf)
    elif magnitude < HALF_TINY:  # subnormal: exact scalings by powers of two around a rint
        rounded = np.float32(np.rint(magnitude * HALF_ULP_TINY)) / HALF_ULP_TINY
    else:  # drop 13 of the 23 mantissa bits, rounding half to even
        bits = _bits(magnitude)
        bits = (bits + np.int32(0xFFF) + ((bits >> np.int32(13)) & np.int32(1))) & np.int32(~0x1FFF)
        rounded = _from_bits(np.int32(bits))
    return -rounded if value < 0 else rounded


@jit
def round_halves(values, out):
    """round_half of each value (a test's handle on it)."""
    for i in range(values.shape[0]):
        out[i] = round_half(values[i])


@jit
def quantize_q8_0(x, q, d, sums, s, with_s):
    """x (rows, width) float32 into q (rows, width) int8, d (rows, width / 32) float32 (float16
    values), sums (rows, width / 32) int32 (each block's sum of q) and, `with_s` (Q8_1), s."""
    rows, width = x.shape
    for r in range(rows):
        for b in range(width // 32):
            at = b * 32
            amax = np.float32(0)
            for j in range(32):
                amax = max(amax, abs(x[r, at + j]))
            scale = amax / np.float32(127)
            inverse = np.float32(127) / amax if amax != 0 else np.float32(0)
            total = 0
            for j in range(32):
                value = np.int32(np.rint(x[r, at + j] * inverse))
                q[r, at + j] = value
                total += value
            d[r, b] = round_half(scale)
            sums[r, b] = total
            if with_s:
                s[r, b] = round_half(scale * np.float32(total))


@jit
def quantize_q8_k(x, q, d, sums):
    """x (rows, width) float32 into q (rows, width) int8, d (rows, width / 256) float32 and sums
    (rows, width / 16) int32, each 16 values' sum of q."""
    rows, width = x.shape
    for r in range(rows):
        for b in range(width // 256):
            at = b * 256
            top, amax = np.float32(0), np.float32(0)
            for j in range(256):
                magnitude = abs(x[r, at + j])
                if magnitude > amax:
                    amax, top = magnitude, x[r, at + j]
            if amax == 0:
                d[r, b] = 0
                q[r, at : at + 256] = 0
                sums[r, b * 16 : b * 16 + 16] = 0
                continue
            iscale = np.float32(-127) / top
            for j in range(256):
                q[r, at + j] = min(127, np.int32(np.rint(iscale * x[r, at + j])))
            for k in range(16):
                total = 0
                for j in range(16):
                    total += np.int32(q[r, at + 16 * k + j])
                sums[r, b * 16 + k] = total
            d[r, b] = np.float32(1) / iscale


@row_parallel
def quantize_q8_0_parallel(x, q, d, sums, s, with_s):
    for r in numba.prange(x.shape[0]):
        a = np.int64(r)  # (prange's index may be unsigned)
        b = a + 1
        quantize_q8_0(x[a:b], q[a:b], d[a:b], sums[a:b], s[a:b], with_s)


@row_parallel
def quantize_q8_k_parallel(x, q, d, sums):
    for r in numba.prange(x.shape[0]):
        a = np.int64(r)  # (prange's index may be unsigned)
        b = a + 1
        quantize_q8_k(x[a:b], q[a:b], d[a:b], sums[a:b])
