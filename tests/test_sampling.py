"""Sampling against its definition: frequencies of the drawn tokens against softmax(v / T) cut to
top-p, with a fixed seed and a bound of a few standard deviations (the draw is deterministic, so
this cannot flake); the settings' limits."""

from __future__ import annotations

import numpy as np
import pytest

from models.gguf_model import ModelError
from models.requests import POOL, Sampling
from split_state.errors import NonFiniteLogits
from split_state.sampling import Rule, choose

pytestmark = pytest.mark.timeout(60)
VALUES = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)  # candidates, best first
INDICES = np.array([40, 7, 12, 3, 99], np.int64)
DRAWS = 20_000


def frequencies(temperature: float, top_p: float, seed: int = 5, min_p: float = 0.0) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    drawn = [choose(VALUES, INDICES, Rule(temperature, top_p=top_p, min_p=min_p), rng) for _ in range(DRAWS)]
    tokens, counts = np.unique(drawn, return_counts=True)
    return dict(zip(tokens.tolist(), (counts / DRAWS).tolist()))


def expected(temperature: float, top_p: float, min_p: float = 0.0) -> dict[int, float]:
    """softmax(v / T) over the candidates, then the smallest best-first prefix whose probability
    reaches top_p, renormalised, then those at least min_p times as likely as the best:
    computed here term by term."""
    weights = [np.exp(float(v) / temperature) for v in VALUES]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, mass = [], 0.0
    for p in probs:
        kept.append(p)
        mass += p
        if mass >= top_p:
            break
    kept = [p / sum(kept) for p in kept]
    kept = [p for p in kept if p >= min_p * kept[0]]
    return {int(INDICES[i]): p / sum(kept) for i, p in enumerate(kept)}


@pytest.mark.parametrize(
    "temperature, top_p, min_p",
    [
        (1.0, 1.0, 0.0),
        (0.5, 1.0, 0.0),
        (2.0, 1.0, 0.0),
        (1.0, 0.8, 0.0),
        (0.7, 0.5, 0.0),
        (1.0, 1.0, 0.2),
        (2.0, 0.9, 0.3),
    ],
)
def test_draws_follow_the_tempered_softmax_cut_to_top_p_and_min_p(temperature, top_p, min_p):
    got, want = frequencies(temperature, top_p, min_p=min_p), expected(temperature, top_p, min_p)
    assert set(got) == set(want), (got, want)  # nothing outside the top-p set, nothing in it missing
    for token, p in want.items():
        sigma = np.sqrt(p * (1 - p) / DRAWS)
        assert abs(got[token] - p) < 5 * sigma + 1e-3, (token, got[token], p)


def test_greedy_takes_the_best_and_the_seed_decides_the_draw():
    assert frequencies(0.0, 1.0) == {40: 1.0}
    assert frequencies(1.0, 1.0, seed=1) == frequencies(1.0, 1.0, seed=1)
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(2)
    a = [choose(VALUES, INDICES, Rule(1.0), rng_a) for _ in range(50)]
    b = [choose(VALUES, INDICES, Rule(1.0), rng_b) for _ in range(50)]
    assert a != b


def test_top_k_is_the_candidate_pool_and_bad_settings_are_refused():
    assert Sampling().pool == 1  # greedy needs only the best
    assert Sampling(temperature=1.0, top_k=3).pool == 3
    assert Sampling(temperature=1.0).pool == POOL
    assert Sampling(temperature=1.0, top_k=10 * POOL).pool == POOL
    for bad in (dict(temperature=-0.1), dict(top_k=-1), dict(top_p=-0.1), dict(top_p=1.5)):
        with pytest.raises(ModelError):
            Sampling(**bad)


def test_the_repeat_penalty_lowers_recent_tokens_as_llama_cpp_does():
    """llama.cpp's rule: a recent token's logit is divided by the penalty when positive and
    multiplied by it when not; then the order is the new one (top-k, greedy)."""
    assert choose(VALUES, INDICES, Rule(repeat_penalty=1.5), None, recent=[40]) == 40  # 2 / 1.5 > 1
    assert choose(VALUES, INDICES, Rule(repeat_penalty=2.5), None, recent=[40]) == 7  # 2 / 2.5 < 1
    assert choose(VALUES, INDICES, Rule(repeat_penalty=5.0), None, recent=[40, 7]) == 12  # 0.4, 0.2 < 0.5
    values = np.array([-0.5, -0.6], np.float32)  # negative logits: multiplied, pushed further down
    assert choose(values, np.array([5, 6]), Rule(repeat_penalty=1.5), None, recent=[5]) == 6  # -0.75 < -0.6
    assert choose(VALUES, INDICES, Rule(repeat_penalty=2.5, top_k=1), None, recent=[40]) == 7  # top-k after
    # sampled: the penalised logits' softmax, computed here by hand
    rng = np.random.default_rng(3)
    drawn = [choose(VALUES, INDICES, Rule(1.0, repeat_penalty=2.0), rng, recent=[40, 99]) for _ in range(DRAWS)]
    logits = {40: 1.0, 7: 1.0, 12: 0.5, 3: 0.0, 99: -2.0}
    total = sum(np.exp(v) for v in logits.values())
    for token, value in logits.items():
        p = np.exp(value) / total
        assert abs(drawn.count(token) / DRAWS - p) < 5 * np.sqrt(p * (1 - p) / DRAWS) + 1e-3, token


def test_the_candidate_pool_leaves_room_for_penalised_tokens():
    assert Sampling(repeat_penalty=1.1).pool == 1 + 64  # greedy: the best unpenalised one is among them
    assert Sampling(temperature=1.0, top_k=3, repeat_penalty=1.1, repeat_last_n=10).pool == 13
    assert Sampling(temperature=1.0, repeat_penalty=1.1).pool == POOL
    for bad in (dict(min_p=-0.1), dict(min_p=1.0), dict(repeat_penalty=0.0), dict(repeat_last_n=-1)):
        with pytest.raises(ModelError):
            Sampling(**bad)


def test_a_top_p_of_0_keeps_the_best_token_alone():
    """OpenAI's rule (and llama.cpp's, which keeps at least one): whatever the draw, the best."""
    rule = Rule(2.0, top_p=0.0)
    assert {choose(VALUES, INDICES, rule, np.random.default_rng(seed)) for seed in range(50)} == {int(INDICES[0])}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_logits_that_are_not_finite_are_refused_by_name(bad):
    """NaN or infinite weights end in such logits: a clear error (the server's job fails with it,
    generate says it in one line), not an arbitrary token or NaN log-probabilities in JSON."""
    values = VALUES.astype(np.float32).copy()
    values[2] = bad
    for rule in (Rule(), Rule(1.0)):
        with pytest.raises(NonFiniteLogits, match="the logits hold"):
            choose(values, INDICES, rule, np.random.default_rng(0))


def test_padding_past_a_devices_candidates_is_not_refused():
    """A device with fewer than k candidates pads with index -1 and -inf: not a logit."""
    values = np.array([2.0, 1.0, -np.inf, -np.inf], np.float32)
    indices = np.array([40, 7, -1, -1], np.int64)
    assert choose(values, indices, Rule(), None) == 40
    assert choose(values, indices, Rule(1.0), np.random.default_rng(0)) in (40, 7)
    indices[2] = 12  # a real candidate at -inf: refused
    with pytest.raises(NonFiniteLogits):
        choose(values, indices, Rule(), None)


@pytest.mark.parametrize(
    ("value", "index", "expected"),
    [(3.5, 17, 17), (-1e30, 0, 0), (-np.inf, -1, -1), (np.nan, 4, None), (np.inf, 4, None), (-np.inf, 4, None)],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_greedy_steps_one_candidate_is_chosen_or_refused_as_any_pool(value, index, expected, dtype):
    """A greedy step proposes one candidate (models/requests.py's pool): it is the token, padding
    (-1 at -inf) is not refused, a candidate that is not finite is, as in a pool of several."""
    values, indices = np.array([value], dtype), np.array([index], np.int64)
    for rule in (Rule(), Rule(top_k=5), Rule(repeat_penalty=1.3)):
        if expected is None:
            with pytest.raises(NonFiniteLogits, match="the logits hold"):
                choose(values, indices, rule, None, recent=[index])
        else:
            assert choose(values, indices, rule, None, recent=[index]) == expected
