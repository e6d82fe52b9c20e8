"""ggml's legacy 32-value blocks as the integer products read them: each value's quant as an
unsigned byte row (one byte of each lane), in IR (workers/backends/cpu/vector_ir.py).

`row(p)` is the block's byte p of every lane (<lanes x i8>). Nibble j of the 16 quant bytes:
the low half of byte j is value j, the high half value j + 16. q5's fifth bit of value j is bit
j of the little-endian 32-bit word before the nibbles. q8_0's int8 quants become unsigned by
adding 128 (the product's sum then subtracts 128 times the activation's block sum, as q4_0's
subtracts 8 and q5_0's 16: `bias` in the format table).
"""

from __future__ import annotations

from llvmlite import ir

from workers.backends.cpu.vector_ir import I8, I32, byte_splat, nibble_of, vector


def nibble(builder, row, first: int, v: int):
    """Value v (0..31) of a nibble block whose quant bytes begin at byte `first`: 0..15."""
    byte = row(first + v % 16)
    lanes = byte.type.count
    if v >= 16:
        byte = builder.lshr(byte, byte_splat(4, lanes))
    return builder.and_(byte, byte_splat(15, lanes))


def fifth_bit_nibble(builder, row, word: int, v: int):
    """Value v of a q5 block (0..31): its nibble (bytes from word + 4) and 16 times bit v of the
    word at byte `word`."""
    low = nibble(builder, row, word + 4, v)
    bits = row(word + v // 8)
    lanes = bits.type.count
    bit = builder.and_(builder.lshr(bits, byte_splat(v % 8, lanes)), byte_splat(1, lanes))
    return builder.or_(low, builder.shl(bit, byte_splat(4, lanes)))


def q4_0(builder, row, v):
    return nibble(builder, row, 2, v)


def q4_1(builder, row, v):
    return nibble(builder, row, 4, v)


def q5_0(builder, row, v):
    return fifth_bit_nibble(builder, row, 2, v)


def q5_1(builder, row, v):
    return fifth_bit_nibble(builder, row, 4, v)


def q8_0(builder, row, v):
    quant = row(2 + v)
    return builder.xor(quant, byte_splat(0x80, quant.type.count))  # int8 q as the byte q + 128


# Where the packed formats' values lie in a weight packed at load (formats.Packed, packing.py):
# values v .. v + 3 (v a multiple of 4) of every lane are one piece of the four byte rows from p,
# made with the same byte operations as from the rows.


def nibble_sources(first: int):
    """The byte rows p (as (p,)) whose four bytes hold values v .. v + 3 of a nibble block whose
    quant bytes begin at `first`: low halves for v < 16, high halves for the rest."""
    return lambda v: (first + v % 16,)


def nibble_piece(builder, pieces, v):
    return nibble_of(builder, pieces[0], v % 32 >= 16)


def fifth_bit_sources(word: int, first: int):
    """A q5 block's sources: values v .. v + 3 from (the fifth bits' word, packed as one four:
    each lane's word as in the file; their nibbles' bytes from `first`)."""
    return lambda v: (word, first + v % 16)


def fifth_bit_piece(builder, pieces, v):
    """Values v .. v + 3 of a q5 block from its fifth bits' and nibbles' pieces: the nibble and,
    as bit 4 of byte k, bit v + k of the lane's word. Those four bits lie in one byte of the
    word, v // 8: a shuffle puts it in each of the lane's four bytes, which keep one bit each
    (bit v % 8 + k of byte k) and make it 16 by a comparison: four instructions a vector
    (vpshufb, vpand, vpcmpeqb, vpand), where from rows each value row took five and each four
    a transpose of 16 shuffles."""
    top, low = pieces
    low = nibble_of(builder, low, v % 32 >= 16)
    count = low.type.count * low.type.element.width // 8
    bytes_ = vector(I8, count)
    spread = builder.shuffle_vector(
        builder.bitcast(top, bytes_),
        ir.Constant(bytes_, ir.Undefined),
        ir.Constant(vector(I32, count), [i - i % 4 + v // 8 for i in range(count)]),
    )
    bits = ir.Constant(bytes_, [1 << (v % 8 + i % 4) for i in range(count)])
    taken = builder.icmp_unsigned("==", builder.and_(spread, bits), bits)
    fifth = builder.select(taken, byte_splat(16, count), byte_splat(0, count))
    return builder.or_(low, builder.bitcast(fifth, low.type))


def q8_0_piece(builder, pieces, v):
    (piece,) = pieces
    bytes_ = vector(I8, piece.type.count * piece.type.element.width // 8)
    flipped = builder.xor(builder.bitcast(piece, bytes_), byte_splat(0x80, bytes_.count))
    return builder.bitcast(flipped, piece.type)
