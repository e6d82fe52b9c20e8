"""NCCL between CuPy workers, each on its own GPU (its comm and engine: engine.py beside this file):
its collectives where they fit, grouped send/recv otherwise; the unique id comes from rank 0 through
the coordinator."""

from __future__ import annotations

from workers.planes import Plane


def _joinable(backend: str) -> str:
    from workers.planes.nccl.engine import nccl_available

    if backend != "cuda":
        return "NCCL moves GPU memory: it needs the cuda backend"
    return "" if nccl_available() else "CuPy here has no NCCL >= 2.7"


def _connect(rank, configure, inbox, context, security):
    from workers.planes.nccl.engine import NcclComm, NcclDevice

    device = NcclDevice(configure.world_size, configure.nccl_id, rank)  # blocks until all ranks join
    return NcclComm(rank, inbox, configure.peers, context, security, device)


PLANE = Plane(name="nccl", hosts="one", kinds=("gpu",), joinable=_joinable, connect=_connect)
