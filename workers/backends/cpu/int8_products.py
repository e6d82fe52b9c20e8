"""Products of block-quantized weights with 8-bit activations, as llama.cpp's CPU backend computes
them: each activation row quantized once per product into the format's partner type
(activations.py), integer dot products per block (u8 quants times s8 activations into int32:
vpdpbusd with AVX-512 VNNI, vector_ir.py), then one float scale per block (and K-quants' integer
sub-block scales applied in int32 first). For every block format of formats.INT_FORMATS, for
any number of activation rows: four at a time (each weight value row made once for four
activation rows: a prefill's rows, a batch's decode step) and one at a time for the rest.

A block's integer sums are exact, so these products equal the NumPy model of the same arithmetic
(tests/test_int8_products.py) to float32 rounding of the per-block sums. Against the float32
products (the exact path, `activations="f32"`) they differ by the activations' 8-bit rounding,
as llama.cpp's do.

Weights keep the workers' interleaved layout (split_state/quant.py) with 64 lanes: a byte row of
a block is one 512-bit vector. (Other lane counts, from splits into extents that are not whole
multiples of 64 rows, take the float32 loops.)
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from split_state.quant import FORMATS
from workers.backends.cpu import vector_ir as vir
from workers.backends.cpu.activations import quantize_q8_0, quantize_q8_k
from workers.backends.cpu.formats import ACTIVATION_BLOCK, INT_FORMATS, SUM_SPAN, Partner

LANES = 64
# Each byte row of the block PREFETCH_BYTES on (whole blocks) is asked for as the block is read:
# the blocks' rows are read out of order (sub-block by sub-block, the scales last), and the
# hardware's prefetcher alone fed a K-quant product from DRAM at 9.5 GB/s. 16384 bytes ahead:
# 16,384 x 2,048 products streamed from DRAM, one / two threads, q4_k 26 / 34 GB/s, q4_0 34 /
# 42-52 (one block ahead: 28 / 31 and 31 / 30; 32 and 64 KiB ahead no better); the machine's
# plain read 40 / 46 GB/s.
PREFETCH_BYTES = 16384
QUAD = 4  # activation rows per pass over a block's value rows


def _block_code(builder, fmt, rows: int, lanes: int, isa: int, at: dict) -> None:
    """One block of `fmt` against `rows` activation rows: for row r, out[r, 0, :] = the sum over
    sub-blocks s of scale_s * (sum of q * x_q over s - bias * the activation sum of s) (scale 1 for
    the legacy formats) and, where the format has minimums, out[r, 1, :] = the sum of min_s * the
    activation sum of s. `at` holds the IR values: pointers and offsets. Each sub-block reads the
    block's bytes anew (vector_ir.load_once) and adds its sums into `out`, so no more than one
    sub-block's vectors are live at once."""
    x8, sums, out = at["x8"], at["sums"], at["out"]
    size = FORMATS[fmt.name].block_bytes * lanes  # the same byte row PREFETCH_BYTES on
    ahead = size * -(-PREFETCH_BYTES // size)
    fetched = set()
    wide = vir.vector(vir.I8, lanes)

    def rows_of():
        """A reader of the block's byte rows that reads each once (vector_ir.load_once)."""
        read = {}

        def row(p):  # byte p of the block, of every lane (and the next block's asked for)
            if p not in read:
                offset = builder.add(at["w_at"], ir.Constant(at["w_at"].type, p * lanes))
                if p not in fetched:
                    fetched.add(p)
                    vir.prefetch(builder, at["w"], builder.add(offset, ir.Constant(offset.type, ahead)))
                read[p] = vir.load_once(builder, at["w"], offset, wide)
            return read[p]

        return row

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

    block = ACTIVATION_BLOCK[fmt.partner] if fmt.scales is not None else fmt.sub
    subs = block // fmt.sub
    for s in range(subs):
        row = rows_of()
        accs = [vir.zeros(lanes, isa) for _ in range(rows)]
        for v in range(s * fmt.sub, (s + 1) * fmt.sub, 4):
            values = [fmt.value_row(builder, row, v + k) for k in range(4)]
            accs = vir.dot4(builder, accs, values, [activation_word(r, v) for r in range(rows)], isa)
        scale = vir.chunks(builder, fmt.scales(builder, row, s)[0], isa) if fmt.scales is not None else None
        for r in range(rows):
            sub_sums = accs[r]
            if fmt.bias:
                total = vir.splat(builder, activation_sum(r, s), sub_sums[0].type.count)
                biased = builder.mul(total, ir.Constant(total.type, [fmt.bias] * total.type.count))
                sub_sums = [builder.sub(a, biased) for a in sub_sums]
            if scale is not None:
                sub_sums = [builder.mul(a, c) for a, c in zip(sub_sums, scale)]
            add_into(r, 0, sub_sums, s == 0)
    if fmt.scales is None:
        return
    row = rows_of()
    minimums = [fmt.scales(builder, row, s)[1] for s in range(subs)]
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


def block_sums(family: tuple[str, ...], rows: int, lanes: int = LANES, isa: int = vir.ISA):
    """An intrinsic `sums(code, w, w_at, x8, x_at, x_stride, sums, sums_at, sums_stride, out)`
    running _block_code for the format whose code is `code` (one of `family`'s, a switch in the
    code): w the weight (uint8, 64 lanes), w_at the block's first byte; x8 (int8) the activation
    rows from element x_at, x_stride apart; sums (int32) their partner sums from sums_at,
    sums_stride apart; out int32 (rows, 2, lanes)."""
    formats = [INT_FORMATS[name] for name in family]

    @intrinsic
    def sums_of_block(typingctx, code, w, w_at, x8, x_at, x_stride, sums, sums_at, sums_stride, out):
        i64 = types.int64
        signature = types.void(i64, w, i64, x8, i64, i64, sums, i64, i64, out)

        def codegen(context, builder, sig, args):
            def data(i):
                array = context.make_array(sig.args[i])(context, builder, args[i])
                return builder.bitcast(array.data, ir.IntType(8).as_pointer())

            at = {"w": data(1), "w_at": args[2], "x8": data(3), "x_at": args[4], "x_stride": args[5]}
            at |= {"sums": data(6), "sums_at": args[7], "sums_stride": args[8], "out": data(9)}
            end = builder.append_basic_block("block_sums.end")
            switch = builder.switch(args[0], end)
            for fmt in formats:
                case = builder.append_basic_block(f"block_sums.{fmt.name}")
                switch.add_case(ir.Constant(args[0].type, fmt.code), case)
                builder.position_at_end(case)
                _block_code(builder, fmt, rows, lanes, isa, at)
                builder.branch(end)
            builder.position_at_end(end)
            return context.get_dummy_value()

        return signature, codegen

    return sums_of_block


LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
K_QUANTS = ("q4_k", "q5_k", "q6_k")
_legacy_quad, _legacy_one = block_sums(LEGACY, QUAD), block_sums(LEGACY, 1)
_k_quad, _k_one = block_sums(K_QUANTS, QUAD), block_sums(K_QUANTS, 1)

parallel = numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
inline = numba.njit(cache=True, nogil=True, fastmath=True, inline="always")


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
def _scratch(rows, lanes):
    """A row group's float sums (rows, lanes), integer block sums, and its two factors' lanes."""
    part = np.zeros((QUAD, 2, lanes), np.int32)
    return np.zeros((rows, lanes), np.float32), part, np.empty(lanes, np.float32), np.zeros(lanes, np.float32)


@parallel
def legacy_rows(code, x8, d, sums, s, w, out):
    """out (rows, groups * 64) = the rows of x8 (rows, width) int8 times the weight's rows, for
    legacy format `code`: each block's d_w * d_x * (its integer sum) (+ m_w * s_x for q4_1 and
    q5_1), d (rows, blocks), sums and s the partner's (activations.quantize_q8_0)."""
    rows, width = x8.shape
    groups, blocks, size, lanes = w.shape
    with_min = code == 1 or code == 3
    for g in numba.prange(groups):
        acc, part, dw, mw = _scratch(rows, lanes)
        for b in range(blocks):
            at = (g * blocks + b) * size * lanes
            _factors(w, g, b, 0, dw)
            if with_min:
                _factors(w, g, b, 2, mw)
            i = 0
            while i < rows:
                count = QUAD if i + QUAD <= rows else 1
                if count == QUAD:
                    _legacy_quad(code, w, at, x8, i * width + b * 32, width, sums, i * blocks + b, blocks, part)
                else:
                    _legacy_one(code, w, at, x8, i * width + b * 32, width, sums, i * blocks + b, blocks, part)
                for r in range(count):
                    f, m = d[i + r, b], s[i + r, b]
                    for lane in range(lanes):
                        acc[i + r, lane] += dw[lane] * f * np.float32(part[r, 0, lane]) + mw[lane] * m
                i += count
        out[:, g * lanes : (g + 1) * lanes] = acc


@parallel
def k_rows(code, x8, d, sums, w, out):
    """legacy_rows for the K-quants (`code` 5 q4_k, 6 q5_k, 7 q6_k): each block's d_x * (d_w * (its
    sub-blocks' integer sums times their scales) - dmin_w * (its minimums times the activation's
    sub-block sums)); d (rows, blocks) and sums (rows, width / 16) are Q8_K's."""
    rows, width = x8.shape
    groups, blocks, size, lanes = w.shape
    q6 = code == 7
    d_at = 208 if q6 else 0
    for g in numba.prange(groups):
        acc, part, dw, dmin = _scratch(rows, lanes)
        for b in range(blocks):
            at = (g * blocks + b) * size * lanes
            _factors(w, g, b, d_at, dw)
            if not q6:  # (q6_k's minimum sums stay 0: _scratch's)
                _factors(w, g, b, 2, dmin)
            i = 0
            while i < rows:
                count = QUAD if i + QUAD <= rows else 1
                sums_at, stride = i * blocks * 16 + b * 16, blocks * 16
                if count == QUAD:
                    _k_quad(code, w, at, x8, i * width + b * 256, width, sums, sums_at, stride, part)
                else:
                    _k_one(code, w, at, x8, i * width + b * 256, width, sums, sums_at, stride, part)
                for r in range(count):
                    f = d[i + r, b]
                    for lane in range(lanes):
                        acc[i + r, lane] += f * (
                            dw[lane] * np.float32(part[r, 0, lane]) - dmin[lane] * np.float32(part[r, 1, lane])
                        )
                i += count
        out[:, g * lanes : (g + 1) * lanes] = acc


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
    """A product's quantized activation rows, made once per run into buffers held by its plan."""

    def __init__(self, partner: Partner, rows: int, width: int):
        block = ACTIVATION_BLOCK[partner]
        self.partner = partner
        self.q = np.empty((rows, width), np.int8)
        self.d = np.empty((rows, width // block), np.float32)
        self.sums = np.empty((rows, width // SUM_SPAN[partner]), np.int32)
        self.s = np.zeros((rows, width // block), np.float32)

    def quantize(self, x: np.ndarray) -> None:
        if self.partner is Partner.Q8_K:
            quantize_q8_k(x, self.q, self.d, self.sums)
        else:
            quantize_q8_0(x, self.q, self.d, self.sums, self.s, self.partner is Partner.Q8_1)


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


def product(fmt: str, rows: int, width: int):
    """A function (x (rows, width) float32, w, out (rows, groups * 64)) running the product on
    the running thread's activation buffers (activations_for)."""
    spec = INT_FORMATS[fmt]
    code, partner = spec.code, spec.partner
    if spec.scales is None:

        def run_legacy(x, w, out):
            act = activations_for(partner, rows, width)
            act.quantize(x)
            legacy_rows(code, act.q, act.d, act.sums, act.s, w, out)

        return run_legacy

    def run_k(x, w, out):
        act = activations_for(partner, rows, width)
        act.quantize(x)
        k_rows(code, act.q, act.d, act.sums, w, out)

    return run_k
