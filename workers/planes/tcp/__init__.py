"""Plain TCP sockets between every pair of workers, on one host or many (the comm: engine.py beside
this file). A small all-reduce costs about one exchange of its bytes: the sockets are the
kernel's, read by a spinning worker, with no ZeroMQ I/O thread between a worker and the wire
(a 4 KiB exchange on loopback: ~6 us, against ~50 us through pyzmq). ZeroMQ still carries the
aborts and the rendezvous. The sockets are not encrypted: a cluster with CURVE keys keeps its
data on ZeroMQ's CURVE and reports why."""

from __future__ import annotations

from workers.planes import Plane, PlaneUnavailable


def _connect(rank, configure, inbox, context, security):
    from workers.comm import ZmqComm
    from workers.planes.tcp.engine import TcpComm

    if configure.world_size == 1:
        return ZmqComm(rank, inbox, configure.peers, context, security)  # nobody to connect to
    if security.keys is not None:
        raise PlaneUnavailable("the tcp plane does not encrypt: with CURVE keys the data stays on ZeroMQ")
    return TcpComm(rank, inbox, configure.peers, context, security, configure.session)


PLANE = Plane(name="tcp", hosts="many", kinds=("cpu", "gpu"), joinable=lambda backend: "", connect=_connect)
