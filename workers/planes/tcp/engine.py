"""The tcp plane's comm: one TCP connection between every pair of workers, carrying that pair's
data both ways; ZeroMQ (the ZmqComm underneath) carries the aborts and the rendezvous.

Rendezvous, when the coordinator's Configure names the plane: every worker listens on the host
its ZeroMQ inbox is reached at, tells each higher rank where over ZeroMQ, connects to each lower
rank and greets it with its rank and the cluster's session; the lower rank accepts (a stranger's
connection, or one with the wrong greeting, is closed and the wait goes on).

On the wire a message is a header (run, step, payload bytes, dtype name, dims) and the array's
bytes. Messages of a pair arrive in order, so the matching, stashing and aborts are the shared
`Inbox`'s, as over the shared-memory rings (workers/comm.py HostComm, whose receive this
mirrors). Sends never block: what the kernel does not take at once is queued and pumped while
the worker waits for anything, so two workers sending each other large messages cannot deadlock.
A waiting worker spins on its socket for SPIN_SECONDS (a peer's bytes usually come within
microseconds of its turn) and then sleeps in a poll of that socket and the ZeroMQ inbox.

A small all-reduce (<= DIRECT_BYTES a contribution) has its own bound path, as the postboxes
have on shared memory: send the contribution to every peer, read each peer's straight into a
buffer of the step's, and add them in rank order (the first two in one pass, as HostEngine.reduce
adds them), so the bits equal every other plane's. Where the ranks sit on several hosts (told
apart by the addresses their inboxes are reached at), some with several workers, it goes host
by host: every worker sends its contribution to one worker of each other host, posts its own
and those sent to it for its host-mates, and adds all of them in rank order (the same bits;
`_hierarchical_all_reduce`; TCP_DIRECT_ENV turns it off). The posts go through shared memory
(host_step.py) where every worker of the host can map the others' files, else over TCP
(TCP_HOST_STEP_ENV = "tcp" forces that).
"""

from __future__ import annotations

import collections
import functools
import os
import socket
import struct
import time
from dataclasses import dataclass
from math import prod

import numpy as np
import zmq

from split_state.dtypes import dtype_from_name, dtype_name
from split_state.errors import ProtocolError, TransportError, UnsupportedDtype, WorkerLost
from transport import protocol as p
from transport.deadline import Deadline
from transport.environment import TCP_DIRECT_ENV, TCP_HOST_STEP_ENV
from transport.shm import Sink, post_stamp
from transport.sockets import Security, endpoint_host
from workers.binding import bound
from workers.comm import POLITE_SPIN_SECONDS, Waiter, ZmqComm, check_arrival
from workers.planes.tcp.host_step import HostBoxes

RENDEZVOUS_RUN = -2  # the run id of the ZeroMQ message that tells a peer where to connect
HOST_STEP_RUN = -3  # the run id of the messages that agree whether a host's step uses shared memory
RENDEZVOUS_SECONDS = 60.0  # every worker gets its Configure at once; a peer slower than this is lost
GREETING = struct.Struct("<4sI16s")  # magic, the connecting worker's rank, the session
MAGIC = b"MTPd"
HEADER = struct.Struct("<qqQ16sB")  # run, step, payload bytes, dtype name, number of dims
RUN_STEP = struct.Struct("<qq")
DIM = struct.Struct("<q")
MAX_DIMS = 8
MAX_PAYLOAD = p.DEFAULT_LIMITS.array_bytes  # a header claiming more is refused, as a ZeroMQ chunk claiming it is
DIRECT_BYTES = 64 << 10  # contributions up to this take the bound all-reduce
STREAM_BYTES = 1 << 20  # a larger message reaches its sink in pieces of this size
READ_AHEAD_BYTES = 256 << 10  # a link's read buffer; a read of at least half this goes straight to its target


class Link:
    """One peer's connection: the socket, and the bytes queued for it."""

    def __init__(self, peer: int, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.peer, self.sock, self.fd = peer, sock, sock.fileno()
        self.queue: collections.deque[memoryview] = collections.deque()
        self.header = bytearray(HEADER.size + MAX_DIMS * DIM.size)
        # bytes read ahead of what was asked for: one recv takes a small message's header and
        # payload together (three system calls a message otherwise)
        self.buffer = bytearray(READ_AHEAD_BYTES)
        self.view = memoryview(self.buffer)
        self.start = self.end = 0
        self.broken = ""  # why this link can carry nothing more
        # the message being read: bytes of it read so far, its header once whole (its size, and
        # the payload bytes still to read)
        self.got, self.arrival, self.header_size = 0, None, 0

    def finished(self) -> None:
        self.got, self.arrival = 0, None

    def left(self) -> int:
        """The payload bytes of the current message still to read."""
        return self.header_size + self.arrival.nbytes - self.got

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Arrival:
    """A parsed message header: what the next bytes from a peer are."""

    __slots__ = ("run", "step", "nbytes", "dtype", "shape")

    def __init__(self, run: int, step: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]):
        self.run, self.step, self.nbytes, self.dtype, self.shape = run, step, nbytes, dtype, shape


@functools.lru_cache(maxsize=1024)
def header_template(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The header of an array of `dtype` and `shape`, run and step zero: a program sends the same
    few shapes every run, so each is packed once and run and step are written per message."""
    nbytes = prod(shape) * dtype.itemsize
    return HEADER.pack(0, 0, nbytes, dtype_name(dtype).encode(), len(shape)) + b"".join(DIM.pack(d) for d in shape)


def header_bytes(run: int, step: int, array: np.ndarray) -> bytearray:
    header = bytearray(header_template(array.dtype, array.shape))
    RUN_STEP.pack_into(header, 0, run, step)
    return header


def parse_header(head: bytes | bytearray, dims: bytes | bytearray) -> Arrival:
    run, step, nbytes, name, ndim = HEADER.unpack(head)
    dtype, shape = _described(name, bytes(dims[: ndim * DIM.size]), nbytes)
    return Arrival(run, step, nbytes, dtype, shape)


@functools.lru_cache(maxsize=1024)
def _described(name: bytes, dims: bytes, nbytes: int) -> tuple[np.dtype, tuple[int, ...]]:
    """A header's dtype and shape, checked once per distinct header."""
    shape = tuple(DIM.unpack_from(dims, at)[0] for at in range(0, len(dims), DIM.size))
    try:
        dtype = dtype_from_name(name.rstrip(b"\0").decode("ascii"))
    except (UnsupportedDtype, UnicodeDecodeError):
        raise ProtocolError(f"a message of dtype {name.rstrip(bytes(1))!r}") from None
    if any(d < 0 for d in shape) or prod(shape) * dtype.itemsize != nbytes:
        raise ProtocolError(f"a message of {nbytes} bytes claims shape {shape} of {dtype}")
    return dtype, shape


class TcpComm(ZmqComm):
    plane = "tcp"

    def __init__(
        self, rank: int, inbox: zmq.Socket, peers: list[str], context: zmq.Context, security: Security, session: str
    ):
        super().__init__(rank, inbox, peers, context, security)
        self.links: dict[int, Link] = {}
        self._backlog: set[int] = set()
        self._scratch = np.empty(0, np.uint8)  # what _stream reads a message's payload into
        self.hosts = host_groups(peers)  # each rank's host, by the address its inbox is reached at
        self.host_by_host = hierarchical(self.hosts) and os.environ.get(TCP_DIRECT_ENV, "") != "1"
        self.host_ranks = ranks_by_host(self.hosts)
        mine = next(g for g in self.host_ranks if rank in g)
        self.host_boxes: HostBoxes | None = None  # the step inside this host through shared memory
        shares = self.host_by_host and len(mine) > 1
        # more workers than cores (this host's): yield while spinning, as HostComm does
        cores = self.size if bound() else len(os.sched_getaffinity(0))
        self._polite = self.size > cores
        # a sleep waits for the one peer awaited (and aborts): polled over every link, bytes of
        # another peer not read yet woke it again at once, a spin that took the core of the
        # worker awaited when workers outnumber cores (4 on 2: 36 tok/s against 81 on shm)
        self._sleepers: dict[int, zmq.Poller] = {}
        try:
            if shares:  # made before the rendezvous: a peer connected to is a peer whose file exists
                self.host_boxes = _host_boxes(session, rank, mine, post_rows(self.host_ranks, mine))
            self.links = rendezvous(self, peers, session.encode()[:16].ljust(16, b"\0"), Deadline(RENDEZVOUS_SECONDS))
            for peer, link in self.links.items():
                self._sleepers[peer] = zmq.Poller()
                self._sleepers[peer].register(inbox, zmq.POLLIN)
                self._sleepers[peer].register(link.fd, zmq.POLLIN)
            if shares and not self._agree_on_host_step(mine, Deadline(RENDEZVOUS_SECONDS)):
                self._drop_host_boxes()
        except BaseException:
            self.close()
            raise

    def _agree_on_host_step(self, mine: tuple[int, ...], deadline: Deadline) -> bool:
        """Whether this host's step goes through shared memory: each worker of the host tells
        the host's first (its leader) whether it made its file and mapped its mates', and the
        leader tells them all the answer, over TCP."""
        ok = np.array([self.host_boxes is not None and self.host_boxes.attach()], np.uint8)
        leader, answer = mine[0], np.empty(1, np.uint8)
        if self.rank == leader:
            for q in mine[1:]:
                self._receive_into(q, answer, HOST_STEP_RUN, 0, deadline)
                ok &= answer
            for q in mine[1:]:
                self.send(q, HOST_STEP_RUN, 1, ok)
        else:
            self.send(leader, HOST_STEP_RUN, 0, ok)
            self._receive_into(leader, answer, HOST_STEP_RUN, 1, deadline)
            ok = answer
        self.flush(HOST_STEP_RUN, deadline)
        self.bytes_sent = 0  # what the collectives send is counted from here
        return bool(ok[0])

    # -- sending --------------------------------------------------------------------------------

    def send(self, dst: int, run: int, step: int, array: np.ndarray) -> None:
        """Queue `array` for `dst` behind a header; the caller leaves it unchanged until flush
        (HostEngine flushes before a collective returns)."""
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array).reshape(array.shape)
        self.bytes_sent += array.nbytes
        link = self.links[dst]
        payload = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
        parts = [memoryview(header_bytes(run, step, array)), payload]
        if not link.queue:
            sent = self._write(link, parts)
            parts = _after(parts, sent)
        link.queue.extend(part for part in parts if len(part))
        if link.queue:
            self._backlog.add(dst)

    def _write(self, link: Link, parts: list[memoryview]) -> int:
        """As many of `parts`' bytes as the kernel takes now."""
        if link.broken:
            raise WorkerLost(f"worker {self.rank}: the connection to worker {link.peer} {link.broken}", rank=link.peer)
        try:
            return link.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            link.broken = f"failed: {exc.strerror or exc}"
            raise WorkerLost(
                f"worker {self.rank}: sending to worker {link.peer} failed: {exc}", rank=link.peer
            ) from None

    def _pump(self) -> bool:
        """Move queued bytes to the kernel; True when nothing is left queued."""
        for dst in list(self._backlog):
            link = self.links[dst]
            while link.queue:
                sent = self._write(link, list(link.queue)[:64])
                if not sent:
                    break
                while sent:
                    head = link.queue[0]
                    if sent >= len(head):
                        sent -= len(head)
                        link.queue.popleft()
                    else:
                        link.queue[0] = head[sent:]
                        sent = 0
            if not link.queue:
                self._backlog.discard(dst)
        return not self._backlog

    def flush(self, run: int, deadline: Deadline) -> None:
        waiter = None
        while not self._pump():
            waiter = waiter or self._waiter(deadline)
            if not self._idle(waiter, run, None):
                stuck = sorted(self._backlog)
                raise WorkerLost(
                    f"worker {self.rank}: workers {stuck} took no data for {deadline.seconds:.1f} s", rank=stuck[0]
                )

    # -- receiving ------------------------------------------------------------------------------

    def receive(
        self, src: int, run: int, step: int, deadline: Deadline, shape: tuple[int, ...], dtype: np.dtype, sink: Sink
    ) -> None:
        start = time.perf_counter()
        try:
            while True:
                if self._aborts or self._stash.get(src):
                    chunk = self._stashed(src, run, step)
                    if chunk is not None:  # set aside earlier
                        check_arrival(chunk.array.shape, chunk.array.dtype, shape, dtype, src, step)
                        sink(0, chunk.array.reshape(-1))
                        return
                arrival = self._arrival(src, run, step, deadline)
                if arrival.run == run and arrival.step == step:
                    check_arrival(arrival.shape, arrival.dtype, shape, dtype, src, step)
                    self._stream(src, arrival, sink, run, step, deadline)
                    return
                self._set_aside(src, arrival, run, step, deadline)  # another message: kept, or stale
        finally:
            self.waited += time.perf_counter() - start

    def _arrival(self, src: int, run: int, step: int, deadline: Deadline) -> Arrival:
        """The header of the next message from `src` whose payload is still to read. Reading is
        resumable: a wait broken off (an abort, a deadline) leaves the link's count of the
        message's bytes read, and a message whose payload was broken off midway belonged to a
        failed run, so the rest of it is skipped here."""
        link = self.links[src]
        while link.arrival is not None and link.got > link.header_size:
            self._payload(src, memoryview(bytearray(min(STREAM_BYTES, link.left()))), run, step, deadline)
        if link.arrival is None:
            view = memoryview(link.header)
            if link.got < HEADER.size:
                self._read(link, view[link.got : HEADER.size], run, step, deadline)
            ndim = link.header[HEADER.size - 1]
            if ndim > MAX_DIMS:
                self._garbled(link, f"a message of {ndim} dims")
            size = HEADER.size + ndim * DIM.size
            if link.got < size:
                self._read(link, view[link.got : size], run, step, deadline)
            try:
                arrival = parse_header(view[: HEADER.size], view[HEADER.size : size])
            except ProtocolError as exc:
                self._garbled(link, str(exc))
            if arrival.nbytes > MAX_PAYLOAD:
                self._garbled(link, f"a message of {arrival.nbytes} bytes")
            link.arrival, link.header_size = arrival, size
        return link.arrival

    def _garbled(self, link: Link, what: str):
        link.broken = f"sent {what}"
        raise ProtocolError(f"worker {self.rank}: worker {link.peer} sent {what} over the tcp plane")

    def _stream(self, src: int, arrival: Arrival, sink: Sink, run: int, step: int, deadline: Deadline) -> None:
        """The payload into `sink` in pieces of whole elements, each read completely first, into
        this comm's scratch (a fragment is valid only during the sink's call: a fresh buffer a
        message cost its pages' first touch, a fifth of a 1 MiB all-reduce)."""
        if not arrival.nbytes:  # nothing to read, but the message is done with
            self._payload(src, memoryview(b""), run, step, deadline)
            sink(0, np.empty(0, arrival.dtype))
            return
        piece = min(arrival.nbytes, STREAM_BYTES - STREAM_BYTES % arrival.dtype.itemsize)
        if self._scratch.nbytes < piece:
            self._scratch = np.empty(piece, np.uint8)
        scratch = self._scratch[:piece].view(arrival.dtype)
        at, left = 0, arrival.nbytes
        while left:
            fragment = scratch[: min(piece, left) // arrival.dtype.itemsize]
            self._payload(src, _bytes_of(fragment), run, step, deadline)
            sink(at, fragment)
            at += fragment.size
            left -= fragment.nbytes

    def _payload(self, src: int, view: memoryview, run: int, step: int, deadline: Deadline) -> None:
        """The next len(view) bytes of the current message's payload into `view`; the message is
        done with when its last byte is read."""
        link = self.links[src]
        self._read(link, view, run, step, deadline)
        if not link.left():
            link.finished()

    def _read(self, link: Link, view: memoryview, run: int, step: int, deadline: Deadline) -> None:
        """Fill `view` with the next bytes from the link (counted in `link.got` as they come):
        spin, then sleep; WorkerLost at the deadline, or at once when the peer's connection
        closes."""
        src, got, total, waiter = link.peer, 0, len(view), None
        if link.broken:
            raise WorkerLost(f"worker {self.rank}: the connection to worker {src} {link.broken}", rank=src)
        while got < total:
            if link.end > link.start:  # read ahead earlier
                n = min(total - got, link.end - link.start)
                view[got : got + n] = link.view[link.start : link.start + n]
                link.start += n
                got += n
                link.got += n
                continue
            direct = total - got >= READ_AHEAD_BYTES // 2
            n = self._recv(link, view[got:] if direct else link.view, run, step)
            if n > 0:
                if direct:
                    got += n
                    link.got += n
                else:
                    link.start, link.end = 0, n
                if waiter is not None:
                    waiter.progressed()
                continue
            waiter = waiter or self._waiter(deadline)
            if not self._idle(waiter, run, link):
                self._lost(src, run, step, deadline)

    def _recv(self, link: Link, into: memoryview, run: int, step: int, flags: int = 0) -> int:
        """The bytes from `link` now, into `into`: how many (-1: none yet); WorkerLost when the
        connection failed or the peer closed it (it exited). `flags`: recv's (MSG_PEEK)."""
        try:
            n = link.sock.recv_into(into, 0, flags)
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError as exc:
            link.broken = f"failed: {exc.strerror or exc}"
            raise WorkerLost(
                f"worker {self.rank}: receiving from worker {link.peer} failed: {exc}", rank=link.peer
            ) from None
        if n == 0:
            link.broken = "was closed by that worker"
            raise WorkerLost(
                f"worker {self.rank}: worker {link.peer} closed its connection (run {run}, step {step})", rank=link.peer
            )
        return n

    def _lost(self, src: int, run: int, step: int, deadline: Deadline):
        raise WorkerLost(
            f"worker {self.rank}: no data from worker {src} within {deadline.seconds:.1f} s (run {run}, step {step})",
            rank=src,
        )

    # -- waiting --------------------------------------------------------------------------------

    def _waiter(self, deadline: Deadline) -> Waiter:
        return Waiter(deadline, POLITE_SPIN_SECONDS, polite=True) if self._polite else Waiter(deadline)

    def _idle(self, waiter: Waiter, run: int, link: Link | None) -> bool:
        """One turn of waiting for `link`'s bytes (None: for room to send): pump our queued bytes,
        spin, looking for aborts when due; once the spin is over, sleep until the socket or the
        ZeroMQ inbox has something, at most BLOCK_SECONDS. False once the deadline has passed."""
        self._pump()
        spun = waiter.spun(lambda: self._check_signals(run))
        if spun is not None:
            return spun
        if self._backlog:  # also wake when a peer makes room for our bytes
            poller = zmq.Poller()
            poller.register(self.inbox, zmq.POLLIN)
            for dst in self._backlog:
                poller.register(self.links[dst].fd, zmq.POLLOUT)
            if link is not None:
                poller.register(link.fd, zmq.POLLIN | (zmq.POLLOUT if link.peer in self._backlog else 0))
            poller.poll(waiter.block_ms())
        elif link is not None:
            self._sleepers[link.peer].poll(waiter.block_ms())
        self._check_signals(run)
        return not waiter.deadline.expired()

    # -- the small all-reduce -------------------------------------------------------------------

    def posts(self, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
        """Whether an all-reduce of `shape` arrays of `dtype` takes `bound_all_reduce`."""
        return self.size > 1 and prod(shape) * dtype.itemsize <= DIRECT_BYTES

    def bound_all_reduce(self, dtype: np.dtype, shape: tuple[int, ...], out: np.ndarray | None = None):
        """A direct all-reduce of arrays of one dtype and shape (workers/comm.py HostComm's
        contract): sent to every peer, each peer's read straight into a buffer of this call's,
        summed in rank order into `out` (else a new array). The input is sent before the call
        returns, so the caller may write over it at once."""
        if not self.posts(dtype, shape):
            return None
        if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous):
            raise ProtocolError(f"all-reduce into a {out.shape} {out.dtype} buffer: needs C-order {shape} {dtype}")
        if self.host_by_host:
            return self._hierarchical_all_reduce(dtype, tuple(shape), out)
        rank, n, size = self.rank, self.size, prod(shape)
        peers = [self.links[d] for d in range(n) if d != rank]
        theirs = {link.peer: np.empty(shape, dtype) for link in peers}
        target = None if out is None else out.reshape(-1)
        header = bytearray(header_template(dtype, tuple(shape)))  # run and step written per call
        expected = memoryview(header)
        need = len(header) + size * dtype.itemsize  # a whole message: header and payload
        buffered = need <= READ_AHEAD_BYTES

        def run_direct(local: np.ndarray, run: int, step: int, deadline: Deadline) -> np.ndarray:
            flat = np.ascontiguousarray(local).reshape(-1)
            RUN_STEP.pack_into(header, 0, run, step)
            head = bytes(header)  # what a send left queued (a run broken off) is its own, not the next call's
            self.bytes_sent += flat.nbytes * len(peers)
            for link in peers:
                self._send_parts(link, [head, flat])
            parts, taken = [], []
            for link in peers:
                part = None
                while buffered and (part := self._buffered(link, expected, need, run, step, deadline)) is False:
                    arrival = self._arrival(link.peer, run, step, deadline)  # another message came first
                    self._set_aside(link.peer, arrival, run, step, deadline)
                if not part:
                    self._receive_into(link.peer, theirs[link.peer], run, step, deadline)
                    part = theirs[link.peer].reshape(-1)
                else:
                    part, offset = np.frombuffer(link.buffer, dtype, size, link.start + len(header)), need
                    taken.append((link, offset))
                parts.append(part)
            if self._backlog:  # the header and `local` are reused: everything leaves before we return
                self.flush(run, deadline)
            parts.insert(rank, flat)
            total = np.add(parts[0], parts[1], out=target)
            for part in parts[2:]:
                total += part
            for link, offset in taken:
                link.start += offset
            return out if out is not None else total.reshape(shape)

        return run_direct

    def _send_parts(self, link: Link, parts: list) -> None:
        """Send a header and payload (whole messages, on the bound path); what the kernel does
        not take now is queued."""
        if not link.queue:
            sent = self._write(link, parts)
            if sent == sum(memoryview(part).nbytes for part in parts):
                return
            views = _after([memoryview(part).cast("B") for part in parts], sent)
        else:
            views = [memoryview(part).cast("B") for part in parts]
        link.queue.extend(view for view in views if len(view))
        self._backlog.add(link.peer)

    def _buffered(
        self, link: Link, expected: memoryview, need: int, run: int, step: int, deadline: Deadline
    ) -> bool | None:
        """True once the next message from `link` is the one `expected` heads, whole in the
        link's read buffer (read until it is: its payload starts len(expected) bytes after
        link.start); False where another message comes first; None where the general path must
        take it (a message half read, or the awaited one set aside earlier)."""
        if self._aborts:
            self._raise_if_aborted(run)
        stash = self._stash.get(link.peer)
        if link.arrival is not None or link.got or link.broken or (stash and _holds(stash, run, step)):
            return None
        waiter, start = None, time.perf_counter()
        try:
            while link.end - link.start < need:
                if (
                    link.end - link.start >= HEADER.size
                    and link.view[link.start : link.start + HEADER.size] != expected[: HEADER.size]
                ):
                    return False
                if READ_AHEAD_BYTES - link.start < need:  # room for the whole message at the front
                    held = link.end - link.start
                    link.view[:held] = link.view[link.start : link.end]
                    link.start, link.end = 0, held
                got = self._recv(link, link.view[link.end :], run, step)
                if got > 0:
                    link.end += got
                    if waiter is not None:
                        waiter.progressed()
                    continue
                waiter = waiter or self._waiter(deadline)
                if not self._idle(waiter, run, link):
                    self._lost(link.peer, run, step, deadline)
        finally:
            self.waited += time.perf_counter() - start
        return link.view[link.start : link.start + len(expected)] == expected

    def _set_aside(self, src: int, arrival: Arrival, run: int, step: int, deadline: Deadline) -> None:
        """Read the payload of the message `arrival` heads and keep it for its own step (or drop
        it, stale)."""
        array = np.empty(arrival.shape, arrival.dtype)
        self._payload(src, _bytes_of(array), run, step, deadline)
        self._take(p.Chunk(src, arrival.run, arrival.step, array), run)

    def _hierarchical_all_reduce(self, dtype: np.dtype, shape: tuple[int, ...], out: np.ndarray | None):
        """The direct all-reduce across hosts with each contribution crossing to each other host
        once: every worker sends its contribution to one worker of each other host, posts its
        own and those it received (`HostRoutes`) in one post its host-mates read (through shared
        memory, `host_boxes`, or over TCP), and adds all n in rank order (the first two in one
        pass: the bits of every other plane's direct all-reduce). One costs a one-way trip
        between hosts and one host step, each worker's beside its mates': a leader that
        gathered its host's contributions, exchanged them and handed the sum back cost two host
        steps and its own work in turn. Across H hosts of m workers n (H - 1) messages of one
        contribution cross between hosts, where a direct exchange sends n (n - m): 2 hosts x 2
        workers, 4 against 8."""
        rank, n, size = self.rank, self.size, prod(shape)
        routes, boxes = host_routes(self.host_ranks, rank), self.host_boxes
        held = {q: routes.posts[q] for q in routes.mates}  # whose contributions each mate's post holds
        target = None if out is None else out.reshape(-1)
        if boxes is not None:
            own_slots = boxes.slots(rank, dtype, len(routes.posts[rank]) * size)
            posted = {q: [a.reshape(-1, size) for a in boxes.slots(q, dtype, len(held[q]) * size)] for q in held}

        def host_by_host(local: np.ndarray, run: int, step: int, deadline: Deadline) -> np.ndarray:
            flat = np.ascontiguousarray(local).reshape(-1)
            for q in routes.sends_to:
                self.send(q, run, step, flat)
            post = np.empty((len(routes.posts[rank]), size), dtype)  # this call's: sends may queue it
            post[0] = flat
            for row, q in enumerate(routes.relays, 1):
                self._receive_into(q, post[row], run, step, deadline)
            parts = dict(zip(routes.posts[rank], post))
            if boxes is not None:
                stamp = post_stamp(run, step)
                boxes.post(post.reshape(-1), stamp, own_slots)
                read = []
                for q in held:
                    slot = self._await_host_post(q, stamp, run, step, deadline)
                    parts.update(zip(held[q], posted[q][slot]))  # read where it lies: see the check below
                    read.append((q, slot))
            else:
                for q in held:
                    self.send(q, run, step, post)
                for q in held:
                    theirs = np.empty((len(held[q]), size), dtype)
                    self._receive_into(q, theirs, run, step, deadline)
                    parts.update(zip(held[q], theirs))
            total = np.add(parts[0], parts[1], out=target)
            for q in range(2, n):
                total += parts[q]
            if boxes is not None:  # no mate posts again before this worker's next post (host_step.py)
                for q, slot in read:
                    boxes.check(q, slot, stamp)
            if self._backlog:  # `local` and `post` are the caller's and this call's: everything leaves first
                self.flush(run, deadline)
            return out if out is not None else total.reshape(shape)

        return host_by_host

    def _await_host_post(self, q: int, stamp: int, run: int, step: int, deadline: Deadline) -> int:
        """The slot of host-mate q's postbox holding `stamp`, once it does: spin, then sleep until
        q rings (it does after posting), looking for aborts; WorkerLost at the deadline."""
        boxes = self.host_boxes
        slot = boxes.find(q, stamp)
        if slot >= 0:
            return slot
        start, waiter = time.perf_counter(), self._waiter(deadline)
        try:
            while (slot := boxes.find(q, stamp)) < 0:
                self._pump()
                spun = waiter.spun(lambda: self._check_signals(run))
                if spun is None:
                    boxes.sleep(q, stamp, waiter.block_seconds())
                    self._check_signals(run)
                    self._check_open(q, run, step)
                    spun = not waiter.deadline.expired()
                if not spun:
                    self._lost(q, run, step, deadline)
            return slot
        finally:
            self.waited += time.perf_counter() - start

    def _check_open(self, q: int, run: int, step: int) -> None:
        """WorkerLost when host-mate q has closed its connection (it exited): a worker waiting
        on q's post in shared memory reads nothing from q's socket, where a closed connection
        would tell it at once. One peek, done between sleeps."""
        link = self.links[q]
        if link.broken:
            raise WorkerLost(f"worker {self.rank}: the connection to worker {q} {link.broken}", rank=q)
        self._recv(link, memoryview(bytearray(1)), run, step, socket.MSG_PEEK)

    def _receive_into(self, src: int, buffer: np.ndarray, run: int, step: int, deadline: Deadline) -> None:
        """The message (src, run, step) straight into `buffer` when it is the next to come."""
        start = time.perf_counter()
        try:
            if not (self._aborts or self._stash.get(src)):
                arrival = self._arrival(src, run, step, deadline)
                if arrival.run == run and arrival.step == step:
                    check_arrival(arrival.shape, arrival.dtype, buffer.shape, buffer.dtype, src, step)
                    self._payload(src, _bytes_of(buffer), run, step, deadline)
                    return
        finally:
            self.waited += time.perf_counter() - start
        self.receive(src, run, step, deadline, buffer.shape, buffer.dtype, _into(buffer))

    def routes(self) -> dict[int, str]:
        """Each peer's way: "tcp+shm" for a host-mate whose small all-reduces go through shared memory."""
        mates = () if self.host_boxes is None else self.host_boxes.members
        return {str(dst): "tcp+shm" if dst in mates else "tcp" for dst in sorted(self.links)}

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links, self._backlog = {}, set()
        self._drop_host_boxes()
        super().close()

    def _drop_host_boxes(self) -> None:
        if self.host_boxes is not None:
            self.host_boxes.close()
            self.host_boxes = None


def _host_boxes(session: str, rank: int, mine: tuple[int, ...], rows: int) -> HostBoxes | None:
    """This worker's postbox for its host's step, or None where the step stays on TCP (asked
    for by TCP_HOST_STEP_ENV, or no file can be made here)."""
    if os.environ.get(TCP_HOST_STEP_ENV, "") == "tcp":
        return None
    try:
        return HostBoxes(session, rank, mine, rows)
    except TransportError:
        return None


def host_groups(peers: list[str]) -> tuple[int, ...]:
    """Each rank's host as an index, in order of first appearance: ranks whose inboxes are
    reached at one address share a host (an ipc inbox is on the coordinator's, as loopback)."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(_host_of(endpoint), len(seen)) for endpoint in peers)


def ranks_by_host(hosts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each host's ranks in order (`hosts`: each rank's host, as host_groups gives them)."""
    return tuple(tuple(q for q in range(len(hosts)) if hosts[q] == h) for h in sorted(set(hosts)))


def hierarchical(hosts: tuple[int, ...]) -> bool:
    """Whether a small all-reduce goes host by host: several hosts, one with several workers."""
    return len(set(hosts)) > 1 and len(set(hosts)) < len(hosts)


@dataclass(frozen=True)
class HostRoutes:
    """One rank's ways in host by host's small all-reduce. `sends_to`: one rank on each other
    host, which takes this rank's contribution; `relays`: the ranks of other hosts whose
    contributions come to this rank, in rank order; `mates`: its host's other ranks; `posts`:
    for each rank of its host, whose contributions that rank's post holds (itself, then its
    relays). The rank at index i of its host sends to index i mod m of a host of m, so each
    contribution reaches each other host once and each host's ranks share the relaying as
    evenly as the sizes allow."""

    sends_to: tuple[int, ...]
    relays: tuple[int, ...]
    mates: tuple[int, ...]
    posts: dict[int, tuple[int, ...]]


def host_routes(groups: tuple[tuple[int, ...], ...], rank: int) -> HostRoutes:
    """`rank`'s HostRoutes among `groups` (each host's ranks in order)."""
    mine = next(g for g in groups if rank in g)

    def relays_of(q: int) -> tuple[int, ...]:
        at = mine.index(q)
        return tuple(sorted(r for g in groups if g != mine for i, r in enumerate(g) if i % len(mine) == at))

    index = mine.index(rank)
    return HostRoutes(
        sends_to=tuple(g[index % len(g)] for g in groups if g != mine),
        relays=relays_of(rank),
        mates=tuple(q for q in mine if q != rank),
        posts={q: (q, *relays_of(q)) for q in mine},
    )


def post_rows(groups: tuple[tuple[int, ...], ...], host: tuple[int, ...]) -> int:
    """The most contributions a post of `host` holds (a worker's own and its relays)."""
    return max(len(host_routes(groups, host[0]).posts[q]) for q in host)


def rendezvous(comm: TcpComm, peers: list[str], session: bytes, deadline: Deadline) -> dict[int, Link]:
    """Connections to every peer (see the module's doc): listen, tell the higher ranks where over
    ZeroMQ, connect to the lower ranks, accept the higher ones."""
    rank, size = comm.rank, comm.size
    links: dict[int, Link] = {}
    listener = _listen(_host_of(peers[rank]), size)
    try:
        host, port = _host_of(peers[rank]), listener.getsockname()[1]
        where = np.frombuffer(f"{host}|{port}".encode(), np.uint8)
        for dst in range(rank + 1, size):
            comm._send(dst, p.Chunk(rank, RENDEZVOUS_RUN, 0, where))
        for src, address in _addresses(comm, range(rank), deadline).items():
            links[src] = _dial(address, GREETING.pack(MAGIC, rank, session), src, deadline)
        while len(links) < size - 1:
            sock = _accept(listener, deadline, rank, size - 1 - len(links))
            greeted = _greeting(sock, session, rank, size, links)
            if greeted < 0:
                sock.close()
            else:
                links[greeted] = Link(greeted, sock)
        return links
    except BaseException:
        for link in links.values():
            link.close()
        raise
    finally:
        listener.close()


def _host_of(endpoint: str) -> str:
    """The host a worker's ZeroMQ inbox is reached at (loopback for an ipc inbox)."""
    return endpoint_host(endpoint) or "127.0.0.1"


def _listen(host: str, backlog: int) -> socket.socket:
    """A listener on `host`, or on every interface where `host` is a name this host does not
    hold (an advertised address behind a NAT)."""
    for where in (host, "0.0.0.0"):
        try:
            family = socket.AF_INET6 if ":" in where else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.bind((where, 0))
            listener.listen(backlog)
            return listener
        except OSError as exc:
            listener.close()
            failure = exc
    raise TransportError(f"the tcp plane cannot listen on {host}: {failure}")


def _addresses(comm: TcpComm, sources: range, deadline: Deadline) -> dict[int, tuple[str, int]]:
    """Where each worker of `sources` listens, from its ZeroMQ message."""
    found: dict[int, tuple[str, int]] = {}
    while len(found) < len(sources):
        message = comm._next(deadline.remaining())
        if message is None:
            missing = [s for s in sources if s not in found]
            raise TransportError(f"worker {comm.rank}: workers {missing} did not say where their tcp plane listens")
        if isinstance(message, p.Chunk) and message.run == RENDEZVOUS_RUN and message.src in sources:
            host, _, port = bytes(message.array).decode("ascii", "replace").rpartition("|")
            if port.isdigit():
                found[message.src] = (host, int(port))
    return found


def _dial(address: tuple[str, int], greeting: bytes, peer: int, deadline: Deadline) -> Link:
    try:
        sock = socket.create_connection(address, timeout=max(0.1, deadline.remaining()))
        sock.sendall(greeting)
    except OSError as exc:
        raise TransportError(f"the tcp plane cannot reach worker {peer} at {address[0]}:{address[1]}: {exc}") from None
    return Link(peer, sock)


def _accept(listener: socket.socket, deadline: Deadline, rank: int, missing: int) -> socket.socket:
    listener.settimeout(max(0.01, deadline.remaining()))
    try:
        sock, _ = listener.accept()
    except TimeoutError:
        raise TransportError(f"worker {rank}: {missing} higher ranks did not connect to its tcp plane") from None
    return sock


def _greeting(sock: socket.socket, session: bytes, rank: int, size: int, links: dict[int, Link]) -> int:
    """The rank a new connection greets as, or -1 for a connection to drop (a stranger, a wrong
    session, a rank that is not a higher peer or already connected)."""
    sock.settimeout(2.0)
    data = b""
    try:
        while len(data) < GREETING.size:
            more = sock.recv(GREETING.size - len(data))
            if not more:
                return -1
            data += more
    except OSError:
        return -1
    magic, peer, theirs = GREETING.unpack(data)
    if magic != MAGIC or theirs != session or not rank < peer < size or peer in links:
        return -1
    return peer


def _holds(stash, run: int, step: int) -> bool:
    return any(chunk.run == run and chunk.step == step for chunk in stash)


def _after(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of `parts` once `sent` bytes of them have gone."""
    left = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
        else:
            left.append(part[sent:])
            sent = 0
    return left


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(bytearray(0))


def _into(buffer: np.ndarray) -> Sink:
    flat = buffer.reshape(-1)

    def sink(at: int, fragment: np.ndarray) -> None:
        flat[at : at + fragment.size] = fragment

    return sink
