"""Host-side scatter and gather: the reference for moving a global array to and from devices."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from split_state.errors import ConsistencyError, SplitError
from split_state.layout import local_shape, pieces
from split_state.states import Mirrored, Partial, Split, State, holders, holds, validate


def reduce_sum(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Sum in rank order. Workers reduce in the same order, so results agree bit for bit."""
    acc = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        acc += a
    return acc


def extract(array: np.ndarray, state: State, n_devices: int, device: int) -> np.ndarray:
    """Device `device`'s local tensor of `state`, cut from the global `array` (a fresh array).
    Partial puts the value on its first holder and zeros elsewhere: exact, unlike dividing by N.
    A device outside the state's group gets an empty array."""
    if not holds(state, device):
        return np.empty(local_shape(state, array.shape, n_devices, device), dtype=array.dtype)
    if isinstance(state, Partial):
        return array.copy() if device == holders(state, n_devices)[0] else np.zeros_like(array)
    out = np.empty(local_shape(state, array.shape, n_devices, device), dtype=array.dtype)
    for p in pieces(state, array.shape, n_devices, device):
        out[p.local_index(array.ndim)] = array[p.global_index(array.ndim)]
    return out


def scatter(array: np.ndarray, state: State, n_devices: int) -> list[np.ndarray]:
    """Local arrays for every device. Partial puts the value on its first holder and zeros
    elsewhere; devices outside the state's group get empty arrays."""
    array = np.asarray(array)
    validate(state, array.shape, n_devices)
    return [extract(array, state, n_devices, d) for d in range(n_devices)]


def global_shape(locals_: Sequence[np.ndarray], state: State) -> tuple[int, ...]:
    shape = list(locals_[holders(state, len(locals_))[0]].shape)
    if isinstance(state, Split):
        if state.axis >= len(shape):
            raise SplitError(f"{state} does not fit local shape {tuple(shape)}")
        shape[state.axis] = state.size
    return tuple(shape)


def gather(locals_: Sequence[np.ndarray], state: State, check_mirrored: bool = False) -> np.ndarray:
    """The global array from every device's local array (Partial: summed in rank order; a
    device outside the state's group contributes nothing)."""
    n = len(locals_)
    if n == 0:
        raise SplitError("gather needs at least one local array")
    if state.on is not None and state.on[-1] >= n:
        raise SplitError(f"{state} names devices beyond the {n} local arrays")
    shape = global_shape(locals_, state)
    validate(state, shape, n)
    for d, local in enumerate(locals_):
        expected = local_shape(state, shape, n, d)
        if tuple(local.shape) != expected:
            raise SplitError(f"device {d} holds shape {tuple(local.shape)}, {state} of {shape} needs {expected}")
    held = [locals_[d] for d in holders(state, n)]
    if isinstance(state, Partial):
        return reduce_sum(held)
    if isinstance(state, Mirrored):
        if check_mirrored:
            check_identical(held)
        return np.array(held[0], copy=True)
    out = np.empty(shape, dtype=locals_[0].dtype)
    for d, local in enumerate(locals_):
        for p in pieces(state, shape, n, d):
            out[p.global_index(len(shape))] = local[p.local_index(len(shape))]
    return out


def check_identical(locals_: Sequence[np.ndarray]) -> None:
    """Mirrored copies must agree bit for bit (NaNs included, hence the byte view)."""
    first = _bytes(locals_[0])
    for d, local in enumerate(locals_[1:], start=1):
        if local.shape != locals_[0].shape or not np.array_equal(_bytes(local), first):
            raise ConsistencyError(f"Mirrored copies differ between device 0 and device {d}")


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
