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
    if _name(a.dtype) in LOW_PRECISION:
        return xp.matmul(a.astype(xp.float32), b.astype(xp.float32)).astype(a.dtype)
    return xp.matmul(a, b)


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
}
