"""Block-quantized weights as ggml stores them (GGUF): the formats the workers compute on
without widening them to float32.

A GGUF file holds a quantized matrix of `rows` x `cols` values as (rows, cols // block,
block_bytes) uint8: row r, block b holds values [b * block, (b + 1) * block) of that row. The
workers keep the same bytes with rows interleaved by `lanes` (`interleave`): (rows / lanes,
blocks, block_bytes, lanes), byte p of block b of row g * lanes + l at [g, b, p, l]. Memory is the
file's size; what changes is that one byte of `lanes` consecutive rows lies contiguous, so a
kernel's innermost loop runs over rows with one value of x for all of them and vectorizes with
no remainder (llama.cpp interleaves its CPU weights for the same reason). Measured on SmolLM2's
30 Q4_1 layers and Q8_0 head, one AVX-512 core, one token: 14.5 ms with 64 lanes against 31.0 ms
for the layout it replaced (byte p of every block of a row contiguous, an inner loop over a
row's 18 blocks). (A CPU worker's integer products go one step further, in its own memory:
each four quant rows of a block of 64 lanes packed as 64 lanes of four bytes, in place, at the
first product: workers/backends/cpu/packing.py. What is sent and split is this layout.)

Split states of such a weight are over the interleaved array: a split of axis 0 splits whole
groups of `lanes` rows, a split of axis 1 the values on block boundaries. `lanes_for` picks the
most lanes that every extent of a split of the rows is a multiple of (one lane is the file's
own order), so any split works, and the common ones (whole heads, even FFN shares) get the most.
"""

from __future__ import annotations

from dataclasses import dataclass

from split_state.errors import ShapeError


@dataclass(frozen=True)
class QuantFormat:
    name: str  # ggml's type name, lower case
    block: int  # values per block
    block_bytes: int  # bytes per block
    factors: tuple[int, ...] = (0,)  # where the block's float16 factors (d, m or dmin) begin
    lanes: int = 64  # the most rows the workers interleave (MAX_LANES)


# ggml's legacy formats, each block a float16 scale (and for q4_1, q5_1 a float16 minimum) then
# the quants: q4_0 value = d * (nibble - 8); q4_1 value = d * nibble + m; q8_0 value = d * int8;
# q5_0 value = d * (q - 16), q5_1 value = d * q + m, q = nibble + 16 * bit j of a little-endian
# 32-bit word before the nibbles. Nibble j of a block's 16 bytes: the low half of byte j is
# value j, the high half value j + 16.
# ggml's K-quants, 256-value super-blocks of 16 or 32-value sub-blocks: q4_k value = d * scale *
# nibble - dmin * min (float16 d and dmin, then 8 six-bit scales and minimums in 12 bytes, then
# 128 bytes of nibbles); q5_k the same with a fifth bit per value (32 bytes before the nibbles);
# q6_k value = d * scale * (q - 32) (128 bytes of q's low four bits, 64 of
# its top two, 16 int8 scales, then float16 d). workers/kernels/quant.py spells out the orders.
FORMATS = {
    "q4_0": QuantFormat("q4_0", 32, 18),
    "q4_1": QuantFormat("q4_1", 32, 20, (0, 2)),
    "q8_0": QuantFormat("q8_0", 32, 34),
    "q5_0": QuantFormat("q5_0", 32, 22),
    "q5_1": QuantFormat("q5_1", 32, 24, (0, 2)),
    "q4_k": QuantFormat("q4_k", 256, 144, (0, 2)),
    "q5_k": QuantFormat("q5_k", 256, 176, (0, 2)),
    "q6_k": QuantFormat("q6_k", 256, 210, (208,)),
    # bfloat16, a value a "block": rows stay whole (one lane), widened a tile of rows at a time by
    # NumPy (a shift) for BLAS. F16 is not kept: neither NumPy nor numba widens float16 with
    # vector instructions here, and a 576 x 1536 product took 2-7x float32's (measured on a 2-vCPU VM)
    "bf16": QuantFormat("bf16", 1, 2, (), 1),
}


MAX_LANES = 64  # rows interleaved at most: 64 float32 accumulators, four AVX-512 registers


def lanes_for(extents, most: int = MAX_LANES) -> int:
    """The most lanes (a power of two up to `most`) that divide every row extent."""
    lanes = most
    while lanes > 1 and any(e % lanes for e in extents):
        lanes //= 2
    return lanes


def interleave(blocks, lanes: int):
    """The file's (rows, blocks, block_bytes) as the workers' (rows / lanes, blocks, block_bytes,
    lanes): a view (of a contiguous array), made contiguous where each device's slice is sent,
    so the coordinator never holds a second copy of a weight."""
    rows, count, size = blocks.shape
    if rows % lanes:
        raise ShapeError(f"{rows} rows do not interleave by {lanes}")
    return blocks.reshape(rows // lanes, lanes, count, size).transpose(0, 2, 3, 1)


def file_order(w):
    """The workers' interleaved (groups, blocks, block_bytes, lanes) back in the file's order,
    (rows, blocks, block_bytes): a copy (a view where lanes is 1). Works for NumPy and CuPy."""
    groups, count, size, lanes = w.shape
    return w.transpose(0, 3, 1, 2).reshape(groups * lanes, count, size)


def quant_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ShapeError(f"unknown quantized format {name!r}; known: {', '.join(FORMATS)}") from None
