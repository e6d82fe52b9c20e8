"""Random cases for every op in the table, with the expected value from the independent NumPy
reference (models/reference.py), never from the kernels under test."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from bench.operands import random_case, random_operands
from models.reference import reference
from split_state import dtype_from_name
from split_state.ops import OPS, infer

seeds = st.integers(0, 2**32 - 1)
# every op with a standalone oracle (internal steps of a composite are tested through it)
CHECKED_OPS = sorted(name for name, op in OPS.items() if not op.internal)


def case_from_seed(seed: int, name: str):
    """(arrays, params, canonical params, expected output) of op `name` drawn from `seed`."""
    rng = np.random.default_rng(seed)
    shapes, dtypes, params = random_case(rng, name)
    out_shape, out_dtype, canon = infer(name, shapes, dtypes, params)
    arrays = random_operands(rng, name, shapes, dtypes, params)
    expected = reference(name, arrays, canon)
    assert expected.shape == out_shape and expected.dtype == dtype_from_name(out_dtype), (name, shapes)
    return arrays, params, canon, expected


def draw_case(data, name: str):
    """The same, with the seed drawn by hypothesis."""
    return case_from_seed(data.draw(seeds, label="case seed"), name)


def assert_matches(got: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    if np.issubdtype(expected.dtype, np.floating):
        tol = 1e-2 if expected.dtype == np.float16 else 1e-4
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)
