"""What a decoder needs: in-place cache writes, top-k over a split axis, rope, masked softmax,
mixed dtypes, one plan for every decode step, and a bounded plan cache."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from meta import MetaDevice, where
from meta.planner import COMMUNICATING
from models import reference as ref
from models.llama import HeadSplit, LlamaConfig, ReferenceDecoder, TensorParallelLlama, random_weights
from split_state import MIRRORED, PARTIAL, Collective, ShapeError, Split
from split_state.layout import local_shape
from split_state.transitions import classify
from transport import protocol as p
from transport.protocol import MoveStep
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(300)


def vocab_states(n: int, vocab: int) -> list:
    uneven = [0] * n
    uneven[0], uneven[-1] = vocab - vocab // 4, vocab // 4
    return [
        MIRRORED,
        PARTIAL,
        Split.even(1, vocab, n),
        Split(1, (tuple(uneven),)) if n > 1 else Split.even(1, vocab, 1),
        Split.even(1, (vocab // 2, vocab - vocab // 2), n),  # two segments
        Split.even(0, 3, n),  # rows split: every device ranks whole rows
    ]


@pytest.mark.parametrize("n, k", [(n, 4) for n in range(1, 9)] + [(n, 1) for n in (1, 2, 3, 5)])
def test_top_k_over_every_state_never_gathers_the_vocabulary(sim, n, k):
    vocab = 50
    rng = np.random.default_rng(n)
    logits = rng.integers(-20, 20, size=(3, vocab)).astype(np.float32)  # ties on purpose
    logits[1, rng.integers(vocab)] = np.nan  # ranks as -inf: never picked (greedy has its own path)
    dev = sim(n)
    for state in vocab_states(n, vocab):
        t = dev.tensor(logits, state)
        values, indices = t.top_k(k)
        got_i, got_v = indices.numpy(), values.numpy()
        expected = ref.top_k(logits, k)
        assert np.array_equal(got_i, expected[..., 1].astype(np.int64)), str(state)
        assert np.array_equal(got_v, expected[..., 0].astype(np.float32)), str(state)
        assert np.array_equal(t.argmax().numpy(), np.argmax(np.nan_to_num(logits, nan=-np.inf), axis=-1)), str(state)
        for step in dev.last_plan.steps:  # what travels: candidates (n * k per row), never the logits
            if isinstance(step, MoveStep) and classify(step.src, step.dst) in COMMUNICATING and state != PARTIAL:
                assert vocab not in step.shape, (str(state), step)
        dev.free(t)


@pytest.mark.parametrize("devname", ["procs3", "cuda3"])
def test_top_k_on_worker_processes(devname, request):
    procs3 = request.getfixturevalue(devname)
    logits = np.random.default_rng(0).standard_normal((2, 101)).astype(np.float32)
    t = procs3.tensor(logits, Split(1, ((60, 0, 41),)))
    values, indices = t.top_k(5)
    assert np.array_equal(indices.numpy(), np.argsort(-logits, axis=-1, kind="stable")[:, :5])
    assert procs3.last_plan.collectives() == [Collective.ALL_GATHER]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_set_rows_writes_in_place_keeping_id_and_storage(sim, n):
    rng = np.random.default_rng(n)
    cache_host = rng.standard_normal((3, 10, 4)).astype(np.float32)
    for state in [MIRRORED, PARTIAL, Split.even(0, 3, n), Split.even(1, 10, n), Split(2, ((4,) + (0,) * (n - 1),))]:
        dev = sim(n)
        cache = dev.tensor(cache_host, state)
        tensor_id, used = cache.node.tensor, {r: s["used"] for r, s in dev.stats().items()}
        value = rng.standard_normal((3, 2, 4)).astype(np.float32)
        ids = np.array([7, 2], np.int32)
        written = cache.set_rows(dev.tensor(ids), dev.tensor(value), axis=1)
        dev.run(written)
        expected = cache_host.copy()
        expected[:, ids] = value
        assert written.node.tensor == tensor_id and written.state == state, str(state)
        np.testing.assert_array_equal(written.numpy(), expected)
        np.testing.assert_array_equal(cache.numpy(), expected)  # the destination's handle sees the write
        stats = dev.stats()
        assert {r: s["used"] for r, s in stats.items()} == used, "no copy of the cache"
        assert all(s["tensors"] == 1 for s in stats.values()), "only the cache is stored"


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("state_of", ["mirrored", "heads", "batch", "batch uneven"])
def test_set_rows_from_a_batch_index_writes_that_sequence_only(sim, n, state_of):
    """batch_start: one sequence's rows of a batched cache (a server prefilling one slot), with
    the cache split on its heads or on its batch axis (some devices holding none of it)."""
    rng = np.random.default_rng(n)
    host = rng.standard_normal((4, 3, 6, 2)).astype(np.float32)  # (batch, heads, ctx, dim)
    state = {
        "mirrored": MIRRORED,
        "heads": Split.even(1, 3, n),
        "batch": Split.even(0, 4, n),
        "batch uneven": Split(0, ((1, 3) + (0,) * (n - 2),)) if n > 1 else MIRRORED,
    }[state_of]
    dev = sim(n)
    cache = dev.tensor(host, state)
    ids = np.array([[4, 0], [1, 5]], np.int32)  # sequences 1 and 2, two positions each
    value = rng.standard_normal((2, 3, 2, 2)).astype(np.float32)
    cache.set_rows(dev.tensor(ids), dev.tensor(value), axis=2, batch_start=1).numpy()
    expected = host.copy()
    for j, b in enumerate((1, 2)):
        for t, row in enumerate(ids[j]):
            expected[b, :, row] = value[j, :, t]
    np.testing.assert_array_equal(cache.numpy(), expected)
    with pytest.raises(ShapeError, match="from batch_start 3"):
        cache.set_rows(dev.tensor(ids), dev.tensor(value), axis=2, batch_start=3)


def test_set_rows_with_bad_ids_fails_and_leaves_the_cache_intact(sim):
    dev = sim(2)
    cache_host = np.arange(24, dtype=np.float32).reshape(6, 4)
    cache = dev.tensor(cache_host, Split.even(0, 6, 2))
    with pytest.raises(ShapeError, match=r"ids must lie in \[0, 6\)"):
        cache.set_rows(dev.tensor(np.array([9], np.int32)), dev.tensor(np.ones((1, 4), np.float32))).numpy()
    np.testing.assert_array_equal(cache.numpy(), cache_host)
    with pytest.raises(ShapeError, match="needs a value of"):
        cache.set_rows(dev.tensor(np.array([1], np.int32)), dev.tensor(np.ones((2, 4), np.float32)))


@pytest.mark.parametrize("bad", [40, 41, -1])
def test_set_rows_of_many_ids_checks_each_bound_and_leaves_the_cache_intact(sim, bad):
    """More ids than the few-rows path takes (a prefill's writes go the masked way): an id equal
    to the row count, past it or negative is refused there too."""
    dev = sim(2)
    cache_host = np.arange(160, dtype=np.float32).reshape(40, 4)
    cache = dev.tensor(cache_host, Split.even(0, 40, 2))
    ids = np.arange(20, dtype=np.int32)  # past FEW_ROWS
    ids[-1] = bad
    with pytest.raises(ShapeError, match=r"ids must lie in \[0, 40\)"):
        cache.set_rows(dev.tensor(ids), dev.tensor(np.ones((20, 4), np.float32))).numpy()
    np.testing.assert_array_equal(cache.numpy(), cache_host)


def test_batched_rows_each_prompt_at_its_own_position(sim):
    dev = sim(3)
    cache = dev.tensor(np.zeros((2, 3, 8, 4), np.float32), Split.even(1, 3, 3))  # (batch, heads, ctx, dim)
    value = np.random.default_rng(0).standard_normal((2, 3, 1, 4)).astype(np.float32)
    ids = np.array([[5], [2]], np.int32)
    out = cache.set_rows(dev.tensor(ids), dev.tensor(value, Split.even(1, 3, 3)), axis=2).numpy()
    assert np.array_equal(out[0, :, 5], value[0, :, 0]) and np.array_equal(out[1, :, 2], value[1, :, 0])
    assert np.count_nonzero(out) == value.size


def test_low_precision_weights_with_float32_activations(procs2):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float16)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    wt = procs2.tensor(w, Split.even(1, 48, 2))
    used = {r: s["used"] for r, s in procs2.stats().items()}
    xt = procs2.tensor(x)
    y = xt @ wt
    assert y.dtype == np.float32
    np.testing.assert_allclose(y.numpy(), x.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-4)
    # the float16 weight stays float16: only x and the result were added to the store
    for r, s in procs2.stats().items():
        assert s["used"] - used[r] == x.nbytes + 5 * 24 * 4, (r, s)


# -- a GQA decode loop: cache written in place, one plan for every step -------------------------


class GQA:
    """4 query heads sharing 2 KV heads (head size 8, hidden 32), a 64-position cache."""

    hidden, q_heads, kv_heads, hd, ctx = 32, 4, 2, 8, 64

    def __init__(self, rng):
        h, hd = self.hidden, self.hd
        self.wq = (rng.standard_normal((h, self.q_heads * hd)) / np.sqrt(h)).astype(np.float32)
        self.wk = (rng.standard_normal((h, self.kv_heads * hd)) / np.sqrt(h)).astype(np.float32)
        self.wv = (rng.standard_normal((h, self.kv_heads * hd)) / np.sqrt(h)).astype(np.float32)
        self.wo = (rng.standard_normal((self.q_heads * hd, h)) / np.sqrt(h)).astype(np.float32)

    def reference_loop(self, xs: np.ndarray) -> np.ndarray:
        """Single-device float64 decode: K and V appended one position at a time."""
        group, hd = self.q_heads // self.kv_heads, self.hd
        ks, vs, outs = [], [], []
        for pos, x in enumerate(xs.astype(np.float64)):
            q = ref.rope((x @ self.wq).reshape(1, self.q_heads, hd), np.array([pos]), 10000.0, "normal")[0]
            k = ref.rope((x @ self.wk).reshape(1, self.kv_heads, hd), np.array([pos]), 10000.0, "normal")[0]
            ks.append(k)
            vs.append((x @ self.wv).reshape(self.kv_heads, hd))
            keys, values = np.stack(ks, 1), np.stack(vs, 1)  # (kv heads, positions, hd)
            attn = np.empty((self.q_heads, hd))
            for head in range(self.q_heads):
                g = head // group
                scores = keys[g] @ q[head] / np.sqrt(hd)
                w = np.exp(scores - scores.max())
                attn[head] = (w / w.sum()) @ values[g]
            outs.append(x + attn.reshape(-1) @ self.wo)
        return np.stack(outs)


def place_gqa(dev, m: GQA):
    n, hd, group = dev.n, m.hd, m.q_heads // m.kv_heads
    kv = Split.even(0, m.kv_heads, n)  # whole KV heads per device; a device may hold none
    kv_cols = tuple(e * hd for e in kv.segments[0])
    q_cols = tuple(e * group * hd for e in kv.segments[0])
    weights = {
        "wq": dev.tensor(m.wq, Split(1, (q_cols,))),
        "wk": dev.tensor(m.wk, Split(1, (kv_cols,))),
        "wv": dev.tensor(m.wv, Split(1, (kv_cols,))),
        "wo": dev.tensor(m.wo, Split(0, (q_cols,))),
        "positions": dev.tensor(np.arange(m.ctx, dtype=np.int32)),
        "zero": dev.tensor(np.float32(0)),
        "minus_inf": dev.tensor(np.float32(-np.inf)),
    }
    caches = [dev.tensor(np.zeros((m.kv_heads, m.ctx, hd), np.float32), kv) for _ in range(2)]
    return weights, caches


def gqa_step(dev, m: GQA, w, caches, x, pos):
    """One decode step; returns (output, new K cache, new V cache), all lazy."""
    group, hd = m.q_heads // m.kv_heads, m.hd
    cache_k, cache_v = caches
    xt = dev.tensor(x.reshape(1, -1))
    p = dev.tensor(np.array([pos], np.int32))
    q = (xt @ w["wq"]).reshape(1, m.q_heads, hd).rope(p)  # (1 token, q heads, hd)
    k = (xt @ w["wk"]).reshape(1, m.kv_heads, hd).rope(p)
    v = (xt @ w["wv"]).reshape(1, m.kv_heads, hd)
    cache_k = cache_k.set_rows(p, k.transpose(1, 0, 2), axis=1)  # (kv heads, ctx, hd), in place
    cache_v = cache_v.set_rows(p, v.transpose(1, 0, 2), axis=1)
    mask = where(w["positions"] <= p, w["zero"], w["minus_inf"])  # (ctx,): causal, from the position
    qg = q.reshape(m.kv_heads, group, hd)  # query heads grouped by the KV head they share
    scores = qg @ cache_k.transpose(0, 2, 1)  # (kv heads, group, ctx)
    attn = scores.softmax_masked(mask, scale=1.0 / np.sqrt(hd)) @ cache_v  # (kv heads, group, hd)
    out = xt + (attn.reshape(1, m.q_heads * hd) @ w["wo"]).redistribute(MIRRORED)
    return out, cache_k, cache_v


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gqa_decode_loop_equals_numpy_with_one_plan(sim, n):
    rng = np.random.default_rng(7)
    m = GQA(rng)
    xs = rng.standard_normal((m.ctx, m.hidden)).astype(np.float32)
    dev = sim(n)
    w, caches = place_gqa(dev, m)
    outs = []
    for pos in range(m.ctx):
        out, k, v = gqa_step(dev, m, w, caches, xs[pos], pos)
        dev.run(out, k, v)
        caches = [k, v]
        outs.append(out.numpy()[0])
    np.testing.assert_allclose(np.stack(outs), m.reference_loop(xs), rtol=1e-4, atol=1e-4)
    assert len(dev.plans) == 1  # every decode step, one plan (reading a resident output compiles nothing)
    (decode,) = dev.plans.values()
    # attention is local: the only collective of a step is the output projection's all-reduce
    assert decode.plan.collectives() == ([Collective.ALL_REDUCE] if n > 1 else [])


@pytest.mark.parametrize("devname", ["procs2", "cuda2", "cuda_nccl2"])
def test_gqa_decode_on_two_processes(devname, request):
    procs2 = request.getfixturevalue(devname)
    rng = np.random.default_rng(8)
    m = GQA(rng)
    steps = 12
    xs = rng.standard_normal((steps, m.hidden)).astype(np.float32)
    w, caches = place_gqa(procs2, m)
    outs = []
    for pos in range(steps):
        out, k, v = gqa_step(procs2, m, w, caches, xs[pos], pos)
        procs2.run(out, k, v)
        caches = [k, v]
        outs.append(out.numpy()[0])
    np.testing.assert_allclose(np.stack(outs), m.reference_loop(xs), rtol=1e-4, atol=1e-4)


# -- a bounded plan cache ------------------------------------------------------------------------


def programs(dev) -> list[int]:
    return [s["programs"] for s in dev.stats().values()]


def test_plans_are_evicted_least_recently_used_and_unloaded(sim):
    dev = MetaDevice(SimulatedCluster(2), max_plans=3)
    try:
        x = {size: dev.tensor(np.ones(size, np.float32)) for size in range(1, 6)}
        for size in (1, 2, 3, 1, 4):  # 1 is used again before 4 arrives: 2 is the oldest
            (x[size] * 2.0).numpy()
        assert [key[0][1] for key in dev.plans] == [(3,), (1,), (4,)]
        assert programs(dev) == [3, 3]
        np.testing.assert_array_equal((x[2] * 2.0).numpy(), [2.0, 2.0])  # recompiled on demand
    finally:
        dev.close()


@pytest.mark.timeout(240)
def test_two_thousand_steps_of_changing_shapes_stay_bounded(fresh_cluster):
    cluster = fresh_cluster(2)
    dev = MetaDevice(cluster, max_plans=32)
    w = dev.tensor(np.ones((16, 16), np.float32), Split.even(1, 16, 2))
    pids = list(cluster.pids.values())

    def step(i: int) -> None:
        rows = 1 + i % 500  # a new shape every step for 500 steps, then the cycle again
        y = dev.tensor(np.ones((rows, 16), np.float32)) @ w
        dev.run(y)
        dev.free(y)

    for i in range(500):
        step(i)
    rss0 = [_rss_kib(pid) for pid in pids]
    for i in range(500, 2000):
        step(i)
    assert len(dev.plans) == 32 and programs(dev) == [32, 32]
    for before, after in zip(rss0, [_rss_kib(pid) for pid in pids]):
        assert after <= before * 1.10, (rss0, after)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        fields = {k: v.split() for k, _, v in (line.partition(":") for line in f)}
    return int(fields["VmRSS"][0]) - int(fields["RssShmem"][0])


def test_fed_inputs_travel_with_the_next_run(sim):
    dev = sim(2)
    x = dev.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), Split.even(1, 3, 2))
    scale = dev.feed(np.array([[2.0], [3.0]], np.float32))
    calls = dev.cluster.call_all
    sent = []
    dev.cluster.call_all = lambda messages, *a: sent.append(type(next(iter(messages.values())))) or calls(messages, *a)
    assert np.array_equal(scale.numpy(), [[2.0], [3.0]]) and sent == []  # known here: no round trip
    got = (x * scale).numpy()
    assert p.Put not in sent and p.RunProgram in sent
    np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3) * [[2.0], [3.0]])
    assert np.array_equal(scale.numpy(), [[2.0], [3.0]])  # now read back from a worker


def test_a_feed_reaching_past_its_bytes_is_refused(sim):
    dev = sim(1)
    reply = dev.cluster.call_all(
        {0: p.RunProgram(1, 1, [], [], [], [p.Feed(5, "float32", (4,), 8)], np.zeros(16, np.uint8))}
    )[0]
    assert isinstance(reply, p.Error) and "reaches past the 16 bytes" in reply.message


# -- the llama decoder's shapes, cache bounds and captured steps ------------------------------------

# 8 query heads over 2 KV heads: groups of 4, so swapping "heads per group" and "KV heads" breaks
# it (SmolLM2's 9 over 3 cannot tell them apart); a rope base of its own
GQA_CFG = LlamaConfig(hidden=64, layers=2, heads=8, kv_heads=2, ffn=48, vocab=72, rope_base=30000.0)


def test_head_splits_give_each_device_the_kv_heads_its_query_heads_read():
    """Written out by hand: SmolLM2's 9 heads of 3 KV heads, a Qwen2-0.5B-like 14 of 2."""
    smol = LlamaConfig(hidden=576, layers=1, heads=9, kv_heads=3, ffn=64, vocab=8)
    assert HeadSplit.whole_groups(smol, 2) == HeadSplit((6, 3), ((0, 1), (2,)), (0, 0, 0, 1, 1, 1, 2, 2, 2))
    assert HeadSplit.even_queries(smol, 2) == HeadSplit((5, 4), ((0, 1), (1, 2)), (0, 0, 0, 1, 1, 2, 3, 3, 3))
    assert not HeadSplit.whole_groups(smol, 2).shared and HeadSplit.even_queries(smol, 2).shared
    qwen = LlamaConfig(hidden=896, layers=1, heads=14, kv_heads=2, ffn=64, vocab=8)
    assert HeadSplit.whole_groups(qwen, 4).query == (7, 7, 0, 0)  # two devices idle in attention
    even = HeadSplit.even_queries(qwen, 4)
    assert even.query == (4, 4, 3, 3) and even.kv == ((0,), (0, 1), (1,), (1,))
    assert even.kv_of_head == (0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 4, 4, 4)
    assert HeadSplit.even_queries(qwen, 16).query == (1,) * 14 + (0, 0)  # more devices than heads
    # 16-value heads before a wo in 32-value blocks go two by two: 6 heads 4 | 2 (not 3 | 3)
    small = LlamaConfig(hidden=96, layers=1, heads=6, kv_heads=3, ffn=64, vocab=8)
    assert HeadSplit.for_workers(small, 2, unit=2).query == (4, 2)
    assert HeadSplit.for_workers(qwen, 4, unit=4) == HeadSplit.whole_groups(qwen, 4)  # 14 heads: no 4s
    # where the KV heads divide among the devices, whole groups
    assert HeadSplit.for_workers(smol, 3) == HeadSplit.whole_groups(smol, 3) == HeadSplit.even_queries(smol, 3)
    assert HeadSplit.for_workers(smol, 2) == HeadSplit.even_queries(smol, 2)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_llama_with_four_query_heads_per_kv_head_equals_the_reference(sim, n):
    """GQA_CFG's 8 query heads of 2 KV heads: on 3 and 4 CPU devices the query heads split
    evenly (3 | 3 | 2, 2 | 2 | 2 | 2, where whole groups gave 4 | 4 | 0 and 4 | 4 | 0 | 0), each
    device's caches holding the KV heads its query heads read, a cut group's on both sides."""
    weights = random_weights(GQA_CFG, seed=9)
    ctx, prompt = 16, np.array([[3, 70, 15, 8, 41]])
    ref_dec = ReferenceDecoder(GQA_CFG, weights, ctx)
    expected = [ref_dec.forward(prompt, np.arange(5)[None])[0, -1]]
    dev = sim(n)
    net = TensorParallelLlama(dev, GQA_CFG, weights.__getitem__, ctx)
    query, cache_heads = {1: ((8,), (2,)), 2: ((4, 4), (1, 1)), 3: ((3, 3, 2), (1, 2, 1)), 4: ((2,) * 4, (1,) * 4)}[n]
    assert net.heads.query == query
    assert [local_shape(net.k[0].state, net.k[0].shape, n, d)[1] for d in range(n)] == list(cache_heads)
    got = [net.step(prompt, np.arange(5)[None])[:, 4:].numpy()[0, 0]]
    for pos, token in zip(range(5, 9), (11, 60, 2, 33)):
        expected.append(ref_dec.forward(np.array([[token]]), np.array([[pos]]))[0, -1])
        got.append(net.step(np.array([[token]]), np.array([[pos]])).numpy()[0, 0])
    np.testing.assert_allclose(np.stack(got), np.stack(expected), rtol=2e-4, atol=2e-4)


def check_float16_caches(dev, cache_types, slot: int | None = None):
    """llama.cpp's --cache-type-k / -v f16: keys and values rounded to float16 as they are
    cached, attention in float32. Prefilled (with `slot`: into that row of a server's two, whose
    first chunk reads its new keys and values, rounded as cached), then decoded one token at a
    time, against the reference with the same caches; the float32 reference differs by more
    than the tolerance, so a cache that stayed float32 (or a rounding in the wrong place) fails."""
    weights = {k: v * (4.0 if k.endswith(("wk", "wv")) else 1.0) for k, v in random_weights(GQA_CFG, seed=5).items()}
    ctx, prompt = 24, [3, 70, 15, 8, 41, 9, 2]
    ref_dec = ReferenceDecoder(GQA_CFG, weights, ctx, cache_types=cache_types)
    exact = ReferenceDecoder(GQA_CFG, weights, ctx)
    rows = 1 if slot is None else 2
    net = TensorParallelLlama(dev, GQA_CFG, weights.__getitem__, ctx, batch=rows, cache_types=cache_types)
    got = [net.prefill([prompt], 0, pool=1, logits=True, slot=slot)[2].numpy()[0, 0]]
    expected = [ref_dec.forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1]]
    far = [exact.forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1]]
    for pos, token in zip(range(len(prompt), ctx), (11, 60, 2, 33, 5, 17)):
        t, p = np.array([[token]], np.int32), np.array([[pos]], np.int32)
        got.append(net.step(t, p).numpy()[0, 0])
        expected.append(ref_dec.forward(t, p)[0, -1])
        far.append(exact.forward(t, p)[0, -1])
    np.testing.assert_allclose(np.stack(got), np.stack(expected), rtol=0, atol=2e-5)  # measured: under 3e-6
    assert np.abs(np.stack(far) - np.stack(expected)).max() > 1e-4  # float16 caches move them 2-4e-4 here
    k_type, v_type = net.k[0].dtype, net.v[0].dtype
    assert (str(k_type), str(v_type)) == tuple({"f16": "float16", "f32": "float32"}[c] for c in cache_types)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("cache_types", [("f16", "f16"), ("f16", "f32"), ("f32", "f16")])
@pytest.mark.parametrize("slot", [None, 0])
def test_float16_caches_equal_the_reference_that_rounds_what_it_caches(sim, n, cache_types, slot):
    check_float16_caches(sim(n), cache_types, slot)


def test_float16_caches_on_the_cuda_backend(cuda2):
    """The same on the CUDA backend (the CuPy stand-in without a GPU): its products widen the
    float16 rows themselves."""
    check_float16_caches(cuda2, ("f16", "f16"))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_prefill_of_the_last_tokens_only_gives_their_rows_of_the_whole_logits(sim, n):
    """step(last=...) computes the head for one token per row: those rows of the reference's
    logits over every token (different rows of a batch at different tokens)."""
    weights = random_weights(GQA_CFG, seed=4)
    prompts, positions = np.array([[3, 70, 15, 8, 41], [9, 2, 66, 1, 0]]), np.tile(np.arange(5), (2, 1))
    whole = ReferenceDecoder(GQA_CFG, weights, 16, batch=2).forward(prompts, positions)
    net = TensorParallelLlama(sim(n), GQA_CFG, weights.__getitem__, 16, batch=2)
    got = net.step(prompts, positions, last=[4, 2]).numpy()
    assert got.shape == (2, 1, GQA_CFG.vocab)
    np.testing.assert_allclose(got[:, 0], [whole[0, 4], whole[1, 2]], rtol=2e-4, atol=2e-4)
    mine = ReferenceDecoder(GQA_CFG, weights, 16, batch=2).forward(prompts, positions, last=[4, 2])
    np.testing.assert_allclose(mine[:, 0], [whole[0, 4], whole[1, 2]], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_sequences_prefilled_into_their_own_slots_decode_as_if_alone(sim, n):
    """A server's slots: prompts of different lengths prefilled one at a time into batch rows
    (prefill with slot=), then decoded together, each row at its own position, equal the reference
    run on each sequence alone; a row not prefilled yet takes no harm from the others."""
    weights = random_weights(GQA_CFG, seed=12)
    ctx, prompts = 16, {2: [3, 70, 15, 8, 41], 0: [9, 2, 66]}
    net = TensorParallelLlama(sim(n), GQA_CFG, weights.__getitem__, ctx, batch=3)
    refs = {slot: ReferenceDecoder(GQA_CFG, weights, ctx) for slot in prompts}
    for slot, prompt in prompts.items():
        got = net.prefill([prompt], 0, pool=1, logits=True, slot=slot)[2].numpy()[0, 0]
        want = refs[slot].forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1]
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    tokens = {2: [11, 60, 2], 0: [33, 7, 5]}
    for step in range(3):
        at = {slot: len(prompts[slot]) + step for slot in prompts}
        t = np.array([[tokens[s][step]] if s in prompts else [0] for s in range(3)], np.int32)
        p = np.array([[at[s]] if s in prompts else [0] for s in range(3)], np.int32)
        logits = net.step(t, p).numpy()
        for slot in prompts:
            want = refs[slot].forward(t[slot : slot + 1], p[slot : slot + 1])[0, -1]
            np.testing.assert_allclose(logits[slot, 0], want, rtol=2e-4, atol=2e-4)


def test_a_prompt_is_padded_by_at_most_a_quarter_within_the_room_left():
    from models.llama import padded_length

    lengths = {1: 8, 8: 8, 9: 16, 16: 16, 17: 24, 33: 40, 64: 64, 65: 80, 100: 112, 128: 128, 129: 160, 1000: 1024}
    assert {t: padded_length(t, 4096) for t in lengths} == lengths
    assert padded_length(100, 105) == 105 and padded_length(100, 100) == 100


@pytest.mark.parametrize("n", [1, 2, 3])
def test_padded_prefills_replay_one_plan_and_equal_the_reference(sim, n):
    """Prompts of 5 and 3 tokens, then of 7 and 6, are padded to 8 tokens: the second pair
    replays the first's captured step (no new plan). Every logit equals the reference run on the
    unpadded prompt, and so does decoding after it: the padding's cache writes past each prompt
    are never read. A continuation near the end of the context pads only to what fits."""
    weights = random_weights(GQA_CFG, seed=21)
    ctx, rng = 40, np.random.default_rng(3)
    dev = sim(n)
    net = TensorParallelLlama(dev, GQA_CFG, weights.__getitem__, ctx, batch=2)

    def check(prompts, start, refs):
        values, indices, logits = net.prefill(prompts, start, pool=4, logits=True)
        got = logits.numpy()[:, 0]
        for b, prompt in enumerate(prompts):
            want = refs[b].forward(np.array([prompt]), np.arange(start, start + len(prompt))[None])[0, -1]
            np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-4)
            np.testing.assert_array_equal(indices.numpy()[b, 0], np.argsort(-want, kind="stable")[:4])
            np.testing.assert_allclose(values.numpy()[b, 0], np.sort(want)[::-1][:4], rtol=2e-4, atol=2e-4)

    refs = [ReferenceDecoder(GQA_CFG, weights, ctx) for _ in range(2)]
    check([list(rng.integers(0, 72, 5)), list(rng.integers(0, 72, 3))], 0, refs)
    plans = len(dev.plans)
    for step in range(3):  # decoding reads the caches the padded prefill wrote
        tokens, at = np.array([[7 + step], [50 - step]], np.int32), np.array([[5 + step], [3 + step]], np.int32)
        logits = net.step(tokens, at).numpy()
        for b in range(2):
            want = refs[b].forward(tokens[b : b + 1], at[b : b + 1])[0, -1]
            np.testing.assert_allclose(logits[b, 0], want, rtol=2e-4, atol=2e-4)
    plans = len(dev.plans)
    refs = [ReferenceDecoder(GQA_CFG, weights, ctx) for _ in range(2)]
    check([list(rng.integers(0, 72, 7)), list(rng.integers(0, 72, 6))], 0, refs)
    assert len(dev.plans) == plans  # the 8-token step replayed
    # row 0 goes on from its 7 cached tokens (row 1 gets padding only)
    check([list(rng.integers(0, 72, 5))], 7, refs)  # padded to 8
    check([list(rng.integers(0, 72, 16))], 12, refs)  # 16: no padding
    check([list(rng.integers(0, 72, 5))], 28, refs)  # padded to 8
    check([list(rng.integers(0, 72, 6))], 33, refs)  # 7 positions left: padded to 7
    with pytest.raises(ShapeError, match="prefill: 1 prompts of up to 8 tokens from position 33"):
        net.prefill([[1] * 8], 33, pool=4)


@pytest.mark.parametrize("n", [1, 2])
def test_warmed_up_steps_run_nothing_until_called_then_plan_nothing_and_equal_the_reference(sim, n):
    """warm_up loads the prefill step of every padded length within a 40-position context (8,
    16, 24, 32 and 40) and prepare_decode the decode step, without running them: the caches keep their
    handles and stay zero. The prompts and decoding after it plan nothing, and their
    candidates equal the reference's."""
    weights = random_weights(GQA_CFG, seed=25)
    ctx, rng = 40, np.random.default_rng(7)
    dev = sim(n)
    net = TensorParallelLlama(dev, GQA_CFG, weights.__getitem__, ctx, batch=2)
    caches = net.caches()
    assert net.warm_up(pool=4) == 5
    assert [key[0] for key in net._prefills] == [8, 16, 24, 32, 40]  # the longest (the chunks') the last evicted
    decode = net.prepare_decode(2, build=lambda logits: list(logits.top_k(4)))
    assert all(a is b for a, b in zip(net.caches(), caches, strict=True))
    assert not any(np.any(c.numpy()) for c in caches)  # nothing ran
    plans = len(dev.plans)
    refs = [ReferenceDecoder(GQA_CFG, weights, ctx) for _ in range(2)]

    def best(logits):
        return np.argsort(-logits, kind="stable")[:4]

    prompts = [list(rng.integers(0, 72, 20)), list(rng.integers(0, 72, 7))]  # padded to 24
    indices = net.prefill(prompts, 0, pool=4)[1].numpy()
    for b, prompt in enumerate(prompts):
        want = refs[b].forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1]
        np.testing.assert_array_equal(indices[b, 0], best(want))
    tokens, at = np.array([[7], [50]], np.int32), np.array([[20], [7]], np.int32)
    indices = decode(tokens, at)[1].numpy()
    for b in range(2):
        np.testing.assert_array_equal(indices[b, 0], best(refs[b].forward(tokens[b : b + 1], at[b : b + 1])[0, -1]))
    assert len(dev.plans) == plans
    # a server's slots: the row fed, a prompt from position 0 and one going on from further on
    assert net.warm_up(pool=4, lengths=[5], slots=True) == 2
    plans = len(dev.plans)
    refs[1] = ReferenceDecoder(GQA_CFG, weights, ctx)
    prompt, rest = list(rng.integers(0, 72, 5)), list(rng.integers(0, 72, 3))
    indices = net.prefill([prompt], 0, pool=4, slot=1)[1].numpy()
    np.testing.assert_array_equal(indices[0, 0], best(refs[1].forward(np.array([prompt]), np.arange(5)[None])[0, -1]))
    indices = net.prefill([rest], 5, pool=4, slot=1)[1].numpy()  # the rest of a prompt the row holds 5 of
    np.testing.assert_array_equal(indices[0, 0], best(refs[1].forward(np.array([rest]), np.arange(5, 8)[None])[0, -1]))
    assert len(dev.plans) == plans


@pytest.mark.parametrize("n", [1, 3])
def test_long_prompts_go_in_chunks_that_equal_the_reference(sim, n, monkeypatch):
    """With 16-token chunks: prompts of 37 and 45 tokens go as two 16-token steps and one padded
    to 16 holding both last tokens; prompts of 20 and 60 as one chunk and a last step of 44;
    a continuation of 30 tokens from position 45 in chunks too. Every logit equals the reference
    run on the whole prompt, decoding after it too, and a single prompt of any length needs
    steps of 16 tokens or fewer only."""
    import models.llama

    monkeypatch.setattr(models.llama, "PREFILL_CHUNK", 16)
    weights = random_weights(GQA_CFG, seed=23)
    ctx, rng = 96, np.random.default_rng(5)
    net = TensorParallelLlama(sim(n), GQA_CFG, weights.__getitem__, ctx, batch=2)

    def check(prompts, start, refs):
        logits = net.prefill(prompts, start, pool=4, logits=True)[2].numpy()[:, 0]
        for b, prompt in enumerate(prompts):
            want = refs[b].forward(np.array([prompt]), np.arange(start, start + len(prompt))[None])[0, -1]
            np.testing.assert_allclose(logits[b], want, rtol=2e-4, atol=2e-4)

    refs = [ReferenceDecoder(GQA_CFG, weights, ctx) for _ in range(2)]
    check([list(rng.integers(0, 72, 37)), list(rng.integers(0, 72, 45))], 0, refs)
    assert {key[0] for key in net._prefills} == {16}
    tokens, at = np.array([[7], [50]], np.int32), np.array([[37], [45]], np.int32)
    logits = net.step(tokens, at).numpy()  # decoding reads what every chunk cached
    for b in range(2):
        want = refs[b].forward(tokens[b : b + 1], at[b : b + 1])[0, -1]
        np.testing.assert_allclose(logits[b, 0], want, rtol=2e-4, atol=2e-4)
    check([list(rng.integers(0, 72, 30))], 38, refs)  # row 0 goes on, from its 38 cached tokens
    assert {key[0] for key in net._prefills} == {16}
    refs = [ReferenceDecoder(GQA_CFG, weights, ctx) for _ in range(2)]
    check([list(rng.integers(0, 72, 20)), list(rng.integers(0, 72, 60))], 0, refs)
    assert max(key[0] for key in net._prefills) == 48  # the last step holds both last tokens: 4 and 44


@pytest.mark.parametrize("n", [1, 2, 3])
def test_padded_prefills_into_slots_leave_the_other_rows_and_equal_the_reference(sim, n):
    """A server's slots through captured, padded prefills: a prompt into slot 1, then prompts of
    5 and 3 tokens into slots 2 and 0, then decoding all three; then slot 2 takes a new prompt
    of 6 tokens (the same padded step, no new plan) while slot 1 goes on. Every logit equals
    the reference run on each sequence alone."""
    weights = random_weights(GQA_CFG, seed=17)
    ctx, rng = 24, np.random.default_rng(5)
    dev = sim(n)
    net = TensorParallelLlama(dev, GQA_CFG, weights.__getitem__, ctx, batch=3)
    refs, at = {}, {}

    def admit(slot, length):
        prompt = [int(x) for x in rng.integers(0, 72, length)]
        refs[slot], at[slot] = ReferenceDecoder(GQA_CFG, weights, ctx), length
        want = refs[slot].forward(np.array([prompt]), np.arange(length)[None])[0, -1]
        values, indices, logits = net.prefill([prompt], 0, pool=3, logits=True, slot=slot)
        np.testing.assert_allclose(logits.numpy()[0, 0], want, rtol=2e-4, atol=2e-4)
        np.testing.assert_array_equal(indices.numpy()[0, 0], np.argsort(-want, kind="stable")[:3])

    def decode():
        t = np.array([[int(rng.integers(0, 72))] for _ in range(3)], np.int32)
        p = np.array([[at[s]] for s in range(3)], np.int32)
        logits = net.step(t, p).numpy()
        for slot in refs:
            want = refs[slot].forward(t[slot : slot + 1], p[slot : slot + 1])[0, -1]
            np.testing.assert_allclose(logits[slot, 0], want, rtol=2e-4, atol=2e-4)
            at[slot] += 1

    admit(1, 7)
    admit(2, 5)
    admit(0, 3)
    decode()
    decode()
    plans = len(dev.plans)
    admit(2, 6)
    assert len(dev.plans) == plans  # slot 2's 8-token step replayed
    decode()
    with pytest.raises(ShapeError, match="prefill of slot 3: a slot is one of the rows 0..2"):
        net.prefill([[1, 2]], 0, pool=3, slot=3)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_new_prompts_of_several_slots_go_in_one_step_and_leave_the_other_rows(sim, n):
    """A server's burst: slot 0 holds a sequence; prompts of 5, 9 and 3 tokens go into slots 1,
    2 and 3 in one prefill (one step of three rows, padded to 16; slot 2 held another prompt).
    Each row's logits equal the reference on its prompt alone; then all four rows decode as the
    reference does (slot 0 untouched by the step). Several slots take new prompts only: from
    position 0, within the slots there are."""
    weights = random_weights(GQA_CFG, seed=31)
    ctx, rng = 32, np.random.default_rng(11)
    dev = sim(n)
    net = TensorParallelLlama(dev, GQA_CFG, weights.__getitem__, ctx, batch=4)
    prompts = [[int(x) for x in rng.integers(0, 72, length)] for length in (6, 5, 9, 3)]
    refs = [ReferenceDecoder(GQA_CFG, weights, ctx) for _ in range(4)]
    at = [len(prompt) for prompt in prompts]
    wants = [r.forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1] for r, prompt in zip(refs, prompts)]
    net.prefill([prompts[0]], 0, pool=3, slot=0)
    net.prefill([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], 0, pool=3, slot=2)  # until the burst writes slot 2
    plans = len(dev.plans)
    values, indices, logits = (t.numpy() for t in net.prefill(prompts[1:], 0, pool=3, logits=True, slot=1))
    assert len(dev.plans) == plans + 3  # one step of three slots: the embedding, one layer, the head
    assert logits.shape == (3, 1, GQA_CFG.vocab) and indices.shape == (3, 1, 3)
    for row, b in enumerate((1, 2, 3)):
        np.testing.assert_allclose(logits[row, 0], wants[b], rtol=2e-4, atol=2e-4)
        np.testing.assert_array_equal(indices[row, 0], np.argsort(-wants[b], kind="stable")[:3])
    for _ in range(2):
        tokens = np.array([[int(rng.integers(0, 72))] for _ in range(4)], np.int32)
        got = net.step(tokens, np.array([[a] for a in at], np.int32)).numpy()
        for b in range(4):
            want = refs[b].forward(tokens[b : b + 1], np.array([[at[b]]]))[0, -1]
            np.testing.assert_allclose(got[b, 0], want, rtol=2e-4, atol=2e-4)
            at[b] += 1
    with pytest.raises(ShapeError, match="several slots take new prompts only"):
        net.prefill([[1, 2], [3]], 4, pool=3, slot=1)
    with pytest.raises(ShapeError, match="prefill of slot 2 and the 2 after it: a slot is one of the rows 0..3"):
        net.prefill([[1], [2], [3]], 0, pool=3, slot=2)


@pytest.mark.parametrize("n", [1, 3])
def test_a_slots_prompt_in_chunks_reads_its_earlier_chunks_from_its_row(sim, n):
    """A server's chunked prefill: a 21-token prompt given to slot 1 in three calls (positions
    0, 8 and 16 on), while slot 0 holds another sequence: each chunk attends to the row's cache
    up to its positions; the last chunk's logits are the reference's on the whole prompt, and
    slot 0 decodes on as if alone."""
    weights = random_weights(GQA_CFG, seed=21)
    ctx, rng = 32, np.random.default_rng(9)
    net = TensorParallelLlama(sim(n), GQA_CFG, weights.__getitem__, ctx, batch=2)
    other = [int(x) for x in rng.integers(0, 72, 6)]
    net.prefill([other], 0, pool=1, slot=0)
    prompt = [int(x) for x in rng.integers(0, 72, 21)]
    for at in (0, 8, 16):
        logits = net.prefill([prompt[at : at + 8]], at, pool=1, logits=True, slot=1)[2].numpy()[0, 0]
    want = ReferenceDecoder(GQA_CFG, weights, ctx).forward(np.array([prompt]), np.arange(21)[None])[0, -1]
    np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-4)
    ref = ReferenceDecoder(GQA_CFG, weights, ctx)
    ref.forward(np.array([other]), np.arange(6)[None])
    got = net.step(np.array([[5], [7]], np.int32), np.array([[6], [21]], np.int32)).numpy()
    np.testing.assert_allclose(got[0, 0], ref.forward(np.array([[5]]), np.array([[6]]))[0, -1], rtol=2e-4, atol=2e-4)


def test_a_cache_write_past_the_context_is_an_error(sim):
    dev = sim(2)
    net = TensorParallelLlama(dev, GQA_CFG, random_weights(GQA_CFG, seed=1).__getitem__, 8)
    step, _ = net.capture_decode(np.array([[1]]), np.array([[7]]))  # the last position: fine
    with pytest.raises(ShapeError, match=r"ids must lie in \[0, 8\), got \[8, 8\]"):
        step(np.array([[1]], np.int32), np.array([[8]], np.int32))


@pytest.mark.parametrize(
    "fed, says", [(np.float64(0.5), "got () float64"), (np.array([0.5], np.float32), "got (1,) float32")]
)
def test_a_captured_step_refuses_a_feed_of_another_dtype_or_shape_and_stays_usable(sim, fed, says):
    """Its program was planned and compiled for the captured feeds' dtype and shape: another is
    refused by name before anything is sent, and the step replays as before afterwards."""
    dev = sim(2)
    x = dev.tensor(np.arange(6, dtype=np.float32))
    step, _ = dev.capture(lambda f: [x * f], np.float32(2.0))
    with pytest.raises(ShapeError, match=re.escape(f"a feed of () float32 {says}")):
        step(fed)
    (again,) = step(np.float32(3.0))
    np.testing.assert_array_equal(again.numpy(), np.arange(6, dtype=np.float32) * np.float32(3))


def test_a_captured_step_survives_a_plan_cache_overflow(sim):
    dev = sim(2)
    dev.max_plans = 2
    x = dev.tensor(np.arange(6, dtype=np.float32))
    step, (first,) = dev.capture(lambda f: [(x * f).exp()], np.float32(0.5))
    loaded = [s["programs"] for s in dev.stats().values()]
    for k in range(6):  # six other plans through a cache of two
        dev.run(x.reshape(2, 3).sum(axis=k % 2) + float(k) if k < 2 else (x + float(k)).reshape(3, 2) * 2.0)
        dev.run(x[: k + 1] * 3.0)
    assert [s["programs"] for s in dev.stats().values()] <= [max(loaded) + 2] * 2
    (again,) = step(np.float32(0.25))
    np.testing.assert_allclose(again.numpy(), np.exp(np.arange(6) * 0.25), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("check_mirrored", [True, False])
def test_outputs_read_with_a_replayed_run_need_no_round_trip_and_equal_numpy(sim, n, check_mirrored):
    """Step(..., read=...) brings those outputs back in the run's replies: Mirrored from rank 0
    only (from every rank when copies are checked), Split (uneven) and Partial from every
    rank, gathered; reading them then sends nothing. Outputs not asked for are read as before."""
    dev = sim(n, check_mirrored=check_mirrored)
    rows = [5] + [0] * (n - 1)  # uneven: everything on rank 0
    x = dev.tensor(np.arange(15, dtype=np.float32).reshape(3, 5), Split(1, (tuple(rows),)))
    w = dev.tensor(np.arange(10, dtype=np.float32).reshape(5, 2) / 10, Split.even(0, 5, n))

    def graph(f):
        y = x * f
        return [y, (y @ w).redistribute(MIRRORED), y @ w, y.exp()]  # split, mirrored, partial, split

    step, _ = dev.capture(graph, np.float32(2.0))
    calls, sent = dev.cluster.call_all, []

    def spy(messages, *a, **k):
        sent.append(messages)
        return calls(messages, *a, **k)

    dev.cluster.call_all = spy
    y, mirrored, partial, exp = step(np.float32(0.5), read=(0, 1, 2))
    (run,) = sent
    asked = {d: m.read for d, m in run.items()}
    assert all(isinstance(m, p.RunProgram) for m in run.values())
    if n > 1:
        assert all(mirrored.node.tensor in asked[d] for d in range(n)) == check_mirrored
        assert all(y.node.tensor in asked[d] and partial.node.tensor in asked[d] for d in range(n))
    assert all(exp.node.tensor not in asked[d] for d in range(n))
    host = np.arange(15, dtype=np.float32).reshape(3, 5) * 0.5
    product = host @ (np.arange(10, dtype=np.float32).reshape(5, 2) / 10)
    np.testing.assert_array_equal(y.numpy(), host)
    np.testing.assert_allclose(mirrored.numpy(), product, rtol=1e-6)
    np.testing.assert_allclose(partial.numpy(), product, rtol=1e-6)
    assert len(sent) == 1, "read with the run: no Get"
    np.testing.assert_allclose(exp.numpy(), np.exp(host), rtol=1e-6)
    assert len(sent) > 1 and isinstance(next(iter(sent[1].values())), p.Get)


def test_a_value_read_with_a_run_is_not_served_after_an_in_place_write(sim):
    dev = sim(2)
    x = dev.tensor(np.arange(6, dtype=np.float32).reshape(3, 2), Split.even(0, 3, 2))
    step, _ = dev.capture(lambda f: [x * f], np.float32(1.0))
    (y,) = step(np.float32(2.0), read=(0,))
    np.testing.assert_array_equal(y.numpy(), np.arange(6).reshape(3, 2) * 2.0)
    dev.run(y.set_rows(dev.tensor(np.array([1], np.int32)), dev.tensor(np.full((1, 2), -1, np.float32)), axis=0))
    np.testing.assert_array_equal(y.numpy(), [[0, 2], [-1, -1], [8, 10]])  # the handle sees the write


def test_reading_an_output_written_in_place_or_out_of_range_with_the_run_is_refused(sim):
    dev = sim(2)
    cache = dev.tensor(np.zeros((4, 2), np.float32), Split.even(0, 4, 2))
    ones = dev.tensor(np.ones((1, 2), np.float32))

    def graph(ids):
        written = cache.set_rows(ids, ones, axis=0)
        return [written * 2.0, written]

    step, _ = dev.capture(graph, np.array([0], np.int32))
    for bad in (1, 2, -1, "0"):
        with pytest.raises(ShapeError, match="cannot read output"):
            step(np.array([1], np.int32), read=(bad,))
    doubled, written = step(np.array([2], np.int32), read=(0,))
    np.testing.assert_array_equal(doubled.numpy(), [[2, 2], [0, 0], [2, 2], [0, 0]])
    np.testing.assert_array_equal(written.numpy(), [[1, 1], [0, 0], [1, 1], [0, 0]])


def test_a_run_reading_a_tensor_it_does_not_make_is_refused_and_the_step_still_runs(sim):
    dev = sim(2)
    x = dev.tensor(np.arange(4, dtype=np.float32), Split.even(0, 4, 2))
    step, _ = dev.capture(lambda f: [x * f], np.float32(1.0))
    calls, sent = dev.cluster.call_all, []
    dev.cluster.call_all = lambda messages, *a, **k: sent.append(messages) or calls(messages, *a, **k)
    step(np.float32(2.0), read=(0,))
    dev.cluster.call_all = calls
    bad = {d: dataclasses.replace(m, run=m.run + 100, release=[], read=[10**9]) for d, m in sent[0].items()}
    replies = calls(bad)
    assert all(isinstance(r, p.Error) and "not all among its outputs" in r.message for r in replies.values())
    (y,) = step(np.float32(3.0), read=(0,))
    np.testing.assert_array_equal(y.numpy(), np.arange(4) * 3.0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_step_over_the_first_rows_decodes_them_alone_and_leaves_the_rest(sim, n):
    """A server decodes its busy slots only: a step of 2 rows over caches of 4 equals the
    reference for those 2 sequences, and the sequence in row 3, not stepped meanwhile, decodes
    afterwards as if nothing had happened."""
    weights = random_weights(GQA_CFG, seed=13)
    ctx, prompts = 16, {0: [9, 2, 66], 1: [3, 70, 15, 8], 3: [41, 5]}
    dev = sim(n)
    net = TensorParallelLlama(dev, GQA_CFG, weights.__getitem__, ctx, batch=4)
    refs = {slot: ReferenceDecoder(GQA_CFG, weights, ctx) for slot in prompts}
    for slot, prompt in prompts.items():
        net.prefill([prompt], 0, pool=1, slot=slot)
        refs[slot].forward(np.array([prompt]), np.arange(len(prompt))[None])
    at = {slot: len(prompt) for slot, prompt in prompts.items()}

    def check(rows, tokens):
        t = np.array([[tokens[s]] if s in tokens else [0] for s in range(rows)], np.int32)
        p = np.array([[at[s]] if s in tokens else [0] for s in range(rows)], np.int32)
        logits = net.step(t, p).numpy()
        assert logits.shape == (rows, 1, GQA_CFG.vocab)
        for slot in tokens:
            want = refs[slot].forward(t[slot : slot + 1], p[slot : slot + 1])[0, -1]
            np.testing.assert_allclose(logits[slot, 0], want, rtol=2e-4, atol=2e-4)
            at[slot] += 1

    before = net.k[0].numpy()
    check(2, {0: 11, 1: 60})
    check(2, {0: 7, 1: 2})
    after = net.k[0].numpy()
    np.testing.assert_array_equal(after[2:], before[2:])  # rows past the step's: not written
    assert not after[2].any()
    check(4, {0: 33, 1: 5, 3: 19})  # row 3 kept its prompt through the 2-row steps
