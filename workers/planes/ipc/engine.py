"""Collectives between CuPy workers on one host through CUDA IPC, as vLLM's custom all-reduce:
every worker's device buffer is opened by every peer (cupy.cuda.runtime.ipcGetMemHandle /
ipcOpenMemHandle), so a worker reads its peers' data where it lies, GPU to GPU, and
interprocess events (ipcGetEventHandle / ipcOpenEventHandle, streamWaitEvent) order the GPU
work of different processes without the host waiting for any GPU.

One operation (every rank runs every one, in the same order, numbered `seq`):
  1. the rank writes what it shares into half `seq % 2` of its buffer, on its compute stream;
  2. it records its event of that half and tells every peer over the host comm (an 8-byte
     message through the shared-memory rings): "the record of seq is issued";
  3. on each peer's message it makes its stream wait for that peer's event (streamWaitEvent
     waits for the latest record issued before the call: the peer's of this seq);
  4. its kernels read the peers' halves.
Why two halves: a rank rewrites half k at seq + 2 only after its stream waited for every peer's
record of seq + 1, which each peer issued after its reads of seq; so no half is read while its
owner rewrites it, and nothing waits on the host but for the peers' 8-byte messages.

The all-reduce is one shot for small tensors (each rank reads every peer's whole tensor and sums
in rank order) and two shots for larger ones (each rank sums its chunk from every peer and
shares it; every rank then gathers the chunks), in pieces of a half's size (REGION_ENV). The other
algorithms' phases (exchange, reduce) run the same way when every rank's sends fit a half,
and through host memory otherwise. Sums are in rank order with the first two added in one pass,
as workers.collectives.HostEngine adds, so every rank gets the same bits as the shm plane gives.

Every rank must count the same operations. A failed one (a peer that failed before an
operation its peers began) leaves the counts apart; the plane then refuses work with a typed
error until the coordinator resyncs it, which it does after every failed run
(transport.protocol.Resync, `IpcComm.resync`): each rank drains its stream, then all take the
largest count. So a failed run costs the cluster nothing, and `auto` picks this plane for CuPy
workers spawned on one host that share one GPU.

`IpcDevice` is the only code that speaks CUDA's IPC API; the rest works on arrays.
"""

from __future__ import annotations

import itertools
import os
from math import prod
from typing import Any

import numpy as np

from split_state.algorithms import Phase, Tag
from split_state.errors import TransportError
from split_state.layout import box_shape
from split_state.transitions import flat_split
from transport.deadline import Deadline
from workers.collectives import HostEngine
from workers.comm import HostComm

# a half's bytes per round (a rank's buffer is four), in MiB: the piece an all-reduce moves per
# two signal rounds. 32 MiB: on an H100 a 64 MiB all-reduce took 3.4 ms in 8 MiB pieces and
# 0.36-0.82 ms in 32 MiB ones (the rounds cost more than the bytes); tests ask for less to keep
# the stand-in's /dev/shm files small
REGION_ENV = "META_TP_IPC_REGION_MIB"
DEFAULT_REGION_MIB = 32
ONE_SHOT_BYTES = 256 << 10  # up to this size every rank reads every peer's whole tensor
ALIGN = 256  # offsets of the boxes a rank shares, in bytes (CUDA's allocation alignment)
ROUND_TAG = 1 << 28  # the second round of an operation: no program has that many steps
HANDLES_RUN = 0  # the run tag of the handle exchange at connect (programs' runs start at 1)
HANDLE_BYTES = 64
MAX_VIEWS = 4096


def region_mib() -> int:
    """The half's size this worker's environment asks for (REGION_ENV), in MiB."""
    text = os.environ.get(REGION_ENV, str(DEFAULT_REGION_MIB))
    if not text.isdigit() or int(text) < 1:
        raise TransportError(f"{REGION_ENV}={text!r}: give a whole number of MiB, 1 or more")
    return int(text)


class IpcDevice:
    """This rank's shared buffer and events, and the peers' as opened here: the thin layer over
    cupy.cuda.runtime's IPC calls. The buffer is two halves of two regions (round 0: what the
    rank shares; round 1: the chunk it reduced), one event per half and round."""

    def __init__(self):
        import cupy

        self.cupy, self.runtime = cupy, cupy.cuda.runtime
        self.region_bytes = region_mib() << 20
        self.own = self.runtime.malloc(4 * self.region_bytes)
        self.events = [cupy.cuda.Event(block=False, disable_timing=True, interprocess=True) for _ in range(4)]
        self.bases: dict[int, int] = {}  # peer -> its buffer's address here
        self.peer_events: dict[int, list[int]] = {}
        self.views: dict[tuple, Any] = {}

    def handles(self) -> np.ndarray:
        raw = self.runtime.ipcGetMemHandle(self.own)
        raw += b"".join(self.runtime.ipcGetEventHandle(e.ptr) for e in self.events)
        return np.frombuffer(raw, np.uint8).copy()

    def open(self, peer: int, handles: np.ndarray) -> None:
        raw = handles.tobytes()
        if len(raw) != 5 * HANDLE_BYTES:
            raise TransportError(f"worker {peer} sent {len(raw)} bytes of IPC handles, expected {5 * HANDLE_BYTES}")
        parts = [raw[i : i + HANDLE_BYTES] for i in range(0, len(raw), HANDLE_BYTES)]
        self.bases[peer] = self.runtime.ipcOpenMemHandle(parts[0], self.runtime.cudaIpcMemLazyEnablePeerAccess)
        self.peer_events[peer] = [self.runtime.ipcOpenEventHandle(h) for h in parts[1:]]

    def view(self, rank: int, half: int, region: int, offset: int, shape: tuple[int, ...], dtype) -> Any:
        """An array over `rank`'s buffer (this rank's own or a peer's): made once per place."""
        key = (rank, half, region, offset, shape, dtype)
        got = self.views.get(key)
        if got is None:
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            base = self.bases.get(rank, self.own)
            nbytes = prod(shape) * np.dtype(dtype).itemsize
            ptr = base + (2 * half + region) * self.region_bytes + offset
            memory = self.cupy.cuda.UnownedMemory(ptr, nbytes, self)
            got = self.views[key] = self.cupy.ndarray(shape, dtype, memptr=self.cupy.cuda.MemoryPointer(memory, 0))
        return got

    def record(self, half: int, region: int) -> None:
        self.events[2 * half + region].record(self.cupy.cuda.get_current_stream())

    def wait(self, peer: int, half: int, region: int) -> None:
        """The current stream waits for the peer's latest record of this half and round."""
        stream = self.cupy.cuda.get_current_stream().ptr
        self.runtime.streamWaitEvent(stream, self.peer_events[peer][2 * half + region], 0)

    def drain(self) -> None:
        """Wait until this rank's stream has done its work: nothing of ours reads a peer's buffer."""
        self.cupy.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        self.drain()
        self.views.clear()
        for peer, base in self.bases.items():
            self.runtime.ipcCloseMemHandle(base)
            for event in self.peer_events[peer]:
                self.runtime.eventDestroy(event)
        self.bases, self.peer_events = {}, {}
        self.runtime.free(self.own)


class IpcComm(HostComm):
    """Shared-memory rings for the signals (and host-staged fallbacks); CUDA IPC for the data."""

    plane = "ipc"

    def __init__(self, rank, inbox, peers, context, security, session: str, device: IpcDevice, timeout: float):
        try:
            super().__init__(rank, inbox, peers, context, security, session)
        except BaseException:
            device.close()
            raise
        self.device = device
        self.seq = 0  # operations so far: the same on every rank while none failed
        self.broken = ""
        self.others = [r for r in range(self.size) if r != rank]
        try:  # every peer's handles, within the deadline
            deadline = Deadline(timeout)
            mine = device.handles()
            for peer in self.others:
                self.send(peer, HANDLES_RUN, 0, mine)
            for peer in self.others:
                device.open(peer, self._read_array(peer, HANDLES_RUN, 0, deadline, mine.shape, mine.dtype))
            self.flush(HANDLES_RUN, deadline)
        except BaseException:
            self.close()
            raise

    def _read_array(self, peer: int, run: int, step: int, deadline: Deadline, shape, dtype) -> np.ndarray:
        """The peer's message (run, step), which must be a `shape` array of `dtype`."""
        got = np.empty(shape, dtype)
        flat = got.reshape(-1)

        def sink(at: int, fragment: np.ndarray) -> None:
            flat[at : at + fragment.size] = fragment

        self.receive(peer, run, step, deadline, tuple(shape), np.dtype(dtype), sink)
        return got

    def engine(self, backend):
        return IpcEngine(self, backend)

    def check_usable(self) -> None:
        if self.broken:
            raise TransportError(
                f"worker {self.rank}: the IPC plane failed ({self.broken}) and was not brought back "
                "(the coordinator resyncs it after a failed run); restart the cluster"
            )

    def begin(self) -> tuple[int, int]:
        """The next operation's number and the half it uses."""
        seq = self.seq
        self.seq += 1
        return seq, seq % 2

    def share(self, seq: int, half: int, region: int, tag: Tag) -> None:
        """Record this half's event of `region` and tell every peer (step 2 of the protocol)."""
        self.device.record(half, region)
        note = np.array([seq], np.int64)
        for peer in self.others:
            self.send(peer, tag.run, tag.step + region * ROUND_TAG, note)

    def await_peers(self, seq: int, half: int, region: int, tag: Tag) -> None:
        """Step 3: the stream waits for every peer's record of `seq`, as each one's message comes."""
        for peer in self.others:
            got = int(self._read_array(peer, tag.run, tag.step + region * ROUND_TAG, tag.deadline, (1,), np.int64)[0])
            if got != seq:
                raise TransportError(f"worker {self.rank}: worker {peer} is at IPC operation {got}, this one at {seq}")
            self.device.wait(peer, half, region)
        self.flush(tag.run, tag.deadline)

    def resync(self, run: int, deadline: Deadline) -> None:
        """After a failed run (which leaves the ranks' operation counts apart): each rank lets
        its stream finish, then sends its count; every rank takes the largest. A rank's count
        leaves only once its stream is done, so when every peer's has come no half is being
        read anywhere, and any number is safe to go on from, as long as all take the same."""
        self.device.drain()
        mine = np.array([self.seq], np.int64)
        for peer in self.others:
            self.send(peer, run, 0, mine)
        counts = [int(self._read_array(peer, run, 0, deadline, (1,), np.int64)[0]) for peer in self.others]
        self.flush(run, deadline)
        self.seq, self.broken = max([self.seq, *counts]), ""

    def close(self) -> None:
        try:
            self.device.close()
        finally:
            super().close()


class IpcEngine:
    """The primitives of split_state.algorithms over CUDA IPC (module docstring)."""

    def __init__(self, comm: IpcComm, backend):
        self.comm, self.backend, self.xp = comm, backend, backend.xp
        self.rank, self.size, self.plane = comm.rank, comm.size, comm.plane
        self.host = HostEngine(comm, backend)  # phases too big for a half

    def check_usable(self) -> None:
        self.comm.check_usable()

    def _guarded(self, operation, *args):
        """Run one operation; a failure leaves the ranks' operation counts apart, so the plane
        refuses further work with a typed error instead of mixing up halves."""
        try:
            return operation(*args)
        except BaseException as exc:
            self.comm.broken = self.comm.broken or f"{type(exc).__name__}: {exc}"
            raise

    # -- all-reduce -------------------------------------------------------------------------------

    def all_reduce(self, flat: Any, tag: Tag) -> Any:
        out = self.xp.empty_like(flat)
        piece = max(1, self.comm.device.region_bytes // flat.itemsize)
        for lo in range(0, flat.size, piece):
            part, target = flat[lo : lo + piece], out[lo : lo + piece]
            shots = self._one_shot if part.nbytes <= ONE_SHOT_BYTES else self._two_shot
            self._guarded(shots, part, target, tag)
        return out

    def _share(self, boxes: list[tuple[int, Any]], tag: Tag) -> tuple[int, int]:
        """Steps 1-3 of an operation: write each (offset, array) into this rank's next half,
        record, signal, and make the stream wait for every peer's record. (seq, half)."""
        comm, device = self.comm, self.comm.device
        seq, half = comm.begin()
        for offset, box in boxes:
            device.view(self.rank, half, 0, offset, box.shape, box.dtype)[...] = box
        comm.share(seq, half, 0, tag)
        comm.await_peers(seq, half, 0, tag)
        return seq, half

    def _one_shot(self, part: Any, target: Any, tag: Tag) -> None:
        device = self.comm.device
        _, half = self._share([(0, part)], tag)
        views = [
            part if r == self.rank else device.view(r, half, 0, 0, part.shape, part.dtype) for r in range(self.size)
        ]
        _sum_in_rank_order(self.xp, views, target)

    def _two_shot(self, part: Any, target: Any, tag: Tag) -> None:
        comm, device, xp, dtype = self.comm, self.comm.device, self.xp, part.dtype
        seq, half = self._share([(0, part)], tag)
        starts = [0, *itertools.accumulate(flat_split(part.size, self.size).segments[0])]
        lo, hi = starts[self.rank], starts[self.rank + 1]
        shape, offset = (hi - lo,), lo * part.itemsize
        mine = [
            part[lo:hi] if r == self.rank else device.view(r, half, 0, offset, shape, dtype) for r in range(self.size)
        ]
        _sum_in_rank_order(xp, mine, device.view(self.rank, half, 1, offset, shape, dtype))
        comm.share(seq, half, 1, tag)
        comm.await_peers(seq, half, 1, tag)
        for r in range(self.size):
            a, b = starts[r], starts[r + 1]
            target[a:b] = device.view(r, half, 1, a * part.itemsize, (b - a,), dtype)

    # -- the phases of the other algorithms -------------------------------------------------------

    def _layout(self, phase: Phase, itemsize: int) -> dict[int, int] | None:
        """Where each remote transfer's box lies in its sender's half (by id of the transfer),
        or None when some rank's sends do not fit one: worked out once per phase."""

        def make():
            offsets, used = {}, [0] * self.size
            for t in phase.transfers:
                if t.src == t.dst:
                    continue
                offsets[id(t)] = used[t.src]
                nbytes = prod(box_shape(t.dst_box, phase.out_shape(self.size, t.dst))) * itemsize
                used[t.src] += -(-nbytes // ALIGN) * ALIGN
            return offsets if max(used) <= self.comm.device.region_bytes else None

        return phase.derived(("ipc", itemsize), make)

    def _publish(self, local: Any, phase: Phase, layout: dict[int, int], tag: Tag) -> int:
        """Steps 1-3 for a phase's sends, at their places in the layout; the half."""
        return self._share([(layout[id(t)], local[t.src_box]) for t in phase.share(self.size, self.rank).sends], tag)[1]

    def _received(self, t, layout, half: int, shape: tuple[int, ...], dtype) -> Any:
        return self.comm.device.view(t.src, half, 0, layout[id(t)], box_shape(t.dst_box, shape), dtype)

    def exchange(self, local: Any, phase: Phase, tag: Tag) -> Any:
        layout = self._layout(phase, local.itemsize)
        if layout is None:
            return self.host.exchange(local, phase, tag)
        return self._guarded(self._exchange, local, phase, layout, tag)

    def _exchange(self, local: Any, phase: Phase, layout: dict[int, int], tag: Tag) -> Any:
        half = self._publish(local, phase, layout, tag)
        share = phase.share(self.size, self.rank)
        out = self.xp.empty(share.out_shape, dtype=local.dtype)
        for t in share.receives:
            remote = t.src != self.rank
            out[t.dst_box] = (
                self._received(t, layout, half, share.out_shape, local.dtype) if remote else local[t.src_box]
            )
        return out

    def reduce(self, local: Any, phase: Phase, tag: Tag) -> Any:
        layout = self._layout(phase, local.itemsize)
        if layout is None:
            return self.host.reduce(local, phase, tag)
        return self._guarded(self._reduce, local, phase, layout, tag)

    def _reduce(self, local: Any, phase: Phase, layout: dict[int, int], tag: Tag) -> Any:
        half = self._publish(local, phase, layout, tag)
        share = phase.share(self.size, self.rank)
        out = self.xp.empty(share.out_shape, dtype=local.dtype)
        for box, group in share.owned:
            parts = [
                local[t.src_box]
                if t.src == self.rank
                else self._received(t, layout, half, share.out_shape, local.dtype)
                for t in group
            ]
            _sum_in_rank_order(self.xp, parts, out[box])  # a plane of one worker is never IPC: two parts or more
        return out


def _sum_in_rank_order(xp, parts: list, out: Any) -> None:
    """out = parts[0] + parts[1] + ... in rank order, the first two in one pass (a + b is b + a
    bit for bit), as HostEngine.reduce adds: every rank gets the same bits."""
    xp.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out += part
