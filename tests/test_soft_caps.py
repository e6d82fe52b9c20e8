"""Soft-capping (Gemma 2's; LlamaConfig.final_softcap and attn_softcap): c * tanh(x / c). The
oracle for the logits' cap needs no capped code: the same model's uncapped logits, capped
here by NumPy. The attention scores' cap is held to llama.cpp's logits on a Gemma 2 file
(tests/llama_cpp_cases.py); here its one rule of placement: whole KV groups per device, as the
fused attention over a cut group has no cap."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meta import MetaDevice
from models.llama import HeadSplit, LlamaConfig, TensorParallelLlama, random_weights
from split_state.errors import ShapeError
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(120)
CFG = LlamaConfig(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=97, rope_mode="neox")
TOKENS = np.random.default_rng(4).integers(0, CFG.vocab, (1, 6))


def logits(cfg: LlamaConfig, n: int) -> np.ndarray:
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        net = TensorParallelLlama(dev, cfg, random_weights(CFG, seed=2).__getitem__, 16)
        out = net.step(TOKENS, np.arange(TOKENS.shape[1])[None])
        dev.run(out, *net.caches())
        return out.numpy()
    finally:
        dev.close()


@pytest.mark.parametrize("n", [1, 2])
def test_the_logits_cap_is_c_tanh_of_the_uncapped_logits_over_c(n):
    plain = logits(CFG, n)
    cap = float(np.abs(plain).max() / 2)  # half the largest: the cap bends most of them
    got = logits(dataclasses.replace(CFG, final_softcap=cap), n)
    np.testing.assert_allclose(got, cap * np.tanh(plain / cap), atol=1e-5, rtol=1e-5)
    assert np.abs(got).max() < cap


def test_capped_attention_keeps_whole_kv_groups_on_each_device_and_refuses_a_cut_one():
    capped = dataclasses.replace(CFG, attn_softcap=50.0)
    assert not HeadSplit.for_workers(capped, 3).shared  # 2 KV heads over 3 devices: 1 | 1 | 0 whole
    assert HeadSplit.for_workers(dataclasses.replace(capped, attn_softcap=None), 3).shared
    dev = MetaDevice(SimulatedCluster(3))
    try:
        cut = HeadSplit.even_queries(capped, 3)
        net = TensorParallelLlama(dev, capped, random_weights(capped, seed=2).__getitem__, 16, heads=cut)
        with pytest.raises(ShapeError, match="whole KV groups"):
            net.step(TOKENS, np.arange(TOKENS.shape[1])[None])
    finally:
        dev.close()
