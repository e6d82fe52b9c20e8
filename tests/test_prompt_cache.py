"""Prompt caching in the server's batcher (models/batching.py `_place`): a free row's caches keep
the prompt of the job that ran there, and a job whose prompt begins with it prefills only the
rest, from the last whole chunk it holds (chunks made small here). The oracles: the NumPy
reference decoder over the whole prompt (tokens, and each token's log-probability), which
caches nothing; and a whole prefill of the same prompt, whose bits the cached one gives."""

from __future__ import annotations

import time

import numpy as np
import pytest

from meta import MetaDevice
from models import synthetic
from models.batching import ContinuousBatcher, Job, Token
from models.gguf_model import GGUFModel
from models.llama import ReferenceDecoder
from models.requests import Sampling
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(120)
SHAPE = synthetic.Shape(layers=2, hidden=64, ffn=128, heads=2, kv_heads=1, context=128)
PROMPT = (504, 3575, 282, 4649, 314)
OTHER = (1000, 2000, 3000, 4000)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("cache") / "tiny.gguf"
    return GGUFModel(synthetic.write(path, synthetic.Recipe(SHAPE, weights="q8_0"), model.path).path)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, model):
    """Gemma 3's layers: the first windowed (4 positions), the second global."""
    path = tmp_path_factory.mktemp("cache") / "gemma3.gguf"
    recipe = synthetic.Recipe(SHAPE, weights="q8_0", architecture="gemma3", window=4, window_pattern=2)
    return GGUFModel(synthetic.write(path, recipe, model.path).path)


def small_chunks(monkeypatch, tokens: int) -> None:
    import models.batching as batching
    import models.llama as llama

    monkeypatch.setattr(batching, "PREFILL_CHUNK", tokens)
    monkeypatch.setattr(llama, "PREFILL_CHUNK", tokens)


def tokens_of(ticket) -> list[Token]:
    return [e for e in ticket.stream(timeout=WAIT_S) if isinstance(e, Token)]


def run(batcher, *jobs: Job) -> list[list[Token]]:
    """Submit the jobs together and wait for all: each one's Token events."""
    tickets = [batcher.submit(job) for job in jobs]
    out = []
    for ticket in tickets:
        start = time.monotonic()
        events = list(ticket.stream(timeout=WAIT_S))
        assert time.monotonic() - start < WAIT_S and events[-1].reason in ("length", "stop"), events[-1]
        out.append([e for e in events if isinstance(e, Token)])
    return out


def scored(prompt, n: int) -> Job:
    """Greedy, n tokens past any end, each token's log-probability."""
    return Job(tuple(prompt), n, Sampling(), stop_at_eos=False, top_logprobs=0)


def reference(model: GGUFModel, prompt, tokens, ctx: int) -> tuple[list[int], list[float]]:
    """The reference decoder's greedy tokens after the whole `prompt`, and the log-probability
    of each of `tokens` (ours) fed one after another."""
    weights = {name: model.weight(name) for name in model.expected_shapes()}
    ref = ReferenceDecoder(model.config, weights, ctx)
    logits = ref.forward(np.array([list(prompt)]), np.arange(len(prompt))[None])[0, -1]
    greedy, logprobs = [], []
    for k, token in enumerate(tokens):
        shifted = logits.astype(np.float64) - logits.max()
        logprobs.append(float(shifted[token] - np.log(np.exp(shifted).sum())))
        greedy.append(int(np.argmax(logits)))
        logits = ref.forward(np.array([[token]]), np.array([[len(prompt) + k]]))[0, -1]
    return greedy, logprobs


def check(model, prompt, got: list[Token], ctx: int) -> None:
    tokens = [t.token for t in got]
    greedy, logprobs = reference(model, prompt, tokens, ctx)
    assert tokens == greedy
    np.testing.assert_allclose([t.logprob for t in got], logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("weights", ["f32", "native"])
def test_a_conversations_next_turn_goes_on_from_its_rows_caches(tiny, weights, monkeypatch):
    """Chunks of 4. Jobs A (4 tokens) and X (12) start together in slots 0 and 1; after A ends
    its free row decodes dummy tokens in X's steps (a step runs rows 0 and 1), past what it
    holds. A's next turn (its 5-token prompt, its answer, new tokens) keeps A's first chunk and
    prefills the rest by the chunks a whole prefill takes (the answer's positions, written by
    decode steps, again, though with them the row holds two chunks): its log-probabilities are
    a whole prefill's (cache_prompt false) bit for bit, with float32 products and with the
    8-bit activations of the file's Q8_0 blocks; with float32 products, the reference's over
    the whole conversation."""
    small_chunks(monkeypatch, 4)
    ctx = 64
    dev = MetaDevice(SimulatedCluster(2))
    batcher = ContinuousBatcher(dev, tiny, slots=2, ctx=ctx, weights=weights).start()
    try:
        first, other = run(batcher, scored(PROMPT, 4), scored(OTHER, 12))
        turn = (*PROMPT, *(t.token for t in first), 11, 12, 13)
        prefilled = batcher.counters.prompt_tokens
        ticket = batcher.submit(scored(turn, 5))
        going_on = tokens_of(ticket)
        whole = batcher.submit(Job(turn, 5, Sampling(), stop_at_eos=False, top_logprobs=0, cache_prompt=False))
        prefilled_whole = tokens_of(whole)
    finally:
        batcher.stop()
        dev.close()
    assert ticket.cached_tokens == 4 and whole.cached_tokens == 0
    assert batcher.counters.prompt_tokens - prefilled == (len(turn) - 4) + len(turn)
    assert batcher.counters.cached_prompt_tokens == 4
    assert [(t.token, t.logprob) for t in going_on] == [(t.token, t.logprob) for t in prefilled_whole]
    if weights == "f32":
        check(tiny, PROMPT, first, ctx)
        check(tiny, OTHER, other, ctx)
        check(tiny, turn, going_on, ctx)


def test_a_job_goes_to_a_higher_slot_only_for_a_chunk_more_of_its_prompt(tiny, monkeypatch):
    """Chunks of 8. X in slot 0, A (a 20-token prompt) in slot 1, both ended: A's next turn goes
    to slot 1 (its caches hold two chunks of it, slot 0's none), a job sharing only A's first 5
    tokens to the lowest free slot, prefilled whole."""
    small_chunks(monkeypatch, 8)
    ctx, long_prompt = 64, tuple(int(t) for t in np.random.default_rng(5).integers(0, 49152, 20))
    dev = MetaDevice(SimulatedCluster(2))
    batcher = ContinuousBatcher(dev, tiny, slots=2, ctx=ctx, weights="f32").start()
    try:
        _, first = run(batcher, scored(OTHER, 6), scored(long_prompt, 2))
        turn = (*long_prompt, *(t.token for t in first), 7, 8)
        ticket = batcher.submit(scored(turn, 4))
        going_on = tokens_of(ticket)
        near = batcher.submit(scored((*long_prompt[:5], 9, 10), 2))
        nearby = tokens_of(near)
    finally:
        batcher.stop()
        dev.close()
    assert ticket.cached_tokens == 16 and near.cached_tokens == 0
    check(tiny, turn, going_on, ctx)
    check(tiny, (*long_prompt[:5], 9, 10), nearby, ctx)


P16 = (*PROMPT, *OTHER, *PROMPT, 1, 2)


def test_a_windowed_layers_ring_is_reused_only_where_it_was_not_written_over(windowed, monkeypatch):
    """Rings of 4 + 8 positions (chunks of 8), one slot. B's next turn keeps B's 8-token prompt
    (its row went 3 positions past it). Then A (16 prompt tokens) runs 20 tokens, and a job
    going on from A's prompt is prefilled whole: A's row went 20 positions past it (its driven
    steps), and the ring's slots of the positions it would see were written over. Each equals
    the reference, whose caches hold the whole context."""
    small_chunks(monkeypatch, 8)
    ctx = 64
    dev = MetaDevice(SimulatedCluster(2))
    batcher = ContinuousBatcher(dev, windowed, slots=1, ctx=ctx, weights="f32").start()
    try:
        assert [k.shape[2] for k in batcher.net.k] == [12, ctx]
        (b,) = run(batcher, scored((*OTHER, *OTHER), 3))
        turn = (*OTHER, *OTHER, *(t.token for t in b), 7, 8)
        (going_on,) = run(batcher, scored(turn, 3))
        reused = batcher.counters.cached_prompt_tokens
        (a,) = run(batcher, scored(P16, 20))
        parting = (*P16, 77, 78)
        (apart,) = run(batcher, scored(parting, 3))
    finally:
        batcher.stop()
        dev.close()
    assert reused == 8 and batcher.counters.cached_prompt_tokens == reused
    check(windowed, (*OTHER, *OTHER), b, ctx)
    check(windowed, turn, going_on, ctx)
    check(windowed, P16, a, ctx)
    check(windowed, parting, apart, ctx)


def test_a_prompts_padding_counts_as_written_in_a_ring(windowed, monkeypatch):
    """Rings of 4 + 8 (chunks of 8): a 17-token prompt goes in as 8, 8, then 1 padded to 8, so
    its row was written to position 23 though it holds 17 tokens; a job sharing its first chunk
    would see ring slots its padding wrote over, and is prefilled whole."""
    small_chunks(monkeypatch, 8)
    ctx, seventeen = 64, (*P16, 3)
    dev = MetaDevice(SimulatedCluster(1))
    batcher = ContinuousBatcher(dev, windowed, slots=1, ctx=ctx, weights="f32").start()
    try:
        (first,) = run(batcher, scored(seventeen, 1))
        parting = (*seventeen[:8], 50, 51)
        (apart,) = run(batcher, scored(parting, 3))
    finally:
        batcher.stop()
        dev.close()
    assert batcher.counters.cached_prompt_tokens == 0
    check(windowed, seventeen, first, ctx)
    check(windowed, parting, apart, ctx)
