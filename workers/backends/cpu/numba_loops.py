"""The numba loops behind workers/backends/cpu/numba_cpu.py, compiled on first import (from the
on-disk cache after the first time on a machine). Imported only when a program that uses them
is loaded, so workers that never run a decoder never pay for numba."""

from __future__ import annotations

import math
import platform

import numba
import numpy as np
from llvmlite import binding, ir
from numba.extending import intrinsic

from workers.backends.cpu import vector_ir

jit = numba.njit(cache=True, nogil=True)
# the row-wise loops' twins over the worker's threads (row_threads.py): each row the one-thread
# loop itself on that row, so a row's bits are the same either way
row_parallel = numba.njit(cache=True, nogil=True, parallel=True)


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


@row_parallel
def rms_norm_mul_rows_parallel(x, weight, eps, out):
    for r in numba.prange(x.shape[0]):
        a = np.int64(r)  # (prange's index may be unsigned)
        b = a + 1
        rms_norm_mul_rows(x[a:b], weight if weight.shape[0] == 1 else weight[a:b], eps, out[a:b])


@jit
def rope_rows(x, cos, sin, neox, out):  # x (tokens, heads, d), its tokens any stride; cos, sin (tokens, d / 2)
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


@row_parallel
def rope_rows_parallel(x, cos, sin, neox, out):
    for r in numba.prange(x.shape[0]):
        a = np.int64(r)  # (prange's index may be unsigned)
        b = a + 1
        rope_rows(x[a:b], cos[a:b], sin[a:b], neox, out[a:b])


@jit
def write_rows(cache, ids, x, cos, sin, rotate, neox):
    """A decode step's KV-cache write: cache[j, h, ids[j, t]] = x[j, t, h] for cache (batch, heads,
    ctx, d) float32, or float16 bits (uint16: rounded to nearest even, as NumPy's astype; only
    where NATIVE_HALVES), and x (rows, tokens, heads, d), rotated on the way as rope_rows rotates
    (the same arithmetic, so the same bits) when `rotate`, by cos, sin (rows * tokens, d / 2).
    False, with nothing written, when an id lies outside [0, ctx)."""
    rows, tokens, heads, d = x.shape
    ctx = cache.shape[2]
    for j in range(rows):
        for t in range(tokens):
            if ids[j, t] < 0 or ids[j, t] >= ctx:
                return False
    half = d // 2
    for j in range(rows):
        for t in range(tokens):
            pos, r = ids[j, t], j * tokens + t
            for h in range(heads):
                if rotate:
                    for i in range(half):
                        ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                        a, b = x[j, t, h, ia], x[j, t, h, ib]
                        c, s = cos[r, i], sin[r, i]
                        cache[j, h, pos, ia] = _as_cached(a * c - b * s, cache)
                        cache[j, h, pos, ib] = _as_cached(a * s + b * c, cache)
                else:
                    for i in range(d):
                        cache[j, h, pos, i] = _as_cached(x[j, t, h, i], cache)
    return True


def _as_cached(value, cache):
    """float32 `value` as `cache` holds it: itself, or float16 bits (_narrow_half)."""


@numba.extending.overload(_as_cached, inline="always")
def _as_cached_typed(value, cache):
    if cache.dtype == numba.types.float32:
        return lambda value, cache: value
    return lambda value, cache: np.uint16(_narrow_half(np.float32(value)))


# -- the candidates of a decode step: each row's best k logits, without NumPy's dozen calls ----
# (no fastmath: NaN must compare as NaN). The top_k ops' order: value descending, then index
# ascending, index -1 (padding) after every real index; NaN ranks as -inf. One pass keeps the
# best k seen in a heap whose root is the worst of them, so an entry that cannot make the top k
# (nearly all of a vocabulary) costs one comparison: a sampled step's 256 of SmolLM2's 49,152
# logits took the shared kernel's partition, where, flatnonzero and lexsort 1.4 ms.


@jit
def _better(va, ia, vb, ib):
    """Whether (va, ia) comes before (vb, ib) in the top_k order (NaN made -inf already)."""
    if va != vb:
        return va > vb
    if ia < 0:  # padding: after every real index of its value
        return False
    return ib < 0 or ia < ib


@jit
def _sift_down(values, indices, at, n):
    """The heap of the first n entries made whole below `at`: no entry comes before its children,
    so the root is the worst."""
    while True:
        worst, left = at, 2 * at + 1
        for child in range(left, min(left + 2, n)):
            if _better(values[worst], indices[worst], values[child], indices[child]):
                worst = child
        if worst == at:
            return
        values[at], values[worst] = values[worst], values[at]
        indices[at], indices[worst] = indices[worst], indices[at]
        at = worst


@jit
def _write_best_first(values, indices, out):
    """out[:k] = the heap's k entries best first (heapsort: the worst goes to the end each time),
    out[k:] padding (-inf, -1)."""
    k = values.shape[0]
    for end in range(k - 1, 0, -1):
        values[0], values[end] = values[end], values[0]
        indices[0], indices[end] = indices[end], indices[0]
        _sift_down(values, indices, 0, end)
    for j in range(k):
        out[j, 0], out[j, 1] = values[j], indices[j]
    for j in range(k, out.shape[0]):
        out[j, 0], out[j, 1] = -np.inf, -1.0


# float32 bits as int64 keys whose order is the values' (_order_key): -inf's key, NaN's too
_NEG_INF_KEY = np.int64(np.array(-np.inf, np.float32).view(np.int32)) ^ 0x7FFFFFFF
_SPAN = 256  # values a chunk of best_one's search for the key: one vectorized test a chunk


@jit
def _order_key(bits):
    """An int64 key of float32 `bits` (an int32) ordered as the values, NaN as -inf, -0 as +0:
    the sign-magnitude bits of a negative value flipped below the non-negative ones. Integer
    max and equality vectorize where a float max that must pass NaN over does not."""
    b = np.int64(bits)
    magnitude = b & 0x7FFFFFFF
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    if magnitude > 0x7F800000:  # NaN
        key = _NEG_INF_KEY
    if magnitude == 0:
        key = 0
    return key


@jit
def _best_one(row, local, length):
    """The first j < length of the greatest row[local + j] (NaN as -inf, -0 as +0: what
    best_of_rows's heap of one keeps: a later equal value never displaces it), and its value
    (-inf where every value is NaN or -inf). One pass of integer keys, a max a chunk, then the
    first chunk holding the greatest searched: greedy decoding's k = 1 over 49,152 logits took
    30 us as the heap's one compare a value, in order, 8.7 so. (Each loop runs over its own
    array's length: indices numba cannot prove non-negative keep LLVM from vectorizing.)"""
    bits = row[local : local + length].view(np.int32)
    chunks = -(-length // _SPAN)
    tops = np.empty(chunks, np.int64)
    for c in range(chunks):
        part = bits[c * _SPAN : (c + 1) * _SPAN]
        top = _NEG_INF_KEY
        for j in range(part.shape[0]):
            top = max(top, _order_key(part[j]))
        tops[c] = top
    best = _NEG_INF_KEY
    for c in range(chunks):
        best = max(best, tops[c])
    if best == _NEG_INF_KEY:  # every value NaN or -inf: the first
        return 0, -np.inf
    for c in range(chunks):
        if tops[c] == best:
            part = bits[c * _SPAN : (c + 1) * _SPAN]
            for j in range(part.shape[0]):
                if _order_key(part[j]) == best:
                    return c * _SPAN + j, np.float64(row[local + c * _SPAN + j])
    return 0, -np.inf  # (not reached: some value holds the max)


@jit
def best_of_rows(x, local, length, start, k, out):
    """out[r] (width, 2) = the best k (1 <= k <= length, k <= width) of x[r, local : local +
    length] as (value, start + j), best first, padded to the width with (-inf, -1); x C-contiguous
    float32."""
    values, indices = np.empty(k), np.empty(k, np.int64)
    for r in range(x.shape[0]):
        if k == 1:  # greedy decoding
            j, values[0] = _best_one(x[r], local, length)
            indices[0] = start + j
            _write_best_first(values, indices, out[r])
            continue
        for j in range(k):
            v = np.float64(x[r, local + j])
            values[j], indices[j] = (-np.inf if v != v else v), start + j
        for at in range(k // 2 - 1, -1, -1):
            _sift_down(values, indices, at, k)
        for j in range(k, length):
            v = np.float64(x[r, local + j])
            # NaN is never greater; an equal value comes after the root, whose index is lower
            if v > values[0]:
                values[0], indices[0] = v, start + j
                _sift_down(values, indices, 0, k)
        _write_best_first(values, indices, out[r])


@jit
def last_open_column(mask):
    """One past the last column of mask (rows, ctx) that is not -inf in some row (NaN is open),
    0 where none is: from the end, so a decode step's mask stops at its position."""
    rows, ctx = mask.shape
    for j in range(ctx - 1, -1, -1):
        for r in range(rows):
            if mask[r, j] != -np.inf:
                return j + 1
    return 0


@jit
def best_of_pairs(pairs, k, out):
    """out[r] (k, 2) = the best k (1 <= k <= entries) of pairs[r] (entries, 2) float64 (value,
    index), best first."""
    values, indices = np.empty(k), np.empty(k, np.int64)
    for r in range(pairs.shape[0]):
        for j in range(k):
            v = pairs[r, j, 0]
            values[j], indices[j] = (-np.inf if v != v else v), np.int64(pairs[r, j, 1])
        for at in range(k // 2 - 1, -1, -1):
            _sift_down(values, indices, at, k)
        for j in range(k, pairs.shape[1]):
            v, i = pairs[r, j, 0], np.int64(pairs[r, j, 1])
            v = -np.inf if v != v else v
            if _better(v, i, values[0], indices[0]):
                values[0], indices[0] = v, i
                _sift_down(values, indices, 0, k)
        _write_best_first(values, indices, out[r])


def warm() -> None:
    """Compile (or load from the cache) every loop for the argument types the kernels pass."""
    x = np.ones((2, 4), np.float32)
    for norm in (rms_norm_mul_rows, rms_norm_mul_rows_parallel):
        norm(x, np.ones((1, 4), np.float32), 1e-5, np.empty_like(x))
    rms_norm_mul_rows_parallel(x, x, 1e-5, np.empty_like(x))  # (a weight a row)
    fused = np.ones((1, 3, 2, 4), np.float32)  # a prefill's q | k | v: each a view of its tokens' rows
    y, strided = fused[0, :1], fused[0, :, :1]
    cos, sin = np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32)
    for rows in (y, strided):
        for rope in (rope_rows, rope_rows_parallel):
            rope(rows, cos[: len(rows)], sin[: len(rows)], False, np.empty(rows.shape, np.float32))
    cache = np.zeros((1, 2, 3, 4), np.float32)
    for kind in (np.int32, np.int64):  # fed positions; the workers' own
        for rows in (y.reshape(1, 1, 2, 4), fused[:, :, :1]):  # (the loop reads an id a token: as many)
            write_rows(cache, np.zeros(rows.shape[:2], kind), rows, cos, sin, True, False)
    best = np.zeros((2, 2, 2))
    best_of_rows(x, 1, 2, 0, 2, best)
    last_open_column(x)
    best_of_pairs(best, 1, np.empty((2, 1, 2)))


warm()


# -- block-quantized matrix times a few rows of x (decode), reading the workers' blocks ----------
# x (m, width) float32; w (groups, blocks, block bytes, lanes) uint8, the interleaved layout of
# split_state/quant.py; out (m, groups * lanes). The innermost loops run over a group's lanes
# (rows): one byte of each of `lanes` rows lies contiguous, each value of x serves all of them,
# and the accumulators are independent, so LLVM vectorizes them with no remainder. A group's bytes
# (a few KiB) stay in cache while every row of x passes over them. The blocks' float16 factors
# are widened by the CPU (`_lane_scales`); `half`, a table from a float16's 16 bits to its
# float32 value, serves CPUs that cannot (numba has no float16). fastmath lets LLVM reorder
# the sums (within float32 rounding of the BLAS path's). The activations stay float32: these
# are the exact products (`activations="f32"`); llama.cpp's 8-bit activations and integer
# products are int8_products.py's.
#
# Nibbles without integer ops: numba widens uint8 arithmetic to 64-bit lanes (a quarter of the
# vector), so a byte q is converted to float once and its halves come from floor(q / 16):
# lo * x_lo + hi * x_hi = q * x_lo + floor(q / 16) * (x_hi - 16 * x_lo), exact in the quants.

fast = numba.njit(cache=True, nogil=True, fastmath=True)
# the decode products: their row groups split over the worker's threads (numba.set_num_threads,
# from workers/backends/cpu/numba_cpu.set_threads), each group's loop as before on its own scratch
parallel = numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
inline = numba.njit(cache=True, nogil=True, fastmath=True, inline="always")  # helpers of the hot loops: as
# separate functions they cost the Q4_1 layers 13 % (measured)
SIXTEENTH = np.float32(0.0625)
SIXTY_FOURTH = np.float32(1 / 64)
SIXTEEN, SIXTY_FOUR = np.float32(16), np.float32(64)


def _converts_halves() -> bool:
    """Whether this CPU widens float16 to float32 in one instruction: F16C on x86-64 (every
    x86-64 CPU since 2012), always on 64-bit Arm. Elsewhere LLVM would call a runtime helper
    that numba's JIT may not link, so the loops look the value up in `half` instead."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    return machine in ("x86_64", "amd64") and bool(binding.get_host_cpu_features().get("f16c"))


NATIVE_HALVES = _converts_halves()


@intrinsic
def _widen_half(typingctx, bits):
    """The float16 whose bits are the low 16 of int32 `bits`, as float32: LLVM's fpext, which
    vectorises to one vcvtph2ps per 16 lanes. numba has no float16 type on the CPU."""

    def codegen(context, builder, signature, args):
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return numba.types.float32(numba.types.int32), codegen


@intrinsic
def _narrow_half(typingctx, value):
    """float32 `value` as float16 bits in an int32: LLVM's fptrunc (round to nearest even, as
    NumPy's astype(float16) and ggml's FP32_TO_FP16), one vcvtps2ph where the CPU has F16C
    (NATIVE_HALVES; elsewhere the caller does not use it)."""

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.zext(builder.bitcast(half, ir.IntType(16)), ir.IntType(32))

    return numba.types.int32(numba.types.float32), codegen


@jit
def narrow_halves(x, out):
    """out = float32 x (4-D, any strides) as float16 bits (uint16, x's shape; _narrow_half's
    rounding, NumPy's astype's). Only where NATIVE_HALVES."""
    a, b, c, d = x.shape
    for i in range(a):
        for j in range(b):
            for k in range(c):
                for m in range(d):
                    out[i, j, k, m] = np.uint16(_narrow_half(x[i, j, k, m]))


@intrinsic
def _quant_bits(typingctx, low_byte, low_shift, top_byte, top_shift, top_mask):
    """((low_byte >> low_shift) & 15) | (((top_byte >> top_shift) & top_mask) << 4) as float32: a
    Q6_K quant from its low four bits and top two (top_mask 3), a Q5 / Q5_K one from its nibble
    and fifth bit (1), a nibble alone (0), in 8-bit integer operations, which vectorise 64 lanes
    to a register. numba's own integer operations widen to 64 bits, and the same in float32
    (halvings and floors) took 1.33x as long (a 2,048 x 8,192 Q6_K product on one thread: 1,915
    against 1,440 us); a 2 MiB Q5_0 tile 199 against 88 us. (Q4's decode loops keep their float32
    nibbles, whose low half folds into the next value's x: as quick.)"""

    def codegen(context, builder, signature, args):
        byte = ir.IntType(8)
        low_byte, low_shift, top_byte, top_shift, top_mask = args
        low = builder.and_(builder.lshr(low_byte, builder.trunc(low_shift, byte)), ir.Constant(byte, 15))
        top = builder.lshr(top_byte, builder.trunc(top_shift, byte))
        top = builder.and_(top, builder.trunc(top_mask, byte))
        return builder.uitofp(builder.or_(low, builder.shl(top, ir.Constant(byte, 4))), ir.FloatType())

    uint8, count = numba.types.uint8, numba.types.int64
    return numba.types.float32(uint8, count, uint8, count, count), codegen


@inline
def _lane_scales(half, w, g, b, at, out):
    """out[lane] = the float16 at bytes at, at + 1 of block b of each lane. Converted in the
    vector unit: the lookup in `half` (the fallback) is a gather from a 256 KiB table, and those
    gathers took over half of a Q4_1 product's time (11.6 against 5.2 ms for SmolLM2's 30 layers
    on one Zen 4 core, the same bits)."""
    for lane in range(out.shape[0]):
        bits = np.int32(w[g, b, at, lane]) | (np.int32(w[g, b, at + 1, lane]) << 8)
        out[lane] = _widen_half(bits) if NATIVE_HALVES else half[bits]


@parallel
def nibble_lanes(x, w, half, with_min, fifth, out):
    """q4_1 (with_min: d * nibble + m), q4_0 (d * (nibble - 8)) and, with a `fifth` bit per value
    (q = nibble + 16 * bit j of the 32-bit word after the factors for value j), q5_1 (d * q + m)
    and q5_0 (d * (q - 16)). Nibble j of a block: the low half of quant byte j is value j, the
    high half value j + 16."""
    m, groups, blocks, lanes, word, first, unsigned = _nibble_layout(x, w, with_min, fifth)
    sums = _sub_block_sums(x, blocks, 32, 32)  # for m and the subtraction
    for g in numba.prange(groups):  # row groups over the worker's threads
        acc = np.empty(lanes, np.float32)
        part = np.empty(lanes, np.float32)
        steps = np.empty(8, np.float32)  # _add_fifth_bits' weights
        d = np.empty(lanes, np.float32)
        offset = np.empty(lanes, np.float32)
        for i in range(m):
            acc[:] = 0
            for b in range(blocks):
                _nibble_sums(x, w, g, b, i, first, part)
                if fifth:
                    _add_fifth_bits(x, w, g, b, i, word, steps, part)
                _nibble_factors(half, w, g, b, with_min, unsigned, d, offset)
                _accumulate(acc, d, part, offset, sums[i, b, 0])
            out[i, g * lanes : (g + 1) * lanes] = acc


@parallel
def nibble_lane_pairs(x, w, half, with_min, fifth, out):
    """nibble_lanes for an even number of rows of x, two at a time (a batch's decode step): each
    quant byte widened once for both rows, which is half a row's work, and every row's sums as
    nibble_lanes makes them (the same bits)."""
    m, groups, blocks, lanes, word, first, unsigned = _nibble_layout(x, w, with_min, fifth)
    sums = _sub_block_sums(x, blocks, 32, 32)
    for g in numba.prange(groups):
        acc = np.empty(lanes, np.float32)
        part = np.empty(lanes, np.float32)
        next_acc = np.empty(lanes, np.float32)  # the pair's second row
        next_part = np.empty(lanes, np.float32)
        steps = np.empty((2, 8), np.float32)
        d = np.empty(lanes, np.float32)
        offset = np.empty(lanes, np.float32)
        for i in range(0, m, 2):
            acc[:] = 0
            next_acc[:] = 0
            for b in range(blocks):
                _nibble_sums_pair(x, w, g, b, i, first, part, next_part)
                if fifth:
                    _add_fifth_bits_pair(x, w, g, b, i, word, steps, part, next_part)
                _nibble_factors(half, w, g, b, with_min, unsigned, d, offset)
                _accumulate(acc, d, part, offset, sums[i, b, 0])
                _accumulate(next_acc, d, next_part, offset, sums[i + 1, b, 0])
            out[i, g * lanes : (g + 1) * lanes] = acc
            out[i + 1, g * lanes : (g + 1) * lanes] = next_acc


@inline
def _nibble_layout(x, w, with_min, fifth):
    """(rows of x, groups, blocks, lanes, the byte where the fifth bits' word begins, the first
    quant byte, what q_0 formats subtract)."""
    word = 4 if with_min else 2
    first = word + 4 if fifth else word
    unsigned = np.float32(16.0 if fifth else 8.0)
    return x.shape[0], w.shape[0], w.shape[1], w.shape[3], word, first, unsigned


@inline
def _add_fifth_bits(x, w, g, b, i, word, steps, part):
    """part[lane] += 16 * the sum of bit j * x_j over block b's 32 values (of row i), bit j of
    the little-endian word at byte `word`, a byte B at a time (byte k: values 8k to 8k + 7).
    With F_n = floor(B / 2^n), bit n = F_n - 2 F_(n+1), so the byte's sum telescopes to
    F_0 x_0 + the sum over n >= 1 of F_n (x_n - 2 x_(n-1)): a halving and a product a bit, in
    float32 (exact on bytes; numba's integer shifts widen to 64-bit lanes). Extracting each bit
    (rest - 2 floor(rest / 2)) took 4 operations a bit, and a Q5_0 product 1.6x as long."""
    for k in range(4):
        _fifth_bit_steps(x, b, i, k, steps)
        byte = w[g, b, word + k]
        for lane in range(part.shape[0]):
            f = np.float32(byte[lane])
            total = f * steps[0]
            for n in range(1, 8):
                f = np.floor(f * np.float32(0.5))
                total += f * steps[n]
            part[lane] += total


@inline
def _add_fifth_bits_pair(x, w, g, b, i, word, steps, part, next_part):
    """_add_fifth_bits for rows i and i + 1 at once (the same arithmetic a row): each F_n made
    once for both."""
    for k in range(4):
        _fifth_bit_steps(x, b, i, k, steps[0])
        _fifth_bit_steps(x, b, i + 1, k, steps[1])
        byte = w[g, b, word + k]
        for lane in range(part.shape[0]):
            f = np.float32(byte[lane])
            total, next_total = f * steps[0, 0], f * steps[1, 0]
            for n in range(1, 8):
                f = np.floor(f * np.float32(0.5))
                total += f * steps[0, n]
                next_total += f * steps[1, n]
            part[lane] += total
            next_part[lane] += next_total


@inline
def _fifth_bit_steps(x, b, i, k, steps):
    """_add_fifth_bits' weights of byte k's bits: 16 x_0, then 16 (x_n - 2 x_(n-1))."""
    at = b * 32 + 8 * k
    steps[0] = SIXTEEN * x[i, at]
    for n in range(1, 8):
        steps[n] = SIXTEEN * (x[i, at + n] - np.float32(2) * x[i, at + n - 1])


@inline
def _nibble_factors(half, w, g, b, with_min, unsigned, d, offset):
    """Block b's d and what each value adds: its m (with_min), else -unsigned * d."""
    _lane_scales(half, w, g, b, 0, d)
    if with_min:
        _lane_scales(half, w, g, b, 2, offset)
    else:
        offset[:] = -unsigned * d


@inline
def _accumulate(acc, d, part, offset, total):
    """acc[lane] += a block's d * (sum of q * x) + offset * (sum of x)."""
    for lane in range(acc.shape[0]):
        acc[lane] += d[lane] * part[lane] + offset[lane] * total


@inline
def _nibble_sums(x, w, g, b, i, first, part):
    """part[lane] = the sum of nibble j * x over block b's 32 values, the quant bytes from `first`.
    Two bytes a pass: half the loads and stores of part."""
    part[:] = 0
    for j in range(0, 16, 2):
        lo, lo2 = x[i, b * 32 + j], x[i, b * 32 + j + 1]
        hi = x[i, b * 32 + 16 + j] - np.float32(16) * lo
        hi2 = x[i, b * 32 + 17 + j] - np.float32(16) * lo2
        q, q2 = w[g, b, first + j], w[g, b, first + j + 1]
        for lane in range(part.shape[0]):
            v, v2 = np.float32(q[lane]), np.float32(q2[lane])
            part[lane] += v * lo + np.floor(v * SIXTEENTH) * hi + v2 * lo2 + np.floor(v2 * SIXTEENTH) * hi2


@inline
def _nibble_sums_pair(x, w, g, b, i, first, part, part2):
    """_nibble_sums for rows i and i + 1 at once (each the same arithmetic, so the same bits):
    the widening and the shifts, which cost as much as the products, done once for both."""
    part[:] = 0
    part2[:] = 0
    for j in range(0, 16, 2):
        lo, lo2 = x[i, b * 32 + j], x[i, b * 32 + j + 1]
        hi = x[i, b * 32 + 16 + j] - np.float32(16) * lo
        hi2 = x[i, b * 32 + 17 + j] - np.float32(16) * lo2
        next_lo, next_lo2 = x[i + 1, b * 32 + j], x[i + 1, b * 32 + j + 1]
        next_hi = x[i + 1, b * 32 + 16 + j] - np.float32(16) * next_lo
        next_hi2 = x[i + 1, b * 32 + 17 + j] - np.float32(16) * next_lo2
        q, q2 = w[g, b, first + j], w[g, b, first + j + 1]
        for lane in range(part.shape[0]):
            v, v2 = np.float32(q[lane]), np.float32(q2[lane])
            top, top2 = np.floor(v * SIXTEENTH), np.floor(v2 * SIXTEENTH)
            part[lane] += v * lo + top * hi + v2 * lo2 + top2 * hi2
            part2[lane] += v * next_lo + top * next_hi + v2 * next_lo2 + top2 * next_hi2


@fast
def _sub_block_sums(x, blocks, block, size):
    """Each `size`-value sub-block's sum of x (m, blocks * block): (m, blocks, block // size)."""
    sums = np.zeros((x.shape[0], blocks, block // size), np.float32)
    for i in range(x.shape[0]):
        for b in range(blocks):
            for s in range(block // size):
                for j in range(size):
                    sums[i, b, s] += x[i, b * block + s * size + j]
    return sums


# q8_0 has its own loop, though its shape repeats nibble_lanes': one loop with the format as a
# runtime branch per block ran 2.2x slower. `signed`: w viewed as int8, for the quants.
@parallel
def q8_0_lanes(x, w, signed, half, out):
    m = x.shape[0]
    groups, blocks, lanes = w.shape[0], w.shape[1], w.shape[3]
    for g in numba.prange(groups):  # row groups over the worker's threads
        acc = np.empty(lanes, np.float32)
        part = np.empty(lanes, np.float32)
        d = np.empty(lanes, np.float32)
        for i in range(m):
            acc[:] = 0
            for b in range(blocks):
                part[:] = 0
                for j in range(0, 32, 2):  # two quant bytes a pass: half the loads and stores of part
                    v, v2 = x[i, b * 32 + j], x[i, b * 32 + j + 1]
                    q, q2 = signed[g, b, 2 + j], signed[g, b, 3 + j]
                    for lane in range(lanes):
                        part[lane] += np.float32(q[lane]) * v + np.float32(q2[lane]) * v2
                _lane_scales(half, w, g, b, 0, d)
                for lane in range(lanes):
                    acc[lane] += d[lane] * part[lane]
            out[i, g * lanes : (g + 1) * lanes] = acc


@parallel
def q8_0_lane_pairs(x, w, signed, half, out):
    """q8_0_lanes for an even number of rows, two at a time, as nibble_lane_pairs."""
    m = x.shape[0]
    groups, blocks, lanes = w.shape[0], w.shape[1], w.shape[3]
    for g in numba.prange(groups):  # row groups over the worker's threads
        acc = np.empty(lanes, np.float32)
        part = np.empty(lanes, np.float32)
        next_acc = np.empty(lanes, np.float32)
        next_part = np.empty(lanes, np.float32)
        d = np.empty(lanes, np.float32)
        for i in range(0, m, 2):
            acc[:] = 0
            next_acc[:] = 0
            for b in range(blocks):
                _q8_0_sums_pair(x, signed, g, b, i, part, next_part)
                _lane_scales(half, w, g, b, 0, d)
                _scale_into(acc, d, part)
                _scale_into(next_acc, d, next_part)
            out[i, g * lanes : (g + 1) * lanes] = acc
            out[i + 1, g * lanes : (g + 1) * lanes] = next_acc


@inline
def _scale_into(acc, d, part):
    for lane in range(acc.shape[0]):
        acc[lane] += d[lane] * part[lane]


@inline
def _q8_0_sums_pair(x, signed, g, b, i, part, part2):
    """q8_0_lanes' sums of quant j * x over block b's 32 values for rows i and i + 1, each quant
    widened once for both (the same arithmetic per row, so the same bits)."""
    part[:] = 0
    part2[:] = 0
    for j in range(0, 32, 2):
        v, v2 = x[i, b * 32 + j], x[i, b * 32 + j + 1]
        next_v, next_v2 = x[i + 1, b * 32 + j], x[i + 1, b * 32 + j + 1]
        q, q2 = signed[g, b, 2 + j], signed[g, b, 3 + j]
        for lane in range(part.shape[0]):
            a, a2 = np.float32(q[lane]), np.float32(q2[lane])
            part[lane] += a * v + a2 * v2
            part2[lane] += a * next_v + a2 * next_v2


# K-quants: 256-value blocks of 8 or 16 sub-blocks, each with its own scale (workers/kernels/quant.py
# spells out the orders). Per sub-block the loops keep partial sums per lane and scale them once.
@inline
def _k4_lane_scales(w, g, b, scales, mins):
    """Q4_K's 6-bit scales and minimums of the 8 sub-blocks, bytes 4-15, per lane: (8, lanes).
    In float32 (exact on bytes): numba's integer masks and shifts widen to 64-bit lanes, and this
    ran a quarter of a Q4_K product's time so (360 of 1,340 us, 2,048 x 8,192 on one thread)."""
    for j in range(4):
        for lane in range(scales.shape[1]):
            low, mid, top = (
                np.float32(w[g, b, 4 + j, lane]),
                np.float32(w[g, b, 8 + j, lane]),
                np.float32(w[g, b, 12 + j, lane]),
            )
            low_top, mid_top, top_top = (
                np.floor(low * SIXTY_FOURTH),
                np.floor(mid * SIXTY_FOURTH),
                np.floor(top * SIXTEENTH),
            )
            scales[j, lane] = low - SIXTY_FOUR * low_top  # low & 63
            mins[j, lane] = mid - SIXTY_FOUR * mid_top
            scales[j + 4, lane] = top - SIXTEEN * top_top + SIXTEEN * low_top  # (top & 15) | (low >> 6) << 4
            mins[j + 4, lane] = top_top + SIXTEEN * mid_top  # (top >> 4) | (mid >> 6) << 4


@parallel
def k_nibble_lanes(x, w, half, fifth, out):
    """Q4_K: value = d * scale * nibble - dmin * min per 32-value sub-block; 64-value chunk c
    holds sub-block 2c in the low halves of its 32 quant bytes, 2c + 1 in the high. Q5_K
    (`fifth`) adds 16 * bit s of byte j of the 32 bytes before the quants to value 32s + j."""
    m = x.shape[0]
    groups, blocks, lanes = w.shape[0], w.shape[1], w.shape[3]
    sums = _sub_block_sums(x, blocks, 256, 32)
    for g in numba.prange(groups):  # row groups over the worker's threads
        acc = np.empty(lanes, np.float32)
        lows = np.empty(lanes, np.float32)  # a chunk's sum of low quant * x_low
        tops = np.empty(lanes, np.float32)  # of high quant * x_high
        d = np.empty(lanes, np.float32)
        dmin = np.empty(lanes, np.float32)
        scales = np.empty((8, lanes), np.float32)
        mins = np.empty((8, lanes), np.float32)
        for i in range(m):
            acc[:] = 0
            for b in range(blocks):
                _lane_scales(half, w, g, b, 0, d)
                _lane_scales(half, w, g, b, 2, dmin)
                _k4_lane_scales(w, g, b, scales, mins)
                for c in range(4):
                    if fifth:
                        _k5_sums(x, w, g, b, i, c, lows, tops)
                    else:
                        _k_nibble_sums(x, w, g, b, i, 16 + c * 32, b * 256 + c * 64, lows, tops)  # quants from 16
                    s0, s1 = sums[i, b, 2 * c], sums[i, b, 2 * c + 1]
                    for lane in range(lanes):
                        acc[lane] += d[lane] * (scales[2 * c, lane] * lows[lane] + scales[2 * c + 1, lane] * tops[lane])
                        acc[lane] -= dmin[lane] * (mins[2 * c, lane] * s0 + mins[2 * c + 1, lane] * s1)
            out[i, g * lanes : (g + 1) * lanes] = acc


@inline
def _k_nibble_sums(x, w, g, b, i, at, base, lows, tops):
    """A 64-value chunk of a Q4_K block (its 32 quant bytes from byte `at`, its values
    from x[i, base]): lows[lane] = the sum of the low nibbles * the first 32 values, tops[lane]
    of the high nibbles * the next 32. Four bytes a pass, two sums: each pass loads and stores
    them once (three sums, a byte a pass, ran 1.3x slower; two bytes a pass 4 % slower)."""
    lows[:] = 0
    tops[:] = 0
    for j in range(0, 32, 4):
        lo, lo2, lo3, lo4 = x[i, base + j], x[i, base + j + 1], x[i, base + j + 2], x[i, base + j + 3]
        hi, hi2, hi3, hi4 = x[i, base + 32 + j], x[i, base + 33 + j], x[i, base + 34 + j], x[i, base + 35 + j]
        q, q2, q3, q4 = w[g, b, at + j], w[g, b, at + j + 1], w[g, b, at + j + 2], w[g, b, at + j + 3]
        for lane in range(lows.shape[0]):
            v, v2, v3, v4 = np.float32(q[lane]), np.float32(q2[lane]), np.float32(q3[lane]), np.float32(q4[lane])
            top, top2 = np.floor(v * SIXTEENTH), np.floor(v2 * SIXTEENTH)
            top3, top4 = np.floor(v3 * SIXTEENTH), np.floor(v4 * SIXTEENTH)
            lows[lane] += (
                (v - SIXTEEN * top) * lo
                + (v2 - SIXTEEN * top2) * lo2
                + (v3 - SIXTEEN * top3) * lo3
                + (v4 - SIXTEEN * top4) * lo4
            )
            tops[lane] += top * hi + top2 * hi2 + top3 * hi3 + top4 * hi4


@inline
def _k5_sums(x, w, g, b, i, c, lows, tops):
    """_k_nibble_sums for Q5_K's chunk c: each quant its nibble (bytes 48 + 32c on) with its fifth
    bit, bit 2c (low halves) or 2c + 1 (high) of byte 16 + j, as one 8-bit value (_quant_bits:
    the fifth bits alone, halved out in float32, took 4 operations a bit)."""
    lows[:] = 0
    tops[:] = 0
    base = b * 256 + c * 64
    for j in range(0, 32, 2):
        lo, lo2, hi, hi2 = x[i, base + j], x[i, base + j + 1], x[i, base + 32 + j], x[i, base + 33 + j]
        q, q2 = w[g, b, 48 + c * 32 + j], w[g, b, 49 + c * 32 + j]
        h, h2 = w[g, b, 16 + j], w[g, b, 17 + j]
        for lane in range(lows.shape[0]):
            a, a2, f, f2 = q[lane], q2[lane], h[lane], h2[lane]
            lows[lane] += _quant_bits(a, 0, f, 2 * c, 1) * lo + _quant_bits(a2, 0, f2, 2 * c, 1) * lo2
            tops[lane] += _quant_bits(a, 4, f, 2 * c + 1, 1) * hi + _quant_bits(a2, 4, f2, 2 * c + 1, 1) * hi2


@parallel
def q6_k_lanes(x, w, half, out):
    """Q6_K: value = d * scale * (q - 32) per 16-value sub-block (int8 scales, bytes 192-207; d
    at 208). q's low 4 bits: ql (bytes 0-127), high 2: qh (128-191). In half h of the block,
    for at < 32: values at and at + 64 take ql[64h + at]'s low and high halves, values at + 32 and
    at + 96 those of ql[64h + 32 + at]; qh[32h + at] holds their top bits, two each, in the order
    at, at + 32, at + 64, at + 96. The -32 is taken once per sub-block, from x's sums."""
    m = x.shape[0]
    groups, blocks, lanes = w.shape[0], w.shape[1], w.shape[3]
    sums = _sub_block_sums(x, blocks, 256, 16)
    signed = w.view(np.int8)
    for g in numba.prange(groups):  # row groups over the worker's threads
        acc = np.empty(lanes, np.float32)
        parts = np.empty((4, lanes), np.float32)
        d = np.empty(lanes, np.float32)
        for i in range(m):
            acc[:] = 0
            for b in range(blocks):
                _lane_scales(half, w, g, b, 208, d)
                for h in range(2):
                    for s in range(2):
                        parts[:] = 0
                        for at in range(s * 16, s * 16 + 16):  # value `at` of each 32-value chunk
                            base = b * 256 + h * 128 + at
                            x0, x1, x2, x3 = x[i, base], x[i, base + 32], x[i, base + 64], x[i, base + 96]
                            qa, qb = w[g, b, 64 * h + at], w[g, b, 64 * h + 32 + at]
                            qh = w[g, b, 128 + 32 * h + at]
                            for lane in range(lanes):
                                a, e, c = qa[lane], qb[lane], qh[lane]  # c's bit pairs: the four tops
                                parts[0, lane] += _quant_bits(a, 0, c, 0, 3) * x0
                                parts[1, lane] += _quant_bits(e, 0, c, 2, 3) * x1
                                parts[2, lane] += _quant_bits(a, 4, c, 4, 3) * x2
                                parts[3, lane] += _quant_bits(e, 4, c, 6, 3) * x3
                        for k in range(4):
                            sub = h * 8 + 2 * k + s
                            total = np.float32(32) * sums[i, b, sub]
                            for lane in range(lanes):
                                acc[lane] += (
                                    d[lane] * np.float32(signed[g, b, 192 + sub, lane]) * (parts[k, lane] - total)
                                )
            out[i, g * lanes : (g + 1) * lanes] = acc


# -- rows of a quantized table (an embedding's lookup), with quant.values' arithmetic -----------
# Not fastmath: each value is made by the operations workers/kernels/quant.py's `values` makes,
# in its order and in float32 (no fused multiply-adds), so a row looked up here has the bits of
# NumPy's (and gguf's) dequantization. A decode step looks up one row: NumPy's dozen calls on it
# cost 120-180 us on a 1.7B-shaped step (the step's weight products had pushed their code and
# data out of the caches; ~20 us warm), this loop a few.
EIGHT, THIRTY_TWO = np.float32(8), np.float32(32)


@jit
def looked_up_rows(w, where, step, ids, spans, rows, half, code, out):
    """out[r] = row ids[r] of a (rows, width) weight held as w (groups, blocks, block bytes, lanes),
    where a span (start, stop, local) of `spans` holds it (at local row id - start + local), else
    zeros; False (nothing written) where an id lies outside [0, rows). Byte p of a block's lane l
    lies at where[p] + l * step[p] of its bytes (packing.byte_map: interleaved, or packed for
    the integer products). code: 0 q4_0, 1 q4_1, 2 q8_0, 3 q5_0, 4 q5_1, 5 q4_k, 6 q5_k, 7 q6_k."""
    for r in range(ids.shape[0]):
        if ids[r] < 0 or ids[r] >= rows:
            return False
    lanes = w.shape[3]
    block = np.empty(w.shape[2], np.uint8)
    for r in range(ids.shape[0]):
        local = -1
        for s in range(spans.shape[0]):
            if spans[s, 0] <= ids[r] < spans[s, 1]:
                local = ids[r] - spans[s, 0] + spans[s, 2]
        if local < 0:
            out[r, :] = 0
            continue
        for b in range(w.shape[1]):
            held = w[local // lanes, b]
            for p in range(block.shape[0]):
                at = where[p] + (local % lanes) * step[p]
                block[p] = held[at // lanes, at % lanes]
            if code >= 5:
                _k_block_values(block, half, code, out[r, b * 256 : (b + 1) * 256])
            else:
                _legacy_block_values(block, half, code, out[r, b * 32 : (b + 1) * 32])
    return True


@jit
def _half_at(block, at, half):
    return _half_value(np.int32(block[at]) | (np.int32(block[at + 1]) << 8), half)


@jit
def _legacy_block_values(block, half, code, out):
    """quant.values of one legacy block (32 values): q8_0 d * q; q4_0 d * (q - 8); q4_1 d * q +
    m; q5_0 d * (q - 16); q5_1 d * q + m (q5's q: its nibble + 16 * its fifth bit)."""
    d = _half_at(block, 0, half)
    if code == 2:
        for j in range(32):
            q = np.int32(block[2 + j])
            out[j] = d * np.float32(q - 256 if q > 127 else q)
        return
    with_min, fifth = code == 1 or code == 4, code >= 3
    m = _half_at(block, 2, half) if with_min else np.float32(0)
    word = 4 if with_min else 2
    first = word + 4 if fifth else word
    for j in range(32):
        byte = np.int32(block[first + j % 16])
        q = np.float32(byte & 15 if j < 16 else byte >> 4)
        if fifth:
            q = q + np.float32(16) * np.float32((np.int32(block[word + j // 8]) >> (j % 8)) & 1)
        if with_min:
            out[j] = d * q + m
        elif fifth:
            out[j] = d * (q - np.float32(16))
        else:
            out[j] = d * (q - EIGHT)


@jit
def _k_block_values(block, half, code, out):
    """quant.values of one K-quant block (256 values): Q4_K / Q5_K (d * scale) * q - dmin * min
    per 32-value sub-block (quant.k4_scales' six-bit scales and minimums); Q6_K (d * scale) *
    (q - 32) per 16-value sub-block."""
    d = _half_at(block, 208 if code == 7 else 0, half)
    if code == 7:
        for h in range(2):
            for k in range(4):
                for at in range(32):
                    low = np.int32(block[64 * h + 32 * (k % 2) + at])
                    low = low & 15 if k < 2 else low >> 4
                    top = (np.int32(block[128 + 32 * h + at]) >> (2 * k)) & 3
                    index = 128 * h + 32 * k + at
                    scale = np.int32(block[192 + index // 16])
                    factor = d * np.float32(scale - 256 if scale > 127 else scale)
                    out[index] = factor * (np.float32(low | (top << 4)) - THIRTY_TWO)
        return
    dmin = _half_at(block, 2, half)
    first = 48 if code == 6 else 16
    for s in range(8):
        low, mid, top = np.int32(block[4 + s % 4]), np.int32(block[8 + s % 4]), np.int32(block[12 + s % 4])
        if s < 4:
            scale, least = low & 63, mid & 63
        else:
            scale, least = (top & 15) | ((low >> 6) << 4), (top >> 4) | ((mid >> 6) << 4)
        factor, offset = d * np.float32(scale), dmin * np.float32(least)
        for j in range(32):
            byte = np.int32(block[first + (s // 2) * 32 + j])
            q = np.float32(byte & 15 if s % 2 == 0 else byte >> 4)
            if code == 6:
                q = q + np.float32(16) * np.float32((np.int32(block[16 + j]) >> s) & 1)
            out[32 * s + j] = factor * q - offset


# -- dequantizing tiles for prefill's BLAS products ---------------------------------------------
@fast
def dequantize_lanes(w, start, half, kind, out):
    """Groups from `start` of w as float32, transposed: out[v, r] is value v of tile row r (row
    start * lanes + r of the weight), so the innermost loops write contiguous lanes; a tile is
    out.shape[1] // lanes groups. kind: 0 q4_0, 1 q4_1, 2 q8_0, 3 q5_0, 4 q5_1."""
    blocks, lanes = w.shape[1], w.shape[3]
    signed = w.view(np.int8)
    d = np.empty(lanes, np.float32)
    offset = np.zeros(lanes, np.float32)
    with_min, fifth = kind == 1 or kind == 4, kind >= 3
    word = 4 if with_min else 2  # q5's fifth bits
    q0 = word + 4 if fifth else word  # the first quant byte
    for t in range(out.shape[1] // lanes):
        g = start + t
        cols = slice(t * lanes, (t + 1) * lanes)
        for b in range(blocks):
            _lane_scales(half, w, g, b, 0, d)
            if with_min:
                _lane_scales(half, w, g, b, 2, offset)
            elif kind != 2:
                offset[:] = np.float32(-16.0 if fifth else -8.0) * d
            if kind == 2:
                for j in range(32):
                    q = signed[g, b, 2 + j]
                    row = out[b * 32 + j, cols]
                    for lane in range(lanes):
                        row[lane] = d[lane] * np.float32(q[lane])
            elif not fifth:
                _tile_nibbles(w, g, b, q0, d, offset, out, cols)
            else:  # value j's fifth bit: bit j % 8 of byte word + j // 8 (value j + 16: of byte + 2)
                for j in range(16):
                    q, bits, high_bits = w[g, b, q0 + j], w[g, b, word + j // 8], w[g, b, word + 2 + j // 8]
                    low, high = out[b * 32 + j, cols], out[b * 32 + 16 + j, cols]
                    for lane in range(lanes):
                        low[lane] = d[lane] * _quant_bits(q[lane], 0, bits[lane], j % 8, 1) + offset[lane]
                        high[lane] = d[lane] * _quant_bits(q[lane], 4, high_bits[lane], j % 8, 1) + offset[lane]


@inline
def _tile_nibbles(w, g, b, q0, d, offset, out, cols):
    """A nibble block's 32 values into out's rows b * 32 on: d * nibble + offset, the low half of
    quant byte j (from byte q0) value j, the high half value j + 16."""
    for j in range(16):
        q = w[g, b, q0 + j]
        low = out[b * 32 + j, cols]
        high = out[b * 32 + 16 + j, cols]
        for lane in range(low.shape[0]):
            v = np.float32(q[lane])
            top = np.floor(v * SIXTEENTH)
            low[lane] = d[lane] * (v - np.float32(16) * top) + offset[lane]
            high[lane] = d[lane] * top + offset[lane]


@fast
def dequantize_k_lanes(w, start, half, kind, out):
    """dequantize_lanes for the K-quants (kind 0 Q4_K, 1 Q5_K, 2 Q6_K), in the order of
    workers/kernels/quant.py's: each sub-block's factor d * scale (Q4_K / Q5_K: less dmin *
    min) times its quants. NumPy's dequantization of a tile cost 80 ms a 2,048 x 8,192 Q4_K
    weight, which made a K-quant file's prefill 8x slower than llama.cpp's."""
    blocks, lanes = w.shape[1], w.shape[3]
    signed = w.view(np.int8)
    d = np.empty(lanes, np.float32)
    dmin = np.empty(lanes, np.float32)
    scales = np.empty((8, lanes), np.float32)
    mins = np.empty((8, lanes), np.float32)
    factor = np.empty((16, lanes), np.float32)  # per sub-block (8 of Q4_K / Q5_K, 16 of Q6_K)
    offset = np.empty((8, lanes), np.float32)
    for t in range(out.shape[1] // lanes):
        g = start + t
        cols = slice(t * lanes, (t + 1) * lanes)
        for b in range(blocks):
            if kind == 2:
                _lane_scales(half, w, g, b, 208, d)
                for sub in range(16):
                    for lane in range(lanes):
                        factor[sub, lane] = d[lane] * np.float32(signed[g, b, 192 + sub, lane])
                _q6_k_tile_block(w, g, b, factor, out, cols)
                continue
            _lane_scales(half, w, g, b, 0, d)
            _lane_scales(half, w, g, b, 2, dmin)
            _k4_lane_scales(w, g, b, scales, mins)
            for sub in range(8):
                for lane in range(lanes):
                    factor[sub, lane] = d[lane] * scales[sub, lane]
                    offset[sub, lane] = dmin[lane] * mins[sub, lane]
            first, fifth = (48, 1) if kind == 1 else (16, 0)  # Q5_K's fifth bits: mask 1 (Q4_K's: 0)
            for c in range(4):  # value 32 s + j's fifth bit: bit s of byte 16 + j
                for j in range(32):
                    q, bits = w[g, b, first + c * 32 + j], w[g, b, 16 + j]
                    low, high = out[b * 256 + c * 64 + j, cols], out[b * 256 + c * 64 + 32 + j, cols]
                    for lane in range(lanes):
                        a, h = q[lane], bits[lane]
                        low[lane] = factor[2 * c, lane] * _quant_bits(a, 0, h, 2 * c, fifth) - offset[2 * c, lane]
                        high[lane] = (
                            factor[2 * c + 1, lane] * _quant_bits(a, 4, h, 2 * c + 1, fifth) - offset[2 * c + 1, lane]
                        )


@inline
def _q6_k_tile_block(w, g, b, factor, out, cols):
    """Block b of Q6_K's lanes into out's rows (values) b * 256 on: (q - 32) * its sub-block's
    factor, q's low four bits from ql and its top two from qh (as q6_k_lanes reads them)."""
    for h in range(2):
        for at in range(32):
            base = b * 256 + h * 128 + at
            qa, qb, qh = w[g, b, 64 * h + at], w[g, b, 64 * h + 32 + at], w[g, b, 128 + 32 * h + at]
            v0, v1 = out[base, cols], out[base + 32, cols]
            v2, v3 = out[base + 64, cols], out[base + 96, cols]
            sub = (h * 128 + at) // 16  # of value at; + 2, 4, 6 for the next three
            for lane in range(v0.shape[0]):
                a, e, c = qa[lane], qb[lane], qh[lane]
                v0[lane] = factor[sub, lane] * (_quant_bits(a, 0, c, 0, 3) - np.float32(32))
                v1[lane] = factor[sub + 2, lane] * (_quant_bits(e, 0, c, 2, 3) - np.float32(32))
                v2[lane] = factor[sub + 4, lane] * (_quant_bits(a, 4, c, 4, 3) - np.float32(32))
                v3[lane] = factor[sub + 6, lane] * (_quant_bits(e, 4, c, 6, 3) - np.float32(32))


# -- attention's softmax over key-major scores --------------------------------------------------
# fastmath without its no-NaN and no-infinity promises: masked scores are -inf, and LLVM may
# drop the comparisons that keep them out of the exponential under those promises
EXACT_LIMITS = {"contract", "reassoc", "nsz", "arcp"}
exact_limits = numba.njit(cache=True, nogil=True, fastmath=EXACT_LIMITS)
inline_exact_limits = numba.njit(cache=True, nogil=True, fastmath=EXACT_LIMITS, inline="always")
LOG2E, HALF = np.float32(1.4426950408889634), np.float32(0.5)
LN2_HIGH, LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2, split for exact k * ln 2
LOWEST, HIGHEST = np.float32(-87.0), np.float32(88.0)


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose bits are int32 `bits`."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return numba.types.float32(numba.types.int32), codegen


@inline_exact_limits
def _exp(x):
    """e**x for float32 x <= 88, within 3 ulp (2.5 measured against float64): 2**k * e**r with
    |r| <= ln(2) / 2, e**r by its Taylor polynomial to r**7 (truncation below 1e-8), 2**k written
    into the exponent bits; 0 below -87 (where e**x is subnormal) and for -inf. A loop of these
    vectorizes, where numba's math.exp is a call per value (LLVM has no vector exp without
    Intel's SVML)."""
    c = min(max(x, LOWEST), HIGHEST)
    k = np.floor(c * LOG2E + HALF)
    r = c - k * LN2_HIGH - k * LN2_LOW
    p = np.float32(1 / 5040) * r + np.float32(1 / 720)
    p = p * r + np.float32(1 / 120)
    p = p * r + np.float32(1 / 24)
    p = p * r + np.float32(1 / 6)
    p = p * r + HALF
    p = p * r + np.float32(1)
    p = p * r + np.float32(1)
    e = p * _float_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))
    return e if x >= LOWEST else np.float32(0)


@inline_exact_limits
def _exponentials(row, n, top):
    """row[j] = e**(row[j] - top) for j < n; gives 1 / their sum (a softmax's last factor)."""
    for j in range(n):
        row[j] = _exp(row[j] - top)
    return np.float32(1) / _lane_sum(row, n)


# the sum's order is its own, not LLVM's: no reassociation, so eight lanes stay eight lanes (a
# function of its own: inlined by numba, it would take its caller's flags; LLVM keeps these)
in_order = numba.njit(cache=True, nogil=True, fastmath={"nsz", "arcp", "contract"})


@in_order
def _lane_sum(row, n):
    """row[:n]'s sum in eight lanes, lane k summing the elements at k mod 8 in order, then the
    lanes pairwise: zeros past the last element leave it as it is, so a softmax over n columns
    and over more whose extra ones are masked (e**-inf = 0) give the same bits. Summed as one
    value in whatever order LLVM vectorized it, a server's new prompt attending over its own keys
    (n: its length) and the same prompt over the cache (n: rounded up to KV_BUCKET) differed in
    the last bit, 1.04 apart in the logits after 30 layers of 8-bit activations."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
    full = n - n % 8
    for j in range(0, full, 8):
        a0 += row[j]
        a1 += row[j + 1]
        a2 += row[j + 2]
        a3 += row[j + 3]
        a4 += row[j + 4]
        a5 += row[j + 5]
        a6 += row[j + 6]
        a7 += row[j + 7]
    left = n - full
    if left > 0:
        a0 += row[full]
    if left > 1:
        a1 += row[full + 1]
    if left > 2:
        a2 += row[full + 2]
    if left > 3:
        a3 += row[full + 3]
    if left > 4:
        a4 += row[full + 4]
    if left > 5:
        a5 += row[full + 5]
    if left > 6:
        a6 += row[full + 6]
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@exact_limits
def softmax_columns(scores, mask, group, scale, out):
    """out[b, h, r, :n] = softmax(scores[b, h, :n, r] * scale + mask[b or 0, r % tokens, :n])
    for key-major scores (B, H, n, group * tokens) and a mask (1 or B, tokens, >= n); out
    (B, H, group * tokens, n)."""
    heads, n, rows = scores.shape[1], scores.shape[2], scores.shape[3]
    tokens = rows // group
    for b in range(scores.shape[0]):
        mb = b if mask.shape[0] > 1 else 0
        for h in range(heads):
            for r in range(rows):
                row, m_row = out[b, h, r], mask[mb, r % tokens]
                top = np.float32(-np.inf)
                for j in range(n):
                    v = scores[b, h, j, r] * scale + m_row[j]
                    row[j] = v
                    top = max(top, v)
                inverse = _exponentials(row, n, top)
                for j in range(n):
                    row[j] *= inverse


# NumPy's division: no test of the divisor for zero before each (Python's ZeroDivisionError),
# which kept LLVM from vectorizing a loop of divisions; their bits are the same (IEEE's)
exact_limits_divisions = numba.njit(cache=True, nogil=True, fastmath=EXACT_LIMITS, error_model="numpy")


@exact_limits_divisions
def swiglu_rows(both, gate, up, n, out):
    """out[r, j] = silu(both[r, gate + j]) * both[r, up + j] for j < n, silu(g) = g / (1 + e**-g):
    NumPy's order of operations, with _exp's e**x (so within a few ulp of NumPy's, not its bits).
    Two passes over row views: as one, LLVM did not vectorise it (5.5 against 2.4 us for 1,536).
    The divisions vectorized (exact_limits_divisions: 1 + e**-g is never 0), 8,192 values took
    9.9 against 29 us on a busy Zen 4 VM, the same bits on 3 x 8,192 random values."""
    for r in range(both.shape[0]):
        g_row, u_row, o_row = both[r, gate : gate + n], both[r, up : up + n], out[r]
        for j in range(n):
            o_row[j] = _exp(-g_row[j])
        for j in range(n):
            o_row[j] = g_row[j] / (np.float32(1) + o_row[j]) * u_row[j]


@row_parallel
def swiglu_rows_parallel(both, gate, up, n, out):
    for r in numba.prange(both.shape[0]):
        a = np.int64(r)  # (prange's index may be unsigned)
        b = a + 1
        swiglu_rows(both[a:b], gate, up, n, out[a:b])


@fast
def geglu_rows(both, gate, up, n, out, table):
    """out[r, j] = gelu_f16(both[r, gate + j]) * both[r, up + j]: ggml's GELU, the value of
    `table` (workers/kernels/basic.py's, one float32 per float16) at the gate's float16; 0 at or
    below -10 and the gate itself at or above 10. Its bits are the unfused steps'."""
    ten, zero = np.float32(10), np.float32(0)
    for r in range(both.shape[0]):
        g_row, u_row, o_row = both[r, gate : gate + n], both[r, up : up + n], out[r]
        for j in range(n):
            g = g_row[j]
            if g <= -ten:
                value = zero
            elif g >= ten:
                value = g
            else:
                value = table[_narrow_half(g)]
            o_row[j] = value * u_row[j]


@row_parallel
def geglu_rows_parallel(both, gate, up, n, out, table):
    for r in numba.prange(both.shape[0]):
        a = np.int64(r)  # (prange's index may be unsigned)
        b = a + 1
        geglu_rows(both[a:b], gate, up, n, out[a:b], table)


# -- attention over float16 caches (llama.cpp's --cache-type-k / -v f16) --------------------------
# The cached rows are float16 bits (uint16), widened in the vector unit as they are read: a decode
# step reads half the bytes of a float32 cache. A few query rows (decode) take decode_attention
# below; more (prefill) widen the used rows once and go to BLAS (numba_cpu.py).


@inline
def _half_value(bits, half):
    return _widen_half(bits) if NATIVE_HALVES else half[bits]


@fast
def widen_half_rows(bits, n, half, out):
    """out[b, h, j] = row j of bits (float16 bits, (B, H, ctx, d)) as float32, for j < n."""
    for b in range(out.shape[0]):
        for h in range(out.shape[1]):
            for j in range(n):
                for i in range(out.shape[3]):
                    out[b, h, j, i] = _half_value(np.int32(bits[b, h, j, i]), half)


# -- decode attention in one loop (a few query rows against the used cache) ----------------------
# One task per query row (batch, KV head, row of the head's group), over the worker's threads:
# the row's scores against the first n key rows, their softmax and the weighted sum of the value
# rows, with no temporaries beyond the row's weights. It replaces three calls (two small BLAS
# products and the softmax) that cost a SmolLM2 decode layer 33 us at 256 positions, and it
# threads over rows where BLAS's small products ran on one thread. The rows of a KV head share
# its keys, read from cache after the first. The cached rows are float32 or float16 bits.


def _as_float(value, half):
    """A cached value as float32 (float16 bits widened; see _half_value)."""


@numba.extending.overload(_as_float, inline="always")
def _as_float_typed(value, half):
    if isinstance(value, numba.types.Float):
        return lambda value, half: np.float32(value)
    return lambda value, half: _half_value(np.int32(value), half)


exact_parallel = numba.njit(cache=True, nogil=True, fastmath=EXACT_LIMITS, parallel=True)


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask for the cache line holding array.flat[index] of a C-ordered array (vector_ir.prefetch:
    a hint, so an index past the end faults nothing)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        itemsize = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        offset = builder.mul(args[1], ir.Constant(ir.IntType(64), itemsize))
        vector_ir.prefetch(builder, builder.bitcast(data, vector_ir.I8.as_pointer()), offset)
        return context.get_dummy_value()

    return numba.types.none(array, numba.types.int64), codegen


# A decode step's cache rows come from memory (the weights' products before them pushed them out
# of the caches), a head's few KiB at a time: too short a stream for the hardware's prefetcher.
# The loop asks for the key and value rows ATTENTION_AHEAD on as it scores the keys (the values
# are in cache by the time the softmax is done), and, while it weighs the values, for the next
# task's key rows, so the memory is never idle between two heads; it scores four key rows a
# pass, whose sums' reductions overlap. 32 heads x 128 positions x 64 (float16) from memory,
# eight layers' caches in turn: two threads 71 -> 47 us a layer, one 136 -> 93 (the values
# asked for only ATTENTION_AHEAD on as they were weighed, the next head's keys at its start).
# The rows are asked for into L2 (as the weights' blocks: vector_ir.prefetch), 16 on: the
# same eight layers of 32 heads x 160 / 256 positions from memory, the Zen 4 VM (2026-12-03, two
# runs alternating in one process), one thread 132-175 / 177-240 -> 90-122 / 121-177 us a layer,
# two 78-106 / 122-143 -> 58-80 / 96-100 (into L1, 8 on, against 16 into L2; 32 into L2 alike).
# (numba's cache of this file does not see a change to vector_ir: its prefetch is only a hint.)
ATTENTION_AHEAD = 16


@exact_parallel
def decode_attention(rows, kv_of, keys, values, mask, n, scale, half, weights, out):
    """out[b, h, t] = softmax_j(rows[b, h, t] . keys[b, kv_of[h], j] * scale + mask[b or 0, t, j])
    weighted sum of values[b, kv_of[h], j], over j < n: rows (B, Q, T, d) float32 (query head h,
    token t), kv_of (Q,) each query head's KV head, keys and values (B, KV, ctx, d) float32 or
    float16 bits, mask (1 or B, T, >= n), weights (B * Q * T, >= n) scratch, out (B, Q, T, d)."""
    batch, heads, tokens, width = rows.shape
    for index in numba.prange(batch * heads * tokens):
        task = np.int64(index)  # prange's index may be unsigned: mixed with int64, numba makes floats
        b, rest = divmod(task, heads * tokens)
        h, t = divmod(rest, tokens)
        kv = kv_of[h]
        m_row = mask[b if mask.shape[0] > 1 else 0, t]
        row, w, key_rows, value_rows = rows[b, h, t], weights[task], keys[b, kv], values[b, kv]
        line = 64 // key_rows.itemsize  # values a cache line
        for at in range(0, min(n, ATTENTION_AHEAD) * width, line):
            _prefetch(key_rows, at)
            _prefetch(value_rows, at)
        top = np.float32(-np.inf)
        j = 0
        while j + 4 <= n:
            for at in range((j + ATTENTION_AHEAD) * width, min(j + ATTENTION_AHEAD + 4, n) * width, line):
                _prefetch(key_rows, at)
                _prefetch(value_rows, at)
            k0, k1, k2, k3 = key_rows[j], key_rows[j + 1], key_rows[j + 2], key_rows[j + 3]
            a0, a1, a2, a3 = np.float32(0), np.float32(0), np.float32(0), np.float32(0)
            for i in range(width):
                x = row[i]
                a0 += _as_float(k0[i], half) * x
                a1 += _as_float(k1[i], half) * x
                a2 += _as_float(k2[i], half) * x
                a3 += _as_float(k3[i], half) * x
            v0, v1 = a0 * scale + m_row[j], a1 * scale + m_row[j + 1]
            v2, v3 = a2 * scale + m_row[j + 2], a3 * scale + m_row[j + 3]
            w[j], w[j + 1], w[j + 2], w[j + 3] = v0, v1, v2, v3
            top = max(top, max(max(v0, v1), max(v2, v3)))
            j += 4
        while j < n:
            key = key_rows[j]
            acc = np.float32(0)
            for i in range(width):
                acc += _as_float(key[i], half) * row[i]
            v = acc * scale + m_row[j]
            w[j] = v
            top = max(top, v)
            j += 1
        inverse = _exponentials(w, n, top)
        # four value rows a pass: the sums live in memory (a row of d), and one load and store of
        # them a value row cost twice the products (48 against 34 us for 9 rows of 1,024 positions)
        result = np.zeros(width, np.float32)
        following = min(task + 1, batch * heads * tokens - 1)  # the next task, most likely this thread's
        next_b, next_rest = divmod(following, heads * tokens)
        next_keys = keys[next_b, kv_of[next_rest // tokens]]
        j = 0
        while j + 4 <= n:
            for at in range(j * width, min(j + 4, n) * width, line):
                _prefetch(next_keys, at)
            w0, w1, w2, w3 = w[j] * inverse, w[j + 1] * inverse, w[j + 2] * inverse, w[j + 3] * inverse
            v0, v1, v2, v3 = value_rows[j], value_rows[j + 1], value_rows[j + 2], value_rows[j + 3]
            for i in range(width):
                result[i] += (
                    w0 * _as_float(v0[i], half)
                    + w1 * _as_float(v1[i], half)
                    + w2 * _as_float(v2[i], half)
                    + w3 * _as_float(v3[i], half)
                )
            j += 4
        while j < n:
            wj, vj = w[j] * inverse, value_rows[j]
            for i in range(width):
                result[i] += wj * _as_float(vj[i], half)
            j += 1
        out[b, h, t, :] = result


@jit
def permute_fours(blocks, first, end, pack):
    """packing.py's permutation of every block of `blocks` (count, block bytes * 64), in place:
    byte rows first .. end - 1 in fours, each four's 64 lanes of a row (`pack`) made 64 lanes of
    four bytes (lane l's four bytes one little-endian word), or back. NumPy's copy of the
    transposed view ran at 0.4-0.7 GB/s, the first product of a 389 MiB model packing it for
    0.6-0.9 s; this, by words, at 1.9 GB/s (in 16-group chunks as NumPy: 0.4-0.7)."""
    words = np.empty(64, np.uint32)
    rows = np.empty(256, np.uint8)
    for b in range(blocks.shape[0]):
        row = blocks[b]
        for p in range(first, end, 4):
            at = p * 64
            if pack:
                for lane in range(64):
                    words[lane] = (
                        np.uint32(row[at + lane])
                        | (np.uint32(row[at + 64 + lane]) << 8)
                        | (np.uint32(row[at + 128 + lane]) << 16)
                        | (np.uint32(row[at + 192 + lane]) << 24)
                    )
                for lane in range(64):
                    word = words[lane]
                    for k in range(4):
                        row[at + 4 * lane + k] = np.uint8((word >> (8 * k)) & 255)
            else:
                for k in range(4):
                    for lane in range(64):
                        rows[64 * k + lane] = row[at + 4 * lane + k]
                for j in range(256):
                    row[at + j] = rows[j]
