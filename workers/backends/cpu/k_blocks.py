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

from workers.backends.cpu.vector_ir import I32, byte_splat, vector


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


def q4_k_source(v: int) -> tuple[int, bool]:
    """Where q4_k's values v .. v + 3 (v a multiple of 4) lie: the low (False) or high (True)
    halves of bytes p .. p + 3, as (p, high)."""
    chunk, within = divmod(v, 64)
    return 16 + 32 * chunk + within % 32, within >= 32


def q4_k(builder, row, v):
    return _k_quant(builder, row, 16, None, v)


def q5_k(builder, row, v):
    return _k_quant(builder, row, 48, 16, v)


def q6_k(builder, row, v):
    """Value v: half h = v // 128; at = v % 32; quarter i = (v % 128) // 32 takes the low (i 0, 1)
    or high (i 2, 3) nibble of ql byte 64 h + at (i even) or 64 h + 32 + at (i odd), and bits
    2 i, 2 i + 1 of qh byte 128 + 32 h + at as its top two."""
    half, rest = divmod(v, 128)
    quarter, at = divmod(rest, 32)
    low = row(64 * half + 32 * (quarter % 2) + at)
    lanes = low.type.count
    if quarter >= 2:
        low = builder.lshr(low, byte_splat(4, lanes))
    low = builder.and_(low, byte_splat(15, lanes))
    top = builder.lshr(row(128 + 32 * half + at), byte_splat(2 * quarter, lanes))
    top = builder.and_(top, byte_splat(3, lanes))
    return builder.or_(low, builder.shl(top, byte_splat(4, lanes)))


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
