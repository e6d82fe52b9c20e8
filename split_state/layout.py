"""Which parts of the global tensor a device holds, and where they sit in its local tensor.

`pieces` is the one function that answers this; scatter, gather, collectives, kernels and tests
all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from split_state.states import Split, State, holds, validate


@dataclass(frozen=True)
class Piece:
    """A contiguous run along `axis` (None: the whole tensor).

    Global indices [global_start, global_stop) sit at local indices [local_start, local_start+len).
    """

    axis: int | None
    global_start: int
    global_stop: int
    local_start: int

    @property
    def length(self) -> int:
        return self.global_stop - self.global_start

    def global_index(self, ndim: int) -> tuple[slice, ...]:
        return _index(self.axis, ndim, self.global_start, self.global_stop)

    def local_index(self, ndim: int) -> tuple[slice, ...]:
        return _index(self.axis, ndim, self.local_start, self.local_start + self.length)


def _index(axis: int | None, ndim: int, start: int, stop: int) -> tuple[slice, ...]:
    if axis is None:
        return (slice(None),) * ndim
    return (slice(None),) * axis + (slice(start, stop),) + (slice(None),) * (ndim - axis - 1)


def pieces(state: State, shape: Sequence[int], n_devices: int, device: int) -> tuple[Piece, ...]:
    """The non-empty pieces device `device` holds, in local order (none outside the state's group)."""
    validate(state, shape, n_devices)
    if not 0 <= device < n_devices:
        raise IndexError(f"device {device} out of range for {n_devices} devices")
    if not holds(state, device):
        return ()
    if not isinstance(state, Split):
        return (Piece(None, 0, 0, 0),)
    out = []
    segment_start = 0
    local = 0
    for seg in state.segments:
        start = segment_start + sum(seg[:device])
        length = seg[device]
        if length:
            out.append(Piece(state.axis, start, start + length, local))
        local += length
        segment_start += sum(seg)
    return tuple(out)


def local_shape(state: State, shape: Sequence[int], n_devices: int, device: int) -> tuple[int, ...]:
    """Device `device`'s local tensor's shape: empty on every axis outside the state's group."""
    validate(state, shape, n_devices)
    shape = tuple(int(s) for s in shape)
    if not holds(state, device):
        return (0,) * len(shape)
    if not isinstance(state, Split):
        return shape
    return shape[: state.axis] + (state.extent(device),) + shape[state.axis + 1 :]


Box = tuple[slice, ...]


def intersect(a: Piece, b: Piece, ndim: int) -> Box | None:
    """The global box two pieces share (each piece restricts at most one axis), or None."""
    box = [slice(None)] * ndim
    for p in (a, b):
        if p.axis is None:
            continue
        cur = box[p.axis]
        lo = max(p.global_start, cur.start or 0)
        hi = p.global_stop if cur.stop is None else min(p.global_stop, cur.stop)
        if lo >= hi:
            return None
        box[p.axis] = slice(lo, hi)
    return tuple(box)


def to_local(piece: Piece, box: Box) -> Box:
    """Translate a global box inside `piece` into the holder's local coordinates."""
    if piece.axis is None:
        return box
    s = box[piece.axis]
    start = 0 if s.start is None else s.start
    stop = piece.global_stop if s.stop is None else s.stop
    shift = piece.local_start - piece.global_start
    return box[: piece.axis] + (slice(start + shift, stop + shift),) + box[piece.axis + 1 :]


def box_shape(box: Box, shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(box, shape))
