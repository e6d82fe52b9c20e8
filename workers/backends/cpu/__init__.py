"""The CPU backend: NumPy on host cores (each CPU worker gets its share of BLAS threads)."""

from __future__ import annotations

import os

import numpy as np

from workers.backends import DeviceInfo
from workers.backends.cpu.numba_cpu import OVERRIDES as KERNELS  # fused loops when numba is installed
from workers.backends.cpu.packing import interleaved_copy
from workers.backends.cpu.placement import resident_copy

__all__ = ["KERNELS", "Backend", "host_memory"]


class Backend:
    name = "cpu"
    kind = "cpu"
    priority = 0
    host_threads = True

    @classmethod
    def device_count(cls) -> int:
        return 1  # the host: workers share its cores

    @classmethod
    def default_workers(cls) -> int:
        return 2

    def __init__(self, index: int = 0):
        self.index = index
        self.xp = np

    def info(self) -> DeviceInfo:
        total, free = host_memory()
        return DeviceInfo(self.name, self.index, f"cpu:{self.index}", "NumPy on host cores", self.kind, total, free)

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return array

    def resident(self, array: np.ndarray) -> np.ndarray:
        return resident_copy(array)  # where the products read it fastest

    def to_host(self, array: np.ndarray) -> np.ndarray:
        return interleaved_copy(array)  # a weight the integer products packed, as it was sent

    def synchronize(self) -> None:
        pass


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    try:
        pages, free = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return pages * size, free * size
    except (ValueError, OSError):
        return 0, 0
