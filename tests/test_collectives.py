"""Every transition run by real collectives equals the host reference, bit for bit."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from split_state import MIRRORED, PARTIAL, Split, apply_reference, scatter
from split_state.scatter import check_identical
from tests.strategies import state_for
from transport import protocol as p
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(120)


def addends(shape, n, dtype, seed=0) -> list[np.ndarray]:
    """Random contributions, one per device: a Partial tensor whose every device matters."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 10).astype(dtype) for _ in range(n)]


def rank_order_sum(parts) -> np.ndarray:
    """((p0 + p1) + p2) + ... in the parts' dtype: the bits every reduction must produce."""
    total = parts[0].copy()
    for part in parts[1:]:
        total = (total + part).astype(parts[0].dtype)
    return total


def expected_locals(locals_, src, dst):
    """Every device's expected result: a Partial source is summed here in rank order; other
    sources go through the host reference (gather, then scatter)."""
    n = len(locals_)
    if src != PARTIAL or dst == PARTIAL:
        return apply_reference(locals_, src, dst)
    return scatter(rank_order_sum(locals_), dst, n)


def inputs_for(x, src, n, seed=0):
    """Local arrays of `x` in `src`; for Partial, random addends on every device."""
    return addends(x.shape, n, x.dtype, seed) if src == PARTIAL else scatter(x, src, n)


def run_transition(call_all, n, x, src, dst, program=1, run=1):
    """Put `x` in `src` (Partial: random addends), run one MoveStep to `dst`, return every worker's
    local inputs and results."""
    dtype = str(x.dtype)
    locals_ = inputs_for(x, src, n, seed=program)
    call_all({d: p.Put(100 + program, src, x.shape, locals_[d]) for d in range(n)})
    step = p.MoveStep(0, 1, src, dst, x.shape, dtype)
    call_all({d: p.LoadProgram(program, [step]) for d in range(n)})
    replies = call_all({d: p.RunProgram(program, run, [[0, 100 + program]], [[1, 200 + program]]) for d in range(n)})
    assert all(isinstance(r, p.Ok) for r in replies.values()), replies
    got = call_all({d: p.Get(200 + program) for d in range(n)})
    return locals_, [np.asarray(got[d].array) for d in range(n)]


def assert_bitwise(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert np.array_equal(g.reshape(-1).view(np.uint8), e.reshape(-1).view(np.uint8))


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 5),
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(["float32", "float16", "int32"]),
)
def test_simulated_collectives_match_the_reference_bitwise(data, n, shape, dtype):
    src = data.draw(state_for(shape, n))
    dst = data.draw(state_for(shape, n))
    x = (np.random.default_rng(0).standard_normal(shape) * 10).astype(dtype)
    cluster = SimulatedCluster(n)
    try:
        locals_, got = run_transition(cluster.call_all, n, x, src, dst)
    finally:
        cluster.close()
    assert_bitwise(got, expected_locals(locals_, src, dst))
    if dst == MIRRORED:
        check_identical(got)


def test_large_all_reduce_uses_ring_phases_and_stays_identical():
    n = 4
    cluster = SimulatedCluster(n)
    try:
        x = np.random.default_rng(1).standard_normal((64, 300)).astype(np.float32)  # 76 KiB > direct limit
        parts = [np.random.default_rng(d).standard_normal(x.shape).astype(np.float32) for d in range(n)]
        call = cluster.call_all
        call({d: p.Put(1, PARTIAL, x.shape, parts[d]) for d in range(n)})
        call({d: p.LoadProgram(1, [p.MoveStep(0, 1, PARTIAL, MIRRORED, x.shape, "float32")]) for d in range(n)})
        call({d: p.RunProgram(1, 1, [[0, 1]], [[1, 2]]) for d in range(n)})
        got = [np.asarray(call({d: p.Get(2)})[d].array) for d in range(n)]
    finally:
        cluster.close()
    check_identical(got)
    assert_bitwise([got[0]], [rank_order_sum(parts)])


CASES = [
    (PARTIAL, MIRRORED),
    (PARTIAL, "uneven"),
    ("uneven", MIRRORED),
    ("uneven", "other_axis"),
    ("segments", "uneven"),
    (MIRRORED, "segments"),
    ("zero", MIRRORED),
    ("uneven", PARTIAL),
]


def resolve(name, n, shape):
    if not isinstance(name, str):
        return name
    if name == "uneven":
        return Split(0, (tuple([shape[0] - (n - 1)] + [1] * (n - 1)),))
    if name == "other_axis":
        return Split.even(1, shape[1], n)
    if name == "segments":
        half = shape[0] // 2
        return Split(0, (Split.even(0, half, n).segments[0], Split.even(0, shape[0] - half, n).segments[0]))
    if name == "zero":
        return Split(0, (tuple([shape[0]] + [0] * (n - 1)),))
    raise ValueError(name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[1]}")
@pytest.mark.parametrize(
    "devname", ["procs2", "procs3", "procs3_zmq", "procs3_tcp", "cuda3", "cuda3_shm", "cuda_nccl2"]
)
def test_process_collectives_match_reference_and_simulator(case, devname, request):
    dev = request.getfixturevalue(devname)
    plane = {"procs3_zmq": "zmq", "procs3_tcp": "tcp", "cuda_nccl2": "nccl", "cuda3": "ipc"}.get(devname, "shm")
    assert {d["data_plane"] for d in dev.cluster.data_planes} == {plane}
    n = dev.n
    shape = (7, 5)
    src, dst = (resolve(c, n, shape) for c in case)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    program = 1000 + CASES.index(case)
    locals_, got = run_transition(dev.cluster.call_all, n, x, src, dst, program=program, run=program)
    assert_bitwise(got, expected_locals(locals_, src, dst))
    sim = SimulatedCluster(n)
    try:
        _, sim_got = run_transition(sim.call_all, n, x, src, dst, program=program, run=program)
    finally:
        sim.close()
    assert_bitwise(got, sim_got)


@pytest.mark.parametrize("n, data_plane", [(1, "shm"), (4, "shm"), (5, "shm"), (5, "tcp")])
def test_every_case_on_one_four_and_five_processes(n, data_plane, fresh_cluster):
    """The cases above on the remaining world sizes, each on one cluster (shared memory; five
    workers over the tcp plane too)."""
    cluster = fresh_cluster(n, data_plane=data_plane)
    assert {d["data_plane"] for d in cluster.data_planes} == {data_plane if n > 1 else "zmq"}
    shape = (7, 5)
    x = np.random.default_rng(n).standard_normal(shape).astype(np.float32)
    for index, case in enumerate(CASES):
        src, dst = (resolve(c, n, shape) for c in case)
        locals_, got = run_transition(cluster.call_all, n, x, src, dst, program=index + 1, run=index + 1)
        assert_bitwise(got, expected_locals(locals_, src, dst))
    big = np.random.default_rng(0).standard_normal((64, 300)).astype(np.float32)  # two-phase all-reduce
    locals_, got = run_transition(cluster.call_all, n, big, PARTIAL, MIRRORED, program=99, run=99)
    assert_bitwise(got, [rank_order_sum(locals_)] * n)
    check_identical(got)


def test_a_program_reloaded_under_its_id_runs_its_new_steps():
    """Workers prepare each collective step once per loaded program: loading another program
    under the same id (or reconfiguring) must not run the old preparation."""
    n = 2
    cluster = SimulatedCluster(n)
    try:
        call = cluster.call_all
        parts = addends((4,), n, np.float32)
        call({d: p.Put(1, PARTIAL, (4,), parts[d]) for d in range(n)})
        call({d: p.LoadProgram(7, [p.MoveStep(0, 1, PARTIAL, MIRRORED, (4,), "float32")]) for d in range(n)})
        call({d: p.RunProgram(7, 1, [[0, 1]], [[1, 2]]) for d in range(n)})
        assert_bitwise([np.asarray(call({0: p.Get(2)})[0].array)], [rank_order_sum(parts)])
        x = np.arange(6, dtype=np.float32)
        split = Split.even(0, 6, n)
        call({d: p.Put(3, split, x.shape, scatter(x, split, n)[d]) for d in range(n)})
        call({d: p.LoadProgram(7, [p.MoveStep(0, 1, split, MIRRORED, (6,), "float32")]) for d in range(n)})
        call({d: p.RunProgram(7, 2, [[0, 3]], [[1, 4]]) for d in range(n)})
        assert all(np.array_equal(np.asarray(call({d: p.Get(4)})[d].array), x) for d in range(n))
    finally:
        cluster.close()


def test_a_collective_on_a_slot_of_another_dtype_names_both():
    n = 2
    cluster = SimulatedCluster(n)
    try:
        call = cluster.call_all
        call({d: p.Put(1, PARTIAL, (4,), np.ones(4, np.int32)) for d in range(n)})
        call({d: p.LoadProgram(1, [p.MoveStep(0, 1, PARTIAL, MIRRORED, (4,), "float32")]) for d in range(n)})
        replies = call({d: p.RunProgram(1, 1, [[0, 1]], [[1, 2]]) for d in range(n)})
        assert all(isinstance(r, p.Error) and "int32" in r.message and "float32" in r.message for r in replies.values())
    finally:
        cluster.close()


@pytest.mark.parametrize("devname", ["procs3", "procs3_zmq", "procs3_tcp", "zmq2"])
def test_all_reduces_inside_a_program_write_its_arena_run_after_run(devname, request, fresh_cluster):
    """All-reduces of products of the program, whose results a later step reads: on every host
    plane they write into the program's arena and what they send lies there too, the second
    product where the first one was once it was sent. Each run's sum is its own inputs'. Three
    workers take the two-phase all-reduce (1.5 MiB: pieces of 512 KiB); two over ZeroMQ the
    direct one, whose worker may go on while its peer still takes its 1.5 MiB, which ZeroMQ sends
    from the arena itself: written over by the next product, the peer summed that."""
    if devname == "zmq2":
        call, n = fresh_cluster(2, data_plane="zmq").call_all, 2
    else:
        dev = request.getfixturevalue(devname)
        call, n = dev.cluster.call_all, dev.n
    shape = (384, 1024)
    steps = [
        p.OpStep("scale", (0,), 5, {"factor": 2.0}, shape, "float32"),
        p.MoveStep(5, 2, PARTIAL, MIRRORED, shape, "float32"),
        p.OpStep("scale", (1,), 6, {"factor": 2.0}, shape, "float32"),
        p.MoveStep(6, 3, PARTIAL, MIRRORED, shape, "float32"),
        p.OpStep("add", (2, 3), 4, {}, shape, "float32"),
    ]
    call({d: p.LoadProgram(77, steps) for d in range(n)})
    for run in range(4):
        a, b = addends(shape, n, np.float32, seed=2 * run), addends(shape, n, np.float32, seed=2 * run + 1)
        call({d: p.Put(301, PARTIAL, shape, a[d]) for d in range(n)})
        call({d: p.Put(302, PARTIAL, shape, b[d]) for d in range(n)})
        replies = call({d: p.RunProgram(77, 7700 + run, [[0, 301], [1, 302]], [[4, 303]]) for d in range(n)})
        assert all(isinstance(r, p.Ok) for r in replies.values()), replies
        got = call({d: p.Get(303) for d in range(n)})
        expected = rank_order_sum([2 * x for x in a]) + rank_order_sum([2 * x for x in b])
        assert_bitwise([np.asarray(got[d].array) for d in range(n)], [expected] * n)
    call({d: p.Unload([77]) for d in range(n)})
    call({d: p.Free([301, 302, 303]) for d in range(n)})
