"""CUDA IPC between CuPy workers on one host (its comm and engine: engine.py beside this file): each
worker's device buffer and events opened by its peers, the data read GPU to GPU; the signals go
through the shared-memory rings of the shm plane. Workers may share a GPU (NCCL cannot put two ranks
on one)."""

from __future__ import annotations

from split_state.errors import TransportError
from workers.planes import Plane


def _joinable(backend: str) -> str:
    from workers.planes.shm import PLANE as SHM

    if backend != "cuda":
        return "CUDA IPC shares GPU memory: it needs the cuda backend"
    why = SHM.joinable(backend)
    return f"the IPC plane signals through shared memory: {why}" if why else ""


def _connect(rank, configure, inbox, context, security):
    from workers.planes.ipc.engine import IpcComm, IpcDevice
    from workers.planes.shm import connect_on_host

    def make():
        try:
            device = IpcDevice()
        except Exception as exc:  # noqa: BLE001 - no IPC on this driver or device: said to the coordinator
            raise TransportError(f"CUDA IPC is not available here: {type(exc).__name__}: {exc}") from None
        return IpcComm(rank, inbox, configure.peers, context, security, configure.session, device, JOIN_SECONDS)

    return connect_on_host(rank, configure, inbox, context, security, make)


JOIN_SECONDS = 30.0  # every peer's handles arrive within this, or the plane is not used

PLANE = Plane(name="ipc", hosts="one", kinds=("gpu",), joinable=_joinable, connect=_connect)
