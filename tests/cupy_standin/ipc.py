"""CUDA IPC for the stand-in: device memory and events shared between processes.

As CUDA: `runtime.malloc` gives an allocation of its own (not the pool's), whose handle
(`ipcGetMemHandle`, 64 bytes) another process opens (`ipcOpenMemHandle`) to read and write the
same bytes; an event made with `interprocess=True` has a handle (`ipcGetEventHandle`) that
another process opens (`ipcOpenEventHandle`), and `runtime.streamWaitEvent` makes a stream wait
for the event's latest record *at the time of the call*, whichever process recorded it. Here the
bytes lie in files under /dev/shm mapped by every process that opened them, and an event is two
shared counters: how many records were issued, and how many of them have run. A stream that
waits for a record that never runs fails after DEADLINE_S, as a timed-out kernel would.

What a missing wait does: work that writes shared memory runs late (runtime.SHARED,
IPC_DELAY_S), so a stream that reads a peer's buffer without waiting for the peer's event reads
it before the peer's write lands: stale or garbage data every time, as a GPU may give.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
import weakref

import numpy as np

from tests.cupy_standin import runtime as rt

HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
PREFIXES = ("standin-ipc-", "standin-event-")  # the files' names: a prefix, the maker's pid, a random part
POLL_S = 20e-6
_FOLDER = "/dev/shm" if os.path.isdir("/dev/shm") else None
_lock = threading.Lock()


class _Shared:
    """A file of `nbytes` mapped here: made (`path` None) or opened."""

    def __init__(self, nbytes: int, path: str | None = None, prefix: str = PREFIXES[0]):
        self.owner = path is None
        if path is None:  # the maker's pid in the name: sweep_orphans finds what a dead maker left
            fd, path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=_FOLDER)
            os.ftruncate(fd, nbytes)
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise rt.CUDARuntimeError("cudaErrorInvalidValue", f"no IPC allocation {path!r}") from None
            nbytes = os.fstat(fd).st_size
        self.path = path
        # the maker's file goes when it is freed, or when the maker exits without freeing it
        self.unlink = weakref.finalize(self, _unlink, path) if self.owner else lambda: None
        self.map = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.raw = np.frombuffer(self.map, np.uint8)
        self.address = self.raw.ctypes.data

    def handle(self) -> bytes:
        name = self.path.encode()
        if len(name) > HANDLE_BYTES:
            raise rt.CUDARuntimeError("cudaErrorInvalidValue", "the temporary folder's path is too long for a handle")
        return name.ljust(HANDLE_BYTES, b"\0")

    def close(self) -> None:
        self.unlink()


def sweep_orphans(folder: str | None = _FOLDER) -> list[str]:
    """Remove the files of makers that exited without freeing them, and return their paths: a
    worker killed, or ended by os._exit (workers/main.py), runs no finalizer, and CUDA itself
    frees a dead process's memory, so nothing else would."""
    removed = []
    for name in os.listdir(folder or tempfile.gettempdir()):
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        pid = name[len(prefix) :].split("-", 1)[0] if prefix else ""
        if pid.isdigit() and not _alive(int(pid)):
            path = os.path.join(folder or tempfile.gettempdir(), name)
            _unlink(path)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _path(handle: bytes) -> str:
    if len(handle) != HANDLE_BYTES:
        raise rt.CUDARuntimeError("cudaErrorInvalidValue", f"an IPC handle of {len(handle)} bytes")
    return bytes(handle).rstrip(b"\0").decode()


# -- memory ----------------------------------------------------------------------------------------

_MEMORY: dict[int, _Shared] = {}  # allocations made or opened here, by address


def malloc(nbytes: int) -> int:
    shared = _Shared(max(1, int(nbytes)))
    shared.raw[:] = rt.GARBAGE
    _register(shared)
    return shared.address


def _register(shared: _Shared) -> None:
    with _lock:
        _MEMORY[shared.address] = shared
        rt.BLOCKS[shared.address] = shared.raw
        rt.SHARED[shared.address] = shared.address + shared.raw.nbytes


def free(ptr: int) -> None:
    _release(ptr, made=True)


def ipc_get_mem_handle(ptr: int) -> bytes:
    shared = _MEMORY.get(ptr)
    if shared is None or not shared.owner:
        raise rt.CUDARuntimeError("cudaErrorInvalidValue", f"{ptr:#x} is not the start of an allocation made here")
    return shared.handle()


def ipc_open_mem_handle(handle: bytes, flags: int = 1) -> int:
    shared = _Shared(0, _path(handle))
    _register(shared)
    return shared.address


def ipc_close_mem_handle(ptr: int) -> None:
    _release(ptr, made=False)


def _release(ptr: int, made: bool) -> None:
    with _lock:
        shared = _MEMORY.get(ptr)
        if shared is None or shared.owner != made:
            what = "made by runtime.malloc" if made else "opened by ipcOpenMemHandle"
            raise rt.CUDARuntimeError("cudaErrorInvalidValue", f"{ptr:#x} is not memory {what}")
        del _MEMORY[ptr]
        rt.BLOCKS.pop(ptr, None)
        rt.SHARED.pop(ptr, None)
    shared.close()  # the mapping itself stays while arrays over it live


# -- events ----------------------------------------------------------------------------------------


class SharedEventState:
    """An interprocess event's state: [records issued, records run], in a shared file."""

    def __init__(self, path: str | None = None):
        self.shared = _Shared(16, path, prefix=PREFIXES[1])
        self.counts = self.shared.raw.view(np.int64)

    def issue_record(self) -> int:
        self.counts[0] += 1
        return int(self.counts[0])

    def ran(self, generation: int) -> None:
        self.counts[1] = max(int(self.counts[1]), generation)

    def wait_for(self, generation: int) -> None:
        deadline = time.monotonic() + rt.DEADLINE_S
        while self.counts[1] < generation:
            if time.monotonic() > deadline:
                raise rt.CUDARuntimeError("cudaErrorLaunchTimeout", "waited for an IPC event that never completed")
            time.sleep(POLL_S)


_OPENED: dict[int, SharedEventState] = {}  # events opened from handles, by the pointer handed out
_ids = iter(range(1 << 40, 1 << 41))


def ipc_get_event_handle(event_ptr: int) -> bytes:
    event = rt.event_at(event_ptr)
    if event.shared is None:
        raise rt.CUDARuntimeError("cudaErrorInvalidResourceHandle", "the event was not made with interprocess=True")
    return event.shared.shared.handle()


def ipc_open_event_handle(handle: bytes) -> int:
    state = SharedEventState(_path(handle))
    ptr = next(_ids)
    _OPENED[ptr] = state
    return ptr


def stream_wait_event(stream_ptr: int, event_ptr: int, flags: int = 0) -> None:
    stream = rt.stream_at(stream_ptr)
    state = _OPENED.get(event_ptr)
    if state is None:  # an event of this process
        stream.wait_event(rt.event_at(event_ptr))
        return
    generation = int(state.counts[0])  # the latest record issued now, as CUDA
    stream.issue(lambda: state.wait_for(generation), what="a wait for an IPC event")


def event_destroy(event_ptr: int) -> None:
    state = _OPENED.pop(event_ptr, None)
    if state is not None:
        state.shared.close()
