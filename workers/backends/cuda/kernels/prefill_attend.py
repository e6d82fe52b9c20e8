"""A prompt's attention on the GPU (more query tokens than a decode step's): kernels of our own,
tiled as flash attention, reading the open positions from the mask on the device. So a prefill
step's attention is captured in its device graph like the rest of the step, its causal half of
the cache is never read, and no score matrix is made: the shared kernel (cuBLAS products and a
softmax in between) wants two (heads x tokens x used positions) float32 buffers of scratch (for a
prefill step's 128 tokens of 32 heads, 64 MiB at 2,048 positions, 1 GiB at 32,768), where these
want a byte for each tile pair.

Two kernels:
- `attend_open_tiles`: a byte for each (mask row, tile of TOKENS query tokens, tile of KEYS cache
  positions): 1 where any of the tile pair's mask entries is open (not -inf). One scan of the
  mask a layer, where every thread block reading its own rows would read it once a head.
- `prefill_{layout}_{kind}`: one thread block for each TOKENS query tokens of one query head.
  It holds its queries in shared memory and walks the cache tile by tile, skipping a tile the map
  says is closed to all its tokens; for an open one it loads the KEYS key rows, scores them
  (q . k * scale + mask, -inf where closed), updates each row's running maximum m and sum l of
  exp(score - m) and rescales its accumulated output by exp(m_old - m_new) (online softmax), then
  loads the value rows and adds exp(score - m) * v for the positions whose weight is not 0 (a
  closed position's value row is never read: the cache past the used positions holds whatever
  was there). The output is acc / l; a row whose positions are all closed gives 0 / 0, NaN, as
  the softmax of a row of -inf does and as the decode kernels give.

Layouts as the decode kernels' (workers/backends/cuda/kernels/attend.py): the decoder's (queries (batch,
kv heads, group, tokens, dim), key and value rows (batch, kv heads, ctx, dim), the mask (1 or
batch, 1, 1, tokens, ctx)) and the gqa_attention op's (queries (batch, tokens, heads, dim), head h
reading KV head kv_of[h], the mask (1 or batch, tokens, ctx)); float32 or float16 caches.

The twins state the arithmetic in float32 tile by tile, vectorized over every query row (the
order of the dot products' and the weighted sums' terms differs from the kernels', and expf from
NumPy's exp by an ulp or two): a GPU test holds kernel to oracle within a stated tolerance, the
kernels' own arithmetic runs compiled for the host in CI (tests/cuda_on_host.py), and prefill on
the CuPy stand-in runs the twins against the NumPy reference decoder.
"""

from __future__ import annotations

import numpy as np

from workers.backends.cuda.kernels.attend import MAX_DIM, each_layout_and_cache
from workers.backends.cuda.kernels.device import DeviceKernel

TOKENS = 16  # query tokens a thread block holds
KEYS = 16  # cache positions a tile
THREADS = 128  # threads a block
ACC = TOKENS * MAX_DIM // THREADS  # accumulated outputs a thread keeps in registers
# the most cache positions a step may have for the CUDA backend to run these kernels (a prompt's
# own keys, a short context): a block walks every used position of its head, and past some
# length cuBLAS's products with a softmax between them win; 512 until a GPU measures where
# (bench/attention.py)
MAX_POSITIONS = 512

_MAP = r"""
extern "C" __global__ void attend_open_tiles(const float* __restrict__ mask, u8* __restrict__ open, int tokens,
                                             int ctx, long mask_batch, int token_tiles, int key_tiles) {
    const long unit = blockIdx.x;  /* mask row * token_tiles + token tile */
    const int tt = (int)(unit % token_tiles);
    const float* rows = mask + (unit / token_tiles) * mask_batch + (long)tt * TOKENS * ctx;
    const int count = tokens - tt * TOKENS < TOKENS ? tokens - tt * TOKENS : TOKENS;
    for (int kt = threadIdx.x; kt < key_tiles; kt += blockDim.x) {
        const int start = kt * KEYS;
        const int n = ctx - start < KEYS ? ctx - start : KEYS;
        u8 any = 0;
        for (int i = 0; i < count && !any; ++i)
            for (int j = 0; j < n; ++j)
                if (rows[(long)i * ctx + start + j] != -INFINITY) { any = 1; break; }
        open[unit * key_tiles + kt] = any;
    }
}
"""

_TILE = r"""
extern "C" __global__ void prefill_SIGNATURE,
        int tokens, int ctx, int dim, long mask_batch, float scale, int token_tiles, int key_tiles) {
    __shared__ float qs[TOKENS][MAX_DIM + 1];  /* +1: a warp's threads read other rows' same d */
    __shared__ float kv[KEYS][MAX_DIM + 1];    /* the tile's key rows, then its value rows */
    __shared__ float s[TOKENS][KEYS];          /* the mask, then the scores, then the weights */
    __shared__ float m[TOKENS], l[TOKENS], rescale[TOKENS];
    const long unit = blockIdx.x / token_tiles;
    const int tt = (int)(blockIdx.x % token_tiles), tid = threadIdx.x;
    const int first = tt * TOKENS;
    const int count = tokens - first < TOKENS ? tokens - first : TOKENS;
    LOCATE
    const KT* keys = k + bh * ctx * dim;
    const KT* values = v + bh * ctx * dim;
    const float* opened = mask + (mask_batch ? b * mask_batch : 0) + (long)first * ctx;
    const u8* tiles = open + ((mask_batch ? b : 0) * token_tiles + tt) * (long)key_tiles;
    for (int e = tid; e < TOKENS * dim; e += THREADS) {
        const int i = e / dim, d = e % dim;
        qs[i][d] = i < count ? q[ROW(first + i) + d] : 0.f;
    }
    if (tid < TOKENS) { m[tid] = -INFINITY; l[tid] = 0.f; }
    float acc[ACC];
#pragma unroll
    for (int a = 0; a < ACC; ++a) acc[a] = 0.f;
    __syncthreads();
    for (int kt = 0; kt < key_tiles; ++kt) {
        if (!tiles[kt]) continue;  /* the same answer for every thread: no barrier is skipped by some */
        const int start = kt * KEYS;
        const int n = ctx - start < KEYS ? ctx - start : KEYS;
        for (int e = tid; e < TOKENS * KEYS; e += THREADS) {
            const int i = e / KEYS, j = e % KEYS;
            s[i][j] = i < count && j < n ? opened[(long)i * ctx + start + j] : -INFINITY;
        }
        for (int e = tid; e < n * dim; e += THREADS) {
            const int j = e / dim, d = e % dim;
            kv[j][d] = LOAD(keys + (long)(start + j) * dim, d);
        }
        __syncthreads();
        for (int e = tid; e < TOKENS * KEYS; e += THREADS) {
            const int i = e / KEYS, j = e % KEYS;
            const float add = s[i][j];
            if (add != -INFINITY) {
                float dot = 0.f;
                for (int d = 0; d < dim; ++d) dot += qs[i][d] * kv[j][d];
                s[i][j] = dot * scale + add;
            }
        }
        __syncthreads();
        /* the value rows over the key rows, while each row's first thread updates its softmax */
        for (int e = tid; e < n * dim; e += THREADS) {
            const int j = e / dim, d = e % dim;
            kv[j][d] = LOAD(values + (long)(start + j) * dim, d);
        }
        if (tid < TOKENS) {
            const int i = tid;
            float best = m[i];
            for (int j = 0; j < KEYS; ++j) best = fmaxf(best, s[i][j]);
            if (best == -INFINITY) {  /* nothing open for this row yet */
                rescale[i] = 1.f;
                for (int j = 0; j < KEYS; ++j) s[i][j] = 0.f;
            } else {
                rescale[i] = m[i] == -INFINITY ? 0.f : expf(m[i] - best);
                float total = 0.f;
                for (int j = 0; j < KEYS; ++j) {
                    const float w = s[i][j] == -INFINITY ? 0.f : expf(s[i][j] - best);
                    s[i][j] = w;
                    total += w;
                }
                l[i] = l[i] * rescale[i] + total;
                m[i] = best;
            }
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < ACC; ++a) {
            const int e = tid + a * THREADS;
            if (e < TOKENS * dim) {
                const int i = e / dim, d = e % dim;
                float sum = acc[a] * rescale[i];
                for (int j = 0; j < n; ++j)
                    if (s[i][j] != 0.f) sum += s[i][j] * kv[j][d];
                acc[a] = sum;
            }
        }
        __syncthreads();  /* before the next tile overwrites s and kv */
    }
#pragma unroll
    for (int a = 0; a < ACC; ++a) {
        const int e = tid + a * THREADS;
        if (e < TOKENS * dim) {
            const int i = e / dim, d = e % dim;
            if (i < count) out[ROW(first + i) + d] = acc[a] / l[i];
        }
    }
}
"""

_SIZES = f"#define TOKENS {TOKENS}\n#define KEYS {KEYS}\n#define THREADS {THREADS}\n#define MAX_DIM {MAX_DIM}\n"
_SIZES += f"#define ACC {ACC}\n"
# A block's unit (what blockIdx.x / token_tiles counts): b its batch row, bh its cache row (b * kv
# heads + its KV head), ROW(t) where the query (and output) row of token t begins. The decoder's
# layout (batch, kv heads, group, tokens, dim): a unit is one (b, h, g). The gqa_attention op's
# (batch, tokens, heads, dim) with a head map: a unit is one (b, h), h reading KV head kv_of[h].
_LAYOUTS = {
    "part": (
        "part_NAME(const float* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,\n"
        "        const float* __restrict__ mask, const u8* __restrict__ open, float* __restrict__ out, int heads,\n"
        "        int group",
        """const long bh = unit / group;
    const long b = bh / heads;
#define ROW(t) ((unit * tokens + (t)) * (long)dim)""",
    ),
    "map": (
        "map_NAME(const float* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,\n"
        "        const float* __restrict__ mask, const u8* __restrict__ open, float* __restrict__ out,\n"
        "        const int* __restrict__ kv_of, int heads, int kv_heads",
        """const long b = unit / heads;
    const int h = (int)(unit % heads);
    const long bh = b * kv_heads + kv_of[h];
#define ROW(t) (((b * tokens + (t)) * heads + h) * (long)dim)""",
    ),
}
SOURCE = _SIZES + _MAP + each_layout_and_cache(_TILE, _LAYOUTS, after="#undef ROW\n")


def _map_twin(mask, open_, tokens, ctx, mask_batch, token_tiles, key_tiles):
    """What attend_open_tiles computes."""
    tokens, ctx, mask_batch, token_tiles, key_tiles = (
        int(a) for a in (tokens, ctx, mask_batch, token_tiles, key_tiles)
    )
    if not key_tiles:  # an empty cache: nothing to mark (the launcher's buffer holds a byte)
        return
    units = open_.size // key_tiles
    for unit in range(units):
        base = (unit // token_tiles) * mask_batch
        tt = unit % token_tiles
        rows = mask[base : base + tokens * ctx].reshape(tokens, ctx)[tt * TOKENS : (tt + 1) * TOKENS]
        padded = np.full((rows.shape[0], key_tiles * KEYS), -np.inf, np.float32)
        padded[:, :ctx] = rows
        tiles = padded.reshape(rows.shape[0], key_tiles, KEYS)
        open_[unit * key_tiles : (unit + 1) * key_tiles] = (tiles != -np.inf).any(axis=(0, 2))


def _twin(cache_dtype, locate):
    """What a prefill kernel computes over the same flat memory and scalars, tile by tile for
    every query row at once. `locate(units, tokens, *its layout's arguments) -> (query rows (units,
    tokens) as indices of dim-wide rows, each unit's batch row, each unit's cache row)`."""

    def run(q, k, v, mask, open_, out, *layout_sizes):
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # -inf - -inf, 0 / 0 as on the GPU
            _run(q, k, v, mask, open_, out, *layout_sizes)

    def _run(q, k, v, mask, open_, out, *layout_sizes):
        *layout, tokens, ctx, dim, mask_batch, scale, token_tiles, key_tiles = layout_sizes
        tokens, ctx, dim, mask_batch = (int(a) for a in (tokens, ctx, dim, mask_batch))
        token_tiles, key_tiles, scale = int(token_tiles), int(key_tiles), np.float32(scale)
        units = q.size // (tokens * dim)
        at, b, bh = locate(units, tokens, *layout)
        b = b if mask_batch else np.zeros_like(b)
        if not ctx:  # no tile to walk: every row 0 / 0, as the kernel's
            out.reshape(-1, dim)[at] = np.nan
            return
        queries = q.reshape(-1, dim)[at]  # (units, tokens, dim)
        keys = k.view(cache_dtype).reshape(-1, ctx, dim)
        values = v.view(cache_dtype).reshape(-1, ctx, dim)
        first_entry = b[:, None, None] * mask_batch + np.arange(tokens)[None, :, None] * ctx  # (units, tokens, 1)
        tiles = open_.reshape(-1, token_tiles, key_tiles)[b]  # (units, token tiles, key tiles)
        live_tiles = np.repeat(tiles, TOKENS, axis=1)[:, :tokens]  # each query row's tile pairs
        top = np.full((units, tokens), -np.inf, np.float32)
        total = np.zeros((units, tokens), np.float32)
        acc = np.zeros((units, tokens, dim), np.float32)
        for kt in range(key_tiles):
            span = slice(kt * KEYS, min(ctx, (kt + 1) * KEYS))
            live = live_tiles[:, :, kt].astype(bool)  # rows whose block reads this tile
            if not live.any():
                continue
            entries = mask[first_entry + np.arange(span.start, span.stop)]
            add = np.where(live[..., None], entries, np.float32(-np.inf))
            scores = np.full(add.shape, -np.inf, np.float32)
            where = add != -np.inf
            dots = np.einsum("utd,ujd->utj", queries, keys[bh, span].astype(np.float32), dtype=np.float32)
            scores[where] = (dots * scale)[where] + add[where]
            best = np.fmax(top, np.fmax.reduce(scores, axis=-1, initial=-np.inf))
            seen = best != -np.inf
            rescale = np.where(seen, np.where(top == -np.inf, np.float32(0), np.exp(top - best)), np.float32(1))
            weights = np.where(where & seen[..., None], np.exp(scores - best[..., None]), np.float32(0))
            rescale, weights = rescale.astype(np.float32), weights.astype(np.float32)
            total = np.where(seen, total * rescale + weights.sum(axis=-1, dtype=np.float32), total)
            top = best
            # a position of weight 0 is skipped: a closed position's value row is never read
            rows = values[bh, span].astype(np.float32)[:, None]  # (units, 1, n, dim)
            terms = np.where((weights != 0)[..., None], weights[..., None] * rows, np.float32(0))
            acc = acc * rescale[..., None] + terms.sum(axis=2, dtype=np.float32)
        out.reshape(-1, dim)[at] = acc / total[..., None]

    return run


def _grouped(units: int, tokens: int, heads, group):
    """prefill_part's LOCATE: units (batch, kv heads, group), each unit's tokens consecutive."""
    unit = np.arange(units)
    bh = unit // int(group)
    return unit[:, None] * tokens + np.arange(tokens), bh // int(heads), bh


def _mapped(units: int, tokens: int, kv_of, heads, kv_heads):
    """prefill_map's LOCATE: units (batch, heads), a unit's token t at row (b * tokens + t) * heads + h."""
    heads = int(heads)
    unit = np.arange(units)
    b, h = unit // heads, unit % heads
    at = (b[:, None] * tokens + np.arange(tokens)) * heads + h[:, None]
    return at, b, b * int(kv_heads) + kv_of[h].astype(np.int64)


DEVICE_KERNELS = (
    DeviceKernel("attend_open_tiles", SOURCE, _map_twin, (1,)),
    DeviceKernel("prefill_part_f32", SOURCE, _twin(np.float32, _grouped), (5,)),
    DeviceKernel("prefill_part_f16", SOURCE, _twin(np.float16, _grouped), (5,)),
    DeviceKernel("prefill_map_f32", SOURCE, _twin(np.float32, _mapped), (5,)),
    DeviceKernel("prefill_map_f16", SOURCE, _twin(np.float16, _mapped), (5,)),
)


def launch(xp, kernels: dict, q, keys, values, mask, mask_batch: int, scale: float, out) -> None:
    """out = attention of q (the decoder's layout) over the open positions of `keys` and
    `values` (batch, kv heads, ctx, dim)."""
    _, heads, group, tokens, _ = q.shape
    _launch(
        xp, kernels, "part", (np.int32(heads), np.int32(group)), q, keys, values, mask, tokens, mask_batch, scale, out
    )


def launch_mapped(xp, kernels: dict, q, keys, values, mask, mask_batch: int, kv_of, scale: float, out) -> None:
    """out = attention of q (batch, tokens, heads, dim) over the open positions, query head h
    reading KV head kv_of[h] (an int32 device array) of `keys` and `values`."""
    _, tokens, heads, _ = q.shape
    layout = (kv_of, np.int32(heads), np.int32(keys.shape[1]))
    _launch(xp, kernels, "map", layout, q, keys, values, mask, tokens, mask_batch, scale, out)


def _launch(xp, kernels, layout_name, layout, q, keys, values, mask, tokens, mask_batch, scale, out) -> None:
    dim, ctx = q.shape[-1], values.shape[-2]
    units = q.size // (tokens * dim) if tokens * dim else 0
    if not units:
        return
    token_tiles, key_tiles = -(-tokens // TOKENS), -(-ctx // KEYS)
    mask_rows = mask.shape[0] if mask_batch else 1
    # packed where they are not (a prompt's own keys are a strided view; in a capture the copies
    # and the map come from the segment's pool)
    q, keys, values, mask = (xp.ascontiguousarray(a) for a in (q, keys, values, mask))
    open_tiles = xp.empty(max(1, mask_rows * token_tiles * key_tiles), xp.uint8)
    sizes = (np.int32(tokens), np.int32(ctx), np.int64(mask_batch))
    tiling = (np.int32(token_tiles), np.int32(key_tiles))
    kernels["attend_open_tiles"]((mask_rows * token_tiles,), (THREADS,), (mask, open_tiles, *sizes, *tiling))
    kind = "f32" if values.dtype == np.float32 else "f16"
    as_bits = (lambda a: a) if values.dtype == np.float32 else (lambda a: a.view(xp.uint16))
    args = (q, as_bits(keys), as_bits(values), mask, open_tiles, out, *layout)
    args += (np.int32(tokens), np.int32(ctx), np.int32(dim), np.int64(mask_batch), np.float32(scale), *tiling)
    kernels[f"prefill_{layout_name}_{kind}"]((units * token_tiles,), (THREADS,), args)
