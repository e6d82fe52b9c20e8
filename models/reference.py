"""Single-device NumPy references for every op of the table: the oracle.

Written apart from workers/kernels on purpose, so that a test comparing the two checks what
the kernels compute and not only how ops are distributed: floats are computed in float64 and
rounded once to the result's dtype, GELU's erf comes from another formula than the kernels', softmax and the norms are
the textbook formulas. Tests, the demo and the stress run compare against these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from split_state.dtypes import dtype_from_name

Params = dict[str, Any]


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _float_unary(fn: Callable[[np.ndarray], np.ndarray]) -> Callable:
    def ref(inputs: Sequence[np.ndarray], params: Params) -> np.ndarray:
        (x,) = inputs
        with np.errstate(all="ignore"):
            return fn(_f64(x)).astype(x.dtype)

    return ref


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Hendrycks & Gimpel): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    w = _f64(x)
    return (0.5 * w * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (w + 0.044715 * w**3)))).astype(np.asarray(x).dtype)


def _python_mod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Python's integer %, element by element (the floor division's remainder)."""
    x, y = np.broadcast_arrays(a, b)
    flat = [int(u) % int(v) for u, v in zip(x.reshape(-1), y.reshape(-1))]
    return np.array(flat, dtype=np.result_type(a, b)).reshape(x.shape)


def gelu_f16(x: np.ndarray) -> np.ndarray:
    """GELU as llama.cpp computes it on the CPU (ggml's GGML_GELU_FP16): x rounded to float16, its
    tanh GELU rounded to float16 (ggml reads it from a table of every float16); 0 at or below
    -10, x at or above 10. Here each value's GELU is worked out, in float32 arithmetic in the
    order ggml's ggml_gelu_f32 writes it (in float64, 371 of the 65,536 float16 inputs round
    to the neighbouring float16)."""
    x = np.asarray(x, np.float32)
    half = x.astype(np.float16).astype(np.float32)
    f = np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        inner = f(math.sqrt(2.0 / math.pi)) * half * (f(1) + f(0.044715) * half * half)
        g = (f(0.5) * half * (f(1) + np.tanh(inner))).astype(np.float16)
    return np.where(x <= -10, f(0), np.where(x >= 10, x, g.astype(np.float32)))


def erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7): another
    formula than the kernels' (a Chebyshev fit of erfc), checked against math.erf in the tests."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-a * a))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """GELU, exact: x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))."""
    w = _f64(x)
    return (0.5 * w * (1.0 + erf(w / math.sqrt(2.0)))).astype(np.asarray(x).dtype)


def silu(x: np.ndarray) -> np.ndarray:
    w = _f64(x)
    with np.errstate(over="ignore"):
        return (w / (1.0 + np.exp(-w))).astype(np.asarray(x).dtype)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    w = _f64(x)
    if w.size == 0:
        return np.asarray(x).copy()
    shifted = w - w.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.asarray(x).dtype)


def rms_norm(x: np.ndarray, axis: int = -1, eps: float = 1e-6) -> np.ndarray:
    w = _f64(x)
    if w.size == 0:
        return np.asarray(x).copy()
    return (w / np.sqrt(np.mean(w**2, axis=axis, keepdims=True) + eps)).astype(np.asarray(x).dtype)


def layer_norm(x: np.ndarray, axis: int = -1, eps: float = 1e-5) -> np.ndarray:
    w = _f64(x)
    if w.size == 0:
        return np.asarray(x).copy()
    centred = w - w.mean(axis=axis, keepdims=True)
    return (centred / np.sqrt(np.var(w, axis=axis, keepdims=True) + eps)).astype(np.asarray(x).dtype)


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable:
    def ref(inputs: Sequence[np.ndarray], params: Params) -> np.ndarray:
        a, b = inputs
        if np.issubdtype(a.dtype, np.integer):
            return fn(a, b).astype(a.dtype)
        with np.errstate(all="ignore"):
            return fn(_f64(a), _f64(b)).astype(a.dtype)

    return ref


def _matmul(inputs, params):
    a, b = inputs
    if np.issubdtype(a.dtype, np.integer):
        return np.matmul(a.astype(np.int64), b.astype(np.int64)).astype(a.dtype)
    out = np.float32 if np.float32 in (a.dtype, b.dtype) else a.dtype  # mixed precision: float32
    return np.matmul(_f64(a), _f64(b)).astype(out)


def _softmax_ext(inputs, params):
    x, mask = inputs
    return softmax((_f64(x) * params["scale"] + _f64(mask)).astype(np.float64), params["axis"]).astype(x.dtype)


def _gqa_attention(inputs, params):
    """Each query head h against the keys and values of KV head kv_of_head[h], head by head in
    float64: softmax(q . k * scale + mask) @ v."""
    q, keys, values, mask = (_f64(a) for a in inputs)
    out = np.empty(q.shape)
    for b in range(q.shape[0]):
        for h, kv in enumerate(params["kv_of_head"]):
            scores = q[b, :, h] @ keys[b, kv].T * params["scale"] + mask[b if mask.shape[0] > 1 else 0]
            out[b, :, h] = softmax(scores, -1) @ values[b, kv]
    return out.astype(inputs[0].dtype)


def rope(x: np.ndarray, positions: np.ndarray, base: float, mode: str, freqs=None) -> np.ndarray:
    """Rotary embedding as complex multiplication: pairs (x[2i], x[2i+1]) (ggml's normal mode) or
    (x[i], x[i + d/2]) (NeoX) are complex numbers turned by position * base^(-2i/d) * freqs[i]
    radians (freqs: each frequency's multiplier, 1 without)."""
    d = x.shape[-1]
    w = _f64(x)
    scale = 1.0 if freqs is None else np.asarray(freqs, np.float64)
    theta = np.asarray(positions, np.float64)[..., None, None] * (base ** (-np.arange(0, d, 2) / d) * scale)
    if mode == "neox":
        z = (w[..., : d // 2] + 1j * w[..., d // 2 :]) * np.exp(1j * theta)
        out = np.concatenate([z.real, z.imag], axis=-1)
    else:
        z = (w[..., 0::2] + 1j * w[..., 1::2]) * np.exp(1j * theta)
        out = np.stack([z.real, z.imag], axis=-1).reshape(w.shape)
    return out.astype(x.dtype)


def _set_rows(inputs, params):
    dst, ids, value = inputs[:3]
    out = dst.copy()
    axis = params["axis"]
    if ids.ndim == 1:
        for j, row in enumerate(ids.tolist()):
            _put(out, axis, row, np.take(value, j, axis=axis))
    else:
        start = int(inputs[3]) if len(inputs) == 4 else params.get("batch_start", 0)
        for b in range(ids.shape[0]):
            for j, row in enumerate(ids[b].tolist()):
                _put(out[start + b], axis - 1, row, np.take(value[b], j, axis=axis - 1))
    return out


def _put(out: np.ndarray, axis: int, row: int, values: np.ndarray) -> None:
    index = [slice(None)] * out.ndim
    index[axis] = row
    out[tuple(index)] = values


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """(..., k, 2) float64 (value, index) pairs of the k largest along the last axis, largest first;
    ties to the lower index (as numpy.argmax); NaN ranks as -inf."""
    v = np.where(np.isnan(values), -np.inf, values.astype(np.float64))
    flat = v.reshape(-1, v.shape[-1])
    out = np.empty((flat.shape[0], k, 2))
    for r, row in enumerate(flat):
        ranked = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        out[r] = [[row[i], i] for i in ranked]
    return out.reshape(v.shape[:-1] + (k, 2))


def _top_k_combine(inputs, params):
    (c,) = inputs
    k = params["k"]
    flat = c.reshape(-1, c.shape[-2], 2)
    out = np.empty((flat.shape[0], k, 2))
    for r, rows in enumerate(flat):
        v = [(-np.inf if np.isnan(val) else val, idx) for val, idx in rows.tolist()]
        ranked = sorted(v, key=lambda p: (-p[0], np.inf if p[1] < 0 else p[1]))[:k]
        out[r] = ranked
    return out.reshape(c.shape[:-2] + (k, 2))


def _sum(inputs, params):
    (x,) = inputs
    if np.issubdtype(x.dtype, np.integer):
        return np.sum(x, axis=params["axis"], keepdims=params["keepdims"], dtype=x.dtype)
    return np.sum(_f64(x), axis=params["axis"], keepdims=params["keepdims"]).astype(x.dtype)


def _mean(inputs, params):
    (x,) = inputs
    with np.errstate(all="ignore"):
        total = np.sum(_f64(x), axis=params["axis"], keepdims=params["keepdims"])
        return (total / x.shape[params["axis"]] if x.shape[params["axis"]] else total * np.nan).astype(x.dtype)


def _get_rows(inputs, params):
    table, ids = inputs
    return table[np.asarray(ids, dtype=np.int64)]


def dequantize_blocks(w: np.ndarray, name: str) -> np.ndarray:
    """(rows, blocks, bytes) of ggml blocks -> (rows, blocks * block) float64, value by value from
    ggml's definitions (its dequantize_row_* in C): q8_0 d * int8; q4_0 d * (nibble - 8); q4_1
    d * nibble + m, where byte j of the quants holds value j in its low and value j + 16 in its
    high four bits; q4_k and q6_k below."""
    rows, blocks, _ = w.shape
    if name == "bf16":  # the top 16 bits of a float32
        halves = np.frombuffer(w.tobytes(), "<u2").astype(np.uint32) << np.uint32(16)
        return halves.view(np.float32).astype(np.float64).reshape(rows, blocks)
    per_block = 256 if name in ("q4_k", "q5_k", "q6_k") else 32
    out = np.zeros((rows, blocks, per_block))
    for r in range(rows):
        for b in range(blocks):
            block = bytes(w[r, b])
            if name in ("q4_k", "q5_k"):
                out[r, b] = _q4_k_block(block, fifth=name == "q5_k")
                continue
            if name == "q6_k":
                out[r, b] = _q6_k_block(block)
                continue
            d = _half(block, 0)
            if name in ("q5_0", "q5_1"):
                out[r, b] = _q5_block(block, name == "q5_1")
                continue
            if name == "q8_0":
                out[r, b] = d * np.frombuffer(block[2:34], np.int8)
                continue
            m = _half(block, 2) if name == "q4_1" else 0.0
            quants = block[4:20] if name == "q4_1" else block[2:18]
            for j, byte in enumerate(quants):
                low, high = byte & 15, byte >> 4
                if name == "q4_0":
                    low, high = low - 8, high - 8
                out[r, b, j], out[r, b, j + 16] = d * low + m, d * high + m
    return out.reshape(rows, blocks * per_block)


def _half(block: bytes, at: int) -> float:
    return float(np.frombuffer(block[at : at + 2], "<f2")[0])


def _q5_block(block: bytes, with_min: bool) -> list[float]:
    """d (and m for q5_1), a little-endian 32-bit word of fifth bits, 16 bytes of nibbles."""
    d, m = _half(block, 0), (_half(block, 2) if with_min else 0.0)
    at = 4 if with_min else 2
    high = int.from_bytes(block[at : at + 4], "little")
    values = [0.0] * 32
    for j, byte in enumerate(block[at + 4 : at + 20]):
        x0 = (byte & 0x0F) | (((high >> j) << 4) & 0x10)
        x1 = (byte >> 4) | ((high >> (j + 12)) & 0x10)
        if not with_min:
            x0, x1 = x0 - 16, x1 - 16
        values[j], values[j + 16] = x0 * d + m, x1 * d + m
    return values


def _q4_k_block(block: bytes, fifth: bool = False) -> list[float]:
    """d, dmin (float16), 12 bytes of six-bit scales and minimums, (q5_k: 32 bytes qh of fifth
    bits,) 128 bytes of nibbles: ggml's dequantize_row_q4_K and _q5_K."""
    d, dmin, scales = _half(block, 0), _half(block, 2), block[4:16]
    qh, q = (block[16:48], block[48:176]) if fifth else (bytes(32), block[16:144])

    def scale_min(j: int) -> tuple[int, int]:  # ggml's get_scale_min_k4
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    values = []
    for chunk in range(4):  # 64 values: the low nibbles of 32 bytes, then their high nibbles
        (sc1, m1), (sc2, m2) = scale_min(2 * chunk), scale_min(2 * chunk + 1)
        quants = q[32 * chunk : 32 * chunk + 32]
        u1, u2 = 1 << (2 * chunk), 2 << (2 * chunk)
        values += [d * sc1 * ((byte & 0xF) + (16 if qh[j] & u1 else 0)) - dmin * m1 for j, byte in enumerate(quants)]
        values += [d * sc2 * ((byte >> 4) + (16 if qh[j] & u2 else 0)) - dmin * m2 for j, byte in enumerate(quants)]
    return values


def _q6_k_block(block: bytes) -> list[float]:
    """128 bytes ql (low four bits), 64 bytes qh (top two), 16 int8 scales, d (float16)."""
    ql, qh, d = block[0:128], block[128:192], _half(block, 208)
    scales = np.frombuffer(block[192:208], np.int8)
    values = [0.0] * 256
    for half in range(2):
        low, top, sc, y = ql[64 * half :], qh[32 * half :], scales[8 * half :], 128 * half
        for lane in range(32):
            s = lane // 16
            q1 = ((low[lane] & 0xF) | (((top[lane] >> 0) & 3) << 4)) - 32
            q2 = ((low[lane + 32] & 0xF) | (((top[lane] >> 2) & 3) << 4)) - 32
            q3 = ((low[lane] >> 4) | (((top[lane] >> 4) & 3) << 4)) - 32
            q4 = ((low[lane + 32] >> 4) | (((top[lane] >> 6) & 3) << 4)) - 32
            values[y + lane] = d * sc[s] * q1
            values[y + lane + 32] = d * sc[s + 2] * q2
            values[y + lane + 64] = d * sc[s + 4] * q3
            values[y + lane + 96] = d * sc[s + 6] * q4
    return values


def _in_file_order(w):
    """The workers' (groups, blocks, bytes, lanes), row g * lanes + l at [g, :, :, l], as the
    file's (rows, blocks, bytes)."""
    rows = np.concatenate([w[:, :, :, lane][:, None] for lane in range(w.shape[3])], axis=1)
    return rows.reshape(w.shape[0] * w.shape[3], *w.shape[1:3])


def _qmatmul(inputs, params):
    xb, w = inputs
    x = _f64(xb).reshape(xb.shape[:-2] + (xb.shape[-2] * xb.shape[-1],))
    out = x @ dequantize_blocks(_in_file_order(w), params["format"]).T
    return out.reshape(out.shape[:-1] + (w.shape[0], w.shape[3])).astype(np.float32)


def _qget_rows(inputs, params):
    table, ids = inputs
    values = dequantize_blocks(_in_file_order(table), params["format"])
    return values[np.asarray(ids, dtype=np.int64)].astype(np.float32)


def _slice(inputs, params):
    (x,) = inputs
    index = [slice(None)] * x.ndim
    index[params["axis"]] = slice(params["start"], params["stop"])
    return x[tuple(index)].copy()


REFERENCES: dict[str, Callable[[Sequence[np.ndarray], Params], np.ndarray]] = {
    "matmul": _matmul,
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "div": _binary(np.divide),
    "mod": lambda i, p: _python_mod(*i),
    "scale": lambda i, p: _float_unary(lambda w: w * p["factor"])(i, p),
    "neg": lambda i, p: np.negative(i[0]),
    "gelu": lambda i, p: gelu_tanh(i[0]),
    "gelu_erf": lambda i, p: gelu_erf(i[0]),
    "gelu_f16": lambda i, p: gelu_f16(i[0]).astype(i[0].dtype),
    "silu": lambda i, p: silu(i[0]),
    "relu": lambda i, p: np.where(i[0] > 0, i[0], np.zeros((), i[0].dtype)).astype(i[0].dtype),
    "exp": _float_unary(np.exp),
    "tanh": _float_unary(np.tanh),
    "cast": lambda i, p: i[0].astype(dtype_from_name(p["dtype"])),
    "softmax": lambda i, p: softmax(i[0], p["axis"]),
    "rms_norm": lambda i, p: rms_norm(i[0], p["axis"], p["eps"]),
    "layer_norm": lambda i, p: layer_norm(i[0], p["axis"], p["eps"]),
    "sum": _sum,
    "mean": _mean,
    "reshape": lambda i, p: np.reshape(i[0], p["shape"]).copy(),
    "transpose": lambda i, p: np.transpose(i[0], p["axes"]).copy(),
    "concat": lambda i, p: np.concatenate(list(i), axis=p["axis"]),
    "slice": _slice,
    "get_rows": _get_rows,
    "qmatmul": _qmatmul,
    "qget_rows": _qget_rows,
    "sqrt": _float_unary(np.sqrt),
    "rsqrt": _float_unary(lambda w: 1.0 / np.sqrt(w)),
    "lt": lambda i, p: np.less(_f64(i[0]), _f64(i[1])),
    "le": lambda i, p: np.less_equal(_f64(i[0]), _f64(i[1])),
    "eq": lambda i, p: np.equal(_f64(i[0]), _f64(i[1])),
    "where": lambda i, p: np.where(i[0], i[1], i[2]).astype(i[1].dtype),
    "softmax_ext": _softmax_ext,
    "gqa_attention": _gqa_attention,
    "rope": lambda i, p: rope(i[0], i[1], p["base"], p["mode"], p.get("freqs")),
    "set_rows": _set_rows,
    "top_k_combine": _top_k_combine,
}


def reference(name: str, inputs: Sequence[np.ndarray], params: Params) -> np.ndarray:
    """The single-device result of op `name` with canonical parameters (as `ops.infer` returns)."""
    return REFERENCES[name]([np.asarray(x) for x in inputs], params)
