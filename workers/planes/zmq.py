"""ZeroMQ PUSH/PULL between every pair of workers, on one host or many (CURVE over tcp)."""

from __future__ import annotations

from workers.planes import Plane


def _connect(rank, configure, inbox, context, security):
    from workers.comm import ZmqComm

    return ZmqComm(rank, inbox, configure.peers, context, security)


PLANE = Plane(name="zmq", hosts="many", kinds=("cpu", "gpu"), joinable=lambda backend: "", connect=_connect)
