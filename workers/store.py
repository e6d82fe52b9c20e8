"""The tensor store: a worker's resident tensors, with memory accounting against a budget."""

from __future__ import annotations

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
