"""ggml's K-quants (256-value super-blocks) as the integer products read them, in IR: each
value's quant as an unsigned byte row, and each sub-block's integer scale (and minimum) per lane.
The orders are workers/kernels/quant.py's (and ggml's): `row(p)` is byte p of the block, of
every lane.

- q4_k: bytes 0-3 float16 d and dmin, 4-15 eight 6-bit scales and minimums, 16-143 nibbles:
  chunk c (32 bytes from 16 + 32 c), byte j: low half value 64 c + j, high half 64 c + 32 + j.
  Sub-block s is values 32 s ..; value = d * scale_s * q - dmin * min_s.
- q5_k: the same, the nibbles from byte 48, and the fifth bit of value 32 s + j bit s of byte 16 + j.
- q6_k: 128 bytes of low four bits, 64 of top two, 16 int8 scales (byte 192 + s for the 16-value
  sub-block s), float16 d at 208; value = d * scale_s * (q - 32) (`q6_k` says where each q lies).
"""

from __future__ import annotations

from workers.backends.cpu.vector_ir import I8, I32, byte_splat, nibble_of, vector


def _k_quant(builder, row, first: int, fifth_at: int | None, v: int):
    chunk, within = divmod(v, 64)
    byte = row(first + 32 * chunk + within % 32)
    lanes = byte.type.count
    if within >= 32:
        byte = builder.lshr(byte, byte_splat(4, lanes))
    q = builder.and_(byte, byte_splat(15, lanes))
    if fifth_at is None:
        return q
    sub = v // 32  # its fifth bit: bit `sub` of byte fifth_at + j
    bits = row(fifth_at + within % 32)
    bit = builder.and_(builder.lshr(bits, byte_splat(sub, lanes)), byte_splat(1, lanes))
    return builder.or_(q, builder.shl(bit, byte_splat(4, lanes)))


def q4_k(builder, row, v):
    return q4_k_transposed(builder, [row(p) for p in q4_k_sources(v)], v)


def q5_k(builder, row, v):
    return _k_quant(builder, row, 48, 16, v)


def q6_k(builder, row, v):
    """Value v: half h = v // 128; at = v % 32; quarter i = (v % 128) // 32 takes the low (i 0, 1)
    or high (i 2, 3) nibble of ql byte 64 h + at (i even) or 64 h + 32 + at (i odd), and bits
    2 i, 2 i + 1 of qh byte 128 + 32 h + at as its top two (q6_k_sources, q6_k_transposed)."""
    return q6_k_transposed(builder, [row(p) for p in q6_k_sources(v)], v)


def _k4_scale_bytes(builder, row, s: int):
    """(scale, min) of sub-block s (0..7) of a q4_k / q5_k block as <lanes x i8>, 6 bits each:
    s < 4 the low six bits of bytes 4 + s and 8 + s; else the nibbles of byte 8 + s with the top
    two bits of bytes s and s + 4 above them."""
    lanes = row(4).type.count
    six, four, fifteen = byte_splat(63, lanes), byte_splat(4, lanes), byte_splat(15, lanes)
    if s < 4:
        return builder.and_(row(4 + s), six), builder.and_(row(8 + s), six)
    both = row(8 + s)
    high_scale = builder.shl(builder.lshr(row(4 + s - 4), byte_splat(6, lanes)), four)
    high_min = builder.shl(builder.lshr(row(4 + s), byte_splat(6, lanes)), four)
    scale = builder.or_(builder.and_(both, fifteen), high_scale)
    minimum = builder.or_(builder.lshr(both, four), high_min)
    return scale, minimum


def k4_scales(builder, row, s: int):
    """Sub-block s's (scale, min) of q4_k and q5_k as <lanes x i32>."""
    scale, minimum = _k4_scale_bytes(builder, row, s)
    wide = vector(I32, scale.type.count)
    return builder.zext(scale, wide), builder.zext(minimum, wide)


def q6_k_scales(builder, row, s: int):
    """q6_k's signed scale of sub-block s as <lanes x i32>, and no minimum."""
    scale = row(192 + s)
    return builder.sext(scale, vector(I32, scale.type.count)), None


# Where q4_k's and q6_k's values come from and how they are made from those bytes: the value code
# above reads the byte rows as they are; the one-row products pass them transposed
# (formats.Transposed), the same byte operations on every piece.
# q4_k's sub-blocks 2c and 2c + 1 are the low and high halves of chunk c's bytes: one pass a chunk
# took q4_k's one-row product from 113-116 to 102 us (4,096 x 2,048, one thread). q6_k's
# sub-blocks s and s + 4 (s 0-3 and 8-11) are the low and high halves of the same ql bytes, and
# their top two bits come from the same qh bytes: in pairs, its one-row product from L3 (2,048 x
# 2,048, one thread) took 380-398 against 449-457 ns a super-block (made and transposed a four
# at a time); in fours (s, s + 2, s + 4, s + 6, each qh byte transposed once) 387, its 16
# accumulators spilling (2026-11-29).
Q4_K_PASSES = ((0, 1), (2, 3), (4, 5), (6, 7))
Q6_K_PASSES = ((0, 4), (2, 6), (1, 5), (3, 7), (8, 12), (10, 14), (9, 13), (11, 15))


def q4_k_sources(v: int) -> tuple[int]:
    """The bytes p .. p + 3 whose low (within a chunk, values 0-31) or high halves (32-63) are
    q4_k's values v .. v + 3 (v a multiple of 4), as (p,)."""
    chunk, within = divmod(v, 64)
    return (16 + 32 * chunk + within % 32,)


def q4_k_transposed(builder, pieces, v):
    """Values v .. v + 3 (or value v) from their bytes' piece (transposed, or a row as read)."""
    return nibble_of(builder, pieces[0], v % 64 >= 32)


def q5_k_sources(v: int) -> tuple[int, int]:
    """q5_k's values v .. v + 3 from (their fifth bits' bytes, their nibbles' bytes)."""
    chunk, within = divmod(v, 64)
    return 16 + within % 32, 48 + 32 * chunk + within % 32


def q5_k_transposed(builder, pieces, v):
    """Values v .. v + 3 from their fifth bits' and nibbles' pieces: the nibble, and bit v // 32
    of the fifth bits' byte as its bit 4."""
    top, low = pieces
    low = nibble_of(builder, low, v % 64 >= 32)
    bytes_ = vector(I8, low.type.count * low.type.element.width // 8)
    bit = builder.and_(
        builder.lshr(builder.bitcast(top, bytes_), byte_splat(v // 32, bytes_.count)), byte_splat(1, bytes_.count)
    )
    return builder.or_(low, builder.bitcast(builder.shl(bit, byte_splat(4, bytes_.count)), low.type))


def q6_k_sources(v: int) -> tuple[int, int]:
    """q6_k's values v .. v + 3 from (their qh bytes, their ql bytes), as `q6_k` reads them."""
    half, rest = divmod(v, 128)
    quarter, at = divmod(rest, 32)
    return 128 + 32 * half + at, 64 * half + 32 * (quarter % 2) + at


def q6_k_transposed(builder, pieces, v):
    """Values v .. v + 3 (or value v) from their qh and ql pieces (transposed, or rows as read):
    the nibble, and bits 2 quarter, 2 quarter + 1 of the qh byte above it."""
    top, low = pieces
    quarter = v % 128 // 32
    low = nibble_of(builder, low, quarter >= 2)
    bytes_ = vector(I8, low.type.count * low.type.element.width // 8)
    top = builder.lshr(builder.bitcast(top, bytes_), byte_splat(2 * quarter, bytes_.count))
    top = builder.shl(builder.and_(top, byte_splat(3, bytes_.count)), byte_splat(4, bytes_.count))
    return builder.or_(low, builder.bitcast(top, low.type))


# Sub-blocks whose code is a template's with its byte rows moved (formats.Repeated), a class a
# template. q4_k: sub-block s is the low (s even) or high half of chunk s // 2's nibbles, and its
# scale and minimum come from bytes 4 + s and 8 + s (s < 4) or s, 4 + s and 8 + s: s and s + 2
# differ by 32 nibble rows and 2 scale rows. q6_k: sub-block s = 8 h + 2 quarter + j reads ql
# rows 64 h + 32 (quarter % 2) + 16 j .., qh rows 128 + 32 h + 16 j .. and scale row 192 + s: the
# same quarter's sub-blocks differ only in where those rows start.
Q4_K_REGIONS = (4, 16, 144)  # scales and minimums, nibbles
Q4_K_CLASSES = ((0, 2), (1, 3), (4, 6), (5, 7))
Q6_K_REGIONS = (0, 128, 192, 208)  # ql, qh, scales
Q6_K_CLASSES = ((0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15))


def q4_k_moves(template: int, s: int) -> tuple[int, ...]:
    return s - template, 16 * (s - template)


def q6_k_moves(template: int, s: int) -> tuple[int, ...]:
    half, j = divmod(s - template, 8)
    return 64 * half + 16 * j, 32 * half + 16 * j, s - template
