"""Random graphs on a MetaDevice, each result compared with NumPy; reproducible by seed.

Graph `i` of a run with seed `K` draws everything from `numpy.random.default_rng([K, i])`: input
shapes of rank 1-4 with size-0 and size-1 axes, split states with uneven and zero extents and
1-4 segments, dtypes, and a chain of 1-20 ops from the rule table (in-place row writes, top-k and
explicit redistributions to random states included), some intermediate values kept as extra
outputs; on simulated devices, the device count too (1-5). The reference applies the same
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
from models.reference import top_k as reference_top_k
from split_state.dtypes import dtype_from_name
from split_state.errors import MetaError, ShapeError
from split_state.ops import OPS, infer
from split_state.states import MIRRORED, PARTIAL, Split, State

AXIS_OPS = {
    "concat",
    "softmax",
    "softmax_ext",
    "rms_norm",
    "layer_norm",
    "sum",
    "mean",
    "slice",
    "reshape",
    "transpose",
    "set_rows",
}
PRECISION = ("bfloat16", "float16", "float32", "float64")
DTYPES = ("float32", "float32", "float16", "bfloat16", "int32")
FLOAT_ONLY = {
    *("scale", "gelu", "gelu_erf", "silu", "exp", "tanh", "softmax", "rms_norm", "layer_norm", "mean", "div"),
    *("sqrt", "rsqrt", "softmax_ext", "rope", "top_k"),
}


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
        if name in ("sqrt", "rsqrt"):
            # the root of y * y + t (t >= 0.5): a root of a computed value near zero amplifies any
            # rounding difference without bound (ill-conditioned, not a runtime error)
            oshape = draw.partner_shape(rng, shape)
            positive = (np.abs(draw.values(rng, oshape, dtype)) + 0.5).astype(dtype_from_name(dtype))
            offset, t = self.new(oshape, dtype, values=positive)
            self.graph.note(f"y = add(mul(y, y), t{len(self.handles)})")
            square = reference("mul", [ref, ref], {})
            return [apply("add", apply("mul", cur, cur), offset)], [reference("add", [square, t], {})], {}
        if name in draw.COMPARISONS:
            oshape = draw.partner_shape(rng, shape)
            other, x = self.new(oshape, dtype)
            return [cur, other], [ref, x], {}
        if name == "where":
            cshape, oshape = draw.partner_shape(rng, shape), draw.partner_shape(rng, shape)
            cond, c = self.new(cshape, "bool", partial=False, values=rng.random(cshape) < 0.5)
            other, x = self.new(oshape, dtype)
            return [cond, cur, other], [c, ref, x], {}
        if name == "softmax_ext":
            mask, m = self.new(draw.partner_shape(rng, shape), dtype)
            return [cur, mask], [ref, m], {"axis": int(rng.integers(-ref.ndim, ref.ndim)), "scale": 0.5}
        if name == "rope":
            if ref.ndim < 3 or shape[-1] % 2:
                raise ShapeError("rope needs (..., tokens, heads, even head_dim)")
            pos, p = self.new(
                shape[:-2], "int32", partial=False, values=rng.integers(0, 512, shape[:-2]).astype(np.int32)
            )
            return [cur, pos], [ref, p], {"base": 10000.0, "mode": str(rng.choice(["normal", "neox"]))}
        if name == "set_rows":  # the chain value written into rows of a fresh resident tensor
            axis = int(rng.integers(ref.ndim))
            dst_shape = shape[:axis] + (shape[axis] + int(rng.integers(0, 3)),) + shape[axis + 1 :]
            dst, d = self.new(dst_shape, dtype)
            rows = rng.permutation(dst_shape[axis])[: shape[axis]].astype(np.int32)
            ids, i = self.new(rows.shape, "int32", partial=False, values=rows)
            return [dst, ids, cur], [d, i, ref], {"axis": axis}
        # a larger eps than a model's: norms of tiny rows are ill-conditioned in float16; computed
        # floats are never cast to int (truncation next to a whole number amplifies any rounding)
        casts = ("float32", "float16") if dtype in PRECISION else ("float32", "float16", "int32")
        return [cur], [ref], draw.params_for(rng, name, shape, eps=1e-3, casts=casts)

    def composite(self, name: str, cur: Tensor, ref: np.ndarray, dtype: str):
        """(result, reference) of the pseudo-ops: top_k's values, or a redistribution."""
        if name == "redistribute":
            state = random_state(self.rng, ref.shape, self.dev.n)
            self.graph.note(f"y = y.redistribute({state})")
            return cur.redistribute(state), ref
        if ref.ndim == 0 or ref.shape[-1] == 0 or dtype not in PRECISION:
            raise ShapeError("top_k needs a float axis with elements")
        k = int(self.rng.integers(1, ref.shape[-1] + 1))
        self.graph.note(f"y = top_k(y, {k}).values")
        # values only: indices of near ties may differ between summation orders, values do not
        return cur.top_k(k)[0], reference_top_k(ref, k)[..., 0].astype(ref.dtype)


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


# ops a chain does not take, each held alone in tests/test_meta.py: gelu_f16's result steps with the
# last bits of its input (it rounds it to float16), so in a chain the last-bit differences of the
# ops before it (our kernels against NumPy's reference) become whole steps; mod wants integer
# divisors other than 0, which a chain's values are not
UNCHAINED = {"gelu_f16", "mod"}
# every op with a standalone oracle, plus the composites: top_k and an explicit redistribution
NAMES = sorted(
    [name for name, op in OPS.items() if not op.internal and name not in UNCHAINED] + ["top_k", "redistribute"]
)
COMPOSITES = ("top_k", "redistribute")
MAX_OPS = 20


def check_graph(dev: MetaDevice, seed: int, index: int) -> tuple[bool, Graph]:
    """Build and run one random graph of 1-20 ops (some intermediate values kept as extra
    outputs); (every output matches NumPy, description)."""
    rng = np.random.default_rng([seed, index])
    graph = Graph((seed, index))
    build = Builder(dev, rng, graph)
    dtype = str(rng.choice(DTYPES))
    outputs: list[tuple[Tensor, np.ndarray, str]] = []  # (tensor, reference, coarsest dtype so far)
    try:
        cur, ref = build.new(draw.shape(rng, max_rank=4), dtype)
        for _ in range(int(rng.integers(1, MAX_OPS + 1))):
            name = str(rng.choice(NAMES))
            if name in FLOAT_ONLY and dtype == "int32":
                continue
            try:
                if name in COMPOSITES:
                    cur, ref = build.composite(name, cur, ref, dtype)
                    continue
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
            if rng.random() < 0.15:
                outputs.append((cur, ref, graph.coarsest))
                graph.note(f"# output {len(outputs)} = y")
        outputs.append((cur, ref, graph.coarsest))
        dev.run(*(t for t, _, _ in outputs))
        ok = True
        for number, (t, expected, coarsest) in enumerate(outputs, start=1):
            got = t.numpy()
            # once a value overflowed, IEEE lets devices holding Partial zeros see 0*inf = NaN where
            # one device sees inf, and exp(-inf) = 0 downstream hides it: such graphs are checked
            # for shape and dtype only, and counted apart
            same = (got.shape, got.dtype) == (expected.shape, expected.dtype)
            if not (same if graph.overflowed else matches(got, expected, coarsest)):
                graph.note(f"# output {number}: expected {expected!r}\n# got      {got!r}")
                ok = False
        return ok, graph
    finally:
        dev.free(*build.handles)


def run(
    dev: MetaDevice | Callable[[int], MetaDevice],
    seconds: float,
    seed: int,
    out: Callable[[str], None] = lambda s: print(s, flush=True),
    limit: int | None = None,
    max_devices: int = 5,
) -> int:
    """Random graphs until `seconds` pass (or `limit` graphs); 0 if all matched, 1 otherwise.
    `dev` is a MetaDevice, or a factory called with a device count drawn per graph (1 to
    `max_devices`), e.g. for simulated devices."""
    start = time.monotonic()
    checked = overflowed = 0
    counts: set[int] = set()
    np.seterr(all="ignore")  # overflow in float16 is part of the test, not news
    while time.monotonic() - start < seconds and (limit is None or checked < limit):
        device = dev
        if not isinstance(dev, MetaDevice):
            device = dev(int(np.random.default_rng([seed, checked, 1]).integers(1, max_devices + 1)))
        counts.add(device.n)
        try:
            ok, graph = check_graph(device, seed, checked)
        except MetaError as exc:
            out(f"graph {checked} (seed {seed}) raised {type(exc).__name__}: {exc}")
            return 1
        finally:
            if device is not dev:
                device.close()
        checked += 1
        overflowed += graph.overflowed
        if not ok:
            out(f"MISMATCH in graph {checked - 1}; reproduce with --seed {seed} (graph index {checked - 1}):")
            out(graph.reproduction())
            return 1
        if checked % 50 == 0:
            out(f"{checked} graphs checked ({time.monotonic() - start:.0f} s)")
    out(
        f"{checked} random graphs matched NumPy on {'/'.join(map(str, sorted(counts)))} workers in "
        f"{time.monotonic() - start:.1f} s (seed {seed}; "
        f"{overflowed} overflowed to inf/nan and were checked for shape and dtype only)"
    )
    return 0
