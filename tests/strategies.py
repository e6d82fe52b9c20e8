"""Hypothesis strategies shared by the tests: shapes, device counts and split states."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from split_state import MIRRORED, PARTIAL, Split


@st.composite
def composition(draw, total: int, parts: int) -> tuple[int, ...]:
    """`parts` non-negative ints summing to `total` (zeros allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return tuple(bounds[i + 1] - bounds[i] for i in range(parts))


@st.composite
def split_for(draw, shape: tuple[int, ...], n: int, axis: int | None = None) -> Split:
    if axis is None:
        axis = draw(st.integers(0, len(shape) - 1))
    n_segments = draw(st.integers(1, 4))
    seg_sizes = draw(composition(shape[axis], n_segments))
    return Split(axis, tuple(draw(composition(size, n)) for size in seg_sizes))


@st.composite
def state_for(draw, shape: tuple[int, ...], n: int, partial: bool = True):
    kinds = ["M", "P", "S"] if partial else ["M", "S"]
    kind = draw(st.sampled_from(kinds if shape else [k for k in kinds if k != "S"]))
    if kind == "M":
        return MIRRORED
    if kind == "P":
        return PARTIAL
    return draw(split_for(shape, n))


shapes = st.lists(st.integers(0, 6), min_size=1, max_size=4).map(tuple)
devices = st.integers(1, 16)
dtypes = st.sampled_from([np.float32, np.float16, np.int32])


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-50, 50, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)
