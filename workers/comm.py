"""Point-to-point transport between workers for collectives.

Four implementations share the matching logic in `Inbox`: `ZmqComm` (PUSH to each peer, one PULL
inbox; peers on one host or across hosts), `HostComm` (ZmqComm plus shared-memory rings for the
peers on this host), `QueueComm` (in-process queues, for the simulator) and, in
workers/planes/nccl/engine.py, `NcclComm` (ZmqComm for signalling beside NCCL for the data). Messages between a
pair arrive in order; they are matched by (source, run, step) and anything from an older run is
stale and dropped. An Abort for the current run (or for every run) ends the wait at once with a
typed error, so a failed or lost peer never leaves the others hanging.

A receiver takes a message as flat fragments handed to a sink (`receive`), so a reduction can add
straight from where the bytes arrived; `recv` returns a whole array.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import queue
import time
from math import prod
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from split_state.errors import ProtocolError, RemoteError, TransportError, WorkerLost
from transport import protocol as p
from transport.deadline import Deadline
from transport.shm import (
    POST_BYTES,
    InboxFile,
    Postbox,
    RecordHeader,
    RingReader,
    RingWriter,
    Sink,
    fence,
    inbox_path,
    post_stamp,
    ring_capacity,
)
from transport.sockets import Security, push, send_frames
from workers.binding import bound

# poll this long for a peer's bytes before sleeping, while every worker has a core. In a SmolLM2
# decode step on 2 workers the one with fewer KV heads waits 100-200 us at each attention
# all-reduce; after a sleep the futex wake-up made it late for the next one (profiled step:
# collectives 7-8 ms per token with 50 us spins, 2.3 ms with 1 ms). A 4 KiB all-reduce beside a
# busy neighbour process: 393 us with 50 us spins, 31 us with 1 ms; the test suite is no slower
SPIN_SECONDS = 1e-3
POLITE_SPIN_SECONDS = 200e-6  # with more workers than cores: yield the core while spinning this long
BLOCK_SECONDS = 2e-3  # the longest sleep: how late an abort over ZeroMQ may be seen by a sleeping worker
NAP_SECONDS = 50e-6  # GPU waits (nothing wakes them): sleep in naps this short at first
MAX_NAP_SECONDS = 1e-3
SIGNAL_SECONDS = 50e-6  # how often a waiting worker looks for aborts
# how long a peer whose connection closed has to deliver what it sent before it left (a failed
# worker's Abort, sent just before it exits) before a wait on it is WorkerLost instead
LOST_GRACE_SECONDS = 0.5
MAX_EARLY_BYTES = 256 << 20  # data set aside for the next run, at most (more is dropped)


def check_arrival(shape, dtype, want_shape, want_dtype, src: int, step: int) -> None:
    if shape != want_shape or dtype != want_dtype:
        raise ProtocolError(
            f"step {step}: worker {src} sent {tuple(shape)} {np.dtype(dtype)}, the plan expects "
            f"{tuple(want_shape)} {np.dtype(want_dtype)}"
        )


class Inbox:
    rank: int
    size: int
    plane = ""  # the data plane's name, as reported to the coordinator
    note = ""  # why a faster data plane was not used, if it was asked for

    def __init__(self) -> None:
        self._stash: dict[int, collections.deque[p.Chunk]] = collections.defaultdict(collections.deque)
        self._aborts: dict[int, p.Abort] = {}
        self.waited = 0.0  # seconds spent blocked on peers: the 'waiting' share of a step
        # how many runs past the awaited one may be in flight: one (the coordinator starts a run
        # once every worker has finished the one before), more while a pipelined generation
        # interleaves its lanes' runs (workers/pipelined.py) or a chain's runs go on without a
        # wait between them (workers/server.py)
        self.lookahead = 1
        self.bytes_sent = 0  # payload bytes sent to peers, as the collective algorithms charge them

    # implemented by subclasses
    def _next(self, timeout: float) -> p.Chunk | p.Abort | None: ...
    def _send(self, dst: int, message: p.Chunk | p.Abort) -> None: ...

    def send(self, dst: int, run: int, step: int, array: np.ndarray) -> None:
        self.bytes_sent += array.nbytes
        self._send(dst, p.Chunk(self.rank, run, step, array))  # encode makes it contiguous

    def abort(self, run: int, kind: str, message: str) -> None:
        """Tell every peer that run `run` cannot finish because of this worker."""
        for dst in range(self.size):
            if dst != self.rank:
                try:
                    self._send(dst, p.Abort(self.rank, run, kind, message))
                except Exception:  # a peer that is gone cannot be told; it is failing anyway
                    pass

    def receive(
        self, src: int, run: int, step: int, deadline: Deadline, shape: tuple[int, ...], dtype: np.dtype, sink: Sink
    ) -> None:
        """Hand the message (src, run, step), which must be a `shape` array of `dtype`, to `sink`
        as flat fragments in order: sink(element offset, fragment). Fragments are valid only
        during the call."""
        array = self.recv(src, run, step, deadline)
        check_arrival(array.shape, array.dtype, shape, dtype, src, step)
        sink(0, array.reshape(-1))

    def flush(self, run: int, deadline: Deadline) -> None:
        """Wait until everything sent has left this worker (a no-op where sends never queue)."""

    def stop_word(self, dst: int):
        """A uint64 word in `dst`'s memory that this worker may store into and `dst` reads as its
        `own_stop_word()` (a worker-driven generation's stop flag, workers/generation.py), or
        None where there is none (another host): then send a message."""
        return None

    def own_stop_word(self):
        """The word peers store into with `stop_word(this rank)`, or None."""
        return None

    def recv(self, src: int, run: int, step: int, deadline: Deadline) -> np.ndarray:
        while True:
            chunk = self._stashed(src, run, step)
            if chunk is not None:
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
            self._take(message, run)

    def _take(self, message: p.Chunk | p.Abort, run: int) -> None:
        """File an arrival: aborts by run, data by source. Only this run and the next
        `lookahead` can be in flight, so anything else is stale or forged and dropped; what
        waits for a later run is bounded."""
        if isinstance(message, p.Abort):
            if message.run == -1 or self.in_flight(message.run, run):
                self._aborts[message.run] = message
        elif message.run == run or (
            self.in_flight(message.run, run) and self._early_bytes(run) + message.array.nbytes <= MAX_EARLY_BYTES
        ):
            self._stash[message.src].append(message)

    @contextlib.contextmanager
    def runs_in_flight(self, count: int):
        """Within the block, up to `count` runs past the awaited one may be under way (at least
        as many as before): their data is kept for them, not dropped as stale."""
        before, self.lookahead = self.lookahead, max(self.lookahead, count)
        try:
            yield
        finally:
            self.lookahead = before

    def in_flight(self, other: int, run: int) -> bool:
        """Whether run `other` may be under way while this worker waits in `run`."""
        return run <= other <= run + self.lookahead

    def _early_bytes(self, run: int) -> int:
        return sum(c.array.nbytes for chunks in self._stash.values() for c in chunks if c.run > run)

    def _stashed(self, src: int, run: int, step: int) -> p.Chunk | None:
        """The message (src, run, step) if it has arrived; raises if the run was aborted."""
        self._raise_if_aborted(run)
        stash = self._stash[src]
        while stash and stash[0].run < run:
            stash.popleft()  # stale data of an earlier, failed run
        for i, chunk in enumerate(stash):
            if chunk.run == run and chunk.step == step:
                del stash[i]
                return chunk
        return None

    def _raise_if_aborted(self, run: int) -> None:
        abort = self._aborts.get(run) or self._aborts.get(-1)
        if abort is None and self.lookahead > 1:  # interleaved runs: a later one's failure ends them all
            abort = next((a for r, a in self._aborts.items() if self.in_flight(r, run)), None)
        if abort is None:
            return
        text = f"run {run} aborted: worker {abort.rank} reports {abort.kind}: {abort.message}"
        if abort.kind == "WorkerLost":
            exc: Exception = WorkerLost(text, rank=abort.rank)
        else:
            exc = RemoteError(text, rank=abort.rank, kind=abort.kind)
        exc.origin = abort.rank  # a consequence of that worker's failure, not a cause (see Error.origin)
        raise exc

    def engine(self, backend):
        """The collective primitives over this comm (workers.collectives): point to point here;
        a plane with collectives of its own returns an engine that uses them."""
        from workers.collectives import HostEngine

        return HostEngine(self, backend)

    def routes(self) -> dict[int, str]:
        """How this worker has reached each peer so far."""
        return {str(dst): self.plane for dst in range(self.size) if dst != self.rank}

    def resync(self, run: int, deadline: Deadline) -> None:
        """After a failed run (transport.protocol.Resync): bring this plane back to the state
        every rank shares. Nothing to do where a run's traffic is told apart by its run id alone;
        a plane that counts operations across runs (workers/planes/ipc/engine.py) agrees on the count here."""

    def forget_aborts(self) -> None:
        """A new run starts clean: an abort of every run (-1) woke the workers of the run it
        interrupted; after that the coordinator has marked the cluster lost, so a stale or forged
        one must not break later runs."""
        self._aborts = {}


class QueueComm(Inbox):
    """In-process comm: one queue per destination, shared by all simulated devices."""

    plane = "queue"

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

    plane = "zmq"

    def __init__(self, rank: int, inbox: zmq.Socket, peers: list[str], context: zmq.Context, security: Security):
        super().__init__()
        self.rank, self.size, self.inbox, self.security = rank, len(peers), inbox, security
        self.outboxes = {d: push(context, ep, security, server=d) for d, ep in enumerate(peers) if d != rank}
        self._sending: collections.deque = collections.deque()  # (peer, tracker) of arrays ZeroMQ sends in place
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        # ZeroMQ reconnects behind a closed connection and says nothing, so a peer that died was
        # found only by the coordinator's liveness window (which sees at once only the processes
        # it spawned). Each outbox's monitor says when its connection to the peer's inbox closes:
        # no heartbeat drops these connections, so a close is the peer's exit or a broken link,
        # and a wait on this inbox raises WorkerLost naming that peer once LOST_GRACE_SECONDS
        # have passed with nothing else to take (`_arrived`).
        self._watches = {}  # monitor socket -> the peer whose inbox its outbox connects to
        self._gone: dict[int, float] = {}  # peer -> when (monotonic) its inbox's connection closed
        for d, sock in self.outboxes.items():
            watch = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._watches[watch] = d
            self._poller.register(watch, zmq.POLLIN)

    def _send(self, dst: int, message: Any) -> None:
        tracker = send_frames(self.outboxes[dst], p.encode(message), track=True)
        if tracker is not None:  # sent from the array itself: the caller leaves it unchanged until flush
            self._sending.append((dst, tracker))

    def flush(self, run: int, deadline: Deadline) -> None:
        """Wait until ZeroMQ is done with every array it sends in place (a large frame: it is
        read after send returns, and a program writes its buffers again once a collective has
        returned; a 4 MiB buffer written over after send arrived as what was written); WorkerLost
        at the deadline, naming the peer that took nothing."""
        while self._sending:
            dst, tracker = self._sending[0]
            if tracker.done:
                self._sending.popleft()
                continue
            if deadline.expired():
                raise WorkerLost(
                    f"worker {self.rank}: worker {dst} took no data for {deadline.seconds:.1f} s", rank=dst
                )
            try:
                tracker.wait(max(0.0, min(BLOCK_SECONDS, deadline.remaining())))
            except zmq.NotDone:
                self._raise_if_gone()
                self._check_signals(run)

    def _next(self, timeout: float):
        """The next Chunk or Abort within `timeout` seconds, else None. Anything else that reaches
        the data plane (malformed bytes, other message types) is dropped, and the wait goes on."""
        end = time.monotonic() + timeout
        while self._arrived(end):
            try:
                frames = self.inbox.recv_multipart(copy=False)
                message, _ = p.decode(frames)
            except ProtocolError:
                continue
            # with keys, the handshake named the sender: it may only speak for itself (the
            # coordinator may also abort on behalf of a worker it lost)
            if isinstance(message, p.Chunk) and self.security.sender(frames[0]) in (None, message.src):
                return message
            if isinstance(message, p.Abort) and self.security.may_speak_for(frames[0], message.rank):
                return message
        return None

    def _arrived(self, end: float) -> bool:
        """Whether a message is in the inbox by `end` (monotonic seconds). No spinning: on a host
        with fewer cores than threads, a spinning worker takes the core its own ZeroMQ I/O thread
        needs to deliver the message. The poller is made once (Socket.poll makes one each call:
        ~5 us, a tenth of a small all-reduce)."""
        if self.inbox.get(zmq.EVENTS) & zmq.POLLIN:
            return True
        while True:
            self._raise_if_gone()
            graced = min(self._gone.values()) + LOST_GRACE_SECONDS if self._gone else math.inf
            ready = dict(self._poller.poll(max(0, int((min(end, graced) - time.monotonic()) * 1000))))
            if ready.pop(self.inbox, None):
                return True
            for watch in ready:
                self._watch(watch)
            if not ready and time.monotonic() < graced:  # the wait ran out before any grace did
                return False

    def _watch(self, watch: zmq.Socket) -> None:
        """Read a monitor's events: note when its peer's connection closed."""
        while watch.get(zmq.EVENTS) & zmq.POLLIN:
            event = recv_monitor_message(watch, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._gone.setdefault(self._watches[watch], time.monotonic())

    def _raise_if_gone(self) -> None:
        """WorkerLost for a peer whose connection closed LOST_GRACE_SECONDS ago or more: what it
        sent before it left (an Abort naming its error; MPI's revocation) has had that long to be
        taken first."""
        now = time.monotonic()
        for peer, since in self._gone.items():
            if now - since >= LOST_GRACE_SECONDS:
                raise WorkerLost(f"worker {self.rank}: the connection to worker {peer}'s inbox closed", rank=peer)

    def _check_signals(self, run: int) -> None:
        """Take in aborts and data that arrived over ZeroMQ meanwhile, without waiting; raises if
        run `run` was aborted. For waits that are not on the ZeroMQ inbox itself."""
        while (message := self._next(0)) is not None:
            self._take(message, run)
        self._raise_if_aborted(run)

    def close(self) -> None:
        for sock in self.outboxes.values():
            sock.disable_monitor()
            sock.close(0)
        for watch in self._watches:
            watch.close(0)
        self.outboxes, self._watches = {}, {}


class Waiter:
    """How a worker waits for a peer: spin briefly (the bytes usually come within microseconds of
    the peer's turn), then block until woken; `pause` is the GPU planes' wait on a stream, which
    nothing can wake: spin, then nap."""

    def __init__(self, deadline: Deadline, spin: float = SPIN_SECONDS, polite: bool = False):
        self.deadline, self.spin, self.polite = deadline, spin, polite
        self.since = self.checked = time.perf_counter()

    def progressed(self) -> None:
        self.since = time.perf_counter()

    def spinning(self) -> bool:
        """Whether the wait is still short enough to spin on; past that, block."""
        return time.perf_counter() - self.since < self.spin

    def block_seconds(self) -> float:
        """How long to sleep at most: until the deadline, and no longer than BLOCK_SECONDS."""
        return max(0.0, min(BLOCK_SECONDS, self.deadline.remaining()))

    def block_ms(self) -> int:
        """The same for a ZeroMQ poll, whose timeouts are whole milliseconds."""
        return max(1, int(self.block_seconds() * 1000))

    def signals_due(self) -> bool:
        """Whether to look at the ZeroMQ inbox (aborts) now: a poll is a system call, so it is
        done at most every SIGNAL_SECONDS while spinning."""
        now = time.perf_counter()
        if now - self.checked < SIGNAL_SECONDS:
            return False
        self.checked = now
        return True

    def spun(self, check_signals) -> bool | None:
        """One turn of the spin, if it is not over: looks for aborts when due (`check_signals()`)
        and, when polite, yields the core. None once the spin is over (then block); else whether
        the deadline is still ahead."""
        if not self.spinning():
            return None
        if self.signals_due():
            check_signals()
        if self.polite:
            os.sched_yield()
        return not self.deadline.expired()

    def pause(self) -> bool:
        waited = time.perf_counter() - self.since
        if waited > self.spin:
            # a nap costs at most ~5 % of the wait so far: prompt after short waits, and a worker
            # waiting long on a slow peer does not take CPU time from the workers still computing
            time.sleep(min(MAX_NAP_SECONDS, max(NAP_SECONDS, waited / 20)))
        else:
            os.sched_yield()
        return not self.deadline.expired()


class HostComm(ZmqComm):
    """ZeroMQ for signalling and for peers on other hosts; shared-memory rings for peers that
    share this host. This worker's rings live in its inbox file, made when it is configured; a
    sender maps the receiver's file when it first sends to it and uses ZeroMQ if it cannot (another
    host, no shared memory), so the receiver accepts a peer's data from either."""

    def __init__(
        self, rank: int, inbox: zmq.Socket, peers: list[str], context: zmq.Context, security: Security, session: str
    ):
        super().__init__(rank, inbox, peers, context, security)
        self.session = session
        self.own = InboxFile.create(inbox_path(session, rank), self.size, ring_capacity(self.size))
        self.readers = {src: RingReader(self.own.rings[src]) for src in range(self.size) if src != rank}
        self.writers: dict[int, RingWriter | None] = {}  # None: that peer is reached over ZeroMQ
        self._post_turn = 0  # the postbox slot this worker's next small all-reduce writes
        self.peer_files: dict[int, InboxFile] = {}
        self._backlog: set[int] = set()  # peers with bytes queued for their rings
        # a worker bound to its own cores (see meta.launchers.worker_cpus) was bound because
        # this host's workers fit its cores; otherwise count the cores it may run on
        self.cores = self.size if bound() else len(os.sched_getaffinity(0))

    plane = "shm"

    def routes(self) -> dict[int, str]:
        return {str(dst): "zmq" if w is None else "shm" for dst, w in sorted(self.writers.items())}

    def _waiter(self, deadline: Deadline) -> Waiter:
        """How to wait. While this host has a core for every worker of ours on it, spin briefly
        and then sleep. With more of our workers than cores, the peer being waited for is likely
        waiting for our core: yield it while spinning (the scheduler hands it to another of our
        runnable workers at once, cheaper than a sleep and a wake-up), longer, then sleep. A
        foreign process hogging a core is not seen here: the short spin and the futex sleep
        serve that case, where a yield would give the hog a whole time slice."""
        if 1 + len(self.peer_files) > self.cores:
            return Waiter(deadline, POLITE_SPIN_SECONDS, polite=True)
        return Waiter(deadline)

    def _writer(self, dst: int) -> RingWriter | None:
        if dst not in self.writers:
            try:
                peer = InboxFile.attach(inbox_path(self.session, dst), self.size)
            except TransportError:
                self.writers[dst] = None
            else:
                self.peer_files[dst] = peer
                self.writers[dst] = RingWriter(peer.rings[self.rank])
        return self.writers[dst]

    def send(self, dst: int, run: int, step: int, array: np.ndarray) -> None:
        writer = self.writers.get(dst) or self._writer(dst)
        if writer is None:
            super().send(dst, run, step, array)
        else:
            self.bytes_sent += array.nbytes
            writer.post(run, step, array)
            if writer.queue:
                self._backlog.add(dst)
            self._wake(dst)

    def stop_word(self, dst: int):
        return None if self._writer(dst) is None else self.peer_files[dst].stop

    def own_stop_word(self):
        return self.own.stop

    def _wake(self, peer: int, space: bool = False) -> None:
        """After publishing progress in a ring shared with `peer` (data we sent, or with `space`,
        room we freed by reading): ring its bell if it sleeps waiting for that (see
        transport/shm.py on why the fence comes first). A peer waiting for our data is not woken
        by our reading its bytes: a wake-up costs it a trip through the scheduler."""
        inbox = self.peer_files.get(peer)
        if inbox is None:
            if peer in self.writers or self._writer(peer) is None:  # it is reached over ZeroMQ
                return
            inbox = self.peer_files[peer]  # a peer we only read from so far: map its file now
        fence()
        if inbox.waits_for(self.rank, space):
            inbox.ring()

    def _pump(self) -> bool:
        """Move queued bytes into peers' rings; True when nothing is left queued."""
        for dst in list(self._backlog):
            writer = self.writers[dst]
            before = writer.head
            if writer.pump():
                self._backlog.discard(dst)
            if writer.head != before:
                self._wake(dst)
        return not self._backlog

    def _idle(self, waiter: Waiter, run: int, peer: int | None = None, ready=lambda: False) -> bool:
        """One turn of waiting for `peer` (None: for any peer to free ring space): move our
        queued bytes, then spin, looking for aborts when due; once the spin is over, sleep until
        the peer rings (or, for a peer reached over ZeroMQ, until a message comes), at most
        BLOCK_SECONDS, then look for aborts. `ready()` says whether what is awaited has come.
        False once the deadline has passed."""
        self._pump()
        spun = waiter.spun(lambda: self._check_signals(run))
        if spun is not None:
            return spun
        if peer is not None and self._writer(peer) is None:  # it sends over ZeroMQ, which wakes a poll
            self._poller.poll(waiter.block_ms())
        else:
            queued = bool(self._backlog)
            waiting_for = p.SHM_WAITING_ANY if peer is None or queued else peer + 1
            self.own.sleep(waiting_for, lambda: ready() or (queued and self._can_pump()), waiter.block_seconds())
        self._check_signals(run)
        return not waiter.deadline.expired()

    def _can_pump(self) -> bool:
        return any(self.writers[dst].can_progress() for dst in self._backlog)

    def flush(self, run: int, deadline: Deadline) -> None:
        waiter = None
        while not self._pump():
            waiter = waiter or self._waiter(deadline)
            if not self._idle(waiter, run):
                stuck = sorted(self._backlog)
                raise WorkerLost(
                    f"worker {self.rank}: workers {stuck} took no data for {deadline.seconds:.1f} s",
                    rank=stuck[0],
                )

    def receive(
        self, src: int, run: int, step: int, deadline: Deadline, shape: tuple[int, ...], dtype: np.dtype, sink: Sink
    ) -> None:
        reader = self.readers[src]
        waiter: Waiter | None = None  # made only when the bytes are not there yet
        start = time.perf_counter()
        try:
            while True:
                if self._aborts or self._stash.get(src):
                    chunk = self._stashed(src, run, step)
                    if chunk is not None:  # it came over ZeroMQ, or was set aside earlier
                        check_arrival(chunk.array.shape, chunk.array.dtype, shape, dtype, src, step)
                        sink(0, chunk.array.reshape(-1))
                        return
                header = reader.peek()
                if header is not None and header.run == run and header.step == step:
                    check_arrival(header.shape, header.dtype, shape, dtype, src, step)
                    self._stream(reader, header, sink, deadline, run, src, step)
                    return
                if header is not None and not self.in_flight(header.run, run):  # a failed run's leftover
                    self._stream(reader, header, _discard, deadline, run, src, step)
                    continue
                if header is not None:  # a later message than the one awaited: set aside
                    array = np.empty(header.shape, header.dtype)
                    self._stream(reader, header, _copy_into(array.reshape(-1)), deadline, run, src, step)
                    self._take(p.Chunk(src, header.run, header.step, array), run)
                    continue
                waiter = waiter or self._waiter(deadline)
                if not self._idle(waiter, run, src, lambda: reader.available() > 0):
                    self._lost(src, run, step, deadline)
        finally:
            self.waited += time.perf_counter() - start

    def _stream(self, reader: RingReader, header: RecordHeader, sink: Sink, deadline: Deadline, run, src, step) -> None:
        at, waiter = 0, None
        while reader.current is header:
            fragment = reader.fragment()
            if fragment is None:
                waiter = waiter or self._waiter(deadline)
                if not self._idle(waiter, run, src, lambda: reader.available() > 0):
                    self._lost(src, run, step, deadline)
                continue
            sink(at, fragment)
            at += fragment.size
            reader.consume(fragment.nbytes)
            self._wake(src, space=True)  # it may be waiting for the space
            if waiter is not None:
                waiter.progressed()
            if self._backlog:
                self._pump()  # the peer may be waiting on our bytes while we read its

    def posts(self, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
        """Whether an all-reduce of `shape` arrays of `dtype` goes through the postboxes (every
        peer on this host, a contribution no bigger than a slot): `bound_all_reduce` gives one."""
        size = prod(shape) * dtype.itemsize
        others = [d for d in range(self.size) if d != self.rank]
        return bool(others) and size <= POST_BYTES and all(self._writer(d) is not None for d in others)

    def bound_all_reduce(self, dtype: np.dtype, shape: tuple[int, ...], out: np.ndarray | None = None):
        """A direct all-reduce of arrays of one dtype and shape through the workers' postboxes
        (transport.shm.Postbox), or None where it does not apply (`posts`). Each worker posts its
        contribution once, wakes the peers that sleep waiting for it, and adds everyone's where
        they lie, in rank order (the first two in one pass, as HostEngine.reduce adds them): the
        same bits on every worker. The contribution is copied into the slot before the call
        returns, so the caller may write over it at once; the sum goes into `out` (a C-order
        buffer of `shape`, the same array every call: what a program's next step was planned
        for), else into a new array each call. A decode step's 2.3 KiB all-reduce cost ~29 us
        through the rings, ~14 of them formatting, copying and parsing records. Called as a
        program step calls a collective: (local, run, step, deadline)."""
        size, rank, n = prod(shape), self.rank, self.size
        if not self.posts(dtype, shape):
            return None
        if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous):
            raise ProtocolError(f"all-reduce into a {out.shape} {out.dtype} buffer: needs C-order {shape} {dtype}")
        boxes = [self.own.postbox(rank) if d == rank else self.peer_files[d].postbox(d) for d in range(n)]
        slots = [[box.array(k, dtype, size) for k in range(Postbox.SLOTS)] for box in boxes]
        peers = [d for d in range(n) if d != rank]
        mine, own_slots = boxes[rank], slots[rank]
        target = None if out is None else out.reshape(-1)
        if n == 2:  # the common case, written out: ~2 us a call less than the loops below
            (peer,) = peers
            box, theirs, first = boxes[peer], slots[peer], rank == 0

            def run_pair(local: np.ndarray, run: int, step: int, deadline: Deadline) -> np.ndarray:
                stamp = post_stamp(run, step)
                k = self._post_turn  # alternates over all of this worker's posts, whichever step makes them
                self._post_turn = k ^ 1
                flat = local.reshape(-1)
                np.copyto(own_slots[k], flat)
                mine.publish(k, stamp)
                self._wake(peer)
                found = box.find(stamp)
                if found < 0:
                    found = self._await_post(peer, box, stamp, run, step, deadline)
                total = np.add(flat, theirs[found], out=target) if first else np.add(theirs[found], flat, out=target)
                if not box.holds(found, stamp):  # a slot written over while we read it would break the invariant
                    raise _post_changed(rank, peer, run, step)
                return out if out is not None else total.reshape(shape)

            return run_pair

        def run(local: np.ndarray, run: int, step: int, deadline: Deadline) -> np.ndarray:
            stamp = post_stamp(run, step)
            k = self._post_turn
            self._post_turn = k ^ 1
            flat = local.reshape(-1)
            np.copyto(own_slots[k], flat)
            mine.publish(k, stamp)
            for d in peers:
                self._wake(d)
            found = [k if d == rank else self._await_post(d, boxes[d], stamp, run, step, deadline) for d in range(n)]
            parts = [flat if d == rank else slots[d][found[d]] for d in range(n)]
            total = np.add(parts[0], parts[1], out=target)
            for part in parts[2:]:
                total += part
            for d in peers:  # a slot written over while we read it would break the invariant above
                if not boxes[d].holds(found[d], stamp):
                    raise _post_changed(rank, d, run, step)
            return out if out is not None else total.reshape(shape)

        return run

    def _await_post(self, src: int, box: Postbox, stamp: int, run: int, step: int, deadline: Deadline) -> int:
        """The slot of `src`'s postbox holding `stamp`, once it does: spin, then sleep until
        `src` rings (it does after posting), looking for aborts; WorkerLost at the deadline."""
        slot = box.find(stamp)
        if slot >= 0:
            return slot
        start, waiter = time.perf_counter(), self._waiter(deadline)
        try:
            while (slot := box.find(stamp)) < 0:
                if not self._idle(waiter, run, src, lambda: box.find(stamp) >= 0):
                    self._lost(src, run, step, deadline)
            return slot
        finally:
            self.waited += time.perf_counter() - start

    def _lost(self, src: int, run: int, step: int, deadline: Deadline):
        raise WorkerLost(
            f"worker {self.rank}: no data from worker {src} within {deadline.seconds:.1f} s (run {run}, step {step})",
            rank=src,
        )

    def close(self) -> None:
        super().close()
        self.readers, self.writers, self._backlog = {}, {}, set()
        for peer in self.peer_files.values():
            peer.close()
        self.peer_files = {}
        self.own.close()


def _post_changed(rank: int, peer: int, run: int, step: int) -> ProtocolError:
    return ProtocolError(f"worker {rank}: worker {peer}'s post for run {run}, step {step} changed as it was read")


def _discard(at: int, fragment: np.ndarray) -> None:
    pass


def _copy_into(flat: np.ndarray) -> Sink:
    def sink(at: int, fragment: np.ndarray) -> None:
        flat[at : at + fragment.size] = fragment

    return sink
