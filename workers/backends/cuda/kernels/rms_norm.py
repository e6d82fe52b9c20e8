"""RMSNorm times its weight on the GPU as one kernel of our own (the rms_norm_mul pattern's), where
the shared kernel's CuPy expressions made six launches (square, mean, + eps, sqrt, divide,
multiply): twice a layer inside a decode step's graph, where a node costs a launch's time
whatever it computes.

One thread block a row of `width` values: each thread sums the squares of the values d = tid,
tid + THREADS, ... one after another, the block adds its threads' sums by halving (thread t
takes t + half), then r = sqrt(sum / width + eps) and out = x / r * weight, every float operation
rounded on its own (device.PRELUDE's mul_rn etc.: no fused multiply-add). The twin does the same
operations in the same order in float32, so kernel and twin agree bit for bit; the sum's order
differs from NumPy's pairwise mean, so the CPU path's norm may differ from it in the last bits.
"""

from __future__ import annotations

import numpy as np

from workers.backends.cuda.kernels.device import DeviceKernel

THREADS = 256  # a power of two: the block's sum halves it

SOURCE = (
    f"#define THREADS {THREADS}\n"
    + r"""
extern "C" __global__ void rms_norm_mul(const float* __restrict__ x, const float* __restrict__ weight,
                                        float* __restrict__ out, int width, float eps) {
    __shared__ float red[THREADS];
    const long row = blockIdx.x;
    const int tid = threadIdx.x;
    const float* values = x + row * width;
    float sum = 0.f;
    for (int d = tid; d < width; d += THREADS) sum = add_rn(sum, mul_rn(values[d], values[d]));
    red[tid] = sum;
    __syncthreads();
    for (int half = THREADS / 2; half > 0; half >>= 1) {
        if (tid < half) red[tid] = add_rn(red[tid], red[tid + half]);
        __syncthreads();
    }
    const float r = sqrt_rn(add_rn(div_rn(red[0], (float)width), eps));
    float* row_out = out + row * width;
    for (int d = tid; d < width; d += THREADS) row_out[d] = mul_rn(div_rn(values[d], r), weight[d]);
}
"""
)


def _twin(x, weight, out, width, eps):
    """What rms_norm_mul computes: its sums in its order, float32 throughout."""
    width, eps = int(width), np.float32(eps)
    rows = x.size // width if width else 0
    if not rows:
        return
    values = x[: rows * width].reshape(rows, width)
    squares = np.zeros((rows, -(-width // THREADS) * THREADS), np.float32)  # + 0 leaves a float sum as it is
    squares[:, :width] = values * values
    sums = np.zeros((rows, THREADS), np.float32)
    for at in range(0, squares.shape[1], THREADS):  # each thread's values, one after another
        sums += squares[:, at : at + THREADS]
    half = THREADS // 2
    while half:
        sums[:, :half] += sums[:, half : 2 * half]
        half //= 2
    r = np.sqrt(sums[:, :1] / np.float32(width) + eps)
    out[: rows * width] = (values / r * weight[:width]).reshape(-1)


DEVICE_KERNELS = (DeviceKernel("rms_norm_mul", SOURCE, _twin, (2,)),)


def fits(x, weight, params, out) -> bool:
    """Whether the kernel takes this step: float32 rows normed along their last axis, packed, a
    weight of one value per column."""
    axis, width = params["axis"], x.shape[-1] if x.ndim else 0
    if axis not in (-1, x.ndim - 1) or not width or out is None or out.shape != x.shape:
        return False
    if x.dtype != np.float32 or weight.dtype != np.float32 or out.dtype != np.float32:
        return False
    if weight.shape not in ((width,), (1,) * (x.ndim - 1) + (width,)):
        return False
    return x.flags.c_contiguous and weight.flags.c_contiguous and out.flags.c_contiguous


def launch(xp, kernels: dict, x, weight, eps: float, out) -> None:
    width = x.shape[-1]
    rows = x.size // width
    if rows:
        kernels["rms_norm_mul"]((rows,), (THREADS,), (x, weight, out, np.int32(width), np.float32(eps)))
