"""Block-quantized weights as ggml stores them (GGUF): the formats the workers compute on
without widening them to float32.

A GGUF file holds a quantized matrix of `rows` x `cols` values as (rows, cols // block,
block_bytes) uint8: row r, block b holds values [b * block, (b + 1) * block) of that row. The
workers keep the same bytes planar, (rows, block_bytes, blocks): byte p of block b of row r at
[r, p, b], the file's array with its last two axes swapped (`planar`). Memory is the file's size;
what changes is that byte p of every block of a row lies contiguous, so a kernel's innermost
loop runs over blocks and vectorizes (llama.cpp repacks its CPU weights for the same reason).
Split states of such a weight are over the planar array, so a split of the block axis (2) is a
split of the values on block boundaries, and a split of the rows splits whole rows (any extents).
"""

from __future__ import annotations

from dataclasses import dataclass

from split_state.errors import ShapeError


@dataclass(frozen=True)
class QuantFormat:
    name: str  # ggml's type name, lower case
    block: int  # values per block
    block_bytes: int  # bytes per block


# ggml's legacy formats, each block a float16 scale (and for q4_1 a float16 minimum) then the
# quants: q4_0 value = d * (nibble - 8); q4_1 value = d * nibble + m; q8_0 value = d * int8.
# Nibble j of a block's 16 bytes: the low half of byte j is value j, the high half value j + 16.
FORMATS = {
    "q4_0": QuantFormat("q4_0", 32, 18),
    "q4_1": QuantFormat("q4_1", 32, 20),
    "q8_0": QuantFormat("q8_0", 32, 34),
}


def planar(blocks):
    """The file's (rows, blocks, block_bytes) as the workers' (rows, block_bytes, blocks): a view,
    made contiguous where it is sent."""
    return blocks.swapaxes(-1, -2)


def quant_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ShapeError(f"unknown quantized format {name!r}; known: {', '.join(FORMATS)}") from None
