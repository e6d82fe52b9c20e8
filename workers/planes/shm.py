"""Shared-memory rings between the workers of one host (transport/shm.py), ZeroMQ for the
signals and for peers on other hosts (workers.comm.HostComm)."""

from __future__ import annotations

import platform
from collections.abc import Callable

from split_state.errors import TransportError
from workers.planes import Plane, PlaneUnavailable


def _joinable(backend: str) -> str:
    from transport import shm

    return "" if shm.supported() else f"shared memory needs an x86-64 CPU (this is {platform.machine()})"


def connect_on_host(rank, configure, inbox, context, security, make: Callable[[], object]):
    """A comm over this host's rings that `make` builds (a HostComm or one of its kinds); for a
    lone worker, ZeroMQ (nobody to share with)."""
    from workers.comm import ZmqComm

    if configure.world_size == 1:
        return ZmqComm(rank, inbox, configure.peers, context, security)
    why = _joinable("")
    if why:
        raise PlaneUnavailable(why)
    try:
        comm = make()
    except TransportError as exc:
        raise PlaneUnavailable(str(exc)) from None
    SHARED_FILES.append(comm.own.path)
    return comm


def _connect(rank, configure, inbox, context, security):
    from workers.comm import HostComm

    def make():
        return HostComm(rank, inbox, configure.peers, context, security, configure.session)

    return connect_on_host(rank, configure, inbox, context, security, make)


SHARED_FILES: list = []  # this worker's ring files: removed even when the watchdog ends it abruptly

PLANE = Plane(name="shm", hosts="one", kinds=("cpu", "gpu"), joinable=_joinable, connect=_connect)
