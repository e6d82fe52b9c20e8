"""Random operands and parameters for every op of the table, from a NumPy generator.

One source for the tests (tests/op_cases.py draws a seed and calls `random_case`) and for the
stress run (bench/stress.py builds chains with `params_for`, `partner_shape` and `values`).
Axes are mostly non-empty: a size-0 axis is drawn with probability ZERO_AXIS, so empty tensors
stay a share of the cases, not the majority.
"""

from __future__ import annotations

import numpy as np

from split_state.dtypes import dtype_from_name
from split_state.quant import FORMATS

ZERO_AXIS = 0.08
BINARY = ("add", "sub", "mul", "div")
COMPARISONS = ("lt", "le", "eq")


def dim(rng: np.random.Generator, low: int = 1, high: int = 6) -> int:
    return 0 if rng.random() < ZERO_AXIS else int(rng.integers(low, high + 1))


def shape(rng: np.random.Generator, max_rank: int = 3) -> tuple[int, ...]:
    return tuple(dim(rng) for _ in range(int(rng.integers(1, max_rank + 1))))


def values(rng: np.random.Generator, shape_: tuple[int, ...], dtype: str, divisor: bool = False) -> np.ndarray:
    """Random values of `dtype`; a divisor is kept at least 0.5 away from zero."""
    if np.issubdtype(dtype_from_name(dtype), np.integer):
        return rng.integers(-4, 5, size=shape_).astype(dtype_from_name(dtype))
    x = rng.standard_normal(shape_)
    if divisor:
        x = np.where(np.abs(x) < 0.5, np.copysign(0.5, x) + x, x)
    return x.astype(dtype_from_name(dtype))


def partner_shape(rng: np.random.Generator, shape_: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts against `shape_`: some axes set to 1, some leading axes dropped."""
    other = tuple(1 if rng.random() < 0.25 else s for s in shape_)
    return other[int(rng.integers(0, len(other))) :] if other else other


def params_for(
    rng: np.random.Generator,
    name: str,
    shape_: tuple[int, ...],
    eps: float = 1e-5,
    casts: tuple[str, ...] = ("float16", "float64", "int32"),
) -> dict:
    """Parameters of a one-input op applied to a tensor of `shape_` (global values, may be negative
    axes, as a user writes them)."""
    ndim = len(shape_)
    axis = int(rng.integers(-ndim, ndim)) if ndim else 0
    if name == "scale":
        return {"factor": float(rng.uniform(-2, 2))}
    if name == "cast":
        return {"dtype": str(rng.choice(list(casts)))}
    if name == "softmax":
        return {"axis": axis}
    if name in ("rms_norm", "layer_norm"):
        return {"axis": axis, "eps": eps}
    if name in ("sum", "mean"):
        return {"axis": axis, "keepdims": bool(rng.integers(2))}
    if name == "transpose":
        return {"axes": tuple(int(a) for a in rng.permutation(ndim))}
    if name == "slice":
        size = shape_[axis]
        start = int(rng.integers(0, size + 1))
        return {"axis": axis, "start": start, "stop": int(rng.integers(start, size + 1))}
    if name == "reshape":
        return {"shape": reshape_target(rng, shape_)}
    return {}


def reshape_target(rng: np.random.Generator, shape_: tuple[int, ...]) -> tuple[int, ...]:
    """Merge two neighbouring axes, split one in two, or flatten."""
    ndim = len(shape_)
    choice = int(rng.integers(3))
    if choice == 0 and ndim >= 2:
        i = int(rng.integers(ndim - 1))
        return shape_[:i] + (shape_[i] * shape_[i + 1],) + shape_[i + 2 :]
    if choice == 1:
        i = int(rng.integers(ndim))
        for f in (2, 3):
            if shape_[i] % f == 0 and shape_[i] > 0:
                return shape_[:i] + (f, shape_[i] // f) + shape_[i + 1 :]
    return (int(np.prod(shape_)),)


def quantized_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random interleaved ggml blocks (groups, blocks, block bytes, lanes): random bytes under
    finite float16 factors (scales, minimums), where the block's format keeps them."""
    groups, blocks, size, lanes = shape
    if size == 2:  # bf16 values: float16 bits of values in [-1, 1] are finite read as bfloat16 too
        halves = rng.uniform(-1, 1, (groups, lanes, blocks, 1)).astype("<f2")
        return np.ascontiguousarray(halves.view(np.uint8).transpose(0, 2, 3, 1))
    fmt = next(f for f in FORMATS.values() if f.block_bytes == size)
    w = rng.integers(0, 256, size=(groups, lanes, blocks, size), dtype=np.uint8)
    top = 0.1 if fmt.block == 32 else 1e-3  # K-quants multiply d by six- or eight-bit scales
    for at in fmt.factors:
        w[..., at : at + 2] = rng.uniform(-top, top, (groups, lanes, blocks, 1)).astype("<f2").view(np.uint8)
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1))


def random_case(rng: np.random.Generator, name: str) -> tuple[list[tuple[int, ...]], list[str], dict]:
    """(input shapes, dtypes, parameters) of one random application of op `name`."""
    f32 = "float32"
    x = shape(rng)
    if name == "matmul":
        batch = (int(rng.integers(1, 4)),) if rng.random() < 0.3 else ()
        m, k, n = dim(rng), dim(rng), dim(rng)
        b_batch = (batch, (), tuple(1 for _ in batch))[int(rng.integers(3))]
        return [batch + (m, k), b_batch + (k, n)], [f32, f32], {}
    if name in BINARY:
        other = partner_shape(rng, x)
        return ([x, other] if rng.random() < 0.5 else [other, x]), [f32, f32], {}
    if name == "concat":
        axis = int(rng.integers(len(x)))
        count = int(rng.integers(1, 4))
        return [x[:axis] + (dim(rng, 0),) + x[axis + 1 :] for _ in range(count)], [f32] * count, {"axis": axis}
    if name == "get_rows":
        rows = int(rng.integers(1, 7))
        ids = tuple(dim(rng) for _ in range(int(rng.integers(1, 3))))
        return [(rows, dim(rng)), ids], [f32, "int32"], {}
    if name in ("qmatmul", "qget_rows"):
        fmt = FORMATS[str(rng.choice(sorted(FORMATS)))]
        groups, blocks, lanes = dim(rng), int(rng.integers(0, 4)), int(rng.choice([1, 2, 4]))
        weight = (groups, blocks, fmt.block_bytes, lanes)
        if name == "qget_rows":
            ids = tuple(dim(rng) for _ in range(int(rng.integers(1, 3))))
            return [(max(groups, 1),) + weight[1:], ids], ["uint8", "int32"], {"format": fmt.name}
        lead = tuple(dim(rng) for _ in range(int(rng.integers(1, 3))))
        return [lead + (blocks, fmt.block), weight], [f32, "uint8"], {"format": fmt.name}
    if name in COMPARISONS:
        other = partner_shape(rng, x)
        return ([x, other] if rng.random() < 0.5 else [other, x]), [f32, f32], {}
    if name == "mod":
        other = partner_shape(rng, x)
        kind = str(rng.choice(["int32", "int64"]))
        return ([x, other] if rng.random() < 0.5 else [other, x]), [kind, kind], {}
    if name == "where":
        shapes = [x, partner_shape(rng, x), partner_shape(rng, x)]
        order = rng.permutation(3)  # the full shape may come from any operand
        return [shapes[i] for i in order], ["bool", f32, f32], {}
    if name == "softmax_ext":
        x = shape(rng) if len(x) > 1 else x + (dim(rng),)
        return [x, partner_shape(rng, x)], [f32, f32], {"axis": int(rng.integers(-len(x), len(x))), "scale": 0.125}
    if name == "rope":
        tokens = tuple(dim(rng) for _ in range(int(rng.integers(1, 3))))
        x = tokens + (dim(rng), 2 * int(rng.integers(1, 5)))
        return [x, tokens], [f32, "int32"], {"base": 10000.0, "mode": str(rng.choice(["normal", "neox"]))}
    if name == "set_rows":
        dst = tuple(int(rng.integers(1, 6)) for _ in range(int(rng.integers(2, 4))))
        axis = int(rng.integers(1 if rng.random() < 0.3 else 0, len(dst)))
        tokens = int(rng.integers(0, dst[axis] + 1))
        ids = (dst[0], tokens) if axis > 0 and rng.random() < 0.3 else (tokens,)
        value = dst[:axis] + (tokens,) + dst[axis + 1 :]
        params = {"axis": axis}
        if axis > 0 and rng.random() < 0.3:  # some batch indices only: one sequence of a batched cache
            start = int(rng.integers(0, dst[0]))
            ids = (dst[0] - start - int(rng.integers(0, dst[0] - start)), tokens)
            value = (ids[0],) + dst[1:axis] + (tokens,) + dst[axis + 1 :]
            if rng.random() < 0.5:  # fed when the step runs (random_operands draws it)
                return [dst, ids, value, ()], [f32, "int32", f32, "int32"], params
            params["batch_start"] = start
        return [dst, ids, value], [f32, "int32", f32], params
    if name == "gqa_attention":  # query heads in runs over KV heads, some KV heads shared or unused
        batch, tokens, kv, ctx, width = (int(rng.integers(1, 4)) for _ in range(5))
        kv_of_head = sorted(int(h) for h in rng.integers(0, kv, size=int(rng.integers(1, 7))))
        cache = (batch, kv, ctx, width)
        mask = (int(rng.choice([1, batch])), tokens, ctx)
        kinds = [f32, *([str(rng.choice([f32, "float16"]))] * 2), f32]
        return (
            [(batch, tokens, len(kv_of_head), width), cache, cache, mask],
            kinds,
            {"kv_of_head": kv_of_head, "scale": 0.5},
        )
    if name == "top_k_combine":
        m = int(rng.integers(1, 9))
        return [x[:-1] + (m, 2)], ["float64"], {"k": int(rng.integers(1, m + 1))}
    return [x], [f32], params_for(rng, name, x)


def random_operands(rng: np.random.Generator, name: str, shapes, dtypes, params: dict) -> list[np.ndarray]:
    """Values for `random_case`'s shapes: divisors away from zero, row ids inside the table."""
    out = []
    for i, (s, t) in enumerate(zip(shapes, dtypes)):
        if name in ("get_rows", "qget_rows") and i == 1:
            out.append(rng.integers(0, shapes[0][0], size=s).astype(dtype_from_name(t)))
        elif t == "uint8" and name in ("qmatmul", "qget_rows"):
            out.append(quantized_blocks(rng, s))
        elif name == "set_rows" and i == 1:  # distinct rows in each list
            rows = shapes[0][params["axis"]]
            lists = [rng.permutation(rows)[: s[-1]] for _ in range(s[0] if len(s) == 2 else 1)]
            out.append(np.array(lists if len(s) == 2 else lists[0], dtype=dtype_from_name(t)).reshape(s))
        elif name == "set_rows" and i == 3:  # a fed batch start: the sequences fit after it
            out.append(np.array(rng.integers(0, shapes[0][0] - shapes[1][0] + 1), dtype=dtype_from_name(t)))
        elif name == "rope" and i == 1:
            out.append(rng.integers(0, 4096, size=s).astype(dtype_from_name(t)))
        elif name == "top_k_combine":
            out.append(candidates(rng, s))
        elif t == "bool":
            out.append(rng.random(s) < 0.5)
        elif name in ("sqrt", "rsqrt"):
            out.append(np.abs(values(rng, s, t)) + np.float32(0.1))
        elif name == "mod":  # a divisor of either sign, never 0
            span = rng.integers(1, 9, size=s) * rng.choice([-1, 1], size=s) if i == 1 else rng.integers(-50, 51, size=s)
            out.append(np.asarray(span).astype(dtype_from_name(t)))
        elif name == "eq":  # a few distinct values, so that equal pairs occur
            out.append(rng.integers(-2, 3, size=s).astype(dtype_from_name(t)))
        else:
            out.append(values(rng, s, t, divisor=name == "div" and i == 1))
    return out


def candidates(rng: np.random.Generator, shape_: tuple[int, ...]) -> np.ndarray:
    """(value, index) pairs as top_k_candidates makes them: distinct indices, some padding, ties."""
    out = np.empty(shape_)
    out[..., 0] = rng.integers(-3, 4, size=shape_[:-1]).astype(np.float64)  # ties on purpose
    out[..., 1] = np.argsort(rng.random(shape_[:-1]), axis=-1) * 3
    pad = rng.random(shape_[:-1]) < 0.2
    out[..., 0][pad], out[..., 1][pad] = -np.inf, -1
    return out
