"""Random operands for every op in the table: shared by the rule tests and the end-to-end tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

dim = st.integers(0, 5)
pos = st.integers(1, 5)


@st.composite
def op_case(draw, name: str):
    """(shapes, dtypes, params) for op `name`, with size-0 and size-1 axes in the mix."""
    f32 = "float32"
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(dim) for _ in range(rank))
    if name == "matmul":
        batch = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
        m, k, n = draw(dim), draw(dim), draw(dim)
        b_batch = draw(st.sampled_from([batch, (), tuple(1 for _ in batch)]))
        return [batch + (m, k), b_batch + (k, n)], [f32, f32], {}
    if name in ("add", "sub", "mul", "div"):
        other = list(shape)
        for i in range(len(other)):
            if draw(st.booleans()) and draw(st.booleans()):
                other[i] = 1
        other = tuple(other[draw(st.integers(0, len(other) - 1)) :])
        shapes = [shape, other] if draw(st.booleans()) else [other, shape]
        return shapes, [f32, f32], {}
    if name == "scale":
        return [shape], [f32], {"factor": draw(st.floats(-3, 3))}
    if name == "cast":
        return [shape], [f32], {"dtype": draw(st.sampled_from(["float16", "float64", "int32"]))}
    if name in ("softmax", "rms_norm", "layer_norm"):
        params = {"axis": draw(st.integers(-rank, rank - 1))}
        if name != "softmax":
            params["eps"] = 1e-5
        return [shape], [f32], params
    if name in ("sum", "mean"):
        return [shape], [f32], {"axis": draw(st.integers(-rank, rank - 1)), "keepdims": draw(st.booleans())}
    if name == "reshape":
        a, b, c = draw(pos), draw(pos), draw(pos)
        src, dst = draw(
            st.sampled_from(
                [
                    ((a, b * c), (a, b, c)),
                    ((a, b, c), (a, b * c)),
                    ((a * b, c), (a, b, c)),
                    ((a, b, c), (a * b * c,)),
                    ((a, b), (b, a)),
                ]
            )
        )
        return [src], [f32], {"shape": dst}
    if name == "transpose":
        return [shape], [f32], {"axes": tuple(draw(st.permutations(range(rank))))}
    if name == "concat":
        axis = draw(st.integers(0, rank - 1))
        count = draw(st.integers(1, 3))
        shapes = [shape[:axis] + (draw(dim),) + shape[axis + 1 :] for _ in range(count)]
        return shapes, [f32] * count, {"axis": axis}
    if name == "slice":
        axis = draw(st.integers(0, rank - 1))
        return [shape], [f32], {"axis": axis, "start": draw(st.integers(-3, 3)), "stop": draw(st.integers(-3, 6))}
    if name == "get_rows":
        rows = draw(pos)
        ids_shape = tuple(draw(dim) for _ in range(draw(st.integers(1, 2))))
        return [(rows, draw(dim)), ids_shape], [f32, "int32"], {}
    return [shape], [f32], {}  # unary


def operand(rng: np.random.Generator, name: str, index: int, shape, dtype, params) -> np.ndarray:
    if name == "get_rows" and index == 1:
        return rng.integers(0, params["rows_hint"], size=shape).astype(dtype)
    x = rng.standard_normal(shape).astype(dtype)
    if name == "div" and index == 1:
        x = np.where(np.abs(x) < 0.5, 1.0, x).astype(dtype)  # keep divisors away from zero
    return x


def draw_case(data, name: str):
    """(arrays, params, canonical params, expected output) for op `name`, drawn by hypothesis."""
    from split_state import dtype_from_name
    from split_state.kernels import KERNELS
    from split_state.ops import infer

    shapes, dtypes, params = data.draw(op_case(name))
    out_shape, out_dtype, canon = infer(name, shapes, dtypes, params)
    rng = np.random.default_rng(0)
    hint = dict(canon, rows_hint=shapes[0][0] if name == "get_rows" else 0)
    arrays = [operand(rng, name, i, s, dtype_from_name(t), hint) for i, (s, t) in enumerate(zip(shapes, dtypes))]
    expected = KERNELS[name](np, arrays, canon)
    assert expected.shape == out_shape and expected.dtype == dtype_from_name(out_dtype)
    return arrays, params, canon, expected


def assert_matches(got: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    if np.issubdtype(expected.dtype, np.floating):
        tol = 1e-2 if expected.dtype == np.float16 else 1e-4
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)
