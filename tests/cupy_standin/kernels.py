"""RawModule and RawKernel as the CUDA backend uses them for its kernels of our own
(workers/backends/cuda/kernels/device.py): where a GPU runs the compiled kernel, the stand-in runs its NumPy
twin, on the current stream, ordered and race-checked like any kernel, recorded by a capture and
replayed with its graph.

What it checks that a GPU would not say: a module's code must be the source the project
declares for the kernel (a kernel it does not know is CUDA's "named symbol not found"); every
array argument must be C-contiguous (a kernel reads raw memory: a strided view would be read as
if it were packed) and a device array; the launch shape must be positive and within CUDA's
limits (1,024 threads a block).
"""

from __future__ import annotations

import numpy as np

from tests.cupy_standin import array as arr
from tests.cupy_standin import runtime as rt

MAX_THREADS = 1024


class CompileException(Exception):
    """As cupy.cuda.compiler.CompileException."""


class RawModule:
    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", name_expressions=None, **_):
        if code is None:
            raise CompileException("the stand-in compiles source code only (no path=)")
        self.code, self.options = code, tuple(options)

    def get_function(self, name: str) -> RawKernel:
        from workers.backends.cuda.kernels.device import full_source, table

        kernel = table().get(name)
        if kernel is None or full_source(kernel.source) != self.code:
            raise CompileException(f"named symbol not found: {name} (not a kernel this module's source declares)")
        return RawKernel(kernel)


class RawKernel:
    def __init__(self, kernel):
        self.kernel = kernel
        self.name = kernel.name

    def __call__(self, grid, block, args, *, shared_mem=0):
        _check_launch(self.name, grid, block)
        flat = []
        for i, a in enumerate(args):
            if isinstance(a, arr.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError(f"{self.name}: argument {i} is not C-contiguous; a kernel reads raw memory")
                flat.append(a._a.reshape(-1))
            elif isinstance(a, np.ndarray):
                raise TypeError(f"{self.name}: argument {i} is a host array; a kernel takes device arrays")
            elif isinstance(a, (np.generic, int, float)):
                flat.append(a)
            else:
                raise TypeError(f"{self.name}: argument {i} of type {type(a).__name__} cannot be passed to a kernel")
        arrays = [a for a in flat if isinstance(a, np.ndarray)]
        writes = [flat[i] for i in self.kernel.writes]
        twin = self.kernel.twin

        def run() -> None:
            twin(*flat)

        rt.get_current_stream().issue(run, reads=arrays, writes=writes, what=self.name)


def _check_launch(name: str, grid, block) -> None:
    grid, block = tuple(grid), tuple(block)
    if not 1 <= len(grid) <= 3 or not 1 <= len(block) <= 3:
        raise ValueError(f"{name}: grid and block are 1 to 3 dimensions, got {grid}, {block}")
    if any(int(g) < 1 for g in grid) or any(int(b) < 1 for b in block):
        raise ValueError(f"{name}: an empty launch {grid} x {block} (CUDA: invalid configuration argument)")
    if int(np.prod(block)) > MAX_THREADS:
        raise ValueError(f"{name}: {int(np.prod(block))} threads a block, more than {MAX_THREADS}")
