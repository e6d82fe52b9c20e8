"""Conventions of the process environment that a coordinator sets and its workers read.

Nothing is imported here: a worker reads these before anything in it starts a thread (BLAS
threads keep the CPUs of the thread that started them).
"""

CPUS_ENV = "META_TP_CPUS"  # a spawned worker's CPUs, "0,1"; absent when workers are not bound
