"""Collectives between workers that are the ranks of one MPI job (mpi4py over the job's MPI).

The workers of `mpiexec -n N python launch.py ...` (or `srun` with PMIx) are started by the job's
ranks, inherit their rank's identity and join MPI as that rank (workers/planes/mpi/__init__.py checks that
the two agree). Data moves through MPI's own buffer calls, never pickled objects:

- all-reduce (Partial -> Mirrored of a dtype MPI sums) is `Allreduce` into a buffer of the
  result's size. A commutative sum gives every rank the same bits (each element's additions are
  done once and shared, or in the same pairs on every rank), though for 3 or more ranks not
  necessarily the rank-order bits of the shared-memory plane;
- where a split is one contiguous block per rank (split_state.algorithms.rank_blocks), Partial ->
  Split is `Reduce_scatter` and Split -> Mirrored is `Allgatherv` (of bytes: any dtype);
- every other exchange phase of split_state.algorithms' transfer plans (segments, inner axes,
  all-to-all) is one `Alltoallv` of bytes, each rank's boxes packed per peer in the plan's order;
- reduce phases (dtypes MPI cannot sum, splits in several segments) and the generation's stop
  flag run as `Isend` / `Irecv` of raw bytes, each message tagged with its run and step, waited
  for with the collective deadline, and summed in rank order as on the host planes.

The blocking `Allreduce` is the fast one: 2 us for 4 KiB here against 7 us for `Iallreduce`,
whose schedule is built anew each call. A blocked rank cannot look at ZeroMQ for aborts, so a
worker whose run fails revokes the communicator (MPI 4's fault-tolerance extension, which Open
MPI 5 ships): every rank blocked on it returns at once with the failure, which is then named
from the abort that came over ZeroMQ. A revoked communicator is not renewed (the ranks could not
agree when, without another blocking call): the plane then refuses further runs with a typed
error, as NCCL's does after an abort. A dead rank ends the whole MPI job (the launcher's rule).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from split_state.dtypes import dtype_name
from split_state.errors import ProtocolError, TransportError, UnsupportedDtype, WorkerLost
from split_state.layout import box_shape
from split_state.transitions import Transfer
from transport.deadline import Deadline
from workers.collectives import HostEngine
from workers.comm import Waiter, ZmqComm
from workers.generation import STOP_TAG

_STEP_BITS = 16  # a tag is (run, step): MPI guarantees tags up to 32767; Open MPI allows 2**31 - 1
_STOP_STEP = (1 << _STEP_BITS) - 1  # workers.generation.STOP_TAG's step, folded into the tag's range
REVOKED_GRACE_S = 1.0  # after a revoke, how long to wait for the abort that names its cause

# numpy dtype name -> the MPI datatype's name in mpi4py; what MPI can sum (split_state.algorithms
# names the same set, MPI_REDUCIBLE, for the planner)
_MPI_TYPES = {
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "int8": "INT8_T",
    "int16": "INT16_T",
    "int32": "INT32_T",
    "int64": "INT64_T",
    "uint8": "UINT8_T",
    "uint16": "UINT16_T",
    "uint32": "UINT32_T",
    "uint64": "UINT64_T",
}


def message_tag(run: int, step: int) -> int:
    """The MPI tag of the message (run, step): runs are told apart modulo 2**15, enough to keep a
    failed run's leftovers from matching (the communicator is revoked after one anyway)."""
    if step == STOP_TAG:
        step = _STOP_STEP
    elif not 0 <= step < _STOP_STEP:
        raise ProtocolError(f"step {step}: the MPI plane tags steps below {_STOP_STEP}")
    return ((run & 0x7FFF) << _STEP_BITS) | step


class MpiComm(ZmqComm):
    """MPI for the data; ZeroMQ for the aborts that name why a run failed."""

    plane = "mpi"

    def __init__(self, rank, inbox, peers, context, security, world):
        super().__init__(rank, inbox, peers, context, security)
        from mpi4py import MPI

        self.MPI, self.world = MPI, world
        self.broken = ""  # why the communicator was revoked, once it was
        self._sends: list[tuple[Any, np.ndarray]] = []  # until flushed: MPI reads the buffer meanwhile
        self._received: dict[int, np.ndarray] = {}  # a reused receive buffer per peer
        self._status = MPI.Status()
        self._sum_types: dict[np.dtype, Any] = {}  # dtype -> MPI datatype, for Allreduce
        self._results = ResultBuffers()

    def engine(self, backend):
        return MpiEngine(self, backend)

    # -- point to point -------------------------------------------------------------------------

    def send(self, dst: int, run: int, step: int, array: np.ndarray) -> None:
        self.check_usable()
        buffer = np.ascontiguousarray(array)
        self.bytes_sent += buffer.nbytes
        request = self._call(lambda: self.world.Isend([buffer, self.MPI.BYTE], dst, message_tag(run, step)), run)
        self._sends.append((request, buffer))

    def receive(self, src, run, step, deadline, shape, dtype, sink) -> None:
        self.check_usable()
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buffer = self._received.get(src)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._received[src] = np.empty(max(nbytes, 1), np.uint8)
        into = buffer[:nbytes]
        tag = message_tag(run, step)
        request = self._call(lambda: self.world.Irecv([into, self.MPI.BYTE], src, tag), run)
        start = time.perf_counter()
        try:
            self._wait([request], run, deadline, f"no data from worker {src} (run {run}, step {step})", src)
        finally:
            self.waited += time.perf_counter() - start
        got = self._status.Get_count(self.MPI.BYTE)
        if got != nbytes:
            raise ProtocolError(f"step {step}: worker {src} sent {got} bytes, the plan expects {nbytes}")
        sink(0, into.view(dtype))

    def flush(self, run: int, deadline: Deadline) -> None:
        if self._sends:
            requests = [r for r, _ in self._sends]
            self._wait(requests, run, deadline, "a peer took no data", -1)
            self._sends = []

    def _wait(self, requests: list, run: int, deadline: Deadline, what: str, peer: int) -> None:
        """Until every request completed: spin on Test, looking for aborts over ZeroMQ when due,
        then nap; a deadline revokes the communicator so no peer waits on us forever."""
        MPI = self.MPI
        waiter = Waiter(deadline)
        while True:
            if len(requests) == 1:  # a receive: its status tells how many bytes came
                done = self._call(lambda: requests[0].Test(self._status), run)
            else:
                done = self._call(lambda: MPI.Request.Testall(requests), run)
            if done:
                return
            if waiter.signals_due():
                try:
                    self._check_signals(run)
                except Exception as exc:
                    self._revoke(f"{type(exc).__name__}: {exc}")
                    raise
            if not waiter.pause():
                self._revoke(f"run {run}: {what} within {deadline.seconds:.1f} s")
                raise WorkerLost(f"worker {self.rank}: {what} within {deadline.seconds:.1f} s", rank=peer)

    # -- the native all-reduce ------------------------------------------------------------------

    def all_reduce(self, flat: np.ndarray, run: int) -> np.ndarray:
        """The sum of `flat` (contiguous) over every rank, in a new array."""
        if self.broken:
            self.check_usable()
        kind = self._sum_types.get(flat.dtype) or self._sum_type(flat.dtype)
        out = self._results.take(flat.dtype, flat.size)
        try:  # the hot path of a decode step: no wrapper around the call
            self.world.Allreduce([flat, kind], [out, kind], self.MPI.SUM)
        except self.MPI.Exception as exc:
            self._failed(exc, run)
        return out

    def bound_all_reduce(self, dtype: np.dtype, shape: tuple[int, ...]):
        """`all_reduce` of arrays of one dtype and shape, everything looked up once: a decode
        step's 4 KiB Allreduce takes 2 us here, so each lookup, tag and reshape around it shows
        (the unbound path cost 1.9 us more than raw mpi4py, this one ~0.9). Called as a program
        step calls a collective: (local, run, step, deadline)."""
        kind = self._sum_types.get(dtype) or self._sum_type(dtype)
        size, one_axis = prod(shape), len(shape) == 1
        allreduce, total = self.world.Allreduce, self.MPI.SUM
        error = self.MPI.Exception
        # results of a few KiB (a decode step's) from two arrays of their own, handed out in
        # turn: a fresh array each call cost 0.9 us of the 4 KiB all-reduce's 5.4 (raw: 3.7)
        take = ResultPair(dtype, size).take if size * dtype.itemsize < ResultBuffers.MIN_BYTES else None
        pool = self._results.take

        def run(local: np.ndarray, run: int, step: int, deadline) -> np.ndarray:
            if self.broken:
                self.check_usable()
            flat = local if local.flags.c_contiguous else np.ascontiguousarray(local)
            out = take() if take is not None else pool(dtype, size)
            try:
                allreduce([flat, kind], [out, kind], total)
            except error as exc:
                self._failed(exc, run)
            return out if one_axis else out.reshape(shape)

        return run

    def all_gather(self, flat: np.ndarray, blocks: tuple[int, ...], run: int) -> np.ndarray:
        """Every rank's block (`blocks[r]` elements; ours is `flat`), in rank order, on every rank."""
        if self.broken:
            self.check_usable()
        out = self._results.take(flat.dtype, sum(blocks))
        size = flat.dtype.itemsize
        counts = [b * size for b in blocks]  # as bytes: any dtype moves, none is summed
        BYTE = self.MPI.BYTE
        try:
            self.world.Allgatherv([flat.view(np.uint8), BYTE], [out.view(np.uint8), (counts, _offsets(counts)), BYTE])
        except self.MPI.Exception as exc:
            self._failed(exc, run)
        return out

    def all_to_all(self, send: np.ndarray, sent, into: np.ndarray, received, run: int) -> None:
        """Alltoallv of bytes: `sent[d]` bytes of `send` (in peer order) to each rank d, and
        `received[s]` bytes from each rank s into `into`, in rank order."""
        if self.broken:
            self.check_usable()
        BYTE = self.MPI.BYTE
        self.bytes_sent += sum(sent)
        try:
            self.world.Alltoallv(
                [send.view(np.uint8), (sent, _offsets(sent)), BYTE],
                [into.view(np.uint8), (received, _offsets(received)), BYTE],
            )
        except self.MPI.Exception as exc:
            self._failed(exc, run)

    def reduce_scatter(self, flat: np.ndarray, blocks: tuple[int, ...], run: int) -> np.ndarray:
        """The sum over every rank of block `rank` of `flat` (`blocks[r]` elements each)."""
        if self.broken:
            self.check_usable()
        kind = self._sum_types.get(flat.dtype) or self._sum_type(flat.dtype)
        out = self._results.take(flat.dtype, blocks[self.rank])
        try:
            self.world.Reduce_scatter([flat, kind], [out, kind], list(blocks), self.MPI.SUM)
        except self.MPI.Exception as exc:
            self._failed(exc, run)
        return out

    def _sum_type(self, dtype: np.dtype):
        """The MPI datatype MPI sums `dtype` as (looked up once per dtype)."""
        name = dtype_name(dtype)
        if name not in _MPI_TYPES:
            raise UnsupportedDtype(f"dtype {name} has no MPI sum")
        kind = self._sum_types[dtype] = getattr(self.MPI, _MPI_TYPES[name])
        return kind

    # -- failures -------------------------------------------------------------------------------

    def _call(self, operation, run: int):
        """Run an MPI call; a revoked communicator (a peer's run failed) becomes that peer's
        error, read from its abort over ZeroMQ."""
        try:
            return operation()
        except self.MPI.Exception as exc:
            self._failed(exc, run)

    def _failed(self, exc, run: int):
        self.broken = self.broken or f"MPI reported {exc.Get_error_string().strip()}"
        end = time.monotonic() + REVOKED_GRACE_S
        while True:  # the failing worker sent its abort before revoking: raise that
            try:
                self._check_signals(run)
            except WorkerLost:  # it left without one (its revoke, then its exit): the revoke is the news
                break
            if time.monotonic() > end:
                break
            self.inbox.poll(10)
        raise TransportError(f"worker {self.rank}: the MPI communicator failed in run {run} ({self.broken})") from None

    def abort(self, run: int, kind: str, message: str) -> None:
        super().abort(run, kind, message)  # the reason first: peers read it once revoked
        self._revoke(f"run {run} failed on worker {self.rank}: {kind}: {message}")

    def _revoke(self, why: str) -> None:
        if self.broken:
            return
        self.broken = why
        try:
            self.world.Revoke()  # every rank blocked on the communicator returns with an error
        except (NotImplementedError, self.MPI.Exception):  # an MPI without the extension
            pass

    def check_usable(self) -> None:
        if self.broken:
            raise TransportError(
                f"worker {self.rank}: the MPI communicator was revoked ({self.broken}); restart the cluster"
            )

    def routes(self) -> dict[int, str]:
        return {str(dst): "mpi" for dst in range(self.size) if dst != self.rank}

    def close(self) -> None:
        super().close()
        if not self.broken:
            try:
                self.world.Free()
            except self.MPI.Exception:
                pass


def _offsets(counts) -> list[int]:
    """Where each of `counts` starts when they lie end to end."""
    at, offsets = 0, []
    for count in counts:
        offsets.append(at)
        at += count
    return offsets


@dataclass(frozen=True)
class Packing:
    """An exchange phase as one Alltoallv on one rank: the boxes it sends, grouped by peer in
    the plan's order (the receiver unpacks in that order too), and the bytes to and from each."""

    sends: tuple[Transfer, ...]
    receives: tuple[Transfer, ...]  # from peers; the rank's own boxes are copied apart
    own: tuple[Transfer, ...]
    sent: tuple[int, ...]
    received: tuple[int, ...]

    @classmethod
    def of(cls, phase, n: int, rank: int, itemsize: int) -> Packing:
        share = phase.share(n, rank)
        sends = tuple(sorted(share.sends, key=lambda t: t.dst))  # a stable sort keeps the plan's order
        receives = tuple(sorted((t for t in share.receives if t.src != rank), key=lambda t: t.src))
        sent, received = [0] * n, [0] * n
        for t in sends:
            sent[t.dst] += prod(box_shape(t.src_box, phase.shape)) * itemsize
        for t in receives:
            received[t.src] += prod(box_shape(t.dst_box, phase.shape)) * itemsize
        return cls(sends, receives, tuple(t for t in share.receives if t.src == rank), tuple(sent), tuple(received))


class ResultPair:
    """Two arrays of one dtype and size for a bound collective's results, handed out in turn
    when nothing but the pair refers to one (CPython's reference count: a result that a program
    slot, a stored tensor or a view of it still holds is never written over); a new array when
    both are held."""

    def __init__(self, dtype: np.dtype, size: int):
        self.arrays = (np.empty(size, dtype), np.empty(size, dtype))

    def take(self) -> np.ndarray:
        for array in self.arrays:
            if sys.getrefcount(array) == 3:  # the pair's, this loop's and the call's argument
                return array
        return np.empty_like(self.arrays[0])


class ResultBuffers:
    """Arrays for all-reduce results, recycled. A fresh array's pages are faulted in as MPI
    writes them, which on this machine costs more than the all-reduce itself (16 MiB: 31 ms of
    faults against a 5 ms Allreduce, measured). A pooled buffer is handed out again only when
    nothing but the pool refers to it (CPython's reference count: a result that a program slot,
    a stored tensor or any view of it still holds is never written over). At most KEEP buffers,
    each as large as the largest result so far, are kept."""

    MIN_BYTES = 256 << 10  # smaller results come from malloc's own reused memory
    KEEP = 3

    def __init__(self) -> None:
        self._pool: list[np.ndarray] = []

    def take(self, dtype: np.dtype, size: int) -> np.ndarray:
        nbytes = size * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return np.empty(size, dtype)
        pool = self._pool
        for i in range(len(pool)):
            if sys.getrefcount(pool[i]) == 2:  # the pool's own reference and the call's argument
                if pool[i].nbytes < nbytes:
                    pool[i] = np.empty(nbytes, np.uint8)
                return pool[i][:nbytes].view(dtype)
        buffer = np.empty(nbytes, np.uint8)
        if len(pool) < self.KEEP:
            pool.append(buffer)
        return buffer.view(dtype)


@contextlib.contextmanager
def standalone(world) -> Iterator[MpiComm]:
    """An MpiComm between the ranks of the MPI communicator `world` with no coordinator: its
    ZeroMQ inboxes (for aborts) in a fresh private directory, their addresses shared over MPI.
    For benchmarks and tests run straight under mpiexec."""
    import zmq

    from transport.sockets import IpcDir, Security, pull

    rank = world.Get_rank()
    directory = IpcDir() if rank == 0 else None
    where = world.bcast(directory.path if directory else None)
    context = zmq.Context()
    security = Security(context, None)
    inbox, endpoint = pull(context, f"ipc://{where}/data-{rank}", security)
    comm = MpiComm(rank, inbox, world.allgather(endpoint), context, security, world.Dup())
    world.Barrier()
    try:
        yield comm
    finally:
        comm.close()
        inbox.close(0)
        context.destroy(linger=0)  # also a socket an exception left unclosed: term would wait for it
        world.Barrier()
        if directory is not None:
            directory.close()


class MpiEngine(HostEngine):
    """MPI's own collectives: Allreduce, Reduce_scatter and Allgatherv where split_state's table
    picks them, every exchange phase as one Alltoallv; reduce phases (dtypes MPI cannot sum,
    splits in several segments) point to point, summed in rank order as on the host planes.
    Usability is checked by every call of the comm (a revoked communicator refuses them), so the
    engine's own check stays the host planes' no-op."""

    def exchange(self, local: Any, phase, tag) -> Any:
        n, rank, itemsize = self.size, self.rank, local.dtype.itemsize
        packing = phase.derived(("alltoallv", n, rank, itemsize), lambda: Packing.of(phase, n, rank, itemsize))
        out = np.empty(phase.out_shape(n, rank), dtype=local.dtype)
        boxes = [local[t.src_box].reshape(-1) for t in packing.sends]
        send = np.concatenate(boxes) if boxes else np.empty(0, local.dtype)
        into = np.empty(sum(packing.received) // itemsize, local.dtype)
        self.comm.all_to_all(send, packing.sent, into, packing.received, tag.run)
        at = 0
        for t in packing.receives:
            target = out[t.dst_box]
            out[t.dst_box] = into[at : at + target.size].reshape(target.shape)
            at += target.size
        for t in packing.own:
            out[t.dst_box] = local[t.src_box]
        return out

    def all_reduce(self, flat: Any, tag) -> Any:
        return self.comm.all_reduce(flat, tag.run)

    def writes_into(self, algorithm, r) -> bool:
        """MPI's calls return arrays of their own: a program's buffer would take a copy."""
        return False

    def bound(self, algorithm, r):
        """MPI's Allreduce bound for one request (Collectives.prepared): no tag, algorithm or
        reshape between a program step and the call."""
        if algorithm.name == "native_all_reduce":
            return self.comm.bound_all_reduce(np.dtype(r.dtype), r.shape)
        return None

    def all_gather(self, flat: Any, blocks: tuple[int, ...], tag) -> Any:
        return self.comm.all_gather(flat, blocks, tag.run)

    def reduce_scatter(self, flat: Any, blocks: tuple[int, ...], tag) -> Any:
        return self.comm.reduce_scatter(flat, blocks, tag.run)
