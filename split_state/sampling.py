"""The sampling rule: how a sequence's next token is chosen from its candidates. Shared by the
coordinator (models/: the prefill's token, the batcher's steps) and the workers (their decode
loop, and the device sampler whose CUDA C computes `pick` step by step: workers/backends/cuda/kernels/sample.py),
so every side chooses the same token from the same candidates and uniform draw.

The arithmetic is spelled out in the order the device kernel runs it: float64 throughout, sums
taken one after another (np.cumsum is sequential; np.sum is pairwise), and the draw a uniform in
[0, 1) placed on the normalised running sum as numpy.random.Generator.choice places it, so a
seeded generation draws the same numbers and makes the same choices as it always did.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from split_state.errors import NonFiniteLogits, ProtocolError

# a temperature below this is greedy (as vLLM's _SAMPLING_EPS): dividing by 1e-320 gives inf,
# then inf - inf NaN probabilities
TEMPERATURE_FLOOR = 1e-5


@dataclass(frozen=True)
class Rule:
    """How a sequence's next token is chosen from its candidates, in the order vLLM and
    transformers apply them: the repeat penalty on recently seen tokens, then temperature,
    top-k, top-p and min-p."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every candidate
    top_p: float = 1.0
    min_p: float = 0.0  # drop candidates less likely than min_p times the best one
    repeat_penalty: float = 1.0  # 1: off; llama.cpp's rule: a seen token's logit / penalty if > 0, else * it
    repeat_last_n: int = 64  # the penalty's window: this many of the latest tokens, the prompt's included

    @property
    def penalized(self) -> int:
        """How many of a sequence's latest tokens the repeat penalty lowers (0: none)."""
        return self.repeat_last_n if self.repeat_penalty != 1 else 0

    @property
    def greedy(self) -> bool:
        """Whether the best candidate (after the penalty) is taken, with no draw."""
        return self.temperature < TEMPERATURE_FLOOR

    def as_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, fields: dict) -> Rule:
        casts = {"float": float, "int": int}  # the fields' annotations, as strings
        try:
            return cls(**{f.name: casts[f.type](fields[f.name]) for f in dataclasses.fields(cls)})
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"generate: a malformed sampling rule ({exc!r})") from None


def choose(values: np.ndarray, indices: np.ndarray, rule: Rule, rng, recent: Sequence[int] = ()) -> int:
    """The next token from a sequence's candidates (best first) under `rule`, drawing from `rng`
    (one uniform, only when the rule samples); `recent`: the sequence's latest tokens, which the
    repeat penalty lowers. A candidate that is not finite is refused (NonFiniteLogits): the
    choice would be arbitrary, and log-probabilities NaN; only padding (index -1, value -inf: a
    device with fewer than k candidates) is not a candidate."""
    if len(values) == 1 and rule.greedy:  # a greedy step's one candidate: no NumPy (see _the_one)
        return _the_one(float(values[0]), int(indices[0]))
    values = np.asarray(values)
    unfit = ~np.isfinite(values) & ((np.asarray(indices) >= 0) | (values != -np.inf))
    if unfit.any():
        raise _refused(values[unfit][0])
    return pick(values, indices, rule, None if rule.greedy else rng.random(), recent)


def _the_one(value: float, index: int) -> int:
    """`choose` of a greedy step's single candidate (its pool is 1: models/requests.py), in
    Python: the workers choose right after a decode step whose weight products pushed NumPy's code
    and data out of the caches, and the general path's NumPy calls on one value cost ~110 us a
    token there (~6 us warm), a fiftieth of a SmolLM2 token. Its rule and errors: the general
    path's (the repeat penalty reorders candidates, of which there is one)."""
    if math.isfinite(value) or (index < 0 and value == -math.inf):
        return index
    raise _refused(value)


def _refused(bad) -> NonFiniteLogits:
    return NonFiniteLogits(
        f"the logits hold {bad} (the model's weights hold NaN or infinity, or its activations overflowed)"
    )


def mass_normalizer(best: float, mass: float) -> float:
    """A row's log sum exp from its best logit and its mass (the sum over the row of exp(logit -
    best)), in float64: log p(token) = logit - this."""
    return float(best) + float(np.log(np.float64(mass)))


def scored(values: np.ndarray, indices: np.ndarray, token: int, normalizer: float, top: int):
    """(`token`'s log-probability, the best `top` (token, log-probability) pairs) from a row's
    candidates (best first) and its normalizer: what a job asking for log-probabilities gets,
    whether the coordinator chose its token (models/batching.py) or the workers did
    (workers/generation.py)."""
    at = np.flatnonzero(indices == token)
    chosen = float(values[at[0]]) - normalizer if at.size else -np.inf
    return chosen, tuple((int(t), float(v) - normalizer) for v, t in zip(values[:top], indices[:top]))


def pick(values: np.ndarray, indices: np.ndarray, rule: Rule, uniform: float | None, recent: Sequence[int] = ()) -> int:
    """`choose` with its uniform draw given (None where the rule is greedy)."""
    values = np.asarray(values).astype(np.float64)
    if rule.repeat_penalty != 1 and len(recent):
        seen = np.isin(indices, np.asarray(recent))
        lowered = np.where(values > 0, values / rule.repeat_penalty, values * rule.repeat_penalty)
        values = np.where(seen, lowered, values)
        order = np.argsort(-values, kind="stable")
        values, indices = values[order], indices[order]
    if rule.top_k:
        values, indices = values[: rule.top_k], indices[: rule.top_k]
    if rule.greedy:
        return int(indices[0])
    keep = values / rule.temperature
    probs = np.exp(keep - keep[0])  # best first: keep[0] is the largest
    probs = probs / np.cumsum(probs)[-1]
    if rule.top_p < 1:
        cut = int(np.searchsorted(np.cumsum(probs), rule.top_p)) + 1
        probs = probs[:cut] / np.cumsum(probs[:cut])[-1]
    if rule.min_p > 0:
        probs = probs[probs >= rule.min_p * probs[0]]  # a prefix: probs do not grow along the list
        probs = probs / np.cumsum(probs)[-1]
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(indices[int(np.searchsorted(cdf, uniform, side="right"))])


def generator_state(rng: np.random.Generator) -> list[str]:
    """A PCG64 generator's exact state as strings (its counters exceed 64 bits)."""
    state = rng.bit_generator.state
    return [str(state["state"]["state"]), str(state["state"]["inc"]), str(state["has_uint32"]), str(state["uinteger"])]


def restore_generator(fields: Sequence[str]) -> np.random.Generator:
    try:
        bits = np.random.PCG64()
        bits.state = {
            "bit_generator": "PCG64",
            "state": {"state": int(fields[0]), "inc": int(fields[1])},
            "has_uint32": int(fields[2]),
            "uinteger": int(fields[3]),
        }
    except (ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"generate: a malformed generator state ({exc})") from None
    return np.random.Generator(bits)
