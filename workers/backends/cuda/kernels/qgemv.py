"""Products of a few rows of x (decode) with a weight kept in its GGUF blocks, on the GPU: one
kernel per format that reads the blocks where they lie and never writes a dequantized copy, so
a decode step's products are kernels of our own (captured in the step's device graph) instead of
CuPy's dequantization of every weight every token.

The weight is interleaved as the workers keep it (split_state/quant.py): byte p of block b of
row g * lanes + l at [g, b, p, l]. A thread owns one output row and a share of its blocks: 32
consecutive rows a thread block wide (threads of a warp read consecutive bytes when lanes >= 32,
one 32-byte sector per load) and KSPLIT threads over each row's blocks (block b goes to thread
b % KSPLIT), whose sums are added in a fixed order (KSPLIT 0 first), so a run gives the same bits
every time. Each x row of the call is one row of the grid.

The twin (`qgemv_twin`) is what each kernel computes: out (xrows, n) = x (xrows, width) @ the
dequantized weight (n, width).T (plus an addend of out's shape where the qmatmul_add pattern
gives one: a residual added as the sums are written), with the dequantization of
workers/kernels/quant.py (held to gguf's by tests/test_quant.py). The kernel sums in another
order than NumPy's product, so a GPU test holds it to the twin within a stated tolerance, not
bit for bit.
"""

from __future__ import annotations

import numpy as np

from split_state.quant import FORMATS
from workers.backends.cuda.kernels.device import DeviceKernel
from workers.kernels import quant

KSPLIT = 16  # threads over one row's blocks
ROWS_PER_BLOCK = 32  # output rows of one thread block
MAX_ROWS = 8  # x rows up to which a product runs these kernels (more: dequantized tiles, cuBLAS)

# Each format's dot product of one block of one row with its x values. `w` points at the block's
# byte 0 of this row; byte p is at w[p * s] (s: the lanes); `x` at the block's first x value.
# Layouts (split_state/quant.py, workers/kernels/quant.py): q4_0 d * (nibble - 8); q4_1 d *
# nibble + m; q5_0 d * (q - 16) and q5_1 d * q + m, q = nibble + 16 * bit j of the 32-bit word
# after the factors; q8_0 d * int8; nibble j of a 16-byte run: low half value j, high j + 16.
_DOTS = r"""
__device__ __forceinline__ float dot_q8_0(const u8* w, long s, const float* x) {
    float acc = 0.f;
    for (int j = 0; j < 32; ++j) acc += x[j] * (float)(signed char)w[(2 + j) * s];
    return half_at(w, s) * acc;
}
__device__ __forceinline__ float nibble_dot(const u8* qs, long s, const float* x, unsigned int high,
                                            float offset) {
    float acc = 0.f;
    for (int j = 0; j < 16; ++j) {
        unsigned int q = qs[j * s];
        float lo = (float)((q & 15u) | (((high >> j) & 1u) << 4)) - offset;
        float hi = (float)((q >> 4) | (((high >> (j + 16)) & 1u) << 4)) - offset;
        acc += x[j] * lo + x[j + 16] * hi;
    }
    return acc;
}
__device__ __forceinline__ float sum32(const float* x) {
    float acc = 0.f;
    for (int j = 0; j < 32; ++j) acc += x[j];
    return acc;
}
__device__ __forceinline__ unsigned int word_at(const u8* w, long s) {
    return (unsigned int)w[0] | ((unsigned int)w[s] << 8) | ((unsigned int)w[2 * s] << 16)
         | ((unsigned int)w[3 * s] << 24);
}
__device__ __forceinline__ float dot_q4_0(const u8* w, long s, const float* x) {
    return half_at(w, s) * nibble_dot(w + 2 * s, s, x, 0u, 8.f);
}
__device__ __forceinline__ float dot_q4_1(const u8* w, long s, const float* x) {
    return half_at(w, s) * nibble_dot(w + 4 * s, s, x, 0u, 0.f) + half_at(w + 2 * s, s) * sum32(x);
}
__device__ __forceinline__ float dot_q5_0(const u8* w, long s, const float* x) {
    return half_at(w, s) * nibble_dot(w + 6 * s, s, x, word_at(w + 2 * s, s), 16.f);
}
__device__ __forceinline__ float dot_q5_1(const u8* w, long s, const float* x) {
    return half_at(w, s) * nibble_dot(w + 8 * s, s, x, word_at(w + 4 * s, s), 0.f)
         + half_at(w + 2 * s, s) * sum32(x);
}
/* q4_k, q5_k (FIFTH): float16 d and dmin, 12 bytes of six-bit scales and minimums, (q5_k: 32
   bytes of fifth bits,) 128 quant bytes; sub-block t (values 32t..32t+31) reads quant bytes
   32 (t / 2) + j, low halves for even t, high for odd; value d * scale_t * q - dmin * min_t. */
template <bool FIFTH>
__device__ __forceinline__ float k_dot(const u8* w, long s, const float* x) {
    const float d = half_at(w, s), dmin = half_at(w + 2 * s, s);
    const u8* sc = w + 4 * s;
    const u8* qs = w + (FIFTH ? 48 : 16) * s;
    float acc = 0.f;
    for (int t = 0; t < 8; ++t) {
        int scale, low;
        if (t < 4) {
            scale = sc[t * s] & 63;
            low = sc[(t + 4) * s] & 63;
        } else {
            scale = (sc[(t + 4) * s] & 15) | ((sc[(t - 4) * s] >> 6) << 4);
            low = (sc[(t + 4) * s] >> 4) | ((sc[t * s] >> 6) << 4);
        }
        const int shift = (t & 1) * 4;
        float dot = 0.f, sum = 0.f;
        for (int j = 0; j < 32; ++j) {
            unsigned int q = (qs[(32 * (t / 2) + j) * s] >> shift) & 15u;
            if (FIFTH) q |= ((w[(16 + j) * s] >> t) & 1u) << 4;
            const float xv = x[32 * t + j];
            dot += xv * (float)q;
            sum += xv;
        }
        acc += d * (float)scale * dot - dmin * (float)low * sum;
    }
    return acc;
}
__device__ __forceinline__ float dot_q4_k(const u8* w, long s, const float* x) { return k_dot<false>(w, s, x); }
__device__ __forceinline__ float dot_q5_k(const u8* w, long s, const float* x) { return k_dot<true>(w, s, x); }
/* q6_k: 128 bytes of low four bits, 64 of top two, 16 int8 scales, float16 d at 208. Value
   v = 128 h + 32 k + l: low bits from byte 64 h + 32 (k % 2) + l (low half for k < 2), top bits
   (2k, 2k + 1) of byte 128 + 32 h + l; q - 32, times d * scale[v / 16]. */
__device__ __forceinline__ float dot_q6_k(const u8* w, long s, const float* x) {
    const float d = half_at(w + 208 * s, s);
    float acc = 0.f;
    for (int h = 0; h < 2; ++h) {
        for (int k = 0; k < 4; ++k) {
            for (int half16 = 0; half16 < 2; ++half16) {
                float dot = 0.f;
                for (int i = 0; i < 16; ++i) {
                    const int l = 16 * half16 + i;
                    const unsigned int ql = w[(64 * h + 32 * (k % 2) + l) * s];
                    const unsigned int low = k < 2 ? (ql & 15u) : (ql >> 4);
                    const unsigned int top = (w[(128 + 32 * h + l) * s] >> (2 * k)) & 3u;
                    dot += x[128 * h + 32 * k + l] * (float)((int)(low | (top << 4)) - 32);
                }
                const int group = 8 * h + 2 * k + half16;
                acc += d * (float)(signed char)w[(192 + group) * s] * dot;
            }
        }
    }
    return acc;
}
/* bf16: a value a block, the top half of a float32 */
__device__ __forceinline__ float dot_bf16(const u8* w, long s, const float* x) {
    const unsigned int bits = (unsigned int)w[0] | ((unsigned int)w[s] << 8);
    return x[0] * __int_as_float((int)(bits << 16));
}
"""

_KERNEL = r"""
extern "C" __global__ void qgemv_NAME(const u8* __restrict__ w, const float* __restrict__ x,
                                      float* __restrict__ out, const float* __restrict__ addend, int add,
                                      int n, int lanes, int blocks, int xrows) {
    __shared__ float part[KSPLIT][ROWS];
    const int r = blockIdx.x * ROWS + threadIdx.x;
    const int xr = blockIdx.y;
    float acc = 0.f;
    if (r < n && xr < xrows) {
        const long g = r / lanes, l = r % lanes;
        const float* xv = x + (long)xr * blocks * BLOCK;
        for (int b = threadIdx.y; b < blocks; b += KSPLIT)
            acc += dot_NAME(w + (g * blocks + b) * BYTES * lanes + l, lanes, xv + (long)b * BLOCK);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && r < n && xr < xrows) {
        float total = 0.f;
        for (int k = 0; k < KSPLIT; ++k) total += part[k][threadIdx.x];
        const long at = (long)xr * n + r;
        out[at] = add ? add_rn(total, addend[at]) : total;
    }
}
"""


def kernel_name(fmt: str) -> str:
    return f"qgemv_{fmt}"


def _kernel_source(fmt: str, ksplit: int, rows: int) -> str:
    f = FORMATS[fmt]
    body = _KERNEL.replace("NAME", fmt).replace("KSPLIT", str(ksplit)).replace("ROWS", str(rows))
    return body.replace("BLOCK", str(f.block)).replace("BYTES", str(f.block_bytes))


def source_for(ksplit: int = KSPLIT, rows: int = ROWS_PER_BLOCK) -> str:
    """Every format's kernel for thread blocks of `rows` output rows x `ksplit` threads over each
    row's blocks (launched with block (rows, ksplit)): the workers' kernels at the defaults;
    bench/qgemv.py times other shapes of the thread block on a GPU."""
    return _DOTS + "".join(_kernel_source(fmt, ksplit, rows) for fmt in FORMATS)


SOURCE = source_for()  # one module: one compilation


def qgemv_twin(fmt: str):
    """What qgemv_<fmt> computes, over the same flat memory and scalars."""
    f = FORMATS[fmt]

    def twin(w, x, out, addend, add, n, lanes, blocks, xrows):
        n, lanes, blocks, xrows = int(n), int(lanes), int(blocks), int(xrows)
        groups = n // lanes
        weight = w[: groups * blocks * f.block_bytes * lanes].reshape(groups, blocks, f.block_bytes, lanes)
        values = quant.dequantize(np, weight, f)  # (n, width)
        xs = x[: xrows * blocks * f.block].reshape(xrows, blocks * f.block)
        product = (xs @ values.T).reshape(-1)
        out[: xrows * n] = product + addend[: xrows * n] if add else product

    return twin


DEVICE_KERNELS = tuple(DeviceKernel(kernel_name(fmt), SOURCE, qgemv_twin(fmt), (2,)) for fmt in FORMATS)


def launch(xp, kernels: dict, fmt: str, x, w, out, addend=None) -> None:
    """out (xrows, n) = x (xrows, width) @ w's dequantized (n, width).T, plus `addend` (xrows, n)
    where given (each sum rounded, then the addend added: an add step's bits); all C-contiguous.
    Without an addend, `out` stands in for its pointer, never read."""
    groups, blocks, _, lanes = w.shape
    n, xrows = groups * lanes, x.shape[0]
    grid = (-(-n // ROWS_PER_BLOCK), xrows)
    add = (out if addend is None else addend, np.int32(addend is not None))
    args = (w, x, out, *add, np.int32(n), np.int32(lanes), np.int32(blocks), np.int32(xrows))
    kernels[kernel_name(fmt)](grid, (ROWS_PER_BLOCK, KSPLIT), args)
