"""LLVM vector code for the integer products (workers/backends/cpu/int8_products.py), written
with llvmlite's IR builder inside numba intrinsics: numba's own integer arithmetic widens every
byte to a 64-bit lane, a sixteenth of a vector, so 8-bit products written as numba loops are no
faster than float32 ones. Here a weight's byte row (one byte of each of `lanes` rows, the
workers' interleaved layout, split_state/quant.py) is one <lanes x i8> value.

Three instruction sets, chosen once from the CPU's features (`ISA`), and a fourth for one format:
- VNNI: AVX-512 with VNNI (`vpdpbusd`: sixteen sums of four u8 x s8 products into int32 in one
  instruction). Four value rows of a block are transposed in registers so that each 32-bit lane
  holds one weight row's four consecutive quants (byte permutes, vpermt2b where the CPU has
  VBMI, then in-lane interleaves), then one vpdpbusd per 16 rows adds them times the
  activation's four int8 values.
- AVX2: VNNI's layout (four quants of a row a 32-bit element, the rows in AVX2_ORDER), each
  vpdpbusd done as llama.cpp's AVX2 code does its products: vpmaddubsw (pairs of u8 x s8
  products summed into int16) then vpmaddwd by ones (pairs of those into int32), on 256-bit
  halves. The int16 pair sums saturate past 32,767:
  exact for quants of up to 7 bits (127 x 128 x 2), so q8_0's 8-bit quants take AVX2_SIGNED
  (`for_format`).
- AVX2_SIGNED: AVX2 for q8_0, whose biased quants (q + 128) would saturate the pair sums: the
  quant's sign moved onto the activation (vpsignb), its magnitude multiplied (vpabsb), no bias.
- GENERIC: plain LLVM vector IR (widen, multiply, add in 32 bits) that any CPU LLVM targets
  runs (x86-64 without AVX2, Arm), each value row times one activation value.
All give the same int32 sums: integer arithmetic, no rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import binding, ir

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
GENERIC, VNNI, AVX2, AVX2_SIGNED = 0, 1, 2, 3
ISA_NAMES = {GENERIC: "generic", VNNI: "avx512-vnni", AVX2: "avx2", AVX2_SIGNED: "avx2-signed"}
AVX2_FAMILY = (AVX2, AVX2_SIGNED)
CHUNK = 16  # rows per 512-bit vector of int32 sums
AVX2_PAIR_BITS = 7  # the widest quant whose u8 x s8 pair sums fit vpmaddubsw's int16


def host_isa() -> int:
    """VNNI where the CPU has AVX-512 VNNI and BW (Intel since Cascade Lake, AMD since Zen 4),
    else AVX2 where it has AVX2 (x86-64 since Haswell and Zen 1), else GENERIC."""
    features = binding.get_host_cpu_features()
    if features.get("avx512vnni") and features.get("avx512bw"):
        return VNNI
    return AVX2 if features.get("avx2") else GENERIC


ISA = host_isa()


def for_format(isa: int, bits: int) -> int:
    """The instruction set a format of `bits`-bit quants runs on: `isa`, but for AVX2, where the
    int16 pair sums of biased 8-bit quants (q8_0's q + 128) could saturate, AVX2_SIGNED: the
    quants taken as the int8 they are, as llama.cpp's AVX2 code takes q8_0's (vpsignb gives the
    activation the quant's sign, vpabsb the quant its magnitude: pairs of at most 128 x 127)."""
    return AVX2_SIGNED if isa == AVX2 and bits > AVX2_PAIR_BITS else isa


def unbiased(isa: int) -> bool:
    """Whether `isa` takes the quants as int8 (their bias taken off before the products)."""
    return isa == AVX2_SIGNED


def transposes(isa: int) -> bool:
    """Whether `isa` takes its value rows transposed (`transposed`: four quants of a row a lane)."""
    return isa != GENERIC


def vector(kind, count: int) -> ir.VectorType:
    return ir.VectorType(kind, count)


def splat(builder: ir.IRBuilder, value, count: int):
    """A <count x T> with every element `value` (a scalar of type T)."""
    kind = vector(value.type, count)
    first = builder.insert_element(ir.Constant(kind, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(first, ir.Constant(kind, ir.Undefined), ir.Constant(vector(I32, count), [0] * count))


def byte_splat(value: int, count: int) -> ir.Constant:
    return ir.Constant(vector(I8, count), [value & 0xFF] * count)


def load(builder: ir.IRBuilder, base, offset, kind):
    """The `kind` at byte `offset` (an i64 value) of the i8 pointer `base`, unaligned."""
    pointer = builder.gep(base, [offset])
    return builder.load(builder.bitcast(pointer, kind.as_pointer()), align=1)


class _VolatileLoad(ir.LoadInstr):
    def descr(self, buf):
        text = []
        super().descr(text)
        buf.append(text[0].replace("load ", "load volatile ", 1))


def load_once(builder: ir.IRBuilder, base, offset, kind):
    """load, but a volatile one: LLVM reads it where it stands and never merges it with another
    read of the same bytes. A K-quant block's sub-blocks read the same byte rows (low and high
    nibbles, the fifth bits of every sub-block); merged, each row stayed in a register from the
    first sub-block that read it to the last, and half the loop's vectors spilled to the stack.
    Read anew from L1 by each sub-block (the caller keeps one read per sub-block)."""
    pointer = builder.bitcast(builder.gep(base, [offset]), kind.as_pointer())
    instruction = _VolatileLoad(builder.block, pointer, typ=kind)
    instruction.align = 1
    builder._insert(instruction)
    return instruction


def prefetch(builder: ir.IRBuilder, base, offset) -> None:
    """Ask for the cache line at byte `offset` of `base` (a read) into L2: the blocks of a K-quant
    are 9-13 KiB, and streaming them with the hardware's prefetch alone ran at half the memory's
    speed once the weight outgrew the last-level cache. Into L1 (prefetcht0) the asks queued on
    L1's few miss buffers: the figures are int8_products.PREFETCH_BYTES'."""
    pointer = builder.gep(base, [offset])
    name = "llvm.prefetch.p0i8"
    function = builder.module.globals.get(name)
    if function is None:
        kind = ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
        function = ir.Function(builder.module, kind, name=name)
    # LLVM's locality 1: prefetcht2 (x86 brings it into L2, as prefetcht1 does)
    builder.call(function, [pointer, ir.Constant(I32, 0), ir.Constant(I32, 1), ir.Constant(I32, 1)])


def store(builder: ir.IRBuilder, value, base, offset) -> None:
    pointer = builder.gep(base, [offset])
    builder.store(value, builder.bitcast(pointer, value.type.as_pointer()), align=1)


def chunks(builder: ir.IRBuilder, value, isa: int) -> list:
    """A <lanes x i32> as the accumulators' pieces: VNNI's <16 x i32> chunks, GENERIC's whole."""
    lanes = value.type.count
    if not transposes(isa):
        return [value]
    undefined = ir.Constant(value.type, ir.Undefined)
    return [
        builder.shuffle_vector(value, undefined, ir.Constant(vector(I32, CHUNK), list(range(z, z + CHUNK))))
        for z in range(0, lanes, CHUNK)
    ]


def zeros(lanes: int, isa: int) -> list:
    if not transposes(isa):
        return [ir.Constant(vector(I32, lanes), [0] * lanes)]
    return [ir.Constant(vector(I32, CHUNK), [0] * CHUNK) for _ in range(lanes // CHUNK)]


def widen(builder: ir.IRBuilder, row, signed: bool, isa: int) -> list:
    """A <lanes x i8> row as int32 pieces (as `chunks`)."""
    wide = (builder.sext if signed else builder.zext)(row, vector(I32, row.type.count))
    return chunks(builder, wide, isa)


def _pairs_mask(lanes: int, half: int) -> ir.Constant:
    """Byte pairs (a_r, b_r) of two <64 x i8> rows (a | b concatenated), ordered so that the
    16-bit element j of 128-bit lane k is the pair of row 32 half + 4 k + j for j < 4, of row
    32 half + 16 + 4 k + j - 4 for j >= 4: what `transposed`'s second stage, an in-lane
    interleave of 16-bit elements, wants."""
    mask = []
    for k in range(4):
        for j in range(8):
            r = 32 * half + 4 * k + (j if j < 4 else 12 + j)
            mask += [r, lanes + r]
    return ir.Constant(vector(I32, len(mask)), mask)


def _interleave_words(builder: ir.IRBuilder, ab, cd, high: bool):
    """vpunpck{l,h}wd: in each 128-bit lane, ab's and cd's low (or high) four 16-bit elements
    interleaved."""
    count = ab.type.count // 2
    words = vector(ir.IntType(16), count)
    ab, cd = builder.bitcast(ab, words), builder.bitcast(cd, words)
    mask = []
    for k in range(count // 8):
        for j in range(4):
            at = 8 * k + j + (4 if high else 0)
            mask += [at, count + at]
    return builder.bitcast(
        builder.shuffle_vector(ab, cd, ir.Constant(vector(I32, count), mask)), vector(I32, count // 2)
    )


def _slice(builder: ir.IRBuilder, row, start: int, count: int):
    if start == 0 and count == row.type.count:
        return row
    return builder.shuffle_vector(row, row, ir.Constant(vector(I32, count), list(range(start, start + count))))


def transposed(builder: ir.IRBuilder, rows: list, isa: int = VNNI) -> list:
    """Four <lanes x i8> value rows (values v .. v + 3 of every lane; lanes a multiple of 64) as
    <16 x i32> pieces whose 32-bit elements each hold one lane's four values in order: with VNNI
    element r of piece z is lane 16 z + r (two byte permutes per pair of rows, vpermt2b with
    VBMI, put each row's pair where an in-lane interleave of 16-bit elements, vpunpck{l,h}wd,
    completes the four; done by permutes alone, vpermt2b then vpermt2w, a q4_k product took
    1.08x as long: 16,384 x 2,048, one thread, three alternating runs: 492-511 against 455-486
    us). With AVX2 the lanes come in AVX2_ORDER (`avx2_transposed`); `natural` puts sums of
    them back in order."""
    if isa in AVX2_FAMILY:
        return avx2_transposed(builder, rows)
    lanes = rows[0].type.count
    pieces = []
    for base in range(0, lanes, 64):
        a, b, c, d = (_slice(builder, row, base, 64) for row in rows)
        for half in range(2):
            mask = _pairs_mask(64, half)
            ab, cd = builder.shuffle_vector(a, b, mask), builder.shuffle_vector(c, d, mask)  # 32 rows' pairs
            pieces.append(_interleave_words(builder, ab, cd, False))  # rows 32 half + 0..15
            pieces.append(_interleave_words(builder, ab, cd, True))  # rows 32 half + 16..31
    return pieces


# The lane each 32-bit element of avx2_transposed's pieces holds, within each 32 lanes (two
# pieces): what in-lane interleaves of bytes then of 16-bit elements give without a lane-crossing
# permute after each (AVX2 has no vpermt2b; the order's vpermq fix-ups were 8 of a four's 24
# shuffles). Sums of the pieces are put in order once a sub-block (`natural`).
AVX2_ORDER = tuple(q + 4 * j + 16 * k for j in range(4) for k in range(2) for q in range(4))


def _in_lane(builder: ir.IRBuilder, a, b, high: bool):
    """vpunpck{l,h}bw on <32 x i8>: in each 128-bit lane, a's and b's low (or high) eight bytes
    interleaved."""
    mask = [16 * k + j + (8 if high else 0) + t * 32 for k in range(2) for j in range(8) for t in range(2)]
    return builder.shuffle_vector(a, b, ir.Constant(vector(I32, 32), mask))


def avx2_transposed(builder: ir.IRBuilder, rows: list) -> list:
    """`transposed` by AVX2's in-lane interleaves alone, each 32 lanes' two pieces in AVX2_ORDER."""
    lanes = rows[0].type.count
    pieces = []
    for base in range(0, lanes, 32):
        a, b, c, d = (_slice(builder, row, base, 32) for row in rows)
        quads = []
        for high in (False, True):
            ab, cd = _in_lane(builder, a, b, high), _in_lane(builder, c, d, high)
            quads += [_interleave_words(builder, ab, cd, False), _interleave_words(builder, ab, cd, True)]
        for first in (0, 2):
            both = ir.Constant(vector(I32, CHUNK), list(range(CHUNK)))
            pieces.append(builder.shuffle_vector(quads[first], quads[first + 1], both))
    return pieces


def natural(builder: ir.IRBuilder, pieces: list, isa: int) -> list:
    """Sums of `transposed` pieces with their lanes in order (AVX2's, from AVX2_ORDER; the
    others' are)."""
    if isa not in AVX2_FAMILY:
        return pieces
    where = {lane: e for e, lane in enumerate(AVX2_ORDER)}
    out = []
    for first in range(0, len(pieces), 2):
        a, b = pieces[first], pieces[first + 1]
        for z in (0, CHUNK):
            mask = ir.Constant(vector(I32, CHUNK), [where[z + r] for r in range(CHUNK)])
            out.append(builder.shuffle_vector(a, b, mask))
    return out


def nibble_of(builder: ir.IRBuilder, piece, high: bool):
    """The low (or, `high`, the high) half of each byte of `piece` (any integer vector), as bytes.
    The high halves by a shift of bytes, which is one instruction with GFNI (vgf2p8affineqb)
    where a shift of wider elements needs a mask after it: q4_k's one-row product from L3 (2,048
    x 2,048, one thread) took 194 against 253 ns a 64-row super-block (2026-11-29)."""
    kind = piece.type
    if high:
        byte_wise = vector(I8, kind.count * kind.element.width // 8)
        shifted = builder.lshr(builder.bitcast(piece, byte_wise), byte_splat(4, byte_wise.count))
        return builder.bitcast(shifted, kind)
    width = kind.element.width // 8
    return builder.and_(piece, ir.Constant(kind, [int("0f" * width, 16)] * kind.count))


def _vnni(builder: ir.IRBuilder, name: str, acc, a, b):
    kind = vector(I32, CHUNK)
    function = builder.module.globals.get(name)
    if function is None:
        function = ir.Function(builder.module, ir.FunctionType(kind, [kind, kind, kind]), name=name)
    return builder.call(function, [acc, a, b])


def _dpbusd(builder: ir.IRBuilder, acc, unsigned, signed):
    """acc (<16 x i32>) plus, in each 32-bit element, the four u8 of `unsigned` times the four
    s8 of `signed` (vpdpbusd)."""
    return _vnni(builder, "llvm.x86.avx512.vpdpbusd.512", acc, unsigned, signed)


@dataclass(frozen=True)
class Gathering:
    """AVX2's sums of one <16 x i32> piece: the int32 sums so far, and vpmaddubsw's int16 pair
    sums of the `count` fours since (None, 0: none), added in int16 until pair_limit's count is
    reached, then widened by one vpmaddwd by ones and added: where each four's pair sums were
    widened and added, a four of 64 lanes took 8 vpmaddwd and 8 additions more."""

    sums: ir.Value
    pairs: ir.Value | None = None  # <32 x i16>
    count: int = 0


def pair_limit(isa: int, bits: int) -> int:
    """How many fours of `bits`-bit quants AVX2 adds in int16 before widening: each vpmaddubsw
    element is two products of at most (2**bits - 1) x 128, so 8 fours of 4-bit quants, 4 of
    5-bit, 2 of 6-bit, 1 of 7-bit stay within 32,767 (no saturation: the same integers). 1 for
    the others (no int16 step)."""
    if isa != AVX2:  # (AVX2_SIGNED's pairs reach 32,512: one four)
        return 1
    return max(1, 32767 // (2 * (2**bits - 1) * 128))


def _pair_sums(builder: ir.IRBuilder, unsigned, signed):
    """vpmaddubsw on the two 256-bit halves of <16 x i32> pieces, as <32 x i16>."""
    bytes_ = vector(I8, 32)
    halves = []
    for z in (0, 8):
        u, sg = (builder.bitcast(_slice(builder, v, z, 8), bytes_) for v in (unsigned, signed))
        halves.append(_x86(builder, "llvm.x86.avx2.pmadd.ub.sw", vector(I16, 16), [u, sg]))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(vector(I32, 32), list(range(32))))


def _widened(builder: ir.IRBuilder, sums, pairs):
    """sums (<16 x i32>) plus each 32-bit element's two int16 pair sums of `pairs` (vpmaddwd by ones)."""
    ones = ir.Constant(vector(I16, 16), [1] * 16)
    halves = [
        _x86(builder, "llvm.x86.avx2.pmadd.wd", vector(I32, 8), [_slice(builder, pairs, z, 16), ones]) for z in (0, 16)
    ]
    both = builder.shuffle_vector(halves[0], halves[1], ir.Constant(vector(I32, CHUNK), list(range(CHUNK))))
    return builder.add(sums, both)


def _gather(builder: ir.IRBuilder, acc, unsigned, signed, limit: int, isa: int = AVX2) -> Gathering:
    """acc (a Gathering, or int32 sums to start one) plus the four u8 of `unsigned` times the
    four s8 of `signed` in each 32-bit element: vpdpbusd's sums by AVX2 (Gathering). With
    AVX2_SIGNED `unsigned` holds int8 quants biased by 128: |q| times s with q's sign instead."""
    if not isinstance(acc, Gathering):
        acc = Gathering(acc)
    if isa == AVX2_SIGNED:
        unsigned, signed = _signs_moved(builder, unsigned, signed)
    pairs = _pair_sums(builder, unsigned, signed)
    if acc.pairs is not None:
        pairs = builder.add(acc.pairs, pairs)
    if acc.count + 1 < limit:
        return Gathering(acc.sums, pairs, acc.count + 1)
    return Gathering(_widened(builder, acc.sums, pairs))


def _signs_moved(builder: ir.IRBuilder, biased, signed):
    """(|q|, s with q's sign, 0 where q is 0) for the int8 quants q = biased - 128 (vpabsb,
    vpsignb): the same products, the quant's side unsigned."""
    bytes_ = vector(I8, 64)  # a <16 x i32> piece
    q = builder.xor(builder.bitcast(biased, bytes_), byte_splat(0x80, 64))
    magnitude = builder.select(builder.icmp_signed("<", q, byte_splat(0, 64)), builder.neg(q), q)
    s = builder.bitcast(signed, bytes_)
    halves = [
        _x86(builder, "llvm.x86.avx2.psign.b", vector(I8, 32), [_slice(builder, s, z, 32), _slice(builder, q, z, 32)])
        for z in (0, 32)
    ]
    moved = builder.shuffle_vector(halves[0], halves[1], ir.Constant(vector(I32, 64), list(range(64))))
    return builder.bitcast(magnitude, biased.type), builder.bitcast(moved, biased.type)


def settled(builder: ir.IRBuilder, pieces: list) -> list:
    """dot4's sums as <16 x i32> pieces (AVX2's Gatherings widened)."""
    out = []
    for piece in pieces:
        if isinstance(piece, Gathering):
            piece = piece.sums if piece.pairs is None else _widened(builder, piece.sums, piece.pairs)
        out.append(piece)
    return out


def _x86(builder: ir.IRBuilder, name: str, result, arguments: list):
    """A call of the x86 intrinsic `name` (declared once a module)."""
    function = builder.module.globals.get(name)
    if function is None:
        kind = ir.FunctionType(result, [a.type for a in arguments])
        function = ir.Function(builder.module, kind, name=name)
    return builder.call(function, arguments)


def dot_pairs(builder: ir.IRBuilder, acc, pairs, word, isa: int = VNNI):
    """acc + each 32-bit element's two signed 16-bit halves of `pairs` times those of `word`
    (an i32 splat), summed (vpdpwssd; with AVX2, vpmaddwd and an add: no saturation either)."""
    if isa == VNNI:
        return _vnni(builder, "llvm.x86.avx512.vpdpwssd.512", acc, pairs, splat(builder, word, CHUNK))
    words = vector(I16, 16)
    spread = builder.bitcast(splat(builder, word, 8), words)
    halves = [
        _x86(
            builder,
            "llvm.x86.avx2.pmadd.wd",
            vector(I32, 8),
            [builder.bitcast(_slice(builder, pairs, z, 8), words), spread],
        )
        for z in (0, 8)
    ]
    both = builder.shuffle_vector(halves[0], halves[1], ir.Constant(vector(I32, CHUNK), list(range(CHUNK))))
    return builder.add(acc, both)


def dot4(
    builder: ir.IRBuilder, accs: list, rows: list, activations, isa: int, ready: bool = False, limit: int = 1
) -> list:
    """accs (one list of pieces per activation row) plus, for each activation row i, the sums
    over k < 4 of rows[k] (u8 quants, <lanes x i8>) times activation k of that row: activations[i]
    is the i32 holding the row's four int8 values (little-endian, value k in byte k). The value
    rows are widened or transposed once for every activation row; `ready`: with VNNI or AVX2,
    `rows` are `transposed`'s pieces already (a block unpacked once for many activation rows).
    With AVX2 the pieces are Gatherings (`limit`: pair_limit's) until `settled`."""
    if transposes(isa):
        pieces = rows if ready else transposed(builder, rows, isa)
        out = []
        for acc, four in zip(accs, activations):
            spread = splat(builder, four, CHUNK)
            if isa in AVX2_FAMILY:
                out.append([_gather(builder, a, p, spread, limit, isa) for a, p in zip(acc, pieces)])
            else:
                out.append([_dpbusd(builder, a, p, spread) for a, p in zip(acc, pieces)])
        return out
    lanes = rows[0].type.count
    wide = [builder.zext(row, vector(I32, lanes)) for row in rows]
    out = []
    for acc, four in zip(accs, activations):
        (total,) = acc
        for k, row in enumerate(wide):
            byte = builder.trunc(builder.lshr(four, ir.Constant(I32, 8 * k)), I8)
            total = builder.add(total, builder.mul(row, splat(builder, builder.sext(byte, I32), lanes)))
        out.append([total])
    return out
