"""Products of block-quantized weights with 8-bit activations, as llama.cpp's CPU backend computes
them: each activation row quantized once per product into the format's partner type
(activations.py), integer dot products per block (u8 quants times s8 activations into int32:
vpdpbusd with AVX-512 VNNI, vector_ir.py), then one float scale per block (and K-quants' integer
sub-block scales applied in int32 first). For every block format of formats.INT_FORMATS, for
any number of activation rows: four at a time (each weight value row made once for four
activation rows: a batch's decode step) and one at a time for the rest; from UNPACK_ROWS rows (a
prefill) each block is unpacked once into L1 and read by every UNPACKED_PASS rows.

A block's integer sums are exact, so these products equal the NumPy model of the same arithmetic
(tests/test_int8_products.py) to float32 rounding of the per-block sums. Against the float32
products (the exact path, `activations="f32"`) they differ by the activations' 8-bit rounding,
as llama.cpp's do.

Weights keep the workers' interleaved layout (split_state/quant.py) with 64 lanes: a byte row of
a block is one 512-bit vector; their quant rows packed at load where `packs` (packing.py: each
four rows as 64 lanes' four bytes, the pieces the products multiply). (Other lane counts, from
splits into extents that are not whole multiples of 64 rows, take the float32 loops.)
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from split_state.quant import FORMATS
from workers.backends.cpu import activations as quantizers
from workers.backends.cpu import vector_ir as vir
from workers.backends.cpu.formats import ACTIVATION_BLOCK, INT_FORMATS, SUM_SPAN, Partner
from workers.backends.cpu.row_threads import over_threads

LANES = 64
# The block `ahead` bytes on (whole blocks, ahead_bytes) is asked for as the block is read, one
# byte row (a cache line) each time the block code first reads one of its own rows, in the
# order of the rows' addresses, and what is left at the block's end: the blocks' rows are read
# out of order (sub-block by sub-block, the scales last, the float16 factors by the numba loop),
# and the hardware's prefetcher alone fed a K-quant product from DRAM at 9.5 GB/s. Asked for in
# the order the block code read them (and the factors' rows not at all), 6 products of 16,384 x
# 2,048 on two threads ran at q4_k 43.8-44.8, q6_k 39.6-41.2, q4_0 46.0-46.9 GB/s; in address
# order 50.0-51.7, 44.6-46.3, 46.9-47.7 (2026-11-29, alternating in one process; one thread
# within noise: q4_k 32.2 against 32.5, q6_k 26.8 against 27.9).
# Where the asks bring the rows: into L2 (vector_ir.prefetch). Into L1 (prefetcht0), the asks
# queue on L1's few miss buffers; the Zen 4 VM of 2026-12-03 (quiet) read one-row products of
# 65,536 x 2,048 from DRAM at, one / two threads, q4_k 7.9 / 16.3 GB/s, q6_k 10.1 / 20.5, q4_0
# 18.6 / 19.1, q8_0 18.7 / 29.4; into L2 at 18.3 / 31.3, 18.0 / 27.3, 22.8 / 32.3, 19.4 / 40.7,
# and bench/formats.py's decode against llama.cpp went, one / two threads, q4_k 0.55 / 0.54x ->
# 0.95 / 0.83x, q6_k 0.52 / 0.57 -> 0.88 / 1.01, q4_0 0.98 / 0.84 -> 1.27 / 1.00.
# How far ahead: at least 16 KiB, whatever the threads. Into L2, a decode step's products of the
# 1.7B shape's 8 layers (each weight once, from DRAM, the Zen 4 VM, 2026-12-03) on one thread
# read q6_k at 14.8-15.6 GB/s 8 KiB ahead (one block), 16.9-18.9 at 16 KiB, 16.0 / 15.4 at 32 /
# 64; two threads 24.2 / 26.9 / 26.8 / 25.0; q4_k, q5_k and q8_0 moved within noise (4-64 KiB).
# (Into L1 the best had been 8 KiB on one thread, 16 on two: the 2026-11-29 Zen 5 VM.)
PREFETCH_BYTES = 16384


def ahead_bytes(fmt: str) -> int:
    """How far ahead a product of `fmt` asks for its weight's rows: whole blocks of 64 lanes, at
    least PREFETCH_BYTES."""
    size = FORMATS[fmt].block_bytes * LANES
    return size * -(-PREFETCH_BYTES // size)


QUAD = 4  # activation rows per pass over a block's value rows
# activation rows per pass over a block unpacked once: with AVX2 one, whose 16 registers hold one
# row's sums of 64 lanes (8) beside the values; more rows' sums spill: 64-row products of 2,048 x
# 2,048, one thread, one / two / four rows a pass: q4_k 3,608 / 6,166 / 8,066 us, q6_k 5,663 /
# 9,158 / 9,524, q4_0 3,529 / 3,672 / 4,692 (21:50-21:56)
UNPACKED_PASS = 1 if vir.ISA == vir.AVX2 else QUAD


def packs(fmt: str, isa: int = vir.ISA) -> bool:
    """Whether the products of `fmt` on `isa` read the weight packed (packing.py): formats with a
    formats.Packed row, on the instruction sets that multiply fours of a lane (the generic code
    multiplies value rows)."""
    return INT_FORMATS[fmt].packed is not None and vir.transposes(isa)


class _Block:
    """The values and factors of one block, read from the weight (each sub-block reading the
    block's byte rows anew: vector_ir.load_once; the rows at["ahead"] bytes on asked for)."""

    ready = False  # values as value rows, for dot4 to transpose
    paired = False  # minimums two sub-blocks a lane (an unpacked block's, with VNNI)

    def __init__(
        self, builder, fmt, lanes: int, at: dict, moves: list | None = None, asking: bool = True, isa: int = vir.ISA
    ):
        self.builder, self.fmt, self.lanes, self.at = builder, fmt, lanes, at
        self.touched: set[int] = set()  # the block's rows read so far
        self.asked = 0  # the rows of the block ahead asked for: rows 0 .. asked - 1
        self.moves = moves  # a class's code (formats.Repeated): the rows each region moves by
        self.asking = asking  # (a class's code and a block's tail ask for rows by ask_slice)
        # the weight's quant rows packed (packing.py): values as pieces, their lanes in order
        self.packed = self.ordered = packs(fmt.name, isa)

    def _offset(self, p: int):
        i64 = self.at["w_at"].type
        offset = self.builder.add(self.at["w_at"], ir.Constant(i64, p * self.lanes))
        region = self.fmt.repeated.region(p) if self.moves is not None else None
        if region is None:
            return offset
        return self.builder.add(offset, self.builder.mul(self.moves[region], ir.Constant(i64, self.lanes)))

    def ask_slice(self, first, count: int) -> None:
        """Ask for rows first .. first + count - 1 (first an i64 value) of the block `ahead`
        bytes on: a class's share of them (one_row_by_classes), where all at once, 210 for q6_k,
        the asks stalled the loads behind them: 8.3 against 12 GB/s from DRAM."""
        i64 = self.at["w_at"].type
        start = self.builder.add(self.at["w_at"], self.builder.mul(first, ir.Constant(i64, self.lanes)))
        start = self.builder.add(start, self.at["ahead"])
        for k in range(count):
            vir.prefetch(self.builder, self.at["w"], self.builder.add(start, ir.Constant(i64, k * self.lanes)))

    def ask_ahead(self, count: int) -> None:
        """Ask for the next `count` rows of the block `ahead` bytes on, in address order."""
        if not self.asking:
            return
        for p in range(self.asked, min(self.asked + count, FORMATS[self.fmt.name].block_bytes)):
            vir.prefetch(self.builder, self.at["w"], self.builder.add(self._offset(p), self.at["ahead"]))
            self.asked = p + 1

    def reader(self):
        """A reader of the block's byte rows for one sub-block: each row read once."""
        read = {}
        wide = vir.vector(vir.I8, self.lanes)

        def row(p):  # byte p of the block, of every lane
            if p not in read:
                if p not in self.touched:
                    self.touched.add(p)
                    self.ask_ahead(1)
                read[p] = vir.load_once(self.builder, self.at["w"], self._offset(p), wide)
            return read[p]

        return row

    def values(self, row, v: int) -> list:
        return [self.fmt.value_row(self.builder, row, v + k) for k in range(4)]

    def pieces(self, p: int) -> list:
        """Packed rows p .. p + 3 as <16 x i32> pieces, lanes 16 z .. 16 z + 15 in piece z."""
        for k in range(4):
            if p + k not in self.touched:
                self.touched.add(p + k)
                self.ask_ahead(1)
        i64, piece = self.at["w_at"].type, vir.vector(vir.I32, vir.CHUNK)
        first = self._offset(p)
        return [
            vir.load_once(
                self.builder, self.at["w"], self.builder.add(first, ir.Constant(i64, z * vir.CHUNK * 4)), piece
            )
            for z in range(self.lanes // vir.CHUNK)
        ]

    def shares(self, rows: int, isa: int) -> bool:
        """Whether sub-blocks that share byte rows go in one pass, each row transposed once for
        all of them (formats.Transposed): with VNNI, for one activation row, whose sums of the
        pass's sub-blocks fit the registers beside the transposed bytes. (Four rows' sums would
        spill; the legacy formats' halves, in one sub-block, gained nothing shared: 97-99 us
        either way, and four rows 197 against 251-270. With AVX2 two sub-blocks' int16 sums of
        64 lanes fill its 16 registers: shared, one thread's 8,192 x 2,048 one-row products took
        q6_k 1,391-1,865 against 1,045-1,061 us, q4_k 822-1,086 against 746, 2026-12-02.)"""
        shared = self.fmt.transposed is not None and isa == vir.VNNI and rows == 1
        return shared and not self.ready and not self.packed

    def passes(self, shared: bool) -> tuple[tuple[int, ...], ...]:
        if shared:
            return self.fmt.transposed.passes
        return tuple((s,) for s in range(FORMATS[self.fmt.name].block // self.fmt.sub))

    def fours(self, row, subs: tuple[int, ...], shared: bool):
        """(sub-block, v, the values v .. v + 3 as dot4 takes them, whether transposed) for every
        four values of `subs`; `shared` (`shares`): the fours in the order of their sources, each
        source's four byte rows transposed once and the values made from the transposed bytes."""
        sub = self.fmt.sub
        fours = [(s, v) for s in subs for v in range(s * sub, (s + 1) * sub, 4)]
        if self.packed:  # each source's pieces loaded once for the fours of `subs`
            spec, loaded = self.fmt.packed, {}
            for s, v in fours:
                for p in spec.sources(v):
                    if p not in loaded:
                        loaded[p] = self.pieces(p)
                pieces = zip(*(loaded[p] for p in spec.sources(v)))
                yield s, v, [spec.value(self.builder, list(chunk), v) for chunk in pieces], True
            return
        if not shared:
            for s, v in fours:
                yield s, v, self.values(row, v), self.ready
            return
        spec, builder, raw = self.fmt.transposed, self.builder, {}
        for s, v in sorted(fours, key=lambda sv: spec.sources(sv[1])):
            sources = spec.sources(v)
            for p in sources:
                if p not in raw:
                    raw[p] = vir.transposed(builder, [row(p + k) for k in range(4)])
            pieces = zip(*(raw[p] for p in sources))
            yield s, v, [spec.value(builder, list(chunk), v) for chunk in pieces], True

    def scale(self, row, s: int):
        return self.fmt.scales(self.builder, row, s)[0] if self.fmt.scales is not None else None

    def minimum(self, row, s: int):
        return self.fmt.scales(self.builder, row, s)[1] if self.fmt.scales is not None else None


def _unpacked_layout(fmt, lanes: int) -> tuple[int, int, int]:
    """Where an unpacked block keeps its scales and its minimums, and its bytes in all: the values
    v..v + 3 at v * lanes (transposed for VNNI, value rows else), then each sub-block's int32
    scale lanes, then its minimums' (with VNNI, sub-blocks 2j and 2j + 1 in one int32 lane as
    int16 halves: _paired_minimums)."""
    block = FORMATS[fmt.name].block
    subs = block // fmt.sub
    return block * lanes, block * lanes + subs * lanes * 4, block * lanes + 2 * subs * lanes * 4


class _Unpacked(_Block):
    """The same block's values and factors from a scratch buffer `unpack_code` wrote (in L1):
    a prefill's activation rows read it four at a time, where each four transposed it anew."""

    def __init__(self, builder, fmt, lanes: int, isa: int, at: dict):
        super().__init__(builder, fmt, lanes, at, isa=isa)
        self.isa, self.ready = isa, vir.transposes(isa)
        self.packed = False  # (read from the scratch; `ordered` as the weight it was unpacked from)
        self.scales_at, self.minimums_at, _ = _unpacked_layout(fmt, lanes)

    def reader(self):
        return None

    def ask_ahead(self, count: int) -> None:  # (unpack_code asked for the weight's rows)
        pass

    def _load(self, offset: int, kind):
        return vir.load(self.builder, self.at["scratch"], ir.Constant(ir.IntType(64), offset), kind)

    def values(self, row, v: int) -> list:
        lanes = self.lanes
        if self.ready:
            piece = vir.vector(vir.I32, vir.CHUNK)
            return [self._load(v * lanes + z * vir.CHUNK * 4, piece) for z in range(lanes // vir.CHUNK)]
        return [self._load((v + k) * lanes, vir.vector(vir.I8, lanes)) for k in range(4)]

    def scale(self, row, s: int):
        if self.fmt.scales is None:
            return None
        return self._load(self.scales_at + s * self.lanes * 4, vir.vector(vir.I32, self.lanes))

    def minimum(self, row, s: int):
        if self.fmt.scales is None or len(self.fmt.factors) < 2:  # no dmin, no minimums (q6_k)
            return None
        return self._load(self.minimums_at + s * self.lanes * 4, vir.vector(vir.I32, self.lanes))

    @property
    def paired(self) -> bool:
        """Whether the minimums were stored in pairs (_unpack_code: VNNI, AVX2)."""
        return self.ready and self.fmt.scales is not None and len(self.fmt.factors) > 1

    def minimum_pair(self, j: int):
        return self._load(self.minimums_at + j * self.lanes * 4, vir.vector(vir.I32, self.lanes))


def _unpack_code(builder, fmt, lanes: int, isa: int, at: dict) -> None:
    """The block's values and factors into at["scratch"] as _Unpacked reads them."""
    source = _Block(builder, fmt, lanes, at, isa=isa)
    scales_at, minimums_at, _ = _unpacked_layout(fmt, lanes)
    block = FORMATS[fmt.name].block

    def put(value, offset):
        vir.store(builder, value, at["scratch"], ir.Constant(ir.IntType(64), offset))

    held = None  # an even sub-block's minimums, paired with the next one's (VNNI, AVX2)
    for s in range(block // fmt.sub):
        row = source.reader()
        for _, v, pieces, _ in source.fours(row, (s,), False) if source.packed else ():
            for z, piece in enumerate(pieces):
                put(piece, v * lanes + z * vir.CHUNK * 4)
        for v in range(s * fmt.sub, (s + 1) * fmt.sub, 4) if not source.packed else ():
            values = source.values(row, v)
            if vir.transposes(isa):
                for z, piece in enumerate(vir.transposed(builder, values, isa)):
                    put(piece, v * lanes + z * vir.CHUNK * 4)
            else:
                for k, value in enumerate(values):
                    put(value, (v + k) * lanes)
        scale, minimum = source.scale(row, s), source.minimum(row, s)
        if scale is not None:
            put(scale, scales_at + s * lanes * 4)
        if minimum is None:
            continue
        if not vir.transposes(isa):
            put(minimum, minimums_at + s * lanes * 4)
        elif s % 2 == 0:
            held = minimum
        else:  # minimums are 6 bits: two in an i32, as int16 halves
            pair = builder.or_(held, builder.shl(minimum, ir.Constant(minimum.type, [16] * lanes)))
            put(pair, minimums_at + s // 2 * lanes * 4)
    source.ask_ahead(FORMATS[fmt.name].block_bytes)


def _block_code(
    builder, fmt, rows: int, lanes: int, isa: int, at: dict, source: _Block, part: tuple[int, ...] | None = None
) -> None:
    """One block of `fmt` against `rows` activation rows: for row r, out[r, 0, :] = the sum over
    sub-blocks s of scale_s * (sum of q * x_q over s - bias * the activation sum of s) (scale 1 for
    the legacy formats) and, where the format has minimums, out[r, 1, :] = the sum of min_s * the
    activation sum of s. `at` holds the IR values: pointers and offsets; `source` the block's
    values and factors. Each sub-block adds its sums into `out`, so no more than one sub-block's
    vectors are live at once. `part`: only those sub-blocks' sums, added into out[r, 0] (a class
    template's, formats.Repeated), or with () only the minimums (the block's tail)."""
    x8, sums, out = at["x8"], at["sums"], at["out"]

    def activation_word(r, v):
        offset = builder.add(at["x_at"], builder.mul(at["x_stride"], ir.Constant(at["x_stride"].type, r)))
        return vir.load(builder, x8, builder.add(offset, ir.Constant(offset.type, v)), vir.I32)

    def activation_sum(r, s):  # the partner's sums over sub-block s of row r
        span = SUM_SPAN[fmt.partner]
        first = builder.add(at["sums_at"], builder.mul(at["sums_stride"], ir.Constant(at["sums_stride"].type, r)))
        total = None
        for k in range(s * fmt.sub // span, (s + 1) * fmt.sub // span):
            offset = builder.mul(builder.add(first, ir.Constant(first.type, k)), ir.Constant(first.type, 4))
            value = vir.load(builder, sums, offset, vir.I32)
            total = value if total is None else builder.add(total, value)
        return total

    def add_into(r, kind, pieces, first):
        for z, piece in enumerate(pieces):
            offset = ir.Constant(ir.IntType(64), (r * 2 + kind) * lanes * 4 + z * piece.type.count * 4)
            if not first:
                piece = builder.add(piece, vir.load(builder, out, offset, piece.type))
            vir.store(builder, piece, out, offset)

    block = FORMATS[fmt.name].block
    subs = block // fmt.sub
    shared = source.shares(rows, isa)

    def start(r, s):
        """Row r's sums of sub-block s before its products: 0, or less the bias times the
        activation's sum (the unsigned quants exceed the true ones by the bias), so that no
        subtraction follows the products. Subtracted after them (a splat and a vector
        subtraction a piece), bench/formats.py's 64-token prefill on one / two threads was
        q4_0 252-272 / 457-485, q8_0 244 / 390, q5_0 259 / 453 tok/s; from the start 304 /
        501, 284 / 492, 326 / 570 (17:29-17:54, quiet)."""
        if not fmt.bias or vir.unbiased(isa):
            return vir.zeros(lanes, isa)
        biased = builder.mul(activation_sum(r, s), ir.Constant(vir.I32, -fmt.bias))
        return [vir.splat(builder, biased, piece.type.count) for piece in vir.zeros(lanes, isa)]

    groups = source.passes(shared) if part is None else tuple((s,) for s in part)
    for group in groups:
        row = source.reader()
        accs = {s: [start(r, s) for r in range(rows)] for s in group}
        for s, v, values, ready in source.fours(row, group, shared):
            words = [activation_word(r, v) for r in range(rows)]
            accs[s] = vir.dot4(builder, accs[s], values, words, isa, ready, vir.pair_limit(isa, fmt.bits))
        for s, sums_of_rows in accs.items():
            first = s == 0 and part is None
            _sub_block_epilogue(
                builder, fmt, rows, isa, at, source, row, s, sums_of_rows, activation_sum, add_into, first
            )
    if part:
        return
    if source.paired:
        _paired_minimums(builder, rows, lanes, isa, source, subs, activation_sum, add_into)
        return
    row = source.reader()
    minimums = [source.minimum(row, s) for s in range(subs)]
    source.ask_ahead(FORMATS[fmt.name].block_bytes)  # the rows not read here (the factors')
    if minimums[0] is None:
        return
    for r in range(rows):
        total = None
        for s, minimum in enumerate(minimums):
            pieces = vir.chunks(builder, minimum, isa)
            spread = vir.splat(builder, activation_sum(r, s), pieces[0].type.count)
            term = [builder.mul(m, spread) for m in pieces]
            total = term if total is None else [builder.add(t, m) for t, m in zip(total, term)]
        add_into(r, 1, total, True)


def _paired_minimums(builder, rows: int, lanes: int, isa: int, source, subs: int, activation_sum, add_into) -> None:
    """out[r, 1, :] = the sum over sub-blocks s of min_s times row r's activation sum over s, from
    the unpacked block's pairs of minimums: one vpdpwssd takes two sub-blocks (each 32-bit
    element two signed 16-bit products: a minimum is 6 bits, a 32-value sub-block's activation
    sum within +-4,064), where each took a 32-bit multiply and an add. The same integers, so the
    same bits; a 64-row q4_k / q5_k product 7-9 % faster on one and two threads (4.87 -> 4.49 and
    5.06 -> 4.67 ms one thread, 2,048 x 8,192, alternating in one process)."""
    pairs = [vir.chunks(builder, source.minimum_pair(j), isa) for j in range(subs // 2)]
    low, shift = ir.Constant(vir.I32, 0xFFFF), ir.Constant(vir.I32, 16)
    for r in range(rows):
        total = vir.zeros(lanes, isa)
        for j, pieces in enumerate(pairs):
            word = builder.or_(
                builder.and_(activation_sum(r, 2 * j), low), builder.shl(activation_sum(r, 2 * j + 1), shift)
            )
            total = [vir.dot_pairs(builder, t, p, word, isa) for t, p in zip(total, pieces)]
        add_into(r, 1, total, True)


def _sub_block_epilogue(
    builder, fmt, rows: int, isa: int, at: dict, source, row, s: int, accs, activation_sum, add_into, first: bool
):
    """Sub-block s's int32 sums (one list of pieces per activation row, the bias's share already
    taken: _block_code's start) times the sub-block's scale, added where they go (`first`: stored
    there)."""
    scale = source.scale(row, s)
    scale = vir.chunks(builder, scale, isa) if scale is not None else None
    for r in range(rows):
        sub_sums = vir.settled(builder, accs[r])
        if not source.ordered:
            sub_sums = vir.natural(builder, sub_sums, isa)
        if scale is not None:
            sub_sums = [builder.mul(a, c) for a, c in zip(sub_sums, scale)]
        if "acc" in at:  # a legacy block's one sum, scaled and added where it belongs
            _add_scaled(builder, at, r, sub_sums)
        else:
            add_into(r, 0, sub_sums, first)


def _add_scaled(builder, at: dict, r: int, sums: list) -> None:
    """acc[r] += dw * (d_x[r] * sum) + mw * s_x[r] for a legacy block's int32 sums (pieces):
    the float work of a block done where the sums are, instead of storing them for a numba loop
    to read back (a third of a legacy block's work at four rows). dw, mw: the block's factors
    (float32 lanes); d_x, s_x the activation rows' (at d_at, d_stride apart); acc float32 rows
    from acc_at, acc_stride apart."""
    f32 = ir.FloatType()
    i64 = at["d_at"].type

    def scalar(name, offset):
        return vir.load(builder, at[name], builder.mul(offset, ir.Constant(i64, 4)), f32)

    place = builder.add(at["d_at"], builder.mul(at["d_stride"], ir.Constant(i64, r)))
    d, m = scalar("d", place), scalar("s", place)
    row = builder.mul(
        builder.add(at["acc_at"], builder.mul(at["acc_stride"], ir.Constant(i64, r))), ir.Constant(i64, 4)
    )
    at_lane = 0
    for piece in sums:
        width = piece.type.count
        kind = vir.vector(f32, width)
        lanes = ir.Constant(i64, 4 * at_lane)
        dw = vir.load(builder, at["dw"], lanes, kind)
        mw = vir.load(builder, at["mw"], lanes, kind)
        term = builder.fmul(dw, builder.fmul(vir.splat(builder, d, width), builder.sitofp(piece, kind)))
        term = builder.fadd(term, builder.fmul(mw, vir.splat(builder, m, width)))
        where = builder.add(row, lanes)
        vir.store(builder, builder.fadd(vir.load(builder, at["acc"], where, kind), term), at["acc"], where)
        at_lane += width


def _switch(cases: dict, name: str, emit):
    """Codegen choosing, by an i64 key (a format's code, a class's number), the code
    emit(builder, case) writes for cases[key]."""

    def codegen(builder, key):
        end = builder.append_basic_block(f"{name}.end")
        switch = builder.switch(key, end)
        for value, item in cases.items():
            case = builder.append_basic_block(f"{name}.{value}")
            switch.add_case(ir.Constant(key.type, value), case)
            builder.position_at_end(case)
            emit(builder, item)
            builder.branch(end)
        builder.position_at_end(end)

    return codegen


def _data(context, builder, sig, args, i):
    array = context.make_array(sig.args[i])(context, builder, args[i])
    return builder.bitcast(array.data, ir.IntType(8).as_pointer())


# The arguments of the block code's intrinsics after the format's code, by name: where the
# block's values come from (the weight, or a block unpacked once into scratch), the activation
# rows and their partner sums, and where the results go (int32 sums for a numba loop; or, for the
# legacy formats, scaled and added into the float sums by the block code itself: _add_scaled).
FROM_WEIGHT = ("w", "w_at", "ahead")
FROM_SCRATCH = ("scratch",)
# a class of formats.Repeated, the first row of the block ahead it asks for, its regions' moves
OF_CLASS = ("cls", "ask", "m0", "m1", "m2")
ROWS = ("x8", "x_at", "x_stride", "sums", "sums_at", "sums_stride")
INTO_SUMS = ("out",)
INTO_ACC = ("d", "d_at", "d_stride", "s", "dw", "mw", "acc", "acc_at", "acc_stride")


def block_sums(
    family: tuple[str, ...],
    rows: int,
    lanes: int = LANES,
    isa: int = vir.ISA,
    unpacked: bool = False,
    scaled: bool = False,
    repeated: str | None = None,
):
    """An intrinsic `sums(code, *arguments)` running _block_code for the format whose code is
    `code` (one of `family`'s, a switch in the code) against `rows` activation rows. Its
    arguments, arrays or int64 offsets, are named by FROM_WEIGHT (w the weight, uint8 of 64
    lanes, w_at its block's first byte, ahead how far on its rows are asked for) or,
    `unpacked`, FROM_SCRATCH (a block block_unpack wrote); then ROWS (x8 int8 rows from
    element x_at, x_stride apart; sums int32 their partner sums from sums_at, sums_stride
    apart); then INTO_SUMS (out int32 (rows, 2, lanes)) or, `scaled`, INTO_ACC (_add_scaled's).
    `repeated` (formats.Repeated): "class", the template of class `cls` (OF_CLASS, after
    FROM_WEIGHT) added into out[:, 0] for the sub-block whose rows are the template's moved by m0,
    m1, m2 (each run asking for its share of the block ahead); "tail", the block's minimums."""
    formats = [INT_FORMATS[name] for name in family]
    of_class = OF_CLASS if repeated == "class" else ()
    names = (FROM_SCRATCH if unpacked else FROM_WEIGHT) + of_class + ROWS + (INTO_ACC if scaled else INTO_SUMS)

    @intrinsic
    def sums_of_block(typingctx, *arguments):
        # numba passes the arguments one by one, or (typing a second time) as one tuple
        star = arguments[0] if len(arguments) == 1 else types.StarArgTuple(arguments)
        if len(star) != 1 + len(names):
            return None

        def codegen(context, builder, sig, args):
            values, kinds = cgutils.unpack_tuple(builder, args[0]), sig.args[0].types
            i64 = types.int64
            code = context.cast(builder, values[0], kinds[0], i64)
            at = {"out": None}
            for name, value, kind in zip(names, values[1:], kinds[1:]):
                if isinstance(kind, types.Array):
                    data = context.make_array(kind)(context, builder, value).data
                    at[name] = builder.bitcast(data, ir.IntType(8).as_pointer())
                else:
                    at[name] = context.cast(builder, value, kind, i64)

            def emit(builder, fmt):
                its = vir.for_format(isa, fmt.bits)
                if repeated == "class":
                    moves = [at[name] for name in OF_CLASS[2:]]
                    share = _ask_share(fmt)

                    def emit_class(builder, template):
                        source = _Block(builder, fmt, lanes, at, moves, asking=False, isa=isa)
                        source.ask_slice(at["ask"], share)
                        _block_code(builder, fmt, rows, lanes, its, at, source, (template,))

                    templates = {k: group[0] for k, group in enumerate(fmt.repeated.classes)}
                    _switch(templates, f"class.{fmt.name}", emit_class)(builder, at["cls"])
                    return
                if unpacked:
                    source = _Unpacked(builder, fmt, lanes, its, at)
                    source.ordered = packs(fmt.name, isa)
                else:
                    source = _Block(builder, fmt, lanes, at, asking=repeated != "tail", isa=isa)
                _block_code(builder, fmt, rows, lanes, its, at, source, () if repeated == "tail" else None)

            _switch({f.code: f for f in formats}, "block_sums", emit)(builder, code)
            return context.get_dummy_value()

        return types.void(star), codegen

    return sums_of_block


def block_unpack(family: tuple[str, ...], lanes: int = LANES, isa: int = vir.ISA):
    """An intrinsic `unpack(code, w, w_at, ahead, scratch)`: the block at w_at unpacked into
    scratch (uint8, SCRATCH_BYTES) for block_sums(..., unpacked=True) (ahead: as block_sums')."""
    formats = [INT_FORMATS[name] for name in family]

    @intrinsic
    def unpack_block(typingctx, code, w, w_at, ahead, scratch):
        i64 = types.int64
        signature = types.void(i64, w, i64, i64, scratch)

        def codegen(context, builder, sig, args):
            at = {"w": _data(context, builder, sig, args, 1), "w_at": args[2], "ahead": args[3]}
            at["scratch"] = _data(context, builder, sig, args, 4)

            def emit(builder, fmt):
                _unpack_code(builder, fmt, lanes, vir.for_format(isa, fmt.bits), at)

            _switch({f.code: f for f in formats}, "block_unpack", emit)(builder, args[0])
            return context.get_dummy_value()

        return signature, codegen

    return unpack_block


LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
K_QUANTS = ("q4_k", "q5_k", "q6_k")
_legacy_quad, _legacy_one = block_sums(LEGACY, QUAD, scaled=True), block_sums(LEGACY, 1, scaled=True)
_k_quad, _k_one = block_sums(K_QUANTS, QUAD), block_sums(K_QUANTS, 1)
_legacy_unpack, _k_unpack = block_unpack(LEGACY), block_unpack(K_QUANTS)
K_REPEATED = tuple(name for name in K_QUANTS if INT_FORMATS[name].repeated is not None)
_legacy_unpacked_pass = block_sums(LEGACY, UNPACKED_PASS, unpacked=True, scaled=True)
_k_unpacked_pass = block_sums(K_QUANTS, UNPACKED_PASS, unpacked=True)
# the most bytes an unpacked block takes (_unpacked_layout): q6_k's 256 values and 16 scales of 64 lanes
SCRATCH_BYTES = max(_unpacked_layout(f, LANES)[2] for f in INT_FORMATS.values())
# activation rows from which a block is unpacked once for all of them (prefill, a batch of 8 or
# more; with AVX2 of 2 or more), where fewer take it straight from the weight four rows at a time.
# AVX2's fours from the weight spill four rows' sums (UNPACKED_PASS): unpacked and read a row at a
# time, one thread's 8,192 x 2,048 products of 4 rows took q4_k 1,720 against 2,237 us, q6_k
# 2,399 against 2,709, q4_0 1,245 against 1,939, q8_0 2,088 against 4,019 (21:58-22:02).
UNPACK_ROWS = 2 if vir.ISA == vir.AVX2 else 8

parallel = numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
inline = numba.njit(cache=True, nogil=True, fastmath=True, inline="always")


@numba.njit(cache=True, nogil=True)
def _store(acc, out, addend, adds, at):
    """A row group's sums into out's columns at .. at + lanes, plus the addend's there where
    `adds` (the qmatmul_add pattern's residual, while the group's rows are in the caches: a
    NumPy add after the product cost ~5-10 us a call in a decode step, its code and data out of
    the caches). Not fastmath and not inlined: each sum is one float32 add, as NumPy's, which
    the loops' reassociation must not fold into the sums before it."""
    lanes = acc.shape[1]
    if adds:
        for r in range(acc.shape[0]):
            for lane in range(lanes):
                out[r, at + lane] = acc[r, lane] + addend[r, at + lane]
    else:
        out[:, at : at + lanes] = acc


@intrinsic
def _widen_half(typingctx, bits):
    def codegen(context, builder, signature, args):
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(types.int32), codegen


@inline
def _factors(w, g, b, at, out):
    """out[lane] = the float16 at bytes at, at + 1 of block b of each lane (F16C's widening)."""
    for lane in range(out.shape[0]):
        out[lane] = _widen_half(np.int32(w[g, b, at, lane]) | (np.int32(w[g, b, at + 1, lane]) << 8))


@inline
def _tasks(groups, threads):
    """legacy_rows' and k_rows' tasks: one a thread (the caller's count: numba's, read in here,
    would keep the loops out of numba's cache), each a run of row groups (prange's own static
    schedule), so that a task makes its scratch once where a task a group made it for each:
    0.3-0.4 us a group, a fifth of a 64 x 576 q5_0 group's time in cache (a SmolLM2 decode step
    has ~2,000 groups a worker). (A serial twin for one-thread workers saved the parallel
    launch, ~1.3 us a call, but calling it from the parallel loop made numba compile the block
    code twice: a cold prepare() on two threads took 278 s against 127 on one.)"""
    return max(1, min(groups, threads))


@inline
def _task_group(acc):
    """A task's next row group begins from zero sums (its other scratch is written before it
    is read, or stays zero: _scratch's)."""
    acc[:, :] = 0


@inline
def _scratch(rows, lanes):
    """A row group's float sums (rows, lanes), integer block sums, its two factors' lanes and
    the room an unpacked block takes."""
    part = np.zeros((QUAD, 2, lanes), np.int32)
    factors = np.empty(lanes, np.float32), np.zeros(lanes, np.float32)
    return np.zeros((rows, lanes), np.float32), part, factors[0], factors[1], np.empty(SCRATCH_BYTES, np.uint8)


@inline
def _add_k(acc, part, i, count, dw, dmin, d, b):
    """acc[i + r] += d_x * (d_w * the scaled sums - dmin_w * the minimums' sums), r < count."""
    for r in range(count):
        f = d[i + r, b]
        for lane in range(acc.shape[1]):
            acc[i + r, lane] += f * (
                dw[lane] * np.float32(part[r, 0, lane]) - dmin[lane] * np.float32(part[r, 1, lane])
            )


def _ask_share(fmt) -> int:
    """The rows of the block ahead each sub-block's run of a class's code asks for."""
    return -(-FORMATS[fmt.name].block_bytes // sum(len(group) for group in fmt.repeated.classes))


def _class_table() -> tuple[np.ndarray, np.ndarray]:
    """For each format code, the sub-blocks of its formats.Repeated classes in the order
    one_row_by_classes runs them, a class after another (each class's code read once a block):
    (class, how far the sub-block's activation values and partner sums lie from its template's,
    the first row of the block ahead it asks for, the rows each region moves by); and how many."""
    codes = 1 + max(f.code for f in INT_FORMATS.values())
    most = max(FORMATS[f.name].block // f.sub for f in INT_FORMATS.values())
    table, count = np.zeros((codes, most, 2 + len(OF_CLASS)), np.int64), np.zeros(codes, np.int64)
    for name in K_REPEATED:
        fmt, e = INT_FORMATS[name], 0
        for k, group in enumerate(fmt.repeated.classes):
            for s in group:
                moves = fmt.repeated.moves(group[0], s)
                if len(moves) > len(OF_CLASS) - 2:
                    raise ValueError(f"{name}: {len(moves)} regions move, the code takes {len(OF_CLASS) - 2}")
                values = (s - group[0]) * fmt.sub
                table[fmt.code, e, : 4 + len(moves)] = (
                    k,
                    values,
                    values // SUM_SPAN[fmt.partner],
                    e * _ask_share(fmt),
                    *moves,
                )
                e += 1
        count[fmt.code] = e
    return table, count


CLASS_TABLE, CLASS_COUNT = _class_table()


def one_row_by_classes(isa: int = vir.ISA):
    """A numba function (code, w, w_at, ahead, x8, x_at, x_stride, sums, sums_at, sums_stride,
    out) doing what block_sums(K_REPEATED, 1) does for one block, class by class (formats.Repeated):
    its tail (the minimums), then each sub-block by its class's code, each asking for its share of
    the block ahead."""
    tail = block_sums(K_REPEATED, 1, isa=isa, repeated="tail")
    of_class = block_sums(K_REPEATED, 1, isa=isa, repeated="class")

    @inline
    def by_classes(code, w, w_at, ahead, x8, x_at, x_stride, sums, sums_at, sums_stride, out):
        tail(code, w, w_at, ahead, x8, x_at, x_stride, sums, sums_at, sums_stride, out)
        out[0, 0, :] = 0
        for e in range(CLASS_COUNT[code]):
            k, dx, ds, ask = (
                CLASS_TABLE[code, e, 0],
                CLASS_TABLE[code, e, 1],
                CLASS_TABLE[code, e, 2],
                CLASS_TABLE[code, e, 3],
            )
            m0, m1, m2 = CLASS_TABLE[code, e, 4], CLASS_TABLE[code, e, 5], CLASS_TABLE[code, e, 6]
            of_class(
                code, w, w_at, ahead, k, ask, m0, m1, m2, x8, x_at + dx, x_stride, sums, sums_at + ds, sums_stride, out
            )

    return by_classes


# One-row K-quant blocks class by class where each sub-block is made alone (not with VNNI, whose
# one-row passes share byte rows): one thread, one-row products of 65,536 x 2,048 from DRAM /
# 8,192 x 2,048 from L3, the AVX2 VM of 2026-12-03, each sub-block its own code: q6_k 9,180-9,440
# / 1,043-1,060 us, q4_k 5,988-6,170 / 745-759; by classes q6_k 7,952-8,110 / 855-912, q4_k
# 6,030-6,063 / 695-714. (The class code running one class's rows eight times, 1/8 of q6_k's
# code for the same work, had shown it: 7,353 / 792. q5_k's fifth bits move by bits, not rows:
# shifted by the class's move at run time, its product took 9,627 / 1,183 against 8,434 / 1,027.)
BY_CLASSES = vir.ISA != vir.VNNI
_k_one_by_classes = one_row_by_classes()


@parallel
def legacy_rows(code, x8, d, sums, s, w, ahead, threads, out, addend, adds):
    """out (rows, groups * 64) = the rows of x8 (rows, width) int8 times the weight's rows, for
    legacy format `code`: each block's d_w * d_x * (its integer sum) (+ m_w * s_x for q4_1 and
    q5_1), d (rows, blocks), sums and s the partner's (activations.quantize_q8_0); the float
    work is the block code's (_add_scaled); the weight's rows asked for `ahead` bytes on. The
    64-row groups go in `threads` tasks (_tasks), one a thread, each on scratch made once for its
    run of groups (numba's own thread count, read inside, kept the loop out of its cache).
    `adds`: plus addend (out's shape) as each group is written (_store)."""
    rows, width = x8.shape
    groups, blocks, size, lanes = w.shape
    with_min = code == 1 or code == 3
    tasks = _tasks(groups, threads)
    for t in numba.prange(tasks):
        acc, _, dw, mw, unpacked = _scratch(rows, lanes)
        for g in range(t * groups // tasks, (t + 1) * groups // tasks):
            _task_group(acc)
            _group_legacy(code, x8, d, sums, s, w, ahead, out, g, with_min, acc, dw, mw, unpacked)
            _store(acc, out, addend, adds, g * lanes)


@inline
def _group_legacy(code, x8, d, sums, s, w, ahead, out, g, with_min, acc, dw, mw, unpacked):
    """legacy_rows' row group g (64 weight rows) into the task's sums (acc)."""
    rows, width = x8.shape
    groups, blocks, size, lanes = w.shape
    for b in range(blocks):
        at = (g * blocks + b) * size * lanes
        _factors(w, g, b, 0, dw)
        if with_min:
            _factors(w, g, b, 2, mw)
        i = 0
        if rows >= UNPACK_ROWS:
            _legacy_unpack(code, w, at, ahead, unpacked)
            while i + UNPACKED_PASS <= rows:
                x_at, k, acc_at = i * width + b * 32, i * blocks + b, i * lanes
                _legacy_unpacked_pass(
                    code, unpacked, x8, x_at, width, sums, k, blocks, d, k, blocks, s, dw, mw, acc, acc_at, lanes
                )
                i += UNPACKED_PASS
        while i < rows:  # (d and s: indexed as the sums, a value a block)
            x_at, k, acc_at = i * width + b * 32, i * blocks + b, i * lanes
            if i + QUAD <= rows:
                _legacy_quad(
                    code, w, at, ahead, x8, x_at, width, sums, k, blocks,
                    d, k, blocks, s, dw, mw, acc, acc_at, lanes,
                )  # fmt: skip
                i += QUAD
            else:
                _legacy_one(
                    code, w, at, ahead, x8, x_at, width, sums, k, blocks,
                    d, k, blocks, s, dw, mw, acc, acc_at, lanes,
                )  # fmt: skip
                i += 1


@parallel
def k_rows(code, x8, d, sums, w, ahead, threads, out, addend, adds):
    """legacy_rows for the K-quants (`code` 5 q4_k, 6 q5_k, 7 q6_k): each block's d_x * (d_w * (its
    sub-blocks' integer sums times their scales) - dmin_w * (its minimums times the activation's
    sub-block sums)); d (rows, blocks) and sums (rows, width / 16) are Q8_K's; `threads` tasks
    and `adds` as there."""
    rows, width = x8.shape
    groups, blocks, size, lanes = w.shape
    q6 = code == 7
    d_at = 208 if q6 else 0
    stride = blocks * 16
    tasks = _tasks(groups, threads)
    for t in numba.prange(tasks):
        acc, part, dw, dmin, unpacked = _scratch(rows, lanes)
        for g in range(t * groups // tasks, (t + 1) * groups // tasks):
            _task_group(acc)
            _group_k(code, x8, d, sums, w, ahead, out, g, q6, d_at, stride, acc, part, dw, dmin, unpacked)
            _store(acc, out, addend, adds, g * lanes)


@inline
def _group_k(code, x8, d, sums, w, ahead, out, g, q6, d_at, stride, acc, part, dw, dmin, unpacked):
    """k_rows' row group g (64 weight rows) into the task's sums (acc)."""
    rows, width = x8.shape
    groups, blocks, size, lanes = w.shape
    for b in range(blocks):
        at = (g * blocks + b) * size * lanes
        _factors(w, g, b, d_at, dw)
        if not q6:  # (q6_k's minimum sums stay 0: _scratch's)
            _factors(w, g, b, 2, dmin)
        i = 0
        if rows >= UNPACK_ROWS:
            _k_unpack(code, w, at, ahead, unpacked)
            while i + UNPACKED_PASS <= rows:
                _k_unpacked_pass(
                    code, unpacked, x8, i * width + b * 256, width, sums, i * stride + b * 16, stride, part
                )
                _add_k(acc, part, i, UNPACKED_PASS, dw, dmin, d, b)
                i += UNPACKED_PASS
        while i < rows:
            if i + QUAD <= rows:
                _k_quad(code, w, at, ahead, x8, i * width + b * 256, width, sums, i * stride + b * 16, stride, part)
                _add_k(acc, part, i, QUAD, dw, dmin, d, b)
                i += QUAD
            elif BY_CLASSES and CLASS_COUNT[code] > 0:
                _k_one_by_classes(
                    code, w, at, ahead, x8, i * width + b * 256, width, sums, i * stride + b * 16, stride, part
                )
                _add_k(acc, part, i, 1, dw, dmin, d, b)
                i += 1
            else:
                _k_one(code, w, at, ahead, x8, i * width + b * 256, width, sums, i * stride + b * 16, stride, part)
                _add_k(acc, part, i, 1, dw, dmin, d, b)
                i += 1


# numba keys its cache of the loops above by this file's time stamp alone, but their code is made
# from vector_ir, formats, legacy_blocks and k_blocks too: a digest of those is kept beside the
# cache, and where it differs the loops' cached code goes (a changed format row would otherwise
# run its old code; seen).
GENERATED_FROM = ("vector_ir.py", "formats.py", "legacy_blocks.py", "k_blocks.py")


def _drop_stale_cache() -> None:
    folder = Path(legacy_rows._cache._cache_path)
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join((here / name).read_bytes() for name in GENERATED_FROM)).hexdigest()
    mark = folder / "int8_products.generated-from"
    try:
        if mark.read_text() == digest:
            return
    except OSError:
        pass
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("int8_products.*.nb[ic]"):
            stale.unlink(missing_ok=True)
        mark.write_text(digest)
    except OSError:  # a read-only install: numba does not cache there either
        pass


_drop_stale_cache()


class Activations:
    """A product's activation rows quantized into its partner type (activations.py), into
    buffers a thread keeps (activations_for)."""

    def __init__(self, partner: Partner, rows: int, width: int):
        block = ACTIVATION_BLOCK[partner]
        self.partner = partner
        self.q = np.empty((rows, width), np.int8)
        self.d = np.empty((rows, width // block), np.float32)
        self.sums = np.empty((rows, width // SUM_SPAN[partner]), np.int32)
        self.s = np.zeros((rows, width // block), np.float32)

    def quantize(self, x: np.ndarray, threaded: bool = False) -> None:
        """x's rows into the buffers; `threaded`: by the twin over the worker's threads (what
        row_threads.over_threads says for the product's size, decided once per product)."""
        if self.partner is Partner.Q8_K:
            quantize = quantizers.quantize_q8_k_parallel if threaded else quantizers.quantize_q8_k
            quantize(x, self.q, self.d, self.sums)
        else:
            quantize = quantizers.quantize_q8_0_parallel if threaded else quantizers.quantize_q8_0
            quantize(x, self.q, self.d, self.sums, self.s, self.partner is Partner.Q8_1)


def takes(fmt: str, width: int, lanes: int) -> bool:
    """Whether the integer products take a weight of format `fmt` with rows `width` values long."""
    spec = INT_FORMATS.get(fmt)
    return spec is not None and lanes == LANES and width % ACTIVATION_BLOCK[spec.partner] == 0


_BUFFERS = threading.local()


def activations_for(partner: Partner, rows: int, width: int) -> Activations:
    """The running thread's activation buffers for rows of `width`, made on first use: a
    thread's products run one at a time, each quantizing then multiplying, so they share them
    (one per product would hold every product's: a prefill's 30 layers x 4 products x rows x
    width bytes)."""
    held = getattr(_BUFFERS, "held", None)
    if held is None:
        held = _BUFFERS.held = {}
    key = (partner, rows, width)
    found = held.get(key)
    if found is None:
        found = held[key] = Activations(partner, rows, width)
    return found


def product(fmt: str, rows: int, width: int, threads: int = 1):
    """A function (x (rows, width) float32, w, out (rows, groups * 64), addend=None) running the
    product, plus `addend` (out's shape and type) where given, on the running thread's activation
    buffers (activations_for), over `threads` threads, asking for the weight's rows ahead_bytes
    on. w is packed (packing.py) where `packs(fmt)`."""
    spec = INT_FORMATS[fmt]
    code, partner, ahead = spec.code, spec.partner, ahead_bytes(fmt)
    threaded = over_threads(rows * width, threads)
    if spec.scales is None:

        def run_legacy(x, w, out, addend=None):
            act = activations_for(partner, rows, width)
            act.quantize(x, threaded)
            adds = addend is not None
            legacy_rows(code, act.q, act.d, act.sums, act.s, w, ahead, threads, out, addend if adds else out, adds)

        return run_legacy

    def run_k(x, w, out, addend=None):
        act = activations_for(partner, rows, width)
        act.quantize(x, threaded)
        adds = addend is not None
        k_rows(code, act.q, act.d, act.sums, w, ahead, threads, out, addend if adds else out, adds)

    return run_k
