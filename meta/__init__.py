"""The coordinator: a MetaDevice made of workers, lazy tensors, planning and execution."""

from meta.cluster import ClusterConfig, ProcessCluster
from meta.device import MetaDevice
from meta.tensor import Tensor, apply, concat, get_rows, matmul, softmax

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
]
