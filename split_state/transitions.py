"""State-to-state transitions: which collective each takes, what it costs, and how data moves.

The transfer plans here are what workers execute, so the host reference (`apply_reference`) and
the real collectives cannot disagree about who sends which box to whom.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from split_state.layout import Box, box_shape, intersect, pieces, to_local
from split_state.scatter import gather, scatter
from split_state.states import Mirrored, Partial, Split, State, validate


class Collective(enum.Enum):
    NONE = "none"
    LOCAL_SLICE = "local_slice"  # Mirrored -> Split: every device cuts its own pieces
    LOCAL_EMBED = "local_embed"  # -> Partial: device keeps its data, zeros elsewhere
    ALL_GATHER = "all_gather"  # Split -> Mirrored
    ALL_TO_ALL = "all_to_all"  # Split -> Split on another axis, or other extents/segments
    REDUCE_SCATTER = "reduce_scatter"  # Partial -> Split
    ALL_REDUCE = "all_reduce"  # Partial -> Mirrored (reduce-scatter then all-gather)


@dataclass(frozen=True)
class Transition:
    kind: Collective
    bytes_per_device: int  # the most bytes any one device sends

    def __str__(self) -> str:
        return f"{self.kind.value}({self.bytes_per_device} B/dev)"


@dataclass(frozen=True)
class Transfer:
    """Copy `src_box` of device `src`'s local tensor into `dst_box` of device `dst`'s."""

    src: int
    dst: int
    src_box: Box
    dst_box: Box


def classify(src: State, dst: State) -> Collective:
    if src == dst:
        return Collective.NONE
    if isinstance(dst, Partial):
        return Collective.NONE if isinstance(src, Partial) else Collective.LOCAL_EMBED
    if isinstance(src, Partial):
        return Collective.ALL_REDUCE if isinstance(dst, Mirrored) else Collective.REDUCE_SCATTER
    if isinstance(src, Mirrored):
        return Collective.LOCAL_SLICE
    return Collective.ALL_GATHER if isinstance(dst, Mirrored) else Collective.ALL_TO_ALL


def exchange_plan(src: State, dst: State, shape: Sequence[int], n: int) -> list[Transfer]:
    """Transfers that turn a Split/Mirrored tensor into `dst` (not Partial).

    A Mirrored source is local: every device already holds every box it needs.
    """
    ndim = len(shape)
    plan = []
    for e in range(n):
        for q in pieces(dst, shape, n, e):
            holders = [e] if isinstance(src, Mirrored) else range(n)
            for d in holders:
                for p in pieces(src, shape, n, d):
                    box = intersect(p, q, ndim)
                    if box is not None and prod(box_shape(box, shape)) > 0:
                        plan.append(Transfer(d, e, to_local(p, box), to_local(q, box)))
    return plan


def reduce_plan(dst: Split, shape: Sequence[int], n: int) -> list[Transfer]:
    """Transfers of a Partial tensor for a reduce-scatter into `dst`: every device sends each box
    to its owner, which sums the contributions in rank order."""
    ndim = len(shape)
    plan = []
    for e in range(n):
        for q in pieces(dst, shape, n, e):
            box = q.global_index(ndim)
            for d in range(n):
                plan.append(Transfer(d, e, box, to_local(q, box)))
    return plan


def flat_split(size: int, n: int) -> Split:
    """The element-granular split an all-reduce scatters over (on the raveled tensor)."""
    return Split.even(0, size, n)


def _bytes_sent(plan: list[Transfer], shape: Sequence[int], n: int, itemsize: int) -> int:
    sent = [0] * n
    for t in plan:
        if t.src != t.dst:
            sent[t.src] += prod(box_shape(t.src_box, shape)) * itemsize
    return max(sent)


def transition(src: State, dst: State, shape: Sequence[int], n: int, itemsize: int) -> Transition:
    """The collective taking `src` to `dst` and the most bytes one device sends for it.

    Turning a non-Partial tensor into Partial moves nothing now but leaves a reduction for later;
    it is charged one reduce-scatter so the planner does not make Partial tensors for free (a
    linear op on Mirrored inputs stays Mirrored instead of forcing a reduction downstream).
    """
    shape = tuple(shape)
    validate(src, shape, n)
    validate(dst, shape, n)
    kind = classify(src, dst)
    size = prod(shape)
    if kind in (Collective.NONE, Collective.LOCAL_SLICE) or n == 1:
        cost = 0
    elif kind is Collective.LOCAL_EMBED:
        cost = _reduce_scatter_bytes(size, n, itemsize)
    elif kind is Collective.ALL_REDUCE:
        chunks = flat_split(size, n).segments[0]
        cost = max((size - c) * itemsize + c * (n - 1) * itemsize for c in chunks)
    elif kind is Collective.REDUCE_SCATTER:
        cost = _bytes_sent(reduce_plan(dst, shape, n), shape, n, itemsize)
    else:
        cost = _bytes_sent(exchange_plan(src, dst, shape, n), shape, n, itemsize)
    return Transition(kind, cost)


def _reduce_scatter_bytes(size: int, n: int, itemsize: int) -> int:
    return max(size - c for c in flat_split(size, n).segments[0]) * itemsize


def embed_partial(local: np.ndarray, src: State, shape: Sequence[int], n: int, device: int, xp=np):
    """Device `device`'s Partial tensor from its `src` local tensor (zeros where it holds nothing)."""
    if isinstance(src, Partial):
        return local
    if isinstance(src, Mirrored):
        return local.copy() if device == 0 else xp.zeros(tuple(shape), dtype=local.dtype)
    out = xp.zeros(tuple(shape), dtype=local.dtype)
    for p in pieces(src, shape, n, device):
        out[p.global_index(len(shape))] = local[p.local_index(len(shape))]
    return out


def apply_reference(locals_: Sequence[np.ndarray], src: State, dst: State) -> list[np.ndarray]:
    """The oracle: new local arrays after the transition, computed on the host."""
    n = len(locals_)
    full = gather(locals_, src)
    shape = full.shape
    if isinstance(dst, Partial):
        return [np.asarray(embed_partial(np.asarray(x), src, shape, n, d)).copy() for d, x in enumerate(locals_)]
    return scatter(full, dst, n)
