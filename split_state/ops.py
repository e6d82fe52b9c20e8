"""The op catalogue: one literal table from op name to its shape inference, rule and localisation.

`infer` checks operands and parameters and returns the output shape, dtype and the canonical
parameters (negative axes resolved, -1 in reshape filled), so that structurally equal graphs get
equal plan keys. `rule` returns the valid signatures for the current input states. `localize`
turns global parameters into the ones device d's kernel needs on its local shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from split_state.dtypes import DTYPES, FLOAT_NAMES, INDEX_NAMES
from split_state.errors import ShapeError, SplitError
from split_state.layout import local_shape, pieces
from split_state.quant import quant_format
from split_state.rules import Labels, Signature, label_signatures
from split_state.states import MIRRORED, PARTIAL, Split, State

Shape = tuple[int, ...]
Params = dict[str, Any]
P, M = True, False


@dataclass(frozen=True)
class OpSpec:
    name: str
    arity: int | None  # None: any number >= 1
    infer: Callable[[Sequence[Shape], Sequence[str], Params], tuple[Shape, str, Params]]
    rule: Callable[[Sequence[State], Sequence[Shape], Params, Shape], list[Signature]]
    localize: Callable[..., Params] | None = None
    # writes into its first input and returns it: no new memory, the destination keeps its storage
    inplace: bool = False
    # its result depends on how its input is split (a step of a composite): no standalone oracle
    internal: bool = False


# -- helpers ------------------------------------------------------------------------------------


def _axis(axis: Any, ndim: int, op: str) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool) or not -ndim <= axis < max(ndim, 1):
        raise ShapeError(f"{op}: axis {axis!r} out of range for a {ndim}-d operand")
    return axis % ndim


def _same_dtype(dtypes: Sequence[str], op: str) -> str:
    if len(set(dtypes)) != 1:
        raise ShapeError(f"{op}: operands have different dtypes {list(dtypes)}; cast one first")
    return dtypes[0]


def _numeric(dtype: str, op: str) -> str:
    if dtype == "bool":
        raise ShapeError(f"{op}: no arithmetic on bool; cast to a number first (astype) or use where")
    return dtype


def _float(dtype: str, op: str) -> str:
    if dtype not in FLOAT_NAMES:
        raise ShapeError(f"{op}: needs a floating dtype, got {dtype}; cast first")
    return dtype


def _broadcast(shapes: Sequence[Shape], op: str) -> Shape:
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        sizes = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0} - {1}
        if len(sizes) > 1:
            raise ShapeError(f"{op}: shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _aligned_labels(
    shapes: Sequence[Shape], out_shape: Shape, prefix: str = "x"
) -> tuple[list[tuple[str, ...]], set[str]]:
    """Right-aligned labels: an axis that broadcasts (size 1 against a larger output) gets a
    label of its own that may not be split."""
    labels, fixed = [], set()
    for i, shape in enumerate(shapes):
        offset = len(out_shape) - len(shape)
        row = []
        for j, size in enumerate(shape):
            if size == out_shape[offset + j]:
                row.append(f"{prefix}{offset + j}")
            else:
                row.append(f"bcast{i}_{j}")
                fixed.add(row[-1])
        labels.append(tuple(row))
    return labels, fixed


def _labels_rule(make: Callable[[Sequence[Shape], Params, Shape], Labels]):
    def rule(states, shapes, params, out_shape):
        return label_signatures(make(shapes, params, out_shape), states)

    return rule


def _out_labels(n: int) -> tuple[str, ...]:
    return tuple(f"x{i}" for i in range(n))


# -- elementwise --------------------------------------------------------------------------------


def _infer_unary(name):
    def infer(shapes, dtypes, params):
        return tuple(shapes[0]), _numeric(dtypes[0], name), {}

    return infer


def _infer_unary_float(name):
    def infer(shapes, dtypes, params):
        return tuple(shapes[0]), _float(dtypes[0], name), {}

    return infer


def _infer_scale(shapes, dtypes, params):
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise ShapeError(f"scale: factor must be a number, got {factor!r}")
    return tuple(shapes[0]), _float(dtypes[0], "scale"), {"factor": float(factor)}


def _infer_cast(shapes, dtypes, params):
    dtype = params.get("dtype")
    if dtype not in DTYPES:
        raise ShapeError(f"cast: unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return tuple(shapes[0]), dtype, {"dtype": dtype}


def _unary_rule(linear: bool):
    def make(shapes, params, out_shape):
        return Labels((_out_labels(len(out_shape)),), _out_labels(len(out_shape)), partial=((P,),) if linear else ())

    return _labels_rule(make)


def _infer_binary(name, floats_only: bool = False):
    # integer division truncates, which does not distribute over a Partial sum: floats only
    def infer(shapes, dtypes, params):
        dtype = _numeric(_same_dtype(dtypes, name), name)
        return _broadcast(shapes, name), _float(dtype, name) if floats_only else dtype, {}

    return infer


def _binary_rule(partial: tuple[tuple[bool, ...], ...]):
    def make(shapes, params, out_shape):
        labels, fixed = _aligned_labels(shapes, out_shape)
        return Labels(tuple(labels), _out_labels(len(out_shape)), frozenset(fixed), partial)

    return _labels_rule(make)


# -- per-axis and reductions --------------------------------------------------------------------


def _infer_along_axis(name, with_eps: bool):
    def infer(shapes, dtypes, params):
        shape = tuple(shapes[0])
        canon = {"axis": _axis(params.get("axis", -1), len(shape), name)}
        if with_eps:
            eps = params.get("eps", 1e-5)
            if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
                raise ShapeError(f"{name}: eps must be a non-negative number, got {eps!r}")
            canon["eps"] = float(eps)
        return shape, _float(dtypes[0], name), canon

    return infer


def _along_axis_rule(shapes, params, out_shape):
    labels = _out_labels(len(out_shape))
    return Labels((labels,), labels, frozenset({labels[params["axis"]]}))


def _infer_reduce(name):
    def infer(shapes, dtypes, params):
        shape = tuple(shapes[0])
        axis = _axis(params.get("axis"), len(shape), name)
        _numeric(dtypes[0], name)
        keepdims = bool(params.get("keepdims", False))
        out = shape[:axis] + ((1,) if keepdims else ()) + shape[axis + 1 :]
        canon = {"axis": axis, "keepdims": keepdims}
        if name == "mean":
            _float(dtypes[0], name)
            canon["count"] = shape[axis]  # the global count: a local sum / count sums to the mean
        return out, dtypes[0], canon

    return infer


def _reduce_rule(shapes, params, out_shape):
    axis, keep = params["axis"], params["keepdims"]
    src = _out_labels(len(shapes[0]))
    src = src[:axis] + ("reduced",) + src[axis + 1 :]
    out = src[:axis] + (("kept",) if keep else ()) + src[axis + 1 :]
    return Labels((src,), out, frozenset({"kept"}), ((P,),))


# -- matmul -------------------------------------------------------------------------------------


LOW_PRECISION = frozenset({"float16", "bfloat16"})


def _infer_matmul(shapes, dtypes, params):
    a, b = (tuple(s) for s in shapes)
    if len(a) < 2 or len(b) < 2:
        raise ShapeError(f"matmul: operands need >= 2 axes, got {a} and {b}; reshape vectors to (1, n) or (n, 1)")
    if a[-1] != b[-2]:
        raise ShapeError(f"matmul: contracting sizes differ: {a} @ {b} ({a[-1]} != {b[-2]})")
    batch = _broadcast([a[:-2], b[:-2]], "matmul") if (a[:-2] or b[:-2]) else ()
    if set(dtypes) <= {"float32"} | LOW_PRECISION and "float32" in dtypes:
        dtype = "float32"  # a low-precision weight with float32 activations computes in float32
    else:
        dtype = _same_dtype(dtypes, "matmul")
    if dtype == "bool":
        raise ShapeError("matmul: bool operands are not supported; cast first")
    return batch + (a[-2], b[-1]), dtype, {}


def _matmul_labels(shapes, params, out_shape):
    # einsum "...mk,...kn->...mn": the batch labels broadcast like an elementwise op.
    a, b = shapes
    batch = out_shape[:-2]
    (la, lb), fixed = _aligned_labels([a[:-2], b[:-2]], batch, prefix="batch")
    out = tuple(f"batch{i}" for i in range(len(batch)))
    return Labels((la + ("m", "k"), lb + ("k", "n")), out + ("m", "n"), frozenset(fixed), ((P, M), (M, P)))


# -- shape ops ----------------------------------------------------------------------------------


def _infer_reshape(shapes, dtypes, params):
    src = tuple(shapes[0])
    target = params.get("shape")
    if not isinstance(target, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in target):
        raise ShapeError(f"reshape: shape must be a sequence of ints, got {target!r}")
    target = list(target)
    if target.count(-1) > 1 or any(s < -1 for s in target):
        raise ShapeError(f"reshape: bad target shape {tuple(target)}")
    if -1 in target:
        known = prod(s for s in target if s != -1)
        if known == 0 or prod(src) % known:
            raise ShapeError(f"reshape: cannot infer -1 in {tuple(target)} from {src}")
        target[target.index(-1)] = prod(src) // known
    if prod(target) != prod(src):
        raise ShapeError(f"reshape: {src} ({prod(src)} elements) cannot become {tuple(target)}")
    return tuple(target), dtypes[0], {"shape": tuple(target)}


def reshape_split(state: Split, src: Shape, dst: Shape) -> Split | None:
    """The split of the reshaped tensor when every device's local data stays a contiguous
    row-major block of the same form, or None when it cannot be expressed."""
    if 0 in src or 0 in dst:
        return None  # an empty tensor: nothing to keep split, Mirrored costs nothing
    a = state.axis
    outer = prod(src[:a])
    for b in range(len(dst) + 1):
        if prod(dst[:b]) != outer or b == len(dst):
            continue
        # the split axis becomes several output axes b..c (split goes to the outermost)
        for c in range(b, len(dst)):
            if prod(dst[b : c + 1]) == src[a]:
                try:
                    return Split(b, state.scaled(1, prod(dst[b + 1 : c + 1])).segments)
                except SplitError:
                    break
        # several input axes a..e merge into output axis b
        for e in range(a + 1, len(src)):
            if prod(src[a : e + 1]) == dst[b]:
                return Split(b, state.scaled(prod(src[a + 1 : e + 1])).segments)
    return None


def _reshape_rule(states, shapes, params, out_shape):
    (st,), (src,) = states, shapes
    sigs = []
    if isinstance(st, Split):
        mapped = reshape_split(st, tuple(src), tuple(params["shape"]))
        if mapped is not None:
            sigs.append(Signature((st,), mapped))
    return sigs + [Signature((PARTIAL,), PARTIAL), Signature((MIRRORED,), MIRRORED)]


def _localize_reshape(params, in_states, in_shapes, out_state, out_shape, n, d):
    return {"shape": local_shape(out_state, out_shape, n, d)}


def _infer_transpose(shapes, dtypes, params):
    shape = tuple(shapes[0])
    axes = params.get("axes")
    axes = tuple(reversed(range(len(shape)))) if axes is None else tuple(axes)
    if sorted(a % max(len(shape), 1) if isinstance(a, int) else -1 for a in axes) != list(range(len(shape))):
        raise ShapeError(f"transpose: axes {axes} are not a permutation of {len(shape)} axes")
    axes = tuple(a % len(shape) for a in axes)
    return tuple(shape[a] for a in axes), dtypes[0], {"axes": axes}


def _transpose_labels(shapes, params, out_shape):
    src = _out_labels(len(shapes[0]))
    return Labels((src,), tuple(src[a] for a in params["axes"]), partial=((P,),))


def _infer_concat(shapes, dtypes, params):
    first = tuple(shapes[0])
    axis = _axis(params.get("axis", 0), len(first), "concat")
    for s in shapes:
        if len(s) != len(first) or any(x != y for i, (x, y) in enumerate(zip(s, first)) if i != axis):
            raise ShapeError(f"concat: shapes {[tuple(x) for x in shapes]} differ off axis {axis}")
    out = first[:axis] + (sum(s[axis] for s in shapes),) + first[axis + 1 :]
    return out, _same_dtype(dtypes, "concat"), {"axis": axis}


def _concat_labels(shapes, params, out_shape):
    axis = params["axis"]
    rows = []
    for i in range(len(shapes)):
        row = list(_out_labels(len(out_shape)))
        row[axis] = f"cat{i}"
        rows.append(tuple(row))
    out = list(_out_labels(len(out_shape)))
    out[axis] = "cat"
    fixed = frozenset(f"cat{i}" for i in range(len(shapes))) | {"cat"}
    return Labels(tuple(rows), tuple(out), fixed, ((P,) * len(shapes),))


def _infer_slice(shapes, dtypes, params):
    shape = tuple(shapes[0])
    axis = _axis(params.get("axis", 0), len(shape), "slice")
    start, stop = params.get("start", 0), params.get("stop", shape[axis])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)):
        raise ShapeError(f"slice: start and stop must be ints, got {start!r}, {stop!r}")
    start, stop, _ = slice(start, stop).indices(shape[axis])
    stop = max(stop, start)
    return shape[:axis] + (stop - start,) + shape[axis + 1 :], dtypes[0], {"axis": axis, "start": start, "stop": stop}


def _slice_labels(shapes, params, out_shape):
    src = list(_out_labels(len(out_shape)))
    out = list(src)
    src[params["axis"]], out[params["axis"]] = "sliced_in", "sliced_out"
    return Labels((tuple(src),), tuple(out), frozenset({"sliced_in", "sliced_out"}), ((P,),))


def _segment_at(state: Split, start: int, stop: int) -> int | None:
    """The segment whose global range is exactly [start, stop), if any."""
    at = 0
    for s, seg in enumerate(state.segments):
        if at == start and at + sum(seg) == stop:
            return s
        at += sum(seg)
    return None


def _slice_rule(states, shapes, params, out_shape):
    """A slice that is exactly one segment of a split on the same axis stays split: every device
    cuts its own chunk of that segment (the Q, K or V of a fused QKV weight), no communication."""
    sigs = label_signatures(_slice_labels(shapes, params, out_shape), states)
    st = states[0]
    if isinstance(st, Split) and st.axis == params["axis"]:
        seg = _segment_at(st, params["start"], params["stop"])
        if seg is not None:
            sigs.insert(0, Signature((st,), Split(st.axis, (st.segments[seg],))))
    return sigs


def _localize_slice(params, in_states, in_shapes, out_state, out_shape, n, d):
    st = in_states[0]
    if not (isinstance(st, Split) and isinstance(out_state, Split) and st.axis == params["axis"]):
        return params
    seg = _segment_at(st, params["start"], params["stop"])
    start = sum(st.segments[s][d] for s in range(seg))
    return {"axis": params["axis"], "start": start, "stop": start + st.segments[seg][d]}


def _infer_get_rows(shapes, dtypes, params):
    table, ids = (tuple(s) for s in shapes)
    if len(table) != 2:
        raise ShapeError(f"get_rows: the table must be 2-d (rows, width), got {table}")
    if dtypes[1] not in INDEX_NAMES:
        raise ShapeError(f"get_rows: ids must be integers, got {dtypes[1]}")
    return ids + (table[1],), dtypes[0], {"rows": table[0]}


def _get_rows_labels(shapes, params, out_shape):
    # a table split on rows gives Partial: each row comes from one device, zeros elsewhere
    ids = tuple(f"i{k}" for k in range(len(shapes[1])))
    return Labels((("rows", "width"), ids), ids + ("width",), partial=((P, M),))


def _localize_get_rows(params, in_states, in_shapes, out_state, out_shape, n, d):
    table = in_states[0]
    if isinstance(table, Split) and table.axis == 0:
        spans = [(p.global_start, p.global_stop, p.local_start) for p in pieces(table, in_shapes[0], n, d)]
    else:
        spans = [(0, in_shapes[0][0], 0)]
    return {"rows": params["rows"], "spans": spans}


# -- decoder ops: comparisons, where, masked softmax, rope, in-place row writes, top-k --------------


def _infer_mod(shapes, dtypes, params):
    dtype = _numeric(_same_dtype(dtypes, "mod"), "mod")
    if dtype in FLOAT_NAMES:
        raise ShapeError(f"mod: integers only (a position's ring slot), got {dtype}")
    return _broadcast(shapes, "mod"), dtype, {}


def _infer_compare(name):
    def infer(shapes, dtypes, params):
        _same_dtype(dtypes, name)
        return _broadcast(shapes, name), "bool", {}

    return infer


def _infer_where(shapes, dtypes, params):
    if dtypes[0] != "bool":
        raise ShapeError(f"where: the condition must be bool, got {dtypes[0]}; compare first (lt, le, eq, ...)")
    return _broadcast(shapes, "where"), _same_dtype(dtypes[1:], "where"), {}


def _number(params: Params, key: str, default: float, op: str) -> float:
    value = params.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ShapeError(f"{op}: {key} must be a number, got {value!r}")
    return float(value)


def _infer_softmax_ext(shapes, dtypes, params):
    x, mask = (tuple(s) for s in shapes)
    if _broadcast([x, mask], "softmax_ext") != x:
        raise ShapeError(f"softmax_ext: mask {mask} must broadcast to the scores {x}")
    _float(dtypes[1], "softmax_ext")
    canon = {
        "axis": _axis(params.get("axis", -1), len(x), "softmax_ext"),
        "scale": _number(params, "scale", 1.0, "softmax_ext"),
    }
    return x, _float(dtypes[0], "softmax_ext"), canon


def _softmax_ext_labels(shapes, params, out_shape):
    labels, fixed = _aligned_labels(shapes, out_shape)
    return Labels(tuple(labels), _out_labels(len(out_shape)), frozenset(fixed | {f"x{params['axis']}"}))


ROPE_MODES = ("normal", "neox")  # ggml's adjacent pairs (x[2i], x[2i+1]); NeoX's halves (x[i], x[i+d/2])


def _infer_rope(shapes, dtypes, params):
    x, pos = (tuple(s) for s in shapes)
    if len(x) < 3 or pos != x[:-2]:
        raise ShapeError(
            f"rope: x must be (..., tokens, heads, head_dim) and positions (..., tokens); got {x} and {pos}"
        )
    if x[-1] % 2:
        raise ShapeError(f"rope: head_dim {x[-1]} must be even")
    if dtypes[1] not in INDEX_NAMES:
        raise ShapeError(f"rope: positions must be integers, got {dtypes[1]}")
    mode = params.get("mode", "normal")
    if mode not in ROPE_MODES:
        raise ShapeError(f"rope: mode must be one of {ROPE_MODES}, got {mode!r}")
    base = _number(params, "base", 10000.0, "rope")
    canon = {"base": base, "mode": mode}
    freqs = params.get("freqs")
    if freqs is not None:  # each frequency's multiplier: linear scaling, Llama 3.1's factors
        good = isinstance(freqs, (list, tuple)) and len(freqs) == x[-1] // 2
        numbers = good and all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in freqs)
        if not numbers or not all(0 < f < math.inf for f in freqs):
            raise ShapeError(f"rope: freqs must be head_dim / 2 = {x[-1] // 2} positive finite multipliers")
        canon["freqs"] = [float(f) for f in freqs]
    return x, _float(dtypes[0], "rope"), canon


def _rope_labels(shapes, params, out_shape):
    tokens = _out_labels(len(out_shape) - 2)
    x = tokens + ("heads", "dim")
    return Labels((x, tokens), x, frozenset({"dim"}), ((P, M),))  # a rotation is linear in x


def _infer_set_rows(shapes, dtypes, params):
    if len(shapes) not in (3, 4):
        raise ShapeError(f"set_rows: takes a destination, ids, a value and maybe a batch start, got {len(shapes)}")
    dst, ids, value = (tuple(s) for s in shapes[:3])
    axis = _axis(params.get("axis", 0), len(dst), "set_rows")
    if dtypes[1] not in INDEX_NAMES:
        raise ShapeError(f"set_rows: row ids must be integers, got {dtypes[1]}")
    if len(ids) == 2 and axis == 0:
        raise ShapeError("set_rows: per-batch ids (batch, tokens) need the rows on an axis after the batch axis 0")
    # batch_start given: the ids' rows are batch indices batch_start, batch_start + 1, ... only;
    # a fourth operand (a 0-d integer) gives it when the step runs (a server's slot), so one
    # plan serves every slot: checked against the destination then
    fed = len(shapes) == 4
    if fed and (tuple(shapes[3]) != () or dtypes[3] not in INDEX_NAMES or "batch_start" in params):
        raise ShapeError(
            f"set_rows: a fed batch start is a 0-d integer, instead of batch_start; got {tuple(shapes[3])} {dtypes[3]}"
        )
    some = "batch_start" in params or fed
    start = params.get("batch_start", 0)
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ShapeError(f"set_rows: batch_start must be an integer >= 0, got {start!r}")
    if some and len(ids) != 2:
        raise ShapeError("set_rows: batch_start needs per-batch ids (batch, tokens)")
    batch_fits = len(ids) == 1 or (ids[0] + start <= dst[0] if some else ids[0] == dst[0])
    if len(ids) not in (1, 2) or not batch_fits:
        raise ShapeError(
            f"set_rows: ids must be (tokens,) or (batch={dst[0]}, tokens), or (at most {dst[0] - start}, tokens) "
            f"from batch_start {start}; got {ids}"
        )
    want = dst[:axis] + (ids[-1],) + dst[axis + 1 :]
    if some:
        want = (ids[0],) + want[1:]
    if value != want:
        raise ShapeError(
            f"set_rows: writing rows {ids} along axis {axis} of {dst} needs a value of {want}, got {value}"
        )
    if (dtypes[0] in FLOAT_NAMES) != (dtypes[2] in FLOAT_NAMES):
        raise ShapeError(f"set_rows: cannot write {dtypes[2]} into {dtypes[0]}")
    batch = {"batch_fed": True} if fed else {"batch_start": start} if some else {}
    return dst, dtypes[0], {"axis": axis, "rows": dst[axis]} | batch


def _set_rows_rule(states, shapes, params, out_shape):
    """The destination is written where it lies: its state is never changed, the value (and ids)
    are moved to match it. Split off the row axis: value split alike; split on the row axis: each
    device writes the rows it holds; Partial: each device writes its addend of the value."""
    dst, axis = states[0], params["axis"]
    batched = len(shapes[1]) == 2
    start = (MIRRORED,) * (len(states) - 3)  # a fed batch start: every device reads it whole
    if ("batch_start" in params or "batch_fed" in params) and isinstance(dst, Split) and dst.axis == 0:
        return [Signature((dst, MIRRORED, MIRRORED, *start), dst)]  # each device writes the batch indices it holds
    if isinstance(dst, Split) and dst.axis != axis:
        ids = dst.with_axis(0) if batched and dst.axis == 0 else MIRRORED
        return [Signature((dst, ids, dst, *start), dst)]
    if isinstance(dst, Split) or dst == MIRRORED:
        return [Signature((dst, MIRRORED, MIRRORED, *start), dst)]
    return [Signature((PARTIAL, MIRRORED, PARTIAL, *start), PARTIAL)]


def _localize_set_rows(params, in_states, in_shapes, out_state, out_shape, n, d):
    dst = in_states[0]
    if isinstance(dst, Split) and dst.axis == params["axis"]:
        spans = [(p.global_start, p.global_stop, p.local_start) for p in pieces(dst, in_shapes[0], n, d)]
    else:
        spans = [(0, params["rows"], 0)]
    if "batch_start" not in params and "batch_fed" not in params:
        return dict(params, spans=spans)
    batch = in_shapes[0][0]
    if isinstance(dst, Split) and dst.axis == 0:
        held = [(p.global_start, p.global_stop, p.local_start) for p in pieces(dst, in_shapes[0], n, d)]
    else:
        held = [(0, batch, 0)]
    if "batch_fed" in params:  # the kernel pairs them with the start it is fed (batch_pairs)
        return dict(params, spans=spans, held=held, batch=batch)
    pairs = batch_pairs(params["batch_start"], in_shapes[1][0], held)
    return {k: v for k, v in params.items() if k != "batch_start"} | {"spans": spans, "batches": pairs}


def batch_pairs(start: int, count: int, held) -> list[tuple[int, int]]:
    """set_rows from batch index `start` on: (row of the ids, local batch index) for each of
    the `count` rows of ids that falls in a batch span this device holds, `held` as (global
    start, global stop, local start)."""
    return [(j, local + start + j - lo) for j in range(count) for lo, hi, local in held if lo <= start + j < hi]


def _infer_top_k_candidates(shapes, dtypes, params):
    (x,) = (tuple(s) for s in shapes)
    k, n = params.get("k"), params.get("devices")
    if not x or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (k, n)):
        raise ShapeError(f"top_k: needs an axis, k >= 1 and a device count; got shape {x}, k={k!r}, devices={n!r}")
    _float(dtypes[0], "top_k")
    return x[:-1] + (k * n, 2), "float64", {"k": k, "devices": n}


def _top_k_candidates_rule(states, shapes, params, out_shape):
    """Each device picks its k best of the last axis (no communication); a device with fewer
    elements pads with (-inf, -1). Split on another axis: whole rows, padded to devices * k."""
    (st,), (x,) = states, shapes
    n, k, last = params["devices"], params["k"], len(x) - 1
    candidates = Split(last, ((k,) * n,))
    sigs = [Signature((MIRRORED,), MIRRORED)] if st == MIRRORED else []  # every device ranks whole rows
    if isinstance(st, Split) and st.axis != last:
        sigs.append(Signature((st,), st))
    sigs.append(
        Signature((st if isinstance(st, Split) and st.axis == last else Split.even(last, x[-1], n),), candidates)
    )
    return list(dict.fromkeys(sigs + [Signature((MIRRORED,), MIRRORED)]))


def _localize_top_k_candidates(params, in_states, in_shapes, out_state, out_shape, n, d):
    st, x = in_states[0], in_shapes[0]
    if isinstance(st, Split) and st.axis == len(x) - 1:
        spans = [(p.global_start, p.length, p.local_start) for p in pieces(st, x, n, d)]
        return dict(params, spans=spans, width=params["k"])
    return dict(params, spans=[(0, x[-1], 0)], width=params["k"] * n)


def _infer_top_k_combine(shapes, dtypes, params):
    (c,) = (tuple(s) for s in shapes)
    k = params.get("k")
    if len(c) < 2 or c[-1] != 2 or dtypes[0] != "float64" or not isinstance(k, int) or not 1 <= k <= c[-2]:
        raise ShapeError(f"top_k: candidates must be (..., m >= k, 2) float64 pairs; got {c} {dtypes[0]}, k={k!r}")
    return c[:-2] + (k, 2), "float64", {"k": k}


def _top_k_combine_labels(shapes, params, out_shape):
    rows = _out_labels(len(out_shape) - 2)
    return Labels((rows + ("candidates", "pair"),), rows + ("best", "pair"), frozenset({"candidates", "best", "pair"}))


# -- block-quantized weights (split_state/quant.py) ----------------------------------------------


# a quantized product's activations: float32 as given (exact), or 8-bit blocks (llama.cpp's, faster)
ACTIVATIONS = ("f32", "q8")


def _infer_qmatmul(shapes, dtypes, params):
    """x (..., blocks, block) float32 times a quantized weight interleaved as the workers keep it,
    (groups, blocks, block_bytes, lanes): (..., groups, lanes), each output the dot product of x
    with one dequantized row (row g * lanes + l at [..., g, l]; meta.tensor.qmatmul merges the
    last two axes)."""
    xb, w = (tuple(s) for s in shapes)
    fmt = quant_format(params.get("format"))
    if len(xb) < 2 or len(w) != 4 or xb[-1] != fmt.block or w[2] != fmt.block_bytes or xb[-2] != w[1]:
        raise ShapeError(
            f"qmatmul ({fmt.name}): x must be (..., blocks, {fmt.block}) and the weight (groups, blocks, "
            f"{fmt.block_bytes}, lanes) with the same blocks, got {xb} and {w}"
        )
    if dtypes[0] != "float32" or dtypes[1] != "uint8":
        raise ShapeError(f"qmatmul: operands must be float32 and uint8 (the file's bytes), got {tuple(dtypes)}")
    activations = params.get("activations", "f32")
    if activations not in ACTIVATIONS:
        raise ShapeError(f"qmatmul: activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
    return xb[:-2] + (w[0], w[3]), "float32", {"format": fmt.name, "activations": activations}


def _qmatmul_labels(shapes, params, out_shape):
    # einsum "...kj,gkbl->...gl": a split of the blocks (k) gives Partial, of the row groups (g) a
    # split output; a block's values (j), its bytes (b) and the lanes (l) are never split
    batch = _out_labels(len(shapes[0]) - 2)
    return Labels((batch + ("k", "j"), ("g", "k", "b", "l")), batch + ("g", "l"), frozenset({"j", "b", "l"}), ((P, M),))


def _infer_qget_rows(shapes, dtypes, params):
    table, ids = (tuple(s) for s in shapes)
    fmt = quant_format(params.get("format"))
    if len(table) != 4 or table[2] != fmt.block_bytes:
        raise ShapeError(
            f"qget_rows ({fmt.name}): the table must be interleaved (groups, blocks, {fmt.block_bytes}, lanes), "
            f"got {table}"
        )
    if dtypes[0] != "uint8" or dtypes[1] not in INDEX_NAMES:
        raise ShapeError(f"qget_rows: operands must be uint8 and integer ids, got {tuple(dtypes)}")
    return ids + (table[1] * fmt.block,), "float32", {"rows": table[0] * table[3], "format": fmt.name}


def _qget_rows_labels(shapes, params, out_shape):
    # as get_rows: a table split on row groups gives Partial; its blocks are not split, and a
    # Partial table is not a sum of tables (dequantizing is not linear in the bytes)
    ids = tuple(f"i{k}" for k in range(len(shapes[1])))
    return Labels((("g", "k", "b", "l"), ids), ids + ("width",), frozenset({"k", "b", "l"}))


def _localize_qget_rows(params, in_states, in_shapes, out_state, out_shape, n, d):
    """get_rows' spans, in rows: the table's split is in groups of `lanes` rows."""
    spans = _localize_get_rows(params, in_states, in_shapes, out_state, out_shape, n, d)["spans"]
    lanes = in_shapes[0][3]
    rows = [(start * lanes, stop * lanes, local * lanes) for start, stop, local in spans]
    return {"rows": params["rows"], "spans": rows, "format": params["format"]}


# -- attention with a head map: query heads split apart from whole KV groups -----------------------


def _infer_gqa_attention(shapes, dtypes, params):
    q, keys, values, mask = (tuple(s) for s in shapes)
    if len(q) != 4 or len(keys) != 4 or values != keys:
        raise ShapeError(
            f"gqa_attention: q (batch, tokens, heads, dim), keys and values (batch, kv heads, ctx, dim); "
            f"got {q}, {keys}, {values}"
        )
    batch, tokens, heads, dim = q
    if keys[0] != batch or keys[3] != dim:
        raise ShapeError(f"gqa_attention: keys {keys} do not match q {q} (batch and dim)")
    if len(mask) != 3 or mask[0] not in (1, batch) or mask[1:] != (tokens, keys[2]):
        raise ShapeError(f"gqa_attention: the mask is (1 or {batch}, {tokens}, {keys[2]}), got {mask}")
    kv = params.get("kv_of_head")
    good = isinstance(kv, (list, tuple)) and len(kv) == heads
    if not good or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < keys[1] for h in kv):
        raise ShapeError(f"gqa_attention: kv_of_head must give each of {heads} heads a KV head in [0, {keys[1]})")
    for dtype in dtypes[1:]:
        _float(dtype, "gqa_attention")
    canon = {"scale": _number(params, "scale", 1.0, "gqa_attention"), "kv_of_head": [int(h) for h in kv]}
    return q, _float(dtypes[0], "gqa_attention"), canon


def _heads_of_kv_split(kv_of_head: Sequence[int], kv: Split) -> tuple[int, ...] | None:
    """The query heads' extents when the KV heads are split by `kv` (one segment) and every head
    goes with its KV head; None if the map does not keep each device's heads in one run."""
    if len(kv.segments) != 1 or any(a > b for a, b in zip(kv_of_head, kv_of_head[1:])):
        return None
    extents, start = [], 0
    for e in kv.segments[0]:
        extents.append(sum(start <= h < start + e for h in kv_of_head))
        start += e
    return tuple(extents)


def _gqa_attention_rule(states, shapes, params, out_shape):
    """Split by heads: q by the query heads of each device's KV heads (the keys' split decides);
    split by batch rows: everything alike (a mask of one row whole); else all Mirrored. Never
    Partial: softmax is not linear."""
    q, keys = states[0], states[1]
    sigs = []
    if isinstance(keys, Split) and keys.axis == 1:
        heads = _heads_of_kv_split(params["kv_of_head"], keys)
        if heads is not None:
            by_heads = Split(2, (heads,))
            sigs.append(Signature((by_heads, keys, keys, MIRRORED), by_heads))
    batch = next((s for s in (q, keys) if isinstance(s, Split) and s.axis == 0 and len(s.segments) == 1), None)
    if batch is not None:
        mask = batch if shapes[3][0] == shapes[0][0] and shapes[0][0] > 1 else MIRRORED
        sigs.append(Signature((batch, batch, batch, mask), batch))
    sigs.append(Signature((MIRRORED,) * 4, MIRRORED))
    return sigs


def _localize_gqa_attention(params, in_states, in_shapes, out_state, out_shape, n, d):
    """Split by heads: this device's heads, each mapped to its KV head's local index."""
    q, keys = in_states[0], in_states[1]
    if not (isinstance(out_state, Split) and out_state.axis == 2):
        return params
    first_head, first_kv = sum(q.segments[0][:d]), sum(keys.segments[0][:d])
    mine = params["kv_of_head"][first_head : first_head + q.segments[0][d]]
    return {"scale": params["scale"], "kv_of_head": [h - first_kv for h in mine]}


# -- a worker outside an op's group --------------------------------------------------------------

NOTHING = "nothing"  # params: ndim, dtype


def _infer_nothing(shapes, dtypes, params):
    raise ShapeError("nothing: made by the compiler for a worker outside an op's group, not by a graph")


def _nothing_rule(states, shapes, params, out_shape):
    return []


# -- the table ----------------------------------------------------------------------------------

_LINEAR_UNARY = _unary_rule(linear=True)
_NONLINEAR_UNARY = _unary_rule(linear=False)

OPS: dict[str, OpSpec] = {
    "matmul": OpSpec("matmul", 2, _infer_matmul, _labels_rule(_matmul_labels)),
    "add": OpSpec("add", 2, _infer_binary("add"), _binary_rule(((P, P),))),
    "sub": OpSpec("sub", 2, _infer_binary("sub"), _binary_rule(((P, P),))),
    "mul": OpSpec("mul", 2, _infer_binary("mul"), _binary_rule(((P, M), (M, P)))),
    # no Partial pattern: 0/0 on the devices holding zeros would turn a true +-inf into NaN
    "div": OpSpec("div", 2, _infer_binary("div", floats_only=True), _binary_rule(())),
    "scale": OpSpec("scale", 1, _infer_scale, _LINEAR_UNARY),
    "neg": OpSpec("neg", 1, _infer_unary("neg"), _LINEAR_UNARY),
    "gelu": OpSpec("gelu", 1, _infer_unary_float("gelu"), _NONLINEAR_UNARY),
    "gelu_erf": OpSpec("gelu_erf", 1, _infer_unary_float("gelu_erf"), _NONLINEAR_UNARY),
    "gelu_f16": OpSpec("gelu_f16", 1, _infer_unary_float("gelu_f16"), _NONLINEAR_UNARY),
    "silu": OpSpec("silu", 1, _infer_unary_float("silu"), _NONLINEAR_UNARY),
    "relu": OpSpec("relu", 1, _infer_unary("relu"), _NONLINEAR_UNARY),
    "exp": OpSpec("exp", 1, _infer_unary_float("exp"), _NONLINEAR_UNARY),
    "tanh": OpSpec("tanh", 1, _infer_unary_float("tanh"), _NONLINEAR_UNARY),
    "cast": OpSpec("cast", 1, _infer_cast, _NONLINEAR_UNARY),
    "softmax": OpSpec("softmax", 1, _infer_along_axis("softmax", False), _labels_rule(_along_axis_rule)),
    "rms_norm": OpSpec("rms_norm", 1, _infer_along_axis("rms_norm", True), _labels_rule(_along_axis_rule)),
    "layer_norm": OpSpec("layer_norm", 1, _infer_along_axis("layer_norm", True), _labels_rule(_along_axis_rule)),
    "sum": OpSpec("sum", 1, _infer_reduce("sum"), _labels_rule(_reduce_rule)),
    "mean": OpSpec("mean", 1, _infer_reduce("mean"), _labels_rule(_reduce_rule)),
    "reshape": OpSpec("reshape", 1, _infer_reshape, _reshape_rule, _localize_reshape),
    "transpose": OpSpec("transpose", 1, _infer_transpose, _labels_rule(_transpose_labels)),
    "concat": OpSpec("concat", None, _infer_concat, _labels_rule(_concat_labels)),
    "slice": OpSpec("slice", 1, _infer_slice, _slice_rule, _localize_slice),
    "get_rows": OpSpec("get_rows", 2, _infer_get_rows, _labels_rule(_get_rows_labels), _localize_get_rows),
    "qmatmul": OpSpec("qmatmul", 2, _infer_qmatmul, _labels_rule(_qmatmul_labels)),
    "qget_rows": OpSpec("qget_rows", 2, _infer_qget_rows, _labels_rule(_qget_rows_labels), _localize_qget_rows),
    "sqrt": OpSpec("sqrt", 1, _infer_unary_float("sqrt"), _NONLINEAR_UNARY),
    "rsqrt": OpSpec("rsqrt", 1, _infer_unary_float("rsqrt"), _NONLINEAR_UNARY),
    # the remainder of floor division (Python's %, the divisor's sign): not linear, so no Partial
    "mod": OpSpec("mod", 2, _infer_mod, _binary_rule(())),
    "lt": OpSpec("lt", 2, _infer_compare("lt"), _binary_rule(())),
    "le": OpSpec("le", 2, _infer_compare("le"), _binary_rule(())),
    "eq": OpSpec("eq", 2, _infer_compare("eq"), _binary_rule(())),
    "where": OpSpec("where", 3, _infer_where, _binary_rule(((M, P, P),))),
    "softmax_ext": OpSpec("softmax_ext", 2, _infer_softmax_ext, _labels_rule(_softmax_ext_labels)),
    "rope": OpSpec("rope", 2, _infer_rope, _labels_rule(_rope_labels)),
    "set_rows": OpSpec("set_rows", None, _infer_set_rows, _set_rows_rule, _localize_set_rows, inplace=True),
    "top_k_candidates": OpSpec(
        "top_k_candidates",
        1,
        _infer_top_k_candidates,
        _top_k_candidates_rule,
        _localize_top_k_candidates,
        internal=True,
    ),
    "top_k_combine": OpSpec("top_k_combine", 1, _infer_top_k_combine, _labels_rule(_top_k_combine_labels)),
    "gqa_attention": OpSpec("gqa_attention", 4, _infer_gqa_attention, _gqa_attention_rule, _localize_gqa_attention),
    # a worker's empty result of an op its group runs without it (meta/compiler.py)
    NOTHING: OpSpec(NOTHING, 0, _infer_nothing, _nothing_rule, internal=True),
}


def spec(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise ShapeError(f"unknown op {name!r}; known ops: {', '.join(OPS)}") from None


def infer(name: str, shapes: Sequence[Shape], dtypes: Sequence[str], params: Params) -> tuple[Shape, str, Params]:
    op = spec(name)
    if (op.arity is not None and len(shapes) != op.arity) or not shapes:
        raise ShapeError(f"{name}: takes {op.arity or 'one or more'} operands, got {len(shapes)}")
    return op.infer([tuple(s) for s in shapes], list(dtypes), dict(params))


def signatures(
    name: str, states: Sequence[State], shapes: Sequence[Shape], params: Params, out_shape: Shape
) -> list[Signature]:
    return spec(name).rule(list(states), [tuple(s) for s in shapes], params, tuple(out_shape))


def localize(name: str, params: Params, in_states, in_shapes, out_state, out_shape, n: int, device: int) -> Params:
    fn = spec(name).localize
    return params if fn is None else fn(params, in_states, in_shapes, out_state, out_shape, n, device)
