"""Straight-line programs (workers/straight.py): a bound program written out as one function
does what its calls do, line by line (the oracle is NumPy on the same values), and a program
replayed often runs written out with the same results as its first runs."""

from __future__ import annotations

import numpy as np
import pytest

from workers import straight
from workers.straight import CallLine, OpLine, ViewLine

pytestmark = pytest.mark.timeout(60)


def negate(xp, inputs, params, out):
    assert isinstance(inputs, tuple)  # as the closures pass one or two inputs
    return xp.negative(inputs[0], out=out)


def scaled_difference(xp, inputs, params, out):
    a, b = inputs
    return xp.multiply(xp.subtract(a, b, out=out), params["scale"], out=out)


def total(xp, inputs, params, out, scratch=None, memo=None):
    assert isinstance(inputs, list)  # three inputs, or a fresh result: a list
    memo["runs"] = memo.get("runs", 0) + 1
    scratch[...] = inputs[0] + inputs[1]
    return xp.add(scratch, inputs[2], out=out)


def test_each_kind_of_line_does_what_its_call_would():
    a = np.arange(6, dtype=np.float32)
    b = np.full(6, 2.0, np.float32)
    cache = np.arange(12, dtype=np.float32)
    o_neg, o_diff, scratch = np.empty(6, np.float32), np.empty(6, np.float32), np.empty(6, np.float32)
    memo: dict = {}
    moved = []
    last = [None, None]
    made = []

    def view(s):  # as workers/program.py _view_call: a view of slot 2, kept in `last`
        made.append(1)
        last[:] = (s[2], s[2].reshape(3, 4))
        s[7] = last[1]

    lines = [
        (OpLine(negate, (0,), 3, {}, o_neg), ()),
        (OpLine(scaled_difference, (3, 1), 4, {"scale": 3.0}, o_diff), (3,)),  # slot 3 dies here
        (OpLine(total, (4, 0, 1), 5, {}, None, {"scratch": scratch, "memo": memo}, ((6,), np.float32)), ()),
        (ViewLine(view, 2, 7, last), ()),
        (CallLine(lambda s: moved.append(s[5].copy())), (4,)),
    ]
    run = straight.write_out(lines, np, "test")
    results = []
    for _ in range(2):
        s = [a, b, cache, None, None, None, None, None]
        run(s)
        results.append(s)
    want_diff = (-a - b) * 3.0
    for s in results:
        assert s[3] is None and s[4] is None  # dead after their last reads
        np.testing.assert_array_equal(s[5], want_diff + a + b)
        np.testing.assert_array_equal(s[7], cache.reshape(3, 4))
        np.testing.assert_array_equal(moved[-1], want_diff + a + b)
    assert results[0][5] is not results[1][5]  # a fresh result each run
    assert results[1][7] is results[0][7] and len(made) == 1  # the kept view, made once
    assert memo["runs"] == 2
    other = np.zeros(12, np.float32)  # another cache: the view is made again, of it
    s = [a, b, other, None, None, None, None, None]
    run(s)
    assert len(made) == 2 and s[7].base is other


def test_a_replayed_program_runs_written_out_with_its_first_runs_results(sim):
    dev = sim(2)
    x_host = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    w_host = np.eye(8, dtype=np.float32) * 0.5 + 0.25
    w = dev.tensor(w_host)
    seen = []
    for k in range(straight.WORTH_RUNS + 3):
        x = dev.tensor(x_host + k / 100)
        y = ((x @ w).reshape(4, 16) * 2.0 + 1.0).exp().sum(axis=1)
        seen.append(y.numpy())
        expected = np.exp(((x_host + k / 100) @ w_host).reshape(4, 16) * 2.0 + 1.0).sum(axis=1)
        np.testing.assert_allclose(seen[-1], expected, rtol=1e-5)
    assert len(dev.plans) == 1
    for server in dev.cluster.servers:
        (program,) = server.executor.programs.values()
        (call,) = program.calls  # written out: one function
        assert call.__code__.co_filename == f"<program {program.program}>"


def test_a_generation_announcing_enough_steps_is_written_out_at_once_with_the_same_tokens(sim, monkeypatch):
    from tests.test_generation import LONG, STEPS, start, worker_loop

    monkeypatch.setattr(straight, "WORTH_RUNS", 30)
    dev = sim(2)

    def written() -> list[bool]:
        return [len(p.calls) == 1 for s in dev.cluster.servers for p in s.executor.programs.values()]

    _, step, v, i = start(dev)
    short, info = worker_loop(dev, step, v, i, 0.9, 1.0, seed=7, steps=STEPS)  # 10 steps: not worth it
    assert info["steps"] == STEPS and not any(written())
    _, step, v, i = start(dev)
    long, info = worker_loop(dev, step, v, i, 0.9, 1.0, seed=7, steps=LONG)  # 58 announced
    assert info["steps"] == LONG and long[: STEPS + 1] == short
    decode = [p for s in dev.cluster.servers for p in s.executor.programs.values() if len(p.calls) == 1]
    assert len(decode) == 2  # the decode program on both devices; the prefill's never
    assert all(p.replays < 30 for p in decode)  # written out on the steps' announcement, not their count
    for program in decode:  # its KV-cache writes (in place) run their plans, as its attention does
        planned = [v.__self__ for v in program.calls[0].__globals__.values() if hasattr(v, "__self__")]
        ops = {p.line.kernel.__name__ for p in planned if isinstance(p, straight._Planned) and p.planned}
        assert {"rope_set_rows", "set_rows", "attention"} <= ops, ops


def planned_scale(xp, inputs, params, out):
    return xp.multiply(inputs[0], params["scale"], out=out)


def _plan_scale(xp, inputs, params, out):
    made.append(inputs[0])
    (x,) = inputs
    factor = params["scale"]
    return lambda: xp.multiply(x, factor, out=out)


made: list = []
planned_scale.plan = _plan_scale


def test_a_planned_line_runs_its_plan_while_its_inputs_are_the_same_arrays():
    """The plan is made at the line's first run and run while slot 0 holds the array it was
    made for (whose values may change); another array is planned for again, up to REPLANS
    times, then the kernel is called as the closure calls it; the results are NumPy's each run,
    and a freed input's plan is let go."""
    made.clear()
    out = np.empty(4, np.float32)
    run = straight.write_out([(OpLine(planned_scale, (0,), 1, {"scale": 2.0}, out), ())], np, "test")
    a = np.arange(4, dtype=np.float32)
    for k in range(3):
        a[...] = k  # new values, the same array
        s = [a, None]
        run(s)
        np.testing.assert_array_equal(s[1], np.full(4, 2.0 * k))
    assert len(made) == 1 and made[0] is a
    run.forget({id(a): a})  # the store freed it: planned again
    run([a, None])
    assert len(made) == 2
    for k in range(6):  # a new array every run: planned on REPLANS runs in a row, then the plain call
        b = np.full(4, k, np.float32)
        s = [b, None]
        run(s)
        np.testing.assert_array_equal(s[1], np.full(4, 2.0 * k))
    assert len(made) == 1 + straight._Planned.REPLANS


def test_an_input_that_changes_now_and_then_is_planned_again_each_time():
    """A new array every other run (the fed positions a rope reads, new with each Generate) is
    planned again each time, however often over the program's life: the count is of runs in a
    row."""
    made.clear()
    out = np.empty(4, np.float32)
    run = straight.write_out([(OpLine(planned_scale, (0,), 1, {"scale": 2.0}, out), ())], np, "test")
    arrays = 3 * straight._Planned.REPLANS
    for k in range(arrays):
        a = np.full(4, k, np.float32)
        for _ in range(2):
            s = [a, None]
            run(s)
            np.testing.assert_array_equal(s[1], np.full(4, 2.0 * k))
        assert made[-1] is a
    assert len(made) == arrays


def scale_in_place(xp, inputs, params, out):
    return xp.multiply(inputs[0], params["scale"], out=inputs[0])


def _plan_in_place(xp, inputs, params, out):
    made.append(inputs[0])
    (x,) = inputs
    factor = params["scale"]
    return lambda: xp.multiply(x, factor, out=x)


scale_in_place.plan = _plan_in_place


def test_a_line_writing_its_input_in_place_runs_its_plan_and_a_fresh_result_never_does():
    """A KV cache's set_rows writes its first input and returns it: the same array every run, so
    its plan serves; a line whose result is a new array each run (`fresh`) never runs a plan (it
    would hand every run the array it was planned with)."""
    made.clear()
    cache = np.ones(4, np.float32)
    lines = [
        (OpLine(scale_in_place, (0,), 1, {"scale": 2.0}, None, inplace=True), ()),
        (OpLine(planned_scale, (1,), 2, {"scale": 3.0}, None, fresh=((4,), np.float32)), ()),
    ]
    run = straight.write_out(lines, np, "test")
    results = []
    for k in range(3):
        s = [cache, None, None]
        run(s)
        assert s[1] is cache
        np.testing.assert_array_equal(cache, np.full(4, 2.0 ** (k + 1)))
        np.testing.assert_array_equal(s[2], np.full(4, 3 * 2.0 ** (k + 1)))
        results.append(s[2])
    assert made == [cache]  # planned once, the in-place line only
    assert results[0] is not results[1] is not results[2]


def test_forget_lets_go_of_exactly_the_plans_that_hold_a_freed_array():
    """`forget` finds the plans holding a freed array by its id (a replayed step frees a few
    arrays every run; scanning every plan cost ~300 us a token): only those are planned again,
    an array a plan held before it was planned anew no longer counts, and a plan that gave up
    planning holds nothing."""
    made.clear()
    outs = [np.empty(4, np.float32), np.empty(4, np.float32)]
    lines = [(OpLine(planned_scale, (k,), 2 + k, {"scale": 2.0}, outs[k]), ()) for k in (0, 1)]
    run = straight.write_out(lines, np, "test")
    a, b = np.ones(4, np.float32), np.full(4, 3.0, np.float32)
    run([a, b, None, None])
    assert [x is y for x, y in zip(made, (a, b))] == [True, True]
    run.forget({id(a): a})  # only the first line's plan goes
    s = [a, b, None, None]
    run(s)
    assert len(made) == 3 and made[2] is a
    np.testing.assert_array_equal(s[2], np.full(4, 2.0)) and np.testing.assert_array_equal(s[3], np.full(4, 6.0))
    c = np.full(4, 5.0, np.float32)
    run([a, c, None, None])  # the second line planned anew, for c
    assert len(made) == 4 and made[3] is c
    run.forget({id(b): b})  # b is no plan's input any more: nothing to let go
    run([a, c, None, None])
    assert len(made) == 4
    run.forget({id(c): c, id(a): a})  # both go
    run([a, c, None, None])
    assert len(made) == 6
