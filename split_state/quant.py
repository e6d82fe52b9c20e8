"""Block-quantized weights as ggml stores them (GGUF): the formats the workers compute on
without widening them to float32.

A quantized matrix of `rows` x `cols` values is a uint8 array (rows, cols // block, block_bytes):
row r, block b holds values [b * block, (b + 1) * block) of that row in the file's own bytes.
Split states of such a weight are over that array, so a split of the block axis is a split of
the values on block boundaries, and a split of the rows splits whole rows (any extents).
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


def quant_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ShapeError(f"unknown quantized format {name!r}; known: {', '.join(FORMATS)}") from None
