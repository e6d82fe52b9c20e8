"""Tensor handles: lazy ops with the NumPy spelling; reading a result runs what it needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from meta.graph import MOVE, Node
from meta.memo import Memo, frozen
from meta.planner import held_by
from split_state.dtypes import dtype_from_name, dtype_name
from split_state.errors import ShapeError
from split_state.ops import infer
from split_state.quant import quant_format
from split_state.states import State

if TYPE_CHECKING:
    from meta.device import MetaDevice


SCALARS = (int, float, np.integer, np.floating)


class Tensor:
    # NumPy defers to our operators (np.float32(2) * t calls t.__rmul__, not np.multiply)
    __array_ufunc__ = None

    def __init__(self, device: MetaDevice, node: Node):
        self.device = device
        self.node = node

    # -- facts ----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> np.dtype:
        return dtype_from_name(self.node.dtype)

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    @property
    def state(self) -> State | None:
        """The split state once resident (None while only a recipe)."""
        return self.node.state

    def __repr__(self) -> str:
        where = f"{self.node.state}" if self.node.resident else "lazy"
        return f"Tensor({self.node.name or self.node.op or 'input'}, shape={self.shape}, {self.node.dtype}, {where})"

    # -- running --------------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        return self.device.get(self)

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def realize(self) -> Tensor:
        self.device.run(self)
        return self

    def free(self) -> None:
        self.device.free(self)

    def redistribute(self, state: State) -> Tensor:
        return _make(MOVE, [self], {"state": state}, self.shape, self.node.dtype)

    # -- ops ------------------------------------------------------------------------------------
    def __matmul__(self, other: Tensor) -> Tensor:
        return apply("matmul", self, other)

    def __add__(self, other: Any) -> Tensor:
        return apply("add", self, _operand(self, other))

    def __radd__(self, other: Any) -> Tensor:
        return apply("add", _operand(self, other), self)

    def __sub__(self, other: Any) -> Tensor:
        return apply("sub", self, _operand(self, other))

    def __rsub__(self, other: Any) -> Tensor:
        return apply("sub", _operand(self, other), self)

    def __mul__(self, other: Any) -> Tensor:
        if isinstance(other, SCALARS) and not isinstance(other, bool):
            return apply("scale", self, factor=float(other))
        return apply("mul", self, other)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Tensor:
        if isinstance(other, SCALARS) and not isinstance(other, bool):
            return apply("scale", self, factor=1.0 / float(other))
        return apply("div", self, other)

    def __neg__(self) -> Tensor:
        return apply("neg", self)

    @property
    def T(self) -> Tensor:  # noqa: N802 - NumPy's spelling
        return self.transpose()

    def transpose(self, *axes: int) -> Tensor:
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (list, tuple)) else axes
        return apply("transpose", self, axes=tuple(axes) if axes else None)

    def reshape(self, *shape: int) -> Tensor:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape
        return apply("reshape", self, shape=tuple(shape))

    def sum(self, axis: int, keepdims: bool = False) -> Tensor:
        return apply("sum", self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int, keepdims: bool = False) -> Tensor:
        return apply("mean", self, axis=axis, keepdims=keepdims)

    def softmax(self, axis: int = -1) -> Tensor:
        return apply("softmax", self, axis=axis)

    def rms_norm(self, axis: int = -1, eps: float = 1e-6) -> Tensor:
        return apply("rms_norm", self, axis=axis, eps=eps)

    def layer_norm(self, axis: int = -1, eps: float = 1e-5) -> Tensor:
        return apply("layer_norm", self, axis=axis, eps=eps)

    def gelu(self) -> Tensor:
        return apply("gelu", self)

    def gelu_erf(self) -> Tensor:
        return apply("gelu_erf", self)

    def gelu_f16(self) -> Tensor:
        """GELU (tanh) as llama.cpp computes it on the CPU: x rounded to float16 and looked up in
        a table of float16 results (Gemma's gate; models.reference.gelu_f16)."""
        return apply("gelu_f16", self)

    def silu(self) -> Tensor:
        return apply("silu", self)

    def relu(self) -> Tensor:
        return apply("relu", self)

    def exp(self) -> Tensor:
        return apply("exp", self)

    def tanh(self) -> Tensor:
        return apply("tanh", self)

    def sqrt(self) -> Tensor:
        return apply("sqrt", self)

    def rsqrt(self) -> Tensor:
        return apply("rsqrt", self)

    def __mod__(self, other: Any) -> Tensor:
        return apply("mod", self, _operand(self, other))

    def __lt__(self, other: Any) -> Tensor:
        return apply("lt", self, _operand(self, other))

    def __le__(self, other: Any) -> Tensor:
        return apply("le", self, _operand(self, other))

    def __gt__(self, other: Any) -> Tensor:
        return apply("lt", _operand(self, other), self)

    def __ge__(self, other: Any) -> Tensor:
        return apply("le", _operand(self, other), self)

    def eq(self, other: Any) -> Tensor:
        """Elementwise ==, as a bool tensor (`==` itself keeps Python's identity meaning)."""
        return apply("eq", self, _operand(self, other))

    def softmax_masked(self, mask: Tensor, scale: float = 1.0, axis: int = -1) -> Tensor:
        """softmax(self * scale + mask) in one op (ggml's soft_max_ext); mask broadcasts."""
        return apply("softmax_ext", self, mask, axis=axis, scale=scale)

    def gqa_attention(self, keys: Tensor, values: Tensor, mask: Tensor, kv_of_head, scale: float = 1.0) -> Tensor:
        """softmax(q . k * scale + mask) @ v for q = self (batch, tokens, heads, dim), each query
        head h against KV head kv_of_head[h] of keys and values (batch, kv heads, ctx, dim); mask
        (1 or batch, tokens, ctx). The attention of a split by query heads where a KV head's
        group is cut between devices (each holds the KV heads its query heads read)."""
        return apply("gqa_attention", self, keys, values, mask, kv_of_head=[int(h) for h in kv_of_head], scale=scale)

    def rope(self, positions: Tensor, base: float = 10000.0, mode: str = "normal", freqs=None) -> Tensor:
        """Rotary position embedding of (..., tokens, heads, head_dim) at integer `positions`
        (..., tokens): mode "normal" rotates adjacent pairs (ggml), "neox" the two halves; pair i
        turns by position * base^(-2i / head_dim) * freqs[i] (`freqs`: head_dim / 2 multipliers,
        1 / a linear scaling's factor or Llama 3.1's frequency factors; none: 1)."""
        extra = {} if freqs is None else {"freqs": [float(f) for f in freqs]}
        return apply("rope", self, positions, base=base, mode=mode, **extra)

    def set_rows(self, ids: Tensor, value: Tensor, axis: int = 0, batch_start: int | Tensor | None = None) -> Tensor:
        """Write `value` into rows `ids` along `axis`, in place (ggml's SET_ROWS): the result is
        this tensor's own storage, under its own id, and reading either handle after the run sees
        the write. ids: (tokens,), or (batch, tokens) with one row list per index of axis 0,
        for the indices from `batch_start` on (one sequence of a batched cache, say): an int,
        or a 0-d integer tensor, read when the step runs (a fed slot: one plan for every one)."""
        if isinstance(batch_start, Tensor):
            return apply("set_rows", self, ids, value, batch_start, axis=axis)
        extra = {} if batch_start is None else {"batch_start": batch_start}
        return apply("set_rows", self, ids, value, axis=axis, **extra)

    def top_k(self, k: int) -> tuple[Tensor, Tensor]:
        """(values, int64 indices) of the k largest along the last axis, largest first, ties to the
        lower index. Over a split axis every device picks its own k and only those candidates
        travel: the whole axis is never gathered."""
        group = held_by(self.node)  # candidates: k from each device that holds a part
        devices = self.device.n if group is None else len(group)
        candidates = apply("top_k_candidates", self, k=k, devices=devices)
        pairs = apply("top_k_combine", candidates, k=k)  # (..., k, 2): value, index
        last = pairs.ndim - 1
        values = apply("slice", pairs, axis=last, start=0, stop=1).reshape(*self.shape[:-1], k)
        indices = apply("slice", pairs, axis=last, start=1, stop=2).reshape(*self.shape[:-1], k)
        return values.astype(self.dtype), indices.astype(np.int64)

    def argmax(self) -> Tensor:
        """int64 index of the largest element along the last axis (lowest index on ties)."""
        _, indices = self.top_k(1)
        return indices.reshape(*self.shape[:-1])

    def astype(self, dtype: Any) -> Tensor:
        return apply("cast", self, dtype=dtype_name(dtype))

    def __getitem__(self, index: Any) -> Tensor:
        """Basic slicing with step 1 (`x[:, 2:5]`): one slice op per sliced axis."""
        index = index if isinstance(index, tuple) else (index,)
        out = self
        for axis, item in enumerate(index):
            if not isinstance(item, slice) or item.step not in (None, 1):
                raise ShapeError(f"only basic slices with step 1 are supported, got {item!r} on axis {axis}")
            if item != slice(None):
                start, stop, _ = item.indices(self.shape[axis])
                out = apply("slice", out, axis=axis, start=start, stop=stop)
        return out


def _operand(like: Tensor, value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    return like.device.tensor(np.asarray(value, dtype=like.dtype))


def _make(
    op: str, inputs: Sequence[Tensor], params: dict, shape, dtype: str, name: str = "", params_key=None
) -> Tensor:
    device = inputs[0].device
    if any(t.device is not device for t in inputs):
        raise ShapeError(f"{op}: operands live on different MetaDevices")
    node = Node(op, tuple(t.node for t in inputs), params, tuple(shape), dtype, name, frozen_params=params_key)
    return Tensor(device, node)


# (op, frozen params, input shapes, input dtypes) -> (shape, dtype, canonical params, their frozen
# form): what `infer` says is a pure function of those, and a decoder's layers ask it the same
# questions (a SmolLM2 prefill graph: ~1,000 ops, ~40 distinct); its canonical parameters are
# then one object for all the nodes that share them, which nothing changes
_INFERRED = Memo(4096)


def apply(op: str, *inputs: Tensor, name: str = "", **params: Any) -> Tensor:
    """Record op `op` on `inputs`; shapes and parameters are checked now, nothing runs yet."""
    shapes = tuple(t.shape for t in inputs)
    dtypes = tuple(t.node.dtype for t in inputs)

    def work() -> tuple:
        shape, dtype, canon = infer(op, shapes, dtypes, params)
        return tuple(shape), dtype, canon, frozen(canon)

    shape, dtype, canon, canon_key = _INFERRED.get((op, frozen(params), shapes, dtypes), work)
    return _make(op, inputs, canon, shape, dtype, name, canon_key)


# -- the functional spelling --------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    return apply("matmul", a, b)


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    return apply("concat", *tensors, axis=axis)


def get_rows(table: Tensor, ids: Tensor) -> Tensor:
    return apply("get_rows", table, ids)


def qmatmul(x: Tensor, weight: Tensor, format: str, activations: str = "f32") -> Tensor:
    """x (..., k) times a block-quantized weight of n rows of k values, interleaved as the workers
    keep it ((n / lanes, k / block, block bytes, lanes), split_state/quant.py): (..., n), as x @
    the dequantized weight transposed. `activations`: "f32" multiplies x as it is (exact to
    float32 rounding); "q8" lets a CPU worker quantize x's rows into 8-bit blocks first and
    multiply integers, as llama.cpp does (workers/backends/cpu/int8_products.py)."""
    block = quant_format(format).block
    if not x.shape or x.shape[-1] % block:
        raise ShapeError(f"qmatmul: x's last axis ({x.shape}) is not a whole number of {block}-value blocks")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    product = apply("qmatmul", blocks, weight, format=format, activations=activations)
    return product.reshape(*product.shape[:-2], product.shape[-2] * product.shape[-1])


def qget_rows(table: Tensor, ids: Tensor, format: str) -> Tensor:
    """Rows `ids` of a block-quantized table, dequantized: ids.shape + (k,)."""
    return apply("qget_rows", table, ids, format=format)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return x.softmax(axis)


def where(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return apply("where", cond, a, b)
