"""Kernels on block-quantized weights (split_state/quant.py), written once against `xp`.

Weights are interleaved, (groups, blocks, block_bytes, lanes). `qmatmul` dequantizes the weight
a tile of row groups at a time into a small float32 buffer and hands each tile to the BLAS
matmul, so no float32 copy of the whole weight ever exists; the CPU backend overrides it with
numba loops that read the blocks directly for a few rows of x (decode), see
workers/backends/cpu/numba_cpu.py. `qget_rows` dequantizes only the rows it looks up.
"""

from __future__ import annotations

from collections.abc import Callable

from split_state.errors import ShapeError
from split_state.quant import FORMATS, QuantFormat, file_order
from workers.kernels.basic import look_up_rows

# float32 bytes of one dequantized tile of rows: 2 MiB against 1 on the 2-vCPU VM, 128-token
# prefill, 1 worker: the 1.7B-shaped file 41-44 against 38-40 tok/s on 2 threads, 28.3-28.8 against
# 27.2-27.8 on 1; SmolLM2 530-540 against 500-510 on 2 threads, the same on 1 (BLAS splits a
# tile's columns over its threads: 128 columns of a 2,048-wide weight left each too few)
TILE_BYTES = 2 << 20


def _scale(xp, w, at: int):
    """The float16 at bytes [at, at + 2) of every block, as float32 (rows, blocks, 1)."""
    return xp.ascontiguousarray(w[..., at : at + 2]).view(xp.float16).astype(xp.float32)


def _nibbles(xp, qs):
    """16 bytes of packed 4-bit values -> 32 values: low halves are values 0-15, high 16-31."""
    return xp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(xp.float32)


def values(xp, w, fmt: QuantFormat):
    """Rows in the file's order, (rows, blocks, block_bytes) uint8 -> (rows, blocks * block)
    float32."""
    if fmt.name == "q8_0":
        out = _scale(xp, w, 0) * xp.ascontiguousarray(w[..., 2:]).view(xp.int8).astype(xp.float32)
    elif fmt.name == "q4_0":
        out = _scale(xp, w, 0) * (_nibbles(xp, w[..., 2:]) - 8.0)
    elif fmt.name == "q4_1":
        out = _scale(xp, w, 0) * _nibbles(xp, w[..., 4:]) + _scale(xp, w, 2)
    elif fmt.name == "bf16":  # the top half of a float32
        out = (xp.ascontiguousarray(w).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    elif fmt.name in ("q5_0", "q5_1"):
        out = _q5(xp, w, fmt.name == "q5_1")
    elif fmt.name in ("q4_k", "q5_k"):
        out = _k_nibbles(xp, w, fmt.name == "q5_k")
    elif fmt.name == "q6_k":
        out = _q6_k(xp, w)
    else:
        raise ShapeError(f"no dequantization for {fmt.name}")
    return out.reshape(w.shape[0], w.shape[1] * fmt.block)


def _q5(xp, w, with_min: bool):
    """The 32 fifth bits: bit j of the little-endian word after the factors belongs to value j."""
    at = 4 if with_min else 2
    word = w[..., at : at + 4]
    bits = (word[..., None] >> xp.arange(8, dtype=xp.uint8)) & 1  # (rows, blocks, byte, bit)
    q = _nibbles(xp, w[..., at + 4 :]) + 16 * bits.reshape(w.shape[:2] + (32,)).astype(xp.float32)
    if with_min:
        return _scale(xp, w, 0) * q + _scale(xp, w, 2)
    return _scale(xp, w, 0) * (q - 16.0)


def k4_scales(xp, s):
    """Q4_K's 12 scale bytes (..., 12) -> the 8 sub-blocks' six-bit scales and minimums (..., 8):
    bytes 0-3 hold scales 0-3 in their low six bits, bytes 4-7 minimums 0-3; scales and
    minimums 4-7 take their low four bits from bytes 8-11 (low and high halves) and their top two
    from the top bits of bytes 0-3 and 4-7."""
    low, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = xp.concatenate([low & 63, (top & 15) | ((low >> 6) << 4)], axis=-1)
    mins = xp.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales.astype(xp.float32), mins.astype(xp.float32)


def _k_nibbles(xp, w, fifth: bool):
    """Q4_K, and Q5_K (`fifth`): sub-block s holds values [32 s, 32 s + 32); 64-value chunk c
    keeps sub-block 2c in the low halves of its 32 quant bytes and 2c + 1 in their high halves.
    Q5_K's 32 bytes before the quants add 16 * bit s of byte j to value 32 s + j."""
    rows, blocks = w.shape[:2]
    scales, mins = k4_scales(xp, w[..., 4:16])
    first = 48 if fifth else 16
    qs = w[..., first : first + 128].reshape(rows, blocks, 4, 1, 32)
    q = xp.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, blocks, 8, 32).astype(xp.float32)
    if fifth:
        bits = (w[..., None, 16:48] >> xp.arange(8, dtype=xp.uint8)[:, None]) & 1  # (rows, blocks, s, j)
        q = q + 16 * bits.astype(xp.float32)
    d, dmin = _scale(xp, w, 0) * scales, _scale(xp, w, 2) * mins
    return d[..., None] * q - dmin[..., None]


def _q6_k(xp, w):
    """In half h of a block (128 values), 32-value chunk k takes its low four bits from bytes
    [64h, 64h + 64) of ql (the low halves for k = 0, 1, the high halves for k = 2, 3, byte
    32 (k % 2) + l for value l) and its top two from bits 2k, 2k + 1 of qh byte 32h + l."""
    rows, blocks = w.shape[:2]
    ql = w[..., 0:128].reshape(rows, blocks, 2, 1, 64)
    low = xp.concatenate([ql & 15, ql >> 4], axis=3).reshape(rows, blocks, 2, 4, 32)
    qh = w[..., 128:192].reshape(rows, blocks, 2, 1, 32)
    top = xp.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=3)
    q = (low | (top << 4)).astype(xp.float32) - 32
    d = _scale(xp, w, 208) * xp.ascontiguousarray(w[..., 192:208]).view(xp.int8).astype(xp.float32)
    return d[..., None] * q.reshape(rows, blocks, 16, 16)


def dequantize(xp, w, fmt: QuantFormat):
    """Interleaved (groups, blocks, block_bytes, lanes) uint8 -> (groups * lanes, blocks * block)
    float32, row g * lanes + l of the weight at [g * lanes + l]."""
    return values(xp, file_order(w), fmt)


def qmatmul_with(product: Callable, dequantized: Callable | None = None, tile_bytes: int = 0) -> Callable:
    """The qmatmul kernel whose tiles' products are `product(xp, x, tile, out)`: out (a column
    slice of the result) = x @ tile, tile a dequantized (width, rows) transposed view of at most
    `tile_bytes` (by default TILE_BYTES), each made by `dequantized(xp, w tile, fmt)` (by default
    `dequantize`). A backend gives its own (the CUDA backend's products can be captured in a
    device graph, its tiles made by a kernel of its own, larger: a launch costs more there than
    the memory)."""
    dequantized = dequantized or dequantize

    def qmatmul(xp, inputs, params, out=None):
        xb, w = inputs
        fmt = FORMATS[params["format"]]
        groups, lanes, width = w.shape[0], w.shape[3], w.shape[1] * fmt.block
        n = groups * lanes
        out = xp.empty(xb.shape[:-2] + (groups, lanes), xp.float32) if out is None else out
        if not width or not n or not out.size:
            out[...] = 0
            return out
        x = xb.reshape(-1, width)
        flat = out.reshape(-1, n)
        tile = max(1, (tile_bytes or TILE_BYTES) // (4 * width * lanes))  # groups a tile
        for start in range(0, groups, tile):
            part = dequantized(xp, w[start : start + tile], fmt)
            product(xp, x, part.T, flat[:, start * lanes : start * lanes + part.shape[0]])
        return out

    return qmatmul


def tile_product(xp, x, tile, out) -> None:
    out[...] = x @ tile


qmatmul = qmatmul_with(tile_product)


def qget_rows(xp, inputs, params, out=None):
    table, ids = inputs
    fmt = FORMATS[params["format"]]
    lanes = table.shape[3]

    def read(rows):  # rows of the table (local ids): from their groups' lanes, in the file's order
        return values(xp, table[rows // lanes, :, :, rows % lanes], fmt)

    return look_up_rows(xp, "qget_rows", None, ids, params, out, table.shape[1] * fmt.block, xp.float32, read)


KERNELS = {"qmatmul": qmatmul, "qget_rows": qget_rows}
