"""Run by tests/test_mpi.py as `mpiexec -n 3 python launch.py run tests/mpi_kill.py`: all-reduces on
the MPI plane until worker 1 is killed (SIGKILL) after 50 runs; the coordinator must name it."""

import os
import signal

import numpy as np

from split_state import MIRRORED, PARTIAL
from transport import protocol as p

call, n = dev.cluster.call_all, dev.n  # noqa: F821 - `dev` is given by launch.py run
shape = (64, 64)
call({d: p.Put(1, PARTIAL, shape, np.ones(shape, np.float32)) for d in range(n)})
call({d: p.LoadProgram(1, [p.MoveStep(0, 1, PARTIAL, MIRRORED, shape, "float32")]) for d in range(n)})
for run in range(1, 100000):
    if run == 50:
        os.kill(dev.cluster.pids[1], signal.SIGKILL)  # noqa: F821
    call({d: p.RunProgram(1, run, [[0, 1]], [[1, 2]]) for d in range(n)})
