"""MPI between workers that are the ranks of one MPI job (its comm and engine: engine.py beside this
file): `mpiexec -n N python launch.py ...` or `srun --mpi=pmix`. A worker can join only where the
command line started it for its job rank (transport.environment.MPI_RANK_ENV) and mpi4py is
installed; MPI is initialized when the plane connects, never before, so workers on other planes
never touch it."""

from __future__ import annotations

import functools
import importlib.util
import os
import time

from split_state.errors import TransportError
from transport.environment import MPI_RANK_ENV
from workers.planes import Plane, PlaneUnavailable, at_hard_exit


def _joinable(backend: str) -> str:
    if backend != "cpu":
        return "the MPI plane moves host memory: it needs the cpu backend"
    if MPI_RANK_ENV not in os.environ:
        return "this worker was not started by a rank of an MPI job (mpiexec -n N python launch.py ...)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed: pip install -e '.[mpi]'"
    return ""


def _connect(rank, configure, inbox, context, security):
    from workers.planes.mpi.engine import MpiComm

    why = _joinable("cpu")
    if why:
        raise PlaneUnavailable(why)
    if os.environ[MPI_RANK_ENV] != str(rank):
        raise PlaneUnavailable(f"worker {rank} was started by MPI rank {os.environ[MPI_RANK_ENV]}")
    # Open MPI: with its fault-tolerance extension switched on, revoking a communicator frees
    # every rank blocked on it (workers/planes/mpi/engine.py); without it a revoke would wait for the peers
    os.environ.setdefault("OMPI_MCA_mpi_ft_enable", "1")
    try:
        from mpi4py import MPI  # initializes MPI: the job's launcher says who we are

        at_hard_exit(functools.partial(_finalize, MPI))
        world = MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (rank, configure.world_size):
            raise PlaneUnavailable(
                f"MPI says rank {world.Get_rank()} of {world.Get_size()}; the cluster says worker {rank} of "
                f"{configure.world_size}"
            )
        # ours alone: revoking it after a failure leaves the job's world intact. Every rank joins
        # here, within the start deadline: a rank that never comes must not hold the others
        own, joined = world.Idup()
        end = time.monotonic() + JOIN_SECONDS
        while not joined.Test():
            if time.monotonic() > end:
                raise TransportError(f"worker {rank}: not every MPI rank joined within {JOIN_SECONDS:.0f} s")
            time.sleep(1e-3)
    except ImportError as exc:
        raise PlaneUnavailable(f"mpi4py cannot start MPI here: {exc}") from None
    return MpiComm(rank, inbox, configure.peers, context, security, own)


def _finalize(MPI) -> None:
    """MPI_Finalize, which mpi4py leaves to atexit: a rank that exits without it fails the whole
    job (mpiexec: "exited without calling finalize"), however well the job went."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


JOIN_SECONDS = 30.0


PLANE = Plane(name="mpi", hosts="many", kinds=("cpu",), joinable=_joinable, connect=_connect)
