"""Collectives between CuPy workers on distinct GPUs through NCCL (cupy.cuda.nccl).

The coordinator makes the NCCL unique id (it hosts NCCL's bootstrap root) and sends it in
Configure; every worker joins the communicator while it handles that message. Data moves GPU to
GPU, never through host memory:

- all-reduce is ncclAllReduce (split_state.algorithms.NativeAllReduce), in place: every rank gets
  the same bits (NCCL's reduction order is fixed per communicator), though not necessarily the
  rank-order bits of the host reference;
- every other algorithm runs its phases as grouped ncclSend/ncclRecv (`NcclEngine`), and
  reductions add the received contributions in rank order on the device, as the host path does.

Waiting on the GPU polls the stream with the collective deadline and watches the ZeroMQ data
plane for aborts; on either, the communicator is aborted (ncclCommAbort) so no kernel spins
forever, and the comm refuses further work with a typed error.

`NcclDevice` is the only code that speaks NCCL's pointer API; the rest works on arrays, so tests
can stand in for the library with a host implementation of the same few operations.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any

from split_state.algorithms import Phase, Tag
from split_state.dtypes import dtype_name
from split_state.errors import TransportError, UnsupportedDtype, WorkerLost
from split_state.layout import box_shape
from split_state.transitions import Transfer, owned_groups
from transport.deadline import Deadline
from workers.comm import Waiter, ZmqComm

UNIQUE_ID_BYTES = 128

# ncclDataType_t values from nccl.h (stable since NCCL 2.10); CuPy may not name all of them.
_NCCL_TYPES = {
    "int8": 0,
    "bool": 1,  # sent as uint8; never reduced
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
NCCL_SUM = 0


def make_unique_id() -> bytes:
    """A fresh NCCL unique id as bytes (this process then hosts the bootstrap root)."""
    from cupy.cuda import nccl

    return struct.pack(f"{UNIQUE_ID_BYTES}b", *nccl.get_unique_id())


def nccl_available() -> bool:
    try:
        from cupy.cuda import nccl

        return nccl.get_version() >= 2700  # grouped send/recv came with NCCL 2.7
    except Exception:  # no CuPy, no NCCL in this CuPy build, no driver
        return False


def nccl_type(dtype: Any) -> int:
    name = dtype_name(dtype)
    if name not in _NCCL_TYPES:
        raise UnsupportedDtype(f"dtype {name} has no NCCL equivalent")
    return _NCCL_TYPES[name]


class NcclDevice:
    """Array-level NCCL operations on one GPU: the thin layer over cupy.cuda.nccl."""

    def __init__(self, world_size: int, unique_id: bytes, rank: int):
        import cupy
        from cupy.cuda import nccl

        if len(unique_id) != UNIQUE_ID_BYTES:
            raise TransportError(f"NCCL unique id of {len(unique_id)} bytes, expected {UNIQUE_ID_BYTES}")
        self.cupy, self.nccl = cupy, nccl
        self.comm = nccl.NcclCommunicator(world_size, struct.unpack(f"{UNIQUE_ID_BYTES}b", unique_id), rank)

    def _stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def all_reduce(self, array: Any) -> None:
        """Sum `array` (contiguous) over all ranks, in place."""
        ptr = array.data.ptr
        self.comm.allReduce(ptr, ptr, array.size, nccl_type(array.dtype), NCCL_SUM, self._stream())

    def exchange(self, sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]]) -> None:
        """Post every (contiguous array, peer) send and receive as one NCCL group."""
        stream = self._stream()
        self.nccl.groupStart()
        try:
            for array, peer in sends:  # as bytes: any dtype moves, none is reduced here
                self.comm.send(array.data.ptr, array.nbytes, _NCCL_TYPES["uint8"], peer, stream)
            for array, peer in recvs:
                self.comm.recv(array.data.ptr, array.nbytes, _NCCL_TYPES["uint8"], peer, stream)
        finally:
            self.nccl.groupEnd()

    def done(self) -> bool:
        return self.cupy.cuda.get_current_stream().done

    def capturing(self) -> bool:
        """Whether the stream NCCL's calls go to is being captured into a device graph."""
        return self.cupy.cuda.get_current_stream().is_capturing()

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.destroy()


class NcclComm(ZmqComm):
    """ZeroMQ for signalling (aborts) and host-staged fallbacks; NCCL for the data."""

    plane = "nccl"

    def __init__(self, rank, inbox, peers, context, security, device: NcclDevice):
        super().__init__(rank, inbox, peers, context, security)
        self.device = device
        self.broken = ""  # why the communicator was aborted, once it was

    def wait(self, run: int, deadline: Deadline, counted: bool = True) -> None:
        """Until the GPU has finished what was posted; aborts the communicator on a deadline or
        an abort from a peer, so a lost peer never leaves a kernel waiting forever. `counted`:
        the time counts as waiting on peers (not where it waits for a whole program)."""
        waiter = Waiter(deadline)
        start = time.perf_counter()
        try:
            while not self.device.done():
                try:
                    self._check_signals(run)
                except Exception as exc:
                    self._abort_device(f"{type(exc).__name__}: {exc}")
                    raise
                if not waiter.pause():
                    self._abort_device(f"run {run} did not finish within {deadline.seconds:.1f} s")
                    raise WorkerLost(
                        f"worker {self.rank}: NCCL collective of run {run} did not finish within "
                        f"{deadline.seconds:.1f} s; a peer is lost or stuck",
                        rank=-1,
                    )
        finally:
            if counted:
                self.waited += time.perf_counter() - start

    def _abort_device(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            self.device.abort()

    def engine(self, backend):
        return NcclEngine(self, backend)

    def check_usable(self) -> None:
        if self.broken:
            raise TransportError(
                f"worker {self.rank}: the NCCL communicator was aborted ({self.broken}); restart the cluster"
            )

    def close(self) -> None:
        super().close()
        if not self.broken:
            self.device.close()


class NcclEngine:
    """The primitives of split_state.algorithms on NCCL: grouped GPU-to-GPU sends and receives,
    rank-order sums on the device, and ncclAllReduce as the native all-reduce.

    NCCL's calls can be captured into a device graph (NCCL >= 2.9): `captures` says so to
    workers/graphs.py, which then keeps a decode step's collectives inside its graph. While its
    stream is captured, a collective is recorded, not waited for (a captured stream cannot be
    queried); a program holding captured collectives waits for the device at its end through
    `wait_device`, with the collective deadline and the abort watch."""

    captures = True

    def __init__(self, comm: NcclComm, backend):
        self.comm, self.backend, self.xp = comm, backend, backend.xp
        self.rank, self.size, self.plane = comm.rank, comm.size, comm.plane

    def check_usable(self) -> None:
        self.comm.check_usable()

    def _settle(self, tag: Tag) -> None:
        if not self.comm.device.capturing():
            self.comm.wait(tag.run, tag.deadline)

    def wait_device(self, run: int, deadline: Deadline) -> None:
        """Until the device has done everything issued (a replayed graph's collectives among it)."""
        self.comm.wait(run, deadline, counted=False)

    def all_reduce(self, flat: Any, tag: Tag) -> Any:
        flat = flat.copy()  # NCCL sums in place; the caller's array stays as it was
        self.comm.device.all_reduce(flat)
        self._settle(tag)
        return flat

    def _transfer(self, local, plan: Sequence[Transfer], shape, tag: Tag) -> dict[int, Any]:
        """Run the remote transfers of `plan` for this rank; received arrays by id(transfer)."""
        rank, xp = self.rank, self.xp
        sends = [(xp.ascontiguousarray(local[t.src_box]), t.dst) for t in plan if t.src == rank and t.dst != rank]
        recvs = [
            (t, xp.empty(box_shape(t.dst_box, shape), local.dtype)) for t in plan if t.dst == rank and t.src != rank
        ]
        self.comm.device.exchange(sends, [(array, t.src) for t, array in recvs])
        self._settle(tag)
        return {id(t): array for t, array in recvs}

    def exchange(self, local, phase: Phase, tag: Tag):
        out_shape = phase.out_shape(self.size, self.rank)
        received = self._transfer(local, phase.transfers, out_shape, tag)
        out = self.xp.empty(out_shape, dtype=local.dtype)
        for t in phase.transfers:
            if t.dst == self.rank:
                out[t.dst_box] = local[t.src_box] if t.src == self.rank else received[id(t)]
        return out

    def reduce(self, local, phase: Phase, tag: Tag):
        out_shape = phase.out_shape(self.size, self.rank)
        received = self._transfer(local, phase.transfers, out_shape, tag)
        rank, n = self.rank, self.size
        out = self.xp.empty(out_shape, dtype=local.dtype)
        for box, group in owned_groups(phase.transfers, n, rank):
            parts = [local[t.src_box] if t.src == rank else received[id(t)] for t in group]
            total = parts[0] + parts[1] if n > 1 else parts[0].copy()
            for part in parts[2:]:
                total += part
            out[box] = total
        return out
