"""Fused decoder patterns: one table of rows, each a chain of program steps that one kernel runs
in a single call with no intermediate arrays.

A row is `Pattern(name, anchor, match, kernel)`: `match(view, i)` looks at step i (an `anchor`
op) and the single-use steps that feed it, and returns a `Fusion` (the fused step's inputs and
parameters, the steps it absorbs, any scratch buffer) or None. The compiled program replaces the
anchor by the fused step and drops the absorbed ones. Every fused kernel runs the arithmetic of
the steps it replaces in their order, on float32, so a fused program gives the bits of the
unfused one; the one exception, attention over the used cache, is documented at its kernel.
Adding a pattern is a row here, its kernel, and a test with a NumPy oracle (tests/test_fused.py);
a row whose kernel is None is fused only by backends whose kernel table has one (for_kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from split_state.ops import OPS
from transport import protocol as p
from workers.kernels.basic import KERNELS, rms_norm_into, silu_into, softmax_masked_into

# cached positions are read in multiples of this, as llama.cpp pads n_kv (32; 256 for its flash-attention
# kernels, which need it): a 128-token prompt's first chunk reads 128 positions, not 256
KV_BUCKET = 32


@dataclass(frozen=True)
class Fusion:
    inputs: tuple[int, ...]
    params: dict
    absorbed: tuple[int, ...]  # indices of the steps the fused step replaces, besides the anchor
    scratch: tuple[int, ...] | None = None  # shape of a float32 scratch buffer the kernel needs


@dataclass
class ProgramView:
    """What a matcher may ask of a program: its steps, who produces each slot, how many steps
    read it, and which slots the program returns."""

    steps: list
    producer: dict[int, int] = field(default_factory=dict)
    uses: dict[int, int] = field(default_factory=dict)
    outputs: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for i, step in enumerate(self.steps):
            for slot in reads(step):
                self.uses[slot] = self.uses.get(slot, 0) + 1
            self.producer[step.output] = i

    def single_use(self, slot: int, op: str) -> int | None:
        """The index of the `op` step producing `slot` when nothing else reads it, else None."""
        i = self.producer.get(slot)
        if i is None or self.uses.get(slot) != 1 or slot in self.outputs:
            return None
        step = self.steps[i]
        return i if isinstance(step, p.OpStep) and step.op == op else None

    def float32(self, *indices: int) -> bool:
        return all(self.steps[i].dtype == "float32" for i in indices)


def reads(step) -> tuple[int, ...]:
    """The slots a program step reads."""
    return step.inputs if isinstance(step, p.OpStep) else (step.input,)


# -- rms_norm(x) * weight -------------------------------------------------------------------------


def _match_rms_norm_mul(view: ProgramView, i: int) -> Fusion | None:
    mul = view.steps[i]
    for side in (0, 1):
        norm = view.single_use(mul.inputs[side], "rms_norm")
        if norm is not None and view.float32(i, norm) and view.steps[norm].shape == mul.shape:
            x, weight = view.steps[norm].inputs[0], mul.inputs[1 - side]
            return Fusion((x, weight), dict(view.steps[norm].params), (norm,))
    return None


def _rms_norm_mul(xp, inputs, params, out=None):
    x, weight = inputs
    out = xp.empty_like(x) if out is None else out
    if x.size:
        rms_norm_into(xp, x, params["axis"], params["eps"], out)
        xp.multiply(out, weight, out=out)
    return out


# -- act(gate) * up, gate and up slices of one tensor: silu (swiglu) or gelu_f16 (geglu) -----------


def _match_gated(view: ProgramView, i: int, act: str) -> Fusion | None:
    mul = view.steps[i]
    for side in (0, 1):
        gated = view.single_use(mul.inputs[side], act)
        up = view.single_use(mul.inputs[1 - side], "slice")
        if gated is None or up is None:
            continue
        gate = view.single_use(view.steps[gated].inputs[0], "slice")
        if gate is None or not view.float32(i, gated, gate, up):
            continue
        g, u = view.steps[gate], view.steps[up]
        last = len(mul.shape) - 1
        if g.inputs != u.inputs or g.params["axis"] != last or u.params["axis"] != last or g.shape != mul.shape:
            continue
        params = {"gate": (g.params["start"], g.params["stop"]), "up": (u.params["start"], u.params["stop"])}
        return Fusion(g.inputs, params, (gate, gated, up))
    return None


def _match_swiglu(view: ProgramView, i: int) -> Fusion | None:
    return _match_gated(view, i, "silu")


def _match_geglu(view: ProgramView, i: int) -> Fusion | None:
    return _match_gated(view, i, "gelu_f16")


def _swiglu(xp, inputs, params, out=None):
    (both,) = inputs
    gate, up = both[..., slice(*params["gate"])], both[..., slice(*params["up"])]
    out = xp.empty(gate.shape, gate.dtype) if out is None else out
    silu_into(xp, gate, out)
    return xp.multiply(out, up, out=out)


def _geglu(xp, inputs, params, out=None):
    """gelu_f16(gate) * up (Gemma's gate): the unfused steps' bits."""
    (both,) = inputs
    gate, up = both[..., slice(*params["gate"])], both[..., slice(*params["up"])]
    return xp.multiply(KERNELS["gelu_f16"](xp, [gate], {}), up, out=out)


# -- attention: softmax(q @ k * scale + mask) @ v over the used cache ------------------------------


def _match_attention(view: ProgramView, i: int) -> Fusion | None:
    pv = view.steps[i]
    soft = view.single_use(pv.inputs[0], "softmax_ext")
    if soft is None or view.steps[soft].params["axis"] != len(view.steps[soft].shape) - 1:
        return None
    qk = view.single_use(view.steps[soft].inputs[0], "matmul")
    if qk is None or not view.float32(i, soft, qk):
        return None
    q, k = view.steps[qk].inputs
    mask, v = view.steps[soft].inputs[1], pv.inputs[1]
    # positions: the cache positions the step reads (a backend may pick its kernel by them)
    params = {"scale": view.steps[soft].params["scale"], "bucket": KV_BUCKET, "positions": view.steps[qk].shape[-1]}
    # scratch: the scores twice over, key-major and query-major, and room for the query rows
    # (the output's size; see attention_with)
    scores = prod(view.steps[qk].shape)
    return Fusion((q, k, mask, v), params, (qk, soft), scratch=(2 * scores + prod(pv.shape),))


def used_positions(xp, mask, bucket: int) -> int:
    """How many leading cache positions any query may see: one past the last column of `mask`
    that is not -inf in some row, rounded up to `bucket` (at most the whole cache)."""
    ctx = mask.shape[-1]
    if ctx <= bucket:
        return ctx
    open_columns = xp.flatnonzero((mask.reshape(-1, ctx) != -xp.inf).any(axis=0))
    last = int(open_columns[-1]) + 1 if open_columns.size else ctx
    return min(ctx, -(-last // bucket) * bucket)


def softmax_rows_of_columns(xp, scores, mask, group: int, scale: float, out):
    """out (..., group * tokens, n) = softmax(scores * scale + mask) over n for key-major scores
    (..., n, group * tokens), the mask (..., tokens, >= n) broadcast over the group (as over
    (..., group, tokens, n)). The CPU backend overrides it with one numba pass
    (workers/backends/cpu/numba_cpu.py)."""
    n, rows = scores.shape[-2:]
    out[...] = scores.swapaxes(-1, -2)
    grouped = out.reshape(out.shape[:-2] + (group, rows // group, n))
    softmax_masked_into(xp, grouped, mask[..., :n], scale, -1, grouped)
    return out


def scores_by_key(xp, key_rows, rows, n: int, out):
    """out (..., n, rows) = the first n key rows (..., ctx, d) times the query rows (..., rows, d),
    transposed: the attention's scores, key-major. float16 keys are widened by the product."""
    return xp.matmul(key_rows[..., :n, :], rows.swapaxes(-1, -2), out=out)


def weighted_values(xp, weights, values, n: int, out):
    """out (..., rows, d) = weights (..., rows, n) times the first n value rows (..., ctx, d)."""
    return xp.matmul(weights, values[..., :n, :], out=out)


def attention_with(
    softmax_columns: Callable,
    score_keys: Callable = scores_by_key,
    weigh_values: Callable = weighted_values,
    one_pass: Callable | None = None,
    one_plan: Callable | None = None,
    used: Callable | None = None,
) -> Callable:
    """The attention kernel: its softmax over key-major scores `softmax_columns` (with
    softmax_rows_of_columns's signature), its products `score_keys` and `weigh_values` (with
    scores_by_key's and weighted_values's). `one_pass(xp, rows, key_rows, values, mask, n, group,
    scale, weights, out) -> bool`, where given, may do all three for GQA's layout in one call
    (weights: a (rows, n) scratch); it says False for what it does not take. `one_plan(xp, rows,
    key_rows, values, mask, group, scale, out)`, where given, plans that call (workers/straight.py):
    a function of n, or None. `used`: a backend's twin of used_positions (None: that)."""

    def attention(xp, inputs, params, out=None, scratch=None, memo=None):
        """softmax(q @ k * scale + mask) @ v, reading only the first n cached positions (n from
        the mask, see used_positions): one plan serves every position, and a short sequence in
        a long context reads what it uses, not the whole preallocated cache. Every position
        past n is -inf in the mask, so it weighs exactly 0; the sums run over n terms instead of
        the whole context, which may change the last bit of a result (the unfused program sums
        the zeros too). Its shapes follow the data, so a device graph must never capture it
        (`eager`). With GQA's layout over a cache of key rows (the decoder's), each KV head's
        keys are read once, as one contiguous block: scores = keys @ queries^T, key-major (the
        fast BLAS product for a few queries: 9 against 13 us for a SmolLM2 layer's 3 heads at 256
        positions, 31 against 58 at 768),
        then the softmax turns them query-major for the product with the values."""
        q, k, mask, v = inputs
        n = _used_positions_of_run(xp, mask, params["bucket"], memo, used)
        lead = q.shape[:-1]
        size = prod(lead) * n
        if scratch is None:
            scratch = xp.empty(2 * size + q.size, xp.float32)
        stacked = _stacked(q, k, v, scratch, 2 * size)
        if stacked is not None and out is not None and out.flags.c_contiguous:
            rows, key_rows, values = stacked
            count = rows.shape[-2]
            if one_pass is not None:
                weights = scratch.reshape(-1)[size : 2 * size].reshape(-1, n)
                if one_pass(xp, rows, key_rows, values, mask, n, q.shape[-3], params["scale"], weights, out):
                    return out
            by_key = scratch.reshape(-1)[:size].reshape(rows.shape[:-2] + (n, count))
            score_keys(xp, key_rows, rows, n, by_key)
            weights = scratch.reshape(-1)[size : 2 * size].reshape(rows.shape[:-2] + (count, n))
            softmax_columns(xp, by_key, mask, q.shape[-3], params["scale"], weights)
            weigh_values(xp, weights, values, n, out.reshape(rows.shape))
            return out
        scores = scratch.reshape(-1)[:size].reshape(lead + (n,))
        xp.matmul(q, k[..., :n], out=scores)
        softmax_masked_into(xp, scores, mask[..., :n], params["scale"], -1, scores)
        if out is None:
            return xp.matmul(scores, v[..., :n, :])
        return xp.matmul(scores, v[..., :n, :], out=out)

    def plan(xp, inputs, params, out=None, scratch=None, memo=None):
        q, k, mask, v = inputs
        if out is None or not out.flags.c_contiguous:
            return None
        stacked = _stacked(q, k, v, xp.empty(0, xp.float32), 0)  # no scratch: views or copies of their own
        if stacked is None:
            return None
        rows, key_rows, values = stacked
        if not all(xp.may_share_memory(a, b) for a, b in ((rows, q), (key_rows, k), (values, v))):
            return None  # a copy made now (several query tokens) would hold this run's values
        by_n = one_plan(xp, rows, key_rows, values, mask, q.shape[-3], params["scale"], out)
        if by_n is None:
            return None
        bucket = params["bucket"]

        def run():
            by_n(_used_positions_of_run(xp, mask, bucket, memo, used))
            return out

        return run

    attention.memo = True  # takes the run's memo (workers/program.py clears it every run)
    attention.eager = True  # n comes from the data: never inside a device graph
    if one_plan is not None:
        attention.plan = plan
    return attention


def _used_positions_of_run(xp, mask, bucket: int, memo, used: Callable | None = None) -> int:
    """used_positions (or a backend's `used` of the same signature and answer), found by the
    first layer of a run: every layer reads the same mask (`memo`: the run's)."""
    key = ("used positions", id(mask), bucket)
    known = memo.get(key) if memo is not None else None
    if known is not None:
        return known[0]
    n = (used or used_positions)(xp, mask, bucket)
    if memo is not None:
        memo[key] = (n, mask)  # holding the mask: its id is not reused while the memo lasts
    return n


def head_runs(kv_of_head) -> list[tuple[int, int, int]]:
    """(first head, past the last, KV head) of each run of consecutive query heads that share a
    KV head."""
    runs: list[tuple[int, int, int]] = []
    for h, kv in enumerate(kv_of_head):
        if runs and runs[-1][2] == kv and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + 1, kv)
        else:
            runs.append((h, h + 1, kv))
    return runs


def gqa_attention_with(
    attention: Callable,
    one_pass: Callable | None = None,
    one_plan: Callable | None = None,
    one_pass_tokens: int = 1,
    used: Callable | None = None,
) -> Callable:
    """The gqa_attention op's kernel (query heads mapped to KV heads one by one, as a split that
    shares a KV head between devices leaves them) from an attention kernel of attention_with's:
    each run of query heads sharing a KV head is one call of it, in GQA's layout of that one KV
    head, so both give the same arithmetic. `one_pass(xp, rows, kv_of, keys, values, mask, n,
    scale, out) -> bool`, where given, may take every head of up to `one_pass_tokens` tokens a
    row in one call: rows (batch, heads, tokens, d), kv_of an int64 array, mask (1 or batch,
    tokens, >= n), out like rows; `one_plan(xp, rows, kv_of, keys, values, mask, scale, out)`
    plans it for one token (workers/straight.py): a function of n, or None. One call over the
    whole batch keeps a row's bits those it gets alone: the runs' calls read each KV head's
    slice of a batch of several rows, which a loop that wants whole blocks refused (BLAS then),
    and took for one row, so a short prompt prefilled beside others differed in its last bits.
    `used`: as attention_with's."""

    def gqa_attention(xp, inputs, params, out=None, memo=None):
        q, keys, values, mask = inputs
        batch, tokens, heads, width = q.shape
        out = xp.empty(q.shape, q.dtype) if out is None else out
        if not out.size:
            return out
        kv_of_head = params["kv_of_head"]
        if one_pass is not None and tokens == 1 and out.flags.c_contiguous and q.flags.c_contiguous:
            n = _used_positions_of_run(xp, mask, KV_BUCKET, memo, used)
            rows, kv_of = q.reshape(batch, heads, 1, width), _kv_index(kv_of_head)
            if one_pass(xp, rows, kv_of, keys, values, mask, n, params["scale"], out.reshape(rows.shape)):
                return out
        elif one_pass is not None and tokens <= one_pass_tokens and mask.ndim == 3:
            n = _used_positions_of_run(xp, mask, KV_BUCKET, memo, used)
            rows = xp.ascontiguousarray(q.transpose(0, 2, 1, 3))  # (batch, heads, tokens, d)
            result = xp.empty(rows.shape, xp.float32)
            if one_pass(xp, rows, _kv_index(kv_of_head), keys, values, mask, n, params["scale"], result):
                out[...] = result.transpose(0, 2, 1, 3)
                return out
        mask5 = _grouped_mask(mask, memo)
        each = {"scale": params["scale"], "bucket": KV_BUCKET}
        for first, stop, kv in head_runs(kv_of_head):
            rows = q[:, :, first:stop].transpose(0, 2, 1, 3)[:, None]  # (batch, 1, heads of the run, tokens, d)
            result = xp.empty(rows.shape, xp.float32)
            attention(
                xp,
                (rows, keys[:, kv : kv + 1, None].swapaxes(-1, -2), mask5, values[:, kv : kv + 1, None]),
                each,
                result,
                None,
                memo,
            )
            out[:, :, first:stop] = result[:, 0].transpose(0, 2, 1, 3)
        return out

    def plan(xp, inputs, params, out=None, memo=None):
        q, keys, values, mask = inputs
        batch, tokens, heads, width = q.shape
        if out is None or not out.size or tokens != 1 or not out.flags.c_contiguous or not q.flags.c_contiguous:
            return None
        rows, shaped = q.reshape(batch, heads, 1, width), out.reshape(batch, heads, 1, width)
        by_n = one_plan(xp, rows, _kv_index(params["kv_of_head"]), keys, values, mask, params["scale"], shaped)
        if by_n is None:
            return None

        def run():
            by_n(_used_positions_of_run(xp, mask, KV_BUCKET, memo, used))
            return out

        return run

    gqa_attention.memo = True  # the used positions, found once a run (as the attention's)
    gqa_attention.eager = True  # n comes from the data: never inside a device graph
    if one_plan is not None:
        gqa_attention.plan = plan
    return gqa_attention


def _grouped_mask(mask, memo):
    """The mask (1 or batch, tokens, ctx) as the attention kernel takes it, (1 or batch, 1, 1,
    tokens, ctx): one view a run, so the kernel's memo finds its used positions once."""
    key = ("grouped mask", id(mask))
    known = memo.get(key) if memo is not None else None
    if known is None:
        known = (mask.reshape(mask.shape[0], 1, 1, *mask.shape[1:]), mask)
        if memo is not None:
            memo[key] = known  # holding the mask: its id is not reused while the memo lasts
    return known[0]


_KV_INDEX: dict[tuple[int, ...], np.ndarray] = {}


def _kv_index(kv_of_head) -> np.ndarray:
    key = tuple(kv_of_head)
    found = _KV_INDEX.get(key)
    if found is None:
        found = _KV_INDEX[key] = np.asarray(key, np.int64)
    return found


def _stacked(q, k, v, scratch, at: int):
    """GQA's layout over key rows: q (..., group, tokens, d) against k (..., 1, d, ctx), a
    transposed view of (..., 1, ctx, d) rows, and v (..., 1, ctx, d), shared by the group. Gives
    q as (..., group * tokens, d) rows, the key rows (..., ctx, d) and v (..., ctx, d); None for
    other layouts. The rows are a view of q for one token; for several (a prefill's queries, a
    transposed view) they are copied into the scratch from `at` on when it has room (the
    program sizes it so), where a reshape would allocate them every layer of every run (and
    fault in fresh pages on the first run: 2,000 of them in a 128-token SmolLM2 prefill)."""
    lead = q.shape[:-3]
    if q.ndim < 4 or k.ndim != q.ndim or v.ndim != q.ndim or k.shape[-3] != 1 or v.shape[-3] != 1:
        return None
    if k.shape[:-3] != lead or v.shape[:-3] != lead or k.strides[-2] != k.itemsize:
        return None
    shape = lead + (q.shape[-3] * q.shape[-2], q.shape[-1])
    # the group and token axes merge in place (a view) when either is 1 or they are contiguous
    merges = q.shape[-2] == 1 or q.shape[-3] == 1 or q.strides[-3] == q.shape[-2] * q.strides[-2]
    if merges or scratch.size < at + q.size:
        rows = q.reshape(shape)  # a view, or (no room) a copy of its own
    else:
        rows = scratch.reshape(-1)[at : at + q.size].reshape(q.shape)
        rows[...] = q
        rows = rows.reshape(shape)
    key_rows = k.reshape(k.shape[:-3] + k.shape[-2:]).swapaxes(-1, -2)
    return rows, key_rows, v.reshape(v.shape[:-3] + v.shape[-2:])


_attention = attention_with(softmax_rows_of_columns)


# -- set_rows(cache, ids, rope(x, positions) transposed): the rotated keys written into the cache --


def _match_rope_set_rows(view: ProgramView, i: int) -> Fusion | None:
    write = view.steps[i]
    if len(write.inputs) < 3:
        return None
    turn = view.single_use(write.inputs[2], "transpose")
    if turn is None or tuple(view.steps[turn].params["axes"]) != (0, 2, 1, 3):
        return None
    rope = view.single_use(view.steps[turn].inputs[0], "rope")
    if rope is None or not view.float32(rope):
        return None
    x, positions = view.steps[rope].inputs
    params = {"set_rows": dict(write.params), "rope": dict(view.steps[rope].params), "axes": (0, 2, 1, 3)}
    return Fusion((write.inputs[0], write.inputs[1], x, positions, *write.inputs[3:]), params, (turn, rope))


# -- a quantized product plus an addend (the residual, a bias): qmatmul's result added where it lies --


def _match_qmatmul_add(view: ProgramView, i: int) -> Fusion | None:
    """add(other, product) where the product is a qmatmul read only here, directly or through a
    reshape (its blocks' layout to the row's); `other` broadcast as add broadcasts it."""
    add = view.steps[i]
    for side in (0, 1):
        source, absorbed = add.inputs[side], ()
        shaped = view.single_use(source, "reshape")
        if shaped is not None:
            source, absorbed = view.steps[shaped].inputs[0], (shaped,)
        product = view.single_use(source, "qmatmul")
        if product is None or not view.float32(i, product):
            continue
        step = view.steps[product]
        if tuple(view.steps[absorbed[0]].shape if absorbed else step.shape) != tuple(add.shape):
            continue  # the product itself broadcast: not a sum this kernel writes in place
        params = {"qmatmul": dict(step.params), "shape": tuple(step.shape), "out": tuple(add.shape)}
        return Fusion((*step.inputs, add.inputs[1 - side]), params, (*absorbed, product))
    return None


def qmatmul_add_with(qmatmul: Callable, adding: Callable | None = None) -> Callable:
    """The qmatmul_add pattern's kernel from a backend's qmatmul: the product computed into the
    result, then the addend added to it (a + b is b + a bit for bit, so the unfused add's bits):
    one call where there were two, and no buffer for the product. `adding(xp, (xb, w),
    qmatmul's params, out, addend)`, where given, plans the product and the add as one loop (a
    function of no arguments, or None where it does not take them)."""

    def qmatmul_add(xp, inputs, params, out=None):
        xb, w, addend = inputs
        out = xp.empty(tuple(params["out"]), xp.float32) if out is None else out
        if out.flags.c_contiguous:  # the product's blocks' layout is a view of it
            product = qmatmul(xp, (xb, w), params["qmatmul"], out.reshape(tuple(params["shape"])))
        else:
            product = qmatmul(xp, (xb, w), params["qmatmul"], None)
        return xp.add(product.reshape(out.shape), addend, out=out)

    def plan(xp, inputs, params, out=None):
        """The backend's `adding` plan, else the product's plan (workers/straight.py) then the add;
        given where qmatmul has a plan."""
        xb, w, addend = inputs
        if out is None or not out.flags.c_contiguous:
            return None
        both = None if adding is None else adding(xp, (xb, w), params["qmatmul"], out, addend)
        if both is not None:
            return both
        product = qmatmul.plan(xp, (xb, w), params["qmatmul"], out.reshape(tuple(params["shape"])))
        if product is None:
            return None
        add = xp.add

        def run():
            product()  # into out (contiguous: its reshape to the blocks' layout is a view)
            return add(out, addend, out=out)

        return run

    if getattr(qmatmul, "plan", None) is not None:
        qmatmul_add.plan = plan
    return qmatmul_add


@dataclass(frozen=True)
class Pattern:
    name: str  # the fused step's op name
    anchor: str  # the op of the pattern's last step, where matching starts
    match: Callable[[ProgramView, int], Fusion | None]
    # the kernel every backend runs; None: only backends whose kernel table has one (their
    # override) fuse the pattern, the others run its steps
    kernel: Callable[..., Any] | None
    scratch: bool = False  # the kernel takes a scratch buffer (Fusion.scratch)
    inplace: bool = False  # the fused step writes its first input in place and returns it, as set_rows


PATTERNS: tuple[Pattern, ...] = (
    Pattern("attention", "matmul", _match_attention, _attention, scratch=True),
    Pattern("swiglu", "mul", _match_swiglu, _swiglu),
    Pattern("geglu", "mul", _match_geglu, _geglu),
    Pattern("rms_norm_mul", "mul", _match_rms_norm_mul, _rms_norm_mul),
    # its kernels: the CPU's numba loop (workers/backends/cpu/numba_cpu.py), the GPU's
    # (workers/backends/cuda/kernels/rope.py)
    Pattern("rope_set_rows", "set_rows", _match_rope_set_rows, None, inplace=True),
    # its kernels: qmatmul_add_with a backend's qmatmul (numba_cpu.py; the CUDA backend's adds in its kernels)
    Pattern("qmatmul_add", "add", _match_qmatmul_add, None),
)

FUSED_KERNELS = {pattern.name: pattern.kernel for pattern in PATTERNS if pattern.kernel is not None}
_WRITES_IN_PLACE = frozenset(pattern.name for pattern in PATTERNS if pattern.inplace)


def writes_in_place(op: str) -> bool:
    """Whether a program step of this op writes its first input in place and returns it (an
    op of split_state.ops marked so, or a fused pattern that absorbs one)."""
    spec = OPS.get(op)
    return op in _WRITES_IN_PLACE if spec is None else spec.inplace


UNFUSED_ENV = "META_TP_UNFUSED"  # pattern names a worker leaves unfused, comma-separated ("all": every one)


def left_fused(unfused: str) -> tuple[Pattern, ...]:
    """PATTERNS less those `unfused` names (the worker's META_TP_UNFUSED): a switch for measuring a
    pattern against its steps (bench/fusion.py) or bisecting a fault, as llama.cpp's GGML_*
    environment switches are. A name no pattern has is refused, naming the ones there are."""
    names = {name.strip() for name in unfused.split(",") if name.strip()}
    if names == {"all"}:
        return ()
    known = {pattern.name for pattern in PATTERNS}
    if names - known:
        raise ValueError(f"{UNFUSED_ENV}: no pattern {sorted(names - known)}; the patterns: {sorted(known)}, or all")
    return tuple(pattern for pattern in PATTERNS if pattern.name not in names)


def for_kernels(patterns: tuple[Pattern, ...], kernels: dict) -> tuple[Pattern, ...]:
    """The patterns a worker with this kernel table fuses: those whose fused op it can run."""
    return tuple(pattern for pattern in patterns if pattern.name in kernels)


OP_KERNELS = {"gqa_attention": gqa_attention_with(_attention)}  # ops of split_state.ops made of the above


def fuse(
    steps: list, outputs: frozenset[int], patterns: tuple[Pattern, ...] = PATTERNS
) -> list[tuple[Any, tuple[int, ...] | None, int]]:
    """The program with every matched pattern replaced by its fused step (an OpStep whose op is
    the pattern's name) and the absorbed steps gone: (step, scratch shape or None, the index in
    `steps` of the step it stands for). `steps` hold OpSteps and MoveSteps only."""
    view = ProgramView(steps, outputs=outputs)
    by_anchor: dict[str, list[Pattern]] = {}
    for pattern in patterns:
        by_anchor.setdefault(pattern.anchor, []).append(pattern)
    replaced: dict[int, tuple[p.OpStep, tuple[int, ...] | None]] = {}
    gone: set[int] = set()
    for i, step in enumerate(steps):
        if not isinstance(step, p.OpStep):
            continue
        for pattern in by_anchor.get(step.op, ()):
            found = pattern.match(view, i)
            # a step already fused or absorbed is not taken twice
            if found is None or i in gone or gone.intersection(found.absorbed) or replaced.keys() & set(found.absorbed):
                continue
            fused = p.OpStep(pattern.name, found.inputs, step.output, found.params, step.shape, step.dtype)
            replaced[i] = (fused, found.scratch)
            gone.update(found.absorbed)
            break
    return [(*replaced.get(i, (step, None)), i) for i, step in enumerate(steps) if i not in gone]


def scratch_bytes(shape: tuple[int, ...]) -> int:
    return prod(shape) * np.dtype(np.float32).itemsize
