"""Run by tests/test_mpi.py as `mpiexec -n 2 python tests/mpi_hard_exit.py DIRECTORY`: each rank
joins the MPI plane as a worker does (workers.planes.connect), closes it, and ends through the
worker's own exit (workers.main.leave) while a thread stands for kernels still compiling, so the
process leaves without the interpreter's teardown and atexit never finalizes MPI. mpiexec fails
the job unless every rank still called MPI_Finalize; each rank writes DIRECTORY/left-RANK first.
"""

import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import zmq

from transport.environment import MPI_RANK_ENV
from transport.sockets import Security, pull
from workers import planes
from workers.main import PREPARING, leave, still_compiling

where = Path(sys.argv[1])
rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ[MPI_RANK_ENV] = str(rank)  # as cli/options.py starts a job's worker
peers = [f"ipc://{where}/data-{r}" for r in range(size)]
context = zmq.Context()
security = Security(context, None)
inbox, _ = pull(context, peers[rank], security)
configure = SimpleNamespace(collective="mpi", world_size=size, peers=peers)
comm = planes.connect(rank, configure, inbox, context, security)
assert comm.plane == "mpi", getattr(comm, "note", "")
comm.close()
inbox.close(0)
context.destroy(linger=0)
compiling = threading.Event()
PREPARING.append(threading.Thread(target=compiling.wait, daemon=True))  # never set: "still compiling"
PREPARING[-1].start()
(where / f"left-{rank}").write_text(str(still_compiling()))
leave(0)
