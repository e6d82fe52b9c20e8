"""Backends: the array module a worker computes with, and moves between host and device.

Kernels live in split_state.kernels, written once against `xp`; a backend supplies `xp`,
host<->device transfers and memory figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from split_state.errors import TransportError


@dataclass(frozen=True)
class DeviceInfo:
    backend: str
    index: int
    name: str
    description: str
    kind: str  # "cpu" or "gpu"
    memory_total: int
    memory_free: int


class NumpyBackend:
    name = "cpu"

    def __init__(self, index: int = 0):
        self.index = index
        self.xp = np

    def info(self) -> DeviceInfo:
        total, free = _host_memory()
        return DeviceInfo("cpu", self.index, f"cpu:{self.index}", "NumPy on host cores", "cpu", total, free)

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_host(self, array: np.ndarray) -> np.ndarray:
        return array

    def synchronize(self) -> None:
        pass


class CupyBackend:
    """One GPU through CuPy. Transfers go through pinned host buffers on a dedicated stream."""

    name = "cuda"

    def __init__(self, index: int = 0):
        import cupy

        self.index = index
        self.xp = cupy
        self.device = cupy.cuda.Device(index)
        self.device.use()
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def info(self) -> DeviceInfo:
        free, total = self.xp.cuda.runtime.memGetInfo()
        props = self.xp.cuda.runtime.getDeviceProperties(self.index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return DeviceInfo("cuda", self.index, f"cuda:{self.index}", name, "gpu", int(total), int(free))

    def to_device(self, array: np.ndarray) -> Any:
        return self.xp.asarray(array)

    def to_host(self, array: Any) -> np.ndarray:
        import cupyx

        out = cupyx.empty_pinned(array.shape, dtype=array.dtype)
        array.get(out=out, stream=self.stream)
        self.stream.synchronize()
        return out

    def synchronize(self) -> None:
        self.device.synchronize()


def _host_memory() -> tuple[int, int]:
    try:
        pages, free = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return pages * size, free * size
    except (ValueError, OSError):
        return 0, 0


def cuda_device_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: all mean "no GPUs here"
        return 0


def make_backend(name: str, index: int = 0):
    if name == "cpu":
        return NumpyBackend(index)
    if name == "cuda":
        if cuda_device_count() <= index:
            raise TransportError(f"backend 'cuda' device {index} is not available (CuPy or a GPU is missing)")
        return CupyBackend(index)
    raise TransportError(f"unknown backend {name!r}; choose cpu or cuda")


def registry() -> list[DeviceInfo]:
    """Every backend's devices, as ggml's backend registry lists them."""
    devices = [NumpyBackend(0).info()]
    for i in range(cuda_device_count()):
        devices.append(CupyBackend(i).info())
    return devices
