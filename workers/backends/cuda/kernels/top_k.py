"""The best k logits on the GPU without a read on the host: kernels of our own, so a decode step's
candidate choice is captured in its device graph (the shared top_k kernels pick the entries that
can make the top k with flatnonzero, whose size follows the data, and run eagerly between
graphs).

The order is the shared kernels' (workers/kernels/basic.py _best): value descending, then index
ascending, an entry of index -1 (padding: a device with fewer than k values) after every real
entry of its value; NaN ranks as -inf and is given as -inf.

Tournament by tiles: a thread block sorts a tile of TILE entries of one row in shared memory (a
bitonic sort over that total order, so no two runs differ) and keeps its best `keep`; the kept
entries of all tiles are tiled again until one tile is left, whose best k are the result, padded
to `width` with (-inf, -1). The number of passes follows the row's length only, so one launch
sequence serves every step. Entries come from a float32 row (this device's span of the logits,
global index = start + position), from (value, index) float64 pairs (the devices' candidates),
or from a previous pass's (float64 value, int32 index) arrays.

The twin states each launch's result: it selects, never computes, so kernel and twin agree bit
for bit.
"""

from __future__ import annotations

import numpy as np

from workers.backends.cuda.kernels.device import DeviceKernel

TILE = 2048  # entries a thread block sorts
THREADS = 512
MAX_K = TILE // 4  # k up to which these kernels select (each pass keeps k of a tile: a quarter at most)

FROM_FLOATS, FROM_PAIRS, FROM_KEPT = 0, 1, 2  # where a pass reads its entries

SOURCE = (
    f"#define TILE {TILE}\n"
    + r"""
__device__ __forceinline__ bool better(double va, int ia, double vb, int ib) {
    if (va != vb) return va > vb;
    return (unsigned int)ia < (unsigned int)ib;  /* -1 is the largest unsigned: padding last */
}

extern "C" __global__ void top_k_tile(int source, const float* __restrict__ floats, const double* __restrict__ doubles,
                                      const int* __restrict__ ints, long row_stride, int n, int start, int keep,
                                      double* __restrict__ kept_v, int* __restrict__ kept_i, double* __restrict__ pairs,
                                      int k, int width, int last) {
    __shared__ double sv[TILE];
    __shared__ int si[TILE];
    const int tile = blockIdx.x, tid = threadIdx.x;
    const long row = blockIdx.y;
    const long first = (long)tile * TILE;
    for (int j = tid; j < TILE; j += blockDim.x) {
        const long e = first + j;
        double v = -INFINITY;
        int i = -1;
        if (e < n) {
            if (source == 0) {
                v = (double)floats[row * row_stride + e];
                i = start + (int)e;
            } else if (source == 1) {
                v = doubles[row * row_stride + 2 * e];
                i = (int)doubles[row * row_stride + 2 * e + 1];
            } else {
                v = doubles[row * row_stride + e];
                i = ints[row * row_stride + e];
            }
            if (v != v) v = -INFINITY;  /* NaN ranks as -inf */
        }
        sv[j] = v;
        si[j] = i;
    }
    __syncthreads();
    for (unsigned int size = 2; size <= TILE; size <<= 1) {
        for (unsigned int stride = size / 2; stride > 0; stride >>= 1) {
            for (unsigned int p = tid; p < TILE / 2; p += blockDim.x) {
                const unsigned int lo = 2 * p - (p & (stride - 1)), hi = lo + stride;
                const bool best_first = (lo & size) == 0;
                const bool swap = best_first ? better(sv[hi], si[hi], sv[lo], si[lo])
                                             : better(sv[lo], si[lo], sv[hi], si[hi]);
                if (swap) {
                    const double v = sv[lo];
                    const int i = si[lo];
                    sv[lo] = sv[hi];
                    si[lo] = si[hi];
                    sv[hi] = v;
                    si[hi] = i;
                }
            }
            __syncthreads();
        }
    }
    if (last) {  /* the one tile left: its best k, padded to width */
        for (int j = tid; j < width; j += blockDim.x) {
            const bool real = j < k;
            pairs[(row * width + j) * 2] = real ? sv[j] : -INFINITY;
            pairs[(row * width + j) * 2 + 1] = real ? (double)si[j] : -1.0;
        }
    } else {
        const long at = row * (long)gridDim.x * keep + (long)tile * keep;
        for (int j = tid; j < keep; j += blockDim.x) {
            kept_v[at + j] = sv[j];
            kept_i[at + j] = si[j];
        }
    }
}
"""
)


def _entries(source, floats, doubles, ints, row, row_stride, n, start):
    """(values, indices) of a row's n entries as the kernel reads them, NaN made -inf."""
    base = row * row_stride
    if source == FROM_FLOATS:
        values = floats[base : base + n].astype(np.float64)
        index = np.arange(start, start + n, dtype=np.int64)
    elif source == FROM_PAIRS:
        pairs = doubles[base : base + 2 * n].reshape(n, 2)
        values, index = pairs[:, 0].copy(), pairs[:, 1].astype(np.int64)
    else:
        values, index = doubles[base : base + n].copy(), ints[base : base + n].astype(np.int64)
    values[np.isnan(values)] = -np.inf
    return values, index


def _order(values, index):
    """The positions of the entries best first: value descending, index ascending, -1 last."""
    rank = np.where(index < 0, np.iinfo(np.int64).max, index)
    return np.lexsort((rank, -values))


def _top_k_tile(source, floats, doubles, ints, row_stride, n, start, keep, kept_v, kept_i, pairs, k, width, last):
    """What top_k_tile computes over the same flat memory: the grid is one block per tile of
    each row (tiles = ceil(n / TILE)), its rows told by the output's size."""
    source, row_stride, n, start, keep, k, width = (int(a) for a in (source, row_stride, n, start, keep, k, width))
    tiles = -(-n // TILE)
    rows = pairs.size // (2 * width) if last else kept_v.size // (tiles * keep)
    for row in range(rows):
        values, index = _entries(source, floats, doubles, ints, row, row_stride, n, start)
        for tile in range(tiles):
            span = slice(tile * TILE, min(n, (tile + 1) * TILE))
            v = np.full(TILE, -np.inf)
            i = np.full(TILE, -1, np.int64)
            v[: span.stop - span.start], i[: span.stop - span.start] = values[span], index[span]
            best = _order(v, i)
            if last:
                out = pairs[row * width * 2 : (row + 1) * width * 2].reshape(width, 2)
                out[:, 0], out[:, 1] = -np.inf, -1.0
                out[:k, 0], out[:k, 1] = v[best[:k]], i[best[:k]]
            else:
                at = (row * tiles + tile) * keep
                kept_v[at : at + keep], kept_i[at : at + keep] = v[best[:keep]], i[best[:keep]]


DEVICE_KERNELS = (DeviceKernel("top_k_tile", SOURCE, _top_k_tile, (8, 9, 10)),)


def select(xp, kernels: dict, source: int, entries, n: int, start: int, k: int, width: int, out) -> None:
    """out (rows, width, 2) float64 = the best k (at most MAX_K) of each row's n entries, padded
    to width: `entries` (rows, n) float32 (FROM_FLOATS: global index start + position) or (rows,
    n, 2) float64 pairs (FROM_PAIRS). The passes' kept entries are fresh arrays (in a capture,
    the segment's pool)."""
    rows = out.size // (2 * width) if width else 0
    if not rows or not n:
        if out.size:
            out.reshape(-1, 2)[:, 0], out.reshape(-1, 2)[:, 1] = -np.inf, -1.0
        return
    entries = xp.ascontiguousarray(entries)
    row_stride = entries.size // rows
    unused = {np.float32: xp.empty(1, xp.float32), np.float64: xp.empty(1, xp.float64), np.int32: xp.empty(1, xp.int32)}
    floats, doubles, ints = (entries, None, None) if source == FROM_FLOATS else (None, entries, None)
    while True:
        tiles = -(-n // TILE)
        last = tiles == 1
        kept_v = unused[np.float64] if last else xp.empty(rows * tiles * k, xp.float64)
        kept_i = unused[np.int32] if last else xp.empty(rows * tiles * k, xp.int32)
        reads = (
            unused[np.float32] if floats is None else floats,
            unused[np.float64] if doubles is None else doubles,
            unused[np.int32] if ints is None else ints,
        )
        sizes = (np.int64(row_stride), np.int32(n), np.int32(start), np.int32(k))
        args = (np.int32(source), *reads, *sizes, kept_v, kept_i, out if last else unused[np.float64])
        kernels["top_k_tile"]((tiles, rows), (THREADS,), (*args, np.int32(k), np.int32(width), np.int32(last)))
        if last:
            return
        source, floats, doubles, ints = FROM_KEPT, None, kept_v, kept_i
        n = row_stride = tiles * k
        start = 0
