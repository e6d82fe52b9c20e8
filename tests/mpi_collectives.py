"""Run by tests/test_mpi.py as `mpiexec -n N python launch.py run tests/mpi_collectives.py OUT.json`:
every transition of tests/test_collectives.py's cases, at several dtypes and sizes, on the
workers of the MPI job, checked against the host reference; the findings go to OUT.json.

Reference: exchanges (Allgatherv included) and point-to-point reductions must equal
`expected_locals` bit for bit (the shared-memory plane's results). MPI's Allreduce and
Reduce_scatter sum in their own order: on 2 ranks that is the rank-order sum bit for bit
(a + b == b + a); on more, within float rounding of it. Mirrored
results must be bitwise identical on every rank either way.
"""

import json
import sys

import numpy as np

from split_state import MIRRORED
from split_state.algorithms import Request, select
from split_state.scatter import check_identical
from tests.test_collectives import CASES, expected_locals, resolve, run_transition

SHAPES = [(7, 5), (300, 3), (5000, 8)]  # 140 B, 3.6 KiB, 160 KiB (past the direct all-reduce)
DTYPES = ["float32", "float16", "int32", "float64"]  # float16: MPI cannot sum it, so point to point

out_path = sys.argv[1]
call = dev.cluster.call_all  # noqa: F821 - `dev` is given by launch.py run
n = dev.n  # noqa: F821
findings = {"plane": dev.plane, "n": n, "cases": []}  # noqa: F821
program = 0
for shape in SHAPES:
    for dtype in DTYPES:
        for case in CASES:
            program += 1
            src, dst = (resolve(c, n, shape) for c in case)
            x = (np.random.default_rng(program).standard_normal(shape) * 10).astype(dtype)
            name = f"{case[0]}->{case[1]} {shape} {dtype}"
            try:
                locals_, got = run_transition(call, n, x, src, dst, program=program, run=program)
                expected = expected_locals(locals_, src, dst)
                request = Request(src, dst, shape, n, x.dtype.itemsize, dtype, dev.plane)  # noqa: F821
                algorithm = select(request).name
                native = algorithm.startswith("native")
                summed = algorithm in ("native_all_reduce", "native_reduce_scatter")
                if dst == MIRRORED:
                    check_identical(got)
                bitwise = all(np.array_equal(g.view(np.uint8), e.view(np.uint8)) for g, e in zip(got, expected))
                close = all(
                    g.shape == e.shape and np.allclose(g, e, rtol=1e-5, atol=1e-4) for g, e in zip(got, expected)
                )
                ok = bitwise or (summed and n > 2 and close)
                findings["cases"].append({"case": name, "ok": ok, "algorithm": algorithm, "bitwise": bitwise})
            except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
                findings["cases"].append({"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
with open(out_path, "w") as f:
    json.dump(findings, f)
