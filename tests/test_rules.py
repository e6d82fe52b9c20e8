"""Every signature every rule offers is checked against the single-device NumPy result."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meta import apply
from models.reference import REFERENCES
from split_state import OPS, PARTIAL, Split, gather, local_shape, scatter
from split_state.ops import localize, signatures
from split_state.rules import choose
from split_state.states import MIRRORED
from tests.op_cases import CHECKED_OPS, assert_matches, case_from_seed, draw_case
from tests.strategies import state_for
from workers.kernels import KERNELS


def test_every_op_has_a_rule_a_kernel_and_an_oracle():
    assert set(OPS) == set(KERNELS)
    assert set(CHECKED_OPS) == set(REFERENCES)
    for name, op in OPS.items():
        assert op.rule is not None and op.infer is not None, name


def partial_parts(rng, x: np.ndarray, n: int) -> list[np.ndarray]:
    """A random decomposition into n addends, so Partial inputs are not just 'all on device 0'."""
    if n == 1 or not np.issubdtype(x.dtype, np.floating):
        return scatter(x, PARTIAL, n)
    if np.array_equal(x, np.round(x)):  # whole numbers (as eq's operands): addends that sum exactly
        parts = [rng.integers(-3, 4, size=x.shape).astype(x.dtype) for _ in range(n - 1)]
    else:
        parts = [rng.standard_normal(x.shape).astype(x.dtype) for _ in range(n - 1)]
    last = x.astype(np.float64) - sum(p.astype(np.float64) for p in parts)
    return parts + [last.astype(x.dtype)]


def run_signature(name, arrays, params, out_shape, sig, n, rng):
    shapes = [a.shape for a in arrays]
    per_input = [
        partial_parts(rng, a, n) if state == PARTIAL else scatter(a, state, n) for a, state in zip(arrays, sig.inputs)
    ]
    outs = []
    for d in range(n):
        local_params = localize(name, params, sig.inputs, shapes, sig.output, out_shape, n, d)
        out = KERNELS[name](np, [locals_[d] for locals_ in per_input], local_params)
        assert out.shape == local_shape(sig.output, out_shape, n, d), (name, str(sig), d)
        outs.append(out)
    return gather(outs, sig.output, check_mirrored=True)


@pytest.mark.parametrize("name", CHECKED_OPS)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 5))
def test_rule_signatures_agree_with_numpy(name, data, n):
    arrays, _, params, expected = draw_case(data, name)
    shapes = [a.shape for a in arrays]
    states = [data.draw(state_for(s, n)) for s in shapes]
    sigs = signatures(name, states, shapes, params, expected.shape)
    if OPS[name].inplace:
        assert sigs and all(s.inputs[0] == states[0] for s in sigs), "an in-place op never moves its destination"
    else:
        assert sigs and sigs[-1].inputs == (MIRRORED,) * len(shapes), "the all-Mirrored fallback is always offered"
    rng = np.random.default_rng(0)
    for sig in sigs:
        got = run_signature(name, arrays, params, expected.shape, sig, n, rng)
        assert_matches(got, expected, f"{name} {sig}")
    chosen, cost = choose(sigs, states, shapes, [4] * len(shapes), n)
    assert chosen in sigs and cost >= 0


def test_matmul_contracting_split_gives_partial_and_free_split_is_kept():
    a, b = (6, 4), (4, 8)
    k = Split.even(1, 4, 2)
    sigs = signatures("matmul", [k, MIRRORED], [a, b], {}, (6, 8))
    assert sigs[0].inputs == (k, k.with_axis(0)) and sigs[0].output == PARTIAL
    col = Split.even(1, 8, 2)
    sigs = signatures("matmul", [MIRRORED, col], [a, b], {}, (6, 8))
    assert sigs[0].output == col


def test_partial_plus_mirrored_is_never_partial_directly():
    sigs = signatures("add", [PARTIAL, MIRRORED], [(3,), (3,)], {}, (3,))
    assert all(not (s.inputs == (PARTIAL, MIRRORED) and s.output == PARTIAL) for s in sigs)
    # the planner turns the Mirrored operand into Partial (a deferred reduce-scatter) rather than
    # all-reducing the Partial one now
    chosen, cost = choose(sigs, [PARTIAL, MIRRORED], [(4,), (4,)], [4, 4], 2)
    assert chosen.inputs == (PARTIAL, PARTIAL) and cost == 2 * 4


def test_linear_op_on_mirrored_inputs_stays_mirrored():
    sigs = signatures("sum", [MIRRORED], [(4, 4)], {"axis": 0, "keepdims": False}, (4,))
    chosen, cost = choose(sigs, [MIRRORED], [(4, 4)], [4], 3)
    assert chosen.output == MIRRORED and cost == 0


def test_nonlinear_op_forces_the_reduction():
    sigs = signatures("gelu", [PARTIAL], [(4,)], {}, (4,))
    assert all(s.inputs != (PARTIAL,) for s in sigs)


def test_reshape_carries_a_head_split():
    # (tokens, heads*dim) split by whole heads -> (tokens, heads, dim) split on heads
    st_in = Split.even(1, 12 * 4, 5, granularity=4)
    sigs = signatures("reshape", [st_in], [(3, 48)], {"shape": (3, 12, 4)}, (3, 12, 4))
    assert sigs[0].output == Split(1, ((3, 3, 2, 2, 2),))


def test_slicing_one_segment_of_a_fused_weight_is_local():
    qkv = Split.even(1, (8, 8, 8), 3, granularity=2)  # (tokens, 3*hidden) split by heads of 2
    x = np.arange(4 * 24, dtype=np.float32).reshape(4, 24)
    for seg, (start, stop) in enumerate([(0, 8), (8, 16), (16, 24)]):
        params = {"axis": 1, "start": start, "stop": stop}
        sigs = signatures("slice", [qkv], [x.shape], params, (4, 8))
        assert sigs[0].inputs == (qkv,) and sigs[0].output == Split(1, (qkv.segments[seg],))
        got = run_signature("slice", [x], params, (4, 8), sigs[0], 3, np.random.default_rng(0))
        assert np.array_equal(got, x[:, start:stop])


# -- a fixed example set: every input state of every op, non-trivial extents --------------------


def uneven_states(size: int, axis: int, n: int = 3) -> list[Split]:
    """An uneven split with an empty middle device, and the same over two segments."""
    first = -(-size // 2)
    out = [Split(axis, ((first,) + (0,) * (n - 2) + (size - first,),))]
    if size >= 4:
        half = size // 2
        out.append(Split(axis, tuple(Split.even(0, s, n).segments[0][::-1] for s in (half, size - half))))
    return out


def nonempty_case(name: str, first_seed: int):
    """The first case from `first_seed` on whose operands all have at least 2 elements per axis."""
    for seed in range(first_seed, first_seed + 1000):
        arrays, params, canon, expected = case_from_seed(seed, name)
        if all(a.ndim and min(a.shape) >= 2 for a in arrays) and expected.size:
            return arrays, params, canon, expected
    raise AssertionError(f"no non-empty case for {name}")


def every_input_state(arrays) -> list[list]:
    """For each input in turn: Mirrored, Partial, and uneven splits on each axis (others Mirrored)."""
    combos = []
    for i, a in enumerate(arrays):
        for state in [PARTIAL] + [s for axis in range(a.ndim) for s in uneven_states(a.shape[axis], axis)]:
            combos.append([state if j == i else MIRRORED for j in range(len(arrays))])
    return combos or [[MIRRORED] * len(arrays)]


@pytest.mark.parametrize("name", CHECKED_OPS)
@pytest.mark.parametrize("first_seed", [0, 500])
def test_every_input_state_of_every_op_on_three_devices(name, first_seed, sim):
    arrays, params, canon, expected = nonempty_case(name, first_seed)
    shapes = [a.shape for a in arrays]
    rng = np.random.default_rng(1)
    dev = sim(3)
    for states in every_input_state(arrays):
        sigs = signatures(name, states, shapes, canon, expected.shape)
        for sig in sigs:  # every signature the rule offers, evaluated per device on the host
            assert_matches(run_signature(name, arrays, canon, expected.shape, sig, 3, rng), expected, f"{name} {sig}")
        handles = []
        for a, s in zip(arrays, states):
            if s == PARTIAL:  # random addends on every device
                parts = partial_parts(rng, a, 3)
                handles.append(dev.from_generator(a.shape, a.dtype, s, lambda d, _, parts=parts: parts[d]))
            else:
                handles.append(dev.tensor(a, s))
        got = apply(name, *handles, **params).numpy()  # what the planner picks, on simulated workers
        assert_matches(got, expected, f"{name} {[str(s) for s in states]}")
        dev.free(*handles)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("split_on", ["heads", "batch"])
def test_set_rows_from_a_fed_batch_start_writes_that_sequence_under_one_plan(sim, n, split_on):
    """A server's slot as a fed 0-d tensor (set_rows' fourth operand): every start writes its
    own batch row under one plan, on a cache split by heads (the decoder's) or by batch rows;
    a start the sequences do not fit after is refused by name. The expected cache is written
    here row by row."""
    from split_state.errors import MetaError

    dev = sim(n)
    batch, heads, ctx, hd = 4, 3, 6, 2
    state = Split.even(1, heads, n) if split_on == "heads" else Split.even(0, batch, n)
    expected = np.zeros((batch, heads, ctx, hd), np.float32)
    cache = dev.tensor(expected.copy(), state)
    rng = np.random.default_rng(n)
    for start in (2, 0, 3, 1):
        ids = np.array([[start % ctx, (start + 2) % ctx]], np.int32)  # (1 sequence, 2 positions)
        value = rng.standard_normal((1, heads, 2, hd)).astype(np.float32)
        cache = cache.set_rows(dev.feed(ids), dev.feed(value), axis=2, batch_start=dev.feed(np.int32(start)))
        for j, position in enumerate(ids[0]):
            expected[start, :, position, :] = value[0, :, j, :]
        np.testing.assert_array_equal(cache.numpy(), expected)
    assert len(dev.plans) == 1
    with pytest.raises(MetaError, match="from batch index 4 do not fit a batch of 4"):
        cache.set_rows(dev.feed(ids), dev.feed(value), axis=2, batch_start=dev.feed(np.int32(4))).numpy()


@pytest.mark.parametrize(
    "state",
    [Split(0, ((32, 32, 32),)), Split(0, ((16, 16, 16), (16, 16, 16))), Split(0, ((40, 0, 56),))],
    ids=["three", "two segments", "an empty device"],
)
def test_many_rows_written_up_to_a_devices_first_row_land_on_that_device(sim, state):
    """set_rows of more rows than a decode step writes (the masked path) on a tensor split along
    the written axis: every run of ids ends exactly on some device's first global row, the row
    that belongs to the next device (or the next segment), and each lands where NumPy's
    assignment puts it."""
    dev = sim(3)
    rows, width = 96, 3
    table = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    boundaries = sorted(set(_chunk_starts(state)) - {0})
    for end in boundaries:
        ids = np.arange(end - 16, end + 1, dtype=np.int32)  # 17 rows, the last on the next device
        value = -np.arange(ids.size * width, dtype=np.float32).reshape(ids.size, width) - 1
        expected = table.copy()
        expected[ids] = value
        x = dev.tensor(table, state)
        got = x.set_rows(dev.tensor(ids), dev.tensor(value), axis=0).numpy()
        np.testing.assert_array_equal(got, expected, err_msg=f"ids {ids[0]}..{ids[-1]}")


def _chunk_starts(state: Split):
    """The global first row of every device's chunk of every segment of `state`."""
    at = 0
    for segment in state.segments:
        for extent in segment:
            yield at
            at += extent
