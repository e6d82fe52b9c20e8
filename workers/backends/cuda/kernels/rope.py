"""Rope on the GPU as kernels of our own: the rotation of a decode step's q (one launch where the
shared kernel's CuPy expressions made about fourteen), and the keys' rotation fused with their
KV-cache write (the rope_set_rows pattern's kernel: one launch for what was rope and set_rows).

The arithmetic is the shared kernel's (workers/kernels/basic.py rope), so a device graph's
result is the eager run's: each angle position * inverse frequency in double precision, its
cosine and sine in double rounded to float, then a * cos - b * sin and a * sin + b * cos in float
with every product and sum rounded on its own (__fmul_rn, __fadd_rn: no fused multiply-add, as
CuPy's separate elementwise kernels round). Pairs are adjacent values (ggml's "normal" mode) or
the two halves of a head ("neox"). The positions are read on the device, so both are captured in
the step's graph. The write's layout and its skipping of positions outside the cache are
set_rows.py's (a kernel cannot raise; an eager run checks them on the host).
"""

from __future__ import annotations

import numpy as np

from workers.backends.cuda.kernels import set_rows
from workers.backends.cuda.kernels.device import DeviceKernel

_SOURCE = r"""
/* the pair (ia, ib) of a head's values that frequency i turns, rotated by the angle at `position` */
__device__ __forceinline__ void rotated(const float* head, int i, int half, int neox, int position,
                                        const double* inverse, int* ia, int* ib, float* first, float* second) {
    *ia = neox ? i : 2 * i;
    *ib = neox ? i + half : 2 * i + 1;
    const double angle = (double)position * inverse[i];
    const float c = (float)cos(angle), s = (float)sin(angle);
    const float a = head[*ia], b = head[*ib];
    *first = sub_rn(mul_rn(a, c), mul_rn(b, s));
    *second = add_rn(mul_rn(a, s), mul_rn(b, c));
}

extern "C" __global__ void rope_f32(float* __restrict__ out, const float* __restrict__ x,
                                    const int* __restrict__ positions, const double* __restrict__ inverse,
                                    int count, int heads, int dim, int neox) {
    const int half = dim / 2;
    const long total = (long)count * heads * half;
    const long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= total) return;
    const int i = (int)(k % half);
    const long row = k / half;  /* (token, head) */
    int ia, ib;
    float first, second;
    rotated(x + row * dim, i, half, neox, positions[row / heads], inverse, &ia, &ib, &first, &second);
    out[row * dim + ia] = first;
    out[row * dim + ib] = second;
}
"""

_WRITE = r"""
extern "C" __global__ void rope_write_NAME(OUT* __restrict__ dst, const float* __restrict__ x,
                                           const int* __restrict__ positions, const double* __restrict__ inverse,
                                           const int* __restrict__ ids, const int* __restrict__ start, int fed,
                                           int batches, int heads, int ctx, int dim, int rows, int tokens, int neox) {
    const int half = dim / 2;
    const long total = (long)rows * tokens * heads * half;
    const long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= total) return;
    const int i = (int)(k % half);
    const int h = (int)((k / half) % heads);
    const long token = k / ((long)half * heads);  /* j * tokens + t */
    const int j = (int)(token / tokens);
    const int b = (fed ? start[0] : 0) + j;
    const int pos = ids[token];
    if (b < 0 || b >= batches || pos < 0 || pos >= ctx) return;
    int ia, ib;
    float first, second;
    rotated(x + (token * heads + h) * dim, i, half, neox, positions[token], inverse, &ia, &ib, &first, &second);
    OUT* row = dst + (((long)b * heads + h) * ctx + pos) * dim;
    row[ia] = CONVERT(first);
    row[ib] = CONVERT(second);
}
"""
THREADS = 256
SOURCE = (
    _SOURCE
    + _WRITE.replace("NAME", "f32").replace("OUT", "float").replace("CONVERT", "")
    + _WRITE.replace("NAME", "f16").replace("OUT", "unsigned short").replace("CONVERT", "half_bits")
)


def _rotated(x, positions, inverse, neox: bool):
    """x (tokens, heads, dim) rotated at positions (tokens,): what `rotated` computes, in NumPy."""
    angles = positions.astype(np.float64)[:, None] * inverse  # (tokens, half)
    c, s = np.cos(angles).astype(np.float32)[:, None], np.sin(angles).astype(np.float32)[:, None]
    half = x.shape[-1] // 2
    a, b = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])
    out = np.empty_like(x)
    first, second = (out[..., :half], out[..., half:]) if neox else (out[..., 0::2], out[..., 1::2])
    first[...], second[...] = a * c - b * s, a * s + b * c
    return out


def _rope_twin(out, x, positions, inverse, count, heads, dim, neox):
    count, heads, dim = int(count), int(heads), int(dim)
    values = x[: count * heads * dim].reshape(count, heads, dim)
    out[: count * heads * dim] = _rotated(values, positions[:count], inverse[: dim // 2], bool(neox)).reshape(-1)


def _write_twin(cache_dtype):
    """What rope_write_<type> computes: the rows rotated, then written as set_rows_<type> writes."""
    write = set_rows.twin(cache_dtype)

    def run(dst, x, positions, inverse, ids, start, fed, batches, heads, ctx, dim, rows, tokens, neox):
        count, h, d = int(rows) * int(tokens), int(heads), int(dim)
        turned = _rotated(x[: count * h * d].reshape(count, h, d), positions[:count], inverse[: d // 2], bool(neox))
        value = turned.reshape(int(rows), int(tokens), h, d).transpose(0, 2, 1, 3).reshape(-1)
        write(dst, np.ascontiguousarray(value), ids, start, fed, batches, heads, ctx, dim, rows, tokens)

    return run


DEVICE_KERNELS = (
    DeviceKernel("rope_f32", SOURCE, _rope_twin, (0,)),
    DeviceKernel("rope_write_f32", SOURCE, _write_twin(np.float32), (0,)),
    DeviceKernel("rope_write_f16", SOURCE, _write_twin(np.float16), (0,)),
)


def fits(x, positions, out) -> bool:
    """The layout rope_f32 takes: float32 x and out (..., heads, dim) in order, one position for
    each of x's tokens."""
    return (
        x.ndim >= 2
        and x.shape[-1] % 2 == 0
        and x.dtype == np.float32
        and out.dtype == np.float32
        and out.shape == x.shape
        and positions.shape == x.shape[:-2]
        and x.flags.c_contiguous
        and out.flags.c_contiguous
    )


def fits_write(dst, ids, x, positions, params, fed_start: bool) -> bool:
    """The decoder's keys, x (rows, tokens, heads, dim) float32 in order, rotated at positions
    (rows, tokens) and written as set_rows.py writes (its `fits`, of their transposed view)."""
    return (
        x.ndim == 4
        and x.shape[-1] % 2 == 0
        and x.dtype == np.float32
        and x.flags.c_contiguous
        and positions.shape == x.shape[:2]
        and set_rows.fits(dst, ids, x.transpose(0, 2, 1, 3), params, fed_start)
    )


def launch(xp, kernels: dict, x, positions, inverse, neox: bool, out) -> None:
    heads, dim = x.shape[-2], x.shape[-1]
    if not x.size:  # no heads here (a device left none of them) or no tokens
        return
    count = x.size // (heads * dim)
    total = count * heads * (dim // 2)
    positions = xp.ascontiguousarray(positions.reshape(-1), dtype=xp.int32)
    args = (out, x, positions, inverse, *(np.int32(v) for v in (count, heads, dim, int(neox))))
    kernels["rope_f32"]((-(-total // THREADS),), (THREADS,), args)


def launch_write(xp, kernels: dict, dst, x, positions, inverse, ids, start, neox: bool) -> None:
    batch, heads, ctx, dim = dst.shape
    rows, tokens = ids.shape
    total = rows * tokens * heads * (dim // 2)
    if not total:
        return
    kind, target, ids, start, fed = set_rows.cache_operands(xp, dst, ids, start)
    positions = xp.ascontiguousarray(positions, dtype=xp.int32)
    sizes = (batch, heads, ctx, dim, rows, tokens, int(neox))
    args = (target, x, positions, inverse, ids, start, fed, *(np.int32(v) for v in sizes))
    kernels[f"rope_write_{kind}"]((-(-total // THREADS),), (THREADS,), args)
