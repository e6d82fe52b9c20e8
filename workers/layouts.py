"""The strides of a program's views, known at load: which reshapes must copy.

A reshape, a transpose and a slice are views of their input (workers/kernels/basic.py
VIEW_OPS), except a reshape that merges axes a transpose has reordered: NumPy and CuPy then
copy, into memory of their own, every run. The memory plan (workers/program.py) gives such a
reshape a buffer in the arena instead, written by its kernel, so a run allocates nothing and
the arena's pages are the only ones it touches (a 128-token SmolLM2 prefill copied its heads'
merge into ~300 KiB of new memory a layer, 2,000 fresh pages in its first run).

Strides here count elements, not bytes (a view keeps its input's element type). A layout is
known for what a program computes into a buffer of its own (contiguous) and for views of it;
an input's (a weight, a cache) is not, and a reshape of one is left to the array module.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, strides in elements)


def contiguous(shape: Sequence[int]) -> Layout:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(shape), tuple(reversed(strides))


def transposed(layout: Layout, axes: Sequence[int]) -> Layout:
    shape, strides = layout
    return tuple(shape[a] for a in axes), tuple(strides[a] for a in axes)


def reshaped(layout: Layout, new_shape: Sequence[int]) -> Layout | None:
    """The layout of `layout` reshaped to `new_shape` (C order) as a view, or None when no view
    can hold it (a copy). NumPy's rule (_attempt_nocopy_reshape): the axes that merge into or
    split from one another must be contiguous among themselves; axes of size 1 do not count."""
    shape, strides = layout
    new_shape = tuple(int(s) for s in new_shape)
    if prod(shape) != prod(new_shape):
        raise ValueError(f"cannot reshape {shape} to {new_shape}")
    if prod(new_shape) == 0:
        return contiguous(new_shape)
    old = [(s, st) for s, st in zip(shape, strides) if s != 1]
    new_strides = [0] * len(new_shape)
    oi, oj, ni, nj = 0, 1, 0, 1
    while ni < len(new_shape) and oi < len(old):
        n_size, o_size = new_shape[ni], old[oi][0]
        while n_size != o_size:
            if n_size < o_size:
                n_size *= new_shape[nj]
                nj += 1
            else:
                o_size *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):  # the old axes oi..oj-1 become one run: C-contiguous?
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        new_strides[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            new_strides[k - 1] = new_strides[k] * new_shape[k]
        ni, nj, oi, oj = nj, nj + 1, oj, oj + 1
    last = new_strides[ni - 1] if ni else 1
    for k in range(ni, len(new_shape)):  # trailing axes of size 1
        new_strides[k] = last
    return new_shape, tuple(new_strides)
