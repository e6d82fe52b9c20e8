"""The embedding lookup on the GPU with the token ids read on the device: kernels of our own, so
the lookup is captured in the step's device graph (the shared get_rows and qget_rows read the
ids' range on the host, a wait for the device, and run eagerly before the first graph).

Each output row is the table's row for its id where this device holds it (the table split by
rows: ids in [start, stop) are its rows from `local` on), zeros elsewhere, as the shared kernels
give it; a float32 table, or a Q8_0 one interleaved as the workers keep it (split_state/quant.py;
a value is its block's float16 d times its int8). An id outside the table gives zeros here: a
kernel cannot raise; the step's first, eager run checks the ids on the host, and a GPU step's ids
come from checked prompts or the workers' own choices.
"""

from __future__ import annotations

import numpy as np

from split_state.quant import FORMATS
from workers.backends.cuda.kernels.device import DeviceKernel
from workers.kernels import quant

THREADS = 256
SOURCE = r"""
extern "C" __global__ void rows_f32(const float* __restrict__ table, const int* __restrict__ ids,
                                    float* __restrict__ out, int count, int width, int start, int stop,
                                    int local, int held) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)count * width) return;
    const int t = (int)(i / width), v = (int)(i % width);
    const int id = ids[t];
    const int r = id - start + local;
    out[i] = (id >= start && id < stop && r >= 0 && r < held) ? table[(long)r * width + v] : 0.f;
}
extern "C" __global__ void rows_q8_0(const u8* __restrict__ table, const int* __restrict__ ids,
                                     float* __restrict__ out, int count, int blocks, int lanes, int start,
                                     int stop, int local, int held) {
    const int width = blocks * 32;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)count * width) return;
    const int t = (int)(i / width), v = (int)(i % width);
    const int id = ids[t];
    const int r = id - start + local;
    if (!(id >= start && id < stop && r >= 0 && r < held)) {
        out[i] = 0.f;
        return;
    }
    const long g = r / lanes, l = r % lanes;
    const u8* block = table + ((g * blocks + v / 32) * 34) * lanes + l;
    out[i] = half_at(block, lanes) * (float)(signed char)block[(2 + v % 32) * lanes];
}
"""


def _rows_f32(table, ids, out, count, width, start, stop, local, held):
    count, width, start, stop, local, held = (int(a) for a in (count, width, start, stop, local, held))
    rows = table[: held * width].reshape(held, width)
    result = out[: count * width].reshape(count, width)
    for t in range(count):
        r = int(ids[t]) - start + local
        result[t] = rows[r] if start <= int(ids[t]) < stop and 0 <= r < held else 0


def _rows_q8_0(table, ids, out, count, blocks, lanes, start, stop, local, held):
    count, blocks, lanes, start, stop, local, held = (int(a) for a in (count, blocks, lanes, start, stop, local, held))
    fmt = FORMATS["q8_0"]
    weight = table[: held * blocks * fmt.block_bytes].reshape(held // lanes, blocks, fmt.block_bytes, lanes)
    values = quant.dequantize(np, weight, fmt)  # (held, blocks * 32)
    result = out[: count * blocks * 32].reshape(count, blocks * 32)
    for t in range(count):
        r = int(ids[t]) - start + local
        result[t] = values[r] if start <= int(ids[t]) < stop and 0 <= r < held else 0


DEVICE_KERNELS = (
    DeviceKernel("rows_f32", SOURCE, _rows_f32, (2,)),
    DeviceKernel("rows_q8_0", SOURCE, _rows_q8_0, (2,)),
)


def span(params) -> tuple[int, int, int] | None:
    """The one span of table rows this device holds (start, stop, local), or None for several."""
    spans = params.get("spans", [(0, params["rows"], 0)])
    return tuple(int(v) for v in spans[0]) if len(spans) == 1 else None


def launch(xp, kernels: dict, name: str, table, ids, out, sizes: tuple[int, ...], where, held: int) -> None:
    ids = xp.ascontiguousarray(ids.reshape(-1), dtype=xp.int32)
    count = ids.size
    total = out.size
    if not total:
        return
    args = (table, ids, out, np.int32(count), *(np.int32(s) for s in sizes), *(np.int32(w) for w in where))
    kernels[name]((-(-total // THREADS),), (THREADS,), (*args, np.int32(held)))
