"""silu(gate) * up on the GPU as one kernel of our own (the swiglu pattern's), where the shared
kernel's CuPy expressions made five launches (negate, exp, + 1, divide, multiply) a layer inside
a decode step's graph.

gate and up are two column ranges of each row of one tensor (the FFN's gate|up product): value j
of a row is g / (1 + exp(-g)) * u for g, u its gate's and up's column j, each float operation
rounded on its own (no fused multiply-add), in the shared kernel's order. The twin computes the
same in float32 with NumPy's exp, which may differ from the device's expf by an ulp or two (a GPU
test holds them to a stated tolerance).
"""

from __future__ import annotations

import numpy as np

from workers.backends.cuda.kernels.device import DeviceKernel

THREADS = 256

SOURCE = r"""
extern "C" __global__ void swiglu(const float* __restrict__ both, float* __restrict__ out, int width, int gate,
                                  int up, int columns, long count) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const long row = i / columns;
    const int j = (int)(i % columns);
    const float g = both[row * width + gate + j], u = both[row * width + up + j];
    out[i] = mul_rn(div_rn(g, add_rn(1.f, expf(-g))), u);
}
"""


def _twin(both, out, width, gate, up, columns, count):
    """What swiglu computes, NumPy's exp for the device's expf."""
    width, gate, up, columns, count = (int(a) for a in (width, gate, up, columns, count))
    if not count:
        return
    rows = both[: count // columns * width].reshape(-1, width)
    g, u = rows[:, gate : gate + columns], rows[:, up : up + columns]
    with np.errstate(over="ignore"):  # exp(-g) past float32's range: inf, and silu 0, as expf gives
        out[:count] = (g / (np.float32(1) + np.exp(-g)) * u).reshape(-1)


DEVICE_KERNELS = (DeviceKernel("swiglu", SOURCE, _twin, (1,)),)


def fits(both, params, out) -> bool:
    """Whether the kernel takes this step: float32 rows, packed, gate and up column ranges of
    one length."""
    (g0, g1), (u0, u1) = params["gate"], params["up"]
    if both.dtype != np.float32 or out is None or out.dtype != np.float32 or g1 - g0 != u1 - u0:
        return False
    return both.flags.c_contiguous and out.flags.c_contiguous and out.shape == both.shape[:-1] + (g1 - g0,)


def launch(xp, kernels: dict, both, params, out) -> None:
    (gate, stop), (up, _) = params["gate"], params["up"]
    count = out.size
    if count:
        sizes = (np.int32(both.shape[-1]), np.int32(gate), np.int32(up), np.int32(stop - gate), np.int64(count))
        kernels["swiglu"]((-(-count // THREADS),), (THREADS,), (both, out, *sizes))
