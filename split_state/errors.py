"""The exception hierarchy of the whole runtime.

It lives in the lowest layer so that every package can raise and catch the same types. Each
subclass also inherits the builtin it resembles, so `except ValueError` still works for callers
that do not know this package.
"""

from __future__ import annotations


class MetaError(Exception):
    """Root of every error this runtime raises on purpose."""


class SplitError(MetaError, ValueError):
    """A split state does not fit a shape or device count, or is malformed."""


class ShapeError(MetaError, ValueError):
    """Operand shapes or op parameters are incompatible."""


class UnsupportedDtype(MetaError, TypeError):
    """A dtype outside the set the runtime moves and computes with."""


class ConsistencyError(MetaError, RuntimeError):
    """Copies that must be bitwise identical (Mirrored) are not."""


class ProtocolError(MetaError, ValueError):
    """A message on the wire is malformed, oversized or of an unknown kind."""


class TransportError(MetaError, ConnectionError):
    """A socket could not be set up or used."""


class WorkerLost(TransportError):
    """A worker process died or stopped answering within its liveness window."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class NonFiniteLogits(MetaError, ValueError):
    """A step's logits hold NaN or infinity: no token can be chosen from them (the model's weights
    hold such values, or its activations overflowed)."""


class FreedTensor(MetaError, ValueError):
    """A tensor handle used after its storage was freed."""


class DeadlineExceeded(MetaError, TimeoutError):
    """A wait ran past its deadline."""


class OutOfMemory(MetaError, MemoryError):
    """An allocation would exceed a worker's memory budget."""


class KernelCompileError(MetaError, RuntimeError):
    """A device kernel of our own did not compile (names the kernel and the compiler's message)."""


class RemoteError(MetaError, RuntimeError):
    """An operation failed inside a worker; carries the worker's traceback text."""

    def __init__(self, message: str, rank: int | None = None, kind: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.kind = kind
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n--- worker traceback ---\n" + self.remote_traceback.rstrip()
        return text


class WorkerTimeout(WorkerLost, DeadlineExceeded):
    """A worker stopped answering (alive but silent past its liveness window): both lost and a timeout."""
