"""The kernel of every op in split_state.ops, written once against an array module `xp` (NumPy on
the host, CuPy on a GPU).

A kernel is `kernel(xp, inputs, params, out=None)`: local input arrays, localised parameters and,
when the worker's memory plan gave it one, `out`, an array of the step's local shape and dtype
to write the result into; it returns the result (`out` itself when given). Kernels of VIEW_OPS
return a view of their input where they can and never get `out`. Low-precision floats compute in
float32 and round once at the end, so results do not depend on the backend's accumulation width.
The float32 paths write into `out` with the ufuncs' own `out=` and run the same arithmetic in the
same order as the allocating path, so both give the same bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from split_state.dtypes import dtype_from_name
from split_state.errors import ShapeError
from split_state.ops import batch_pairs

LOW_PRECISION = frozenset({"float16", "bfloat16"})


_LOW: dict = {}  # dtype -> _low's answer


def _low(dtype) -> bool:
    """Whether `dtype` is a 16-bit float, computed in float32. Cached: every matmul and binary
    step asks, and a dtype's `.name` costs about a microsecond."""
    low = _LOW.get(dtype)
    if low is None:
        low = _LOW[dtype] = np.dtype(dtype).name in LOW_PRECISION
    return low


def _wide(xp, x):
    """float32 view of low-precision floats for the computation."""
    return x.astype(xp.float32) if _low(x.dtype) else x


def emit(value, out, dtype=None):
    """`value` as the step's result: written into `out` when given (assignment rounds to its
    dtype), else cast to `dtype` (default: unchanged)."""
    if out is None:
        return value if dtype is None else value.astype(dtype, copy=False)
    out[...] = value
    return out


def _unary_float(fn: Callable) -> Callable:
    def kernel(xp, inputs, params, out=None):
        (x,) = inputs
        return emit(fn(xp, _wide(xp, x)), out, x.dtype)

    return kernel


def _gelu_tanh(xp, x):
    return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


@functools.cache
def gelu_f16_table() -> np.ndarray:
    """ggml's GELU table (ggml-cpu.c: ggml_table_gelu_f16): for every float16 bit pattern, its
    value's tanh GELU in float32 arithmetic as ggml's ggml_gelu_f32 writes it, rounded to float16;
    as float32."""
    half = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    c, a, one = np.float32(0.79788456080286535587989211986876), np.float32(0.044715), np.float32(1)
    with np.errstate(over="ignore", invalid="ignore"):
        gelu = np.float32(0.5) * half * (one + np.tanh(c * half * (one + a * half * half)))
    return gelu.astype(np.float16).astype(np.float32)


_GELU_TABLES: dict[int, Any] = {}  # per array module: the table where its arrays live


def _gelu_f16(xp, inputs, params, out=None):
    """llama.cpp's CPU GELU (GGML_GELU_FP16): the table's value at x's float16; 0 at or below -10,
    x at or above 10."""
    (x,) = inputs
    table = _GELU_TABLES.get(id(xp))
    if table is None:
        table = _GELU_TABLES[id(xp)] = xp.asarray(gelu_f16_table())
    wide = x.astype(xp.float32, copy=False)
    looked = table[xp.clip(wide, -10, 10).astype(xp.float16).view(xp.uint16)]  # past 10: the where below
    y = xp.where(wide <= -10, xp.float32(0), xp.where(wide >= 10, wide, looked))
    return emit(y, out, x.dtype)


def _erf(xp, x):
    """erf with fractional error below 1.2e-7 (the Numerical Recipes erfc fit). NumPy has no erf;
    one formula on every backend keeps the devices' results identical."""
    sign = xp.sign(x)
    a = xp.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    coefficients = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418)
    poly = coefficients[0]
    for c in coefficients[1:]:
        poly = c + t * poly
    poly = -a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * poly))
    return sign * (1.0 - t * xp.exp(poly))


def _gelu_erf(xp, x):
    return 0.5 * x * (1.0 + _erf(xp, x / math.sqrt(2.0)))


def silu_into(xp, x, out):
    """x / (1 + exp(-x)) for float32 `x`, computed in `out` (which may not alias x)."""
    xp.negative(x, out=out)
    xp.exp(out, out=out)
    out += 1.0
    return xp.divide(x, out, out=out)


def _silu(xp, inputs, params, out=None):
    (x,) = inputs
    if not _low(x.dtype):
        return silu_into(xp, x, xp.empty_like(x) if out is None else out)
    w = _wide(xp, x)
    return emit(w / (1.0 + xp.exp(-w)), out, x.dtype)


def _matmul(xp, inputs, params, out=None):
    a, b = inputs
    if _low(a.dtype) and _low(b.dtype):
        return emit(xp.matmul(a.astype(xp.float32), b.astype(xp.float32)), out, a.dtype)
    if _low(a.dtype) or _low(b.dtype):  # a low-precision operand beside float32: widened for this step
        return emit(xp.matmul(_wide(xp, a), _wide(xp, b)), out)
    return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)


def _binary(ufunc: str) -> Callable:
    def kernel(xp, inputs, params, out=None):
        a, b = inputs
        fn = getattr(xp, ufunc)
        if _low(a.dtype):
            return emit(fn(_wide(xp, a), _wide(xp, b)), out, a.dtype)
        if out is None:
            return fn(a, b).astype(a.dtype, copy=False)
        return fn(a, b, out=out)

    return kernel


def _along_axis(fn: Callable) -> Callable:
    """A kernel normalising along params["axis"]: fn(xp, widened x, params); empty stays empty."""

    def kernel(xp, inputs, params, out=None):
        (x,) = inputs
        if x.size == 0:
            return x.copy() if out is None else out
        return emit(fn(xp, _wide(xp, x), params), out, x.dtype)

    return kernel


@_along_axis
def _softmax(xp, w, params):
    w = w - w.max(axis=params["axis"], keepdims=True)
    e = xp.exp(w)
    return e / e.sum(axis=params["axis"], keepdims=True)


def rms_norm_into(xp, x, axis: int, eps: float, out):
    """x / sqrt(mean(x * x) + eps) for float32 `x`, in `out` (not aliasing x)."""
    xp.multiply(x, x, out=out)
    ms = out.mean(axis=axis, keepdims=True)
    ms += eps
    xp.sqrt(ms, out=ms)
    return xp.divide(x, ms, out=out)


def _rms_norm(xp, inputs, params, out=None):
    (x,) = inputs
    if x.size == 0:
        return x.copy() if out is None else out
    if not _low(x.dtype):
        return rms_norm_into(xp, x, params["axis"], params["eps"], xp.empty_like(x) if out is None else out)
    w = _wide(xp, x)
    return emit(w / xp.sqrt((w * w).mean(axis=params["axis"], keepdims=True) + params["eps"]), out, x.dtype)


@_along_axis
def _layer_norm(xp, w, params):
    c = w - w.mean(axis=params["axis"], keepdims=True)
    var = (c * c).mean(axis=params["axis"], keepdims=True)
    return c / xp.sqrt(var + params["eps"])


def _sum(xp, inputs, params, out=None):
    (x,) = inputs
    return xp.sum(x, axis=params["axis"], keepdims=params["keepdims"], dtype=x.dtype, out=out)


def _mean(xp, inputs, params, out=None):
    (x,) = inputs
    total = xp.sum(_wide(xp, x), axis=params["axis"], keepdims=params["keepdims"])
    return emit(total / params["count"] if params["count"] else total * np.nan, out, x.dtype)


def _scale(xp, inputs, params, out=None):
    (x,) = inputs
    if not _low(x.dtype) and out is not None:
        return xp.multiply(x, params["factor"], out=out)
    return emit(_wide(xp, x) * params["factor"], out, x.dtype)


def ids_outside(op: str, rows: int, lowest: int, highest: int) -> ShapeError:
    """The error of a row op (get_rows, set_rows, qget_rows) given ids outside [0, rows): the
    lowest and highest it was given."""
    return ShapeError(f"{op}: ids must lie in [0, {rows}), got [{lowest}, {highest}]")


def look_up_rows(xp, op: str, table, ids, params, out, width: int, dtype, read=None):
    """Rows `ids` of `table` as (ids..., width), zeros for the rows this device does not hold
    (params["spans"]: which global rows it holds, where); `read`, given local row numbers, gives
    their values instead of `table[rows]` (a quantized table dequantizes only the rows looked
    up)."""
    ids = ids.astype(xp.int64, copy=False)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= params["rows"]):
        raise ids_outside(op, params["rows"], int(ids.min()), int(ids.max()))
    spans = params.get("spans", [(0, params["rows"], 0)])
    if read is None and len(spans) == 1 and tuple(spans[0]) == (0, params["rows"], 0):
        # the table held whole (split on another axis, or not at all): one pass into out, not
        # zeros, a masked copy and the copy
        return xp.take(table, ids, axis=0) if out is None else xp.take(table, ids, axis=0, out=out)
    read = table.__getitem__ if read is None else read
    if out is None:
        out = xp.zeros(ids.shape + (width,), dtype=dtype)
    else:
        out[...] = 0
    for start, stop, local in spans:
        mask = (ids >= start) & (ids < stop)
        out[mask] = read(ids[mask] - start + local)
    return out


def _get_rows(xp, inputs, params, out=None):
    table, ids = inputs
    return look_up_rows(xp, "get_rows", table, ids, params, out, table.shape[1], table.dtype)


def _compare(ufunc: str) -> Callable:
    def kernel(xp, inputs, params, out=None):
        a, b = inputs
        return getattr(xp, ufunc)(_wide(xp, a), _wide(xp, b), out=out)

    return kernel


def _where(xp, inputs, params, out=None):
    cond, a, b = inputs
    if out is None:
        return xp.where(cond, a, b).astype(a.dtype, copy=False)
    xp.copyto(out, b)
    xp.copyto(out, a, where=cond)
    return out


def softmax_masked_into(xp, x, mask, scale: float, axis: int, out):
    """softmax(x * scale + mask) along `axis` for float32 `x`, in `out` (which may be x)."""
    xp.multiply(x, scale, out=out)
    out += mask
    out -= out.max(axis=axis, keepdims=True)
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


def _softmax_masked(xp, inputs, params, out=None):
    """softmax(x * scale + mask) along `axis`, in one pass over the scores (ggml's soft_max_ext)."""
    x, mask = inputs
    if x.size == 0:
        return x.copy() if out is None else out
    if not _low(x.dtype) and not _low(mask.dtype):
        target = xp.empty_like(x) if out is None else out
        return softmax_masked_into(xp, x, mask, params["scale"], params["axis"], target)
    w = _wide(xp, x)
    w = w * params["scale"] + _wide(xp, mask).astype(w.dtype, copy=False)
    w = w - w.max(axis=params["axis"], keepdims=True)
    e = xp.exp(w)
    return emit(e / e.sum(axis=params["axis"], keepdims=True), out, x.dtype)


def rope_angles(xp, positions, head_dim: int, base: float, freqs: tuple[float, ...] | None = None):
    """(..., tokens, head_dim / 2) rotation angles: position * base^(-2i / head_dim) * freqs[i]
    (each frequency's multiplier: 1 / a linear scaling's factor, Llama 3.1's 1 / factor_i), in
    float64."""
    return positions.astype(xp.float64)[..., None] * _inverse_frequencies(xp, head_dim, float(base), freqs)


_FREQUENCIES: dict[tuple, object] = {}


def _inverse_frequencies(xp, head_dim: int, base: float, freqs: tuple[float, ...] | None):
    """base^(-2i / head_dim) * freqs[i], computed on the host (the same bits on every backend)
    and moved to the device once: a copy from host memory each call cannot be captured in a
    device graph, so every rope ran eagerly, about 10 kernel launches 20 times per token."""
    # by the array module itself (a test process may hold two modules of one name: CuPy's
    # stand-in installed twice) and its current device (an array lives on one)
    device = xp.cuda.Device().id if hasattr(xp, "cuda") else -1
    key = (id(xp), device, head_dim, base, freqs)
    inv = _FREQUENCIES.get(key)
    if inv is None:
        host = np.power(base, -np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if freqs is not None:
            host = host * np.asarray(freqs, np.float64)
        inv = _FREQUENCIES[key] = xp.asarray(host)
    return inv


def inverse_frequencies(xp, head_dim: int, params: dict):
    """The rope op's base^(-2i / head_dim) * freqs[i] (`params`: its base and frequency
    multipliers), float64 on xp's device, made once: what a kernel of its own multiplies the
    positions by (workers/backends/cuda/kernels/rope.py)."""
    freqs = params.get("freqs")
    return _inverse_frequencies(xp, head_dim, float(params["base"]), None if freqs is None else tuple(freqs))


@functools.lru_cache(maxsize=16)
def _host_rotation(positions: bytes, dtype: str, shape: tuple, head_dim: int, base: float, freqs):
    """cos and sin (float32) of host positions, kept for the next step with the same positions:
    every layer's q and k rope at the same positions."""
    pos = np.frombuffer(positions, dtype=dtype).reshape(shape)
    angles = rope_angles(np, pos, head_dim, base, freqs)[..., None, :]  # broadcast over heads
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# positions a block of _rotation_block: a decode step's one position is a row of one, made with
# the block's other positions, not alone (basic.rotation)
ROTATION_BLOCK = 256


@functools.lru_cache(maxsize=64)
def _rotation_block(block: int, head_dim: int, base: float, freqs):
    """cos and sin (float32, (ROTATION_BLOCK, head_dim / 2)) of positions block * ROTATION_BLOCK
    onwards, element by element the bits of _host_rotation's for each position alone."""
    first = block * ROTATION_BLOCK
    angles = rope_angles(np, np.arange(first, first + ROTATION_BLOCK, dtype=np.int64), head_dim, base, freqs)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotation(xp, positions, head_dim: int, params: dict, dtype):
    """cos and sin of the rope op's angles (`params`: its base and frequency multipliers). One
    host position (a decode step's) is a row of its block's table (_rotation_block): the
    angles' NumPy calls for it alone took ~55 us of a decode step, the functions pushed out of
    the caches by the weight products before them."""
    base, freqs = float(params["base"]), params.get("freqs")
    freqs = None if freqs is None else tuple(freqs)  # floats already (the op's check made them so): hashable
    if xp is np and np.dtype(dtype) == np.float32:
        if positions.size == 1 and positions.dtype.kind in "iu":
            block, row = divmod(int(positions.reshape(-1)[0]), ROTATION_BLOCK)
            if 0 <= block < 1 << 24:
                cos, sin = _rotation_block(block, head_dim, base, freqs)
                shape = positions.shape + (1, head_dim // 2)
                return cos[row : row + 1].reshape(shape), sin[row : row + 1].reshape(shape)
        return _host_rotation(positions.tobytes(), positions.dtype.str, positions.shape, head_dim, base, freqs)
    angles = rope_angles(xp, positions, head_dim, base, freqs)[..., None, :]
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)


def _rope(xp, inputs, params, out=None):
    x, positions = inputs
    if x.size == 0:
        return x.copy() if out is None else out
    w = _wide(xp, x)
    cos, sin = rotation(xp, positions, x.shape[-1], params, w.dtype)
    target = xp.empty_like(w) if out is None or _low(x.dtype) else out
    half = x.shape[-1] // 2
    if params["mode"] == "neox":
        a, b = w[..., :half], w[..., half:]
        target[..., :half], target[..., half:] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = w[..., 0::2], w[..., 1::2]
        target[..., 0::2], target[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return target if target is out else emit(target, out, x.dtype)


def _set_rows(xp, inputs, params, out=None, memo=None):
    """dst[..., ids, ...] = value along `axis`, in place; returns dst. `spans` are the global row
    ranges this device holds (start, stop, local start); rows elsewhere are another device's."""
    dst, ids, value = inputs[:3]
    # (row of the ids, local batch index) for each sequence written: given when only some are,
    # or made from a fed batch start (one plan for every slot of a server)
    rows, pairs = params["rows"], params.get("batches")
    if len(inputs) == 4:
        pairs = fed_pairs(inputs[3], ids, params)
    if ids.ndim == 2 and pairs is None:
        pairs = [(j, j) for j in range(ids.shape[0])]
    if xp is np and ids.size <= FEW_ROWS and ids.ndim in (1, 2):
        return _set_few_rows(dst, ids, value, rows, params["axis"], params["spans"], pairs)
    # every layer writes its caches at the same ids: on a GPU, reading their range is a wait for
    # the device, so the first set_rows of a run reads it and the others take it from the memo
    key = ("ids range", id(ids))
    known = memo.get(key) if memo is not None else None
    held = ids
    ids = ids.astype(xp.int64, copy=False)
    if known is not None:
        bounds = known[0]
    else:
        bounds = tuple(int(v) for v in xp.stack([ids.min(), ids.max()]).tolist()) if ids.size else (0, -1)
        if memo is not None:
            memo[key] = (bounds, held)  # holding the ids: their id is not reused this run
    lo, hi = bounds
    if ids.size and (lo < 0 or hi >= rows):
        raise ids_outside("set_rows", rows, lo, hi)
    axis = params["axis"]
    if ids.ndim == 2:  # one row list per batch element (axis 0)
        for j, b in pairs:
            _write_rows(xp, dst[b], ids[j], value[j], axis - 1, params["spans"], bounds)
    else:
        _write_rows(xp, dst, ids, value, axis, params["spans"], bounds)
    return dst


_set_rows.memo = True  # the ids' range, read once per run (workers/program.py clears the memo)
_set_rows.eager = True  # it reads the ids on the host: never inside a device graph


FEW_ROWS = 16  # a decode step writes one row per sequence: plain indexing beats masks there


def fed_pairs(start, ids, params) -> list[tuple[int, int]]:
    start = int(start)  # a 0-d array (on a GPU, read back: set_rows is eager)
    if not 0 <= start <= params["batch"] - ids.shape[0]:
        raise ShapeError(
            f"set_rows: {ids.shape[0]} sequences from batch index {start} do not fit a batch of {params['batch']}"
        )
    return batch_pairs(start, ids.shape[0], params["held"])


def _set_few_rows(dst, ids, value, rows: int, axis: int, spans, pairs):
    """set_rows for a handful of host ids: one assignment per row this device holds."""
    listed = ids.tolist()
    flat = [r for row in listed for r in row] if ids.ndim == 2 else listed
    if flat and (min(flat) < 0 or max(flat) >= rows):
        raise ids_outside("set_rows", rows, min(flat), max(flat))
    if ids.ndim == 2:
        batches = [(dst[b], listed[j], value[j], axis - 1) for j, b in pairs]
    else:
        batches = [(dst, listed, value, axis)]
    for target, row_ids, source, ax in batches:
        before = (slice(None),) * ax
        for j, row in enumerate(row_ids):
            for start, stop, local in spans:
                if start <= row < stop:
                    target[before + (row - start + local,)] = source[before + (j,)]
    return dst


def _write_rows(xp, dst, ids, value, axis: int, spans, bounds: tuple[int, int]) -> None:
    """The rows of `ids` that fall in each span, written; `bounds` (lowest, highest id of all the
    ids written, a superset of these) spare the masks where a span holds all or none of them."""
    before = (slice(None),) * axis
    lo, hi = bounds
    for start, stop, local in spans:
        if hi < start or lo >= stop:
            continue  # none of them here
        if start <= lo and hi < stop:  # all of them here: no mask, nothing read on the host
            dst[before + (ids - start + local,)] = value.astype(dst.dtype, copy=False)
            continue
        mask = (ids >= start) & (ids < stop)
        if bool(mask.any()):
            dst[before + (ids[mask] - start + local,)] = value[before + (mask,)].astype(dst.dtype, copy=False)


def _top_k_candidates(xp, inputs, params, out=None):
    """This device's best k of the last axis as (value, global index) pairs, best first, padded
    to `width` with (-inf, -1). Ties go to the lower index, as numpy.argmax does; NaN ranks as
    -inf."""
    (x,) = inputs
    k, width = params["k"], params["width"]
    spans = sorted(params["spans"])  # by global start: concatenated, position order is index order
    if out is None:
        out = xp.empty(x.shape[:-1] + (width, 2), dtype=xp.float64)
    out[..., 0], out[..., 1] = -xp.inf, -1.0
    spans = [s for s in spans if s[1]]
    if not spans:
        return out
    if len(spans) == 1:
        start, length, local = spans[0]
        v = x[..., local : local + length]
    else:
        v = xp.concatenate([x[..., loc : loc + n] for _, n, loc in spans], axis=-1)
    k = min(k, v.shape[-1])
    if k == 1:  # greedy: one pass; argmax keeps the first of ties, and finds a NaN if there is one
        best = xp.argmax(v, axis=-1)
        top = xp.take_along_axis(v, best[..., None], -1)[..., 0]
        if not bool(xp.isnan(top).any()):
            out[..., 0, 0] = top
            out[..., 0, 1] = best + start if len(spans) == 1 else _global_index(xp, spans)[best]
            return out
    index = _global_index(xp, spans)
    out[..., :k, :] = _best(xp, v.astype(xp.float64), xp.broadcast_to(index, v.shape), k)
    return out


def _global_index(xp, spans):
    """The global index of each value of the spans' values concatenated, as float64."""
    return xp.concatenate([xp.arange(s, s + n, dtype=xp.float64) for s, n, _ in spans])


def _best(xp, values, index, k: int):
    """(..., k, 2): the k largest values with their index, ordered by value desc, then index asc;
    padding (index -1) after every real entry. NaN counts as -inf. Only the entries that can
    make the top k (at least the k-th largest value) are sorted."""
    v = xp.where(xp.isnan(values), -xp.inf, values)
    if k < v.shape[-1]:
        kth = -xp.partition(-v, k - 1, axis=-1)[..., k - 1 : k]  # the k-th largest value per row
    else:
        kth = v.min(axis=-1, keepdims=True)
    rows_v, rows_i = v.reshape(-1, v.shape[-1]), xp.broadcast_to(index, v.shape).reshape(-1, v.shape[-1])
    out = xp.empty((rows_v.shape[0], k, 2), dtype=xp.float64)
    for r, (row_v, row_i, t) in enumerate(zip(rows_v, rows_i, kth.reshape(-1))):
        keep = xp.flatnonzero(row_v >= t)
        cv, ci = row_v[keep], row_i[keep]
        tie = xp.where(ci < 0, xp.inf, ci)  # padding (-1) after every real entry
        order = xp.lexsort(xp.stack([tie, -cv]))[:k]
        out[r, :, 0], out[r, :, 1] = cv[order], ci[order]
    return out.reshape(v.shape[:-1] + (k, 2))


def _top_k_combine(xp, inputs, params, out=None):
    (c,) = inputs
    return emit(_best(xp, c[..., 0], c[..., 1], params["k"]), out)


def _view_kernel(view: Callable) -> Callable:
    """A kernel of a VIEW_OPS op: the view of its input; copied into `out` when one is given (a
    program's result, which must not share memory with what a later in-place write changes)."""

    def kernel(xp, inputs, params, out=None):
        v = view(xp, inputs[0], params)
        if out is None:
            return v
        xp.copyto(out, v)
        return out

    return kernel


def _reshape(xp, inputs, params, out=None):
    """A view where the layout allows; with `out` (a result's buffer, or the arena's for a
    reshape that must copy: workers/layouts.py), the values copied straight into it: `out` is
    contiguous, so its reshape to the input's shape is a view, and C order is reshape's."""
    (x,) = inputs
    if out is None:
        return xp.reshape(x, tuple(params["shape"]))
    xp.copyto(out.reshape(x.shape), x)
    return out


def _concat(xp, inputs, params, out=None):
    return xp.concatenate(list(inputs), axis=params["axis"], out=out)


def _relu(xp, inputs, params, out=None):
    (x,) = inputs
    return xp.maximum(x, xp.zeros((), dtype=x.dtype), out=out)


# Ops whose kernel returns a view of its first input where the layout allows (a reshape of a
# transposed view copies): no buffer of their own. Kernels read views of any strides. A slice is
# one: a decode step over the first rows of a batched cache reads them where they lie.
VIEW_OPS = frozenset({"reshape", "transpose", "slice"})
# Ops whose kernel may write over an input of the output's shape (one elementwise ufunc call):
# the memory plan gives them the buffer of an input that dies with them (ggml-alloc's in-place
# reuse), so a chain of residual adds and scalings keeps one buffer.
OVERWRITES_INPUT = frozenset({"add", "sub", "mul", "div", "scale", "neg"})

KERNELS: dict[str, Callable] = {
    "matmul": _matmul,
    "add": _binary("add"),
    "sub": _binary("subtract"),
    "mul": _binary("multiply"),
    "div": _binary("divide"),
    "mod": _binary("remainder"),
    "scale": _scale,
    "neg": lambda xp, i, p, out=None: xp.negative(i[0], out=out),
    "gelu": _unary_float(_gelu_tanh),
    "gelu_erf": _unary_float(_gelu_erf),
    "gelu_f16": _gelu_f16,
    "silu": _silu,
    "relu": _relu,
    "exp": _unary_float(lambda xp, x: xp.exp(x)),
    "tanh": _unary_float(lambda xp, x: xp.tanh(x)),
    "cast": lambda xp, i, p, out=None: emit(i[0].astype(dtype_from_name(p["dtype"])), out),
    # the empty result of an op that this worker's group does not run (meta/compiler.py)
    "nothing": lambda xp, i, p, out=None: (
        out if out is not None else xp.empty((0,) * p["ndim"], dtype=dtype_from_name(p["dtype"]))
    ),
    "softmax": _softmax,
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "sum": _sum,
    "mean": _mean,
    "reshape": _reshape,
    "transpose": _view_kernel(lambda xp, x, p: xp.transpose(x, tuple(p["axes"]))),
    "concat": _concat,
    "slice": _view_kernel(lambda xp, x, p: x[(slice(None),) * p["axis"] + (slice(p["start"], p["stop"]),)]),
    "get_rows": _get_rows,
    "sqrt": _unary_float(lambda xp, x: xp.sqrt(x)),
    "rsqrt": _unary_float(lambda xp, x: 1.0 / xp.sqrt(x)),
    "lt": _compare("less"),
    "le": _compare("less_equal"),
    "eq": _compare("equal"),
    "where": _where,
    "softmax_ext": _softmax_masked,
    "rope": _rope,
    "set_rows": _set_rows,
    "top_k_candidates": _top_k_candidates,
    "top_k_combine": _top_k_combine,
}
