"""Steps with tensor arguments and chains of them (MetaDevice.chain, RunChain): a step captured
once replays with other tensors of the same shape, dtype and state, writes in place into the
one passed, and a chain runs several in one message. Oracles: NumPy on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from meta.steps import Earlier
from split_state.errors import FreedTensor, MetaError, ShapeError
from split_state.states import MIRRORED, Partial, Split


def _cols(n: int) -> Split:
    return Split(1, ((5, 0, 3) if n == 3 else (4, 4) if n == 2 else (8,),))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_layer_step_chained_over_its_layers_equals_numpy(sim, n):
    """One step (x @ w1).relu() @ w2 + x, prepared with layer 0's weights, runs for four layers
    with each one's weights in one chain: the residual goes from call to call as it comes out
    (Partial over several devices), and the result is the layers' product in NumPy."""
    dev = sim(n)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    w1 = [rng.standard_normal((6, 8)).astype(np.float32) for _ in range(4)]
    w2 = [rng.standard_normal((8, 6)).astype(np.float32) for _ in range(4)]
    cols, rows = _cols(n), Split(0, _cols(n).segments)
    up = [dev.tensor(w, cols) for w in w1]
    down = [dev.tensor(w, rows) for w in w2]

    def layer(h, a, b):
        return [(h @ a).relu() @ b + h]

    first = dev.prepare(layer, x, up[0], down[0])
    state = first.compiled.plan.out_states[0]
    step = dev.prepare(layer, dev.placeholder(x.shape, np.float32, state), up[0], down[0])
    plans = len(dev.plans)
    calls = [(first, (x, up[0], down[0]))]
    calls += [(step, (Earlier(k - 1, 0), up[k], down[k])) for k in range(1, 4)]
    outs = dev.chain(calls, read=[0])
    assert len(dev.plans) == plans  # nothing planned: one program per kind of call
    want = x
    for a, b in zip(w1, w2):
        want = np.maximum(want @ a, 0) @ b + want
    np.testing.assert_allclose(outs[-1][0].numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[0][0].numpy(), np.maximum(x @ w1[0], 0) @ w2[0] + x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2])
def test_a_step_writes_in_place_into_the_cache_it_is_passed(sim, n):
    """A step capturing a write into cache 0 writes cache 1 when passed cache 1, and returns
    cache 1's handle; cache 0 keeps what it had. Ids past FEW_ROWS take the kernel's ranged
    path, whose range a chain's second run of the same program must not take from the first's."""
    dev = sim(n)
    rows, width = 40, 8
    state = Split(1, ((4, 4),)) if n == 2 else Split(1, ((8,),))
    caches = [dev.tensor(np.zeros((rows, width), np.float32), state) for _ in range(2)]
    values = np.arange(20 * width, dtype=np.float32).reshape(20, width)
    ids_a, ids_b = np.arange(0, 20, dtype=np.int32), np.arange(20, 40, dtype=np.int32)

    def write(cache, ids, v):
        return [cache.set_rows(ids, v, axis=0)]

    step, (written,) = dev.capture(write, caches[0], ids_a, values)
    assert written.node.tensor == caches[0].node.tensor
    (again,) = step(caches[1], ids_b, -values)
    assert again is caches[1]
    want0, want1 = np.zeros((rows, width), np.float32), np.zeros((rows, width), np.float32)
    want0[ids_a], want1[ids_b] = values, -values
    np.testing.assert_array_equal(caches[0].numpy(), want0)
    np.testing.assert_array_equal(caches[1].numpy(), want1)
    # one chain, the same program twice over different ids: each run finds its own ids' range
    dev.chain([(step, (caches[0], ids_b, 2 * values)), (step, (caches[1], ids_a, 3 * values))])
    want0[ids_b], want1[ids_a] = 2 * values, 3 * values
    np.testing.assert_array_equal(caches[0].numpy(), want0)
    np.testing.assert_array_equal(caches[1].numpy(), want1)
    with pytest.raises(ShapeError, match=r"ids must lie in \[0, 40\), got \[30, 49\]"):
        dev.chain([(step, (caches[0], ids_a, values)), (step, (caches[1], ids_b + 10, values))])


@pytest.mark.parametrize("n", [1, 2])
def test_a_chains_runs_on_new_data_find_what_they_read_anew(sim, n):
    """A step writing rows at ids it works out itself (positions modulo the rows, as a ring
    cache's slots: an array of the program's own, the same buffer every run) into a cache
    split by rows, run twice in one chain over positions of each device's half in turn: the
    second run, marked as on new data, writes its own rows (its ids' range found anew, not the
    first run's, which would send its rows to the other half); a bad mark is refused."""
    dev = sim(n)
    rows, width = 40, 4
    state = Split(0, ((20, 20),)) if n == 2 else MIRRORED
    cache = dev.tensor(np.zeros((rows, width), np.float32), state)
    values = np.arange(20 * width, dtype=np.float32).reshape(20, width)
    first, second = np.arange(40, 60, dtype=np.int32), np.arange(60, 80, dtype=np.int32)

    def write(c, positions, v):
        return [c.set_rows(positions % rows, v, axis=0)]

    step = dev.prepare(write, cache, first, values)
    dev.chain([(step, (cache, first, values)), (step, (cache, second, -values))], new_data=[1])
    want = np.zeros((rows, width), np.float32)
    want[first % rows], want[second % rows] = values, -values
    np.testing.assert_array_equal(cache.numpy(), want)
    with pytest.raises(ShapeError, match="new data at calls"):
        dev.chain([(step, (cache, first, values))], new_data=[1])


def test_an_argument_of_another_shape_dtype_or_state_is_refused_and_nothing_runs(sim):
    """Refused by name before anything is sent; a tensor the caller fed (dev.feed) for the
    refused chain still goes with the next run that reads it."""
    dev = sim(2)
    w = dev.tensor(np.ones((6, 8), np.float32), Split(1, ((4, 4),)))
    x = np.ones((3, 6), np.float32)
    step = dev.prepare(lambda h, a: [h @ a], x, w)
    fed = dev.feed(2 * x)
    before = [s["runs"] for s in dev.stats().values()]
    for bad, says in [
        (
            dev.tensor(np.ones((6, 8), np.float32), Split(1, ((8, 0),))),
            r"argument 1 was \(6, 8\) float32 S1\[4\|4\], got \(6, 8\) float32 S1\[8\|0\]",
        ),
        (dev.tensor(np.ones((6, 4), np.float32), Split(1, ((2, 2),))), r"argument 1 was \(6, 8\)"),
        (dev.tensor(np.ones((6, 8), np.float64), Split(1, ((4, 4),))), r"got \(6, 8\) float64"),
    ]:
        with pytest.raises(ShapeError, match=says):
            dev.chain([(step, (fed, w)), (step, (x, bad))])
    with pytest.raises(ShapeError, match=r"argument 1 is a S1\[4\|4\] tensor of \(6, 8\); pass one, not an array"):
        step(x, np.ones((6, 8), np.float32))
    with pytest.raises(ShapeError, match="call 0 takes output 0 of call 1"):
        dev.chain([(step, (Earlier(1, 0), w)), (step, (x, w))])
    assert [s["runs"] for s in dev.stats().values()] == before
    (y,) = step(fed, w)  # still usable, and the fed tensor with it
    np.testing.assert_array_equal(y.numpy(), np.full((3, 8), 12, np.float32))


@pytest.mark.parametrize("n", [1, 2])
def test_a_chain_that_fails_part_way_raises_it_and_keeps_nothing(sim, n):
    """The second call writes past the cache: the workers refuse it after the first call ran.
    The error is the typed one, the first call's result is released (the workers hold what they
    held before), and the device runs the next chain."""
    dev = sim(n)
    cache = dev.tensor(np.zeros((8, 4), np.float32), MIRRORED)
    w = dev.tensor(np.eye(4, dtype=np.float32))

    def write(h, ids, c):
        return [h @ w, c.set_rows(ids, h, axis=0)]

    h = np.ones((2, 4), np.float32)
    step = dev.prepare(write, h, np.array([0, 1], np.int32), cache)
    dev.collect()
    held = [s["tensors"] for s in dev.stats().values()]
    with pytest.raises(MetaError, match=r"ids must lie in \[0, 8\), got \[8, 9\]"):
        dev.chain([(step, (h, np.array([0, 1], np.int32), cache)), (step, (h, np.array([8, 9], np.int32), cache))])
    dev.collect()
    assert [s["tensors"] for s in dev.stats().values()] == held
    out = dev.chain(
        [(step, (h, np.array([2, 3], np.int32), cache)), (step, (2 * h, np.array([4, 5], np.int32), cache))]
    )
    np.testing.assert_array_equal(out[1][0].numpy(), 2 * h)
    want = np.zeros((8, 4), np.float32)
    want[0:4], want[4:6] = 1, 2  # rows 0-1 from the failed chain's first call, which ran
    np.testing.assert_array_equal(cache.numpy(), want)


def test_a_placeholder_stands_for_a_tensor_but_is_never_read(sim):
    dev = sim(2)
    stand_in = dev.placeholder((3, 6), np.float32, Partial())
    w = dev.tensor(np.ones((6, 8), np.float32), Split(1, ((4, 4),)))
    step = dev.prepare(lambda h, a: [h @ a], stand_in, w)
    x = dev.tensor(np.ones((3, 6), np.float32) / 2, Partial())  # half on device 0, zeros elsewhere
    (y,) = step(x, w)
    np.testing.assert_array_equal(y.numpy(), np.full((3, 8), 3, np.float32))
    with pytest.raises(MetaError, match="not stored"):
        step(stand_in, w)
    (again,) = step(x, w)
    np.testing.assert_array_equal(again.numpy(), np.full((3, 8), 3, np.float32))


def test_an_in_place_write_inside_a_graph_is_resident_after_its_run(sim):
    """A write that is not an output of its run (a decode step's cache, read by its attention)
    leaves its handle resident, holding what the cache holds: a later graph over it runs
    nothing again."""
    dev = sim(2)
    cache = dev.tensor(np.zeros((4, 3), np.float32))
    written = cache.set_rows(dev.feed(np.array([1], np.int32)), dev.tensor(np.ones((1, 3), np.float32)), axis=0)
    total = written.sum(axis=0).numpy()
    np.testing.assert_array_equal(total, np.ones(3, np.float32))
    assert written.node.resident and written.node.tensor == cache.node.tensor
    plans, runs = len(dev.plans), [s["runs"] for s in dev.stats().values()]
    np.testing.assert_array_equal(written.numpy(), np.array([[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]))
    assert len(dev.plans) == plans and [s["runs"] for s in dev.stats().values()] == runs


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_prefill_plans_one_layer_and_equals_the_whole_model_program_bit_for_bit(sim, n):
    """A prompt of a new length plans three programs (the embedding, one layer for all four,
    the head), not one of every layer; its logits are the bits of the one program of every
    layer that TensorParallelLlama.step builds (the same sums in the same order), and a
    second prompt of the length plans nothing."""
    from models.llama import LlamaConfig, TensorParallelLlama, random_weights

    cfg = LlamaConfig(hidden=64, layers=4, heads=8, kv_heads=2, ffn=48, vocab=72)
    weights = random_weights(cfg, seed=5)
    dev = sim(n)
    chained = TensorParallelLlama(dev, cfg, weights.__getitem__, 32)
    whole = TensorParallelLlama(dev, cfg, weights.__getitem__, 32)
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]  # padded to 16
    plans = len(dev.plans)
    logits = chained.prefill([prompt], 0, pool=2, logits=True)[2].numpy()
    assert len(dev.plans) == plans + 3
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, : len(prompt)] = prompt
    want = whole.step(tokens, np.arange(16, dtype=np.int32)[None], last=[len(prompt) - 1]).numpy()
    np.testing.assert_array_equal(logits, want)
    plans = len(dev.plans)
    chained.prefill([prompt[:9]], 0, pool=2, logits=True)[2].numpy()
    assert len(dev.plans) == plans


@pytest.mark.parametrize("n", [1, 2])
def test_a_chain_that_keeps_only_its_last_results_frees_the_others_as_it_goes(sim, n):
    """keep=False: what the calls before the last made is freed on the workers after its last
    reader, so the workers hold what they held before plus the last call's result; the earlier
    handles are freed ones, and the result is NumPy's."""
    dev = sim(n)
    w = dev.tensor(np.full((4, 4), 0.5, np.float32))
    step = dev.prepare(lambda h, a: [h @ a + h], np.ones((2, 4), np.float32), w)
    dev.collect()
    held = [s["tensors"] for s in dev.stats().values()]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    calls = [(step, (x, w))] + [(step, (Earlier(k, 0), w)) for k in range(4)]
    outs = dev.chain(calls, keep=False)
    assert [s["tensors"] for s in dev.stats().values()] == [h + 1 for h in held]
    want = x
    for _ in range(5):
        want = want @ np.full((4, 4), 0.5, np.float32) + want
    np.testing.assert_allclose(outs[-1][0].numpy(), want, rtol=1e-6)
    with pytest.raises(FreedTensor):
        outs[1][0].numpy()
