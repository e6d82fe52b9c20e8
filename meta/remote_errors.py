"""A failed request's Error replies as the coordinator's exceptions: the root cause among the
workers' errors (peers that merely aborted come after it), as the typed exception it was on the
worker where the kind is one of ours, else RemoteError; the worker's traceback kept."""

from __future__ import annotations

from split_state import errors
from split_state.errors import MetaError, RemoteError
from transport import protocol as p

# error kinds a worker reports that map back onto our own exception types
_TYPED = {
    name: getattr(errors, name)
    for name in (
        "SplitError",
        "ShapeError",
        "UnsupportedDtype",
        "ProtocolError",
        "OutOfMemory",
        "WorkerLost",
        "DeadlineExceeded",
        "ConsistencyError",
        "TransportError",
    )
}


def exception_from(failures: dict[int, p.Error]) -> MetaError:
    """The root cause among the workers' errors (peers that merely aborted come last)."""
    ranked = sorted(failures.items(), key=lambda kv: (kv[1].origin >= 0, kv[0]))
    rank, err = ranked[0]
    said = f"worker {rank}: "  # many of a worker's errors already name it so
    text = err.message if err.message.startswith(said) else said + err.message
    if len(failures) > 1:
        text += f" (workers {sorted(failures)} failed)"
    cls = _TYPED.get(err.kind)
    if cls is None:
        return RemoteError(text, rank=rank, kind=err.kind, remote_traceback=err.traceback)
    exc = cls(text) if cls is not errors.WorkerLost else cls(text, rank=rank)
    exc.remote_traceback = err.traceback
    return exc
