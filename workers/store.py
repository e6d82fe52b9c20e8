"""The tensor store: a worker's resident tensors, with memory accounting against a budget."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Any

from split_state.errors import OutOfMemory


class TensorStore:
    def __init__(self, budget: int):
        self.budget = budget
        self.tensors: dict[int, Any] = {}
        self.used = 0
        self.transient = 0  # bytes held by the running program's own buffers (results, collectives)
        self.arena = 0  # bytes of the arena every loaded program's intermediates share

    def reserve(self, nbytes: int, what: Callable[[], str]) -> None:
        """Account `nbytes` of intermediates, or OutOfMemory (nothing stored is touched). `what`
        names the allocation; it is called only for the error, as it runs once per step."""
        if self.used + self.transient + self.arena + nbytes > self.budget:
            raise OutOfMemory(
                f"{what()} needs {nbytes} bytes; {self.used} stored + {self.transient} in flight + {self.arena} arena "
                f"of a {self.budget}-byte budget; free tensors or raise the budget"
            )
        self.transient += nbytes

    def release(self, nbytes: int) -> None:
        self.transient -= nbytes

    def put(self, tensor: int, array: Any) -> None:
        old = self.tensors.get(tensor)
        growth = array.nbytes - (old.nbytes if old is not None else 0)
        if self.used + self.transient + self.arena + growth > self.budget:
            raise OutOfMemory(
                f"tensor {tensor} needs {array.nbytes} bytes; {self.used} of a {self.budget}-byte budget "
                f"are in use; free tensors or raise the budget"
            )
        self.tensors[tensor] = array
        self.used += growth

    def get(self, tensor: int) -> Any:
        try:
            return self.tensors[tensor]
        except KeyError:
            raise KeyError(f"tensor {tensor} is not stored on this worker") from None

    def free(self, tensor: int) -> None:
        array = self.tensors.pop(tensor, None)
        if array is not None:
            self.used -= array.nbytes


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_FROM_BYTES = 1 << 20


def map_large_allocations() -> None:
    """Have glibc map every allocation of MMAP_FROM_BYTES or more on its own, and unmap it when
    freed, for the rest of the process (mallopt(M_MMAP_THRESHOLD), which also stops glibc
    raising the threshold to the largest chunk freed, up to 32 MiB). A weight arrives in a
    message buffer and is copied into the store; with the threshold raised, both came from the
    heap, and the freed buffers between stored weights stayed resident: a 1.7B-shaped Q4_K_M
    file's 452 MiB on one worker peaked at 678 MiB, with this at 635 (file + 200 MiB + KV: 653).
    A decode step allocates nothing this large (its buffers are the program's arena)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_FROM_BYTES)
    except (OSError, AttributeError):  # not glibc: its own policy stands
        pass
