"""Point-to-point transport between workers for collectives.

Two implementations share the matching logic in `Inbox`: `ZmqComm` (PUSH to each peer, one PULL
inbox; peers on one host or across hosts) and `QueueComm` (in-process queues, for the simulator).
Messages between a pair arrive in order; they are matched by (source, run, step) and anything
from an older run is stale and dropped. An Abort for the current run (or for every run) ends the
wait at once with a typed error, so a failed or lost peer never leaves the others hanging.
"""

from __future__ import annotations

import collections
import queue
import time
from typing import Any

import numpy as np
import zmq

from split_state.errors import ProtocolError, RemoteError, WorkerLost
from transport import protocol as p
from transport.deadline import Deadline
from transport.sockets import Security, push, send


class Inbox:
    rank: int
    size: int

    def __init__(self) -> None:
        self._stash: dict[int, collections.deque[p.Chunk]] = collections.defaultdict(collections.deque)
        self._aborts: dict[int, p.Abort] = {}
        self.waited = 0.0  # seconds spent blocked on peers: the 'waiting' share of a step

    # implemented by subclasses
    def _next(self, timeout: float) -> p.Chunk | p.Abort | None: ...
    def _send(self, dst: int, message: p.Chunk | p.Abort) -> None: ...

    def send(self, dst: int, run: int, step: int, array: np.ndarray) -> None:
        self._send(dst, p.Chunk(self.rank, run, step, np.ascontiguousarray(array)))

    def abort(self, run: int, kind: str, message: str) -> None:
        """Tell every peer that run `run` cannot finish because of this worker."""
        for dst in range(self.size):
            if dst != self.rank:
                try:
                    self._send(dst, p.Abort(self.rank, run, kind, message))
                except Exception:  # a peer that is gone cannot be told; it is failing anyway
                    pass

    def recv(self, src: int, run: int, step: int, deadline: Deadline) -> np.ndarray:
        while True:
            self._raise_if_aborted(run)
            stash = self._stash[src]
            while stash and stash[0].run < run:
                stash.popleft()  # stale data of an earlier, failed run
            for i, chunk in enumerate(stash):
                if chunk.run == run and chunk.step == step:
                    del stash[i]
                    return chunk.array
            start = time.perf_counter()
            message = self._next(deadline.remaining())
            self.waited += time.perf_counter() - start
            if message is None:
                raise WorkerLost(
                    f"worker {self.rank}: no data from worker {src} within {deadline.seconds:.1f} s "
                    f"(run {run}, step {step})",
                    rank=src,
                )
            if isinstance(message, p.Abort):
                self._aborts[message.run] = message
            elif message.run >= run:
                self._stash[message.src].append(message)

    def _raise_if_aborted(self, run: int) -> None:
        abort = self._aborts.get(run) or self._aborts.get(-1)
        if abort is None:
            return
        text = f"run {run} aborted: worker {abort.rank} reports {abort.kind}: {abort.message}"
        if abort.kind == "WorkerLost":
            raise WorkerLost(text, rank=abort.rank)
        raise RemoteError(text, rank=abort.rank, kind=abort.kind)

    def forget_aborts(self) -> None:
        self._aborts = {r: a for r, a in self._aborts.items() if r == -1}


class QueueComm(Inbox):
    """In-process comm: one queue per destination, shared by all simulated devices."""

    def __init__(self, rank: int, queues: list[queue.Queue]):
        super().__init__()
        self.rank, self.size, self.queues = rank, len(queues), queues

    def _send(self, dst: int, message: Any) -> None:
        if isinstance(message, p.Chunk):  # a copy, as a real transport would deliver
            message = p.Chunk(message.src, message.run, message.step, np.array(message.array, copy=True))
        self.queues[dst].put(message)

    def _next(self, timeout: float):
        try:
            return self.queues[self.rank].get(timeout=timeout)
        except queue.Empty:
            return None


class ZmqComm(Inbox):
    """Host-staged collectives over ZeroMQ: PUSH to each peer's PULL inbox."""

    def __init__(self, rank: int, inbox: zmq.Socket, peers: list[str], context: zmq.Context, security: Security):
        super().__init__()
        self.rank, self.size, self.inbox = rank, len(peers), inbox
        self.outboxes = {d: push(context, ep, security) for d, ep in enumerate(peers) if d != rank}

    def _send(self, dst: int, message: Any) -> None:
        send(self.outboxes[dst], message)

    def _next(self, timeout: float):
        """The next Chunk or Abort within `timeout` seconds, else None. Anything else that reaches
        the data plane (malformed bytes, other message types) is dropped, and the wait goes on."""
        end = time.monotonic() + timeout
        while self.inbox.poll(max(0, int((end - time.monotonic()) * 1000))):
            try:
                message, _ = p.decode(self.inbox.recv_multipart(copy=False))
            except ProtocolError:
                continue
            if isinstance(message, (p.Chunk, p.Abort)):
                return message
        return None

    def close(self) -> None:
        for sock in self.outboxes.values():
            sock.close(0)
        self.outboxes = {}
