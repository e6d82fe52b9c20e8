"""Op kernels written once against an array module `xp` (NumPy on the host, CuPy on a GPU).

Each takes (xp, inputs, params) with local arrays and localised parameters. Low-precision floats
compute in float32 and round once at the end, so results do not depend on the backend's
accumulation width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from split_state.dtypes import dtype_from_name
from split_state.errors import ShapeError

LOW_PRECISION = frozenset({"float16", "bfloat16"})


def _name(dtype) -> str:
    return np.dtype(dtype).name


def _wide(xp, x):
    """float32 view of low-precision floats for the computation."""
    return x.astype(xp.float32) if _name(x.dtype) in LOW_PRECISION else x


def _unary_float(fn: Callable) -> Callable:
    def kernel(xp, inputs, params):
        (x,) = inputs
        return fn(xp, _wide(xp, x)).astype(x.dtype, copy=False)

    return kernel


def _gelu_tanh(xp, x):
    return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _erf(xp, x):
    """erf with fractional error below 1.2e-7 (the Numerical Recipes erfc fit). NumPy has no erf;
    one formula on every backend keeps the devices' results identical."""
    sign = xp.sign(x)
    a = xp.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = (
        -a * a
        - 1.26551223
        + t
        * (
            1.00002368
            + t
            * (
                0.37409196
                + t
                * (
                    0.09678418
                    + t
                    * (
                        -0.18628806
                        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))
                    )
                )
            )
        )
    )
    return sign * (1.0 - t * xp.exp(poly))


def _gelu_erf(xp, x):
    return 0.5 * x * (1.0 + _erf(xp, x / math.sqrt(2.0)))


def _matmul(xp, inputs, params):
    a, b = inputs
    if _name(a.dtype) in LOW_PRECISION and _name(b.dtype) in LOW_PRECISION:
        return xp.matmul(a.astype(xp.float32), b.astype(xp.float32)).astype(a.dtype)
    # a low-precision operand next to float32 is widened for this step only (a temporary)
    return xp.matmul(_wide(xp, a), _wide(xp, b))


def _binary(fn: Callable) -> Callable:
    def kernel(xp, inputs, params):
        a, b = inputs
        if _name(a.dtype) in LOW_PRECISION:
            return fn(_wide(xp, a), _wide(xp, b)).astype(a.dtype)
        out = fn(a, b)
        return out.astype(a.dtype, copy=False)

    return kernel


def _along_axis(fn: Callable) -> Callable:
    """A kernel normalising along params["axis"]: fn(xp, widened x, params); empty stays empty."""

    def kernel(xp, inputs, params):
        (x,) = inputs
        if x.size == 0:
            return x.copy()
        return fn(xp, _wide(xp, x), params).astype(x.dtype, copy=False)

    return kernel


@_along_axis
def _softmax(xp, w, params):
    w = w - w.max(axis=params["axis"], keepdims=True)
    e = xp.exp(w)
    return e / e.sum(axis=params["axis"], keepdims=True)


@_along_axis
def _rms_norm(xp, w, params):
    ms = (w * w).mean(axis=params["axis"], keepdims=True)
    return w / xp.sqrt(ms + params["eps"])


@_along_axis
def _layer_norm(xp, w, params):
    c = w - w.mean(axis=params["axis"], keepdims=True)
    var = (c * c).mean(axis=params["axis"], keepdims=True)
    return c / xp.sqrt(var + params["eps"])


def _sum(xp, inputs, params):
    (x,) = inputs
    return xp.sum(x, axis=params["axis"], keepdims=params["keepdims"], dtype=x.dtype)


def _mean(xp, inputs, params):
    (x,) = inputs
    total = xp.sum(_wide(xp, x), axis=params["axis"], keepdims=params["keepdims"])
    return (total / params["count"] if params["count"] else total * np.nan).astype(x.dtype, copy=False)


def _scale(xp, inputs, params):
    (x,) = inputs
    return (_wide(xp, x) * params["factor"]).astype(x.dtype, copy=False)


def _get_rows(xp, inputs, params):
    table, ids = inputs
    ids = ids.astype(xp.int64, copy=False)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= params["rows"]):
        raise ShapeError(f"get_rows: ids must lie in [0, {params['rows']}), got [{int(ids.min())}, {int(ids.max())}]")
    spans = params.get("spans", [(0, params["rows"], 0)])
    out = xp.zeros(ids.shape + (table.shape[1],), dtype=table.dtype)
    for start, stop, local in spans:
        mask = (ids >= start) & (ids < stop)
        out[mask] = table[ids[mask] - start + local]
    return out


def _compare(fn: Callable) -> Callable:
    def kernel(xp, inputs, params):
        a, b = inputs
        return fn(_wide(xp, a), _wide(xp, b))

    return kernel


def _where(xp, inputs, params):
    cond, a, b = inputs
    return xp.where(cond, a, b).astype(a.dtype, copy=False)


def _softmax_masked(xp, inputs, params):
    """softmax(x * scale + mask) along `axis`, in one pass over the scores (ggml's soft_max_ext)."""
    x, mask = inputs
    if x.size == 0:
        return x.copy()
    w = _wide(xp, x)
    w = w * params["scale"] + _wide(xp, mask).astype(w.dtype, copy=False)
    w = w - w.max(axis=params["axis"], keepdims=True)
    e = xp.exp(w)
    return (e / e.sum(axis=params["axis"], keepdims=True)).astype(x.dtype, copy=False)


def rope_angles(xp, positions, head_dim: int, base: float):
    """(..., tokens, head_dim / 2) rotation angles: position * base^(-2i / head_dim), in float64."""
    inv = np.power(float(base), -np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return positions.astype(xp.float64)[..., None] * xp.asarray(inv)


def _rope(xp, inputs, params):
    x, positions = inputs
    if x.size == 0:
        return x.copy()
    w = _wide(xp, x)
    angles = rope_angles(xp, positions, x.shape[-1], params["base"])[..., None, :]  # broadcast over heads
    cos, sin = xp.cos(angles).astype(w.dtype), xp.sin(angles).astype(w.dtype)
    out = xp.empty_like(w)
    half = x.shape[-1] // 2
    if params["mode"] == "neox":
        a, b = w[..., :half], w[..., half:]
        out[..., :half], out[..., half:] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = w[..., 0::2], w[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out.astype(x.dtype, copy=False)


def _set_rows(xp, inputs, params):
    """dst[..., ids, ...] = value along `axis`, in place; returns dst. `spans` are the global row
    ranges this device holds (start, stop, local start); rows elsewhere are another device's."""
    dst, ids, value = inputs
    ids = ids.astype(xp.int64, copy=False)
    rows = params["rows"]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise ShapeError(f"set_rows: ids must lie in [0, {rows}), got [{int(ids.min())}, {int(ids.max())}]")
    axis = params["axis"]
    if ids.ndim == 2:  # one row list per batch element (axis 0)
        for b in range(ids.shape[0]):
            _write_rows(xp, dst[b], ids[b], value[b], axis - 1, params["spans"])
    else:
        _write_rows(xp, dst, ids, value, axis, params["spans"])
    return dst


def _write_rows(xp, dst, ids, value, axis: int, spans) -> None:
    before = (slice(None),) * axis
    for start, stop, local in spans:
        mask = (ids >= start) & (ids < stop)
        if bool(mask.any()):
            dst[before + (ids[mask] - start + local,)] = value[before + (mask,)].astype(dst.dtype, copy=False)


def _top_k_candidates(xp, inputs, params):
    """This device's best k of the last axis as (value, global index) pairs, best first, padded
    to `width` with (-inf, -1). Ties go to the lower index, as numpy.argmax does."""
    (x,) = inputs
    k, width = params["k"], params["width"]
    values, index = [], []
    for global_start, length, local_start in params["spans"]:
        values.append(x[..., local_start : local_start + length].astype(xp.float64))
        index.append(xp.arange(global_start, global_start + length, dtype=xp.float64))
    out = xp.empty(x.shape[:-1] + (width, 2), dtype=xp.float64)
    out[..., 0], out[..., 1] = -xp.inf, -1.0
    if values and sum(v.shape[-1] for v in values):
        v = xp.concatenate(values, axis=-1)
        i = xp.broadcast_to(xp.concatenate(index), v.shape)
        best = _best(xp, v, i, min(k, v.shape[-1]))
        out[..., : best.shape[-2], :] = best
    return out


def _best(xp, values, index, k: int):
    """(..., k, 2): the k largest values with their index, ordered by value desc, then index asc;
    padding (index -1) after every real entry. NaN counts as -inf."""
    v = xp.where(xp.isnan(values), -xp.inf, values)
    tie = xp.where(index < 0, xp.inf, index)
    order = xp.argsort(tie, axis=-1, kind="stable")  # index ascending, then a stable sort by -value
    v, index = xp.take_along_axis(v, order, -1), xp.take_along_axis(index, order, -1)
    order = xp.argsort(-v, axis=-1, kind="stable")[..., :k]
    return xp.stack([xp.take_along_axis(v, order, -1), xp.take_along_axis(index, order, -1)], axis=-1)


def _top_k_combine(xp, inputs, params):
    (c,) = inputs
    return _best(xp, c[..., 0], c[..., 1], params["k"])


KERNELS: dict[str, Callable[[Any, Sequence[Any], dict], Any]] = {
    "matmul": _matmul,
    "add": _binary(lambda a, b: a + b),
    "sub": _binary(lambda a, b: a - b),
    "mul": _binary(lambda a, b: a * b),
    "div": _binary(lambda a, b: a / b),
    "scale": _scale,
    "neg": lambda xp, i, p: -i[0],
    "gelu": _unary_float(_gelu_tanh),
    "gelu_erf": _unary_float(_gelu_erf),
    "silu": _unary_float(lambda xp, x: x / (1.0 + xp.exp(-x))),
    "relu": lambda xp, i, p: xp.maximum(i[0], xp.zeros((), dtype=i[0].dtype)),
    "exp": _unary_float(lambda xp, x: xp.exp(x)),
    "tanh": _unary_float(lambda xp, x: xp.tanh(x)),
    "cast": lambda xp, i, p: i[0].astype(dtype_from_name(p["dtype"])),
    "softmax": _softmax,
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "sum": _sum,
    "mean": _mean,
    "reshape": lambda xp, i, p: xp.reshape(i[0], tuple(p["shape"])),
    "transpose": lambda xp, i, p: xp.ascontiguousarray(xp.transpose(i[0], tuple(p["axes"]))),
    "concat": lambda xp, i, p: xp.concatenate(list(i), axis=p["axis"]),
    "slice": lambda xp, i, p: xp.ascontiguousarray(i[0][(slice(None),) * p["axis"] + (slice(p["start"], p["stop"]),)]),
    "get_rows": _get_rows,
    "sqrt": _unary_float(lambda xp, x: xp.sqrt(x)),
    "rsqrt": _unary_float(lambda xp, x: 1.0 / xp.sqrt(x)),
    "lt": _compare(lambda a, b: a < b),
    "le": _compare(lambda a, b: a <= b),
    "eq": _compare(lambda a, b: a == b),
    "where": _where,
    "softmax_ext": _softmax_masked,
    "rope": _rope,
    "set_rows": _set_rows,
    "top_k_candidates": _top_k_candidates,
    "top_k_combine": _top_k_combine,
}
