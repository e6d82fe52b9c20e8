"""Collectives on a worker: the algorithm split_state.algorithms selects, run on this worker's
data plane.

`Collectives.redistribute` asks `select` (the same table the planner charged) and runs the chosen
algorithm against an engine: `HostEngine` for the point-to-point planes (shared memory, ZeroMQ,
in-process queues), `NcclEngine` for NCCL (workers/planes/nccl/engine.py). An engine supplies
the primitives:
exchange (copy boxes), reduce (sum each box's contributions in rank order) and, where the plane
has one, a native all-reduce. Reductions are done by the owner of each box in rank order and
every device then receives the owner's bits, so Mirrored results are bitwise identical.

A redistribution among the workers of a group (a layer split's layer, or a hand-over from one
group to the next) runs the same algorithms renumbered over its devices (split_state.algorithms
`grouped`), on a HostEngine over a `GroupComm`: the plane's point-to-point sends, whatever the
plane, since its native collectives span every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from split_state.algorithms import DirectAllReduce, LocalSlice, Phase, Request, Tag, grouped, select
from split_state.dtypes import dtype_from_name, dtype_name
from split_state.layout import local_shape
from split_state.states import State
from split_state.transitions import Collective, Transfer, classify
from transport.deadline import Deadline


class Collectives:
    def __init__(self, engine):
        self.engine = engine
        self._groups: dict[tuple[int, ...], HostEngine] = {}  # a group's devices -> its engine

    def _group_engine(self, devices: tuple[int, ...]) -> HostEngine:
        engine = self._groups.get(devices)
        if engine is None:
            engine = self._groups[devices] = HostEngine(GroupComm(self.engine.comm, devices), self.engine.backend)
        return engine

    def request(self, src: State, dst: State, shape: Sequence[int], dtype: Any) -> Request:
        """The redistribution a program step asks of this worker's engine (made once per step:
        `run` then finds its algorithm and phases by this object)."""
        e = self.engine
        return Request(src, dst, tuple(shape), e.size, dtype.itemsize, dtype_name(dtype), e.plane)

    def prepared(self, r: Request, out: Any = None) -> Callable[[Any, int, int, Deadline], Any]:
        """The redistribution of one request, its algorithm looked up now: a program step binds
        it once (the lookup hashes the request's states, a few microseconds a call). With `out`
        (a buffer of the local result's shape, where `writes_into(r)`), every call's result is
        `out` itself."""
        devices, inner = grouped(r)
        if devices is not None:
            fast = self._in_group(devices, r, inner)
        else:
            engine, algorithm = self.engine, select(r)
            if out is not None and self._engine_writes_into(r):
                return engine.bound(algorithm, r, out)
            bound = getattr(engine, "bound", None)
            fast = bound(algorithm, r) if bound is not None else None
            if fast is None:
                fast = _runner(engine, algorithm, r, engine.check_usable)
        if out is None:
            return fast

        def run_into(local: Any, run: int, step: int, deadline: Deadline) -> Any:
            # a program planned where the engine wrote into its buffer, bound to one that does not
            # (its peers changed since): the same result, copied
            out[...] = fast(local, run, step, deadline)
            return out

        return run_into

    def _in_group(self, devices: tuple[int, ...], r: Request, inner: Request) -> Callable:
        """A redistribution among `devices` only: run renumbered on their group engine; a worker
        outside them holds nothing before or after it."""
        xp, rank = self.engine.xp, self.engine.rank
        if rank not in devices:
            empty = local_shape(r.dst, r.shape, r.n, rank)
            return lambda local, run, step, deadline: xp.empty(empty, dtype=local.dtype)
        return _runner(self._group_engine(devices), select(inner), inner, self.engine.check_usable)

    def writes_into(self, r: Request) -> bool:
        """Whether this engine's run of `r` is done with its input when it returns and can write
        its result into a buffer of the program's: a program then gives both a place in its
        arena, the same every run, instead of new arrays per run. The shared-memory postboxes'
        all-reduce writes there itself; a hand-over of a layer split's activation from one group
        to the next (on the point-to-point engine, or a group's) and a local cut (a mask every
        layer reads, onto a layer's group) are copied there by `prepared`: the engine flushes
        before it returns, a cut sends nothing. Without that the hand-over's result was a new
        array every run, every kernel after it in a step was planned again each run
        (workers/straight.py gives up on such lines) and made new arrays in turn."""
        if grouped(r)[0] is not None or select(r).name == LocalSlice.name:  # (a local cut: sends nothing)
            return True
        if isinstance(self.engine, HostEngine) and classify(r.src, r.dst) is Collective.HAND_OVER:
            return True
        return self._engine_writes_into(r)

    def _engine_writes_into(self, r: Request) -> bool:
        """Whether the engine itself writes `r`'s result into a buffer (its `bound` with `out`)."""
        check = getattr(self.engine, "writes_into", None)
        return bool(check is not None and grouped(r)[0] is None and check(select(r), r))

    def redistribute(
        self, local: Any, src: State, dst: State, shape: Sequence[int], run: int, step: int, deadline: Deadline
    ) -> Any:
        return self.prepared(self.request(src, dst, shape, local.dtype))(local, run, step, deadline)


def _runner(engine, algorithm, r: Request, check_usable: Callable[[], None]) -> Callable:
    """`algorithm` run for `r` on `engine`, after `check_usable` (the worker's own engine's: a
    group engine's sends go through its comm)."""

    def redistribute_once(local: Any, run: int, step: int, deadline: Deadline) -> Any:
        check_usable()
        return algorithm.run(engine, local, r, Tag(run, step, deadline))

    return redistribute_once


class GroupComm:
    """A worker's comm as the workers of one group see it: ranks renumbered 0..len(devices)-1
    over `devices` (sorted global ranks, this worker among them), sends and receives through the
    cluster's comm under the global ranks. It has no bound all-reduce of its own (a plane's
    postboxes and native collectives span every rank)."""

    def __init__(self, comm, devices: tuple[int, ...]):
        self.comm, self.devices = comm, devices
        self.rank, self.size, self.plane = devices.index(comm.rank), len(devices), ""

    def send(self, dst: int, run: int, step: int, array: Any) -> None:
        self.comm.send(self.devices[dst], run, step, array)

    def receive(self, src: int, run: int, step: int, deadline: Deadline, shape, dtype, sink) -> None:
        self.comm.receive(self.devices[src], run, step, deadline, shape, dtype, sink)

    def flush(self, run: int, deadline: Deadline) -> None:
        self.comm.flush(run, deadline)


class HostEngine:
    """Phases over a point-to-point comm (workers.comm): sends are queued and never block, and
    received bytes are handed over as they arrive, so a reduction adds straight from where the
    bytes landed."""

    def __init__(self, comm, backend):
        self.comm, self.backend, self.xp = comm, backend, backend.xp
        self.rank, self.size, self.plane = comm.rank, comm.size, comm.plane

    def check_usable(self) -> None:
        pass

    def writes_into(self, algorithm, r: Request) -> bool:
        """Whether `bound` with a buffer writes this request's result there: the plane's own
        direct all-reduce (the shared-memory postboxes: workers.comm.HostComm.posts, which copy
        the input before returning), or any algorithm that runs phases (the last one writes into
        the buffer). Either way the input is free when the call returns: every send is copied or
        flushed by then (workers.comm: flush waits until ZeroMQ is done with what it sent in
        place). A buffer of the program's arena is the same memory every run; a fresh result
        of 16 MiB cost 2-4 ms of first-touch page faults a call, a third of its all-reduce."""
        return self._posts(algorithm, r) or algorithm.plan_driven()

    def _posts(self, algorithm, r: Request) -> bool:
        posts = getattr(self.comm, "posts", None)
        return (
            posts is not None
            and algorithm.name == DirectAllReduce.name
            and self.xp is np
            and posts(dtype_from_name(r.dtype), r.shape)
        )

    def bound(self, algorithm, r: Request, out: Any = None):
        """The plane's own direct all-reduce for one request, where it has one (the shared-memory
        postboxes: workers.comm.HostComm.bound_all_reduce) and the data is on the host, its
        results in `out` when given; else, given `out`, the algorithm's phases writing into it."""
        if self._posts(algorithm, r):
            return self.comm.bound_all_reduce(dtype_from_name(r.dtype), r.shape, out)
        if out is None or not algorithm.plan_driven():
            return None

        def run_into(local: Any, run: int, step: int, deadline: Deadline) -> Any:
            algorithm.run(self, local, r, Tag(run, step, deadline), out=out)
            return out

        return run_into

    def _send_mine(self, local: Any, sends: Sequence[Transfer], tag: Tag) -> None:
        for t in sends:
            self.comm.send(t.dst, tag.run, tag.step, self.backend.to_host(local[t.src_box]))

    def _receive(self, t: Transfer, target: Any, tag: Tag, combine) -> None:
        """Stream transfer `t` into the contiguous array `target`: combine(flat part, fragment)."""
        flat = target.reshape(-1)
        to_device = self.backend.to_device

        def sink(at: int, fragment: Any) -> None:
            combine(flat[at : at + fragment.size], to_device(fragment), at)

        self.comm.receive(t.src, tag.run, tag.step, tag.deadline, target.shape, target.dtype, sink)

    def exchange(self, local: Any, phase: Phase, tag: Tag, into: Any = None) -> Any:
        """Copy the boxes of `phase`; the result in `into` (contiguous, of as many elements) when given."""
        share = phase.share(self.size, self.rank)
        self._send_mine(local, share.sends, tag)  # queued, never blocking: receives below drain them
        out = self.xp.empty(share.out_shape, dtype=local.dtype) if into is None else into.reshape(share.out_shape)
        for t in share.receives:
            if t.src == self.rank:
                out[t.dst_box] = local[t.src_box]
                continue
            target = out[t.dst_box]
            if target.flags.c_contiguous:  # straight into place
                self._receive(t, target, tag, _assign)
            else:
                staged = self.xp.empty(target.shape, dtype=target.dtype)
                self._receive(t, staged, tag, _assign)
                out[t.dst_box] = staged
        self.comm.flush(tag.run, tag.deadline)
        return out

    def reduce(self, local: Any, phase: Phase, tag: Tag, into: Any = None) -> Any:
        """Sum every device's contribution to each box this device owns, in rank order, adding
        remote contributions as their bytes arrive. The first two are added in one pass (a + b
        is b + a bit for bit), so every owner does the same arithmetic whatever its rank. The
        result in `into` (contiguous, of as many elements) when given."""
        rank, n, xp = self.rank, self.size, self.xp
        share = phase.share(n, rank)
        self._send_mine(local, share.sends, tag)
        out_shape = tuple(share.out_shape)
        out = None if into is None else into.reshape(out_shape)
        for box, group in share.owned:
            mine = local[group[rank].src_box]
            whole = mine.shape == out_shape  # the whole result is this one box: summed in place
            if whole and out is None:
                out = xp.empty(out_shape, local.dtype)
            total = out if whole else xp.empty(mine.shape, local.dtype)
            if n == 1:
                total[...] = mine
            elif rank < 2:
                first = xp.ascontiguousarray(mine).reshape(-1)
                self._receive(group[1 - rank], total, tag, _added_to(first, xp))
            else:
                self._receive(group[0], total, tag, _assign)
                self._receive(group[1], total, tag, _add)
            for t in group[2:]:
                if t.src == rank:
                    total += mine
                else:
                    self._receive(t, total, tag, _add)
            if not whole:
                if out is None:
                    out = xp.empty(out_shape, dtype=local.dtype)
                out[box] = total
        self.comm.flush(tag.run, tag.deadline)
        return xp.empty(out_shape, dtype=local.dtype) if out is None else out


def _assign(part: Any, fragment: Any, at: int) -> None:
    part[...] = fragment


def _add(part: Any, fragment: Any, at: int) -> None:
    part += fragment


def _added_to(first: Any, xp: Any):
    """Combine: the sum of this device's contribution `first` (flat) and the arriving one."""

    def combine(part: Any, fragment: Any, at: int) -> None:
        xp.add(first[at : at + part.size], fragment, out=part)

    return combine
