"""Fused loops for the CPU backend (its kernel overrides), compiled by numba with `cache=True`.

NumPy needs several passes and temporaries for a 576-wide norm or for rotating one token's
heads; these loops (workers/backends/cpu/numba_loops.py) do one pass with no allocation. They
accumulate in float64 where NumPy accumulates in float32, so they agree with the NumPy kernels
to rounding, not bit for bit; every CPU worker runs the same ones, so Mirrored results stay
identical across devices. silu(gate) * up is one pass too: alone, NumPy's vectorised passes were
as fast, but in a decode step each NumPy call runs after a weight product has pushed NumPy's
code and data out of the caches, and there its five passes cost 12.8 us a SmolLM2 layer (greedy
decoding's choice, top_k, cost 220 us in NumPy, 60 as a loop). A decode step's attention (up to
MAX_LOOP_QUERIES tokens) is one loop here, threaded over the query rows: scores, softmax and the
weighted values of a row in one task (SmolLM2, 1,024 positions: 82 against 92 us on one thread,
59 against 91 on two; in a decode token at ~100 positions 31.5 / 24.5 against 35.7 / 33.2 us a
layer). A prefill's keeps BLAS for its two products and takes its softmax from here: one pass
per row with an exponential that vectorises, where NumPy made five passes and a transposed copy
(11 against 22 us a SmolLM2 layer at 256 positions).

A decode step's KV-cache writes are one loop each (set_rows), the keys' with their rope (the
fused pattern rope_set_rows, which a backend without a kernel for it leaves unfused): in a
SmolLM2 token on two workers rope and the writes were four calls of ~5.5 us a layer, against
~2-3 us of work.

`OVERRIDES` maps op and pattern names to kernels with the shared kernels' signature; each falls
back to the shared NumPy kernel for layouts it does not handle (not float32, not contiguous).
Each has `prepare()`: numba imported and every loop loaded (compiled the first time on a
machine), then LLVM's code pages handed back. A worker calls it on its start, in the background;
a program that uses the kernels waits for it at load, so nothing compiles during a run. Without
numba installed OVERRIDES is empty and the NumPy kernels run everywhere.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import threading
from collections.abc import Callable

import numpy as np

from split_state.errors import ShapeError
from split_state.quant import FORMATS
from workers.backends.cpu import compile_lock, packing
from workers.backends.cpu.row_threads import over_threads
from workers.kernels import basic, fused, quant

AVAILABLE = importlib.util.find_spec("numba") is not None


@functools.cache
def _loops():
    return importlib.import_module("workers.backends.cpu.numba_loops")


@functools.cache
def _int8():
    """The integer products (8-bit activations), compiled on first import as _loops()."""
    return importlib.import_module("workers.backends.cpu.int8_products")


_FLOAT32, _FLOAT16 = np.dtype(np.float32), np.dtype(np.float16)


def _plain(*arrays) -> bool:
    for a in arrays:  # a loop and `is`, not all() over a generator: half the time, every call
        if a.dtype is not _FLOAT32 or not a.flags.c_contiguous:
            return False
    return True


def _token_rows(x, inner: int = 2):
    """x (..., tokens, *inner axes) float32 as a view (tokens, *inner) whose inner axes lie
    contiguous and whose tokens are any stride apart, or None: a prefill's queries, keys and
    values are such views of one fused product's rows (q | k | v), which a loop reads where
    they lie, not after NumPy's copy (a prefill's rope ran in NumPy for them: 9 ms of a 150 ms
    1.7B-shaped 64-token step)."""
    if x.dtype is not _FLOAT32 or x.ndim < inner or not x.size:
        return None
    expected = x.itemsize
    for axis in range(x.ndim - 1, x.ndim - 1 - inner, -1):
        if x.shape[axis] > 1 and x.strides[axis] != expected:
            return None
        expected *= x.shape[axis]
    flat = x.reshape((-1, *x.shape[x.ndim - inner :]))
    return flat if np.may_share_memory(flat, x) else None  # a copy would not see the next run's values


def _row_loop(serial, parallel, values: int):
    """The row-wise loop `serial` or, for as many values as row_threads wants threaded, its twin
    over the worker's threads (the same rows' bits)."""
    if over_threads(values, _THREADS[0]):
        _use_threads()
        return parallel
    return serial


# Each kernel here has a plan (workers/straight.py): `plan(xp, inputs, params, out, **extra)`, a
# function of no arguments running the loop on exactly these arrays (their checks done and their
# views made once), or None where the loop does not take them. The kernel itself runs its plan
# once, or the shared kernel where there is none. The views a plan holds are views (C order:
# a reshape of a contiguous array never copies), so each run reads the arrays' current values.


def _runs_plan(plan: Callable, fallback: Callable) -> Callable:
    """A kernel that runs `plan`'s function once, or `fallback` (a shared kernel) where it gives
    none; the kernel carries the plan."""

    def kernel(xp, inputs, params, out=None, *memo, **extra):
        run = plan(xp, inputs, params, out, *memo, **extra)
        return fallback(xp, inputs, params, out, *memo, **extra) if run is None else run()

    kernel.plan = plan
    kernel.__name__ = kernel.__qualname__ = plan.__name__.removeprefix("_plan_")
    kernel.__doc__ = plan.__doc__
    return kernel


def _plan_rms_norm_mul(xp, inputs, params, out=None):
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
        return None
    loops = _loops()
    loop, rows, weights, eps, result = (
        _row_loop(loops.rms_norm_mul_rows, loops.rms_norm_mul_rows_parallel, x.size),
        x.reshape(-1, n),
        weight.reshape(-1, n),
        params["eps"],
        out.reshape(-1, n),
    )

    def run():
        loop(rows, weights, eps, result)
        return out

    return run


rms_norm_mul = _runs_plan(_plan_rms_norm_mul, fused.FUSED_KERNELS["rms_norm_mul"])


def _rotation(positions, d: int, params: dict, memo: dict | None):
    """cos and sin (float32, (tokens, d / 2)) of the rope op's angles at host `positions`: every
    layer of a decode step ropes q and k at the same positions, so they are found once a run
    (the run's memo, by the positions' identity), else by basic.rotation's cache of their bytes."""
    freqs = params.get("freqs")
    key = ("rotation", id(positions), d, params["base"], None if freqs is None else tuple(freqs))
    known = memo.get(key) if memo is not None else None
    if known is None:
        cos, sin = basic.rotation(np, positions, d, params, np.float32)
        known = (cos.reshape(-1, d // 2), sin.reshape(-1, d // 2), positions)  # holding them: their id stays theirs
        if memo is not None:
            memo[key] = known
    return known[0], known[1]


def _plan_rope(xp, inputs, params, out=None, memo=None):
    x, positions = inputs
    out = xp.empty_like(x) if out is None else out
    if xp is not np or x.ndim < 2 or not x.size or positions.shape != x.shape[:-2] or not _plain(out):
        return None
    d, flat = x.shape[-1], _token_rows(x)
    if flat is None:
        return None
    loops = _loops()
    loop = _row_loop(loops.rope_rows, loops.rope_rows_parallel, x.size)
    neox, result = params["mode"] == "neox", out.reshape(flat.shape)

    def run():
        cos, sin = _rotation(positions, d, params, memo)  # the positions' values: this run's
        loop(flat, cos, sin, neox, result)
        return out

    return run


def _shared_rope(xp, inputs, params, out=None, memo=None):
    return basic.KERNELS["rope"](xp, inputs, params, out)


rope = _runs_plan(_plan_rope, _shared_rope)
rope.memo = True  # the run's memo: the rotation found once for every layer


_NO_ROTATION = np.zeros((1, 1), np.float32)
_IDS = (np.dtype(np.int32), np.dtype(np.int64))


def _rows_target(xp, dst, ids, rows, params):
    """The cache that write_rows writes `rows` into, or None where it does not take this set_rows.
    It takes the decoder's KV-cache write: a float32 cache (batch, heads, ctx, d) whole here (or
    a float16 one, as its bits, where the CPU converts halves), rows (rows, tokens, heads, d)
    (each token's heads and values contiguous, the tokens any stride apart), row j going to the
    cache's batch element j, or offset + j (`batches`: a server's
    step of its first slots, rows fewer than the cache's batch; the target is then the cache
    from element offset on, a view)."""
    if xp is not np or dst.ndim != 4 or ids.ndim != 2 or rows.ndim != 4 or params["axis"] != 2:
        return None
    halves = dst.dtype is _FLOAT16 and dst.flags.c_contiguous and _loops().NATIVE_HALVES
    if ids.dtype not in _IDS or _token_rows(rows) is None or not (halves or _plain(dst)):
        return None
    batch, heads, ctx, d = dst.shape
    spans = params["spans"]
    if params["rows"] != ctx or len(spans) != 1 or tuple(spans[0]) != (0, ctx, 0):  # the whole context here
        return None
    offset = _batch_offset(params.get("batches"), ids.shape[0])
    if offset is None or rows.shape != (ids.shape[0], ids.shape[1], heads, d) or offset + ids.shape[0] > batch:
        return None
    target = dst.view(np.uint16) if halves else dst
    return target[offset:] if offset else target


def _batch_offset(pairs, count: int) -> int | None:
    """The cache's batch element of row 0 when row j goes to element offset + j for every row
    (pairs (row, element), set_rows's `batches`; none given: row j to element j), else None."""
    if pairs is None:
        return 0
    if len(pairs) != count or not count:
        return None
    offset = pairs[0][1]
    return offset if all(tuple(pair) == (j, offset + j) for j, pair in enumerate(pairs)) else None


def _write_rows(dst, ids, rows, cos, sin, rotate: bool, neox: bool) -> None:
    if not _loops().write_rows(dst, ids, rows, cos, sin, rotate, neox):
        raise basic.ids_outside("set_rows", dst.shape[2], int(ids.min()), int(ids.max()))


def _fed_target(target, ids, fed, params):
    """The cache a write from a fed batch start (a server's slot, read at each run) goes to:
    `target` (the whole cache, _rows_target's) from that batch element on, or None where its
    rows do not go to consecutive elements this device holds (the shared kernel writes them)."""
    count = ids.shape[0]
    offset = _batch_offset(basic.fed_pairs(fed, ids, params), count)  # a start past the batch: ShapeError
    # (the loop writes count elements from there: never past the cache's end)
    return None if offset is None or offset + count > target.shape[0] else target[offset:]


def _plan_set_rows(xp, inputs, params, out=None, memo=None):
    """The decoder's KV-cache write in one loop (ids checked in it: a decode step's ids are read
    on the host by no other step), from a fed batch start too (a server's slot: through the
    shared kernel a SmolLM2 prompt's 60 writes took 2.8 ms of its 47 ms prefill on one worker,
    here 1.7); the shared kernel for every other layout."""
    if len(inputs) not in (3, 4) or inputs[2].ndim != 4:
        return None
    dst, ids, value, *fed = inputs
    rows = value.transpose(0, 2, 1, 3)  # the decoder's (b, t, heads, d)
    target = _rows_target(xp, dst, ids, rows, params)
    if target is None:
        return None

    def run():
        into = _fed_target(target, ids, fed[0], params) if fed else target
        if into is None:
            return _shared_set_rows(xp, inputs, params, None, memo)
        _write_rows(into, ids, rows, _NO_ROTATION, _NO_ROTATION, False, False)
        return dst

    return run


def _shared_set_rows(xp, inputs, params, out=None, memo=None):
    return basic.KERNELS["set_rows"](xp, inputs, params, out, memo=memo)


set_rows = _runs_plan(_plan_set_rows, _shared_set_rows)
set_rows.memo, set_rows.eager = True, True  # as the shared kernel's


def _plan_rope_set_rows(xp, inputs, params, out=None, memo=None):
    """fused.py's rope_set_rows: set_rows(cache, ids, rope(x, positions) transposed), the rotated
    rows written straight into the cache (the bits of the two steps), from a fed batch start too
    (_plan_set_rows); other layouts run the two."""
    dst, ids, x, positions, *fed = inputs
    spec, rotation = params["set_rows"], params["rope"]
    target = None if len(fed) > 1 or positions.shape != x.shape[:2] else _rows_target(xp, dst, ids, x, spec)
    if target is None:
        return None
    d, neox = x.shape[-1], rotation["mode"] == "neox"

    def run():
        into = _fed_target(target, ids, fed[0], spec) if fed else target
        if into is None:
            return _rope_then_set_rows(xp, inputs, params, None, memo)
        cos, sin = _rotation(positions, d, rotation, memo)
        _write_rows(into, ids, x, cos, sin, True, neox)
        return dst

    return run


def _rope_then_set_rows(xp, inputs, params, out=None, memo=None):
    dst, ids, x, positions, *fed = inputs
    roped = rope(xp, (x, positions), params["rope"], None, memo)
    return set_rows(xp, (dst, ids, roped.transpose(params["axes"]), *fed), params["set_rows"], None, memo)


rope_set_rows = _runs_plan(_plan_rope_set_rows, _rope_then_set_rows)
rope_set_rows.memo = True


def _plan_cast(xp, inputs, params, out=None):
    """float32 to float16 in one loop where the CPU converts halves (numba_loops.narrow_halves):
    a server's new prompt attends over its own keys and values as a float16 cache holds them
    (models/llama.py _as_cached), and NumPy's astype took 23 us a layer's keys of 24 tokens (1.4
    ms of a SmolLM2 prompt's prefill on one worker). Other casts: the shared kernel's."""
    (x,) = inputs
    usable = (
        xp is np
        and out is not None
        and x.dtype is _FLOAT32
        and out.dtype is _FLOAT16
        and out.shape == x.shape
        and 1 <= x.ndim <= 4
        and out.flags.c_contiguous
        and _loops().NATIVE_HALVES
    )
    if not usable:
        return None
    lead = (None,) * (4 - x.ndim)  # views: never a copy the plan would keep
    source, bits, loop = x[lead], out.view(np.uint16)[lead], _loops().narrow_halves

    def run():
        loop(source, bits)
        return out

    return run


cast = _runs_plan(_plan_cast, basic.KERNELS["cast"])


# rows of x (tokens) up to which the block loops beat dequantizing tiles for BLAS: with rows in
# pairs, even on one thread (1 / 2 threads, 16 rows of SmolLM2's 576 x 1,536 Q4_1 product: loops
# 471 / 251 us, tiles 593 / 601; at 24 rows 713 / 368 against 743 / 623; the 1.7B file's 2,048 x
# 8,192 at 16 rows 9.0 / 4.6 against 8.3 / 9.5 ms): a server's batch of up to 16 streams, and
# prompts that short, stay in the loops
MAX_LOOP_ROWS = 16
# formats whose loops cost more a row: the K-quants' take a row at a time, Q5's fifth bits a row
# at a time too but for their halvings; the tiles win from ~8-12 rows on one thread (2,048 x
# 8,192: Q6_K at 8 / 12 rows loops 14.8 / 21.9 ms, tiles 10.3 / 11.0; Q4_K at 12 rows 10.9
# against 9.6; Q5_0 at 8 / 12 rows 9.2 / 13.8 against 10.8 / 12.5, 576 x 1,536 0.73 against 1.0)
LOOP_ROWS = {"q4_k": 8, "q5_k": 8, "q6_k": 8, "q5_0": 12, "q5_1": 12}
MAX_LOOP_QUERIES = 8  # tokens up to which a decoder's attention is one loop over its query rows

# The threads the decode loops split a product's row groups over (numba's prange): the worker's
# --threads, cores // workers by default, as its BLAS threads. numba keeps the count per calling
# thread, so it is set again in each thread that runs a product.
_THREADS = [1]
_SET_IN = threading.local()


def set_threads(threads: int) -> None:
    """How many threads this process's decode loops use (workers/main.py, from --threads; how
    long they spin when done: workers/binding.py QUIET_POOLS)."""
    _THREADS[0] = max(1, int(threads))


def _use_threads() -> None:
    if getattr(_SET_IN, "threads", None) != _THREADS[0]:
        import numba

        numba.set_num_threads(min(_THREADS[0], numba.config.NUMBA_NUM_THREADS))
        _SET_IN.threads = _THREADS[0]


@functools.cache
def _halves() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


WIDENED = ("bf16",)  # NumPy widens tiles of its rows for BLAS at every size (a shift): no loop beats it
KINDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "q5_0": 3, "q5_1": 4}  # numba_loops.dequantize_lanes's codes
K_KINDS = {"q4_k": 0, "q5_k": 1, "q6_k": 2}  # numba_loops.dequantize_k_lanes's


def _plan_qmatmul(xp, inputs, params, out=None, addend=None):
    """Products with quantized weights, no float32 copy of the weight: for a few rows of x
    (decode) one pass over the blocks; for more (prefill) the weight a tile of row groups at a
    time into one reused float32 buffer, each tile a BLAS product. `addend` (out's shape and
    type; _plan_qmatmul_adding): the product plus it, where the integer products take the
    product, else None."""
    xb, w = inputs
    groups, lanes = w.shape[0], w.shape[3]
    width = xb.shape[-2] * xb.shape[-1] if xb.ndim >= 2 else 0
    rows = xb.size // max(1, width)
    out = xp.empty(xb.shape[:-2] + (groups, lanes), np.float32) if out is None else out
    fmt = params["format"]
    usable = xp is np and rows > 0 and w.size and _plain(xb, out) and w.flags.c_contiguous
    if usable and fmt not in WIDENED and params.get("activations") == "q8" and _int8_takes(fmt, w, width):
        x, flat = xb.reshape(rows, width), out.reshape(rows, groups * lanes)
        return _int8_run(fmt, x, w, flat, out, None if addend is None else addend.reshape(flat.shape))
    if addend is not None:
        return None
    packing.ensure_interleaved(w)  # every reader below reads the file's interleaved bytes
    if not usable or fmt in WIDENED:
        return None
    x = xb.reshape(rows, width)
    flat = out.reshape(rows, groups * lanes)
    if rows > LOOP_ROWS.get(fmt, MAX_LOOP_ROWS):

        def tiled():
            _tiled(x, w, fmt, flat)
            return out

        return tiled
    loops = _loops()
    if fmt == "q8_0":
        signed = w.view(np.int8)
        loop, pairs, args = loops.q8_0_lanes, loops.q8_0_lane_pairs, (w, signed, _halves())
    elif fmt in ("q4_k", "q5_k"):
        loop, pairs, args = loops.k_nibble_lanes, None, (w, _halves(), fmt == "q5_k")
    elif fmt == "q6_k":
        loop, pairs, args = loops.q6_k_lanes, None, (w, _halves())
    else:  # q4_0, q4_1, q5_0, q5_1
        loop, pairs = loops.nibble_lanes, loops.nibble_lane_pairs
        args = (w, _halves(), fmt in ("q4_1", "q5_1"), fmt.startswith("q5"))
    return _rows_run(loop, pairs, x, args, flat, out)


def _int8_takes(fmt: str, w, width: int) -> bool:
    """Whether the integer products take w, packed first where they read it packed (in place,
    once: packing.py)."""
    int8 = _int8()
    if not int8.takes(fmt, width, w.shape[3]):
        return False
    return not int8.packs(fmt) or packing.ensure_packed(w, fmt)


def _int8_run(fmt: str, x, w, flat, out, addend=None) -> Callable:
    """A product with 8-bit activations (workers/backends/cpu/int8_products.py), for any number
    of rows: its integer loops beat the float32 loops from one row and BLAS on dequantized tiles
    at 64 (2,048 x 8,192 on one thread, one row 1.5-3.7x, 64 rows 1.3-1.8x, every format). The
    activation buffers are the running thread's (int8_products.activations_for). `addend`
    (flat's shape): added as the loops write each row group (_plan_qmatmul_adding)."""
    product = _int8().product(fmt, x.shape[0], x.shape[1], _THREADS[0])

    def run():
        _use_threads()
        product(x, w, flat, addend)
        return out

    return run


def _plan_qmatmul_adding(xp, inputs, params, out, addend):
    """fused.qmatmul_add_with's `adding`: the integer products (8-bit activations) write
    product + addend where the addend is out's own shape (the residual of a decode step), the
    sum's bits NumPy's add of the product (int8_products._store); None otherwise (then the
    product's plan and NumPy's add)."""
    xb, w = inputs
    fits = w.ndim == 4 and xb.ndim >= 2 and out.size * xb.shape[-2] * xb.shape[-1] == xb.size * w.shape[0] * w.shape[3]
    if xp is not np or not fits or addend.shape != out.shape or not _plain(addend):
        return None
    return _plan_qmatmul(xp, inputs, params, out, addend)


def _rows_run(loop, pairs, x, args, flat, out) -> Callable:
    """A decode product's run: one row (a single stream's step) through `loop`; more (a batch's
    step) two at a time through `pairs` where the format has one (the quants widened once per
    pair: ~1.4x a row), an odd last row through `loop`. Every row's bits as alone."""
    rows = x.shape[0]
    paired = 0 if pairs is None else rows - rows % 2
    calls = [(pairs, (x[:paired], *args, flat[:paired]))] if paired else []
    if paired < rows:
        calls.append((loop, (x[paired:], *args, flat[paired:])))
    if len(calls) == 1:  # a decode step's every product: no loop over calls in its hot path
        ((kernel, arguments),) = calls

        def run_one():
            _use_threads()  # numba's count is per calling thread
            kernel(*arguments)
            return out

        return run_one

    def run():
        _use_threads()
        for kernel, arguments in calls:
            kernel(*arguments)
        return out

    return run


qmatmul = _runs_plan(_plan_qmatmul, quant.qmatmul)


def _tiled(x, w, fmt: str, flat) -> None:
    width, lanes = x.shape[1], w.shape[3]
    tile_groups = max(1, min(w.shape[0], quant.TILE_BYTES // (4 * width * lanes)))
    tile = np.empty((width, tile_groups * lanes), np.float32)  # values by rows: see dequantize_lanes
    kind, k_kind, half = KINDS.get(fmt), K_KINDS.get(fmt), _halves()
    for start in range(0, w.shape[0], tile_groups):
        part = tile[:, : min(tile_groups, w.shape[0] - start) * lanes]
        if kind is not None:
            _loops().dequantize_lanes(w, start, half, kind, part)
        elif k_kind is not None:
            _loops().dequantize_k_lanes(w, start, half, k_kind, part)
        else:  # a format with no loop: NumPy's dequantization, a tile at a time
            part[...] = quant.dequantize(np, w[start : start + tile_groups], FORMATS[fmt]).T
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


def _half_rows(key_rows, out) -> bool:
    """Whether the float16 widening serves: host float16 (B, H, ctx, d) rows in order."""
    return key_rows.dtype is _FLOAT16 and key_rows.ndim == 4 and key_rows.flags.c_contiguous and _plain(out)


def _widened(rows, n: int, at_least: int = 0):
    """The first n float16 rows of rows (B, H, ctx, d) as float32, for a BLAS product; with
    `at_least` rows past n, zeros after them."""
    wide = np.empty(rows.shape[:2] + (max(n, at_least), rows.shape[3]), np.float32)
    if at_least > n:
        wide[:, :, n:] = 0
    _loops().widen_half_rows(rows.view(np.uint16), n, _halves(), wide)
    return wide


def _scores_by_key(xp, key_rows, rows, n: int, out):
    """A prefill's scores (a decode step's: _one_pass): float16 key rows widened once, then BLAS.
    Fewer than a bucket of key rows (a short prompt's own, a server slot's first chunk), float16
    or float32, go in as a bucket's, zeros after them: BLAS took another kernel for 16 rows than
    for the 32 the same prompt reads from the cache, and their scores differed in the last bit."""
    if xp is not np or rows.ndim != 4 or key_rows.ndim != 4:
        return fused.scores_by_key(xp, key_rows, rows, n, out)
    if _half_rows(key_rows, out):
        wide = _widened(key_rows, n, fused.KV_BUCKET)
    elif n < fused.KV_BUCKET and key_rows.dtype is _FLOAT32 and _plain(out):  # float32: the same bucket
        wide = np.zeros(key_rows.shape[:2] + (fused.KV_BUCKET, key_rows.shape[3]), np.float32)
        wide[:, :, :n] = key_rows[:, :, :n]
    else:
        return fused.scores_by_key(xp, key_rows, rows, n, out)
    if wide.shape[2] > n:
        out[...] = np.matmul(wide, rows.swapaxes(-1, -2))[..., :n, :]
        return out
    return np.matmul(wide, rows.swapaxes(-1, -2), out=out)


def _weighted_values(xp, weights, values, n: int, out):
    if xp is not np or not _half_rows(values, out) or not _plain(weights) or weights.ndim != 4:
        return fused.weighted_values(xp, weights, values, n, out)
    return np.matmul(weights, _widened(values, n), out=out)


def _one_pass(xp, rows, key_rows, values, mask, n: int, group: int, scale: float, weights, out) -> bool:
    """A few query rows (decode) in one threaded loop over the used cache, GQA's layout: rows
    (B, kv, group * tokens, d) are the loop's (B, kv * group, tokens, d), query head h reading
    KV head h // group; False for other layouts. A prompt's own float32 keys and values (a
    server slot's first chunk: views of the step's projections) are copied in order first, so
    it takes the loop its cache's rows take (the loop wants contiguous rows; BLAS gave other
    last bits)."""
    if xp is np and key_rows.dtype is _FLOAT32 and not (key_rows.flags.c_contiguous and values.flags.c_contiguous):
        key_rows, values = np.ascontiguousarray(key_rows), np.ascontiguousarray(values)
    return _ran(_grouped_plan(xp, rows, key_rows, values, mask, group, scale, weights, out), n)


def _one_plan(xp, rows, key_rows, values, mask, group: int, scale: float, out):
    """_one_pass planned (workers/straight.py): a function of n, or None."""
    return _grouped_plan(xp, rows, key_rows, values, mask, group, scale, None, out)


def _grouped_plan(xp, rows, key_rows, values, mask, group: int, scale: float, weights, out):
    """_one_pass as a function of n; `weights` None: the thread's planned scratch."""
    usable = (
        xp is np
        and rows.ndim == 4
        and rows.shape[2] <= MAX_LOOP_QUERIES * group
        and mask.ndim == 5
        and mask.shape[1:3] == (1, 1)
        and _plain(rows, out)
    )
    if not usable:
        return None
    batch, kv, count, width = rows.shape
    heads, tokens = kv * group, count // group
    flat_mask = mask.reshape(mask.shape[0], mask.shape[3], mask.shape[4])
    shaped = rows.reshape(batch, heads, tokens, width), out.reshape(batch, heads, tokens, width)
    if not _views_of([(shaped[0], rows), (shaped[1], out), (flat_mask, mask)]):
        return None
    if weights is None:
        weights = _planned_weights(batch * heads * tokens, mask.shape[-1])
    return _decode_heads_plan(shaped[0], _grouped(kv, group), key_rows, values, flat_mask, scale, weights, shaped[1])


def _ran(run, n: int) -> bool:
    """Whether there was a planned loop `run`, run at n used positions."""
    if run is None:
        return False
    run(n)
    return True


_GROUPED: dict[tuple[int, int], np.ndarray] = {}


def _grouped(kv: int, group: int) -> np.ndarray:
    """Each query head's KV head in GQA's layout: h // group."""
    found = _GROUPED.get((kv, group))
    if found is None:
        found = _GROUPED[kv, group] = np.arange(kv * group, dtype=np.int64) // group
    return found


def _decode_heads_plan(rows, kv_of, keys, values, mask, scale: float, weights, out):
    """numba_loops.decode_attention over rows (B, Q, T, d), query head h reading KV head
    kv_of[h] of keys and values (B, KV, ctx, d), float32 or float16, as a function of n (the
    used positions, at most the weights' width); None for what it does not take (then the
    caller's BLAS path runs)."""
    usable = (
        rows.ndim == 4
        and mask.ndim == 3
        and mask.shape[0] in (1, rows.shape[0])
        and keys.dtype == values.dtype
        and keys.dtype in (_FLOAT32, _FLOAT16)
        and keys.flags.c_contiguous
        and values.flags.c_contiguous
        and _plain(rows, mask, out, weights)
    )
    if not usable:
        return None
    if keys.dtype == _FLOAT16:
        keys, values = keys.view(np.uint16), values.view(np.uint16)
    loop, scale32, half, room = _loops().decode_attention, np.float32(scale), _halves(), weights.shape[-1]

    def run(n: int) -> None:
        if n > room:  # the loop does not check its bounds
            raise ShapeError(f"attention: {n} used positions, room for {room}")
        _use_threads()
        loop(rows, kv_of, keys, values, mask, n, scale32, half, weights, out)

    return run


def _views_of(pairs) -> bool:
    """Whether each derived array is a view starting where its source does (a reshape that did
    not copy): a plan holds views, which must see every run's values."""
    return all(a.__array_interface__["data"][0] == b.__array_interface__["data"][0] for a, b in pairs)


_WEIGHTS: dict[tuple[int, int, int], np.ndarray] = {}


def _planned_weights(rows: int, ctx: int) -> np.ndarray:
    """The softmax rows' scratch of planned attention calls, (rows, ctx): one for every layer
    of this thread (a thread runs one call at a time), where a buffer a layer would hold
    layers * heads * ctx floats (25 MiB for a 1.7B-shaped model at 8,192 positions)."""
    key = (threading.get_ident(), rows, max(ctx, 1))
    found = _WEIGHTS.get(key)
    if found is None:
        found = _WEIGHTS[key] = np.empty(key[1:], np.float32)
    return found


def _heads_one_pass(xp, rows, kv_of, keys, values, mask, n: int, scale: float, out) -> bool:
    """gqa_attention's decode step (fused.gqa_attention_with's one_pass): the same loop."""
    return _ran(_heads_one_plan(xp, rows, kv_of, keys, values, mask, scale, out), n)


def _heads_one_plan(xp, rows, kv_of, keys, values, mask, scale: float, out):
    """_heads_one_pass planned (workers/straight.py): a function of n, or None."""
    if xp is not np or not _plain(rows, out):
        return None
    weights = _planned_weights(rows.shape[0] * rows.shape[1] * rows.shape[2], mask.shape[-1])
    return _decode_heads_plan(rows, kv_of, keys, values, mask, scale, weights, out)


def _used_positions(xp, mask, bucket: int) -> int:
    """fused.used_positions in one loop (numba_loops.last_open_column) for a float32 mask: the
    mask's NumPy passes took 41 us of a 1.7B-shaped decode step (its first layer's attention),
    run after the weight products have pushed NumPy's code and data out of the caches."""
    ctx = mask.shape[-1] if mask.ndim else 0
    if xp is not np or ctx <= bucket or not _plain(mask):
        return fused.used_positions(xp, mask, bucket)
    last = _loops().last_open_column(mask.reshape(-1, ctx)) or ctx  # none open: the whole cache
    return min(ctx, -(-last // bucket) * bucket)


attention = fused.attention_with(
    _softmax_columns, _scores_by_key, _weighted_values, _one_pass, _one_plan, used=_used_positions
)
gqa_attention = fused.gqa_attention_with(
    attention, _heads_one_pass, _heads_one_plan, MAX_LOOP_QUERIES, used=_used_positions
)


def prepare() -> None:
    """Every loop loaded (compiled the first time on a machine, from numba's cache after), for
    the argument types the kernels pass, by running each kernel once on small arrays of every
    layout it takes; then LLVM's code pages handed back (`release_compiler_code`). Runs once
    per process, on a worker's start (workers/main.py), before its weights arrive (past their
    first few MiB they wait for it: workers/server.py): the worker's peak resident set is then
    what it holds, not that plus the compiler's code. A program
    loaded meanwhile waits for it. While the cache is empty, workers of one machine compile
    one at a time (compile_lock.py): the first fills numba's cache, the others then load from
    it; once it is filled they load at once, side by side."""
    with _PREPARING:
        if not _PREPARED:
            if compiled_here():
                _warm()
            else:
                with compile_lock.one_at_a_time(compile_lock.cache_folder(__file__)):
                    _warm()
            _PREPARED.append(True)


_PREPARING, _PREPARED = threading.Lock(), []


def compiled_here() -> bool:
    """Whether numba's cache on this machine holds the loops already (or there is nothing to
    compile: no numba): else a worker's first start compiles them, ~2 minutes on 2 cores. Read
    from the cache's index files beside the sources (numba's default place, or NUMBA_CACHE_DIR)
    without importing numba."""
    if not AVAILABLE:
        return True

    def cached(module: str) -> bool:
        spec = importlib.util.find_spec(module)
        place = compile_lock.cache_folder(spec.origin if spec else None)
        stem = module.rsplit(".", 1)[-1]
        return place is not None and place.is_dir() and any(place.rglob(f"{stem}.*.nbi"))

    return cached("workers.backends.cpu.numba_loops") and cached("workers.backends.cpu.int8_products")


def _warm() -> None:
    _loops()
    for name, fmt in FORMATS.items():
        if name in WIDENED:
            continue
        w = np.zeros((2, 64 // fmt.block or 1, fmt.block_bytes, 8), np.uint8)  # 2 groups of 8 lanes
        width = w.shape[1] * fmt.block
        for rows in (1, 2, MAX_LOOP_ROWS + 1):  # the decode loops, alone and in pairs; prefill's tiles
            x = np.ones((rows, 1, width), np.float32)
            qmatmul(np, (x, w), {"format": name}, np.empty((rows, 2, 8), np.float32))
        if name in ROW_CODES:  # an embedding's lookup, ids of either type
            for ids in (np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int64)):
                qget_rows(np, (w, ids), {"format": name, "rows": 16}, np.empty((1, 1, width), np.float32))
        for kinds, loop in ((KINDS, _loops().dequantize_lanes), (K_KINDS, _loops().dequantize_k_lanes)):
            if name in kinds:  # a tile of some groups (columns of the tile: strided) and of all of them
                tile = np.empty((width, 16), np.float32)
                loop(w, 0, _halves(), kinds[name], tile[:, :8])
                loop(w, 0, _halves(), kinds[name], tile)
    for name, fmt in FORMATS.items():  # the integer products (8-bit activations): one row and four
        if _int8().takes(name, 256, 64):
            w = np.zeros((1, 256 // fmt.block, fmt.block_bytes, 64), np.uint8)
            for rows in (1, 4):
                x = np.ones((rows, 256 // fmt.block, fmt.block), np.float32)
                qmatmul(np, (x, w), {"format": name, "activations": "q8"}, np.empty((rows, 1, 64), np.float32))
    for gated in (swiglu, geglu):
        gated(np, (np.ones((1, 8), np.float32),), {"gate": (0, 4), "up": (4, 8)}, np.empty((1, 4), np.float32))
    _warm_row_twins()
    # decode's one loop, prefill's softmax and float16 widening, each cache type
    for tokens, cached in itertools.product((1, 2, MAX_LOOP_QUERIES + 1), (np.float32, np.float16)):
        q = np.ones((1, 2, 3, tokens, 8), np.float32)
        keys = np.ones((1, 2, 1, 4, 8), cached).swapaxes(-1, -2)  # key rows, as the decoder caches them
        v, mask = np.ones((1, 2, 1, 4, 8), cached), np.zeros((1, 1, 1, tokens, 4), np.float32)
        attention(np, (q, keys, mask, v), {"scale": 0.5, "bucket": 256}, np.empty(q.shape, np.float32), memo={})
        cache = np.ones((1, 2, 4, 8), cached)  # gqa_attention: heads mapped to KV heads one by one
        q = np.ones((1, tokens, 3, 8), np.float32)
        heads = {"scale": 0.5, "kv_of_head": [0, 1, 1]}
        gqa_attention(np, (q, cache, cache, mask[:, 0, 0]), heads, np.empty(q.shape, np.float32), memo={})
    release_compiler_code()


def _warm_row_twins() -> None:
    """The row-wise loops' twins over threads (a prefill's: row_threads.py), and the cache
    writes of a fused product's rows (a prefill's keys and values), every cache type."""
    loops, activations = _loops(), _int8().quantizers
    both, out = np.ones((2, 8), np.float32), np.empty((2, 4), np.float32)
    loops.swiglu_rows_parallel(both, 0, 4, 4, out)
    if loops.NATIVE_HALVES:
        loops.geglu_rows_parallel(both, 0, 4, 4, out, basic.gelu_f16_table())
        fused = np.ones((1, 3, 2, 4), np.float32)
        cos, sin = np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32)
        for kind in (np.int32, np.int64):
            for rows in (fused[:, :1], fused[:, :, :1]):  # (the loop reads an id a token: as many)
                ids = np.zeros(rows.shape[:2], kind)
                loops.write_rows(np.zeros((1, 2, 3, 4), np.uint16), ids, rows, cos, sin, True, False)
        for keys in (fused, fused.transpose(0, 2, 1, 3)):  # a cast's float32 rows, whole or strided
            loops.narrow_halves(keys, np.empty(keys.shape, np.uint16))
    x = np.ones((2, 256), np.float32)
    q, sums = np.empty((2, 256), np.int8), np.empty((2, 16), np.int32)
    activations.quantize_q8_k_parallel(x, q, np.empty((2, 1), np.float32), sums)
    for with_s in (False, True):
        blocks = np.empty((2, 8), np.float32)
        activations.quantize_q8_0_parallel(x, q, blocks, sums[:, :8], blocks.copy(), with_s)


MADV_DONTNEED = 4


def release_compiler_code() -> None:
    """Drop this process's resident pages of LLVM's machine code (libllvmlite's executable
    mappings): once the loops are loaded, nothing runs it until a loop for new argument types
    compiles, which reads the pages back from the library file. 50 MiB of a decoding worker's
    resident set (SmolLM2, Q4_1), a fifth of it. Only code: never written, its pages are the
    file's, so dropping them loses nothing (the library's data pages, relocated in place, are
    left alone). Linux only; elsewhere, or if the kernel refuses, nothing happens."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as maps:
            spans = [line.split() for line in maps]
    except (OSError, AttributeError):
        return
    for fields in spans:
        if len(fields) > 5 and fields[1] == "r-xp" and "libllvmlite" in fields[5]:
            start, stop = (int(a, 16) for a in fields[0].split("-"))
            libc.madvise(start, stop - start, MADV_DONTNEED)


def _gated_rows(xp, inputs, params, out):
    """(rows of the gate | up tensor, gate start, up start, n, out's rows) for a gated loop, or
    None where the arrays are not ones it takes."""
    (both,) = inputs
    (gate, gate_end), (up, up_end) = params["gate"], params["up"]
    n = gate_end - gate
    usable = (
        xp is np
        and out is not None
        and both.ndim >= 1
        and 0 <= gate <= gate_end <= both.shape[-1]
        and 0 <= up
        and up_end - up == n
        and up_end <= both.shape[-1]
        and out.shape == both.shape[:-1] + (n,)
        and both.size
        and _plain(both, out)
    )
    if not usable:
        return None
    return both.reshape(-1, both.shape[-1]), gate, up, n, out.reshape(-1, n)


def _plan_swiglu(xp, inputs, params, out=None):
    """fused.py's swiglu, silu(gate) * up, in one pass (numba_loops.swiglu_rows): NumPy's five
    passes cost 12.8 us a SmolLM2 layer in a decode token (1,536 values), against ~1 us of work."""
    args = _gated_rows(xp, inputs, params, out)
    if args is None:
        return None
    loop = _row_loop(_loops().swiglu_rows, _loops().swiglu_rows_parallel, out.size)

    def run():
        loop(*args)
        return out

    return run


def _plan_geglu(xp, inputs, params, out=None):
    """fused.py's geglu, gelu_f16(gate) * up, in one pass (numba_loops.geglu_rows) where the CPU
    narrows float32 to float16 in one instruction: NumPy's table lookup took ~25 us a layer of
    a 2,560-wide FFN in a decode token, a Gemma file's decode 13 % slower than a llama file's of
    the same shape."""
    loops = _loops()
    args = _gated_rows(xp, inputs, params, out) if loops.NATIVE_HALVES else None
    if args is None:
        return None
    loop, table = _row_loop(loops.geglu_rows, loops.geglu_rows_parallel, out.size), basic.gelu_f16_table()

    def run():
        loop(*args, table)
        return out

    return run


swiglu = _runs_plan(_plan_swiglu, fused.FUSED_KERNELS["swiglu"])
geglu = _runs_plan(_plan_geglu, fused.FUSED_KERNELS["geglu"])


_FLOAT64 = np.dtype(np.float64)


ROW_CODES = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7}  # looked_up_rows'


def _plan_qget_rows(xp, inputs, params, out=None):
    """quant.qget_rows (rows of a quantized table: an embedding's lookup) in one loop
    (numba_loops.looked_up_rows: the bits of NumPy's dequantization), where the shared kernel's
    gather, masks and dequantization are a dozen NumPy calls: 120-180 us a 1.7B-shaped decode
    step against ~20 warm. Planned, what a call finds of the table and the spans is found once
    (61 us a decode step unplanned), but not the table's layout: a tied head's first product
    packs it in place (packing.py) after the lookup was planned, so it is read again whenever
    some weight has been packed or unpacked since. Other formats and layouts: None (the shared
    kernel)."""
    table, ids = inputs
    code = ROW_CODES.get(params["format"])
    usable = xp is np and code is not None and table.ndim == 4 and table.dtype == np.uint8 and ids.dtype in _IDS
    width = table.shape[1] * FORMATS[params["format"]].block if usable else 0
    if (
        not usable
        or out is None
        or out.dtype != np.float32
        or not out.flags.c_contiguous
        or not ids.flags.c_contiguous
        or out.shape != ids.shape + (width,)
        or not out.size
    ):
        return None
    spans = np.asarray(params.get("spans", [(0, params["rows"], 0)]), np.int64).reshape(-1, 3)
    flat, target, rows = ids.reshape(-1), out.reshape(-1, width), params["rows"]
    size, lanes, loop, halves = table.shape[2], table.shape[3], _loops().looked_up_rows, _halves()
    byte_map, layout_of, changes = packing.byte_map, packing.layout_of, packing.layout_changes
    read = [-1, None]  # [layout_changes() when the layout was read, its byte map]

    def run():
        if read[0] != changes():
            read[0] = changes()
            read[1] = byte_map(size, lanes, layout_of(table))
        where, step = read[1]
        if not loop(table, where, step, flat, spans, rows, halves, code, target):
            raise basic.ids_outside("qget_rows", rows, int(flat.min()), int(flat.max()))
        return out

    return run


def _interleaved_qget_rows(xp, inputs, params, out=None):
    packing.ensure_interleaved(inputs[0])
    return quant.qget_rows(xp, inputs, params, out)


qget_rows = _runs_plan(_plan_qget_rows, _interleaved_qget_rows)


def top_k_candidates(xp, inputs, params, out=None):
    """This device's best k of one span in one loop (numba_loops.best_of_rows), where the shared
    kernel makes a dozen NumPy calls, each slow in a decode step, run between weight products
    that have pushed NumPy's code and data out of the caches. Measured over SmolLM2's 49,152
    logits: greedy's k = 1 16 us in a decode step against 150, a sampled step's k = 256 82 us
    alone against 1.4 ms. Several spans: the shared kernel."""
    (x,) = inputs
    spans, k, width = params["spans"], int(params["k"]), int(params["width"])
    if xp is np and len(spans) == 1 and out is not None and 1 <= k <= width:
        start, length, local = (int(s) for s in spans[0])
        if (
            length > 0
            and x.ndim >= 1
            and local + length <= x.shape[-1]
            and _plain(x)
            and out.dtype is _FLOAT64
            and out.flags.c_contiguous
            and out.shape == x.shape[:-1] + (width, 2)
        ):
            rows = x.reshape(-1, x.shape[-1])
            _loops().best_of_rows(rows, local, length, start, min(k, length), out.reshape(-1, width, 2))
            return out
    return basic.KERNELS["top_k_candidates"](xp, inputs, params, out)


def top_k_combine(xp, inputs, params, out=None):
    """The devices' candidates to the best k in one loop (numba_loops.best_of_pairs)."""
    (c,) = inputs
    k = int(params["k"])
    if (
        xp is np
        and out is not None
        and c.ndim >= 2
        and c.shape[-1] == 2
        and 1 <= k <= c.shape[-2]
        and c.dtype is _FLOAT64
        and c.flags.c_contiguous
        and out.dtype is _FLOAT64
        and out.flags.c_contiguous
        and out.shape == c.shape[:-2] + (k, 2)
    ):
        _loops().best_of_pairs(c.reshape(-1, c.shape[-2], 2), k, out.reshape(-1, k, 2))
        return out
    return basic.KERNELS["top_k_combine"](xp, inputs, params, out)


for kernel in (
    rms_norm_mul,
    rope,
    qmatmul,
    attention,
    gqa_attention,
    set_rows,
    rope_set_rows,
    cast,
    swiglu,
    geglu,
    top_k_candidates,
    top_k_combine,
    qget_rows,
):
    kernel.prepare = prepare

OVERRIDES = (
    {
        "rms_norm_mul": rms_norm_mul,
        "swiglu": swiglu,
        "geglu": geglu,
        "rope": rope,
        "set_rows": set_rows,
        "rope_set_rows": rope_set_rows,
        "cast": cast,
        "qmatmul": qmatmul,
        "qmatmul_add": fused.qmatmul_add_with(qmatmul, _plan_qmatmul_adding),
        "attention": attention,
        "gqa_attention": gqa_attention,
        "top_k_candidates": top_k_candidates,
        "top_k_combine": top_k_combine,
        "qget_rows": qget_rows,
    }
    if AVAILABLE
    else {}
)
