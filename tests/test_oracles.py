"""Kernels and the NumPy reference against values known independently of both: the `math` module,
closed forms worked by hand, and inputs that break careless formulas (large logits, all-zero rows,
rows needing centring)."""

import math

import numpy as np
import pytest

from models import reference as ref
from workers.kernels import KERNELS

GRID = np.linspace(-6, 6, 241)


def kernel(name, *inputs, **params):
    return KERNELS[name](np, [np.asarray(x) for x in inputs], params)


def both(name, *inputs, **params):
    """The kernel's and the reference's result: each must match the known value."""
    return [kernel(name, *inputs, **params), ref.reference(name, [np.asarray(x) for x in inputs], params)]


def gelu_tanh_math(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("fn", [lambda x: kernel("gelu", x), lambda x: ref.gelu_tanh(x)], ids=["kernel", "reference"])
def test_gelu_is_the_tanh_form(fn):
    got = fn(GRID)
    np.testing.assert_allclose(got, [gelu_tanh_math(v) for v in GRID], rtol=0, atol=1e-12)
    assert abs(fn(np.array([1.0]))[0] - 0.8411919906082768) < 1e-12


@pytest.mark.parametrize(
    "fn", [lambda x: kernel("gelu_erf", x), lambda x: ref.gelu_erf(x)], ids=["kernel", "reference"]
)
def test_gelu_erf_is_x_times_the_normal_cdf(fn):
    exact = [0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in GRID]
    np.testing.assert_allclose(fn(GRID), exact, rtol=0, atol=1e-6)
    assert abs(fn(np.array([1.0]))[0] - 0.8413447460685429) < 1e-6  # Phi(1) = 0.841344746...
    # the two GELUs differ by up to ~1e-3 near |x| = 2: an erf kernel that fell back to tanh fails
    assert abs(fn(np.array([2.0]))[0] - 1.9544997361036416) < 1e-6


def test_reference_erf_is_erf():
    np.testing.assert_allclose(ref.erf(GRID), [math.erf(v) for v in GRID], rtol=0, atol=1.5e-7)


@pytest.mark.parametrize(
    "name, fn", [("silu", lambda v: v / (1 + math.exp(-v))), ("exp", math.exp), ("tanh", math.tanh)]
)
def test_unary_ops_match_the_math_module(name, fn):
    x = np.linspace(-5, 5, 41)
    for got in both(name, x):
        np.testing.assert_allclose(got, [fn(v) for v in x], rtol=1e-12)


def test_relu_and_neg_known_points():
    x = np.array([-2.0, -0.0, 0.5, 3.0])
    for got in both("relu", x):
        assert got.tolist() == [0.0, 0.0, 0.5, 3.0]
    for got in both("neg", x):
        assert got.tolist() == [2.0, 0.0, -0.5, -3.0]


def test_softmax_of_large_logits_is_finite():
    x = np.array([[100.0, 0.0], [1000.0, 1000.0], [-1000.0, 0.0]], np.float32)
    for got in both("softmax", x, axis=1):
        assert np.all(np.isfinite(got)), got
        np.testing.assert_allclose(got, [[1.0, math.exp(-100)], [0.5, 0.5], [0.0, 1.0]], atol=1e-7)


def test_softmax_rows_sum_to_one_and_follow_exp_ratios():
    x = np.array([[1.0, 2.0, 3.0]])
    e = [math.exp(v) for v in (1.0, 2.0, 3.0)]
    for got in both("softmax", x, axis=1):
        np.testing.assert_allclose(got[0], [v / sum(e) for v in e], rtol=1e-12)


def test_rms_norm_uses_eps_and_survives_zero_rows():
    x = np.array([[3.0, 4.0], [0.0, 0.0], [1e-3, 1e-3]])
    eps = 1e-5
    expected = [
        [3 / math.sqrt(12.5 + eps), 4 / math.sqrt(12.5 + eps)],
        [0.0, 0.0],  # 0 / sqrt(0 + eps), not 0 / 0
        [1e-3 / math.sqrt(1e-6 + eps)] * 2,  # ~0.3015: eps dominates; without it this is 1.0
    ]
    for got in both("rms_norm", x, axis=1, eps=eps):
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_layer_norm_centres_and_scales():
    x = np.array([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [0.0, 0.0, 0.0]])
    s = 1 / math.sqrt(2 / 3 + 1e-5)
    expected = [[-s, 0.0, s], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    for got in both("layer_norm", x, axis=1, eps=1e-5):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


def test_reductions_matmul_and_rows_known_values():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    for got in both("sum", x, axis=0, keepdims=False):
        assert got.tolist() == [4.0, 6.0]
    for got in both("mean", x, axis=1, keepdims=True, count=2):
        assert got.tolist() == [[1.5], [3.5]]
    for got in both("matmul", x, np.array([[0.0, 1.0], [1.0, 0.0]])):
        assert got.tolist() == [[2.0, 1.0], [4.0, 3.0]]
    table = np.array([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5]])
    for got in both("get_rows", table, np.array([2, 0, 2], np.int32), rows=3):
        assert got.tolist() == [[2.0, 2.5], [0.0, 0.5], [2.0, 2.5]]


def test_low_precision_rounds_once_from_float32():
    x = np.array([1.0, 2.0, 3.0], np.float16)
    for got in both("scale", x, factor=1 / 3):
        assert got.dtype == np.float16 and got.tolist() == np.float16([1 / 3, 2 / 3, 1.0]).tolist()
