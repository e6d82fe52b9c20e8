"""Sliding-window attention (LlamaConfig.window): a token attends to the positions less than W
before its own. The oracle needs no windowed code: in a one-layer model a position's keys and
values depend on its own token alone, and rope's scores on relative positions alone, so the
last row of a windowed run over tokens 0..p equals the last row of an unwindowed run over tokens
p - W + 1..p alone, moved to positions 0..W - 1 (a run that kept their positions would also see
the empty cache rows before them), up to the rounding of rope's other angles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meta import MetaDevice
from models.llama import LlamaConfig, ReferenceDecoder, TensorParallelLlama, random_weights
from split_state.errors import ShapeError
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(120)
CFG = LlamaConfig(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=97, window=4, rope_mode="neox")
CTX = 16
TOKENS = np.random.default_rng(3).integers(0, CFG.vocab, 11)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=1)


def seen_alone(weights, p: int) -> np.ndarray:
    """Position p's logits from the last W tokens alone, no window: the oracle."""
    first = max(0, p - CFG.window + 1)
    plain = ReferenceDecoder(dataclasses.replace(CFG, window=None), weights, CTX)
    return plain.forward(TOKENS[None, first : p + 1], np.arange(p + 1 - first)[None])[0, -1]


def test_the_reference_attends_to_the_last_w_positions_only(weights):
    got = ReferenceDecoder(CFG, weights, CTX).forward(TOKENS[None], np.arange(len(TOKENS))[None])[0]
    for p in range(len(TOKENS)):
        np.testing.assert_allclose(got[p], seen_alone(weights, p), atol=1e-4, rtol=0)
    unwindowed = ReferenceDecoder(dataclasses.replace(CFG, window=None), weights, CTX)
    whole = unwindowed.forward(TOKENS[None], np.arange(len(TOKENS))[None])[0]
    assert np.abs(whole[-1] - got[-1]).max() > 1e-2  # the window changes what the last token sees


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tensor_parallel_prefill_and_decode_attend_to_the_window(weights, n):
    """A prefill of 6 tokens, then one token a step: every row the oracle's."""
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        net = TensorParallelLlama(dev, CFG, weights.__getitem__, CTX)
        logits = net.step(TOKENS[None, :6], np.arange(6)[None])
        dev.run(logits, *net.caches())
        rows = list(logits.numpy()[0])
        for p in range(6, len(TOKENS)):
            step = net.step(TOKENS[None, p : p + 1], np.array([[p]]))
            dev.run(step, *net.caches())
            rows.append(step.numpy()[0, 0])
    finally:
        dev.close()
    for p, row in enumerate(rows):
        np.testing.assert_allclose(row, seen_alone(weights, p), atol=1e-4, rtol=0)


# Gemma's layout: a window on some layers (0 and 2), a global one between, rope bases of their own
MIXED = dataclasses.replace(
    CFG, layers=3, windowed=(True, False, True), window_rope_base=100.0, qk_norm=True, post_norms=True, gate="gelu"
)
LONG_TOKENS = np.random.default_rng(5).integers(0, CFG.vocab, 50)


@pytest.fixture(scope="module")
def mixed_weights():
    return random_weights(MIXED, seed=4)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_windowed_layers_in_rings_give_the_whole_caches_logits(mixed_weights, n, monkeypatch):
    """Prefill steps made small (chunks of 16): the windowed layers' caches are
    rings of 4 + 16 = 20 positions, the global layer's the context's 64; 30 tokens in steps of
    8 and 16 (the last of 6), then 20 one at a time, the rings wrapping twice: every position's
    logits those of the NumPy reference, whose caches hold the whole context."""
    import models.llama as llama

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 16)
    ctx = 64
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        net = TensorParallelLlama(dev, MIXED, mixed_weights.__getitem__, ctx)
        assert [k.shape[2] for k in net.k] == [20, ctx, 20]
        rows = []
        for start, stop in [(0, 8), (8, 24), (24, 30), *((p, p + 1) for p in range(30, 50))]:
            step = net.step(LONG_TOKENS[None, start:stop], np.arange(start, stop)[None])
            dev.run(step, *net.caches())
            rows.extend(step.numpy()[0])
        with pytest.raises(ShapeError, match="at most 16 a step"):
            net.step(LONG_TOKENS[None, :17], np.arange(17)[None])
    finally:
        dev.close()
    whole = ReferenceDecoder(MIXED, mixed_weights, ctx).forward(LONG_TOKENS[None], np.arange(50)[None])[0]
    np.testing.assert_allclose(np.array(rows), whole, atol=1e-4, rtol=0)


def test_a_gemma3_shaped_cache_at_32k_positions_is_under_a_quarter_of_every_layers_whole_cache():
    """Five windowed layers in six (window 512): the caches the workers allocate (each layer's
    K and V handle) hold 32,768 positions on the global layers and 640 on the others."""
    cfg = dataclasses.replace(
        CFG, layers=6, heads=1, kv_heads=1, window=512, windowed=(True,) * 5 + (False,), hidden=16, ffn=32
    )
    ctx = 32768
    dev = MetaDevice(SimulatedCluster(2))
    try:
        net = TensorParallelLlama(dev, cfg, random_weights(cfg, seed=1).__getitem__, ctx)
        held = sum(k.shape[2] + v.shape[2] for k, v in zip(net.k, net.v))
    finally:
        dev.close()
    assert held == 2 * (ctx + 5 * 640)
    assert held <= 2 * cfg.layers * ctx / 4


CHUNKED_TOKENS = np.random.default_rng(7).integers(0, CFG.vocab, 80)


@pytest.mark.parametrize("n, groups", [(1, None), (2, None), (2, ((0,), (1,))), (3, ((0,), (1,), (2,)))])
def test_a_long_prompts_chunks_fill_the_rings_as_the_reference(mixed_weights, n, groups, monkeypatch):
    """A 74-token prompt prefilled in chunks of 32 (two, then 10 tokens), on rows (a chain a
    chunk) or on groups of one worker (every chunk in one chain of runs a worker), then 6 tokens
    one at a time: the last prompt position's logits and every decoded one the NumPy
    reference's. The windowed layers' rings hold 4 + 32 positions, so each chunk writes other
    ring slots: in one chain a chunk's positions are new data to the layer programs run again
    (RunChain.new_data)."""
    import models.llama as llama
    from models.llama import LayerGroups

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 32)
    ctx = 96
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        layer_groups = None if groups is None else LayerGroups(groups)
        net = TensorParallelLlama(dev, MIXED, mixed_weights.__getitem__, ctx, layer_groups=layer_groups)
        assert [k.shape[2] for k in net.k] == [36, ctx, 36]
        _, _, logits = net.prefill([list(CHUNKED_TOKENS[:74])], 0, pool=1, logits=True)
        rows = [logits.numpy()[0, 0]]
        for p in range(74, 80):
            step = net.step(CHUNKED_TOKENS[None, p : p + 1], np.array([[p]]))
            dev.run(step, *net.caches())
            rows.append(step.numpy()[0, 0])
    finally:
        dev.close()
    whole = ReferenceDecoder(MIXED, mixed_weights, ctx).forward(CHUNKED_TOKENS[None], np.arange(80)[None])[0]
    np.testing.assert_allclose(np.array(rows), whole[73:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("n", [1, 2])
def test_a_conversation_reuses_a_rings_cache_only_where_it_was_not_written_over(tmp_path, monkeypatch, n):
    """LLM.chat's reuse of the caches (generate's reuse_prefix) on a Gemma 3 file whose windowed
    layers keep rings (window 4; chunks made 16 tokens, so rings of 20). A next turn that goes on
    from the cached one prefills only what follows its whole chunks; a prompt that leaves the cached sequence
    early (an edited or regenerated turn: the old one went 40 positions past where they part,
    writing over ring slots the new tokens see) is prefilled whole. Each prefill's logits are a
    fresh model's for the whole prompt, which attends to none of the old sequence."""
    import models.llama as llama
    from models import synthetic
    from models.generate import LLM
    from models.gguf_model import GGUFModel

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 16)
    shape = synthetic.Shape(layers=2, hidden=128, ffn=256, heads=4, kv_heads=2, context=128)
    recipe = synthetic.Recipe(
        shape, weights="f32", embedding="f32", seed=3, architecture="gemma3", window=4, window_pattern=2
    )
    vocabulary = synthetic.default_vocabulary() or synthetic.BYTES
    model = GGUFModel(synthetic.write(tmp_path / "m.gguf", recipe, vocabulary).path)
    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    first, going_on = f"{words} {words}", f"{words} {words} and then some more"
    parting = "one two three apples and pears"
    dev = MetaDevice(SimulatedCluster(n))
    try:
        llm = LLM(dev, model, ctx=128, weights="f32", activations="f32")
        assert [k.shape[2] for k in llm.net.k] == [20, 128]  # the windowed layer's ring, the global layer's
        prefilled, prefill = [], llm._prefill
        llm._prefill = lambda prompts, *rest: prefilled.append(len(prompts[0])) or prefill(prompts, *rest)
        got = []
        for prompt in (first, going_on, parting):
            cached = list(llm._cached)
            g = llm.generate([prompt], 4, reuse_prefix=True, keep_logits=True, stop_at_eos=False)[0]
            fresh = LLM(dev, model, ctx=128, weights="f32", activations="f32")
            expected = fresh.generate([prompt], 4, keep_logits=True, stop_at_eos=False)[0]
            got.append((cached, g.prompt_tokens, llm.last_logits, fresh.last_logits, g.tokens, expected.tokens))
    finally:
        dev.close()
    common = [next(i for i, (a, b) in enumerate(zip([*c, -1], whole)) if a != b) for c, whole, *_ in got]
    lengths = [len(whole) for _, whole, *_ in got]
    assert common[1] >= lengths[0] and common[2] < 8 and len(got[2][0]) - common[2] >= 30
    kept = common[1] // 16 * 16  # whole chunks of the cached prompt
    assert kept > 0 and prefilled == [lengths[0], lengths[1] - kept, lengths[2]]  # going on: the rest alone
    for _, _, logits, oracle, tokens, expected_tokens in got:  # by the same chunks: the same bits
        np.testing.assert_array_equal(logits, oracle)
        assert tokens == expected_tokens


def test_reusable_says_exactly_where_a_ring_still_holds_what_a_new_sequence_sees(mixed_weights, monkeypatch):
    """An old sequence of L tokens in the caches (rings of 4 + 16 = 20), a new one sharing its
    first `common` tokens and going on from there: `reusable(common, L)` is true exactly where the
    new tokens' logits are the NumPy reference's over the new sequence alone: a ring that never
    wrapped (L <= 20), or one the old sequence took at most 20 - 4 + 1 = 17 positions past
    where they part."""
    import models.llama as llama

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 16)
    ctx, rng = 64, np.random.default_rng(9)
    reference = ReferenceDecoder(MIXED, mixed_weights, ctx)
    seen = {}
    for common, length in [(2, 20), (2, 21), (4, 22), (24, 40), (24, 41), (24, 42), (30, 47), (30, 48)]:
        old = rng.integers(0, MIXED.vocab, length)
        new = np.concatenate([old[:common], rng.integers(0, MIXED.vocab, 6)])
        dev = MetaDevice(SimulatedCluster(1))
        try:
            net = TensorParallelLlama(dev, MIXED, mixed_weights.__getitem__, ctx)
            for start in range(0, length, 16):
                stop = min(length, start + 16)
                step = net.step(old[None, start:stop], np.arange(start, stop)[None])
                dev.run(step, *net.caches())
            step = net.step(new[None, common:], np.arange(common, len(new))[None])
            dev.run(step, *net.caches())
            said = net.reusable(common, length)
            rows = step.numpy()[0]
        finally:
            dev.close()
        whole = reference.forward(new[None], np.arange(len(new))[None])[0]
        seen[(common, length)] = (said, bool(np.abs(rows - whole[common:]).max() < 1e-4))
    assert all(said == exact for said, exact in seen.values()), seen
    assert [said for said, _ in seen.values()] == [True, False, False, True, True, False, True, False]
