"""Shared-memory rings: the data plane between workers on one host.

Each worker owns one inbox file in shared memory (/dev/shm where there is one) holding a
single-producer single-consumer byte ring per peer. A sender copies a record (a header and the
array's bytes) into the ring the receiver keeps for it; the receiver reads the bytes where they
lie, so a reduction adds straight from shared memory. ZeroMQ stays for signalling (aborts) and
for peers on other hosts.

Ordering: the producer writes data and then publishes `head`; the consumer reads `head`, then
the data, and publishes `tail` when done with it. Each index has one writer and is an aligned
8-byte store, so this is correct on a total-store-order CPU (x86-64) without explicit fences;
`supported()` refuses other machines, which then use ZeroMQ.

Sleeping: a process waiting on a ring spins only briefly, then writes whom it waits for into
its file's "asleep" word and sleeps on its bell, a futex word in the same file (one system call
each way, no helper threads: the fastest wake-up Linux has, which matters most when the cores
are oversubscribed and every extra thread hop waits for a time slice). A peer that publishes
progress (head or tail) reads the asleep word and, if it names the peer, bumps the bell and wakes
it. Each side stores, then `fence()`s, then loads (the sleeper re-checks the ring after announcing
itself), so at least one sees the other's store; and the futex sleeps only while the bell still
holds the value read before announcing, so no wake-up is lost.

The file header and record layouts are wire conventions and live in transport.protocol.
Ring layout, all offsets multiples of 64 bytes (one cache line): records start on a line, a
record header is whole lines, payload chunks are whole lines except a record's last, so every
fragment a reader sees holds whole elements and is aligned for any dtype.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import struct
import tempfile
import threading
from collections.abc import Callable
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np

from split_state.dtypes import DTYPES, dtype_name
from split_state.errors import ProtocolError, TransportError
from transport.protocol import (
    SHM_BELL_OFFSET,
    SHM_FILE_HEADER,
    SHM_FILE_MAGIC,
    SHM_RECORD_MAGIC,
    SHM_RECORD_PREFIX,
    SHM_STOP_OFFSET,
    SHM_WAITING_ANY,
    SHM_WAITING_OFFSET,
)

LINE = 64
FILE_HEADER = 4096  # magic, world size, capacity, owner pid; rings start on a page
CONTROL = 2 * LINE  # per ring: head on one cache line, tail on the next (no false sharing)
HEAD, TAIL = 0, LINE // 8  # indices into the ring's uint64 control words
MAX_NDIM = 32
WRITE_CHUNK = 256 << 10  # a sender publishes at least this often, so the reader can start early
READ_CHUNK = 256 << 10  # a reader frees space at least this often, so the sender can refill

_PREFIX = SHM_RECORD_PREFIX
_FILE = SHM_FILE_HEADER
_DTYPES = {name.encode().ljust(24, b"\0"): dtype for name, dtype in DTYPES.items()}  # as packed


def supported() -> bool:
    """Total store order is what makes the lock-free ring correct without fences."""
    return platform.machine().lower() in ("x86_64", "amd64")


def host_id() -> bytes:
    """This machine (boot) as a short string: two workers may share memory only if it matches."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{platform.node()}/{boot}".encode()[:64]


def shm_root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def inbox_path(session: str, rank: int) -> Path:
    return shm_root() / f"meta-tp-{session}-{rank}"


def host_box_path(session: str, rank: int) -> Path:
    """A worker's postbox for the tcp plane's host-by-host all-reduce (workers/planes/tcp/host_step.py):
    a file of its own, named under the session so that `remove_session` finds it too."""
    return shm_root() / f"meta-tp-{session}-{rank}-host"


def ring_capacity(world_size: int) -> int:
    """Bytes per ring: 4 MiB for small groups, less for large ones (n - 1 rings per worker)."""
    per_ring = (16 << 20) // max(1, world_size - 1)
    return 1 << max(18, min(22, per_ring.bit_length() - 1))


def _round_up(n: int) -> int:
    return -(-n // LINE) * LINE


class RecordHeader(NamedTuple):
    """What precedes an array in a ring (a tuple: this is made for every message)."""

    run: int
    step: int
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int


_RUN_STEP = struct.Struct("<qq")  # the only fields of a record header that change from run to run
_RUN_STEP_AT = 8  # after magic and ndim (see SHM_RECORD_PREFIX)
_SHAPES = {ndim: struct.Struct(f"<{ndim}q") for ndim in range(MAX_NDIM + 1)}


@functools.lru_cache(maxsize=1024)
def header_template(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A record header for an array of `dtype` and `shape`, run and step zero: a program sends
    the same few shapes every run, so each header is packed once and only run and step are
    written per message."""
    ndim = len(shape)
    nbytes = prod(shape) * dtype.itemsize
    raw = _PREFIX.pack(SHM_RECORD_MAGIC, ndim, 0, 0, nbytes, dtype_name(dtype).encode())
    return raw + _SHAPES[ndim].pack(*shape) + bytes(header_bytes(ndim) - _PREFIX.size - 8 * ndim)


@functools.lru_cache(maxsize=1024)
def _parsed(name: bytes, shape: tuple[int, ...], nbytes: int) -> np.dtype:
    """The dtype of a record header's fields, checked once per distinct header."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        name = name.rstrip(b"\0")
        raise ProtocolError(f"shared-memory record of unsupported dtype {name!r}")
    if min(shape, default=0) < 0 or prod(shape) * dtype.itemsize != nbytes:
        raise ProtocolError(f"shared-memory record: shape {shape} of {dtype} does not hold {nbytes} bytes")
    return dtype


_FENCE = threading.Lock()
_SYS_FUTEX = 202  # x86-64, the only machine the rings run on (see `supported`)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE) futexes: the word is in a file mapped by several processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def fence() -> None:
    """A full memory barrier: taking a lock is an atomic read-modify-write (a locked instruction
    on x86-64), which orders every earlier store before every later load."""
    _FENCE.acquire()
    _FENCE.release()


def header_bytes(ndim: int) -> int:
    return _round_up(_PREFIX.size + 8 * ndim)


class Ring:
    """One byte ring in a mapped file: control words and `capacity` data bytes."""

    def __init__(self, buffer: mmap.mmap, offset: int, capacity: int):
        self.capacity = capacity
        self.buffer = buffer
        self.base = offset + CONTROL  # where the data bytes start in `buffer`
        # head and tail as a memoryview of uint64: an index is one aligned 8-byte load or store,
        # and several times cheaper from Python than a NumPy element
        self.words = memoryview(buffer)[offset : offset + CONTROL].cast("Q")
        self.data = np.frombuffer(buffer, np.uint8, capacity, self.base)
        self._typed: dict[np.dtype, np.ndarray] = {}

    def head(self) -> int:
        return self.words[HEAD]

    def tail(self) -> int:
        return self.words[TAIL]

    def typed(self, dtype: np.dtype) -> np.ndarray:
        """The data bytes as read-only elements of `dtype` (fragments start on a line, so at a
        whole element of any dtype)."""
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self.data.view(dtype)
            view.flags.writeable = False
        return view

    def write(self, position: int, raw: bytes) -> None:
        """Small bytes (a header) at a stream position, split where the ring wraps."""
        at = position % self.capacity
        first = min(len(raw), self.capacity - at)
        self.buffer[self.base + at : self.base + at + first] = raw[:first]
        if first < len(raw):
            self.buffer[self.base : self.base + len(raw) - first] = raw[first:]

    def read(self, position: int, n: int) -> bytes:
        at = position % self.capacity
        first = min(n, self.capacity - at)
        raw = self.buffer[self.base + at : self.base + at + first]
        return raw if first == n else raw + self.buffer[self.base : self.base + n - first]

    def release(self) -> None:
        self.words.release()
        self._typed = {}


class _Outgoing:
    """A record being written: header bytes, then the payload, then padding to a line."""

    __slots__ = ("header", "payload", "done")

    def __init__(self, header: bytes, payload: np.ndarray):
        self.header, self.payload = header, payload
        self.done = -1  # payload bytes written; -1 until the header is in


class RingWriter:
    """The producer end of one ring: queues records and writes as much as fits, never blocking."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self.head = ring.head()
        self.queue: list[_Outgoing] = []

    def space(self) -> int:
        """Bytes free in the ring now."""
        return self.ring.capacity - (self.head - self.ring.tail())

    def can_progress(self) -> bool:
        """Whether `pump` would write something now: a record is queued and its next piece fits."""
        if not self.queue:
            return False
        m = self.queue[0]
        need = len(m.header) if m.done < 0 else min(LINE, m.payload.size - m.done)
        return self.space() >= need

    def post(self, run: int, step: int, array: np.ndarray) -> None:
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array).reshape(array.shape)  # keeps 0-d arrays 0-d
        template = header_template(array.dtype, array.shape)
        if not self.queue and self._write_whole(run, step, template, array):
            return
        header = bytearray(template)
        _RUN_STEP.pack_into(header, _RUN_STEP_AT, run, step)
        payload = array.reshape(-1).view(np.uint8) if array.size else np.empty(0, np.uint8)
        self.queue.append(_Outgoing(bytes(header), payload))
        self.pump()

    def _write_whole(self, run: int, step: int, template: bytes, array: np.ndarray) -> bool:
        """The common case, in few Python operations: the whole record fits in the free space
        before the ring wraps. Written, then published with one store of head."""
        ring, head = self.ring, self.head
        cap, size, nbytes = ring.capacity, len(template), array.nbytes
        at = head % cap
        record = _round_up(size + nbytes)
        if at + record > cap or record > cap - (head - ring.words[TAIL]):
            return False
        start = ring.base + at
        buffer = ring.buffer
        buffer[start : start + size] = template
        _RUN_STEP.pack_into(buffer, start + _RUN_STEP_AT, run, step)
        if nbytes:
            buffer[start + size : start + size + nbytes] = array  # its bytes, whatever the dtype
        self.head = head + record
        ring.words[HEAD] = self.head
        return True

    def pump(self) -> bool:
        """Write what fits; True when nothing is left queued."""
        ring, cap = self.ring, self.ring.capacity
        while self.queue:
            m = self.queue[0]
            free = cap - (self.head - ring.tail())
            if m.done < 0:
                if free < len(m.header):
                    return False
                ring.write(self.head, m.header)
                self.head += len(m.header)
                m.done, free = 0, free - len(m.header)
            left = m.payload.size - m.done
            if left:
                at = self.head % cap
                n = min(left, free, cap - at, WRITE_CHUNK)
                if n < left:
                    n -= n % LINE  # whole lines until the last piece keeps fragments aligned
                if n <= 0:
                    ring.words[HEAD] = self.head
                    return False
                ring.data[at : at + n] = m.payload[m.done : m.done + n]
                m.done += n
                self.head += n
                if m.done < m.payload.size:
                    ring.words[HEAD] = self.head  # publish progress: the reader may start
                    continue
            self.head = _round_up(self.head)
            ring.words[HEAD] = self.head
            self.queue.pop(0)
        return True


class RingReader:
    """The consumer end of one ring: a record's header, then its payload as aligned fragments.

    The reader keeps its place inside a record, so a wait abandoned half way (a deadline, an
    abort) leaves the stream intact and the rest can be skipped later."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self.tail = ring.tail()
        self.current: RecordHeader | None = None
        self.offset = 0  # payload bytes of `current` already consumed
        self._elements: np.ndarray | None = None  # the ring as elements of the current dtype

    def available(self) -> int:
        return self.ring.words[HEAD] - self.tail

    def peek(self) -> RecordHeader | None:
        """The header of the record being read, taking in the next one if none is; None while
        no whole header has arrived."""
        if self.current is not None:
            return self.current
        ring = self.ring
        avail = ring.words[HEAD] - self.tail
        if avail < LINE:
            return None
        at = self.tail % ring.capacity
        if at + LINE <= ring.capacity:  # a record starts on a line: its prefix never wraps there
            magic, ndim, run, step, nbytes, name = _PREFIX.unpack_from(ring.buffer, ring.base + at)
        else:
            magic, ndim, run, step, nbytes, name = _PREFIX.unpack(ring.read(self.tail, _PREFIX.size))
        if magic != SHM_RECORD_MAGIC or ndim > MAX_NDIM:
            raise ProtocolError(f"shared-memory ring corrupted: record magic {magic:#x}, {ndim} dimensions")
        size = header_bytes(ndim)
        if avail < size:
            return None
        shape = _SHAPES[ndim].unpack(ring.read(self.tail + _PREFIX.size, 8 * ndim))
        dtype = _parsed(name, shape, nbytes)
        self._advance(size)
        header = self.current = RecordHeader(run, step, dtype, shape, nbytes)
        self.offset = 0
        self._elements = ring.typed(dtype)
        if not nbytes:
            self._finish()
        return header

    def fragment(self) -> np.ndarray | None:
        """The next arrived elements of the current payload as a read-only view of the ring
        (valid until `consume`), or None when none has arrived yet."""
        ring = self.ring
        avail = ring.words[HEAD] - self.tail
        if not avail:
            return None
        cap = ring.capacity
        at = self.tail % cap
        n = min(self.current.nbytes - self.offset, avail, cap - at, READ_CHUNK)
        itemsize = self.current.dtype.itemsize
        return self._elements[at // itemsize : (at + n) // itemsize]

    def consume(self, nbytes: int) -> None:
        """Free `nbytes` payload bytes (those of the last fragment) for the writer."""
        self.offset += nbytes
        self.tail += nbytes
        if self.offset == self.current.nbytes:
            self._finish()
        else:
            self.ring.words[TAIL] = self.tail

    def _finish(self) -> None:
        self.current = None
        self._advance(_round_up(self.tail) - self.tail)

    def _advance(self, n: int) -> None:
        self.tail += n
        self.ring.words[TAIL] = self.tail


POST_BYTES = 64 << 10  # the largest small all-reduce contribution a postbox slot holds
# two slots fit the smallest ring area (ring_capacity is at least 256 KiB)
_POSTED = 1 << 63  # set in every stamp: a zeroed slot matches none
_STEP_BITS = 24


def post_stamp(run: int, step: int) -> int:
    """The stamp of one contribution: its run and program step in one 8-byte word."""
    if not (0 <= step < 1 << _STEP_BITS and 0 <= run < 1 << (63 - _STEP_BITS)):
        raise ProtocolError(f"postbox: run {run}, step {step} do not fit a stamp")
    return _POSTED | run << _STEP_BITS | step


class Postbox:
    """A worker's contributions to small all-reduces, where its peers read them in place: two
    slots, each a stamp line and POST_BYTES of data, in its inbox file's own ring area (a ring
    nobody writes: no worker sends to itself). The owner writes a contribution, then its stamp
    (one aligned 8-byte store publishes it, as a ring's head publishes a record); a peer waits
    until a slot holds the stamp it wants and reads the data where it lies. The owner writes a
    slot again two posts later: by then it has read every peer's next post, and each peer posts
    that only after it has read this one, so nothing is overwritten while a peer reads it."""

    SLOTS = 2  # `find` looks at both by hand: it runs in every spin of a wait

    def __init__(self, buffer: mmap.mmap, offset: int, slot_bytes: int = POST_BYTES):
        self.buffer, self.offset, self.slot_bytes, self.stride = buffer, offset, slot_bytes, LINE + slot_bytes
        words = memoryview(buffer)
        at = [offset + k * self.stride for k in range(self.SLOTS)]
        self.stamps = [words[a : a + 8].cast("Q") for a in at]
        words.release()

    def array(self, slot: int, dtype: np.dtype, size: int) -> np.ndarray:
        """Slot `slot`'s data as `size` elements of `dtype` (a view of the shared memory)."""
        if size * dtype.itemsize > self.slot_bytes:
            raise ProtocolError(f"postbox: {size} x {dtype} is more than a slot's {self.slot_bytes} bytes")
        return np.frombuffer(self.buffer, dtype, size, self.offset + slot * self.stride + LINE)

    def publish(self, slot: int, stamp: int) -> None:
        self.stamps[slot][0] = stamp

    def find(self, stamp: int) -> int:
        """The slot holding `stamp`, or -1 while none does."""
        stamps = self.stamps
        return 0 if stamps[0][0] == stamp else 1 if stamps[1][0] == stamp else -1

    def holds(self, slot: int, stamp: int) -> bool:
        return self.stamps[slot][0] == stamp

    def release(self) -> None:
        for word in self.stamps:
            word.release()
        self.stamps = []


class InboxFile:
    """A worker's shared-memory inbox: one ring per source rank; the area of its own rank's ring,
    which nobody writes, is its Postbox."""

    def __init__(self, path: Path, buffer: mmap.mmap, world_size: int, capacity: int, owner: bool):
        self.path, self.buffer, self.world_size, self.capacity, self.owner = path, buffer, world_size, capacity, owner
        words = memoryview(buffer)
        self.waiting = words[SHM_WAITING_OFFSET : SHM_WAITING_OFFSET + 8].cast("Q")  # the owner's asleep word
        self.bell = words[SHM_BELL_OFFSET : SHM_BELL_OFFSET + 4].cast("I")
        self.stop = words[SHM_STOP_OFFSET : SHM_STOP_OFFSET + 8].cast("Q")  # see transport.protocol
        words.release()
        self._bell_address = ctypes.c_void_p(np.frombuffer(buffer, np.uint32, 1, SHM_BELL_OFFSET).ctypes.data)
        stride = CONTROL + capacity
        self.rings = [Ring(buffer, FILE_HEADER + src * stride, capacity) for src in range(world_size)]
        self._postbox: Postbox | None = None

    def postbox(self, owner: int, slot_bytes: int = POST_BYTES) -> Postbox:
        """The owner's postbox (`owner` is the file's rank; a peer maps it to read what it posts),
        of slots of `slot_bytes` (the ring area must hold two and their stamp lines)."""
        if self._postbox is None:
            if Postbox.SLOTS * (LINE + slot_bytes) > self.capacity:
                raise ProtocolError(f"postbox slots of {slot_bytes} bytes do not fit a ring area of {self.capacity}")
            self._postbox = Postbox(self.buffer, FILE_HEADER + owner * (CONTROL + self.capacity), slot_bytes)
        return self._postbox

    @classmethod
    def create(cls, path: Path, world_size: int, capacity: int) -> InboxFile:
        """Make and map the file (`create_mapped`)."""
        size = FILE_HEADER + world_size * (CONTROL + capacity)
        buffer = create_mapped(path, size, "shared-memory inbox")
        header = _FILE.pack(SHM_FILE_MAGIC, world_size, capacity, os.getpid(), host_id())
        buffer[: len(header)] = header
        return cls(path, buffer, world_size, capacity, owner=True)

    @classmethod
    def attach(cls, path: Path, world_size: int) -> InboxFile:
        buffer = map_existing(path, FILE_HEADER, "a peer's shared-memory inbox")
        size = len(buffer)
        magic, world, capacity, _, host = _FILE.unpack_from(buffer)
        if magic != SHM_FILE_MAGIC or world != world_size or size != FILE_HEADER + world * (CONTROL + capacity):
            buffer.close()
            raise TransportError(f"{path}: not an inbox for {world_size} workers (magic {magic!r}, world {world})")
        host = host.rstrip(b"\0")
        if host != host_id():  # a /tmp shared between machines is not shared memory
            buffer.close()
            raise TransportError(f"{path} belongs to host {host!r}, not this one")
        return cls(path, buffer, world_size, capacity, owner=False)

    def waits_for(self, rank: int, space: bool = False) -> bool:
        """Whether the owner sleeps until `rank` sends it data (read after a `fence()`), or with
        `space`, until `rank` frees ring space (only an owner with bytes queued waits for that,
        and it announces SHM_WAITING_ANY)."""
        word = self.waiting[0]
        return word == SHM_WAITING_ANY or (not space and word == rank + 1)

    def sleep(self, waiting_for: int, ready: Callable[[], bool], seconds: float) -> None:
        """The owner sleeps until its bell rings or `seconds` pass, unless `ready()` (checked
        after announcing whom it waits for: 1 + a rank, or SHM_WAITING_ANY) is already true."""
        seen = self.bell[0]
        self.waiting[0] = waiting_for
        fence()
        try:
            if not ready():
                t = _Timespec(int(seconds), int((seconds % 1) * 1e9))
                _syscall(_SYS_FUTEX, self._bell_address, _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(t), None, 0)
        finally:
            self.waiting[0] = 0

    def ring(self) -> None:
        """Wake the owner (a peer calls this after `waits_for` said it sleeps for it)."""
        self.bell[0] = (self.bell[0] + 1) & 0xFFFFFFFF  # any change fails the sleeper's compare
        _syscall(_SYS_FUTEX, self._bell_address, _FUTEX_WAKE, ctypes.c_int(1), None, None, 0)

    def close(self) -> None:
        for ring in self.rings:
            ring.release()
        if self._postbox is not None:
            self._postbox.release()
            self._postbox = None
        self.waiting.release()
        self.bell.release()
        self.stop.release()
        self.rings = []
        try:
            self.buffer.close()
        except BufferError:  # a view still alive somewhere; the mapping goes with the process
            pass
        if self.owner:
            self.path.unlink(missing_ok=True)


def create_mapped(path: Path, size: int, what: str) -> mmap.mmap:
    """A new file of `size` bytes at `path`, mapped, with all its pages reserved now: a full
    /dev/shm fails here with TransportError, not later with SIGBUS in the middle of a copy."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise TransportError(f"cannot create {what} {path}: {exc}") from None
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise TransportError(f"cannot reserve {size} bytes of shared memory at {path}: {exc}") from None
    finally:
        os.close(fd)


def map_existing(path: Path | str, least: int, what: str) -> mmap.mmap:
    """Another process's file mapped whole; TransportError when it is missing or shorter than
    `least` bytes."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise TransportError(f"cannot open {what} {path}: {exc}") from None
    try:
        size = os.fstat(fd).st_size
        if size < least:
            raise TransportError(f"{path} is not {what} ({size} bytes)")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def remove_session(session: str) -> int:
    """Remove inbox files a session's workers left behind (killed before they could); returns
    how many. The coordinator calls it when it closes."""
    removed = 0
    for path in shm_root().glob(f"meta-tp-{session}-*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


Sink = Callable[[int, np.ndarray], None]  # (element offset, fragment of elements)
