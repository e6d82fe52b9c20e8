"""Data planes: how workers move bytes to each other in collectives. One module per plane in this
folder (a file, or a folder whose __init__.py is the entry and whose engine.py holds the plane's
own comm and collective engine: nccl/, ipc/, mpi/), found by its name; each defines `PLANE`, a
`Plane`:

    name          as --data-plane spells it
    hosts         "one" (peers must share this host) or "many"
    kinds         the device kinds it moves data of ("cpu", "gpu")
    joinable(backend) -> str   "" when a worker of this backend can join it here, else why not
    connect(rank, configure, inbox, context, security) -> comm
                  the worker's comm (workers.comm.Inbox: send, receive, flush, abort); raises
                  PlaneUnavailable when it cannot after all (ZeroMQ is then used, and why is
                  reported to the coordinator)

Every worker says in its Hello which planes it can join (`joinable_planes`); the coordinator
picks one they all can (`--data-plane`, or auto: NCCL for GPU workers on distinct GPUs, then
MPI for the ranks of an MPI job, then plain TCP sockets for workers on several hosts without
keys, else shared memory), without importing this package. Adding a
plane that moves bytes through workers/comm.py's HostComm and the shared HostEngine (as shm and
zmq do) is one file here plus tests; a plane with a transport of its own is a folder here: its
entry, and an engine.py with its comm (workers/comm.py's contract) and, where its collectives
are native, its engine (CONTRIBUTING.md, "Add a data plane").
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from split_state.errors import TransportError


class PlaneUnavailable(TransportError):
    """A plane that cannot connect on this worker (the reason goes to the coordinator)."""


@dataclass(frozen=True)
class Plane:
    name: str
    hosts: str  # "one" or "many"
    kinds: tuple[str, ...]
    joinable: Callable[[str], str]  # backend -> "" or why this worker cannot join
    connect: Callable[..., Any]


FALLBACK = "zmq"  # every worker can join it, on any host

_EXIT_DUTIES: list[Callable[[], None]] = []


def at_hard_exit(duty: Callable[[], None]) -> None:
    """Have `duty` run when the worker process exits without the interpreter's teardown
    (workers/main.py's `leave`), where atexit's handlers never run: what a plane's transport must
    still do before the process goes. Each duty runs once at most, in the order given."""
    _EXIT_DUTIES.append(duty)


def exit_duties() -> None:
    while _EXIT_DUTIES:
        _EXIT_DUTIES.pop(0)()


@functools.cache
def names() -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def plane(name: str) -> Plane:
    if name not in names():
        raise TransportError(f"unknown data plane {name!r}; choose one of {', '.join(names())}")
    return importlib.import_module(f"{__name__}.{name}").PLANE


def joinable_planes(backend: str) -> list[str]:
    """The planes a worker of `backend` can join here, for its Hello."""
    return [name for name in names() if not plane(name).joinable(backend)]


def connect(rank: int, configure, inbox, context, security):
    """The comm of the plane the coordinator chose; ZeroMQ, with the reason kept in `note`,
    where that plane cannot connect on this worker."""
    try:
        return plane(configure.collective).connect(rank, configure, inbox, context, security)
    except PlaneUnavailable as exc:
        comm = plane(FALLBACK).connect(rank, configure, inbox, context, security)
        comm.note = str(exc)
        return comm
