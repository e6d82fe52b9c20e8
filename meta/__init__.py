"""The coordinator: a MetaDevice made of workers, lazy tensors, planning and execution.

`cluster` (start, connect, call and watch worker processes), `device` (MetaDevice: placement,
runs, reads), `tensor` and `graph` (the lazy graph the user builds), `planner` (split-state
inference and communication insertion), `compiler` (one program per worker), `api` (the
`cluster()` context manager), `launchers` (Slurm, MPI, torchrun detection). It speaks to
workers only through transport's messages.
"""

from meta.cluster import ClusterConfig, ProcessCluster
from meta.device import MetaDevice
from meta.tensor import Tensor, apply, concat, get_rows, matmul, softmax, where

__all__ = [
    "ClusterConfig",
    "MetaDevice",
    "ProcessCluster",
    "Tensor",
    "apply",
    "concat",
    "get_rows",
    "matmul",
    "softmax",
    "where",
]
