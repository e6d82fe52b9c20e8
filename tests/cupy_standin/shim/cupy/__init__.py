"""`import cupy` in a worker started with tests/cupy_standin/shim on its PYTHONPATH: the stand-in."""

import sys

from tests.cupy_standin import MODULES, use_standin_cublas

sys.modules.update(MODULES)  # cupy (this import returns it), cupy.cuda, cupy.cuda.runtime, cupyx
use_standin_cublas()  # the CUDA backend's own products: the stand-in's libcublas, as CuPy's on a GPU
