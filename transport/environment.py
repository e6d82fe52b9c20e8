"""Conventions of the process environment that a coordinator sets and its workers read.

Nothing is imported here: a worker reads these before anything in it starts a thread (BLAS
threads keep the CPUs of the thread that started them).
"""

# the BLAS pools' sizes, read once when BLAS loads: a worker is started with them set to its
# threads (a spawned one by the coordinator, a remote one by `launch.py worker`)
BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# set to 1 on the workers: the tcp plane's small all-reduce exchanges with every peer directly even
# across hosts, not host by host (workers/planes/tcp/engine.py; bench/hosts.py's comparison)
TCP_DIRECT_ENV = "META_TP_TCP_DIRECT"
# set to "tcp" on the workers: host by host, the step inside each host goes over TCP too, not
# through shared memory (workers/planes/tcp/host_step.py; bench/collectives.py --hosts compares)
TCP_HOST_STEP_ENV = "META_TP_TCP_HOST_STEP"
CPUS_ENV = "META_TP_CPUS"  # a spawned worker's CPUs, "0,1"; absent when workers are not bound
# set by the command line for a worker started by rank R of an MPI job (mpiexec, srun): the worker
# may join MPI as rank R (workers/planes/mpi/__init__.py); a worker without it never initializes MPI
MPI_RANK_ENV = "META_TP_MPI_RANK"
