"""The CPU backend's row per block format for the integer products (ggml's `type_traits_cpu`):
how the format's quants read as unsigned bytes, its activation partner, and its sub-blocks.
Adding a format to the integer path is a row here, its value rows in the family's file
(legacy_blocks.py, k_blocks.py) and its tests (tests/test_int8_products.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from split_state.quant import FORMATS
from workers.backends.cpu import k_blocks, legacy_blocks


class Partner(Enum):
    """llama.cpp's 8-bit activation types (ggml-quants.c, arch/x86/quants.c)."""

    Q8_0 = "q8_0"  # 32 values: float16 d = max|x| / 127, q = round-half-even(x * 127 / max|x|)
    Q8_1 = "q8_1"  # Q8_0 and s = float16(d * sum q) (for formats with a minimum)
    Q8_K = "q8_k"  # 256 values: float32 d = max / -127 (max the value of largest |x|), sums of each 16


@dataclass(frozen=True)
class Transposed:
    """How a format's values are made from its byte rows after their transpose, for a one-row
    product whose sub-blocks share byte rows (int8_products._Block.shares): each byte row is
    transposed once for every sub-block of a pass (byte operations commute with a permute of the
    bytes), where each four values' rows were made, then transposed, one four at a time."""

    sources: Callable  # v -> (p, ...): values v .. v + 3 are made from byte rows p .. p + 3 of each p
    value: Callable  # (builder, the sources' transposed pieces in that order, v) -> the values' piece
    passes: tuple[tuple[int, ...], ...]  # the sub-blocks of each pass: those sharing their rows


@dataclass(frozen=True)
class Repeated:
    """How one sub-block's code serves others of the block in a one-row product where each
    sub-block is made alone (AVX2, the generic code): sub-blocks whose values and scales come
    from a template's byte rows moved by whole rows, region by region, with the same byte
    operations. The block's code is then each class's template, run once for every sub-block of
    its class (int8_products.one_row_by_classes), where it was every sub-block's own code: q6_k's
    block unrolled is some 4,700 instructions, past a core's cache of decoded instructions, and
    the same work from an eighth of the code ran 1.25-1.3x as fast (int8_products.BY_CLASSES'
    comment; the VM had no counters to show which stage waited)."""

    regions: tuple[int, ...]  # byte rows regions[i] .. regions[i + 1] - 1 move together
    classes: tuple[tuple[int, ...], ...]  # the sub-blocks one code makes, its template first
    moves: Callable  # (template, sub-block) -> the rows each region moves by

    def region(self, p: int) -> int | None:
        """The region byte row p lies in; None for rows that never move (the float factors)."""
        for i in range(len(self.regions) - 1):
            if self.regions[i] <= p < self.regions[i + 1]:
                return i
        return None


@dataclass(frozen=True)
class Packed:
    """Byte rows first .. end - 1 of a block of 64 lanes kept packed (packing.py): each four rows
    from `first` as 64 lanes of four bytes, lane after lane, where the file's interleaved layout
    keeps each row's 64 lanes together. The products read values v .. v + 3 of every lane as
    they are loaded, where from rows each four was transposed first (16 shuffles a four of 64
    lanes with AVX2: with them removed, q4_k's one-row product ran 1.17-1.2x as fast, q6_k
    1.08x, q4_0 1.13-1.34x, 2026-12-02). Values are made from the pieces by the byte operations
    that made them from rows (they commute with moving bytes)."""

    first: int
    end: int
    sources: Callable  # v -> (p, ...): values v .. v + 3 are made from the four rows from each p
    value: Callable  # (builder, the sources' pieces in that order, v) -> the values' piece


@dataclass(frozen=True)
class IntFormat:
    name: str
    code: int  # the intrinsic's compile-time selector
    partner: Partner
    value_row: Callable  # (builder, row, v) -> the <lanes x i8> unsigned quant of value v
    sub: int  # values per integer sum: each scaled by its own factor
    bias: int  # what each unsigned quant exceeds the true one by (times the activation's sum)
    factors: tuple[int, ...]  # bytes of the float16 factors (d, then m or dmin)
    scales: Callable | None = None  # (builder, row, sub-block) -> (scale, min or None), <lanes x i32>
    transposed: Transposed | None = None  # for formats whose sub-blocks share byte rows
    bits: int = 4  # of each unsigned quant (vector_ir.for_format: AVX2's pair sums hold up to 7)
    repeated: Repeated | None = None  # for formats whose sub-blocks' code is a template's moved
    packed: Packed | None = None  # for formats whose quant rows are packed at load

    def __post_init__(self) -> None:  # a sub-block left out would add nothing; one taken twice, twice
        every = list(range(FORMATS[self.name].block // self.sub))
        if self.packed is not None:
            rows = range(self.packed.first, self.packed.end)
            read = {p for v in range(0, FORMATS[self.name].block, 4) for p in self.packed.sources(v)}
            if (self.packed.end - self.packed.first) % 4 or not read <= set(rows[::4]):
                raise ValueError(f"{self.name}: the values are read from rows {sorted(read)}, not fours of {rows}")
        if self.transposed is not None:
            taken = sorted(s for group in self.transposed.passes for s in group)
            if taken != every:
                raise ValueError(f"{self.name}: the passes take sub-blocks {taken}, not each once")
        if self.repeated is not None:
            taken = sorted(s for group in self.repeated.classes for s in group)
            if taken != every:
                raise ValueError(f"{self.name}: the classes take sub-blocks {taken}, not each once")


_Q4_K = Transposed(k_blocks.q4_k_sources, k_blocks.q4_k_transposed, k_blocks.Q4_K_PASSES)
_Q6_K = Transposed(k_blocks.q6_k_sources, k_blocks.q6_k_transposed, k_blocks.Q6_K_PASSES)


def _nibbles_packed(first: int) -> Packed:
    return Packed(first, first + 16, legacy_blocks.nibble_sources(first), legacy_blocks.nibble_piece)


def _fifth_bits_packed(word: int) -> Packed:
    """q5_0 / q5_1: the fifth bits' word (one four) and the nibbles after it."""
    return Packed(word, word + 20, legacy_blocks.fifth_bit_sources(word, word + 4), legacy_blocks.fifth_bit_piece)


_Q8_0_PACKED = Packed(2, 34, lambda v: (2 + v,), legacy_blocks.q8_0_piece)
_Q4_K_PACKED = Packed(16, 144, k_blocks.q4_k_sources, k_blocks.q4_k_transposed)
_Q5_K_PACKED = Packed(16, 176, k_blocks.q5_k_sources, k_blocks.q5_k_transposed)
_Q6_K_PACKED = Packed(0, 192, k_blocks.q6_k_sources, k_blocks.q6_k_transposed)
_Q4_K_REPEATED = Repeated(k_blocks.Q4_K_REGIONS, k_blocks.Q4_K_CLASSES, k_blocks.q4_k_moves)
_Q6_K_REPEATED = Repeated(k_blocks.Q6_K_REGIONS, k_blocks.Q6_K_CLASSES, k_blocks.q6_k_moves)
INT_FORMATS = {
    f.name: f
    for f in (
        IntFormat("q4_0", 0, Partner.Q8_0, legacy_blocks.q4_0, 32, 8, (0,), bits=4, packed=_nibbles_packed(2)),
        IntFormat("q4_1", 1, Partner.Q8_1, legacy_blocks.q4_1, 32, 0, (0, 2), bits=4, packed=_nibbles_packed(4)),
        IntFormat("q5_0", 2, Partner.Q8_0, legacy_blocks.q5_0, 32, 16, (0,), bits=5, packed=_fifth_bits_packed(2)),
        IntFormat("q5_1", 3, Partner.Q8_1, legacy_blocks.q5_1, 32, 0, (0, 2), bits=5, packed=_fifth_bits_packed(4)),
        IntFormat("q8_0", 4, Partner.Q8_0, legacy_blocks.q8_0, 32, 128, (0,), bits=8, packed=_Q8_0_PACKED),
        IntFormat(
            "q4_k",
            5,
            Partner.Q8_K,
            k_blocks.q4_k,
            32,
            0,
            (0, 2),
            k_blocks.k4_scales,
            _Q4_K,
            4,
            _Q4_K_REPEATED,
            _Q4_K_PACKED,
        ),
        IntFormat(
            "q5_k", 6, Partner.Q8_K, k_blocks.q5_k, 32, 0, (0, 2), k_blocks.k4_scales, bits=5, packed=_Q5_K_PACKED
        ),
        IntFormat(
            "q6_k",
            7,
            Partner.Q8_K,
            k_blocks.q6_k,
            16,
            32,
            (208,),
            k_blocks.q6_k_scales,
            _Q6_K,
            6,
            _Q6_K_REPEATED,
            _Q6_K_PACKED,
        ),
    )
}
BY_CODE = {f.code: f for f in INT_FORMATS.values()}
ACTIVATION_BLOCK = {Partner.Q8_0: 32, Partner.Q8_1: 32, Partner.Q8_K: 256}
SUM_SPAN = {Partner.Q8_0: 32, Partner.Q8_1: 32, Partner.Q8_K: 16}  # values per stored activation sum
