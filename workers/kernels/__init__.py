"""Kernels: what a worker runs for each step of a program.

The tables every backend starts from:
    basic.py        one kernel per op of split_state.ops (KERNELS), written once against `xp`
    quant.py        the ops on block-quantized weights (qmatmul, qget_rows)
    fused.py        fused decoder patterns (PATTERNS): one table row and one kernel each (or
                    none: only backends with an override fuse it); the gqa_attention op's kernel

The CPU backend's overrides live in its folder (workers/backends/cpu/: numba_cpu.py's KERNELS,
the numba loops, the integer products with 8-bit activations).

The CUDA backend's kernels of our own (CUDA C with a NumPy twin each; device.py says how to add one):
    device.py       DeviceKernel, the modules compiled at start-up, compile_all
    qgemv.py        decode products reading the GGUF blocks in place
    dequant.py      a prefill's tiles of legacy-format weights dequantized in one launch each
    get_rows.py     the embedding lookup with the ids read on the device
    set_rows.py     the KV-cache write with the positions read on the device
    rope.py         rope, and the keys' rope fused with their cache write (rope_set_rows)
    rms_norm.py     RMSNorm times its weight (rms_norm_mul) in one launch
    swiglu.py       silu(gate) * up (swiglu) in one launch
    attend.py       decode attention over the positions the mask opens (flash-decoding's passes),
                    in the decoder's layout and with a head map (the gqa_attention op)
    top_k.py        the best k logits (bitonic tiles), of a device's span and of the devices'
    sample.py       the next token chosen from the candidates, written where the next step reads it

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
