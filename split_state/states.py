"""Split states: how the values of one tensor are spread over N devices.

`Split(axis, segments)`: `segments[s][d]` is the extent of segment `s` on device `d`. Along `axis`
the global tensor is `seg0 | seg1 | ...` and segment `s` is `dev0 chunk | dev1 chunk | ...`; device
`d` holds the concatenation of its chunks. Axes follow NumPy (axis 0 is outermost); ggml's AXIS_k of
an n-d tensor is NumPy axis n-1-k.

`Mirrored()`: every device holds the whole tensor, bitwise identical.
`Partial()`: every device holds a full-shape tensor; the value is their sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from split_state.errors import SplitError


@dataclass(frozen=True)
class Mirrored:
    def __str__(self) -> str:
        return "M"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Split:
    axis: int
    segments: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.axis, int) or isinstance(self.axis, bool) or self.axis < 0:
            raise SplitError(f"Split axis must be a non-negative int, got {self.axis!r}")
        try:
            segments = tuple(tuple(_as_int(e) for e in seg) for seg in self.segments)
        except (TypeError, ValueError) as exc:
            raise SplitError(f"Split segments must be a sequence of sequences of ints, got {self.segments!r}") from exc
        if not segments:
            raise SplitError("Split needs at least one segment")
        n = len(segments[0])
        if n == 0:
            raise SplitError("Split segments need at least one device extent")
        if any(len(seg) != n for seg in segments):
            raise SplitError(f"every segment must list one extent per device; got lengths {[len(s) for s in segments]}")
        if any(e < 0 for seg in segments for e in seg):
            raise SplitError(f"Split extents must be >= 0, got {segments}")
        object.__setattr__(self, "segments", segments)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def even(cls, axis: int, sizes: int | Sequence[int], n_devices: int, granularity: int = 1) -> Split:
        """An even split of one segment (`sizes` an int) or several (`sizes` a sequence).

        Each segment is cut in units of `granularity` (a head size, a quantization block); the
        remainder goes one unit each to the first devices, so no device gets more than one unit
        extra. Devices beyond the number of units get zero extents.
        """
        if n_devices < 1:
            raise SplitError(f"need at least one device, got n_devices={n_devices}")
        if granularity < 1:
            raise SplitError(f"granularity must be >= 1, got {granularity}")
        seg_sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
        segments = []
        for size in seg_sizes:
            if size < 0 or size % granularity:
                raise SplitError(
                    f"segment size {size} is not a non-negative multiple of granularity {granularity}; "
                    f"pad the axis or choose a granularity that divides it"
                )
            base, extra = divmod(size // granularity, n_devices)
            segments.append(tuple((base + (d < extra)) * granularity for d in range(n_devices)))
        return cls(axis, tuple(segments))

    # -- derived values ----------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return len(self.segments[0])

    @property
    def size(self) -> int:
        return sum(sum(seg) for seg in self.segments)

    def extent(self, device: int) -> int:
        """Total extent device `device` holds along the axis (all its chunks)."""
        return sum(seg[device] for seg in self.segments)

    def with_axis(self, axis: int) -> Split:
        return Split(axis, self.segments)

    def scaled(self, numerator: int, denominator: int = 1) -> Split:
        """Every extent multiplied by numerator/denominator (exact, or SplitError)."""
        new = []
        for seg in self.segments:
            row = []
            for e in seg:
                if (e * numerator) % denominator:
                    raise SplitError(f"extent {e} of {self} is not divisible by {denominator}")
                row.append(e * numerator // denominator)
            new.append(tuple(row))
        return Split(self.axis, tuple(new))

    def __str__(self) -> str:
        return f"S{self.axis}[" + ",".join("|".join(str(e) for e in seg) for seg in self.segments) + "]"


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"not an int: {value!r}")
    return int(value)


State = Split | Mirrored | Partial
MIRRORED = Mirrored()
PARTIAL = Partial()


def validate(state: State, shape: Sequence[int], n_devices: int, name: str = "tensor") -> None:
    """The one check that a state fits a global shape on `n_devices`; raises SplitError."""
    if n_devices < 1:
        raise SplitError(f"{name}: need at least one device, got {n_devices}")
    if isinstance(state, (Mirrored, Partial)):
        return
    if not isinstance(state, Split):
        raise SplitError(f"{name}: not a split state: {state!r}")
    shape = tuple(shape)
    if state.axis >= len(shape):
        raise SplitError(f"{name}: {state} splits axis {state.axis} but shape {shape} has only {len(shape)} axes")
    if state.n_devices != n_devices:
        raise SplitError(
            f"{name}: {state} lists extents for {state.n_devices} devices but the device count is {n_devices}"
        )
    if state.size != shape[state.axis]:
        raise SplitError(
            f"{name}: {state} extents sum to {state.size} but shape {shape} has {shape[state.axis]} "
            f"along axis {state.axis}; use Split.even({state.axis}, {shape[state.axis]}, {n_devices}) "
            f"or give extents that sum to {shape[state.axis]}"
        )


def encode_state(state: State) -> list:
    """A msgpack-friendly form: ["S", axis, segments] | ["M"] | ["P"]."""
    if isinstance(state, Split):
        return ["S", state.axis, [list(seg) for seg in state.segments]]
    return ["M"] if isinstance(state, Mirrored) else ["P"]


def decode_state(value: object) -> State:
    """Inverse of encode_state; raises SplitError on anything malformed."""
    if isinstance(value, (list, tuple)) and value:
        tag = value[0]
        if tag == "M" and len(value) == 1:
            return MIRRORED
        if tag == "P" and len(value) == 1:
            return PARTIAL
        if tag == "S" and len(value) == 3 and isinstance(value[2], (list, tuple)):
            if not all(isinstance(seg, (list, tuple)) and all(type(e) is int for e in seg) for seg in value[2]):
                raise SplitError(f"malformed split segments: {value[2]!r}")
            return Split(value[1], tuple(tuple(seg) for seg in value[2]))
    raise SplitError(f"malformed split state: {value!r}")
