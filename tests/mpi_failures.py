"""Run by tests/test_mpi.py as `mpiexec -n 2 python tests/mpi_failures.py OUT_PREFIX SCENARIO`: an
MPI comm (workers/planes/mpi/engine.py) on each rank over real MPI and ZeroMQ, one rank failing;
each rank writes what it saw to OUT_PREFIX-RANK.json.

abort:    rank 0 waits in the native all-reduce; rank 1's run fails (comm.abort), so rank 0 must
          return with rank 1's error within a second or so, not wait forever.
deadline: rank 0 waits for data rank 1 never sends: WorkerLost at its deadline; rank 1, blocked
          in an all-reduce rank 0 never joins, returns once rank 0 revokes the communicator.
SCENARIO-bound: the same, the all-reduce bound once as a program step binds it (bound_all_reduce).
"""

import json
import os
import sys
import time

os.environ.setdefault("OMPI_MCA_mpi_ft_enable", "1")  # as workers/planes/mpi/__init__.py sets it

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from transport.deadline import Deadline  # noqa: E402
from workers.planes.mpi.engine import standalone  # noqa: E402

prefix, scenario = sys.argv[1], sys.argv[2].removesuffix("-bound")
bound = sys.argv[2].endswith("-bound")
rank = MPI.COMM_WORLD.Get_rank()
with standalone(MPI.COMM_WORLD) as comm:
    time.sleep(0.2)  # the ZeroMQ pushes connect
    seen = {"rank": rank}
    start = time.monotonic()
    try:
        if scenario == "abort" and rank == 1:
            time.sleep(0.5)  # rank 0 is in the all-reduce by now
            comm.abort(5, "ValueError", "planted failure")
        elif scenario == "deadline" and rank == 0:
            comm.receive(1, 5, 3, Deadline(0.5), (4,), np.dtype(np.float32), lambda at, fragment: None)
        elif bound:
            comm.bound_all_reduce(np.dtype(np.float32), (1024,))(np.ones(1024, np.float32), 5, 0, Deadline(5.0))
        else:
            comm.all_reduce(np.ones(1024, np.float32), 5)
        seen["error"] = ""
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        seen["error"] = f"{type(exc).__name__}: {exc}"
        seen["origin"] = getattr(exc, "origin", None)
    seen["seconds"] = time.monotonic() - start
    try:
        comm.check_usable()
        seen["usable"] = True
    except Exception as exc:  # noqa: BLE001
        seen["usable"] = False
        seen["unusable_error"] = f"{type(exc).__name__}: {exc}"
    with open(f"{prefix}-{rank}.json", "w") as f:
        json.dump(seen, f)
