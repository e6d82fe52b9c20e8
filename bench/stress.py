"""Random graphs on a MetaDevice, each result compared with NumPy; reproducible by seed.

Graph `i` of a run with seed `K` draws everything from `numpy.random.default_rng([K, i])`: input
shapes of rank 1-4 with size-0 and size-1 axes, split states with uneven and zero extents and
1-4 segments, dtypes, and a chain of 1-5 ops from the rule table. The reference applies the same
independent NumPy reference (models/reference.py) to the global arrays on one device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench import operands as draw
from meta.device import MetaDevice
from meta.tensor import Tensor, apply
from models.reference import reference
from split_state.dtypes import dtype_from_name
from split_state.errors import MetaError, ShapeError
from split_state.ops import OPS, infer
from split_state.states import MIRRORED, PARTIAL, Split, State

AXIS_OPS = {"concat", "softmax", "rms_norm", "layer_norm", "sum", "mean", "slice", "reshape", "transpose"}
PRECISION = ("bfloat16", "float16", "float32", "float64")
DTYPES = ("float32", "float32", "float16", "bfloat16", "int32")
FLOAT_ONLY = {"scale", "gelu", "gelu_erf", "silu", "exp", "tanh", "softmax", "rms_norm", "layer_norm", "mean", "div"}


@dataclass
class Graph:
    seed: tuple[int, int]
    lines: list[str] = field(default_factory=list)
    overflowed: bool = False
    coarsest: str = "float64"  # the least precise float dtype the chain went through

    def saw(self, dtype: np.dtype) -> None:
        name = np.dtype(dtype).name  # by name: ml_dtypes' bfloat16 has kind "V", not "f"
        if name in PRECISION and PRECISION.index(name) < PRECISION.index(self.coarsest):
            self.coarsest = name

    def note(self, text: str) -> None:
        self.lines.append(text)

    def reproduction(self) -> str:
        return "\n".join([f"# graph seed {list(self.seed)}", *self.lines])


def random_state(rng: np.random.Generator, shape: tuple[int, ...], n: int, partial: bool = True) -> State:
    kinds = ["M", "S", "S"] + (["P"] if partial else [])
    kind = kinds[rng.integers(len(kinds))] if shape else "M"
    if kind == "M":
        return MIRRORED
    if kind == "P":
        return PARTIAL
    axis = int(rng.integers(len(shape)))
    n_segments = int(rng.integers(1, 5))
    sizes = _composition(rng, shape[axis], n_segments)
    return Split(axis, tuple(_composition(rng, size, n) for size in sizes))


def _composition(rng: np.random.Generator, total: int, parts: int) -> tuple[int, ...]:
    cuts = np.sort(rng.integers(0, total + 1, parts - 1)) if parts > 1 else np.array([], int)
    bounds = [0, *cuts.tolist(), total]
    return tuple(bounds[i + 1] - bounds[i] for i in range(parts))


class Builder:
    """Draws operands compatible with an op, as fresh resident inputs or from the chain so far."""

    def __init__(self, dev: MetaDevice, rng: np.random.Generator, graph: Graph):
        self.dev, self.rng, self.graph = dev, rng, graph
        self.handles: list[Tensor] = []

    def label(self, t: Tensor, cur: Tensor) -> str:
        """How a reproduction names an operand: y (the chain so far) or tK (the K-th input)."""
        if t is cur:
            return "y"
        return next((f"t{i + 1}" for i, h in enumerate(self.handles) if h is t), "?")

    def new(self, shape, dtype: str, partial: bool = True, values: np.ndarray | None = None):
        """A fresh resident input in a random state: (handle, its value)."""
        x = draw.values(self.rng, tuple(shape), dtype) if values is None else values
        state = random_state(self.rng, tuple(shape), self.dev.n, partial)
        t = self.dev.tensor(x, state)
        self.handles.append(t)
        self.graph.note(f"t{len(self.handles)} = input {tuple(shape)} {dtype} {state}")
        return t, x

    def operands(self, name: str, cur: Tensor, ref: np.ndarray, dtype: str):
        """(inputs, reference inputs, params) for op `name` applied to the current value."""
        rng, shape = self.rng, ref.shape
        if name == "matmul":
            if ref.ndim < 2:
                raise ShapeError("needs 2 axes")
            other, x = self.new(shape[:-2] + (shape[-1], int(rng.integers(0, 5))), dtype)
            return [cur, other], [ref, x], {}
        if name in draw.BINARY:
            oshape = draw.partner_shape(rng, shape)
            other, x = self.new(oshape, dtype, values=draw.values(rng, oshape, dtype, divisor=name == "div"))
            # the chain value is never a divisor: dividing by a computed value near zero amplifies
            # any rounding difference without bound (ill-conditioned, not a runtime error)
            swap = name != "div" and rng.random() < 0.5
            return ([other, cur], [x, ref], {}) if swap else ([cur, other], [ref, x], {})
        if ref.ndim == 0 and name in AXIS_OPS:
            raise ShapeError(f"{name} needs an axis")
        if name == "concat":
            axis = int(rng.integers(ref.ndim))
            other, x = self.new(shape[:axis] + (int(rng.integers(0, 4)),) + shape[axis + 1 :], dtype)
            return [cur, other], [ref, x], {"axis": axis}
        if name == "get_rows":
            rows = max(1, ref.shape[0]) if ref.ndim == 2 else 3
            table, t = (cur, ref) if ref.ndim == 2 and ref.shape[0] > 0 else self.new((rows, 3), dtype)
            ids_shape = draw.shape(rng, max_rank=2)
            ids, i = self.new(
                ids_shape, "int32", partial=False, values=rng.integers(0, t.shape[0], size=ids_shape).astype(np.int32)
            )
            return [table, ids], [t, i], {}
        # a larger eps than a model's: norms of tiny rows are ill-conditioned in float16
        return [cur], [ref], draw.params_for(rng, name, shape, eps=1e-3, casts=("float32", "float16", "int32"))


def tolerance(dtype: np.dtype, scale: float) -> float:
    base = {"float16": 3e-2, "bfloat16": 1e-1}.get(np.dtype(dtype).name, 1e-3)
    return base * max(1.0, scale)


def matches(got: np.ndarray, ref: np.ndarray, precision: str | None = None) -> bool:
    """Equal within a dtype tolerance. Where the reference overflowed, ours must be non-finite too,
    but which non-finite value may differ: a Partial operand holds zeros on some devices, and
    0/0 or 0*inf there gives NaN where one device computes +-inf (IEEE, not a planning error).
    `precision`: the least precise float dtype the computation went through (a bfloat16 sum
    reduced in another order and then cast to float32 still differs by a bfloat16 ulp)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    g, r = got.astype(np.float64), ref.astype(np.float64)
    finite = np.isfinite(r)
    if not np.array_equal(finite, np.isfinite(g)):
        return False
    scale = float(np.max(np.abs(r[finite]), initial=0.0))
    dtype = np.dtype(precision or ref.dtype)
    return bool(np.allclose(g[finite], r[finite], rtol=tolerance(dtype, 0), atol=tolerance(dtype, scale)))


def check_graph(dev: MetaDevice, seed: int, index: int) -> tuple[bool, Graph]:
    """Build and run one random graph; (matches NumPy, description)."""
    rng = np.random.default_rng([seed, index])
    graph = Graph((seed, index))
    build = Builder(dev, rng, graph)
    dtype = str(rng.choice(DTYPES))
    try:
        cur, ref = build.new(draw.shape(rng, max_rank=4), dtype)
        names = sorted(OPS)
        for _ in range(int(rng.integers(1, 6))):
            name = str(rng.choice(names))
            if name in FLOAT_ONLY and dtype == "int32":
                continue
            try:
                inputs, refs, params = build.operands(name, cur, ref, dtype)
                _, out_dtype, canon = infer(name, [r.shape for r in refs], [str(r.dtype) for r in refs], params)
            except ShapeError:
                continue
            ref = reference(name, refs, canon)
            graph.overflowed |= ref.dtype.name in PRECISION and not bool(np.all(np.isfinite(ref.astype(np.float64))))
            for r in (*refs, ref):
                graph.saw(r.dtype)
            graph.note(f"y = {name}({', '.join(build.label(t, cur) for t in inputs)}, {params})")
            cur = apply(name, *inputs, **params)
            dtype = out_dtype
        got = cur.numpy()
        # once a value overflowed, IEEE lets devices holding Partial zeros see 0*inf = NaN where one
        # device sees inf, and exp(-inf) = 0 downstream hides it: such graphs are checked for
        # shape and dtype only, and counted apart
        ok = (got.shape, got.dtype) == (ref.shape, ref.dtype) if graph.overflowed else matches(got, ref, graph.coarsest)
        if not ok:
            graph.note(f"# expected {ref!r}\n# got      {got!r}")
        return ok, graph
    finally:
        dev.free(*build.handles)


def run(
    dev: MetaDevice,
    seconds: float,
    seed: int,
    out: Callable[[str], None] = lambda s: print(s, flush=True),
    limit: int | None = None,
) -> int:
    """Random graphs until `seconds` pass (or `limit` graphs); 0 if all matched, 1 otherwise."""
    start = time.monotonic()
    checked = overflowed = 0
    np.seterr(all="ignore")  # overflow in float16 is part of the test, not news
    while time.monotonic() - start < seconds and (limit is None or checked < limit):
        try:
            ok, graph = check_graph(dev, seed, checked)
        except MetaError as exc:
            out(f"graph {checked} (seed {seed}) raised {type(exc).__name__}: {exc}")
            return 1
        checked += 1
        overflowed += graph.overflowed
        if not ok:
            out(f"MISMATCH in graph {checked - 1}; reproduce with --seed {seed} (graph index {checked - 1}):")
            out(graph.reproduction())
            return 1
        if checked % 50 == 0:
            out(f"{checked} graphs checked ({time.monotonic() - start:.0f} s)")
    out(
        f"{checked} random graphs matched NumPy on {dev.n} workers in {time.monotonic() - start:.1f} s (seed {seed}; "
        f"{overflowed} overflowed to inf/nan and were checked for shape and dtype only)"
    )
    return 0
