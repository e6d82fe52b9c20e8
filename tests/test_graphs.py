"""Device graphs (workers/graphs.py) on the CUDA backend under the CuPy stand-in: a compiled
program's kernels are captured at their second run and replayed after, with results equal to
NumPy's every run, whatever changes between runs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cupy_standin import install
from transport import protocol as p
from workers import graphs
from workers.arena import Arena
from workers.kernels import kernels_for
from workers.program import CompiledProgram
from workers.store import TensorStore

X, W, B = 0, 1, 2  # input slots


@pytest.fixture
def backend(monkeypatch):
    install(monkeypatch)
    from workers.backends.cuda import Backend

    return Backend(0)


def op(name, inputs, output, shape, **params):
    return p.OpStep(name, tuple(inputs), output, params, shape, "float32")


def relu_mlp_steps():
    """out = -exp(relu(x @ w) * 2 + b), with x (4, 8), w (8, 6), b (6,): the product goes to the
    backend's own cuBLAS handle (the stand-in's libcublas), captured with the rest."""
    return [
        op("matmul", (X, W), 3, (4, 6)),
        op("relu", (3,), 4, (4, 6)),
        op("scale", (4,), 5, (4, 6), factor=2.0),
        op("add", (5, B), 6, (4, 6)),
        op("exp", (6,), 7, (4, 6)),
        op("neg", (7,), 8, (4, 6)),  # the result: its own array each run, so not captured
    ]


def expected(x, w, b):
    return -np.exp(np.maximum(x @ w, 0) * 2 + b)


class Program:
    """One compiled program on the backend, run as the executor runs it."""

    def __init__(self, backend, steps, kernels=None):
        self.backend = backend
        self.compiled = CompiledProgram(1, steps, [steps[-1].output], kernels or kernels_for(backend))
        self.arena = Arena(backend.xp, TensorStore(1 << 30))
        self.arena.resize(self.compiled.arena_bytes)
        self.compiled.bind(self.arena, None, backend, 5.0)
        self.runs = 0

    def __call__(self, *inputs):
        slots = [None] * self.compiled.nslots
        for i, value in enumerate(inputs):
            slots[i] = value
        self.runs += 1
        self.compiled.run(slots, self.runs, self.backend, profile=False)
        return self.backend.to_host(slots[self.compiled.placed[-1].step.output])

    def segments(self):
        return graphs.segments(self.compiled.calls)


def test_runs_are_captured_once_and_replayed_with_new_inputs_copied_in(backend):
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    program = Program(backend, relu_mlp_steps())
    wd, bd = backend.to_device(w), backend.to_device(b)
    for _ in range(6):
        x = rng.standard_normal((4, 8)).astype(np.float32)  # a new array every run: copied in
        np.testing.assert_allclose(program(backend.to_device(x), wd, bd), expected(x, w, b), rtol=1e-5)
    (segment,) = program.segments()
    assert segment.captures == 1 and segment.replays == 4  # run 1 checks, run 2 learns, run 3 captures
    assert set(segment.staged) == {X} and len(segment.calls) == 5


def test_inputs_that_stay_are_read_in_place_and_a_new_weight_is_captured_again(backend):
    rng = np.random.default_rng(1)
    x, b = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    w1, w2 = (rng.standard_normal((8, 6)).astype(np.float32) for _ in range(2))
    program = Program(backend, relu_mlp_steps())
    xd, bd, wd1, wd2 = (backend.to_device(a) for a in (x, b, w1, w2))
    for _ in range(4):
        np.testing.assert_allclose(program(xd, wd1, bd), expected(x, w1, b), rtol=1e-5)
    for _ in range(3):
        np.testing.assert_allclose(program(xd, wd2, bd), expected(x, w2, b), rtol=1e-5)
    (segment,) = program.segments()
    assert segment.captures == 2 and not segment.staged  # nothing copied: every input read in place


def test_a_kernel_that_reads_on_the_host_runs_eagerly_between_two_graphs(backend):
    def host_reading_scale(xp, inputs, params, out=None):
        factor = float(inputs[0].max())  # waits for the device: cannot be captured
        return xp.multiply(inputs[0], 1 / factor, out=out)

    kernels = {**kernels_for(backend), "normalize": host_reading_scale}
    steps = relu_mlp_steps()
    steps.insert(2, op("normalize", (4,), 9, (4, 6)))
    steps[3] = op("scale", (9,), 5, (4, 6), factor=2.0)
    program = Program(backend, steps, kernels)
    rng = np.random.default_rng(2)
    w, b = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    for _ in range(5):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        h = np.maximum(x @ w, 0)
        want = -np.exp(h / h.max() * 2 + b)
        np.testing.assert_allclose(
            program(backend.to_device(x), backend.to_device(w), backend.to_device(b)), want, rtol=1e-5
        )
    found = program.segments()
    assert [len(s.calls) for s in found] == [2, 3] and all(s.replays for s in found)
    ((eager_op, why),) = graphs.refusals(program.compiled.calls)  # what the workers' stats report
    assert eager_op == "normalize" and "cudaErrorStreamCaptureUnsupported" in why, why
    # what the abandoned capture allocated is let go: no graph will ever write that pool
    (split,) = [s for s in program.compiled.calls if isinstance(s, graphs.Segment) and s.pieces is not None]
    assert split.pool is None
    # the stats' per-run count: two graphs, the refused kernel and the fresh result between and after
    steps = [placed.step for placed, _, _ in program.compiled.dropping]
    assert graphs.per_run(program.compiled.calls, steps) == (2, ["normalize", "neg"])


@pytest.mark.parametrize("cublas", [True, False], ids=["own cuBLAS handle", "CuPy's products"])
def test_a_product_is_captured_with_the_backends_own_cublas_and_runs_eagerly_without(monkeypatch, cublas):
    """With its own cuBLAS handle (workers/backends/cuda/cublas.py; the stand-in's libcublas here) the
    CUDA backend's product is captured with the kernels around it: one graph. Without, CuPy's
    product, which CuPy refuses to capture, runs eagerly (backend.uncaptured) between two graphs.
    Either way nothing is refused and every run gives NumPy's result."""
    install(monkeypatch, cublas=cublas)
    from workers.backends.cuda import Backend

    backend = Backend(0)
    steps = [
        op("relu", (X,), 3, (4, 8)),
        op("matmul", (3, W), 4, (4, 6)),
        op("exp", (4,), 5, (4, 6)),
        op("add", (5, B), 6, (4, 6)),
        op("neg", (6,), 7, (4, 6)),  # the result: its own array each run
    ]
    program = Program(backend, steps)
    rng = np.random.default_rng(4)
    w, b = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    wd, bd = backend.to_device(w), backend.to_device(b)
    for _ in range(5):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        want = -(np.exp(np.maximum(x, 0) @ w) + b)
        np.testing.assert_allclose(program(backend.to_device(x), wd, bd), want, rtol=1e-5)
    found = program.segments()
    assert [len(s.calls) for s in found] == ([4] if cublas else [1, 2]) and all(s.replays == 3 for s in found)
    assert graphs.refusals(program.compiled.calls) == []


def test_what_a_captured_kernel_allocates_is_never_handed_to_anyone_else(backend):
    xp = backend.xp

    def with_temporaries(xp, inputs, params, out=None):
        return xp.add(xp.exp(inputs[0]) * 0, inputs[0], out=out)  # two temporaries of 96 bytes

    kernels = {**kernels_for(backend), "identity": with_temporaries}
    steps = [op("identity", (X,), 3, (4, 6)), op("neg", (3,), 4, (4, 6))]
    program = Program(backend, steps, kernels)
    x = backend.to_device(np.ones((4, 6), np.float32))
    for _ in range(3):
        program(x)
    bystanders = [xp.full((4, 6), 7, xp.float32) for _ in range(4)]  # blocks of the temporaries' size
    for _ in range(2):
        np.testing.assert_array_equal(program(x), -np.ones((4, 6), np.float32))
    for a in bystanders:
        assert backend.to_host(a).tolist() == np.full((4, 6), 7, np.float32).tolist()


def test_a_segment_captured_later_never_gets_memory_another_graph_writes(backend):
    """A view of a segment's input buffer read after a later graph replays keeps its data. The
    first segment splits at a kernel that reads on the host, so its first half is captured a run
    after the second segment was: with one pool for the program, the half's buffer for the input
    that changes was the block the second graph writes its temporaries into at every replay."""

    def host_reading_scale(xp, inputs, params, out=None):
        factor = float(abs(inputs[0]).max())  # waits for the device: cannot be captured
        return xp.multiply(inputs[0], 1 / factor, out=out)

    def copy(xp, inputs, params, out=None):
        return xp.multiply(inputs[0], 1, out=out)

    def with_temporaries(xp, inputs, params, out=None):
        return xp.add(xp.exp(inputs[0]) * 0, inputs[0], out=out)  # temporaries of 96 bytes

    def add(xp, inputs, params, out=None):
        return xp.add(inputs[0], inputs[1], out=out)

    copy.eager = add.eager = True  # never captured: the second segment is one from the start
    kernels = {**kernels_for(backend), "normalize": host_reading_scale, "copy": copy, "temps": with_temporaries}
    kernels["eager_add"] = add
    steps = [
        p.OpStep("reshape", (X,), 3, {"shape": [24]}, (24,), "float32"),  # a view of the input
        op("normalize", (3,), 4, (24,)),
        op("copy", (4,), 5, (24,)),
        op("temps", (5,), 6, (24,)),
        op("eager_add", (3, 6), 7, (24,)),  # reads the view after the second graph replayed
    ]
    program = Program(backend, steps, kernels)
    rng = np.random.default_rng(3)
    for _ in range(6):
        x = rng.standard_normal((4, 6)).astype(np.float32)  # a new array every run: copied in
        flat = x.reshape(24)
        np.testing.assert_allclose(program(backend.to_device(x)), flat + flat / np.abs(flat).max(), rtol=1e-6)
    assert all(s.replays for s in program.segments())


def test_a_program_over_an_engine_whose_collectives_graphs_hold_waits_for_the_device_by_its_deadline(backend):
    """Where the collectives' engine says a device graph can hold its collectives (NCCL's), a
    run ends in the engine's wait for the device, given the collective deadline (a peer lost
    inside a replayed graph then ends the wait; a plain synchronize would spin forever); a run
    issued without waiting (the pipelined decode loop) does not wait at all."""
    from types import SimpleNamespace

    waits = []
    engine = SimpleNamespace(captures=True, wait_device=lambda run, deadline: waits.append((run, deadline.seconds)))
    compiled = CompiledProgram(1, relu_mlp_steps(), [8], kernels_for(backend))
    arena = Arena(backend.xp, TensorStore(1 << 30))
    arena.resize(compiled.arena_bytes)
    compiled.bind(arena, SimpleNamespace(engine=engine), backend, 7.5)
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8, 6), (6,)))
    for run in (1, 2, 3):
        slots = [backend.to_device(a) for a in (x, w, b)] + [None] * (compiled.nslots - 3)
        compiled.run(slots, run, backend, profile=False, wait=run != 3)
        np.testing.assert_allclose(backend.to_host(slots[8]), expected(x, w, b), rtol=1e-5)
    assert waits == [(1, 7.5), (2, 7.5)]
