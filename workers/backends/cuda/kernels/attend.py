"""Decode attention on the GPU over the cache positions the mask opens, read on the device: kernels
of our own, so a decode step's attention is captured in its device graph (the shared kernel finds
the used length on the host, a wait for the device, and runs eagerly between graphs, splitting a
step into one graph per layer).

Flash-decoding's two passes. The cache's positions are cut into chunks of CHUNK; one thread
block per (query row, chunk) computes, over its chunk's open positions (mask not -inf), the
scores q . k * scale + mask, their maximum m, the weights e = exp(score - m), their sum l and
the weighted sum of the value rows acc = sum e * v, and writes (acc, m, l) to a partial; a chunk
with no open position writes (0, -inf, 0) and reads no cache row. The second kernel combines a
row's partials: out = sum_c acc_c * exp(m_c - M) / sum_c l_c * exp(m_c - M), M the largest m_c.
So the work follows the positions in use, with one launch shape for every position: the same
graph replays at every step. A row whose positions are all closed gives NaN (0 / 0), as the
softmax of a row of -inf does.

Two layouts, the same passes (attend_part_* and attend_map_*, one source, only where a row's
keys lie differs):
- the decoder's (models/llama.py): queries (batch, kv heads, group, tokens, dim), cached key and
  value rows (batch, kv heads, ctx, dim), float32 or float16, the mask (1 or batch, 1, 1, tokens,
  ctx) of 0 and -inf. Rows are (b, h, g, t) in C order.
- the gqa_attention op's (a split that shares a KV head between devices, models/llama.py
  HeadSplit): queries (batch, tokens, heads, dim), query head h reading KV head kv_of[h] of the
  cached rows (batch, kv heads, ctx, dim), the mask (1 or batch, tokens, ctx). Rows are (b, t, h).

The twins state the arithmetic in float32 (the order of the sums differs from the kernels' tree
reductions, and expf from NumPy's exp by an ulp or two): a GPU test holds kernel to twin within
a stated tolerance, and decode on the CuPy stand-in runs the twins against the NumPy reference
decoder. Positions whose weight is exactly 0 are skipped by both (their value rows never read).
"""

from __future__ import annotations

import numpy as np

from workers.backends.cuda.kernels.device import DeviceKernel

CHUNK = 256  # cache positions a thread block reads
THREADS = 128  # threads a block (a power of two: the reductions halve it)
MAX_DIM = 256  # head dims up to this
MAX_TOKENS = 8  # query tokens a row up to which a step runs these kernels (more: a prefill, cuBLAS)

_PART = r"""
extern "C" __global__ void attend_SIGNATURE,
        int tokens, int ctx, int dim, long mask_batch, float scale, int chunks) {
    __shared__ float qs[MAX_DIM];
    __shared__ float w[CHUNK];
    __shared__ float red[THREADS];
    const long row = blockIdx.x;
    const int c = blockIdx.y, tid = threadIdx.x;
    LOCATE
    const KT* keys = k + bh * ctx * dim;
    const KT* values = v + bh * ctx * dim;
    const float* open = mask + b * mask_batch + (long)t * ctx;
    const int start = c * CHUNK;
    const int n = ctx - start < CHUNK ? ctx - start : CHUNK;
    for (int d = tid; d < dim; d += THREADS) qs[d] = q[row * dim + d];
    __syncthreads();
    float best = -INFINITY;
    for (int i = tid; i < n; i += THREADS) {
        const float add = open[start + i];
        float s = -INFINITY;
        if (add != -INFINITY) {
            const KT* key = keys + (long)(start + i) * dim;
            float dot = 0.f;
            for (int d = 0; d < dim; ++d) dot += qs[d] * LOAD(key, d);
            s = dot * scale + add;
        }
        w[i] = s;
        best = fmaxf(best, s);
    }
    red[tid] = best;
    __syncthreads();
    for (int half = THREADS / 2; half > 0; half >>= 1) {
        if (tid < half) red[tid] = fmaxf(red[tid], red[tid + half]);
        __syncthreads();
    }
    const float top = red[0];
    __syncthreads();  /* every thread has read red[0] before the sums overwrite it */
    float total = 0.f;
    for (int i = tid; i < n; i += THREADS) {
        const float e = w[i] == -INFINITY ? 0.f : expf(w[i] - top);
        w[i] = e;
        total += e;
    }
    red[tid] = total;
    __syncthreads();
    for (int half = THREADS / 2; half > 0; half >>= 1) {
        if (tid < half) red[tid] += red[tid + half];
        __syncthreads();
    }
    float* out = part + (row * chunks + c) * (dim + 2);
    for (int d = tid; d < dim; d += THREADS) {
        float acc = 0.f;
        for (int i = 0; i < n; ++i)
            if (w[i] != 0.f) acc += w[i] * LOAD(values + (long)(start + i) * dim, d);
        out[d] = acc;
    }
    if (tid == 0) {
        out[dim] = top;
        out[dim + 1] = red[0];
    }
}
"""

_COMBINE = r"""
extern "C" __global__ void attend_combine(const float* __restrict__ part, float* __restrict__ out, int chunks,
                                          int dim) {
    const long row = blockIdx.x;
    const float* p = part + row * chunks * (dim + 2);
    float top = -INFINITY;
    for (int c = 0; c < chunks; ++c) top = fmaxf(top, p[c * (dim + 2) + dim]);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float sum = 0.f, acc = 0.f;
        for (int c = 0; c < chunks; ++c) {
            const float* at = p + c * (dim + 2);
            const float f = expf(at[dim] - top);
            sum += at[dim + 1] * f;
            acc += at[d] * f;
        }
        out[row * dim + d] = acc / sum;
    }
}
"""

_SIZES = f"#define CHUNK {CHUNK}\n#define THREADS {THREADS}\n#define MAX_DIM {MAX_DIM}\n"
LOADS = {  # a cache element's C type, and element d of a cache row as float32
    "f32": ("float", "#define LOAD(row, d) ((row)[d])\n"),
    "f16": ("unsigned short", "#define LOAD(row, d) half_at((const u8*)((row) + (d)), 1)\n"),
}
# Where a query row's keys lie: t its token, b its batch row, bh its cache row (b * kv heads + its
# KV head). The decoder's layout (batch, kv heads, group, tokens, dim): a row's KV head is its place
# in the kv-heads axis. The gqa_attention op's layout (batch, tokens, heads, dim) with a head map
# (a split that shares a KV head between devices): kv_of[h] for query head h.
_LAYOUTS = {
    "part": (
        "part_NAME(const float* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,\n"
        "        const float* __restrict__ mask, float* __restrict__ part, int heads, int group",
        """const int t = (int)(row % tokens);
    const long bh = row / ((long)tokens * group);  /* b * heads + h */
    const long b = bh / heads;""",
    ),
    "map": (
        "map_NAME(const float* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,\n"
        "        const float* __restrict__ mask, float* __restrict__ part, const int* __restrict__ kv_of, int heads,\n"
        "        int kv_heads",
        """const int h = (int)(row % heads);
    const int t = (int)(row / heads % tokens);
    const long b = row / ((long)heads * tokens);
    const long bh = b * kv_heads + kv_of[h];""",
    ),
}


def each_layout_and_cache(template: str, layouts: dict[str, tuple[str, str]], after: str = "") -> str:
    """`template` written out for every layout (its SIGNATURE and LOCATE) and cache element type
    (NAME, KT and LOAD), each followed by `after` (the #undefs of what its LOCATE defined)."""
    return "".join(
        load
        + template.replace("SIGNATURE", signature).replace("LOCATE", locate).replace("NAME", n).replace("KT", kt)
        + "#undef LOAD\n"
        + after
        for signature, locate in layouts.values()
        for n, (kt, load) in LOADS.items()
    )


SOURCE = _SIZES + each_layout_and_cache(_PART, _LAYOUTS) + _COMBINE


def _twin(cache_dtype, locate):
    """What an attend kernel computes over the same flat memory and scalars, its rows' keys found
    by `locate(row, tokens, *its layout's arguments) -> (t, b, bh)` as its LOCATE finds them."""

    def run(q, k, v, mask, part, *layout_sizes):
        *layout, tokens, ctx, dim, mask_batch, scale, chunks = layout_sizes
        tokens, ctx, dim, mask_batch, chunks = (int(a) for a in (tokens, ctx, dim, mask_batch, chunks))
        scale = np.float32(scale)
        rows = q.size // dim
        queries = q[: rows * dim].reshape(rows, dim)
        keys = k.view(cache_dtype).reshape(-1, ctx, dim)
        values = v.view(cache_dtype).reshape(-1, ctx, dim)
        partials = part[: rows * chunks * (dim + 2)].reshape(rows, chunks, dim + 2)
        for row in range(rows):
            t, b, bh = locate(row, tokens, *layout)
            opened = mask[b * mask_batch + t * ctx : b * mask_batch + (t + 1) * ctx]
            for c in range(chunks):
                span = slice(c * CHUNK, min(ctx, (c + 1) * CHUNK))
                add = opened[span]
                scores = np.full(add.shape, -np.inf, np.float32)
                live = add != -np.inf
                dots = keys[bh, span][live].astype(np.float32) @ queries[row]
                scores[live] = dots * scale + add[live]
                top = np.float32(np.fmax.reduce(scores))
                with np.errstate(invalid="ignore"):  # a closed chunk: -inf - -inf, weighed 0 anyway
                    weights = np.where(scores == -np.inf, np.float32(0), np.exp(scores - top)).astype(np.float32)
                used = weights != 0
                partials[row, c, :dim] = weights[used] @ values[bh, span][used].astype(np.float32)
                partials[row, c, dim] = top
                partials[row, c, dim + 1] = weights.sum(dtype=np.float32)

    return run


def _grouped(row: int, tokens: int, heads, group) -> tuple[int, int, int]:
    """attend_part's LOCATE: rows (batch, kv heads, group, tokens)."""
    bh = row // (tokens * int(group))
    return row % tokens, bh // int(heads), bh


def _mapped(row: int, tokens: int, kv_of, heads, kv_heads) -> tuple[int, int, int]:
    """attend_map's LOCATE: rows (batch, tokens, heads), query head h reading KV head kv_of[h]."""
    heads = int(heads)
    b = row // (heads * tokens)
    return row // heads % tokens, b, b * int(kv_heads) + int(kv_of[row % heads])


def _combine_twin(part, out, chunks, dim):
    """What attend_combine computes."""
    chunks, dim = int(chunks), int(dim)
    rows = out.size // dim
    partials = part[: rows * chunks * (dim + 2)].reshape(rows, chunks, dim + 2)
    top = np.fmax.reduce(partials[:, :, dim], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        factors = np.exp(partials[:, :, dim] - top[:, None]).astype(np.float32)
        total = (partials[:, :, dim + 1] * factors).sum(axis=1, dtype=np.float32)
        acc = np.einsum("rcd,rc->rd", partials[:, :, :dim], factors).astype(np.float32)
        out[: rows * dim] = (acc / total[:, None]).reshape(-1)


DEVICE_KERNELS = (
    DeviceKernel("attend_part_f32", SOURCE, _twin(np.float32, _grouped), (4,)),
    DeviceKernel("attend_part_f16", SOURCE, _twin(np.float16, _grouped), (4,)),
    DeviceKernel("attend_map_f32", SOURCE, _twin(np.float32, _mapped), (4,)),
    DeviceKernel("attend_map_f16", SOURCE, _twin(np.float16, _mapped), (4,)),
    DeviceKernel("attend_combine", SOURCE, _combine_twin, (1,)),
)


def runs_here(shape: tuple[int, ...]) -> bool:
    """Whether an attention step of output `shape` is one these kernels take: the decoder's five
    axes, a few query tokens (a decode step), a head dim they hold."""
    return len(shape) == 5 and 0 < shape[-2] <= MAX_TOKENS and 0 < shape[-1] <= MAX_DIM


def decoder_rows(shape: tuple[int, ...]) -> bool:
    """Whether an attention step of output `shape` has the decoder's five axes and a head dim the
    kernels of our own hold: these (a decode step's tokens) or prefill_attend.py's (a prompt's)."""
    return len(shape) == 5 and shape[-2] > 0 and 0 < shape[-1] <= MAX_DIM


def mapped_rows(shape: tuple[int, ...]) -> bool:
    """As decoder_rows for a gqa_attention step's output (batch, tokens, heads, dim)."""
    return len(shape) == 4 and shape[1] > 0 and 0 < shape[-1] <= MAX_DIM


def operands(q, k, mask, v, out):
    """(key rows, value rows, the mask's batch stride) where the operands have the decoder's
    shapes (the module docstring) and types, any number of query tokens, else None. `k` is the
    transposed view (batch, kv, 1, dim, ctx) of the key rows, as the decoder multiplies by it;
    the rows are the cache itself (packed) in a decode step, the new keys (a strided view, packed
    by the launcher) in a prompt that starts a sequence."""
    if not decoder_rows(tuple(out.shape)) or q.shape != out.shape or not out.flags.c_contiguous:
        return None
    batch, heads, group, tokens, dim = q.shape
    if k.ndim != 5 or v.ndim != 5 or mask.ndim != 5:
        return None
    ctx = v.shape[3]
    if k.shape != (batch, heads, 1, dim, ctx) or v.shape != (batch, heads, 1, ctx, dim) or k.dtype != v.dtype:
        return None
    if v.dtype not in (np.float32, np.float16) or q.dtype != np.float32 or mask.dtype != np.float32:
        return None
    if mask.shape[1:] != (1, 1, tokens, ctx) or mask.shape[0] not in (1, batch):
        return None
    mask_batch = tokens * ctx if mask.shape[0] == batch and batch > 1 else 0
    return k[:, :, 0].swapaxes(-1, -2), v[:, :, 0], mask_batch


def maps_here(shape: tuple[int, ...]) -> bool:
    """Whether a gqa_attention step of output `shape` (batch, tokens, heads, dim) is one the
    mapped kernels take: a few query tokens (a decode step), a head dim they hold."""
    return len(shape) == 4 and 0 < shape[1] <= MAX_TOKENS and 0 < shape[-1] <= MAX_DIM


def map_operands(q, keys, values, mask, out) -> int | None:
    """The mask's batch stride where a gqa_attention step's operands are the mapped kernels' (these
    or prefill_attend.py's, by the number of query tokens): q and out (batch, tokens, heads, dim)
    float32, packed; the cached key and value rows (batch, kv heads, ctx, dim), float32 or
    float16, packed; the mask (1 or batch, tokens, ctx). Else None."""
    packed = out.flags.c_contiguous and q.flags.c_contiguous
    if not mapped_rows(tuple(out.shape)) or q.shape != out.shape or not packed:
        return None
    batch, tokens, _, dim = q.shape
    if keys.ndim != 4 or keys.shape != values.shape or keys.shape[0] != batch or keys.shape[3] != dim:
        return None
    if keys.dtype != values.dtype or values.dtype not in (np.float32, np.float16) or q.dtype != np.float32:
        return None
    if not (keys.flags.c_contiguous and values.flags.c_contiguous):
        return None
    ctx = keys.shape[2]
    if mask.dtype != np.float32 or mask.shape[1:] != (tokens, ctx) or mask.shape[0] not in (1, batch):
        return None
    return tokens * ctx if mask.shape[0] == batch and batch > 1 else 0


def launch(xp, kernels: dict, q, keys, values, mask, mask_batch: int, scale: float, out, scratch=None) -> None:
    """out = attention of q (the decoder's layout) over the open positions, through the partials
    (in `scratch` where it has room, else a fresh buffer: in a capture, the segment's pool)."""
    batch, heads, group, tokens, dim = q.shape
    layout = (np.int32(heads), np.int32(group))
    _launch(xp, kernels, "part", layout, q, keys, values, mask, tokens, mask_batch, scale, out, scratch)


def launch_mapped(xp, kernels: dict, q, keys, values, mask, mask_batch: int, kv_of, scale: float, out) -> None:
    """out = attention of q (batch, tokens, heads, dim) over the open positions, query head h
    reading KV head kv_of[h] (an int32 device array) of `keys` and `values` (batch, kv, ctx, dim)."""
    batch, tokens, heads, dim = q.shape
    layout = (kv_of, np.int32(heads), np.int32(keys.shape[1]))
    _launch(xp, kernels, "map", layout, q, keys, values, mask, tokens, mask_batch, scale, out, None)


def _launch(xp, kernels, layout_name, layout, q, keys, values, mask, tokens, mask_batch, scale, out, scratch) -> None:
    dim, ctx = q.shape[-1], values.shape[-2]
    rows = q.size // dim
    if not rows:
        return
    chunks = -(-ctx // CHUNK)
    need = rows * chunks * (dim + 2)
    if scratch is not None and scratch.size >= need and scratch.dtype == np.float32:
        part = scratch.reshape(-1)[:need]
    else:
        part = xp.empty(need, xp.float32)
    # packed where they are not (a no-op for a decode step's cache; in a capture, the copies
    # come from the segment's pool)
    q, keys, values, mask = (xp.ascontiguousarray(a) for a in (q, keys, values, mask))
    kind = "f32" if values.dtype == np.float32 else "f16"
    as_bits = (lambda a: a) if values.dtype == np.float32 else (lambda a: a.view(xp.uint16))
    sizes = (np.int32(tokens), np.int32(ctx), np.int32(dim), np.int64(mask_batch), np.float32(scale))
    args = (q, as_bits(keys), as_bits(values), mask, part, *layout, *sizes, np.int32(chunks))
    kernels[f"attend_{layout_name}_{kind}"]((rows, chunks), (THREADS,), args)
    kernels["attend_combine"]((rows,), (min(THREADS, dim),), (part, out, np.int32(chunks), np.int32(dim)))
