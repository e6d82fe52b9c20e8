"""A prefill's quantized weights dequantized on the GPU a tile at a time by one kernel of our own,
where CuPy's expressions (workers/kernels/quant.py `values`: the file's order, the scales, the
nibbles, their products and sums) made about a dozen launches a tile: in a 1.7B-shaped model's
128-token prefill, thousands a layer inside its device graphs.

The legacy formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32-value blocks); the K-quants keep CuPy's
expressions. One thread a value: row r = g * lanes + l of the interleaved weight (byte p of block
b at [g, b, p, l]), value j of block b, written at out[r, 32 b + j]. The arithmetic is quant.py's,
each float operation rounded on its own (d * q, d * q + m, d * (q - 8), d * (q - 16)): exact
values of the same operations, so the twin, quant.dequantize itself, gives the kernel's bits.
"""

from __future__ import annotations

import numpy as np

from split_state.quant import FORMATS
from workers.kernels import quant
from workers.kernels.device import DeviceKernel

THREADS = 256

# value j of a block whose byte p lies at w[p * s]: d the float16 at bytes 0-1 (m at 2-3)
_VALUES = {
    "q8_0": "mul_rn(half_at(w, s), (float)(signed char)w[(2 + j) * s])",
    "q4_0": "mul_rn(half_at(w, s), sub_rn((float)nibble(w + 2 * s, s, j), 8.f))",
    "q4_1": "add_rn(mul_rn(half_at(w, s), (float)nibble(w + 4 * s, s, j)), half_at(w + 2 * s, s))",
    "q5_0": "mul_rn(half_at(w, s), sub_rn((float)(nibble(w + 6 * s, s, j) | fifth(w + 2 * s, s, j)), 16.f))",
    "q5_1": "add_rn(mul_rn(half_at(w, s), (float)(nibble(w + 8 * s, s, j) | fifth(w + 4 * s, s, j))),"
    " half_at(w + 2 * s, s))",
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
"""

_KERNEL = r"""
extern "C" __global__ void dequant_NAME(const u8* __restrict__ weight, float* __restrict__ out, int groups,
                                        int blocks, int lanes) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long total = (long)groups * lanes * blocks * 32;
    if (i >= total) return;
    const int j = (int)(i % 32);
    const int b = (int)(i / 32 % blocks);
    const long r = i / (32L * blocks);
    const long g = r / lanes, l = r % lanes;
    const long s = lanes;
    const u8* w = weight + (g * blocks + b) * BYTES * s + l;
    out[i] = VALUE;
}
"""

SOURCE = _HELPERS + "".join(
    _KERNEL.replace("NAME", name).replace("BYTES", str(FORMATS[name].block_bytes)).replace("VALUE", value)
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
    lanes, blocks * 32) float32, as quant.dequantize gives it."""
    groups, blocks, _, lanes = w.shape
    out = xp.empty((groups * lanes, blocks * 32), xp.float32)
    if out.size:
        grid = (-(-out.size // THREADS),)
        kernels[f"dequant_{name}"](grid, (THREADS,), (w, out, np.int32(groups), np.int32(blocks), np.int32(lanes)))
    return out
