"""Collective algorithms: one object per algorithm.

Each algorithm says when it applies (`applies`), how data moves (`phases`: transfer plans from
split_state.transitions), what that costs (`sent`: the exact bytes each device sends, summed
from its own phases) and how it runs (`run`, against an engine the workers supply). The planner
charges what `select` picks; the workers run what `select` picks; both ask the same table, so
the cost the planner charged and the bytes that move cannot drift apart.

A worker's engine (workers/collectives.py for point-to-point planes, workers/planes/nccl/engine.py
for NCCL) provides the primitives the phases need:

    engine.rank, engine.size, engine.xp
    engine.exchange(local, phase, tag) -> local result   # copy boxes between devices
    engine.reduce(local, phase, tag)   -> local result   # sum each box's contributions in rank order
    engine.all_reduce(flat, tag)       -> flat result    # only on planes with a native all-reduce
    engine.all_gather(flat, blocks, tag), engine.reduce_scatter(flat, blocks, tag)
                                       -> flat result    # only on NATIVE_BLOCKS planes

Adding an algorithm is a class here (its rule, phases, and `run` if the generic one does not fit)
and a row in `ALGORITHMS`, ahead of the ones it should win against.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any, ClassVar, NamedTuple

from split_state.errors import SplitError
from split_state.layout import Box, box_shape, local_shape, pieces
from split_state.states import MIRRORED, Mirrored, Partial, Split, State, holders, restrict, validate
from split_state.transitions import (
    Collective,
    Transfer,
    classify,
    embed_partial,
    everyone_plan,
    exchange_plan,
    flat_split,
    owned_groups,
    reduce_plan,
)

DIRECT_ALL_REDUCE_BYTES = 64 << 10  # up to this size (or on 2 devices) one exchange beats two phases
NCCL_REDUCIBLE = frozenset(
    {"int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16"}
)  # dtypes ncclAllReduce sums (ncclDataType_t); others go point to point
MPI_REDUCIBLE = frozenset(
    {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64"}
)  # dtypes MPI_Allreduce sums with MPI_SUM (MPI has no 16-bit floats)
# the data planes with an all-reduce of their own (workers/planes/), and the dtypes it sums
NATIVE_ALL_REDUCE = {"nccl": NCCL_REDUCIBLE, "mpi": MPI_REDUCIBLE, "ipc": NCCL_REDUCIBLE}
# the planes with an all-gather and a reduce-scatter of their own over one contiguous block per
# device (engine.all_gather, engine.reduce_scatter; the reduce-scatter sums NATIVE_ALL_REDUCE's dtypes)
NATIVE_BLOCKS = frozenset({"mpi"})


@dataclass(frozen=True)
class Request:
    """One redistribution: `src` -> `dst` of a tensor of global `shape` on `n` devices."""

    src: State
    dst: State
    shape: tuple[int, ...]
    n: int
    itemsize: int
    dtype: str = ""  # the dtype's wire name, where an algorithm depends on it
    plane: str = ""  # the workers' data plane, where an algorithm depends on it

    def __post_init__(self) -> None:
        # hashed once: a worker looks its requests up (select, phases) on every collective
        fields = (self.src, self.dst, self.shape, self.n, self.itemsize, self.dtype, self.plane)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


class PhaseKind(enum.Enum):
    EXCHANGE = "exchange"  # each transfer copies a box into its destination
    REDUCE = "reduce"  # transfers come in groups of n, one per source rank, summed in rank order


@dataclass(frozen=True)
class RankShare:
    """What one device does in a phase, worked out once: its result's shape, the transfers it
    sends, those it receives, and (in a reduce) the boxes it owns with their n contributions."""

    out_shape: tuple[int, ...]
    sends: tuple[Transfer, ...]
    receives: tuple[Transfer, ...]
    owned: tuple[tuple[Box, tuple[Transfer, ...]], ...]


@dataclass(frozen=True)
class Phase:
    """One round of transfers over a tensor of global `shape`, leaving it in state `out`."""

    kind: PhaseKind
    shape: tuple[int, ...]
    out: State
    transfers: tuple[Transfer, ...]
    # (n, rank) -> RankShare, and whatever else an engine works out once per phase (`derived`)
    _shares: dict = field(default_factory=dict, compare=False, repr=False)

    def out_shape(self, n: int, rank: int) -> tuple[int, ...]:
        return self.share(n, rank).out_shape

    def share(self, n: int, rank: int) -> RankShare:
        """This device's part: phases are cached per request, so a program's every run after
        the first finds it here instead of filtering the plan again."""
        got = self._shares.get((n, rank))
        if got is None:
            got = self._shares[(n, rank)] = RankShare(
                local_shape(self.out, self.shape, n, rank),
                tuple(t for t in self.transfers if t.src == rank and t.dst != rank),
                tuple(t for t in self.transfers if t.dst == rank),
                tuple((box, tuple(group)) for box, group in owned_groups(self.transfers, n, rank))
                if self.kind is PhaseKind.REDUCE
                else (),
            )
        return got

    def derived(self, key: tuple, make: Callable[[], Any]) -> Any:
        """A value an engine works out from this phase once (a plane's packing of its transfers,
        say), kept with the phase: it lives and goes with the cached phase, so nothing grows."""
        got = self._shares.get(key)
        if got is None:
            got = self._shares[key] = make()
        return got


class Tag(NamedTuple):
    """What identifies a collective's traffic and bounds its waits. A named tuple, not a frozen
    dataclass: one is made per collective call, and a dataclass's frozen __init__ costs a
    microsecond more (a decode step makes 60 of them)."""

    run: int
    step: int
    deadline: Any  # transport.deadline.Deadline (split_state does no I/O)


class Algorithm:
    name: ClassVar[str]
    flat: ClassVar[bool] = False  # phases work on the raveled tensor

    def applies(self, r: Request) -> bool:
        raise NotImplementedError

    def phases(self, r: Request) -> tuple[Phase, ...]:
        return ()

    def deferred(self, r: Request) -> int:
        """Bytes per device a later step will have to move because of this one."""
        return 0

    def sent(self, r: Request) -> tuple[int, ...]:
        """Exactly the bytes each device sends to other devices."""
        return _sent(self.phases(r), r.n, r.itemsize)

    def charge(self, r: Request) -> int:
        """What the planner charges: the busiest device's bytes, plus what this defers."""
        return max(self.sent(r)) + self.deferred(r)

    def run(self, engine: Any, local: Any, r: Request, tag: Tag, out: Any = None) -> Any:
        """Run the phases in order; the default for every plan-driven algorithm. With `out` (a
        contiguous buffer of the local result's shape, for an engine whose phases take `into`:
        workers.collectives.HostEngine), the last phase writes the result there."""
        x = engine.xp.ascontiguousarray(local).reshape(-1) if self.flat else local
        phases = cached_phases(self, r)
        for k, phase in enumerate(phases):
            run_phase = engine.exchange if phase.kind is PhaseKind.EXCHANGE else engine.reduce
            if out is not None and k == len(phases) - 1:
                x = run_phase(x, phase, tag, into=out)
            else:
                x = run_phase(x, phase, tag)
        return x.reshape(cached_local_shape(r.dst, r.shape, r.n, engine.rank)) if self.flat else x

    @classmethod
    def plan_driven(cls) -> bool:
        """Whether this algorithm runs its phases (the default `run`), so `run` takes `out`."""
        return cls.run is Algorithm.run


def _sent(phases: Sequence[Phase], n: int, itemsize: int) -> tuple[int, ...]:
    sent = [0] * n
    for phase in phases:
        for t in phase.transfers:
            if t.src != t.dst:
                sent[t.src] += prod(box_shape(t.src_box, phase.shape)) * itemsize
    return tuple(sent)


# -- local transitions ----------------------------------------------------------------------------


def moves_nothing(src: State, dst: State, n: int) -> bool:
    """Redistributing `src` -> `dst` over `n` devices leaves every local tensor as it is: the
    same state, or one device holding both (where every state's local tensor is the whole
    tensor, in order: one device of the cluster, or a group of one, as a layer split with one
    worker a group places its layers; their weights' Split@d -> Mirrored@d were ~120 steps of a
    SmolLM2 decode step)."""
    if n == 1 or classify(src, dst) is Collective.NONE:
        return True
    held = holders(src, n)
    return len(held) == 1 and holders(dst, n) == held


class Keep(Algorithm):
    """Nothing to do (moves_nothing)."""

    name = "keep"

    def applies(self, r: Request) -> bool:
        return moves_nothing(r.src, r.dst, r.n)

    def run(self, engine, local, r, tag):
        return local


class LocalSlice(Algorithm):
    """Mirrored -> Split, or to Mirrored on a group of the devices: every device cuts its own
    pieces (those outside the group keep nothing)."""

    name = "local_slice"

    def applies(self, r: Request) -> bool:
        return isinstance(r.src, Mirrored) and r.src.on is None and not isinstance(r.dst, Partial)

    def run(self, engine, local, r, tag):
        ndim = len(r.shape)
        if isinstance(r.dst, Mirrored):
            return local if r.dst.on is None or engine.rank in r.dst.on else local[(slice(0, 0),) * ndim]
        out = engine.xp.empty(local_shape(r.dst, r.shape, r.n, engine.rank), dtype=local.dtype)
        for p in pieces(r.dst, r.shape, r.n, engine.rank):
            out[p.local_index(ndim)] = local[p.global_index(ndim)]
        return out


class LocalEmbed(Algorithm):
    """-> Partial: each device keeps what it holds, zeros elsewhere. Nothing moves now, but a
    reduction is left for later: it is charged one reduce-scatter, so the planner does not make
    Partial tensors for free (a linear op on Mirrored inputs stays Mirrored)."""

    name = "local_embed"

    def applies(self, r: Request) -> bool:
        return isinstance(r.dst, Partial) and not isinstance(r.src, Partial)

    def deferred(self, r: Request) -> int:
        return max(ReduceScatter().sent(_flat_request(r, flat_split(r.size, r.n))))

    def run(self, engine, local, r, tag):
        return embed_partial(local, r.src, r.shape, r.n, engine.rank, engine.xp)


# -- reductions -----------------------------------------------------------------------------------


def _is_all_reduce(r: Request) -> bool:
    return isinstance(r.src, Partial) and isinstance(r.dst, Mirrored)


def _flat_request(r: Request, dst: State) -> Request:
    return Request(r.src, dst, (r.size,), r.n, r.itemsize, r.dtype, r.plane)


class NativeAllReduce(Algorithm):
    """The data plane's own all-reduce (NCCL's ring on the device, MPI's Allreduce, CUDA IPC's
    one or two shots): the same bits on every rank."""

    name = "native_all_reduce"

    def applies(self, r: Request) -> bool:
        return _is_all_reduce(r) and r.dtype in NATIVE_ALL_REDUCE.get(r.plane, ()) and r.n > 1

    def sent(self, r: Request) -> tuple[int, ...]:
        # charged as a ring: n-1 reduce-scatter steps and n-1 all-gather steps of one chunk each
        # (NCCL's algorithm; MPI picks its own by size, of about these bytes for large tensors)
        chunks = flat_split(r.size, r.n).segments[0]
        return tuple(2 * (r.size - c) * r.itemsize for c in chunks)

    def run(self, engine, local, r, tag):
        # the engine leaves `local` as it was (the program may still read it)
        return engine.all_reduce(engine.xp.ascontiguousarray(local).reshape(-1), tag).reshape(r.shape)


class DirectAllReduce(Algorithm):
    """Every device sends the whole tensor to every other and each sums all of it in rank
    order: one round, the same bits everywhere. Best on 2 devices and for small tensors."""

    name = "direct_all_reduce"
    flat = True

    def applies(self, r: Request) -> bool:
        return _is_all_reduce(r) and (r.n <= 2 or r.nbytes <= DIRECT_ALL_REDUCE_BYTES)

    def phases(self, r: Request) -> tuple[Phase, ...]:
        return (Phase(PhaseKind.REDUCE, (r.size,), MIRRORED, everyone_plan(r.n)),)


class TwoPhaseAllReduce(Algorithm):
    """Reduce-scatter of the raveled tensor (each device owns a chunk and sums it in rank order),
    then an all-gather of the chunks: the owner's bits reach everyone."""

    name = "reduce_scatter_all_gather"
    flat = True

    def applies(self, r: Request) -> bool:
        return _is_all_reduce(r)

    def phases(self, r: Request) -> tuple[Phase, ...]:
        shape, chunks = (r.size,), flat_split(r.size, r.n)
        return (
            Phase(PhaseKind.REDUCE, shape, chunks, cached_reduce_plan(chunks, shape, r.n)),
            Phase(PhaseKind.EXCHANGE, shape, MIRRORED, cached_exchange_plan(chunks, MIRRORED, shape, r.n)),
        )


@functools.lru_cache(maxsize=4096)
def rank_blocks(state: State, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The elements each device holds when `state` cuts the raveled tensor into one contiguous
    block per device in rank order (a Split in one segment of an axis after only size-1 axes),
    else None."""
    if not isinstance(state, Split) or len(state.segments) != 1 or any(d != 1 for d in shape[: state.axis]):
        return None
    inner = prod(shape[state.axis + 1 :])
    return tuple(e * inner for e in state.segments[0])


class NativeReduceScatter(Algorithm):
    """Partial -> one contiguous block per device, by the plane's own reduce-scatter (MPI's
    Reduce_scatter): each block is summed where the plane sums it and lands on its owner."""

    name = "native_reduce_scatter"

    def applies(self, r: Request) -> bool:
        return (
            isinstance(r.src, Partial)
            and r.plane in NATIVE_BLOCKS
            and r.dtype in NATIVE_ALL_REDUCE.get(r.plane, ())
            and r.n > 1
            and rank_blocks(r.dst, r.shape) is not None
        )

    def sent(self, r: Request) -> tuple[int, ...]:
        blocks = rank_blocks(r.dst, r.shape)  # each device's contribution to every other block
        return tuple((r.size - b) * r.itemsize for b in blocks)

    def run(self, engine, local, r, tag):
        flat = engine.xp.ascontiguousarray(local).reshape(-1)
        mine = engine.reduce_scatter(flat, rank_blocks(r.dst, r.shape), tag)
        return mine.reshape(cached_local_shape(r.dst, r.shape, r.n, engine.rank))


class NativeAllGather(Algorithm):
    """One contiguous block per device -> Mirrored, by the plane's own all-gather (MPI's
    Allgatherv): bytes only, so every rank holds the same bits."""

    name = "native_all_gather"

    def applies(self, r: Request) -> bool:
        return (
            isinstance(r.dst, Mirrored)
            and r.plane in NATIVE_BLOCKS
            and r.n > 1
            and rank_blocks(r.src, r.shape) is not None
        )

    def sent(self, r: Request) -> tuple[int, ...]:
        return tuple(b * (r.n - 1) * r.itemsize for b in rank_blocks(r.src, r.shape))

    def run(self, engine, local, r, tag):
        flat = engine.xp.ascontiguousarray(local).reshape(-1)
        return engine.all_gather(flat, rank_blocks(r.src, r.shape), tag).reshape(r.shape)


class ReduceScatter(Algorithm):
    """Partial -> Split: every device sends each box to its owner, which sums in rank order."""

    name = "reduce_scatter"

    def applies(self, r: Request) -> bool:
        return isinstance(r.src, Partial) and isinstance(r.dst, Split)

    def phases(self, r: Request) -> tuple[Phase, ...]:
        return (Phase(PhaseKind.REDUCE, r.shape, r.dst, cached_reduce_plan(r.dst, r.shape, r.n)),)


# -- exchanges ------------------------------------------------------------------------------------


class Exchange(Algorithm):
    """Split -> Mirrored (all-gather) or Split -> another split (all-to-all), and a hand-over
    from the devices of one group to those of another: each box goes straight from a device
    that holds it to every device that needs it."""

    name = "exchange"

    def applies(self, r: Request) -> bool:
        held_by_some = isinstance(r.src, Mirrored) and r.src.on is not None
        return (isinstance(r.src, Split) or held_by_some) and not isinstance(r.dst, Partial)

    def phases(self, r: Request) -> tuple[Phase, ...]:
        return (Phase(PhaseKind.EXCHANGE, r.shape, r.dst, cached_exchange_plan(r.src, r.dst, r.shape, r.n)),)


# Plans depend only on states, shape and device count: a program repeats them every run.
cached_exchange_plan = functools.lru_cache(maxsize=4096)(lambda s, d, shape, n: tuple(exchange_plan(s, d, shape, n)))
cached_reduce_plan = functools.lru_cache(maxsize=4096)(lambda d, shape, n: tuple(reduce_plan(d, shape, n)))


@functools.lru_cache(maxsize=4096)
def cached_phases(algorithm: Algorithm, r: Request) -> tuple[Phase, ...]:
    """An algorithm's phases for a request: the same objects every time a program repeats it."""
    return algorithm.phases(r)


cached_local_shape = functools.lru_cache(maxsize=4096)(local_shape)


# Tried in order; the first that applies is the one that runs (and the one the planner charges).
ALGORITHMS: tuple[Algorithm, ...] = (
    Keep(),
    LocalSlice(),
    LocalEmbed(),
    NativeAllReduce(),
    DirectAllReduce(),
    TwoPhaseAllReduce(),
    NativeReduceScatter(),
    ReduceScatter(),
    NativeAllGather(),
    Exchange(),
)


@functools.lru_cache(maxsize=4096)
def select(r: Request) -> Algorithm:
    """The algorithm for a request (cached: a program asks for the same few every run)."""
    for algorithm in ALGORITHMS:
        if algorithm.applies(r):
            return algorithm
    raise AssertionError(f"no algorithm for {r.src} -> {r.dst}")  # the table covers every pair


def universe(src: State, dst: State, n: int) -> tuple[int, ...] | None:
    """The devices a redistribution involves (those holding the tensor before or after it), or
    None when that is every device."""
    if src.on is None or dst.on is None:
        return None
    devices = tuple(sorted(set(src.on) | set(dst.on)))
    return None if len(devices) == n else devices


def grouped(r: Request) -> tuple[tuple[int, ...] | None, Request]:
    """A redistribution as its devices run it: renumbered over its universe (the devices of
    both groups), where the algorithms written for a whole cluster apply, or as it is when it
    involves every device. A group's collective cannot use a plane's native collectives (they
    span every rank), so its plane is left unnamed. A partial sum changes holders only once
    summed: the planner moves it to Mirrored on its own group first."""
    if isinstance(r.src, Partial) or isinstance(r.dst, Partial):
        if r.src.on != r.dst.on:
            raise SplitError(
                f"{r.src} -> {r.dst}: a partial sum is reduced on its own devices before it moves to "
                f"others (move it to Mirrored on {holders(r.src, r.n)} first)"
            )
    devices = universe(r.src, r.dst, r.n)
    if devices is None:
        return None, r
    inner = Request(restrict(r.src, devices), restrict(r.dst, devices), r.shape, len(devices), r.itemsize, r.dtype)
    return devices, inner


@dataclass(frozen=True)
class Transition:
    kind: Collective
    bytes_per_device: int  # what the planner charges: the most bytes any one device sends
    algorithm: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}({self.bytes_per_device} B/dev)"


def transition(
    src: State, dst: State, shape: Sequence[int], n: int, itemsize: int, dtype: str = "", plane: str = ""
) -> Transition:
    """The collective taking `src` to `dst`, the algorithm that will run it, and its charge."""
    shape = tuple(shape)
    validate(src, shape, n)
    validate(dst, shape, n)
    _, r = grouped(Request(src, dst, shape, n, itemsize, dtype, plane))
    algorithm = select(r)
    return Transition(classify(src, dst), algorithm.charge(r), algorithm.name)
