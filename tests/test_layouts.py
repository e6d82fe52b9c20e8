"""workers/layouts.py against NumPy: a reshape is a view exactly when NumPy makes one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.layouts import contiguous, reshaped, transposed

pytestmark = pytest.mark.timeout(60)


def _factorizations(n: int, most: int = 5) -> list[tuple[int, ...]]:
    """Every way to write n as an ordered product of factors >= 2 (at most `most`)."""
    if n == 1:
        return [()]
    found = []
    for d in range(2, n + 1):
        if n % d == 0:
            found += [(d, *rest) for rest in _factorizations(n // d, most - 1) if len(rest) < most]
    return found


@st.composite
def views(draw):
    """A transposed (and maybe sliced) view of a contiguous array, its layout, and a new shape."""
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=5)))
    axes = draw(st.permutations(range(len(shape))))
    array = np.empty(shape, np.float32)
    view, layout = array.transpose(axes), transposed(contiguous(shape), axes)
    if view.shape[0] > 1 and draw(st.booleans()):  # rows 1.. of the first axis: a slice
        view = view[1:]
        layout = ((view.shape[0], *layout[0][1:]), layout[1])
    new = draw(st.sampled_from(_factorizations(view.size) or [()]))
    ones = draw(st.lists(st.integers(0, len(new)), max_size=2))
    new = list(new)
    for at in ones:  # axes of size 1 anywhere
        new.insert(at, 1)
    return array, view, layout, tuple(new)


@settings(max_examples=400, deadline=None)
@given(views())
def test_a_reshape_is_a_view_exactly_when_numpy_makes_one_with_numpys_strides(case):
    array, view, layout, new = case
    assert layout == (view.shape, tuple(s // 4 for s in view.strides))
    got = reshaped(layout, new)
    made = view.reshape(new)
    assert (got is not None) == np.shares_memory(made, array)
    if got is not None:
        assert got[0] == made.shape
        # strides of axes of size 1 are arbitrary
        assert [s for s, n in zip(got[1], new) if n != 1] == [s // 4 for s, n in zip(made.strides, new) if n != 1]


def test_the_heads_merge_of_a_prefill_copies_and_of_one_token_does_not():
    """The decoder's (batch, kv, group, tokens, hd) attention output, turned back to tokens
    first and merged to (batch, tokens, heads * hd): a copy for 128 tokens, a view for one."""
    for tokens, copies in ((128, True), (1, False)):
        layout = transposed(contiguous((1, 3, 3, tokens, 64)), (0, 3, 1, 2, 4))
        assert (reshaped(layout, (1, tokens, 9 * 64)) is None) == copies


def test_a_reshape_to_a_different_size_is_refused():
    with pytest.raises(ValueError, match="cannot reshape"):
        reshaped(contiguous((2, 3)), (4, 2))
