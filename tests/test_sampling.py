"""Sampling against its definition: frequencies of the drawn tokens against softmax(v / T) cut to
top-p, with a fixed seed and a bound of a few standard deviations (the draw is deterministic, so
this cannot flake); the settings' limits."""

from __future__ import annotations

import numpy as np
import pytest

from models.generate import POOL, Sampling
from models.gguf_model import ModelError
from workers.generation import choose

pytestmark = pytest.mark.timeout(60)
VALUES = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)  # candidates, best first
INDICES = np.array([40, 7, 12, 3, 99], np.int64)
DRAWS = 20_000


def frequencies(temperature: float, top_p: float, seed: int = 5) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    drawn = [choose(VALUES, INDICES, temperature, top_p, rng) for _ in range(DRAWS)]
    tokens, counts = np.unique(drawn, return_counts=True)
    return dict(zip(tokens.tolist(), (counts / DRAWS).tolist()))


def expected(temperature: float, top_p: float) -> dict[int, float]:
    """softmax(v / T) over the candidates, then the smallest best-first prefix whose probability
    reaches top_p, renormalised: computed here term by term."""
    weights = [np.exp(float(v) / temperature) for v in VALUES]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, mass = [], 0.0
    for p in probs:
        kept.append(p)
        mass += p
        if mass >= top_p:
            break
    return {int(INDICES[i]): p / sum(kept) for i, p in enumerate(kept)}


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (1.0, 0.8), (0.7, 0.5)])
def test_draws_follow_the_tempered_softmax_cut_to_top_p(temperature, top_p):
    got, want = frequencies(temperature, top_p), expected(temperature, top_p)
    assert set(got) == set(want), (got, want)  # nothing outside the top-p set, nothing in it missing
    for token, p in want.items():
        sigma = np.sqrt(p * (1 - p) / DRAWS)
        assert abs(got[token] - p) < 5 * sigma + 1e-3, (token, got[token], p)


def test_greedy_takes_the_best_and_the_seed_decides_the_draw():
    assert frequencies(0.0, 1.0) == {40: 1.0}
    assert frequencies(1.0, 1.0, seed=1) == frequencies(1.0, 1.0, seed=1)
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(2)
    a = [choose(VALUES, INDICES, 1.0, 1.0, rng_a) for _ in range(50)]
    b = [choose(VALUES, INDICES, 1.0, 1.0, rng_b) for _ in range(50)]
    assert a != b


def test_top_k_is_the_candidate_pool_and_bad_settings_are_refused():
    assert Sampling().pool == 1  # greedy needs only the best
    assert Sampling(temperature=1.0, top_k=3).pool == 3
    assert Sampling(temperature=1.0).pool == POOL
    assert Sampling(temperature=1.0, top_k=10 * POOL).pool == POOL
    for bad in (dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ModelError):
            Sampling(**bad)
