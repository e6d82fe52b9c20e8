"""A prefill's quantized weights dequantized on the GPU a tile at a time by one kernel of our own,
where CuPy's expressions (workers/kernels/quant.py `values`: the file's order, the scales, the
nibbles, their products and sums) made about a dozen launches a tile: in a 1.7B-shaped model's
128-token prefill, thousands a layer inside its device graphs.

The legacy formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32-value blocks) and the K-quants (Q4_K, Q5_K,
Q6_K: 256). One thread a value: row r = g * lanes + l of the interleaved weight (byte p of block
b at [g, b, p, l]), value v of block b, written at out[r, block * b + v]. The arithmetic is
quant.py's, each float operation rounded on its own (d * q + m, d * (q - 8), (d * scale) * q -
dmin * min, ...): exact values of the same operations, so the twin, quant.dequantize itself,
gives the kernel's bits.
"""

from __future__ import annotations

import numpy as np

from split_state.quant import FORMATS
from workers.backends.cuda.kernels.device import DeviceKernel
from workers.kernels import quant

THREADS = 256

# value v of a block whose byte p lies at w[p * s]: d the float16 at bytes 0-1 (m at 2-3)
_VALUES = {
    "q8_0": "mul_rn(half_at(w, s), (float)(signed char)w[(2 + v) * s])",
    "q4_0": "mul_rn(half_at(w, s), sub_rn((float)nibble(w + 2 * s, s, v), 8.f))",
    "q4_1": "add_rn(mul_rn(half_at(w, s), (float)nibble(w + 4 * s, s, v)), half_at(w + 2 * s, s))",
    "q5_0": "mul_rn(half_at(w, s), sub_rn((float)(nibble(w + 6 * s, s, v) | fifth(w + 2 * s, s, v)), 16.f))",
    "q5_1": "add_rn(mul_rn(half_at(w, s), (float)(nibble(w + 8 * s, s, v) | fifth(w + 4 * s, s, v))),"
    " half_at(w + 2 * s, s))",
}
# the K-quants' 256-value blocks (value v of sub-block t = v / 32: k_value's and q6_value's comments)
_VALUES |= {
    "q4_k": "k_value(w, s, v, 16, -1)",
    "q5_k": "k_value(w, s, v, 48, 16)",
    "q6_k": "q6_value(w, s, v)",
}
FORMAT_NAMES = tuple(_VALUES)

_HELPERS = r"""
/* value j of 16 packed bytes: the low halves are values 0-15, the high halves 16-31 */
__device__ __forceinline__ unsigned int nibble(const u8* qs, long s, int j) {
    return j < 16 ? (qs[j * s] & 15u) : (qs[(j - 16) * s] >> 4);
}
/* the fifth bit of value j: bit j of the little-endian 32-bit word at `word`, as 16 */
__device__ __forceinline__ unsigned int fifth(const u8* word, long s, int j) {
    return ((word[(j >> 3) * s] >> (j & 7)) & 1u) << 4;
}
/* Q4_K / Q5_K value v: d * scale[t] * q - dmin * min[t] for sub-block t = v / 32, with the six-bit
   scales and minimums of the 12 bytes at 4 (quant.k4_scales), q the low (even t) or high (odd t)
   half of quant byte 32 (t / 2) + j at `first`, plus (Q5_K, `bits` 16) 16 * bit t of byte j there */
__device__ __forceinline__ float k_value(const u8* w, long s, int v, int first, int bits) {
    const int t = v / 32, j = v % 32;
    const u8* sc = w + 4 * s;
    unsigned int scale, minimum;
    if (t < 4) {
        scale = sc[t * s] & 63u;
        minimum = sc[(t + 4) * s] & 63u;
    } else {
        scale = (sc[(t + 4) * s] & 15u) | ((sc[(t - 4) * s] >> 6) << 4);
        minimum = (sc[(t + 4) * s] >> 4) | ((sc[t * s] >> 6) << 4);
    }
    const unsigned int byte = w[(first + 32 * (t / 2) + j) * s];
    unsigned int q = (t % 2) ? (byte >> 4) : (byte & 15u);
    if (bits > 0) q += ((w[(bits + j) * s] >> t) & 1u) << 4;
    const float d = mul_rn(half_at(w, s), (float)scale), dmin = mul_rn(half_at(w + 2 * s, s), (float)minimum);
    return sub_rn(mul_rn(d, (float)q), dmin);
}
/* Q6_K value v: half h = v / 128, chunk k = (v % 128) / 32, l = v % 32: the low four bits from ql
   byte 64 h + 32 (k % 2) + l (its low half for k < 2, high for k >= 2), the top two from bits 2k,
   2k + 1 of qh byte 128 + 32 h + l; d * scale[v / 16] * (q - 32), the int8 scales at 192, d at 208 */
__device__ __forceinline__ float q6_value(const u8* w, long s, int v) {
    const int h = v / 128, k = v % 128 / 32, l = v % 32;
    const unsigned int ql = w[(64 * h + 32 * (k % 2) + l) * s];
    const unsigned int low = k < 2 ? (ql & 15u) : (ql >> 4);
    const unsigned int top = (w[(128 + 32 * h + l) * s] >> (2 * k)) & 3u;
    const float d = mul_rn(half_at(w + 208 * s, s), (float)(signed char)w[(192 + v / 16) * s]);
    return mul_rn(d, sub_rn((float)(low | (top << 4)), 32.f));
}
"""

_KERNEL = r"""
extern "C" __global__ void dequant_NAME(const u8* __restrict__ weight, float* __restrict__ out, int groups,
                                        int blocks, int lanes) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long total = (long)groups * lanes * blocks * BLOCK;
    if (i >= total) return;
    const int v = (int)(i % BLOCK);
    const int b = (int)(i / BLOCK % blocks);
    const long r = i / ((long)BLOCK * blocks);
    const long g = r / lanes, l = r % lanes;
    const long s = lanes;
    const u8* w = weight + (g * blocks + b) * BYTES * s + l;
    out[i] = VALUE;
}
"""

SOURCE = _HELPERS + "".join(
    _KERNEL.replace("NAME", name)
    .replace("BYTES", str(FORMATS[name].block_bytes))
    .replace("BLOCK", str(FORMATS[name].block))
    .replace("VALUE", value)
    for name, value in _VALUES.items()
)


def _twin(name: str):
    """What dequant_<name> computes: quant.dequantize on the same flat memory."""
    fmt = FORMATS[name]

    def run(weight, out, groups, blocks, lanes):
        groups, blocks, lanes = int(groups), int(blocks), int(lanes)
        w = weight[: groups * blocks * fmt.block_bytes * lanes].reshape(groups, blocks, fmt.block_bytes, lanes)
        values = quant.dequantize(np, w, fmt).reshape(-1)
        out[: values.size] = values

    return run


DEVICE_KERNELS = tuple(DeviceKernel(f"dequant_{name}", SOURCE, _twin(name), (1,)) for name in FORMAT_NAMES)


def launch(xp, kernels: dict, name: str, w):
    """The interleaved tile `w` (groups, blocks, block_bytes, lanes), packed, dequantized: (groups *
    lanes, blocks * block) float32, as quant.dequantize gives it."""
    groups, blocks, _, lanes = w.shape
    out = xp.empty((groups * lanes, blocks * FORMATS[name].block), xp.float32)
    if out.size:
        grid = (-(-out.size // THREADS),)
        kernels[f"dequant_{name}"](grid, (THREADS,), (w, out, np.int32(groups), np.int32(blocks), np.int32(lanes)))
    return out
