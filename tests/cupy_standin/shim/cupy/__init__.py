"""`import cupy` in a worker started with tests/cupy_standin/shim on its PYTHONPATH: the stand-in."""

import sys

from tests.cupy_standin import MODULES

sys.modules.update(MODULES)  # cupy (this import returns it), cupy.cuda, cupy.cuda.runtime, cupyx
