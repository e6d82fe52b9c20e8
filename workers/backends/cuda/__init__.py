"""The CUDA backend: one GPU through CuPy, with its kernels of our own in this folder (device.py
lists them: CUDA C with a NumPy twin each) and its capturable cuBLAS products (cublas.py).

Stream discipline (every place device data crosses to the host or a peer follows it):
- every kernel of a worker runs on its compute stream, made current when the backend starts, so
  kernels, NCCL calls (which take the current stream) and device-to-device copies are ordered;
- `to_host` records an event on the compute stream and makes the copy stream wait on it before
  copying, so a host copy (a collective's send, a Get) never reads data not yet computed; it
  then waits for the copy, so the host array is complete when returned; `read_later` instead
  copies on the compute stream itself, behind the kernels issued so far, and records an event the
  caller waits on later (the decode loop's token ids: the next step is issued meanwhile);
- host staging buffers are pinned and come from CuPy's pinned-memory pool, so a transfer does not
  pin fresh memory each time; a buffer returns to the pool when its last reference goes (a
  ZeroMQ send that still holds it keeps it alive).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from workers.backends import DeviceInfo
from workers.backends.cuda import cublas
from workers.backends.cuda.kernels import attend, dequant, device, prefill_attend, qgemv, sample, top_k
from workers.backends.cuda.kernels import get_rows as get_rows_kernel
from workers.backends.cuda.kernels import rms_norm as rms_norm_kernel
from workers.backends.cuda.kernels import rope as rope_kernel
from workers.backends.cuda.kernels import set_rows as set_rows_kernel
from workers.backends.cuda.kernels import swiglu as swiglu_kernel
from workers.kernels import basic, fused, quant

# (id(array module), device index) -> the device's capturable float32 products
# (workers/backends/cuda/cublas.py), opened by the first Backend of the device in this process;
# none where cuBLAS cannot be opened (a build without the library). Keyed by the module too: a
# test process may drive the real CuPy and the stand-in in turn, whose arrays cuBLAS must never
# be handed (by id(): a test's fake module may not hash; a gemm holds its module, so the id stays
# its own).
_GEMMS: dict[tuple[int, int], cublas.CapturableGemm] = {}


# (id(array module), device index) -> the device's kernels of our own (workers/backends/cuda/kernels/device.py),
# compiled by the first Backend of the device in this process
_DEVICE_KERNELS: dict[tuple[int, int], dict] = {}


def _own_kernels(xp, operand) -> dict | None:
    """The kernels of our own compiled for `operand`'s device, or None."""
    return _DEVICE_KERNELS.get((id(xp), operand.device.id)) if _DEVICE_KERNELS else None


def _gemm(xp, a, b, out):
    """a @ b into out through the device's capturable cuBLAS product; None where it cannot."""
    gemm = _GEMMS.get((id(xp), a.device.id)) if _GEMMS else None
    return None if gemm is None else gemm(a, b, out)


def matmul(xp, inputs, params, out=None):
    a, b = inputs
    # a compiled program gives every product its `out` (a fresh result too); a call without one,
    # never in a device graph, gets CuPy's product
    if out is not None and _gemm(xp, a, b, out) is not None:
        return out
    return basic.KERNELS["matmul"](xp, inputs, params, out)


def _tile_product(xp, x, tile, out) -> None:
    if _gemm(xp, x, tile, out) is None:
        quant.tile_product(xp, x, tile, out)


def _dequantized(xp, w, fmt):
    """A prefill's tile of a weight dequantized by a kernel of our own (workers/backends/cuda/kernels/dequant.py:
    one launch where CuPy's expressions made about a dozen) for the formats it has; the others by
    CuPy's expressions."""
    kernels = _own_kernels(xp, w)
    if kernels is None or fmt.name not in dequant.FORMAT_NAMES or not w.flags.c_contiguous:
        return quant.dequantize(xp, w, fmt)
    return dequant.launch(xp, kernels, fmt.name, w)


# float32 bytes of a prefill's dequantized tile on the GPU: a 1.7B-shaped layer's weights in ~30
# tiles (two launches each, the tile and its product) where the CPU's 1 MiB made ~230; a captured
# segment's pool holds one tile at a time
TILE_BYTES = 8 << 20
_tiled_qmatmul = quant.qmatmul_with(_tile_product, _dequantized, TILE_BYTES)


def _direct(xp, xb, w, out):
    """(the device's kernels, x as (rows, width)) where a product is qgemv.py's (a few rows of
    x, a packed result), else None."""
    kernels = _own_kernels(xp, w)
    width = xb.shape[-2] * xb.shape[-1] if xb.ndim >= 2 else 0
    rows = xb.size // width if width else 0
    direct = kernels is not None and 0 < rows <= qgemv.MAX_ROWS and w.size and out is not None
    if not direct or not (out.flags.c_contiguous and w.flags.c_contiguous):
        return None
    return kernels, xp.ascontiguousarray(xb.reshape(rows, width))


def qmatmul(xp, inputs, params, out=None):
    """A few rows of x (decode): one kernel of our own per format reading the blocks where they
    lie (workers/backends/cuda/kernels/qgemv.py), captured in a device graph like any kernel; more rows
    (prefill): dequantized tiles through cuBLAS."""
    xb, w = inputs
    found = _direct(xp, xb, w, out)
    if found is None:
        return _tiled_qmatmul(xp, inputs, params, out)
    kernels, x = found
    qgemv.launch(xp, kernels, params["format"], x, w, out.reshape(x.shape[0], -1))
    return out


_qmatmul_then_add = fused.qmatmul_add_with(qmatmul)


def qmatmul_add(xp, inputs, params, out=None):
    """The qmatmul_add pattern (a product and the residual added to it): in a decode step one
    qgemv.py kernel that adds the addend as it writes the sums (one launch where there were
    two); other shapes (an addend broadcast, a prefill's rows): the product, then the add."""
    xb, w, addend = inputs
    found = _direct(xp, xb, w, out)
    plain = addend.dtype == np.float32 and addend.shape == tuple(params["out"]) and addend.flags.c_contiguous
    if found is None or not plain:
        return _qmatmul_then_add(xp, inputs, params, out)
    kernels, x = found
    rows = x.shape[0]
    qgemv.launch(xp, kernels, params["qmatmul"]["format"], x, w, out.reshape(rows, -1), addend.reshape(rows, -1))
    return out


def set_rows(xp, inputs, params, out=None, memo=None):
    """KV-cache writes: when a device graph captures them, a kernel of our own reading the
    positions on the device (workers/backends/cuda/kernels/set_rows.py), so the write is in the graph; run
    eagerly (a step's first run, or another layout), the shared kernel, which checks the
    positions on the host and raises for one outside the cache."""
    dst, ids, value = inputs[:3]
    fed_start = len(inputs) == 4
    kernels = _own_kernels(xp, dst)
    if kernels is not None and _capturing(xp) and set_rows_kernel.fits(dst, ids, value, params, fed_start):
        set_rows_kernel.launch(xp, kernels, dst, ids, value, inputs[3] if fed_start else None)
        return dst
    return basic.KERNELS["set_rows"](xp, inputs, params, out, memo=memo)


set_rows.memo = True  # and not eager: a capture holds it (the shared kernel is eager)


def rope(xp, inputs, params, out=None):
    """Rope as one kernel of our own (workers/backends/cuda/kernels/rope.py), the shared kernel's arithmetic;
    the shared kernel for other layouts."""
    x, positions = inputs
    kernels = _own_kernels(xp, x)
    if kernels is not None and rope_kernel.fits(x, positions, x if out is None else out):
        target = xp.empty_like(x) if out is None else out
        inverse = basic.inverse_frequencies(xp, x.shape[-1], params)
        rope_kernel.launch(xp, kernels, x, positions, inverse, params["mode"] == "neox", target)
        return target
    return basic.KERNELS["rope"](xp, inputs, params, out)


def rope_set_rows(xp, inputs, params, out=None, memo=None):
    """The fused pattern rope_set_rows (workers/kernels/fused.py): when a device graph captures
    it, one kernel rotating the keys and writing them into the cache at the positions the device
    holds; run eagerly, rope and then set_rows (which checks the positions on the host)."""
    dst, ids, x, positions, *fed = inputs
    spec, rotation = params["set_rows"], params["rope"]
    kernels = _own_kernels(xp, dst)
    if kernels is not None and _capturing(xp) and rope_kernel.fits_write(dst, ids, x, positions, spec, bool(fed)):
        inverse = basic.inverse_frequencies(xp, x.shape[-1], rotation)
        neox = rotation["mode"] == "neox"
        rope_kernel.launch_write(xp, kernels, dst, x, positions, inverse, ids, fed[0] if fed else None, neox)
        return dst
    roped = rope(xp, (x, positions), rotation)
    return set_rows(xp, (dst, ids, roped.transpose(params["axes"]), *fed), spec, None, memo)


rope_set_rows.memo = True  # for set_rows's, run eagerly


def rms_norm_mul(xp, inputs, params, out=None):
    """The rms_norm_mul pattern as one kernel of our own (workers/backends/cuda/kernels/rms_norm.py); other
    layouts: the shared kernel."""
    x, weight = inputs
    kernels = _own_kernels(xp, x)
    if kernels is None or not rms_norm_kernel.fits(x, weight, params, out):
        return fused.FUSED_KERNELS["rms_norm_mul"](xp, inputs, params, out)
    rms_norm_kernel.launch(xp, kernels, x, weight, params["eps"], out)
    return out


def swiglu(xp, inputs, params, out=None):
    """The swiglu pattern as one kernel of our own (workers/backends/cuda/kernels/swiglu.py); other layouts:
    the shared kernel."""
    (both,) = inputs
    kernels = _own_kernels(xp, both)
    if kernels is None or not swiglu_kernel.fits(both, params, out):
        return fused.FUSED_KERNELS["swiglu"](xp, inputs, params, out)
    swiglu_kernel.launch(xp, kernels, both, params, out)
    return out


def get_rows(xp, inputs, params, out=None):
    """The embedding lookup: when a device graph captures it, a kernel of our own reading the
    ids on the device (workers/backends/cuda/kernels/get_rows.py); run eagerly, the shared kernel, which checks
    the ids on the host."""
    table, ids = inputs
    where = get_rows_kernel.span(params)
    kernels = _own_kernels(xp, table)
    plain = table.ndim == 2 and table.dtype == np.float32 and table.flags.c_contiguous
    if kernels is not None and _capturing(xp) and plain and where is not None and _plain_out(out):
        get_rows_kernel.launch(xp, kernels, "rows_f32", table, ids, out, (table.shape[1],), where, table.shape[0])
        return out
    return basic.KERNELS["get_rows"](xp, inputs, params, out)


def qget_rows(xp, inputs, params, out=None):
    """The lookup in a table kept in Q8_0 blocks, as get_rows; other formats: the shared kernel."""
    table, ids = inputs
    where = get_rows_kernel.span(params)
    kernels = _own_kernels(xp, table)
    fits = params["format"] == "q8_0" and table.ndim == 4 and table.flags.c_contiguous
    if kernels is not None and _capturing(xp) and fits and where is not None and _plain_out(out):
        groups, blocks, _, lanes = table.shape
        get_rows_kernel.launch(xp, kernels, "rows_q8_0", table, ids, out, (blocks, lanes), where, groups * lanes)
        return out
    return quant.KERNELS["qget_rows"](xp, inputs, params, out)


def attention(xp, inputs, params, out=None, scratch=None, memo=None):
    """Attention by kernels of our own reading the open positions from the mask on the device, so
    every run of a step computes the same way eagerly and in a device graph: a decode step's few
    query tokens by flash-decoding's two passes (workers/backends/cuda/kernels/attend.py), a
    prompt's over at most prefill_attend.MAX_POSITIONS cache positions by tiles of queries
    (workers/backends/cuda/kernels/prefill_attend.py). Other operands (a longer cache, another
    layout, a head dim past MAX_DIM): the shared kernel, which finds the used length on the host
    and so runs outside the graphs."""
    q, k, mask, v = inputs
    kernels = _own_kernels(xp, q)
    found = attend.operands(q, k, mask, v, out) if kernels is not None and out is not None else None
    if found is None or not _ours(out.shape[-2], v.shape[-2]):
        return fused.FUSED_KERNELS["attention"](xp, inputs, params, out, scratch=scratch, memo=memo)
    keys, values, mask_batch = found
    if attend.runs_here(tuple(out.shape)):
        attend.launch(xp, kernels, q, keys, values, mask, mask_batch, params["scale"], out, scratch)
    else:
        prefill_attend.launch(xp, kernels, q, keys, values, mask, mask_batch, params["scale"], out)
    return out


def _ours(tokens: int, positions: int | None) -> bool:
    """Whether a step of `tokens` query tokens a row over `positions` cache positions (None: not
    known) is our kernels': a decode step's always; a prompt's where the cache is short (a
    prompt's own keys, a short context), where by count the tiles should beat cuBLAS + softmax's
    launches and passes. Past that the tiles walk every position a block at a fraction of the
    rate cuBLAS's products reach; where they break even is for a GPU to measure
    (bench/attention.py)."""
    return tokens <= attend.MAX_TOKENS or (positions is not None and positions <= prefill_attend.MAX_POSITIONS)


def _fused_attention_is_ours(step) -> bool:
    """_ours for a fused attention step: its params name the cache positions it reads."""
    return attend.decoder_rows(tuple(step.shape)) and _ours(step.shape[-2], step.params.get("positions"))


attention.memo = True  # for the shared kernel it falls back to
attention.eager = lambda step: not _fused_attention_is_ours(step)  # ours: in the graph
# our prompt tiles want none of the score matrices the fused pattern plans for (workers/program.py
# asks); a decode step's partials and the shared kernel use them
attention.scratch_for = lambda step, planned: (
    None if _fused_attention_is_ours(step) and not attend.runs_here(tuple(step.shape)) else planned
)


# (id(array module), device index, head map) -> the map as an int32 device array: made at a
# step's first (eager) run, so a capture finds it
_KV_MAPS: dict[tuple, Any] = {}


def gqa_attention(xp, inputs, params, out=None, memo=None):
    """The gqa_attention op (a split sharing a KV head between devices) by the mapped kernels of
    our own: a decode step's in the device graph like the attention's; a prompt's over a short
    cache (_ours) eagerly, between graphs, since a step does not say how long its cache is.
    Other operands: the shared kernel, run by runs of heads between graphs."""
    q, keys, values, mask = inputs
    kernels = _own_kernels(xp, q)
    mask_batch = attend.map_operands(q, keys, values, mask, out) if kernels is not None and out is not None else None
    if mask_batch is None or not _ours(out.shape[1], keys.shape[2]):
        return fused.OP_KERNELS["gqa_attention"](xp, inputs, params, out, memo=memo)
    heads = tuple(params["kv_of_head"])
    key = (id(xp), q.device.id, heads)
    kv_of = _KV_MAPS.get(key)
    if kv_of is None:
        kv_of = _KV_MAPS[key] = xp.asarray(np.array(heads, np.int32))
    if attend.maps_here(tuple(out.shape)):
        attend.launch_mapped(xp, kernels, q, keys, values, mask, mask_batch, kv_of, params["scale"], out)
    else:
        prefill_attend.launch_mapped(xp, kernels, q, keys, values, mask, mask_batch, kv_of, params["scale"], out)
    return out


gqa_attention.memo = True  # for the shared kernel it falls back to
gqa_attention.eager = lambda step: not attend.maps_here(tuple(step.shape))  # a decode step's: in the graph


def top_k_candidates(xp, inputs, params, out=None):
    """This device's best k logits by kernels of our own (workers/backends/cuda/kernels/top_k.py), eagerly and
    in a device graph alike; several spans, float64 logits or a k past MAX_K: the shared kernel
    (whose capture fails: it reads on the host)."""
    (x,) = inputs
    spans = [tuple(s) for s in params["spans"] if s[1]]
    k, width = params["k"], params["width"]
    kernels = _own_kernels(xp, x)
    if kernels is None or len(spans) > 1 or x.dtype != np.float32 or k > top_k.MAX_K:
        return basic.KERNELS["top_k_candidates"](xp, inputs, params, out)
    into = _pairs_into(xp, out, x.shape[:-1] + (width, 2))
    start, length, local = spans[0] if spans else (0, 0, 0)
    top_k.select(xp, kernels, top_k.FROM_FLOATS, x[..., local : local + length], length, start, k, width, into)
    return _delivered(xp, into, out)


def top_k_combine(xp, inputs, params, out=None):
    """The best k of the devices' candidates, as top_k_candidates."""
    (c,) = inputs
    k = params["k"]
    kernels = _own_kernels(xp, c)
    if kernels is None or k > top_k.MAX_K:
        return basic.KERNELS["top_k_combine"](xp, inputs, params, out)
    into = _pairs_into(xp, out, c.shape[:-2] + (k, 2))
    top_k.select(xp, kernels, top_k.FROM_PAIRS, c, c.shape[-2], 0, k, k, into)
    return _delivered(xp, into, out)


def _pairs_into(xp, out, shape):
    """Where a kernel writing packed float64 pairs writes: `out`, or a buffer where it is not that."""
    if out is not None and out.flags.c_contiguous and out.dtype == np.float64:
        return out
    return xp.empty(shape, xp.float64)


def _delivered(xp, result, out):
    if out is None or result is out:
        return result
    xp.copyto(out, result)
    return out


def _plain_out(out) -> bool:
    return out is not None and out.dtype == np.float32 and out.flags.c_contiguous


def _capturing(xp) -> bool:
    return bool(xp.cuda.get_current_stream().is_capturing())


KERNELS = {
    "matmul": matmul,
    "qmatmul": qmatmul,
    "qmatmul_add": qmatmul_add,
    "set_rows": set_rows,
    "rope": rope,
    "rope_set_rows": rope_set_rows,
    "rms_norm_mul": rms_norm_mul,
    "swiglu": swiglu,
    "get_rows": get_rows,
    "qget_rows": qget_rows,
    "attention": attention,
    "gqa_attention": gqa_attention,
    "top_k_candidates": top_k_candidates,
    "top_k_combine": top_k_combine,
}


class Backend:
    name = "cuda"
    kind = "gpu"
    priority = 10
    host_threads = False

    @classmethod
    def device_count(cls) -> int:
        try:
            import cupy

            return int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # no CuPy, no driver, no device: all mean "no GPUs here"
            return 0

    @classmethod
    def default_workers(cls) -> int:
        return cls.device_count()

    def __init__(self, index: int = 0):
        import cupy
        import cupyx

        self.index = index
        self.xp = cupy
        self._empty_pinned = cupyx.empty_pinned
        self.device = cupy.cuda.Device(index)
        self.device.use()
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
        self.compute = cupy.cuda.Stream(non_blocking=True)
        self.compute.use()  # the current stream of this thread: every kernel runs on it
        self.copy = cupy.cuda.Stream(non_blocking=True)
        key = (id(cupy), index)
        if key not in _GEMMS:
            try:
                _GEMMS[key] = cublas.CapturableGemm(cupy)
            except (ImportError, OSError, AttributeError, RuntimeError):
                pass  # CuPy's own products, never captured
        # ops never captured in a device graph: with the products of our own cuBLAS handle, none;
        # without it CuPy hands floating-point products to cuBLAS and refuses any cuBLAS call
        # while a stream captures ("calling cuBLAS API during stream capture is currently
        # unsupported", cupy/cupy#6290), so a segment holding one would fail its capture
        self.uncaptured = frozenset() if key in _GEMMS else frozenset({"matmul", "qmatmul", "qmatmul_add"})
        if key not in _DEVICE_KERNELS:  # at start-up, before any weight moves: a failure names the kernel
            _DEVICE_KERNELS[key] = device.compile_all(cupy)

    def info(self) -> DeviceInfo:
        free, total = self.xp.cuda.runtime.memGetInfo()
        props = self.xp.cuda.runtime.getDeviceProperties(self.index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return DeviceInfo(self.name, self.index, f"cuda:{self.index}", name, self.kind, int(total), int(free))

    def memory(self) -> dict[str, int]:
        """What this worker holds on its GPU: the bytes CuPy's pool hands out now (weights, KV
        caches, results, scratch) and holds (with its free blocks), and the device's free and
        total bytes (other processes' too)."""
        pool = self.xp.get_default_memory_pool()
        free, total = self.xp.cuda.runtime.memGetInfo()
        return {
            "pool_used": int(pool.used_bytes()),
            "pool_held": int(pool.total_bytes()),
            "free": int(free),
            "total": int(total),
        }

    def to_device(self, array: np.ndarray) -> Any:
        return self.xp.asarray(array)  # on the compute stream, after the kernels before it

    def to_host(self, array: Any) -> np.ndarray:
        shape = array.shape  # ascontiguousarray turns a 0-d array into shape (1,), as NumPy's does
        array = self.xp.ascontiguousarray(array)  # a box of a larger tensor: packed on the compute stream
        ready = self.compute.record()  # everything issued so far, the producer of `array` included
        self.copy.wait_event(ready)
        out = self._empty_pinned(array.shape, dtype=array.dtype)
        array.get(out=out, stream=self.copy)
        self.copy.synchronize()
        return out.reshape(shape)

    def read_later(self, array: Any) -> Callable[[], np.ndarray]:
        """A copy of `array` to the host issued on the compute stream, behind what is issued
        so far, into pinned memory, not waited for: the function returned waits for it and gives
        the host copy. The decode loop issues the next step behind it (workers/generation.py),
        so the host's work between tokens overlaps the device's next step."""
        array = self.xp.ascontiguousarray(array)
        out = self._empty_pinned(array.shape, dtype=array.dtype)
        array.get(out=out, stream=self.compute, blocking=False)
        landed = self.compute.record()

        def wait() -> np.ndarray:
            landed.synchronize()
            return out

        return wait

    def synchronize(self) -> None:
        self.compute.synchronize()

    def device_sampler(self, rule, rng, steps, recent, values, indices, tokens, positions):
        """The decode loop's tokens chosen on this GPU (workers/backends/cuda/kernels/sample.py), or None: no
        kernels of our own here, or arrays the kernel does not read (checked before any draw)."""
        kernels = _own_kernels(self.xp, values)
        if kernels is None or not sample.DeviceSampler.reads(values, indices, tokens, positions):
            return None
        arrays = (values, tokens, positions)
        return sample.DeviceSampler(self.xp, kernels["sample_next"], self.read_later, rule, rng, steps, recent, *arrays)

    # -- device graphs (workers/graphs.py): kernels captured on the compute stream, replayed on it

    def begin_capture(self) -> None:
        self.compute.begin_capture()

    def end_capture(self):
        return self.compute.end_capture()

    def launch(self, graph) -> None:
        graph.launch(stream=self.compute)

    def capture_pool(self) -> CapturePool:
        """A pool of its own for one segment's captures: what a captured kernel allocates is
        written again at every replay, so nothing outside may reuse it."""
        return CapturePool(self.xp)


class CapturePool:
    """A segment's memory pool (workers/graphs.py): called, a context in which allocations come
    from it; `total_bytes()`, what it holds (a worker's stats add them up)."""

    def __init__(self, xp):
        self.xp, self.pool = xp, xp.cuda.MemoryPool()

    def __call__(self):
        return self.xp.cuda.using_allocator(self.pool.malloc)

    def total_bytes(self) -> int:
        return int(self.pool.total_bytes())
