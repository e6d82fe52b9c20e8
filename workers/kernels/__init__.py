"""Kernels: what a worker runs for each step of a program.

    basic.py   one kernel per op of split_state.ops (KERNELS), written once against `xp`
    quant.py   the ops on block-quantized weights (qmatmul, qget_rows)
    fused.py   fused decoder patterns (PATTERNS): one table row and one kernel each

`kernels_for(backend)` is the table a worker uses: the shared kernels with the backend's own
overrides on top (a backend module may define `KERNELS = {op or pattern name: kernel}`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from workers.kernels import basic, quant
from workers.kernels.basic import OVERWRITES_INPUT, VIEW_OPS
from workers.kernels.fused import FUSED_KERNELS, PATTERNS

KERNELS: dict[str, Callable] = {**basic.KERNELS, **quant.KERNELS}  # one per op of split_state.ops

__all__ = ["FUSED_KERNELS", "KERNELS", "OVERWRITES_INPUT", "PATTERNS", "VIEW_OPS", "kernels_for"]


def kernels_for(backend) -> dict[str, Callable]:
    overrides = getattr(sys.modules.get(type(backend).__module__), "KERNELS", {})
    return {**basic.KERNELS, **quant.KERNELS, **FUSED_KERNELS, **overrides}
