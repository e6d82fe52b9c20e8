"""A decode step's KV-cache writes on the GPU with the positions read on the device: a kernel of
our own, so the write is captured in the step's device graph (the shared set_rows reads its ids'
range on the host, a wait for the device, and runs eagerly between graphs).

The layout is the decoder's: the cache (batch, heads, ctx, dim) with the whole batch and context
on this device, the value (rows, heads, tokens, dim), the positions (rows, tokens); row j of the
value goes to batch row start + j (`start`: a one-element device array, the fed batch start of a
server's slot, read where `fed` is set; else 0: no array made and zeroed for it, a launch fewer in
the graph). A position outside [0, ctx) or a batch row outside the cache is not
written: a kernel cannot raise, and a GPU step's positions come from the coordinator's checked
feeds or from the workers' own count; the first (eager) run of a step still checks them on the
host (workers/backends/cuda/__init__.py). The float16 cache takes each value rounded to nearest even.
"""

from __future__ import annotations

import numpy as np

from workers.backends.cuda.kernels.device import DeviceKernel

_KERNEL = r"""
extern "C" __global__ void set_rows_NAME(OUT* __restrict__ dst, const float* __restrict__ value,
                                         const int* __restrict__ ids, const int* __restrict__ start, int fed,
                                         int batches, int heads, int ctx, int dim, int rows, int tokens) {
    const long total = (long)rows * heads * tokens * dim;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int d = (int)(i % dim);
    const int t = (int)((i / dim) % tokens);
    const int h = (int)((i / ((long)dim * tokens)) % heads);
    const int j = (int)(i / ((long)dim * tokens * heads));
    const int b = (fed ? start[0] : 0) + j;
    const int pos = ids[(long)j * tokens + t];
    if (b < 0 || b >= batches || pos < 0 || pos >= ctx) return;
    dst[(((long)b * heads + h) * ctx + pos) * dim + d] = CONVERT(value[i]);
}
"""
THREADS = 256
SOURCE = _KERNEL.replace("NAME", "f32").replace("OUT", "float").replace("CONVERT", "") + _KERNEL.replace(
    "NAME", "f16"
).replace("OUT", "unsigned short").replace("CONVERT", "half_bits")


def twin(cache_dtype):
    """What set_rows_<type> computes, over the same flat memory and scalars."""

    def run(dst, value, ids, start, fed, batches, heads, ctx, dim, rows, tokens):
        batches, heads, ctx, dim, rows, tokens = (int(a) for a in (batches, heads, ctx, dim, rows, tokens))
        cache = dst.view(cache_dtype)[: batches * heads * ctx * dim].reshape(batches, heads, ctx, dim)
        values = value[: rows * heads * tokens * dim].reshape(rows, heads, tokens, dim)
        positions = ids[: rows * tokens].reshape(rows, tokens)
        for j in range(rows):
            b = (int(start[0]) if fed else 0) + j
            if not 0 <= b < batches:
                continue
            for t in range(tokens):
                pos = int(positions[j, t])
                if 0 <= pos < ctx:
                    cache[b, :, pos, :] = values[j, :, t, :].astype(cache_dtype)

    return run


DEVICE_KERNELS = (
    DeviceKernel("set_rows_f32", SOURCE, twin(np.float32), (0,)),
    DeviceKernel("set_rows_f16", SOURCE, twin(np.float16), (0,)),
)


def fits(dst, ids, value, params, fed_start) -> bool:
    """The decoder's layout, which the kernel writes: (batch, heads, ctx, dim) along axis 2, the
    whole batch and context here, float32 values into a float32 or float16 cache."""
    if dst.ndim != 4 or ids.ndim != 2 or value.ndim != 4 or params.get("axis") != 2:
        return False
    batch, heads, ctx, dim = dst.shape
    if value.shape != (ids.shape[0], heads, ids.shape[1], dim) or value.dtype != np.float32:
        return False
    if dst.dtype not in (np.float32, np.float16) or not dst.flags.c_contiguous:
        return False
    if [tuple(s) for s in params.get("spans", [])] != [(0, ctx, 0)]:
        return False
    if fed_start:
        return [tuple(s) for s in params.get("held", [])] == [(0, batch, 0)]
    return params.get("batches") is None


def cache_operands(xp, dst, ids, start):
    """What a kernel writing the cache takes of it (here and in rope.py): its type's kernel suffix
    ("f32" or "f16"), the cache as that type's bits, the ids as int32, the batch start as one
    int32 and whether it is fed (without one, the ids stand in for the pointer, never read)."""
    ids = xp.ascontiguousarray(ids, dtype=xp.int32)
    fed = start is not None
    start = xp.ascontiguousarray(start.reshape(1), dtype=xp.int32) if fed else ids
    if dst.dtype == np.float32:
        return "f32", dst, ids, start, np.int32(fed)
    return "f16", dst.view(xp.uint16), ids, start, np.int32(fed)


def launch(xp, kernels: dict, dst, ids, value, start) -> None:
    batch, heads, ctx, dim = dst.shape
    rows, tokens = ids.shape
    total = rows * heads * tokens * dim
    if not total:
        return
    kind, target, ids, start, fed = cache_operands(xp, dst, ids, start)
    sizes = (batch, heads, ctx, dim, rows, tokens)
    args = (target, xp.ascontiguousarray(value), ids, start, fed, *(np.int32(v) for v in sizes))
    kernels[f"set_rows_{kind}"]((-(-total // THREADS),), (THREADS,), args)
