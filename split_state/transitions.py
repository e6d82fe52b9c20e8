"""State-to-state transitions: their kind, the transfer plans data moves by, and the host oracle.

`exchange_plan` and `reduce_plan` say who sends which box to whom; the collective algorithms
(split_state.algorithms) are built from them, and the workers run those. `apply_reference` is
the oracle the collectives are tested against: it goes through the global array (gather, then
scatter) and shares no plan with them.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from split_state.layout import Box, box_shape, intersect, pieces, to_local
from split_state.scatter import gather, scatter
from split_state.states import Mirrored, Partial, Split, State, holders, holds


class Collective(enum.Enum):
    NONE = "none"
    LOCAL_SLICE = "local_slice"  # Mirrored -> Split: every device cuts its own pieces
    LOCAL_EMBED = "local_embed"  # -> Partial: device keeps its data, zeros elsewhere
    ALL_GATHER = "all_gather"  # Split -> Mirrored
    ALL_TO_ALL = "all_to_all"  # Split -> Split on another axis, or other extents/segments
    REDUCE_SCATTER = "reduce_scatter"  # Partial -> Split
    ALL_REDUCE = "all_reduce"  # Partial -> Mirrored (reduce-scatter then all-gather)
    HAND_OVER = "hand_over"  # to devices of another group: each box from one holder to each taker


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
    if not _within(dst.on, src.on):
        return Collective.HAND_OVER
    if isinstance(dst, Partial):
        return Collective.NONE if isinstance(src, Partial) else Collective.LOCAL_EMBED
    if isinstance(src, Partial):
        return Collective.ALL_REDUCE if isinstance(dst, Mirrored) else Collective.REDUCE_SCATTER
    if isinstance(src, Mirrored):
        return Collective.LOCAL_SLICE
    return Collective.ALL_GATHER if isinstance(dst, Mirrored) else Collective.ALL_TO_ALL


def _within(inner: tuple[int, ...] | None, outer: tuple[int, ...] | None) -> bool:
    """Whether every device of group `inner` is in group `outer` (None: every device)."""
    return outer is None or (inner is not None and set(inner) <= set(outer))


def exchange_plan(src: State, dst: State, shape: Sequence[int], n: int) -> list[Transfer]:
    """Transfers that turn a Split/Mirrored tensor into `dst` (not Partial).

    A Mirrored source is local to its holders: each of them already holds every box it needs,
    and a device outside the source's group takes its boxes from one holder (the holders taking
    turns, so a hand-over to a group of k devices spreads over the givers).
    """
    ndim = len(shape)
    plan = []
    givers = holders(src, n)
    takers = [e for e in range(n) if not holds(src, e)]
    for e in range(n):
        for q in pieces(dst, shape, n, e):
            if isinstance(src, Mirrored):
                sources = [e] if holds(src, e) else [givers[takers.index(e) % len(givers)]]
            else:
                sources = range(n)
            for d in sources:
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


def everyone_plan(n: int) -> tuple[Transfer, ...]:
    """A reduce of a flat tensor in which every device receives all of it from every device."""
    return _everyone_plan(n)


@functools.lru_cache(maxsize=64)
def _everyone_plan(n: int) -> tuple[Transfer, ...]:
    whole = (slice(None),)
    return tuple(Transfer(d, e, whole, whole) for e in range(n) for d in range(n))


def owned_groups(plan: Sequence[Transfer], n: int, rank: int) -> Iterator[tuple[Box, Sequence[Transfer]]]:
    """The boxes of a reduce plan that `rank` owns, each with its n contributions in rank order."""
    for at in range(0, len(plan), n):
        group = plan[at : at + n]
        if group[0].dst == rank:
            yield group[0].dst_box, group


def flat_split(size: int, n: int) -> Split:
    """The element-granular split an all-reduce scatters over (on the raveled tensor)."""
    return Split.even(0, size, n)


def embed_partial(local: np.ndarray, src: State, shape: Sequence[int], n: int, device: int, xp=np):
    """Device `device`'s Partial tensor (over every device) from its `src` local tensor (zeros
    where it holds nothing; a Mirrored value counted once, on its first holder)."""
    if isinstance(src, Partial):
        return local
    if isinstance(src, Mirrored):
        first = holders(src, n)[0]
        return local.copy() if device == first else xp.zeros(tuple(shape), dtype=local.dtype)
    out = xp.zeros(tuple(shape), dtype=local.dtype)
    for p in pieces(src, shape, n, device):
        out[p.global_index(len(shape))] = local[p.local_index(len(shape))]
    return out


def apply_reference(locals_: Sequence[np.ndarray], src: State, dst: State) -> list[np.ndarray]:
    """The oracle: new local arrays after the transition, computed on the host."""
    n = len(locals_)
    full = gather(locals_, src)
    shape = full.shape
    if isinstance(dst, Partial) and dst.on is None:
        return [np.asarray(embed_partial(np.asarray(x), src, shape, n, d)).copy() for d, x in enumerate(locals_)]
    return scatter(full, dst, n)  # a group's partial sum: the value on its first holder
