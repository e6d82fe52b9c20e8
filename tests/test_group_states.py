"""States held by a group of the devices (a layer split's layers): their algebra, and every
redistribution within a group and from one group to another run over in-process queues.

The oracles: hand-written local arrays for the small cases (which device holds what, written
out), and for the sweeps `apply_reference` (gather then scatter through the global array: no
transfer plan shared with the algorithms) plus the bytes each rank really sent against what the
planner charges.
"""

from __future__ import annotations

import numpy as np
import pytest

from split_state import MIRRORED, PARTIAL, Split, SplitError, apply_reference, gather, scatter, select, transition
from split_state.algorithms import Request, grouped
from split_state.layout import local_shape, pieces
from split_state.states import Mirrored, Partial, decode_state, encode_state, restrict, validate
from split_state.transitions import Collective, classify
from tests.test_algorithms import run_on_ranks

pytestmark = pytest.mark.timeout(120)


def test_a_group_is_spelled_once_and_round_trips():
    m, p, s = Mirrored(on=(2, 3)), Partial(on=[0, 2]), Split(1, ((4, 4, 0, 0),), on=(0, 1))
    assert (str(m), str(p), str(s)) == ("M@2,3", "P@0,2", "S1[4|4|0|0]@0,1")
    assert p.on == (0, 2) and eval(repr(s)) == s and eval(repr(m)) == m and repr(MIRRORED) == "Mirrored()"
    for state in (m, p, s, MIRRORED, PARTIAL, Split(0, ((1, 2),))):
        assert decode_state(encode_state(state)) == state
    assert Mirrored(on=(1,)) != MIRRORED and hash(Mirrored(on=(1,))) != hash(Mirrored(on=(2,)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Mirrored(on=()),
        lambda: Mirrored(on=(2, 1)),
        lambda: Partial(on=(1, 1)),
        lambda: Mirrored(on=(-1,)),
        lambda: Mirrored(on="ab"),
        lambda: Split(0, ((2, 2),), on=(0,)),  # device 1 outside the group holds rows
    ],
)
def test_a_malformed_group_is_refused(make):
    with pytest.raises(SplitError):
        make()


def test_validate_refuses_a_group_beyond_the_devices_or_of_all_of_them():
    validate(Mirrored(on=(0, 2)), (4,), 3)
    with pytest.raises(SplitError, match="outside"):
        validate(Mirrored(on=(1, 3)), (4,), 3)
    with pytest.raises(SplitError, match="all of them"):
        validate(Partial(on=(0, 1, 2)), (4,), 3)
    for bad in (["M", [1, "x"]], ["P", 3], ["S", 0, [[1, 1]], [0], 9]):
        with pytest.raises(SplitError):
            decode_state(bad)


def test_devices_outside_the_group_hold_an_empty_tensor():
    s = Split(0, ((0, 3, 2, 0),), on=(1, 2))
    assert [local_shape(s, (5, 7), 4, d) for d in range(4)] == [(0, 0), (3, 7), (2, 7), (0, 0)]
    assert pieces(s, (5, 7), 4, 0) == () and pieces(Mirrored(on=(1,)), (5, 7), 4, 0) == ()
    assert local_shape(Mirrored(on=(3,)), (5, 7), 4, 3) == (5, 7)
    assert local_shape(Partial(on=(0, 3)), (5, 7), 4, 1) == (0, 0)


def test_scatter_and_gather_of_group_states_by_hand():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    locals_ = scatter(x, Split(0, ((0, 3, 1),), on=(1, 2)), 3)
    assert locals_[0].shape == (0, 0)
    np.testing.assert_array_equal(locals_[1], x[:3])
    np.testing.assert_array_equal(locals_[2], x[3:])
    partial = scatter(x, Partial(on=(1, 2)), 3)  # the value on the first holder, zeros on the other
    assert partial[0].shape == (0, 0) and not partial[2].any()
    np.testing.assert_array_equal(partial[1], x)
    empty = np.empty((0, 0), np.float32)
    np.testing.assert_array_equal(gather([empty, x, 2 * x], Partial(on=(1, 2))), 3 * x)
    np.testing.assert_array_equal(gather([empty, empty, x], Mirrored(on=(2,))), x)


def test_restrict_renumbers_over_the_universe():
    assert restrict(Split(1, ((0, 4, 0, 4),), on=(1, 3)), (1, 3)) == Split(1, ((4, 4),))
    assert restrict(Mirrored(on=(3,)), (1, 3)) == Mirrored(on=(1,))
    assert restrict(MIRRORED, (0, 1)) == MIRRORED
    with pytest.raises(SplitError):
        restrict(Mirrored(on=(0, 2)), (1, 2))


def test_a_partial_sum_changes_hands_only_once_reduced():
    moves = [(PARTIAL, Mirrored(on=(0,))), (Partial(on=(0, 1)), Mirrored(on=(2, 3))), (MIRRORED, Partial(on=(1,)))]
    for src, dst in moves:
        with pytest.raises(SplitError, match="reduced on its own devices"):
            grouped(Request(src, dst, (4,), 4, 4))
    assert classify(Mirrored(on=(0, 1)), Mirrored(on=(2, 3))) is Collective.HAND_OVER
    assert classify(MIRRORED, Mirrored(on=(2, 3))) is Collective.LOCAL_SLICE


def test_a_hand_over_sends_one_copy_to_each_new_holder():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    got, sent = run_on_ranks(4, x, Mirrored(on=(0, 1)), Mirrored(on=(2, 3)))
    assert [g.shape for g in got] == [(0, 0), (0, 0), (4, 6), (4, 6)]
    np.testing.assert_array_equal(got[2], x)
    np.testing.assert_array_equal(got[3], x)
    assert sent == [x.nbytes, x.nbytes, 0, 0]  # the givers take turns
    assert transition(Mirrored(on=(0, 1)), Mirrored(on=(2, 3)), x.shape, 4, 4).bytes_per_device == x.nbytes


def test_a_group_all_reduce_moves_nothing_outside_the_group():
    x = np.zeros((3, 5), np.float32)
    parts = [np.empty((0, 0), np.float32), np.full((3, 5), 1.5, np.float32), np.full((3, 5), 2.0, np.float32)]
    got, sent = run_on_ranks(3, x, Partial(on=(1, 2)), Mirrored(on=(1, 2)), parts)
    assert got[0].shape == (0, 0) and sent[0] == 0
    for g in got[1:]:
        np.testing.assert_array_equal(g, np.full((3, 5), 3.5, np.float32))


def group_states(shape: tuple[int, ...], n: int) -> list:
    """States on the whole cluster and on groups of it: halves, a lone device, overlapping."""
    rows = shape[0]
    low, high = tuple(range(n // 2)), tuple(range(n // 2, n))
    out = [MIRRORED, Split.even(0, rows, n)]
    for group in (low, high, (n - 1,), tuple(range(1, n))):
        if not group or len(group) == n:
            continue
        extents = [0] * n
        for i, d in enumerate(group):
            extents[d] = rows // len(group) + (i < rows % len(group))
        out += [Mirrored(on=group), Split(0, (tuple(extents),), on=group), Partial(on=group)]
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_redistribution_between_groups_matches_the_reference_and_its_charge(n):
    rng = np.random.default_rng(n)
    shape = (7, 8)
    x = rng.standard_normal(shape).astype(np.float32)
    checked = 0
    for src in group_states(shape, n):
        for dst in group_states(shape, n):
            partial = isinstance(src, Partial) or isinstance(dst, Partial)
            if partial and src.on != dst.on:
                continue  # the planner reduces on the source's group first (tested above)
            parts = None
            if isinstance(src, Partial):
                parts = [rng.standard_normal(local_shape(src, shape, n, d)).astype(np.float32) for d in range(n)]
            locals_ = parts if parts is not None else scatter(x, src, n)
            got, sent = run_on_ranks(n, x, src, dst, parts)
            what = f"{src} -> {dst} on {n}"
            expected = apply_reference(locals_, src, dst)
            for d in range(n):
                assert got[d].shape == expected[d].shape, what
                if isinstance(dst, Partial):  # any split of the same sum will do
                    continue
                np.testing.assert_array_equal(got[d], expected[d], err_msg=what)
            if isinstance(dst, Partial):
                np.testing.assert_array_equal(gather(got, dst), gather(expected, dst), err_msg=what)
            devices, inner = grouped(Request(src, dst, shape, n, 4))
            charged = select(inner).sent(inner)
            if devices is not None:
                charged = tuple(charged[devices.index(d)] if d in devices else 0 for d in range(n))
            assert tuple(sent) == charged, what
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_redistribution_between_states_of_one_lone_holder_moves_nothing(n):
    """`moves_nothing` (a worker drops such steps from its program) is sound for every pair of
    states: where it says so, every device's local tensor is the same before and after (the
    oracle: scatter through the global array). And it says so for any two states held by the
    same lone device (Split, Mirrored or Partial there: the whole tensor on it, in order): a
    layer split with one worker a group has ~120 such steps in a SmolLM2 decode step."""
    from split_state.algorithms import moves_nothing

    shape = (2 * n + 1, 3)
    x = np.random.default_rng(n).standard_normal(shape).astype(np.float32)
    lone = n - 1
    states = group_states(shape, n) + [Split(0, ((0,) * lone + (3,), (0,) * lone + (2 * n - 2,)), on=(lone,))]
    for src in states:
        for dst in states:
            if isinstance(src, Partial) and isinstance(dst, Partial) and src.on != dst.on:
                continue  # refused: a partial sum changes holders only once reduced (above)
            before, after = scatter(x, src, n), scatter(x, dst, n)
            same = all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(before, after))
            if moves_nothing(src, dst, n):
                assert same, (src, dst)
            if src.on == dst.on == (lone,):
                assert moves_nothing(src, dst, n), (src, dst)
