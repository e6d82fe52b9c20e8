"""Split states: how the values of one tensor are spread over N devices.

`Split(axis, segments)`: `segments[s][d]` is the extent of segment `s` on device `d`. Along `axis`
the global tensor is `seg0 | seg1 | ...` and segment `s` is `dev0 chunk | dev1 chunk | ...`; device
`d` holds the concatenation of its chunks. Axes follow NumPy (axis 0 is outermost); ggml's AXIS_k of
an n-d tensor is NumPy axis n-1-k.

`Mirrored()`: every device holds the whole tensor, bitwise identical.
`Partial()`: every device holds a full-shape tensor; the value is their sum.

Each state may be held by a group of the devices only (`on`, sorted device indices; None: every
device): a layer placed on the workers of one host (`--split layer`) is `Mirrored(on=(2, 3))` or
`Split(1, ((64, 64, 0, 0),), on=(0, 1))`. A device outside the group holds nothing (its local
tensor is empty) and runs nothing for it. `on` never lists every device: that is `on=None`, so
each placement has one spelling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from split_state.errors import SplitError

Group = tuple[int, ...] | None  # the devices that hold a tensor; None: every device


def _group(on: object) -> Group:
    """`on` checked and made canonical: None, or a non-empty sorted tuple of distinct indices."""
    if on is None:
        return None
    try:
        devices = tuple(_as_int(d) for d in on)  # type: ignore[union-attr]
    except (TypeError, ValueError) as exc:
        raise SplitError(f"a state's group must be a sequence of device indices, got {on!r}") from exc
    if not devices or any(d < 0 for d in devices) or list(devices) != sorted(set(devices)):
        raise SplitError(f"a state's group must list distinct device indices >= 0 in order, got {on!r}")
    return devices


def _on_suffix(on: Group) -> str:
    return "" if on is None else "@" + ",".join(str(d) for d in on)


def _on_argument(on: Group) -> str:
    return "" if on is None else f"on={on!r}"


@dataclass(frozen=True)
class Mirrored:
    on: Group = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "on", _group(self.on))

    def __str__(self) -> str:
        return "M" + _on_suffix(self.on)

    def __repr__(self) -> str:
        return f"Mirrored({_on_argument(self.on)})"


@dataclass(frozen=True)
class Partial:
    on: Group = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "on", _group(self.on))

    def __str__(self) -> str:
        return "P" + _on_suffix(self.on)

    def __repr__(self) -> str:
        return f"Partial({_on_argument(self.on)})"


@dataclass(frozen=True)
class Split:
    axis: int
    segments: tuple[tuple[int, ...], ...]
    on: Group = None  # devices outside the group have extent 0 in every segment

    def __post_init__(self) -> None:
        object.__setattr__(self, "on", _group(self.on))
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
        if self.on is not None and any(seg[d] for seg in segments for d in range(n) if d not in self.on):
            raise SplitError(f"Split extents {segments} give rows to devices outside its group {self.on}")
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
        return Split(axis, self.segments, self.on)

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
        return Split(self.axis, tuple(new), self.on)

    def __str__(self) -> str:
        extents = ",".join("|".join(str(e) for e in seg) for seg in self.segments)
        return f"S{self.axis}[{extents}]" + _on_suffix(self.on)

    def __repr__(self) -> str:
        on = _on_argument(self.on)
        return f"Split(axis={self.axis}, segments={self.segments!r}" + (f", {on})" if on else ")")


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
    if not isinstance(state, (Split, Mirrored, Partial)):
        raise SplitError(f"{name}: not a split state: {state!r}")
    if state.on is not None and (state.on[-1] >= n_devices or len(state.on) == n_devices):
        raise SplitError(
            f"{name}: {state} names devices outside 0..{n_devices - 1} or all of them "
            f"(a state held by every device has no group)"
        )
    if isinstance(state, (Mirrored, Partial)):
        return
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


def holders(state: State, n_devices: int) -> tuple[int, ...]:
    """The devices that hold `state`'s tensor, in order."""
    return tuple(range(n_devices)) if state.on is None else state.on


def holds(state: State, device: int) -> bool:
    return state.on is None or device in state.on


def restrict(state: State, universe: Sequence[int]) -> State:
    """`state` seen by the devices of `universe` only (sorted global indices, holding every
    holder of `state`), renumbered 0..len(universe)-1: how a group's collective runs the
    algorithms written for a whole cluster."""
    universe = tuple(universe)
    local = {d: i for i, d in enumerate(universe)}
    if state.on is not None and any(d not in local for d in state.on):
        raise SplitError(f"{state} is held outside the devices {universe}")
    on = None if state.on is None or len(state.on) == len(universe) else tuple(local[d] for d in state.on)
    if isinstance(state, Split):
        return Split(state.axis, tuple(tuple(seg[d] for d in universe) for seg in state.segments), on)
    return type(state)(on)


def widen(state: State, group: Sequence[int], n_devices: int) -> State:
    """The inverse of `restrict(state, group)`: a state over the devices of `group` (numbered
    0..len(group)-1) as a state of all `n_devices`, held by that group."""
    group = tuple(group)
    if len(group) == n_devices:
        return state
    on = group if state.on is None else tuple(group[d] for d in state.on)
    if isinstance(state, Split):
        spread = []
        for seg in state.segments:
            row = [0] * n_devices
            for d, extent in zip(group, seg):
                row[d] = extent
            spread.append(tuple(row))
        return Split(state.axis, tuple(spread), on)
    return type(state)(on)


def encode_state(state: State) -> list:
    """A msgpack-friendly form: ["S", axis, segments] | ["M"] | ["P"], each followed by its group
    where it has one."""
    if isinstance(state, Split):
        out = ["S", state.axis, [list(seg) for seg in state.segments]]
    else:
        out = ["M"] if isinstance(state, Mirrored) else ["P"]
    return out if state.on is None else [*out, list(state.on)]


def decode_state(value: object) -> State:
    """Inverse of encode_state; raises SplitError on anything malformed."""
    if isinstance(value, (list, tuple)) and value:
        tag, size = value[0], 2 if value[0] in ("M", "P") else 4
        on = None
        if len(value) == size:
            on = value[-1]
            if not isinstance(on, (list, tuple)) or not all(type(d) is int for d in on):
                raise SplitError(f"malformed state group: {on!r}")
            value = value[:-1]
        if tag == "M" and len(value) == 1:
            return Mirrored(on)
        if tag == "P" and len(value) == 1:
            return Partial(on)
        if tag == "S" and len(value) == 3 and isinstance(value[2], (list, tuple)):
            if not all(isinstance(seg, (list, tuple)) and all(type(e) is int for e in seg) for seg in value[2]):
                raise SplitError(f"malformed split segments: {value[2]!r}")
            return Split(value[1], tuple(tuple(seg) for seg in value[2]), on)
    raise SplitError(f"malformed split state: {value!r}")
