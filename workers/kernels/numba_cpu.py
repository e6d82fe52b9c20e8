"""Fused loops for the CPU backend (its kernel overrides), compiled by numba with `cache=True`.

NumPy needs several passes and temporaries for a 576-wide norm or for rotating one token's
heads; these loops (workers/kernels/numba_loops.py) do one pass with no allocation. They
accumulate in float64 where NumPy accumulates in float32, so they agree with the NumPy kernels
to rounding, not bit for bit; every CPU worker runs the same ones, so Mirrored results stay
identical across devices. Measured at a decode step's sizes, silu(gate) * up was as fast in
NumPy (vectorised exp): it stays NumPy's. Attention keeps BLAS for its two products and takes
its softmax from here: one pass per row with an exponential that vectorises, where NumPy made
five passes and a transposed copy (11 against 22 us a SmolLM2 layer at 256 positions).

`OVERRIDES` maps op and pattern names to kernels with the shared kernels' signature; each falls
back to the shared NumPy kernel for layouts it does not handle (not float32, not contiguous).
Each has `prepare()`, called when a program that uses it is loaded: numba is imported and the
loops compiled then, not during a run. Without numba installed OVERRIDES is empty and the NumPy
kernels run everywhere.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import numpy as np

from split_state.quant import FORMATS
from workers.kernels import basic, fused, quant

AVAILABLE = importlib.util.find_spec("numba") is not None


@functools.cache
def _loops():
    return importlib.import_module("workers.kernels.numba_loops")


_FLOAT32 = np.dtype(np.float32)


def _plain(*arrays) -> bool:
    for a in arrays:  # a loop and `is`, not all() over a generator: half the time, every call
        if a.dtype is not _FLOAT32 or not a.flags.c_contiguous:
            return False
    return True


def rms_norm_mul(xp, inputs, params, out=None):
    x, weight = inputs
    out = xp.empty_like(x) if out is None else out
    n = x.shape[-1] if x.ndim else 0
    usable = (
        xp is np
        and params["axis"] == x.ndim - 1
        and x.size
        and _plain(x, weight, out)
        and weight.shape[-1:] == (n,)
        and weight.size // n in (1, x.size // n)
    )
    if not usable:
        return fused.FUSED_KERNELS["rms_norm_mul"](xp, inputs, params, out)
    _loops().rms_norm_mul_rows(x.reshape(-1, n), weight.reshape(-1, n), params["eps"], out.reshape(-1, n))
    return out


def rope(xp, inputs, params, out=None):
    x, positions = inputs
    out = xp.empty_like(x) if out is None else out
    if xp is not np or x.ndim < 2 or not x.size or positions.shape != x.shape[:-2] or not _plain(x, out):
        return basic.KERNELS["rope"](xp, inputs, params, out)
    d = x.shape[-1]
    cos, sin = basic.rotation(xp, positions, d, params["base"], np.float32)
    flat = x.reshape(-1, x.shape[-2], d)
    neox = params["mode"] == "neox"
    _loops().rope_rows(flat, cos.reshape(-1, d // 2), sin.reshape(-1, d // 2), neox, out.reshape(flat.shape))
    return out


MAX_LOOP_ROWS = 8  # rows of x (tokens) up to which the block loops beat dequantizing tiles for BLAS


@functools.cache
def _halves() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


WIDENED = ("bf16",)  # NumPy widens tiles of its rows for BLAS at every size (a shift): no loop beats it
KINDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}  # numba_loops.dequantize_lanes's codes (the others: NumPy)


def qmatmul(xp, inputs, params, out=None):
    """Products with quantized weights, no float32 copy of the weight: for a few rows of x
    (decode) one pass over the blocks; for more (prefill) the weight a tile of row groups at a
    time into one reused float32 buffer, each tile a BLAS product."""
    xb, w = inputs
    groups, lanes = w.shape[0], w.shape[3]
    width = xb.shape[-2] * xb.shape[-1] if xb.ndim >= 2 else 0
    rows = xb.size // max(1, width)
    out = xp.empty(xb.shape[:-2] + (groups, lanes), np.float32) if out is None else out
    fmt = params["format"]
    usable = xp is np and rows > 0 and w.size and _plain(xb, out) and w.flags.c_contiguous
    if not usable or fmt in WIDENED:
        return quant.qmatmul(xp, inputs, params, out)
    x = xb.reshape(rows, width)
    flat = out.reshape(rows, groups * lanes)
    if rows > MAX_LOOP_ROWS:
        _tiled(x, w, fmt, flat)
    elif fmt == "q8_0":
        _loops().q8_0_lanes(x, w, w.view(np.int8), _halves(), flat)
    elif fmt in ("q4_k", "q5_k"):
        _loops().k_nibble_lanes(x, w, _halves(), fmt == "q5_k", flat)
    elif fmt == "q6_k":
        _loops().q6_k_lanes(x, w, _halves(), flat)
    else:  # q4_0, q4_1, q5_0, q5_1
        _loops().nibble_lanes(x, w, _halves(), fmt in ("q4_1", "q5_1"), fmt.startswith("q5"), flat)
    return out


def _tiled(x, w, fmt: str, flat) -> None:
    width, lanes = x.shape[1], w.shape[3]
    tile_groups = max(1, min(w.shape[0], quant.TILE_BYTES // (4 * width * lanes)))
    tile = np.empty((width, tile_groups * lanes), np.float32)  # values by rows: see dequantize_lanes
    kind, half = KINDS.get(fmt), _halves()
    for start in range(0, w.shape[0], tile_groups):
        part = tile[:, : min(tile_groups, w.shape[0] - start) * lanes]
        if kind is None:  # the K-quants' tiles: NumPy's dequantization, a tile at a time
            part[...] = quant.dequantize(np, w[start : start + tile_groups], FORMATS[fmt]).T
        else:
            _loops().dequantize_lanes(w, start, half, kind, part)
        flat[:, start * lanes : start * lanes + part.shape[1]] = x @ part


def _softmax_columns(xp, scores, mask, group: int, scale: float, out):
    """fused.softmax_rows_of_columns in one pass per row, for the decoder's layouts: 4-d scores
    and a (1 or batch, 1, 1, tokens, ctx) mask."""
    usable = (
        xp is np
        and scores.ndim == 4
        and mask.ndim == 5
        and mask.shape[1:3] == (1, 1)
        and mask.shape[0] in (1, scores.shape[0])
        and _plain(scores, mask, out)
    )
    if not usable:
        return fused.softmax_rows_of_columns(xp, scores, mask, group, scale, out)
    flat_mask = mask.reshape(mask.shape[0], mask.shape[3], mask.shape[4])
    _loops().softmax_columns(scores, flat_mask, group, np.float32(scale), out)
    return out


attention = fused.attention_with(_softmax_columns)

for kernel in (rms_norm_mul, rope, qmatmul, attention):
    kernel.prepare = _loops

OVERRIDES = (
    {"rms_norm_mul": rms_norm_mul, "rope": rope, "qmatmul": qmatmul, "attention": attention} if AVAILABLE else {}
)
