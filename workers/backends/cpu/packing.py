"""Weights of the integer products packed at load, in place: each block's quant rows (formats.Packed)
as the four-byte pieces the products multiply, where the workers' interleaved layout
(split_state/quant.py) keeps each byte row's 64 lanes together and the products transposed every
four rows (llama.cpp repacks its Q4_0 and Q4_K weights at load for the same reason).

Rows p .. p + 3 of a block's 64 lanes (256 bytes at p * 64) become lane 0's four bytes, lane 1's,
..., lane 63's, in the same 256 bytes: a permutation within them, so the weight keeps its size,
its shape and its split (whole groups of 64 rows, whole blocks), and packing is undone exactly.

A worker packs a weight the first time an integer product takes it (numba_cpu's qmatmul plan)
and marks it here; every other reader of its bytes on the CPU backend asks (`layout_of`): the
table lookups read the packed rows where they lie (`byte_map`), the float32 products unpack it
first (`ensure_interleaved`), a copy for the coordinator is unpacked (`interleaved_copy`). The
mark is the memory's: a weight is known by its owner (the array whose memory it is, alive) and
its bytes' span, so views of it agree and freed memory is forgotten with its array. A view that
overlaps a packed span without being it is refused (it would read bytes in the wrong layout).
"""

from __future__ import annotations

import functools
import importlib
import threading
import weakref

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # NumPy 1
    byte_bounds = np.byte_bounds

from split_state.errors import ShapeError

LANES = 64  # the products' lanes (int8_products.LANES): packing is for them alone


def packed_rows(fmt: str) -> tuple[int, int] | None:
    from workers.backends.cpu.formats import INT_FORMATS  # (llvmlite's: only where numba is)

    spec = INT_FORMATS.get(fmt)
    return None if spec is None or spec.packed is None else (spec.packed.first, spec.packed.end)


def _permute(w: np.ndarray, fmt: str, pack: bool) -> None:
    first, end = packed_rows(fmt)
    groups, blocks, size, lanes = w.shape
    if lanes != LANES or not w.flags.c_contiguous or w.dtype != np.uint8:
        raise ShapeError(f"a packed {fmt} weight is contiguous uint8 of {LANES} lanes, not {w.dtype} {w.shape}")
    loops = importlib.import_module("workers.backends.cpu.numba_loops")  # (where products pack: numba's)
    loops.permute_fours(w.reshape(groups * blocks, size * lanes), first, end, pack)


def pack(w: np.ndarray, fmt: str) -> None:
    """w (groups, blocks, block bytes, 64) of format `fmt` packed in place (no mark: `ensure_packed`)."""
    _permute(w, fmt, True)


def unpack(w: np.ndarray, fmt: str) -> None:
    """`pack` undone, in place."""
    _permute(w, fmt, False)


class _Marks:
    """The packed spans of memory: owner id -> (weakref to the owner, {(start, nbytes): format})."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_owner: dict[int, tuple[weakref.ref, dict[tuple[int, int], str]]] = {}
        self.changes = 0  # marks made or taken back so far (layout_changes)

    @staticmethod
    def owner(w: np.ndarray) -> np.ndarray | None:
        """The array whose memory w is, or None where no NumPy array owns it (a buffer's view)."""
        base = w
        while isinstance(base.base, np.ndarray):
            base = base.base
        return base if base.base is None else None

    def spans(self, owner: np.ndarray) -> dict[tuple[int, int], str]:
        held = self.by_owner.get(id(owner))
        return {} if held is None or held[0]() is not owner else held[1]

    def mark(self, owner: np.ndarray, span: tuple[int, int], fmt: str) -> None:
        held = self.by_owner.get(id(owner))
        if held is None or held[0]() is not owner:
            key = id(owner)
            held = self.by_owner[key] = (weakref.ref(owner, lambda _, key=key: self.by_owner.pop(key, None)), {})
        held[1][span] = fmt
        self.changes += 1

    def unmark(self, owner: np.ndarray, span: tuple[int, int]) -> None:
        self.spans(owner).pop(span, None)
        self.changes += 1


_MARKS = _Marks()


def _span(w: np.ndarray) -> tuple[int, int]:
    """(first byte, bytes to the last) of the memory w's elements lie in."""
    low, high = byte_bounds(w)
    return low, high - low


def layout_changes() -> int:
    """How many times a weight has been packed or unpacked in this process: where it has not
    changed since a reader asked layout_of, the answer stands (a planned reader's check, where
    layout_of itself took ~25 us of a decode step, its code and data out of the caches)."""
    return _MARKS.changes


def layout_of(w: np.ndarray) -> str | None:
    """The format w's bytes are packed as, or None where they are the interleaved layout; a view
    overlapping a packed span it is not: ShapeError."""
    if not _MARKS.by_owner:  # (the common case, asked on every host copy)
        return None
    owner = _MARKS.owner(w) if isinstance(w, np.ndarray) else None
    if owner is None:
        return None
    spans = _MARKS.spans(owner)
    if not spans:
        return None
    start, size = span = _span(w)
    found = spans.get(span)
    if found is not None:
        return found
    for (first, nbytes), fmt in spans.items():
        if first < start + size and start < first + nbytes:
            raise ShapeError(
                f"bytes {start}..{start + size} overlap a {fmt} weight packed at {first}..{first + nbytes}"
            )
    return None


def ensure_packed(w: np.ndarray, fmt: str) -> bool:
    """Pack w (a weight of `fmt` an integer product takes) in place unless it is; False where it
    cannot be (memory no NumPy array owns, or read-only): the caller keeps the interleaved layout."""
    owner = _MARKS.owner(w)
    if owner is None or not w.flags.writeable or packed_rows(fmt) is None:
        return False
    with _MARKS.lock:
        current = layout_of(w)
        if current == fmt:
            return True
        if current is not None:
            raise ShapeError(f"a weight packed as {current} is read as {fmt}")
        pack(w, fmt)
        _MARKS.mark(owner, _span(w), fmt)
    return True


def ensure_interleaved(w: np.ndarray) -> None:
    """Unpack w in place where it is packed: for a reader of the interleaved layout."""
    if not isinstance(w, np.ndarray):
        return
    with _MARKS.lock:
        fmt = layout_of(w)
        if fmt is not None:
            unpack(w, fmt)
            _MARKS.unmark(_MARKS.owner(w), _span(w))


def interleaved_copy(w):
    """w as the coordinator knows it: an unpacked copy of a packed weight, else w itself."""
    fmt = layout_of(w) if isinstance(w, np.ndarray) else None
    if fmt is None:
        return w
    out = w.copy()
    unpack(out, fmt)
    return out


@functools.cache
def byte_map(size: int, lanes: int, packed_as: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(where, step): byte p of a block's lane l lies at where[p] + l * step[p] of the block's
    size * lanes bytes, interleaved (packed_as None) or packed as that format."""
    where, step = np.arange(size, dtype=np.int64) * lanes, np.ones(size, np.int64)
    if packed_as is not None:
        first, end = packed_rows(packed_as)
        for p in range(first, end):
            four, k = divmod(p - first, 4)
            where[p], step[p] = (first + 4 * four) * lanes + k, 4
    where.flags.writeable = step.flags.writeable = False
    return where, step
