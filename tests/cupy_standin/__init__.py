"""An asynchronous stand-in for CuPy, on NumPy buffers: the CUDA backend's code runs under it
without a GPU, with CuPy's ordering rules enforced (tests/cupy_standin/runtime.py says how).

    modules()        the `cupy` and `cupyx` modules (and their submodules) to put in sys.modules
    install(mp)      put them there for one test (pytest's monkeypatch)
    SHIM             a folder to prepend to a worker process's PYTHONPATH: there `import cupy`
                     gives the stand-in

What it models: streams (each a thread running its work later, in order), events, the current
stream, stream capture into graphs and their replay, the device memory pool (stream-ordered
reuse of freed blocks, a limit), pinned host memory, host-synchronous calls (forbidden while
capturing), the race detector, NCCL communicators between processes (nccl.py), CUDA IPC:
device memory and events shared between processes (ipc.py), and the libcublas the CUDA backend
calls through ctypes for products a graph can capture (cublas.py: operands read at raw device
addresses, column-major, on the handle's stream), and the kernels of our own (kernels.py: each
runs its NumPy twin). What it does not: what a launch configuration computes (a twin computes
the whole result whatever grid it is given; the launch is only checked for CUDA's limits).
"""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path

import numpy as np

from tests.cupy_standin import array as arr
from tests.cupy_standin import ipc
from tests.cupy_standin import kernels as standin_kernels
from tests.cupy_standin import nccl as standin_nccl
from tests.cupy_standin import runtime as rt

SHIM = str(Path(__file__).resolve().parent / "shim")
VERSION = "14.2.0-standin"


class _Module(types.ModuleType):
    """`cupy`: its own functions, then NumPy's names (dtypes and constants as they are, functions
    issued to the stream)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(np, name)  # AttributeError for what NumPy lacks too
        if isinstance(value, type) or not callable(value):
            return value
        return arr.function(name)


def _device_count() -> int:
    return int(rt._setting("DEVICES", 1))


class Device:
    """A device; `Device()` the current one. A process drives one stand-in device (its memory is
    the process's), so `use()` only says which: what its arrays report as their `device`."""

    def __init__(self, device=None):
        self.id = rt.current_device[0] if device is None else int(device)
        if not 0 <= self.id < _device_count():
            raise rt.CUDARuntimeError("cudaErrorInvalidDevice", "invalid device ordinal")

    def use(self) -> None:
        rt.current_device[0] = self.id

    def synchronize(self) -> None:
        rt.device_synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _get_device_count() -> int:
    return _device_count()


def _mem_get_info() -> tuple[int, int]:
    total = int(rt._setting("MEMORY", 8 << 30))
    return total - rt.DEFAULT_POOL.total_bytes(), total


def _device_properties(index: int) -> dict:
    return {"name": b"CuPy stand-in", "totalGlobalMem": int(rt._setting("MEMORY", 8 << 30)), "major": 9, "minor": 0}


@contextlib.contextmanager
def _using_allocator(allocator=None):
    rt._allocator.append(allocator or rt.DEFAULT_POOL.malloc)
    try:
        yield
    finally:
        rt._allocator.pop()


def _empty_pinned(shape, dtype=float, order="C"):
    return rt.PINNED_POOL.empty(shape, dtype)


def _zeros_pinned(shape, dtype=float, order="C"):
    out = rt.PINNED_POOL.empty(shape, dtype)
    out[...] = 0
    return out


def modules() -> dict[str, types.ModuleType]:
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.CUDARuntimeError = rt.CUDARuntimeError
    runtime.getDeviceCount = _get_device_count
    runtime.memGetInfo = _mem_get_info
    runtime.getDeviceProperties = _device_properties
    runtime.deviceSynchronize = rt.device_synchronize
    runtime.streamCaptureModeRelaxed = 2
    runtime.malloc, runtime.free = ipc.malloc, ipc.free
    runtime.ipcGetMemHandle, runtime.ipcOpenMemHandle = ipc.ipc_get_mem_handle, ipc.ipc_open_mem_handle
    runtime.ipcCloseMemHandle = ipc.ipc_close_mem_handle
    runtime.ipcGetEventHandle, runtime.ipcOpenEventHandle = ipc.ipc_get_event_handle, ipc.ipc_open_event_handle
    runtime.streamWaitEvent, runtime.eventDestroy = ipc.stream_wait_event, ipc.event_destroy
    runtime.cudaIpcMemLazyEnablePeerAccess = 1
    memory = types.ModuleType("cupy.cuda.memory")
    memory.OutOfMemoryError = rt.OutOfMemoryError
    memory.MemoryPool = rt.MemoryPool
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime, cuda.memory, cuda.nccl = runtime, memory, standin_nccl
    cuda.Stream, cuda.Event, cuda.Graph, cuda.Device = rt.Stream, rt.Event, rt.Graph, Device
    cuda.UnownedMemory, cuda.MemoryPointer = arr.UnownedMemory, arr.MemoryPointer
    cuda.MemoryPool, cuda.PinnedMemoryPool = rt.MemoryPool, rt.PinnedMemoryPool
    cuda.get_current_stream, cuda.get_elapsed_time = rt.get_current_stream, rt.get_elapsed_time
    cuda.set_pinned_memory_allocator = lambda allocator=None: None
    cuda.set_allocator = lambda allocator=None: rt._allocator.__setitem__(0, allocator or rt.DEFAULT_POOL.malloc)
    cuda.using_allocator = _using_allocator
    cuda.is_available = lambda: _device_count() > 0
    cupy = _Module("cupy")
    cupy.__version__ = VERSION
    cupy.cuda = cuda
    cupy.ndarray = arr.ndarray
    cupy.RawModule, cupy.RawKernel = standin_kernels.RawModule, standin_kernels.RawKernel
    cupy.get_default_memory_pool = lambda: rt.DEFAULT_POOL
    cupy.get_default_pinned_memory_pool = lambda: rt.PINNED_POOL
    for name, fn in arr.SPECIAL.items():
        setattr(cupy, name, fn)
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned, cupyx.zeros_pinned = _empty_pinned, _zeros_pinned
    return {
        "cupy": cupy,
        "cupy.cuda": cuda,
        "cupy.cuda.runtime": runtime,
        "cupy.cuda.memory": memory,
        "cupy.cuda.nccl": standin_nccl,
        "cupyx": cupyx,
    }


MODULES = modules()
cupy = MODULES["cupy"]


def install(monkeypatch, cublas: bool = True) -> types.ModuleType:
    """The stand-in as `cupy` for one test; returns it. With `cublas`, the CUDA backend's own
    products find the stand-in's libcublas (cublas.py), as on a GPU; without, none (the backend
    leaves products to CuPy, never captured)."""
    from workers.backends import cuda
    from workers.backends.cuda import cublas as _cublas

    for name, module in MODULES.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(cuda, "_GEMMS", {})  # each test opens its own
    monkeypatch.setattr(cuda, "_DEVICE_KERNELS", {})  # and compiles the kernels for the stand-in
    monkeypatch.setattr(rt, "current_device", [0])
    monkeypatch.setattr(_cublas, "_library", _standin_cublas if cublas else _no_cublas)
    return cupy


def use_standin_cublas() -> None:
    """In a worker whose `import cupy` gives the stand-in (shim/cupy): the CUDA backend's own
    products find the stand-in's libcublas, where on a GPU they find CuPy's."""
    from workers.backends.cuda import cublas as _cublas

    _cublas._library = _standin_cublas


def _standin_cublas(cupy):
    from tests.cupy_standin.cublas import Library

    return Library()


def _no_cublas(cupy):
    raise OSError("libcublas is not loaded in this process")
