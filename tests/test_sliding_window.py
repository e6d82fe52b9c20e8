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
