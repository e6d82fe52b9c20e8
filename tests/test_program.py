"""Programs compiled at load (workers/program.py): intermediates planned in one arena by
liveness and reused across runs, results that outlive the run, the arena charged at load and
shared by every loaded program, profiling on request, and what adding an op takes."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from meta import MetaDevice, apply
from split_state import MIRRORED, OPS, PARTIAL, OutOfMemory, Split
from split_state.ops import OpSpec, _infer_unary_float, _unary_rule
from tests.test_memory import affine_chain
from transport.protocol import MoveStep, Unload
from workers.arena import aligned
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(60)
SIZE = 16 << 10  # float32 elements of the test arrays: 64 KiB


def arena_bytes(dev) -> list[int]:
    return [s["arena"] for s in dev.stats().values()]


def test_a_chain_of_elementwise_ops_keeps_one_buffer(sim):
    dev = sim(2)
    x_host = np.linspace(-1, 1, SIZE, dtype=np.float32)
    # 24 intermediates, each overwriting the one it consumes
    got, expected = affine_chain(x_host, dev.tensor(x_host))
    np.testing.assert_allclose(got, expected, rtol=2e-6)
    # one buffer for all 23 intermediates (the last is the result, in a buffer of its own);
    # without in-place reuse two would alternate
    assert arena_bytes(dev) == [aligned(SIZE * 4)] * 2


def test_an_op_that_cannot_overwrite_its_input_takes_a_second_buffer(sim):
    dev = sim(1)
    x = dev.tensor(np.full(SIZE, 0.5, np.float32))
    y = ((x * 2.0).exp() + 1.0).sum(axis=0)  # exp reads the product while writing its own result
    np.testing.assert_allclose(y.numpy(), (np.e + 1.0) * SIZE, rtol=1e-5)
    assert arena_bytes(dev) == [2 * aligned(SIZE * 4)]


def test_an_elementwise_op_does_not_overwrite_an_input_read_after_it(sim):
    """An add may write over its input's buffer only when nothing reads that input later: here
    the product is read again by the last step, so the sum takes a buffer of its own."""
    dev = sim(1)
    x_host = np.linspace(-1, 1, SIZE, dtype=np.float32)
    x = dev.tensor(x_host)
    product = x * 3.0  # in the arena, read by both steps below
    total = (product + 1.0) * product
    tripled = x_host * np.float32(3)
    np.testing.assert_array_equal(total.numpy(), (tripled + np.float32(1)) * tripled)  # float32, in order
    assert arena_bytes(dev) == [2 * aligned(SIZE * 4)]


def test_results_outlive_the_run_that_made_them(sim):
    """The second run of a plan reuses the arena: results of the first stay as they were."""
    dev = sim(2)
    w = dev.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), Split.even(1, 4, 2))
    outs = []
    for k in range(3):
        x = dev.tensor(np.full((2, 3), k + 1, np.float32))
        outs.append(((x @ w) * 2.0 + 1.0, k + 1))
        dev.run(outs[-1][0])
    assert len(dev.plans) == 1  # one plan ran three times
    for out, k in outs:
        expected = np.full((2, 3), k, np.float64) @ np.arange(12).reshape(3, 4) * 2.0 + 1.0
        np.testing.assert_array_equal(out.numpy(), expected.astype(np.float32))


def test_an_intermediate_read_through_a_view_lives_until_the_view_is_read(sim):
    dev = sim(1)
    x_host = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = dev.tensor(x_host)
    a = (x * 2.0).reshape(6, 4)  # a view of the product's buffer
    b = (x + 1.0).reshape(6, 4)  # must not take that buffer while the view is unread
    got = (a.transpose(1, 0) @ b).numpy()
    expected = (x_host * 2).reshape(6, 4).T.astype(np.float64) @ (x_host + 1).reshape(6, 4)
    np.testing.assert_array_equal(got, expected.astype(np.float32))


def test_views_of_arena_buffers_are_made_at_bind_and_see_every_runs_values(sim):
    """A reshape of an arena buffer is the same view every run: made once when the program is
    bound, with no call per run. A reshape of an input (a new array each run) still runs."""
    dev = sim(1)
    w = dev.tensor(np.eye(6, dtype=np.float32) * 3.0)
    outs = []
    for k in range(3):
        x = dev.tensor(np.arange(24, dtype=np.float32).reshape(4, 6) + k)
        y = (x.reshape(6, 4).transpose(1, 0) + 1.0) @ w  # reshape of an input, of nothing in the arena
        outs.append((((y * 2.0).reshape(2, 12) + 1.0).reshape(3, 8) * 0.5, k))
        dev.run(outs[-1][0])
    assert len(dev.plans) == 1
    for out, k in outs:
        x = np.arange(24, dtype=np.float64).reshape(4, 6) + k
        want = (((x.reshape(6, 4).T + 1.0) @ (np.eye(6) * 3.0) * 2.0).reshape(2, 12) + 1.0).reshape(3, 8) * 0.5
        np.testing.assert_array_equal(out.numpy(), want.astype(np.float32))
    (program,) = dev.cluster.servers[0].executor.programs.values()
    reshapes = [pl for pl in program.placed if pl.step.op == "reshape"]
    assert len(reshapes) == 3 and len(program.preset) == 2  # the two reshapes of products
    assert len(program.bound) == len(program.placed) - 2


def test_views_of_a_cache_written_in_place_see_every_runs_writes(sim):
    """A view of a cache that set_rows writes in place (the decoder's keys) is kept from one run
    to the next while the cache is the same array; it sees each run's writes, another cache gets
    its own view, and a reshape that copies (of a transposed view) is made every run."""
    dev = sim(1)
    hosts = [np.zeros((6, 4), np.float32), np.full((6, 4), -1.0, np.float32)]
    caches = [dev.tensor(h.copy()) for h in hosts]
    for k in range(6):
        which = k % 3 == 2  # the second cache now and then, through the same program
        row = np.full((1, 4), k + 1.0, np.float32)
        written = caches[which].set_rows(dev.tensor(np.array([k], np.int32)), dev.tensor(row), axis=0)
        viewed = written.reshape(4, 6) * 2.0  # a view of the cache
        copied = written.transpose(1, 0).reshape(2, 12) + 1.0  # a transposed view, then a copy
        dev.run(viewed, copied)
        hosts[which][k] = k + 1.0
        np.testing.assert_array_equal(viewed.numpy(), hosts[which].reshape(4, 6) * 2.0)
        np.testing.assert_array_equal(copied.numpy(), hosts[which].T.reshape(2, 12) + 1.0)
    assert len(dev.plans) == 1
    (program,) = dev.cluster.servers[0].executor.programs.values()
    kept = [c for _, c, _ in program.bound if c.__qualname__.startswith("_view_call")]
    assert len(kept) == 3  # the cache's three view steps (the copying reshape keeps nothing it makes)
    # a freed cache is not kept alive by the views the program kept of it (the last run's cache)
    store = dev.cluster.servers[0].store
    held = weakref.ref(store.tensors[caches[which].node.tensor])
    dev.free(caches[which])
    gc.collect()
    assert held() is None


def test_a_slice_is_read_where_it_lies(sim):
    """A slice (the first rows of a batched cache) takes no buffer: the next step reads the
    sliced rows in place, and only its own result takes arena memory."""
    dev = sim(2)
    x_host = np.linspace(-1, 1, 4 * SIZE, dtype=np.float32).reshape(4, SIZE)
    x = dev.tensor(x_host, Split.even(1, SIZE, 2))
    got = (x[1:3].exp() * 2.0).numpy()
    np.testing.assert_allclose(got, np.exp(x_host[1:3].astype(np.float64)) * 2.0, rtol=1e-6)
    assert arena_bytes(dev) == [aligned(SIZE * 4)] * 2  # exp's (2, SIZE / 2) only; no copy of the rows


def test_the_arena_is_shared_by_programs_and_shrinks_when_they_go(sim):
    dev = sim(1)
    dev.max_plans = 1
    small = dev.tensor(np.ones(SIZE // 4, np.float32))
    big = dev.tensor(np.ones(SIZE, np.float32))

    def two_live(x):  # exp and tanh live at once; the sum overwrites one of them
        return (x.exp() + x.tanh()).sum(axis=0)

    dev.run(two_live(small))
    assert arena_bytes(dev) == [2 * aligned(SIZE)]
    dev.run(two_live(big))  # the small program is evicted and unloaded
    assert arena_bytes(dev) == [2 * aligned(SIZE * 4)]
    dev.run(two_live(small) * 3.0)
    assert arena_bytes(dev) == [2 * aligned(SIZE)]  # the big one is gone: the arena shrank
    dev.max_plans = 4
    dev.run(two_live(big))
    dev.run(two_live(small) * 5.0)
    assert arena_bytes(dev) == [2 * aligned(SIZE * 4)]  # the largest plan loaded, not the sum


def test_the_arena_is_charged_at_load_before_any_step_runs(sim):
    dev = sim(2)
    for server in dev.cluster.servers:
        server.store.budget = 3 * SIZE * 4
    x = dev.tensor(np.ones(SIZE, np.float32))
    runs_before = [s["runs"] for s in dev.stats().values()]
    with pytest.raises(OutOfMemory, match=r"step \d+ \(exp\) needs 65536 bytes"):
        dev.run((x.exp() + x.tanh() * x.sqrt()).sum(axis=0))  # three intermediates live at once
    stats = dev.stats()
    assert [s["runs"] for s in stats.values()] == runs_before  # refused at load: nothing ran
    assert [s["arena"] for s in stats.values()] == [0, 0] and [s["programs"] for s in stats.values()] == [0, 0]
    np.testing.assert_array_equal((x + 1.0).numpy(), np.full(SIZE, 2, np.float32))  # still usable


def test_profiling_times_each_step_and_is_off_by_default(sim):
    dev = sim(2)
    w = dev.tensor(np.ones((64, 64), np.float32), Split.even(0, 64, 2))
    x = dev.tensor(np.ones((8, 64), np.float32), Split.even(1, 64, 2))
    y = ((x @ w).redistribute(MIRRORED) * 0.01).exp()
    dev.run(y)
    plain = dev.last_timings
    dev.profile = True
    dev.run(((x @ w).redistribute(MIRRORED) * 0.01).exp())
    for timings in (plain, dev.last_timings):
        for t in timings.values():
            assert t["comm_s"] > 0 and t["compute_s"] > 0 and t["comm_s"] + t["compute_s"] <= t["program_s"] * 1.001
    assert all(t["profiled"] for t in dev.last_timings.values())
    assert not any(t["profiled"] for t in plain.values())


def test_an_elementwise_op_takes_one_table_row_and_one_kernel(monkeypatch):
    """CONTRIBUTING's recipe: a row in split_state.ops.OPS and a kernel in workers' KERNELS (the
    oracle and the Tensor method are for tests and users, not for running it)."""
    from workers.kernels import basic

    row = OpSpec("softplus", 1, _infer_unary_float("softplus"), _unary_rule(linear=False))
    monkeypatch.setitem(OPS, "softplus", row)
    monkeypatch.setitem(basic.KERNELS, "softplus", basic._unary_float(lambda xp, x: xp.log1p(xp.exp(x))))
    x_host = np.linspace(-3, 3, 10, dtype=np.float32).reshape(2, 5)
    with MetaDevice(SimulatedCluster(3)) as dev:
        for state in (MIRRORED, Split.even(1, 5, 3), PARTIAL):
            x = dev.tensor(x_host, state)
            got = apply("softplus", x).numpy()
            np.testing.assert_allclose(got, np.log1p(np.exp(x_host.astype(np.float64))), rtol=1e-6)


def test_a_result_is_never_a_view_of_memory_a_later_step_reuses(sim):
    """A (1, 1) slice of a (1, 2) intermediate is already contiguous: a kernel that returned it
    as is would leave the result inside the arena, where the next step writes."""
    dev = sim(1)
    x = dev.tensor(np.array([[1.0, 2.0]], np.float32))
    first = (x * 2.0)[:, :1]  # the result: a slice of an arena buffer
    later = (x + 5.0).exp()  # reuses that buffer once the product is dead
    dev.run(first, later)
    np.testing.assert_array_equal(first.numpy(), [[2.0]])
    np.testing.assert_allclose(later.numpy(), np.exp([[6.0, 7.0]]), rtol=1e-6)


def test_a_reshape_that_copies_a_transposed_buffer_runs_every_run(sim):
    """A transpose of an arena buffer is a view made at bind; a reshape of that view must copy
    (its layout is not contiguous), so it cannot be made once at bind: it runs every run, and
    copies into a buffer of its own in the arena (workers/layouts.py), not into new memory."""
    dev = sim(1)
    outs = []
    for k in range(3):
        x = dev.tensor(np.arange(24, dtype=np.float32).reshape(4, 6) + k)
        outs.append((((x * 2.0).transpose(1, 0).reshape(4, 6) + 1.0), k))
        dev.run(outs[-1][0])
    for out, k in outs:
        want = ((np.arange(24, dtype=np.float64).reshape(4, 6) + k) * 2.0).T.reshape(4, 6) + 1.0
        np.testing.assert_array_equal(out.numpy(), want.astype(np.float32))
    (program,) = dev.cluster.servers[0].executor.programs.values()
    assert [op for op, _ in ((pl.step.op, pl) for pl in program.placed)].count("transpose") == 1
    assert len(program.preset) == 1  # the transpose; the reshape is a call
    assert [pl.out for pl in program.placed if pl.step.op == "reshape"] == ["arena"]
    assert arena_bytes(dev) == [2 * aligned(24 * 4)]  # the product, the reshape's copy (the sum: a result)


@pytest.mark.parametrize("n", [1, 2])
def test_redistributions_that_move_nothing_leave_the_compiled_program(sim, n):
    """On one device every redistribution is the tensor as it is (the Keep algorithm): the
    compiled program drops it and its readers read its input. On two, the all-reduce stays."""
    dev = sim(n)
    rng = np.random.default_rng(n)
    xh, wh = rng.standard_normal((3, 6)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    x, w = dev.tensor(xh, Split.even(1, 6, n)), dev.tensor(wh, Split.even(0, 6, n))
    y = ((x @ w).redistribute(MIRRORED) * 2.0 + 1.0).redistribute(Split.even(0, 3, n)).exp()
    np.testing.assert_allclose(y.numpy(), np.exp((xh @ wh) * 2.0 + 1.0), rtol=1e-5)
    planned = [s for s in dev.last_plan.steps if isinstance(s, MoveStep)]
    assert len(planned) == 2  # what the plan asks of every device
    for server in dev.cluster.servers:
        (program,) = server.executor.programs.values()
        moves = [pl for pl in program.placed if isinstance(pl.step, MoveStep)]
        kept = [(str(pl.step.src), str(pl.step.dst), pl.out) for pl in moves]
        # (both write into buffers of the arena, the all-reduce's last phase and the local cut:
        # Collectives.writes_into)
        assert kept == ([] if n == 1 else [("P", "M", "arena"), ("M", "S0[2|1]", "arena")])


def test_per_run_buffers_go_back_after_their_last_read():
    """What a collective sends and returns is a new array each run: held in the run's slots until
    its end, a 128-token prefill's 60 all-reduces kept ~50 MiB alive per worker. Each goes when
    its last reader has run; a run that asks for undeclared slots keeps everything."""
    import weakref

    from transport import protocol as p
    from workers.arena import Arena
    from workers.backends.cpu import Backend
    from workers.kernels import kernels_for
    from workers.program import CompiledProgram
    from workers.store import TensorStore

    made: list = []  # weak references to every collective's result
    alive_at_probe: list[int] = []

    class Collectives:  # an all-reduce over one device: a new array, as an engine returns
        def request(self, *args):
            return args

        def prepared(self, request, out=None):
            assert out is None, "no buffer without writes_into"

            def run(local, run, step, deadline):
                out = local.copy()
                made.append(weakref.ref(out))
                return out

            return run

    def probe(xp, inputs, params, out=None):
        alive_at_probe.append(sum(ref() is not None for ref in made))
        return xp.multiply(inputs[0], 1.0, out=out)

    backend = Backend(0)
    kernels = {**kernels_for(backend), "probe": probe}
    shape = (4, 8)
    steps = []
    for i in range(3):  # the product, then its all-reduce, three times: slots 2i+1 and 2i+2
        steps.append(p.OpStep("scale", (2 * i,), 2 * i + 1, {"factor": 2.0}, shape, "float32"))
        steps.append(p.MoveStep(2 * i + 1, 2 * i + 2, PARTIAL, MIRRORED, shape, "float32"))
    slot = 7
    steps.append(p.OpStep("probe", (6,), slot, {}, shape, "float32"))
    program = CompiledProgram(1, steps, [slot], kernels, world=(2, 0))
    arena = Arena(np, TensorStore(1 << 20))
    arena.resize(program.arena_bytes)
    program.bind(arena, Collectives(), backend, 5.0)
    x = np.ones(shape, np.float32)
    for keep in (False, False, True):  # the first run checks every step: another loop
        slots = [None] * program.nslots
        slots[0] = x
        program.run(slots, 1, backend, profile=False, keep=keep)
        np.testing.assert_array_equal(slots[slot], np.full(shape, 8.0, np.float32))
    # the probe reads the last all-reduce's result: the two before it are gone, unless kept
    assert alive_at_probe == [1, 1, 3]
    # and so written out as one function (workers/straight.py), once enough runs are announced
    from workers import straight

    program.expect(straight.WORTH_RUNS)
    slots = [None] * program.nslots
    slots[0] = x
    program.run(slots, 1, backend, profile=False)
    np.testing.assert_array_equal(slots[slot], np.full(shape, 8.0, np.float32))
    assert len(program.calls) == 1 and alive_at_probe[-1] == 1


def test_a_worker_process_keeps_loaded_programs_out_of_the_collectors_passes_until_unloaded(sim):
    """workers/main.py sets freeze_programs: a load freezes what is alive (the program's objects
    stay out of the garbage collector's full passes), an unload gives everything back to it, and
    the unloaded program is freed."""
    import gc
    import weakref

    dev = sim(1)
    dev.max_plans = 1
    executor = dev.cluster.servers[0].executor
    executor.freeze_programs = True
    x = dev.tensor(np.ones(64, np.float32))
    try:
        gc.unfreeze()
        dev.run((x.exp() + x.tanh()).sum(axis=0))
        assert gc.get_freeze_count() > 0
        loaded = [weakref.ref(c) for c in executor.programs.values()]
        dev.run((x * 3.0).sum(axis=0))  # evicts and unloads the first, then freezes again
        gc.collect()
        assert [ref() for ref in loaded] == [None]
        dev.cluster.servers[0].handle(Unload(list(executor.programs)))
        assert gc.get_freeze_count() == 0 and not executor.programs
    finally:
        executor.freeze_programs = False
        gc.unfreeze()


def test_a_collective_that_writes_into_a_buffer_gets_one_in_the_arena_and_so_does_what_it_sends():
    """An engine that copies what it sends before returning and writes its result where it is
    told (the shared-memory postboxes: Collectives.writes_into) gets both in the arena: the same
    arrays every run, so the kernels either side of it can be planned (workers/straight.py). A
    redistribution whose result the program returns still gets a new array each run (results
    outlive the run), and so does what one sends to an engine that does not copy it."""
    from transport import protocol as p
    from workers.arena import Arena
    from workers.backends.cpu import Backend
    from workers.kernels import kernels_for
    from workers.program import CompiledProgram
    from workers.store import TensorStore

    given: list = []  # (the input array, the buffer) each call: which arrays the engine saw

    class Collectives:  # an all-reduce over two devices whose peer contributes ones
        def request(self, src, dst, shape, dtype):
            return shape

        def prepared(self, request, out=None):
            def run(local, run, step, deadline):
                given.append((local, out))
                return np.add(local, 1.0, out=out)

            return run

    backend = Backend(0)
    kernels = kernels_for(backend)
    shape = (4, 8)
    steps = [
        p.OpStep("scale", (0,), 1, {"factor": 2.0}, shape, "float32"),
        p.MoveStep(1, 2, PARTIAL, MIRRORED, shape, "float32"),
        p.OpStep("scale", (2,), 3, {"factor": 3.0}, shape, "float32"),
        p.MoveStep(3, 4, PARTIAL, MIRRORED, shape, "float32"),  # returned: a new array each run
    ]
    program = CompiledProgram(1, steps, [4], kernels, world=(2, 0), writes_into=lambda step: True)
    assert [pl.out for pl in program.placed] == ["arena", "arena", "fresh", "move"]
    assert program.fresh_bytes == 2 * 128  # the last product (what the returned move sends) and its result
    arena = Arena(np, TensorStore(1 << 20))
    arena.resize(program.arena_bytes)
    program.bind(arena, Collectives(), backend, 5.0)
    results = []
    for k in range(3):
        x = np.full(shape, float(k), np.float32)
        slots = [None] * program.nslots
        slots[0] = x
        program.run(slots, 1, backend, profile=False)
        np.testing.assert_array_equal(slots[4], np.full(shape, (2.0 * k + 1) * 3 + 1, np.float32))
        results.append(slots[4])
    first, second = given[0::2], given[1::2]
    assert all(local is first[0][0] and out is first[0][1] for local, out in first), "the same buffers every run"
    assert np.shares_memory(first[0][0], arena.memory) and np.shares_memory(first[0][1], arena.memory)
    assert all(out is None for _, out in second) and len({id(local) for local, _ in second}) == 3
    assert not any(np.shares_memory(r, arena.memory) for r in results)
    # no engine that writes into buffers: the plan of old
    plain = CompiledProgram(1, steps, [4], kernels, world=(2, 0), writes_into=lambda step: False)
    assert [pl.out for pl in plain.placed] == ["fresh", "move", "fresh", "move"]


def test_an_empty_slices_buffer_leaves_the_lives_of_the_others_alone():
    """A device that holds an empty slice (no heads of a split, say) plans buffers of 0 bytes. One
    kept at the offset of a live buffer, which an op that overwrites its input then took over,
    moved that buffer's end of life to its own: the next buffer went over it while it was still
    to be read (NaN logits on the third of 3 devices once collectives wrote into the arena)."""
    from transport import protocol as p
    from workers.arena import Arena
    from workers.backends.cpu import Backend
    from workers.kernels import kernels_for
    from workers.program import CompiledProgram
    from workers.store import TensorStore

    backend = Backend(0)
    full, empty = (4, 8), (0, 8)
    steps = [
        p.OpStep("scale", (0,), 2, {"factor": 2.0}, full, "float32"),  # read by the last step
        p.OpStep("scale", (1,), 3, {"factor": 2.0}, empty, "float32"),
        p.OpStep("scale", (3,), 4, {"factor": 2.0}, empty, "float32"),  # overwrites its input
        p.OpStep("add", (4, 4), 5, {}, empty, "float32"),
        p.OpStep("scale", (0,), 6, {"factor": 3.0}, full, "float32"),
        p.OpStep("add", (2, 6), 7, {}, full, "float32"),
    ]
    program = CompiledProgram(1, steps, [7, 5], kernels_for(backend))
    placed = {pl.step.output: pl for pl in program.placed}
    assert placed[2].out == placed[6].out == "arena" and placed[2].offset != placed[6].offset
    arena = Arena(np, TensorStore(1 << 20))
    arena.resize(program.arena_bytes)
    program.bind(arena, None, backend, 5.0)
    x = np.arange(32, dtype=np.float32).reshape(full)
    slots = [None] * program.nslots
    slots[0], slots[1] = x, np.empty(empty, np.float32)
    program.run(slots, 1, backend, profile=False)
    np.testing.assert_array_equal(slots[7], x * 2.0 + x * 3.0)


def test_a_fused_steps_kernel_may_want_less_scratch_than_its_pattern_plans():
    """The attention pattern plans the scores twice over and the queries' room as scratch; a
    kernel saying it wants none for a step (`scratch_for`, as the CUDA backend's prompt
    attention does) gets none, and the arena is smaller by exactly that scratch."""
    from transport import protocol as p
    from workers.backends.cpu import Backend
    from workers.kernels import kernels_for
    from workers.program import CompiledProgram

    tokens, ctx, dim = 24, 40, 16
    steps = [
        p.OpStep("matmul", (0, 1), 4, {}, (1, 1, 1, tokens, ctx), "float32"),
        p.OpStep("softmax_ext", (4, 2), 5, {"axis": 4, "scale": 0.25}, (1, 1, 1, tokens, ctx), "float32"),
        p.OpStep("matmul", (5, 3), 6, {}, (1, 1, 1, tokens, dim), "float32"),
    ]
    kernels = kernels_for(Backend(0))
    planned = CompiledProgram(1, steps, [6], kernels)
    (fused,) = planned.placed
    assert fused.step.op == "attention" and fused.scratch[0] == (2 * tokens * ctx + tokens * dim,)

    def attention(*args, **kwargs):
        return kernels["attention"](*args, **kwargs)

    attention.scratch_for = lambda step, plan: None
    attention.memo = True
    wanting_none = CompiledProgram(1, steps, [6], {**kernels, "attention": attention})
    assert wanting_none.placed[0].scratch is None
    assert planned.arena_bytes - wanting_none.arena_bytes == aligned((2 * tokens * ctx + tokens * dim) * 4)


def test_a_program_too_big_for_its_budget_names_a_collectives_result_as_its_biggest_buffer():
    """describe_peak (the memory budget's refusal) names a redistribution by its states and prices
    this worker's part of it; it raised AttributeError on a collective's result."""
    from transport import protocol as p
    from workers.backends.cpu import Backend
    from workers.kernels import kernels_for
    from workers.program import CompiledProgram

    steps = [
        p.OpStep("scale", (0,), 1, {"factor": 2.0}, (4, 32), "float32"),  # this worker's half
        p.MoveStep(1, 2, Split.even(1, 64, 2), MIRRORED, (4, 64), "float32"),
        p.OpStep("scale", (2,), 3, {"factor": 3.0}, (4, 64), "float32"),
    ]
    program = CompiledProgram(1, steps, [3], kernels_for(Backend(0)), world=(2, 0), writes_into=lambda step: True)
    assert program.describe_peak() == "program 1 step 1 (redistribution S1[32|32] -> M) needs 1024 bytes"
