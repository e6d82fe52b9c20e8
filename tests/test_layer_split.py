"""The decoder split by layers (`LayerGroups`, llama.cpp's -sm layer): consecutive layers on
groups of the workers, each split over its group only, against the single-process NumPy
decoder (models/llama.py ReferenceDecoder) and against the same model split by rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from models.llama import LayerGroups, LlamaConfig, ReferenceDecoder, TensorParallelLlama, random_weights
from split_state import Collective
from split_state.layout import local_shape
from split_state.states import Mirrored
from split_state.transitions import classify
from transport import protocol as p

pytestmark = pytest.mark.timeout(300)

CFG = LlamaConfig(hidden=64, layers=4, heads=8, kv_heads=2, ffn=48, vocab=72, rope_base=30000.0)
PROMPT = np.array([[3, 70, 15, 8, 41]])
CASES = {  # workers -> layer groups: one worker a group, two of two, one of three and three layers a group
    2: LayerGroups(((0,), (1,))),
    4: LayerGroups(((0, 1), (2, 3))),
    3: LayerGroups(((0,), (1,), (2,))),
}


def test_layer_groups_are_checked_and_spread_the_layers_in_runs():
    groups = LayerGroups.even(4, 2)
    assert groups.groups == ((0, 1), (2, 3)) and groups.size == 2
    assert [groups.of_layer(i, 5) for i in range(5)] == [(0, 1)] * 3 + [(2, 3)] * 2
    for bad in [((0, 1), (2,)), ((0,), (0,)), ((1,), (2,)), ((1, 0), (2, 3)), ()]:
        with pytest.raises(ValueError):
            LayerGroups(bad)
    with pytest.raises(ValueError):
        LayerGroups.even(3, 2)


def _counted(obj, name: str) -> list[int]:
    """Each call's count of prompts to obj.name (first argument), as it is called."""
    calls, method = [], getattr(obj, name)

    def counting(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return method(prompts, *args, **kwargs)

    setattr(obj, name, counting)
    return calls


def _most_cost(counts, costs, head) -> int:
    """The busiest group's cost with `counts` layers a group, the head on the last."""
    bounds = np.cumsum([0, *counts])
    loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    loads[-1] += head
    return max(loads)


def test_balanced_groups_hold_the_cut_whose_busiest_group_costs_least():
    """Against every cut tried (the oracle: brute force over where the groups begin)."""
    import itertools

    rng = np.random.default_rng(3)
    for count, layers in [(2, 6), (3, 7), (4, 9), (2, 2)]:
        for _ in range(20):
            costs = rng.integers(1, 50, layers).tolist()
            head = int(rng.integers(0, 120))
            got = LayerGroups.even(count, count).balanced(costs, head).counts
            assert sum(got) == layers and min(got) >= 1

            cuts = itertools.combinations(range(1, layers), count - 1)
            best = min(_most_cost(np.diff([0, *c, layers]).tolist(), costs, head) for c in cuts)
            assert _most_cost(got, costs, head) == best, (costs, head, got)
    groups = LayerGroups(((0,), (1,)), (3, 1))
    assert [groups.of_layer(i, 4) for i in range(4)] == [(0,)] * 3 + [(1,)]
    with pytest.raises(ValueError, match="for 5 layers"):
        groups.of_layer(0, 5)
    for bad in [(4,), (0, 4), (1, 2, 1)]:
        with pytest.raises(ValueError, match="layer counts"):
            LayerGroups(((0,), (1,)), bad)
    assert LayerGroups.even(3, 3).balanced([1, 1], 0) == LayerGroups.even(3, 3)  # fewer layers than groups


@pytest.mark.parametrize("n", sorted(CASES))
def test_layers_on_groups_equal_the_reference_prefill_and_decode(sim, n):
    weights = random_weights(CFG, seed=4)
    ctx = 16
    ref_dec = ReferenceDecoder(CFG, weights, ctx)
    groups = CASES[n]
    dev = sim(n)
    net = TensorParallelLlama(dev, CFG, weights.__getitem__, ctx, layer_groups=groups)
    # each layer's cache is held by its group only, split by KV heads inside it
    for i in range(CFG.layers):
        group = groups.of_layer(i, CFG.layers)
        assert net.k[i].state.on == (None if len(group) == n else group)
        held = [local_shape(net.k[i].state, net.k[i].shape, n, d)[1] for d in range(n)]
        assert [h > 0 for h in held] == [d in group for d in range(n)], (i, held)
    expected = [ref_dec.forward(PROMPT, np.arange(5)[None])[0, -1]]
    got = [net.step(PROMPT, np.arange(5)[None])[:, 4:].numpy()[0, 0]]
    for pos, token in zip(range(5, 9), (11, 60, 2, 33)):
        expected.append(ref_dec.forward(np.array([[token]]), np.array([[pos]]))[0, -1])
        got.append(net.step(np.array([[token]]), np.array([[pos]])).numpy()[0, 0])
    np.testing.assert_allclose(np.stack(got), np.stack(expected), rtol=2e-4, atol=2e-4)
    # one hand-over a group boundary (the residual), the head's logits read from its group
    plan = dev.last_plan
    hand_overs = [s for s in plan.steps if isinstance(s, p.MoveStep) and classify(s.src, s.dst) is Collective.HAND_OVER]
    assert [(s.src.on, s.dst, s.shape) for s in hand_overs] == [
        (a, Mirrored(on=b), (1, 1, CFG.hidden)) for a, b in zip(groups.groups, groups.groups[1:])
    ]


@pytest.mark.parametrize("n", [2, 4])
def test_greedy_tokens_equal_the_row_split_and_the_candidates_reach_every_worker(sim, n):
    weights = random_weights(CFG, seed=6)
    ctx = 24
    tokens = {}
    for split in ("row", "layer"):
        dev = sim(n)
        groups = CASES[n] if split == "layer" else None
        net = TensorParallelLlama(dev, CFG, weights.__getitem__, ctx, layer_groups=groups)
        step, (ids, *_) = net.capture_decode(np.array([[3]], np.int32), np.array([[0]], np.int32))
        assert ids.state.on is None  # the chosen token on every worker
        seq = [int(ids.numpy().reshape(-1)[0])]
        for pos in range(1, 12):
            ids, *_ = step(np.array([[seq[-1]]], np.int32), np.array([[pos]], np.int32))
            seq.append(int(ids.numpy().reshape(-1)[0]))
        tokens[split] = seq
    assert tokens["layer"] == tokens["row"] and len(set(tokens["row"])) > 2, tokens


def test_a_layer_split_on_worker_processes_over_tcp(procs3_tcp):
    weights = random_weights(CFG, seed=8)
    ctx = 12
    ref_dec = ReferenceDecoder(CFG, weights, ctx)
    net = TensorParallelLlama(procs3_tcp, CFG, weights.__getitem__, ctx, layer_groups=CASES[3])
    got = net.step(PROMPT, np.arange(5)[None])[:, 4:].numpy()[0, 0]
    np.testing.assert_allclose(got, ref_dec.forward(PROMPT, np.arange(5)[None])[0, -1], rtol=2e-4, atol=2e-4)


def test_one_worker_a_group_computes_what_one_worker_alone_does_bit_for_bit(sim):
    """On groups of one worker every product is whole, as on a single worker: the same
    arithmetic in the same order, so the logits are equal bit for bit (row split's partial
    sums would not be)."""
    weights = random_weights(CFG, seed=11)
    alone = TensorParallelLlama(sim(1), CFG, weights.__getitem__, 12)
    split = TensorParallelLlama(sim(2), CFG, weights.__getitem__, 12, layer_groups=CASES[2])
    np.testing.assert_array_equal(
        split.step(PROMPT, np.arange(5)[None]).numpy(), alone.step(PROMPT, np.arange(5)[None]).numpy()
    )
    token = np.array([[7]])
    np.testing.assert_array_equal(split.step(token, [[5]]).numpy(), alone.step(token, [[5]]).numpy())


def test_generate_and_serve_split_by_layers_give_one_workers_tokens(model):
    """The SmolLM2 file through LLM (generate) and the ContinuousBatcher (serve), split by layers
    over 2 workers (one a group: the same arithmetic as one worker, 8-bit activations and all),
    against one worker's greedy tokens."""
    from meta import MetaDevice
    from models.batching import ContinuousBatcher, Job, Token
    from models.generate import LLM
    from models.requests import Sampling
    from workers.simulator import SimulatedCluster

    prompt, other = "The capital of France is", "Once upon a time"
    one = MetaDevice(SimulatedCluster(1))
    try:
        (expected,) = LLM(one, model, ctx=48).generate([prompt], 12, stop_at_eos=False)
        both = LLM(one, model, ctx=48, batch=2).generate([prompt, other], 12, stop_at_eos=False)
    finally:
        one.close()
    dev = MetaDevice(SimulatedCluster(2))
    try:
        llm = LLM(dev, model, ctx=48, batch=2, split="layer")
        assert llm.net.layer_groups.groups == ((0,), (1,))
        assert llm.net.layer_groups.counts == (19, 11)  # the head's work is ~8 of SmolLM2's 30 layers
        (got,) = llm.generate([prompt], 12, stop_at_eos=False)
        assert got.tokens == expected.tokens and len(set(got.tokens)) > 2
        # two prompts: a lane each, pipelined (workers/pipelined.py), twice
        assert llm.net.lanes(2) == [range(0, 1), range(1, 2)]
        llm.warm_up()  # a lane's step for each prompt row, loaded; the generations below run them
        warmed = set(llm._steps)  # (first row, rows, a lane's, pool)
        in_lanes = _counted(llm.net, "prefill_in_lanes")
        assert sorted(key[:2] for key in warmed if key[2]) == [(0, 1), (1, 1)]
        for _ in range(2):
            assert [g.tokens for g in llm.generate([prompt, other], 12, stop_at_eos=False)] == [g.tokens for g in both]
        assert set(llm._steps) == warmed and in_lanes == [2, 2]  # none captured anew; the prompts went in lanes too
        del llm
        batcher = ContinuousBatcher(dev, model, slots=2, ctx=48, split="layer")
        batcher.start()
        try:
            job = Job(tuple(expected.prompt_tokens), 12, Sampling(), stop_at_eos=False)
            served = [e.token for e in batcher.submit(job).stream(timeout=120) if isinstance(e, Token)]
        finally:
            batcher.stop()
    finally:
        dev.close()
    assert served == expected.tokens


def test_a_servers_batch_split_by_layers_decodes_in_lanes_with_each_jobs_own_tokens(model):
    """Three jobs served together on two groups of one worker: rows 0-1 and 2 in two lanes (their
    steps captured apart, workers/pipelined.py), the first two prompts prefilled in lanes too,
    each job's tokens those it gets alone on one worker, greedy and sampled (its own generator),
    and with log-probabilities."""
    from meta import MetaDevice
    from models.batching import ContinuousBatcher, Job, Token
    from models.generate import LLM
    from models.requests import Sampling
    from workers.simulator import SimulatedCluster

    sampled = Sampling(temperature=0.8, top_k=30, seed=9)
    one = MetaDevice(SimulatedCluster(1))
    try:
        llm = LLM(one, model, ctx=48)
        greedy = llm.generate(["The capital of France is"], 10, stop_at_eos=False)[0]
        drawn = llm.generate(["Once upon a time"], 10, sampled, stop_at_eos=False)[0]
    finally:
        one.close()
    dev = MetaDevice(SimulatedCluster(2))
    try:
        batcher = ContinuousBatcher(dev, model, slots=3, ctx=48, split="layer")
        in_lanes = _counted(batcher.net, "prefill_in_lanes")
        jobs = [
            Job(tuple(greedy.prompt_tokens), 10, Sampling(), stop_at_eos=False),
            Job(tuple(drawn.prompt_tokens), 10, sampled, stop_at_eos=False),
            Job(tuple(greedy.prompt_tokens), 10, Sampling(), stop_at_eos=False, top_logprobs=2),
        ]
        tickets = [batcher.submit(job) for job in jobs]  # both queued before the batcher runs
        batcher.start()
        try:
            served = [[e for e in t.stream(timeout=120) if isinstance(e, Token)] for t in tickets]
        finally:
            batcher.stop()
        assert {key[:2] for key in batcher._decodes if key[2]} >= {(0, 2), (2, 1)}  # a step for each lane
        assert in_lanes == [2]  # the first two prompts joined in one prefill, in lanes (the third asks for logits)
        assert batcher.counters.decode_steps >= 9
    finally:
        dev.close()
    assert [e.token for e in served[0]] == greedy.tokens and [e.token for e in served[1]] == drawn.tokens
    assert [e.token for e in served[2]] == greedy.tokens
    assert all(e.logprob is not None and len(e.top) == 2 for e in served[2])


def test_prompts_prefilled_in_lanes_repeat_the_step_they_replace_bit_for_bit(model):
    """The SmolLM2 file (8-bit activations, integer products: a row's sums do not depend on
    the rows beside it) on two groups of one worker: prefill_in_lanes gives the candidates of
    `prefill` of every row (keys and values through the float16 caches) or, with `slots`, of
    the slots' first chunks (attention over their own keys and values), bit for bit; and the
    two ways agree (tests/test_llm.py: their softmax sums no longer depend on the length)."""
    from bench.hosts import PROMPT
    from meta import MetaDevice
    from models.loading import place_model
    from workers.simulator import SimulatedCluster

    prompts = [model.tokenizer.encode(p) for p in (PROMPT, "Once upon a time", PROMPT[:100])]
    got = {}
    for how in ("rows", "rows in lanes", "slots", "slots in lanes"):
        dev = MetaDevice(SimulatedCluster(2))
        try:
            net = place_model(dev, model, 64, 4, split="layer")
            if how == "rows":
                values = net.prefill(prompts, 0, 8)[0].numpy()[:3]
            elif how == "slots":
                values = net.prefill(prompts, 0, 8, slot=1)[0].numpy()
            else:
                values, _ = net.prefill_in_lanes(prompts, 8, first_row=how == "slots in lanes", slots="slots" in how)
            got[how] = values
        finally:
            dev.close()
    np.testing.assert_array_equal(got["rows in lanes"], got["rows"])
    np.testing.assert_array_equal(got["slots in lanes"], got["slots"])
    np.testing.assert_array_equal(got["rows"], got["slots"])  # one step of all three: 48 tokens padded


def test_split_options_are_checked_before_any_weight_moves(sim):
    from models.errors import ModelError
    from models.loading import layer_groups_for

    dev = sim(4)
    assert layer_groups_for(dev, "row") is None
    assert layer_groups_for(dev, "layer") == LayerGroups(((0,), (1,), (2,), (3,)))  # one host: a worker a group
    assert layer_groups_for(dev, "layer", 2) == LayerGroups(((0, 1), (2, 3)))
    for split, groups, says in [("rows", 0, "one of row, layer"), ("layer", 3, "divides"), ("row", 2, "goes with")]:
        with pytest.raises(ModelError, match=says):
            layer_groups_for(dev, split, groups)


@pytest.mark.parametrize("n, most_runs", [(2, None), (2, 10), (4, None), (4, 10), (1, None)])
def test_a_long_prompts_chunks_go_in_chains_with_one_head(sim, monkeypatch, n, most_runs):
    """A 40-token prompt in chunks of 16 (16, 16, 8) on two groups of one worker each, or of
    two (all-reduces inside each): one chain (one message a worker), so the first group goes on
    to the next chunk while the second works on the one before (pipelined), each chunk's
    positions new data, the head after the last chunk only; with at most 10 runs a chain, the
    first two chunks (5 runs each) in one and the last with the head in another. On one worker:
    a chain a chunk, the head in the last. The candidates the reference's."""
    import models.llama as llama

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 16)
    if most_runs is not None:
        monkeypatch.setattr(llama, "PREFILL_CHAIN_RUNS", most_runs)
    weights = random_weights(CFG, seed=8)
    dev = sim(n)
    net = TensorParallelLlama(dev, CFG, weights.__getitem__, 48, layer_groups=CASES.get(n))
    chains = []
    real_chain = dev.chain

    def spy(calls, *args, **kwargs):
        chains.append((len(calls), kwargs.get("new_data")))
        return real_chain(calls, *args, **kwargs)

    monkeypatch.setattr(dev, "chain", spy)
    prompt = np.random.default_rng(2).integers(0, CFG.vocab, 40)
    _, _, logits = net.prefill([list(prompt)], 0, pool=1, logits=True)
    per_chunk = 1 + CFG.layers  # the embedding and each layer
    if n == 1:
        assert chains == [(per_chunk, [0]), (per_chunk, [0]), (per_chunk + 1, [0])]
    elif most_runs is None:
        assert chains == [(3 * per_chunk + 1, [0, per_chunk, 2 * per_chunk])]
    else:
        assert chains == [(2 * per_chunk, [0, per_chunk]), (per_chunk + 1, [0])]
    want = ReferenceDecoder(CFG, weights, 48).forward(prompt[None], np.arange(40)[None])[0, -1]
    np.testing.assert_allclose(logits.numpy()[0, 0], want, rtol=2e-4, atol=2e-4)


def test_the_longest_prefill_chain_fits_a_message():
    """A chain of PREFILL_CHAIN_RUNS runs, each with the inputs of a layer with every optional
    weight (biases, q/k norms, post-norms: 19 weights, x, positions, mask, the caches, a
    slot), its outputs and a tensor to free, encodes within a message's header limit, with
    room to spare, and decodes."""
    from models.llama import PREFILL_CHAIN_RUNS

    runs = PREFILL_CHAIN_RUNS
    big = 1 << 40  # ids as large as a long-lived coordinator's
    pairs = [np.arange(2 * 25, dtype=np.int64).reshape(25, 2) + big for _ in range(runs)]
    outs = [np.arange(2 * 3, dtype=np.int64).reshape(3, 2) + big for _ in range(runs)]
    chain = p.RunChain(
        list(range(runs)), list(range(big, big + runs)), pairs, outs, frees=[[big]] * runs, new_data=[1, 2]
    )
    frames = p.encode(chain)
    assert len(bytes(frames[0])) < p.DEFAULT_LIMITS.header_bytes // 2
    assert p.decode(frames)[0].runs == chain.runs
