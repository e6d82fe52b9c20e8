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
# how long numba's OpenMP threads spin after a loop before they sleep, in libgomp's turns, read
# when a worker's first parallel loop loads libgomp (workers/binding.py). POOL_SPIN: the default,
# short, where float32 weights' BLAS products take turns with those loops on the same cores.
# INTEGER_DECODE_SPIN: a worker of two or more threads takes it where the coordinator sets
# INTEGER_DECODE_ENV to "1" (every product of its decode step an 8-bit integer product, no BLAS in
# the step: models.loading.decode_pool_env), long enough to span the step's gaps between loops:
# a pool asleep took 18-26 us (median; 44 at p90) to start its next loop (2-core Zen 4 VM,
# 2026-12-04: after a gap of 80 us with 3,000 turns; 2-3 us after gaps up to 300 us with 20,000).
# Decode on one worker of two threads went, alternating pairs: the 1.7B shape's q4_k 68.5 and
# 65.0 -> 79.7 and 71.4 tok/s, SmolLM2's Q4_1 140 / 180 -> 150 / 210; SmolLM2's float32 weights
# (BLAS products) 37 -> 25, the spinning thread holding the core BLAS's thread waits for. A
# worker of one thread has no pool to keep awake and keeps POOL_SPIN (bench/llm.py's one-thread
# decode read 4.6-5.1x the NumPy reference with the long spin, 5.5-6.2x without, 3 and 2 runs:
# not understood, so not taken).
POOL_SPIN_ENV = "GOMP_SPINCOUNT"
POOL_SPIN = "3000"
INTEGER_DECODE_SPIN = "20000"
INTEGER_DECODE_ENV = "META_TP_INTEGER_DECODE"
