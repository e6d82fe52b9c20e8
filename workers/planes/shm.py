"""Shared-memory rings between the workers of one host (transport/shm.py), ZeroMQ for the
signals and for peers on other hosts (workers.comm.HostComm)."""

from __future__ import annotations

import platform

from split_state.errors import TransportError
from workers.planes import Plane, PlaneUnavailable


def _joinable(backend: str) -> str:
    from transport import shm

    return "" if shm.supported() else f"shared memory needs an x86-64 CPU (this is {platform.machine()})"


def _connect(rank, configure, inbox, context, security):
    from workers.comm import HostComm, ZmqComm

    if configure.world_size == 1:
        return ZmqComm(rank, inbox, configure.peers, context, security)  # nobody to share with
    why = _joinable("")
    if why:
        raise PlaneUnavailable(why)
    try:
        comm = HostComm(rank, inbox, configure.peers, context, security, configure.session)
    except TransportError as exc:
        raise PlaneUnavailable(str(exc)) from None
    SHARED_FILES.append(comm.own.path)
    return comm


SHARED_FILES: list = []  # this worker's ring files: removed even when the watchdog ends it abruptly

PLANE = Plane(name="shm", hosts="one", kinds=("cpu", "gpu"), joinable=_joinable, connect=_connect)
