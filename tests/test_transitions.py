import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from split_state import MIRRORED, PARTIAL, Collective, Split, apply_reference, gather, scatter, transition
from split_state.scatter import check_identical
from tests.strategies import devices, dtypes, random_array, shapes, state_for


@settings(max_examples=300, deadline=None)
@given(data=st.data(), shape=shapes, n=st.integers(1, 6), dtype=dtypes)
def test_every_transition_preserves_the_global_value(data, shape, n, dtype):
    src = data.draw(state_for(shape, n))
    dst = data.draw(state_for(shape, n))
    rng = np.random.default_rng(1)
    if src == PARTIAL:  # random addends on every device; the value is their rank-order sum
        locals_ = [random_array(rng, shape, dtype) for _ in range(n)]
        x = locals_[0].copy()
        for part in locals_[1:]:
            x = (x + part).astype(x.dtype)
    else:
        x = random_array(rng, shape, dtype)
        locals_ = scatter(x, src, n)
    out = apply_reference(locals_, src, dst)
    if dst == MIRRORED:
        check_identical(out)
    assert np.array_equal(gather(out, dst).view(np.uint8), x.view(np.uint8))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), shape=shapes, n=devices)
def test_costs_are_zero_for_local_transitions_and_never_negative(data, shape, n):
    src = data.draw(state_for(shape, n))
    dst = data.draw(state_for(shape, n))
    t = transition(src, dst, shape, n, 4)
    assert t.bytes_per_device >= 0
    if t.kind in (Collective.NONE, Collective.LOCAL_SLICE) or n == 1:
        assert t.bytes_per_device == 0


@pytest.mark.parametrize(
    "src, dst, kind, cost",
    [
        (Split(0, ((4, 4),)), MIRRORED, Collective.ALL_GATHER, 4 * 4 * 4),
        (PARTIAL, MIRRORED, Collective.ALL_REDUCE, 2 * 16 * 4),  # 2T(p-1)/p with T = 32 elements
        (PARTIAL, Split(0, ((4, 4),)), Collective.REDUCE_SCATTER, 16 * 4),
        (Split(0, ((4, 4),)), Split(1, ((2, 2),)), Collective.ALL_TO_ALL, 8 * 4),  # a quarter of T leaves each device
        (MIRRORED, Split(1, ((3, 1),)), Collective.LOCAL_SLICE, 0),
        (MIRRORED, PARTIAL, Collective.LOCAL_EMBED, 16 * 4),  # charged the reduction it defers
    ],
)
def test_transition_kinds_and_exact_costs_on_two_devices(src, dst, kind, cost):
    t = transition(src, dst, (8, 4), 2, 4)
    assert (t.kind, t.bytes_per_device) == (kind, cost)


def test_resegmenting_is_an_exchange():
    t = transition(Split(0, ((3, 1),)), Split(0, ((2, 2),)), (4, 1), 2, 4)
    assert t.kind is Collective.ALL_TO_ALL and t.bytes_per_device == 4
