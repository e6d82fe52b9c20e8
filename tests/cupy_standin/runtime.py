"""The stand-in's device: streams that run their work later on threads of their own, events,
stream capture into graphs, the memory pools, and the race detector.

Ordering is CUDA's: work on one stream runs in the order issued; work on two streams is
unordered unless an event orders it (record on one, wait_event on the other) or the host waits
for one (synchronize) before it issues to the other. Every operation names the device bytes it
reads and writes; the detector keeps, per stream, a vector clock of what that stream is known to
run after, and an operation that touches bytes another stream touched (one of them writing)
without such an order raises RaceError where it is issued: a missing wait fails every time, not
only when the threads happen to interleave badly. The work itself also runs late, after small
random delays, so a host that reads pinned memory before waiting reads garbage.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.array_utils import byte_bounds

GARBAGE = 0xFF  # fresh device and pinned memory: NaN as float32, so unwritten data shows
DEADLINE_S = 60.0  # a stream waiting for an event that never comes fails rather than hangs


class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError: the CUDA error's name in the text."""

    def __init__(self, status: str, detail: str = ""):
        self.status = status
        super().__init__(f"{status}: {detail}" if detail else status)


class RaceError(AssertionError):
    """Two streams touched the same bytes, one writing, with nothing ordering them."""


class OutOfMemoryError(MemoryError):
    def __init__(self, size: int, total: int, limit: int):
        super().__init__(
            f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes, limit {limit:,})."
        )


def _setting(name: str, default: float) -> float:
    return float(os.environ.get(f"CUPY_STANDIN_{name}", default))


# -- vector clocks and the race detector -----------------------------------------------------------


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for stream, tick in other.items():
        if into.get(stream, 0) < tick:
            into[stream] = tick


@dataclass
class Access:
    lo: int
    hi: int  # byte addresses [lo, hi)
    write: bool
    tick: int  # the issuing stream's tick
    what: str


class Detector:
    """Accesses per stream, checked against every other stream's when an operation is issued."""

    def __init__(self) -> None:
        self.host: dict[int, int] = {}  # what the host has waited for
        self.accesses: dict[int, list[Access]] = {}  # stream id -> accesses not yet known ordered
        self.clocks: dict[int, dict[int, int]] = {}  # stream id -> its vector clock
        self.names: dict[int, str] = {}

    def issue(self, stream: Stream, reads, writes, what: str) -> int:
        """The tick of a new operation on `stream`, after checking it against the others."""
        clock = self.clocks.setdefault(stream.id, {})
        _merge(clock, self.host)  # the host issued it after everything the host waited for
        tick = clock.get(stream.id, 0) + 1
        clock[stream.id] = tick
        mine = [(lo, hi, False) for lo, hi in reads] + [(lo, hi, True) for lo, hi in writes]
        for other, accesses in self.accesses.items():
            if other == stream.id:
                continue
            seen = clock.get(other, 0)
            for a in accesses:
                if a.tick <= seen:
                    continue
                for lo, hi, write in mine:
                    if lo < a.hi and a.lo < hi and (write or a.write):
                        raise RaceError(
                            f"{what} on {stream.name} {'writes' if write else 'reads'} bytes that "
                            f"{a.what} on {self.names[other]} {'writes' if a.write else 'reads'}, "
                            "and no event or synchronize orders the two"
                        )
        own = self.accesses.setdefault(stream.id, [])
        own.extend(Access(lo, hi, write, tick, what) for lo, hi, write in mine)
        if len(own) > 4096:
            self._prune(stream.id)
        self.names[stream.id] = stream.name
        return tick

    def _prune(self, sid: int) -> None:
        """Drop the accesses every other stream (and the host) is known to run after: any later
        operation of theirs merges the host's clock first, so it is ordered after them too."""
        known = self.host.get(sid, 0)
        others = [c for s, c in self.clocks.items() if s != sid]
        if others:
            known = max(known, min(c.get(sid, 0) for c in others))
        self.accesses[sid] = [a for a in self.accesses[sid] if a.tick > known]

    def host_waited(self, clock: dict[int, int]) -> None:
        _merge(self.host, clock)


DETECTOR = Detector()


class Context:
    """The process's CUDA context: a kernel that fails (a twin that raises: CUDA's illegal address
    or launch failure) poisons it, as CUDA's sticky errors do. From then on no stream runs work
    and every synchronize, on any stream or event, raises; so a read-back on a copy stream after
    a failed kernel on the compute stream fails too, where a per-stream failure would have
    returned whatever the buffer held. A process (here: a test, by `reset`) starts anew."""

    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self.where = ""

    def failed(self, exc: BaseException, where: str) -> None:
        with _lock:
            if self.failure is None:  # the first error is the one CUDA reports
                self.failure, self.where = exc, where

    def raise_failure(self) -> None:
        failure = self.failure
        if failure is not None:
            raise CUDARuntimeError(
                "cudaErrorLaunchFailure", f"a kernel on {self.where} failed: {failure!r}"
            ) from failure

    def reset(self) -> None:
        """A fresh context, as a new process has (tests/conftest.py, after each test)."""
        self.failure, self.where = None, ""


CONTEXT = Context()
_lock = threading.RLock()  # issuing is atomic across the host threads of one process


def extent(array: np.ndarray) -> tuple[int, int]:
    if array.size == 0:
        return (0, 0)
    return byte_bounds(array)


# -- streams and events -------------------------------------------------------------------------------


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._done = threading.Event()
        self._done.set()  # an event never recorded counts as complete, as in CUDA
        self.clock: dict[int, int] = {}
        self.stream: Stream | None = None
        self.ptr = next(_ids)
        self.shared = None  # an interprocess event's counters (tests/cupy_standin/ipc.py)
        self.reached: float | None = None  # when its stream ran its record (get_elapsed_time)
        if interprocess:
            if not disable_timing:
                raise CUDARuntimeError("cudaErrorInvalidValue", "an interprocess event must disable timing")
            from tests.cupy_standin.ipc import SharedEventState

            self.shared = SharedEventState()
        _EVENTS[self.ptr] = self

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or get_current_stream()
        stream._record(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(DEADLINE_S):
            raise CUDARuntimeError("cudaErrorLaunchTimeout", "event never completed")
        with _lock:
            DETECTOR.host_waited(self.clock)
        CONTEXT.raise_failure()


@dataclass
class _Work:
    run: Callable[[], None]
    what: str
    late: bool = False  # it writes memory other processes read (CUDA IPC): run it late


# Device memory other processes map (tests/cupy_standin/ipc.py), start -> end. Work writing it
# runs IPC_DELAY_S late, so a reader in another process that does not wait for the writer's
# event reads it before the write, every time.
SHARED: dict[int, int] = {}


def _writes_shared(writes) -> bool:
    if not SHARED:  # the common case: no IPC memory in this process
        return False
    return any(lo < end and start < hi for lo, hi in writes for start, end in list(SHARED.items()))


@dataclass
class _Captured:
    run: Callable[[], None]
    reads: list
    writes: list
    what: str


_local = threading.local()
_ids = iter(range(1, 1 << 62))
_STREAMS: weakref.WeakSet = weakref.WeakSet()  # every stream made (synchronize-all, NCCL's lookup by pointer)
_EVENTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # every event made, by pointer


class Stream:
    null: Stream  # set below

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=0):
        self.id = next(_ids)
        self.name = "the null stream" if null else f"stream {self.id}"
        self.ptr = 0 if null else self.id
        self.non_blocking = non_blocking
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._capture: list[_Captured] | None = None
        self._capture_broken = ""
        self._previous: list[Stream] = []
        self._issued = 0
        self._completed = 0
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        self._delay = _setting("DELAY_S", 0.0005)
        self._delay_odds = _setting("DELAY_ODDS", 0.05)
        self._ipc_delay = _setting("IPC_DELAY_S", 0.002)
        _STREAMS.add(self)

    def _loop(self) -> None:
        while True:
            work: _Work = self._queue.get()
            if random.random() < self._delay_odds:  # late, so an unordered reader sees it missing
                time.sleep(random.uniform(0, self._delay))
            if work.late:
                time.sleep(self._ipc_delay)
            if CONTEXT.failure is not None and not isinstance(work.run, _Marker):
                self._completed += 1
                continue  # after a failed kernel no stream runs anything more, as a sticky CUDA error
            try:
                work.run()
            except BaseException as exc:  # noqa: BLE001 - kept, raised at the next synchronize
                CONTEXT.failed(exc, self.name)
            finally:
                self._completed += 1

    def _put(self, work: _Work) -> None:
        self._issued += 1
        self._queue.put(work)

    # what a kernel or copy calls to run on this stream
    def issue(self, run: Callable[[], None], reads=(), writes=(), what: str = "a kernel") -> None:
        reads = [extent(a) for a in reads]
        writes = [extent(a) for a in writes]
        with _lock:
            if self._capture is not None:
                self._capture.append(_Captured(run, reads, writes, what))
                return
            DETECTOR.issue(self, reads, writes, what)
            self._put(_Work(run, what, _writes_shared(writes)))

    def _record(self, event: Event) -> None:
        with _lock:
            if self._capture is not None:
                self._broken("an event recorded during capture (cross-stream capture is not modelled)")
            done = threading.Event()
            event._done = done
            event.stream = self
            event.clock = dict(DETECTOR.clocks.setdefault(self.id, {}))
            _merge(event.clock, DETECTOR.host)
            event.reached = None
            marker = _Marker(done, stamp=event)
            if event.shared is not None:  # other processes see the record run
                marker = _Marker(done, event.shared, event.shared.issue_record())
            self._put(_Work(marker, "record"))

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        self._record(event)
        return event

    def wait_event(self, event: Event) -> None:
        with _lock:
            if self._capture is not None:
                self._broken("wait_event during capture (cross-stream capture is not modelled)")
            _merge(DETECTOR.clocks.setdefault(self.id, {}), event.clock)
            done = event._done

            def wait() -> None:
                if not done.wait(DEADLINE_S):
                    raise CUDARuntimeError("cudaErrorLaunchTimeout", "waited for an event that never completed")

            self._put(_Work(wait, "wait_event"))

    def synchronize(self) -> None:
        if self._capture is not None:
            self._broken("synchronize of a capturing stream")
        done = threading.Event()
        with _lock:
            clock = dict(DETECTOR.clocks.get(self.id, {}))
            self._put(_Work(_Marker(done), "synchronize"))
        if not done.wait(DEADLINE_S):
            raise CUDARuntimeError("cudaErrorLaunchTimeout", f"{self.name} did not finish")
        with _lock:
            DETECTOR.host_waited(clock)
        self._raise_failure()

    @property
    def done(self) -> bool:
        if self._capture is not None:  # cudaStreamQuery of a capturing stream: refused, as CUDA does
            self._broken("a query of a capturing stream")
        return self._completed == self._issued

    def _raise_failure(self) -> None:
        CONTEXT.raise_failure()

    # -- current stream ------------------------------------------------------------------------------

    def use(self) -> Stream:
        _local.current = self
        return self

    def __enter__(self) -> Stream:
        self._previous.append(get_current_stream())
        return self.use()

    def __exit__(self, *exc) -> None:
        self._previous.pop().use()

    # -- capture -------------------------------------------------------------------------------------

    def begin_capture(self, mode=None) -> None:
        if self is Stream.null:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "the legacy null stream cannot be captured")
        if self._capture is not None:
            raise CUDARuntimeError("cudaErrorIllegalState", "already capturing")
        self._capture, self._capture_broken = [], ""

    def is_capturing(self) -> bool:
        return self._capture is not None

    def end_capture(self) -> Graph:
        if self._capture is None:
            raise CUDARuntimeError("cudaErrorIllegalState", "not capturing")
        work, broken = self._capture, self._capture_broken
        self._capture, self._capture_broken = None, ""
        if broken:
            raise CUDARuntimeError("cudaErrorStreamCaptureInvalidated", broken)
        return Graph(work)

    def _broken(self, why: str) -> None:
        """As CUDA: the illegal call fails, and so does the capture it happened in."""
        self._capture_broken = self._capture_broken or why
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", why)


class _Marker:
    """Work that only says the stream got this far (it runs even after a failure); for an
    interprocess event, also to the other processes (`shared`: its counters)."""

    def __init__(self, done: threading.Event, shared=None, generation: int = 0, stamp: Event | None = None):
        self.done, self.shared, self.generation, self.stamp = done, shared, generation, stamp

    def __call__(self) -> None:
        if self.stamp is not None:
            self.stamp.reached = time.perf_counter()
        self.done.set()
        if self.shared is not None:
            self.shared.ran(self.generation)


Stream.null = Stream(null=True)


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two events' records, as cupy.cuda.get_elapsed_time: both must have
    been recorded and reached (CUDA: cudaErrorNotReady, or invalid for an unrecorded one)."""
    for event in (start, end):
        if event.stream is None:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle", "an event that was never recorded")
        if not event.done or event.reached is None:
            raise CUDARuntimeError("cudaErrorNotReady", "an event its stream has not reached")
    return (end.reached - start.reached) * 1e3


def stream_at(ptr: int) -> Stream:
    """The stream a library given its pointer means."""
    for stream in list(_STREAMS):
        if stream.ptr == ptr:
            return stream
    raise CUDARuntimeError("cudaErrorInvalidResourceHandle", f"no stream with pointer {ptr}")


def event_at(ptr: int) -> Event:
    event = _EVENTS.get(ptr)
    if event is None:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle", f"no event with pointer {ptr}")
    return event


def get_current_stream() -> Stream:
    return getattr(_local, "current", None) or Stream.null


def forbid_in_capture(why: str) -> None:
    """A host-synchronous call: illegal while the current stream captures."""
    stream = get_current_stream()
    if stream._capture is not None:
        stream._broken(why)


class Graph:
    """A captured sequence of work: launching issues it again, on the same memory, in order."""

    def __init__(self, work: list[_Captured]):
        self._work = work
        self.launches = 0

    def upload(self, stream: Stream | None = None) -> None:
        pass

    def launch(self, stream: Stream | None = None) -> None:
        stream = stream or get_current_stream()
        with _lock:
            for w in self._work:
                if stream._capture is not None:
                    stream._capture.append(w)
                    continue
                DETECTOR.issue(stream, w.reads, w.writes, f"{w.what} (graph)")
                stream._put(_Work(w.run, w.what, _writes_shared(w.writes)))
        self.launches += 1


def device_synchronize() -> None:
    forbid_in_capture("device synchronize during capture")
    for stream in list(_STREAMS):
        stream.synchronize()


# -- memory ---------------------------------------------------------------------------------------------


@dataclass
class Memory:
    """One device allocation; back to its pool's free list (for its stream) when no array holds it."""

    raw: np.ndarray
    pool: MemoryPool | None
    stream_id: int
    size: int

    def __del__(self) -> None:
        if self.pool is not None:
            self.pool._free(self)


@dataclass
class MemoryPool:
    """CuPy's pool: sizes rounded to 512 bytes, a freed block kept for reuse by later
    allocations on the stream it was allocated on (stream-ordered reuse, as CuPy's arenas)."""

    limit: int = 0
    _free_blocks: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)
    _used: int = 0
    _total: int = 0

    def malloc(self, nbytes: int) -> Memory:
        size = max(512, -(-nbytes // 512) * 512)
        sid = get_current_stream().id
        with _lock:
            blocks = self._free_blocks.get((sid, size))
            if blocks:
                raw = blocks.pop()
            else:
                capacity = self.limit or int(_setting("MEMORY", 8 << 30))
                if self._total + size > capacity:
                    raise OutOfMemoryError(size, self._total, capacity)
                raw = np.full(size, GARBAGE, np.uint8)
                BLOCKS[raw.ctypes.data] = raw
                self._total += size
            self._used += size
        return Memory(raw, self, sid, size)

    def _free(self, memory: Memory) -> None:
        if _lock is None:  # the interpreter is shutting down (a module's cache held the array): nothing to reuse
            return
        with _lock:
            self._used -= memory.size
            self._free_blocks.setdefault((memory.stream_id, memory.size), []).append(memory.raw)

    def used_bytes(self) -> int:
        return self._used

    def total_bytes(self) -> int:
        return self._total

    def free_all_blocks(self, stream=None) -> None:
        with _lock:
            for blocks in self._free_blocks.values():
                self._total -= sum(b.nbytes for b in blocks)
                for b in blocks:
                    BLOCKS.pop(b.ctypes.data, None)
            self._free_blocks.clear()

    def set_limit(self, size=None, fraction=None) -> None:
        self.limit = int(size or 0)


class PinnedMemoryPool:
    """Page-locked host memory: arrays the stand-in knows are pinned (copies into them are
    asynchronous, so the host must wait before reading them)."""

    def __init__(self) -> None:
        self.pinned: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def malloc(self, nbytes: int):
        raise NotImplementedError("the stand-in's pinned arrays come from cupyx.empty_pinned")

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        raw = np.full(int(np.prod(shape)) * dtype.itemsize, GARBAGE, np.uint8)
        array = raw.view(dtype).reshape(shape)
        self.pinned[id(array)] = array
        return array

    def is_pinned(self, array: np.ndarray) -> bool:
        base = array
        while isinstance(base, np.ndarray):
            if self.pinned.get(id(base)) is base:
                return True
            base = base.base
        return False

    def free_all_blocks(self) -> None:
        pass


current_device = [0]  # the device Device.use() chose: a process drives one
BLOCKS: dict[int, np.ndarray] = {}  # every block a pool holds, by its address


def array_at(ptr: int, count: int, dtype) -> np.ndarray:
    """The device memory at address `ptr` (what a library given a raw pointer reads), as
    `count` values of `dtype`."""
    nbytes = count * np.dtype(dtype).itemsize
    for start, raw in list(BLOCKS.items()):
        if start <= ptr and ptr + nbytes <= start + raw.nbytes:
            return raw[ptr - start : ptr - start + nbytes].view(dtype)
    raise CUDARuntimeError("cudaErrorIllegalAddress", f"{nbytes} bytes at {ptr:#x} are not device memory")


DEFAULT_POOL = MemoryPool()
PINNED_POOL = PinnedMemoryPool()
_allocator: list[Callable[[int], Memory]] = [DEFAULT_POOL.malloc]


def allocate(nbytes: int) -> Memory:
    return _allocator[-1](nbytes)
