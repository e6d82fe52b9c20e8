"""Kernels: what a worker runs for each step of a program.

The tables every backend starts from:
    basic.py        one kernel per op of split_state.ops (KERNELS), written once against `xp`
    quant.py        the ops on block-quantized weights (qmatmul, qget_rows)
    fused.py        fused decoder patterns (PATTERNS): one table row and one kernel each (or
                    none: only backends with an override fuse it); the gqa_attention op's kernel

Each backend's kernels of its own live in its folder: the CPU's numba loops and integer products
in workers/backends/cpu/, the CUDA C kernels (each with its NumPy twin) in workers/backends/cuda/
(its device.py says how to add one).

`kernels_for(backend)` is the table a worker uses: the shared kernels with the backend's own
overrides on top (a backend module may define `KERNELS = {op or pattern name: kernel}`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from workers.kernels import basic, quant
from workers.kernels.basic import OVERWRITES_INPUT, VIEW_OPS
from workers.kernels.fused import FUSED_KERNELS, OP_KERNELS, PATTERNS

KERNELS: dict[str, Callable] = {**basic.KERNELS, **quant.KERNELS, **OP_KERNELS}  # one per op of split_state.ops

__all__ = ["FUSED_KERNELS", "KERNELS", "OVERWRITES_INPUT", "PATTERNS", "VIEW_OPS", "kernels_for"]


def kernels_for(backend) -> dict[str, Callable]:
    overrides = getattr(sys.modules.get(type(backend).__module__), "KERNELS", {})
    return {**basic.KERNELS, **quant.KERNELS, **OP_KERNELS, **FUSED_KERNELS, **overrides}
