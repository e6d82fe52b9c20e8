import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from split_state import MIRRORED, PARTIAL, ConsistencyError, Split, SplitError, gather, scatter
from tests.strategies import devices, dtypes, random_array, shapes, state_for


@settings(max_examples=300, deadline=None)
@given(data=st.data(), shape=shapes, n=devices, dtype=dtypes)
def test_gather_of_scatter_is_exact_for_every_state(data, shape, n, dtype):
    state = data.draw(state_for(shape, n))
    x = random_array(np.random.default_rng(0), shape, dtype)
    locals_ = scatter(x, state, n)
    assert len(locals_) == n
    back = gather(locals_, state, check_mirrored=True)
    assert back.dtype == x.dtype and back.shape == x.shape
    assert np.array_equal(back, x)


def test_partial_scatter_puts_value_on_device_zero():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    parts = scatter(x, PARTIAL, 3)
    assert np.array_equal(parts[0], x) and not parts[1].any() and not parts[2].any()


def test_split_scatter_holds_only_the_slices():
    x = np.arange(10).reshape(5, 2)
    a, b = scatter(x, Split(0, ((2, 3),)), 2)
    assert np.array_equal(a, x[:2]) and np.array_equal(b, x[2:])


def test_mirrored_check_catches_divergent_copies():
    x = np.ones(3, np.float32)
    with pytest.raises(ConsistencyError, match="device 1"):
        gather([x, x + 1], MIRRORED, check_mirrored=True)


def test_scatter_rejects_state_that_does_not_fit():
    with pytest.raises(SplitError, match="extents sum to 4"):
        scatter(np.zeros((5, 2)), Split(0, ((2, 2),)), 2)


def test_gather_rejects_wrong_local_shapes():
    with pytest.raises(SplitError, match="device 1 holds shape"):
        gather([np.zeros((2, 2)), np.zeros((2, 3))], Split(0, ((2, 2),)))
