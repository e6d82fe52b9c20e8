"""End to end through the MetaDevice: every op and input state against NumPy, collective counts,
every state writable and readable, redistribution between any two states, plan caching."""

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.operands import random_case, random_operands
from meta import MetaDevice, apply, get_rows
from models.reference import gelu_tanh, reference
from split_state import MIRRORED, PARTIAL, Collective, Split
from split_state.errors import ShapeError
from split_state.ops import infer
from tests.op_cases import CHECKED_OPS, assert_matches, draw_case, seeds
from tests.strategies import state_for
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(300)


def check_op(dev, name, data):
    arrays, params, _, expected = draw_case(data, name)
    states = [data.draw(state_for(a.shape, dev.n)) for a in arrays]
    handles = [dev.tensor(a, s) for a, s in zip(arrays, states)]
    assert_matches(apply(name, *handles, **params).numpy(), expected, f"{name} {states}")
    dev.free(*handles)


@pytest.mark.parametrize("name", CHECKED_OPS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(1, 8))
def test_every_op_and_state_on_the_simulator(name, data, n):
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        check_op(dev, name, data)
    finally:
        dev.close()


@pytest.mark.parametrize("name", CHECKED_OPS)
@pytest.mark.parametrize("devname", ["procs2", "procs3", "cuda2", "cuda3", "cuda_nccl2"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_op_on_worker_processes(name, devname, data, request):
    check_op(request.getfixturevalue(devname), name, data)


@pytest.mark.parametrize("name", CHECKED_OPS)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_op_replayed_with_new_operands_equals_numpy_every_run(name, data, cuda2):
    """Every op in a captured step replayed with new operands of the same shapes and states,
    against the NumPy reference each run. On CUDA a step's kernels run eagerly, then are captured,
    then replay as device graphs with the new operands copied in: the op's result is cast to
    float64 so that it is an intermediate (a program's outputs are its own array each run and
    never captured), as every op of a decode step is."""
    seed = data.draw(seeds, label="case seed")
    rng = np.random.default_rng(seed)
    shapes, dtypes, params = random_case(rng, name)
    canon = infer(name, shapes, dtypes, params)[2]
    states = [data.draw(state_for(shape, cuda2.n)) for shape in shapes]

    def operands():
        arrays = random_operands(rng, name, shapes, dtypes, params)
        return [cuda2.tensor(a, s) for a, s in zip(arrays, states)], reference(name, arrays, canon)

    handles, expected = operands()
    step, (out,) = cuda2.capture(lambda *xs: [apply("cast", apply(name, *xs, **params), dtype="float64")], *handles)
    for run in range(5):  # the capture's run, then four replays: eager, captured, replayed twice
        if run:
            cuda2.free(*handles)
            handles, expected = operands()
            (out,) = step(*handles)
        got = out.numpy()
        assert got.dtype == np.float64  # its own dtype back below, exactly: every dtype casts up exactly
        assert_matches(got.astype(expected.dtype), expected, f"{name} {states}, run {run}")
    cuda2.free(*handles)


@pytest.mark.parametrize("name", CHECKED_OPS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 8))
def test_the_planners_remembered_choice_is_the_one_made_afresh(name, data, n):
    """The planner remembers each op's signature by what it depends on (a decoder repeats every
    layer's choices); after many other draws, a remembered choice is still the fresh one."""
    from meta.planner import _choice
    from split_state.dtypes import dtype_from_name
    from split_state.ops import infer, signatures
    from split_state.rules import choose

    arrays, params, _, _ = draw_case(data, name)
    states = tuple(data.draw(state_for(a.shape, n)) for a in arrays)
    shapes = tuple(a.shape for a in arrays)
    dtypes = tuple(str(a.dtype) for a in arrays)
    out_shape = infer(name, shapes, dtypes, params)[0]
    plane = data.draw(st.sampled_from(["", "shm", "nccl"]))
    fresh, _ = choose(
        signatures(name, list(states), list(shapes), params, out_shape),
        states,
        shapes,
        [dtype_from_name(d).itemsize for d in dtypes],
        n,
        dtypes,
        plane,
    )
    assert _choice(name, params, out_shape, states, shapes, dtypes, n, plane).sig == fresh
    assert _choice(name, params, out_shape, states, shapes, dtypes, n, plane).sig == fresh  # remembered


@pytest.mark.parametrize("name", CHECKED_OPS)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_a_remembered_inference_is_the_one_made_afresh(name, data):
    """Recording an op remembers what `infer` said for its parameters, input shapes and dtypes
    (a decoder's layers ask the same); recorded twice, among other draws, it is what `infer`
    says afresh."""
    from split_state.ops import infer

    arrays, params, _, _ = draw_case(data, name)
    dev = MetaDevice(SimulatedCluster(1))
    try:
        inputs = [dev.tensor(a) for a in arrays]
        shape, dtype, canon = infer(name, [a.shape for a in arrays], [str(a.dtype) for a in arrays], params)
        for _ in range(2):
            node = apply(name, *inputs, **params).node
            assert (node.shape, node.dtype, node.params) == (tuple(shape), dtype, canon)
    finally:
        dev.close()


def test_inferences_differ_by_dtype_and_by_the_type_of_a_parameter(sim):
    """What makes two recordings share an inference: equal parameters of the same types, input
    shapes and dtypes; an int32 input, or an axis 1.0 or True where 1 was, is another question."""
    dev = sim(1)
    f, i = dev.tensor(np.ones((2, 3), np.float32)), dev.tensor(np.ones((2, 3), np.int32))
    assert (f + f).node.dtype == "float32" and (i + i).node.dtype == "int32"
    assert (f + f).node.dtype == "float32"
    assert apply("sum", f, axis=1).shape == (2,)  # the very question, bar the parameter's type
    for wrong in (1.0, True):  # equal to 1 in Python, and refused afresh: refused after 1 was taken too
        with pytest.raises(ShapeError, match="out of range"):
            apply("sum", f, axis=wrong)


@pytest.mark.parametrize("n", [1, 3])
def test_each_devices_program_is_its_plan_localised_afresh(sim, n):
    """The compiler works out each remembered choice's parameters and shape once per device
    (a decoder's layers share them): every step of every device's program is still what
    localising that step of the plan afresh gives, for two layers of uneven splits, an in-place
    write and a top-k, over two compilations."""
    from meta.compiler import compile_plan
    from meta.graph import topo_order
    from meta.planner import plan
    from split_state.layout import local_shape
    from split_state.ops import localize
    from transport.protocol import OpStep

    dev = sim(n)
    cols = Split(1, ((5, 0, 3) if n == 3 else (8,),))
    x = dev.tensor(np.ones((2, 6), np.float32))
    cache = dev.tensor(np.zeros((4, 8), np.float32), Split(1, cols.segments))
    for layer in range(2):
        w = dev.tensor(np.ones((6, 8), np.float32), cols)
        h = (x @ w).relu()
        cache = cache.set_rows(dev.feed(np.array([layer, layer + 1], np.int32)), h, axis=0)
        x = (h @ dev.tensor(np.ones((8, 6), np.float32), Split(0, cols.segments))).relu()
    outputs = [t.node for t in (*x.top_k(2), cache)]
    leaves, order = topo_order(outputs)
    planned = plan(leaves, order, outputs, n)
    for _ in range(2):
        programs = compile_plan(planned, n)
        for d, program in enumerate(programs):
            ops = [s for s in program if isinstance(s, OpStep)]
            glob = [s for s in planned.steps if isinstance(s, OpStep)]
            assert len(ops) == len(glob)
            for mine, step in zip(ops, glob):
                in_states = tuple(planned.states[v] for v in step.inputs)
                in_shapes = tuple(planned.shapes[v] for v in step.inputs)
                out_state = planned.states[step.output]
                params = localize(step.op, step.params, in_states, in_shapes, out_state, step.shape, n, d)
                assert mine.params == params, (d, step.op)
                assert tuple(mine.shape) == local_shape(out_state, tuple(step.shape), n, d), (d, step.op)
                same = (mine.op, mine.inputs, mine.output, mine.dtype)
                assert same == (step.op, step.inputs, step.output, step.dtype)


# -- worked examples: tensor-parallel MLP and attention -----------------------------------------


def mlp(dev, x, w_up, w_down):
    """Column-parallel up-projection, row-parallel down-projection: one all-reduce."""
    n = dev.n
    up = dev.tensor(w_up, Split.even(1, w_up.shape[1], n), name="w_up")
    down = dev.tensor(w_down, Split.even(0, w_down.shape[0], n), name="w_down")
    return ((dev.tensor(x, name="x") @ up).gelu() @ down).redistribute(MIRRORED)


def attention(dev, x, w_qkv, w_o, mask, heads):
    """Fused QKV weight as 3 segments split by whole heads; heads local; output row-parallel."""
    tokens, hidden = x.shape
    hd = hidden // heads
    qkv_w = dev.tensor(w_qkv, Split.even(1, (hidden, hidden, hidden), dev.n, granularity=hd), name="w_qkv")
    o_w = dev.tensor(w_o, Split.even(0, hidden, dev.n, granularity=hd), name="w_o")
    qkv = dev.tensor(x, name="x") @ qkv_w  # (tokens, 3*hidden) segmented by heads

    def heads_first(t):  # (tokens, hidden) -> (heads, tokens, hd)
        return t.reshape(tokens, heads, hd).transpose(1, 0, 2)

    q, k, v = (heads_first(qkv[:, i * hidden : (i + 1) * hidden]) for i in range(3))
    scores = (q @ k.transpose(0, 2, 1)) * (1.0 / np.sqrt(hd)) + dev.tensor(mask, name="mask")
    ctx = scores.softmax(-1) @ v  # (heads, tokens, hd), heads split
    merged = ctx.transpose(1, 0, 2).reshape(tokens, hidden)
    return (merged @ o_w).redistribute(MIRRORED)


def attention_reference(x, w_qkv, w_o, mask, heads):
    tokens, hidden = x.shape
    hd = hidden // heads
    qkv = x @ w_qkv
    q, k, v = (qkv[:, i * hidden : (i + 1) * hidden].reshape(tokens, heads, hd).transpose(1, 0, 2) for i in range(3))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return (s @ v).transpose(1, 0, 2).reshape(tokens, hidden) @ w_o


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_mlp_emits_exactly_one_all_reduce(sim, n):
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in [(5, 8), (8, 12), (12, 8)])
    dev = sim(n)
    got = mlp(dev, x, w1, w2).numpy()
    np.testing.assert_allclose(got, gelu_tanh(x @ w1) @ w2, rtol=1e-4, atol=1e-4)
    assert dev.last_plan.collectives() == ([Collective.ALL_REDUCE] if n > 1 else [])


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_attention_with_heads_split_emits_exactly_one_all_reduce(sim, n):
    rng = np.random.default_rng(1)
    tokens, hidden, heads = 6, 12, 6
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w_qkv = rng.standard_normal((hidden, 3 * hidden)).astype(np.float32)
    w_o = rng.standard_normal((hidden, hidden)).astype(np.float32)
    mask = np.triu(np.full((tokens, tokens), -1e9, np.float32), 1)
    dev = sim(n)
    got = attention(dev, x, w_qkv, w_o, mask, heads).numpy()
    np.testing.assert_allclose(got, attention_reference(x, w_qkv, w_o, mask, heads), rtol=1e-4, atol=1e-4)
    assert dev.last_plan.collectives() == ([Collective.ALL_REDUCE] if n > 1 else [])


def test_attention_on_three_processes(procs3):
    rng = np.random.default_rng(2)
    tokens, hidden, heads = 5, 8, 4
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w_qkv = rng.standard_normal((hidden, 3 * hidden)).astype(np.float32)
    w_o = rng.standard_normal((hidden, hidden)).astype(np.float32)
    mask = np.zeros((tokens, tokens), np.float32)
    got = attention(procs3, x, w_qkv, w_o, mask, heads).numpy()
    np.testing.assert_allclose(got, attention_reference(x, w_qkv, w_o, mask, heads), rtol=1e-4, atol=1e-4)
    assert procs3.last_plan.count(Collective.ALL_REDUCE) == 1


def test_chain_of_linear_ops_on_partial_reduces_once_at_the_end(sim):
    dev = sim(3)
    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(3))
    pa = dev.tensor(a, PARTIAL)
    out = ((pa * 2.0 + dev.tensor(b)) - dev.tensor(c, PARTIAL)).T.reshape(16) * -1.0
    lazy = out.redistribute(MIRRORED)
    np.testing.assert_allclose(lazy.numpy(), -((a * 2 + b) - c).T.reshape(16), rtol=1e-5, atol=1e-5)
    assert dev.last_plan.collectives() == [Collective.ALL_REDUCE]


def test_nonlinear_consumer_forces_the_reduction(sim):
    dev = sim(2)
    x = np.linspace(-2, 2, 8, dtype=np.float32)
    y = dev.tensor(x, PARTIAL).gelu()
    np.testing.assert_allclose(y.numpy(), gelu_tanh(x), rtol=1e-6)
    assert len(dev.last_plan.collectives()) == 1


# -- states ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(1, 6), shape=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple))
def test_every_state_writes_reads_and_redistributes_to_every_other(data, n, shape):
    src = data.draw(state_for(shape, n))
    dst = data.draw(state_for(shape, n))
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        t = dev.tensor(x, src)
        assert t.state == src and np.array_equal(t.numpy(), x)
        moved = t.redistribute(dst)
        assert np.array_equal(moved.numpy(), x) and moved.state == dst
    finally:
        dev.close()


def test_generator_placement_never_builds_the_whole_weight(sim):
    dev = sim(3)
    state = Split.even(0, 10, 3)
    seen = []

    def make(device, pieces):
        seen.append((device, [(p.global_start, p.global_stop) for p in pieces]))
        rows = [np.arange(p.global_start, p.global_stop, dtype=np.float32) for p in pieces]
        return np.concatenate(rows)[:, None] * np.ones((1, 4), np.float32)

    t = dev.from_generator((10, 4), np.float32, state, make)
    assert seen == [(0, [(0, 4)]), (1, [(4, 7)]), (2, [(7, 10)])]
    assert np.array_equal(t.numpy(), np.arange(10, dtype=np.float32)[:, None] * np.ones((1, 4)))


def test_placement_policy_chooses_weight_states(sim):
    def policy(name, shape):
        return Split.even(1, shape[1], 2) if name.startswith("w") else None

    dev = sim(2, policy=policy)
    w = dev.tensor(np.ones((3, 4), np.float32), name="w_up")
    b = dev.tensor(np.ones((4,), np.float32), name="bias")
    assert w.state == Split.even(1, 4, 2) and b.state == MIRRORED


def test_repeated_step_reuses_the_cached_plan(sim):
    dev = sim(2)
    w = dev.tensor(np.eye(4, dtype=np.float32), Split.even(1, 4, 2))
    for i in range(3):
        y = (dev.tensor(np.full((2, 4), i, np.float32)) @ w).relu()
        assert np.array_equal(y.numpy(), np.full((2, 4), i, np.float32))
    assert len(dev.plans) == 1


def test_debug_trace_prints_states_and_collectives():
    out = io.StringIO()
    dev = MetaDevice(SimulatedCluster(2), debug=True, trace_to=out)
    try:
        x = dev.tensor(np.ones((2, 4), np.float32), name="x")
        w = dev.tensor(np.ones((4, 2), np.float32), Split.even(0, 4, 2), name="w")
        (x @ w).gelu().numpy()
    finally:
        dev.close()
    text = out.getvalue()
    assert "(x:M, w:S0[2|2])" not in text  # x is sliced locally first
    assert "-> matmul -> P" in text and "all_reduce" in text and "-> gelu -> M" in text


def test_get_rows_with_split_table_is_partial(sim):
    dev = sim(3)
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    t = dev.tensor(table, Split.even(0, 10, 3))
    ids = dev.tensor(np.array([[9, 0], [4, 4]], np.int32))
    rows = get_rows(t, ids)
    rows.realize()
    assert rows.state == PARTIAL
    assert np.array_equal(rows.numpy(), table[[[9, 0], [4, 4]]])


def test_partial_divided_by_zero_stays_inf(sim):
    """x / 0 is inf on one device; with Partial x the division must not run per addend (0 / 0 = NaN
    on devices holding other addends, inf - inf = NaN in the sum)."""
    dev = sim(3)
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(3)]
    total = (parts[0] + parts[1]) + parts[2]
    divisor = np.where(np.arange(5) % 2 == 0, 0.0, 2.0).astype(np.float32)
    x = dev.from_generator((4, 5), np.float32, PARTIAL, lambda d, pieces: parts[d])  # real addends
    got = (x / dev.tensor(divisor)).numpy()
    with np.errstate(divide="ignore"):
        assert np.array_equal(np.isinf(got), np.isinf(total / divisor)) and not np.isnan(got).any()
    np.testing.assert_allclose(got[:, 1::2], total[:, 1::2] / 2.0, rtol=1e-6)
    assert np.array_equal(np.sign(got[:, ::2]), np.sign(total[:, ::2]))


def test_a_collectives_result_handed_out_by_a_replayed_step_stays_each_runs_own(cuda_nccl2):
    """Over NCCL a step's collectives replay inside its device graph, but one whose result the
    step hands out (an all-reduce to Mirrored as the output) stays outside it: a graph writes the
    same memory at every replay, so each run's result would be the last run's. Every run's result
    is read after all the runs, against NumPy."""
    dev = cuda_nccl2
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    weight = dev.tensor(w, Split(0, ((4, 4),)))

    def build(x):
        return [(x @ weight).redistribute(MIRRORED)]  # partial sums, all-reduced: the output

    xs = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(5)]
    handles = [dev.tensor(x, Split(1, ((4, 4),))) for x in xs]
    step, (first,) = dev.capture(build, handles[0])
    outs = [first] + [step(h)[0] for h in handles[1:]]  # eager, captured, replayed twice
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_allclose(out.numpy(), x @ w, rtol=1e-5, atol=1e-5)
