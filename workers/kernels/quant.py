"""Kernels on block-quantized weights (split_state/quant.py), written once against `xp`.

Weights are planar, (rows, block_bytes, blocks). `qmatmul` dequantizes the weight a tile of rows
at a time into a small float32 buffer and hands each tile to the BLAS matmul, so no float32 copy
of the whole weight ever exists; the CPU backend overrides it with numba loops that read the
blocks directly for a few rows of x (decode), see workers/kernels/numba_cpu.py. `qget_rows`
dequantizes only the rows it looks up.
"""

from __future__ import annotations

from split_state.errors import ShapeError
from split_state.quant import FORMATS, QuantFormat
from workers.kernels.basic import look_up_rows

TILE_BYTES = 1 << 20  # float32 bytes of one dequantized tile of rows


def _scale(xp, w, at: int):
    """The float16 at bytes [at, at + 2) of every block, as float32 (rows, blocks, 1)."""
    return xp.ascontiguousarray(w[..., at : at + 2]).view(xp.float16).astype(xp.float32)


def _nibbles(xp, qs):
    """16 bytes of packed 4-bit values -> 32 values: low halves are values 0-15, high 16-31."""
    return xp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(xp.float32)


def dequantize(xp, planar, fmt: QuantFormat):
    """Planar (rows, block_bytes, blocks) uint8 -> (rows, blocks * block) float32."""
    w = planar.swapaxes(-1, -2)  # the file's (rows, blocks, block_bytes), a view
    if fmt.name == "q8_0":
        values = _scale(xp, w, 0) * xp.ascontiguousarray(w[..., 2:]).view(xp.int8).astype(xp.float32)
    elif fmt.name == "q4_0":
        values = _scale(xp, w, 0) * (_nibbles(xp, w[..., 2:]) - 8.0)
    elif fmt.name == "q4_1":
        values = _scale(xp, w, 0) * _nibbles(xp, w[..., 4:]) + _scale(xp, w, 2)
    else:
        raise ShapeError(f"no dequantization for {fmt.name}")
    return values.reshape(w.shape[0], w.shape[1] * fmt.block)


def qmatmul(xp, inputs, params, out=None):
    xb, w = inputs
    fmt = FORMATS[params["format"]]
    n, width = w.shape[0], w.shape[2] * fmt.block
    out = xp.empty(xb.shape[:-2] + (n,), xp.float32) if out is None else out
    if not width or not n or not out.size:
        out[...] = 0
        return out
    x = xb.reshape(-1, width)
    flat = out.reshape(-1, n)
    rows = max(1, TILE_BYTES // (4 * width))
    for start in range(0, n, rows):
        tile = dequantize(xp, w[start : start + rows], fmt)
        flat[:, start : start + tile.shape[0]] = x @ tile.T
    return out


def qget_rows(xp, inputs, params, out=None):
    table, ids = inputs
    fmt = FORMATS[params["format"]]

    def read(rows):
        return dequantize(xp, rows, fmt)

    return look_up_rows(xp, "qget_rows", table, ids, params, out, table.shape[2] * fmt.block, xp.float32, read)


KERNELS = {"qmatmul": qmatmul, "qget_rows": qget_rows}
