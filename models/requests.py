"""What a generation asks for and when it ends, the same for LLM.generate and the server: the
sampling settings (Sampling, each field's range), the candidates a decode step keeps for them
(POOL best of the vocabulary: `candidates`), the rule that ends a sequence (Stopping: end
tokens, stop strings, max tokens, the context's room) and the text a stream may show so far
(TextStream: whole characters, nothing past a stop string).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from models.errors import ModelError
from split_state.sampling import TEMPERATURE_FLOOR, Rule
from split_state.states import Mirrored

POOL = 256  # candidates per sequence a sampled step considers


# each sampling field's range: (field, fits, what to give); the CLI names its flag with them
SAMPLING_RANGES = (
    ("temperature", lambda v: v >= 0, "0 or more"),
    ("top_k", lambda v: v >= 0, "0 or more"),
    ("top_p", lambda v: 0 <= v <= 1, "a number in [0, 1]"),  # 0: the most likely token alone, as OpenAI's
    ("min_p", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("repeat_penalty", lambda v: v > 0, "more than 0"),
    ("repeat_last_n", lambda v: v >= 0, "0 or more"),
)


def sampling_refusal(field: str, value) -> str | None:
    """What is wrong with `value` for sampling field `field` (None: nothing; NaN never fits)."""
    for name, fits, want in SAMPLING_RANGES:
        if name == field and not (value == value and fits(value)):
            return f"give {want}"
    return None


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit (within POOL)
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0  # 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64

    def __post_init__(self) -> None:
        for name, _, _ in SAMPLING_RANGES:
            refusal = sampling_refusal(name, getattr(self, name))
            if refusal is not None:
                raise ModelError(f"sampling {name} {getattr(self, name)}: {refusal}")

    @property
    def rule(self) -> Rule:
        fields = dataclasses.asdict(self)
        del fields["seed"]
        return Rule(**fields)

    @property
    def penalized(self) -> int:
        return self.rule.penalized

    @property
    def pool(self) -> int:
        """Candidates per sequence the workers propose: enough that the penalty, lowering at most
        `penalized` of them, still leaves the best top_k others among them."""
        want = 1 if self.temperature < TEMPERATURE_FLOOR else (self.top_k or POOL)
        return min(want + self.penalized, POOL)


def stop_string_at(text: str, stop_strings: Sequence[str]) -> int | None:
    """Where the first of `stop_strings` to occur in `text` begins, or None."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None


@dataclass(frozen=True)
class Stopping:
    """When a sequence ends and why, the one rule LLM.generate and the server's batcher keep:
    its last token one of `end_ids` (the model's end-of-generation tokens; none where EOS is
    ignored) or its text holding one of `stop_strings`: "stop"; `max_tokens` generated, or no
    room left in the context to feed the token back: "length". (The workers' own loop checks
    the end ids too, to stop without a word from the coordinator.)"""

    end_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    max_tokens: int | None = None  # None: the caller's loop counts them

    def reason(self, tokens: Sequence[int], text: Callable[[], str], room: bool = True) -> str | None:
        """Why a sequence of `tokens` so far ends now, or None; `text()` its text (decoded only
        where there are stop strings), `room` whether the context can take the last token."""
        if tokens and tokens[-1] in self.end_ids:
            return "stop"
        if self.stop_strings and stop_string_at(text(), self.stop_strings) is not None:
            return "stop"
        if (self.max_tokens is not None and len(tokens) >= self.max_tokens) or not room:
            return "length"
        return None


# the tokens a stream decodes again at each push, at least: those before are decoded once, into
# TextStream.settled (decoding every token at every push made a stream of n tokens cost n^2 / 2
# token decodes: 0.2 ms a token at 2,000 tokens, on the cores the workers decode on). A character
# is at most 4 bytes: 4 byte tokens at most
SETTLED_AFTER = 4


class TextStream:
    """A generation's text as its tokens arrive: each `push` returns the new text that is safe
    to show (whole characters only, nothing past a stop string, and the end that may still begin
    one held back)."""

    def __init__(self, tokenizer, special: bool = False, stop: Sequence[str] = ()):
        self.tokenizer, self.special, self.stop = tokenizer, special, list(stop)
        self.tokens: list[int] = []
        self.shown = ""
        self.base, self.settled = 0, ""  # the text of tokens[:base], decoded once

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self._text()
        if text.endswith("\ufffd"):  # a character whose bytes are still arriving
            return ""
        cut = stop_string_at(text, self.stop)
        if cut is not None:
            text = text[:cut]
        else:  # hold back what may be the start of a stop string
            text = text[: len(text) - _pending(text, self.stop)]
        if len(text) <= len(self.shown):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def _text(self) -> str:
        """The text of every token so far: the settled text and that of the tokens after it.
        The settled part grows by the tokens up to the last SETTLED_AFTER where they decode to
        whole characters that the tokens after them leave as they are (the text of all of them
        begins with theirs alone), so it is the text the whole would decode to."""
        rest = self._decode(self.tokens[self.base :])
        text = self.settled + rest
        if len(self.tokens) - self.base >= 2 * SETTLED_AFTER:
            cut = len(self.tokens) - SETTLED_AFTER
            head = self._decode(self.tokens[self.base : cut])
            if not head.endswith("\ufffd") and rest.startswith(head):
                self.base, self.settled = cut, self.settled + head
        return text

    def _decode(self, tokens: list[int]) -> str:
        # a continuation: the first word's space is the generation's (a SentencePiece-style
        # tokenizer would take it off the text's start)
        return self.tokenizer.decode(tokens, skip_special=not self.special, continuation=True)

    def final_text(self) -> str:
        """The whole text, cut at the first stop string."""
        text = self._text()
        cut = stop_string_at(text, self.stop)
        return text if cut is None else text[:cut]

    def finish(self, text: str | None = None) -> str:
        """What was held back, once the generation ended (`text`: its final text)."""
        text = self.final_text() if text is None else text
        if text.startswith(self.shown) and len(text) > len(self.shown):
            new, self.shown = text[len(self.shown) :], text
            return new
        return ""


def _pending(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins one of `stop` (shorter than it):
    linear in the stop strings' lengths (one pass of Knuth-Morris-Pratt's automaton over the
    last len(s) - 1 characters), where trying every prefix took time quadratic in them."""
    return max((_longest_end_beginning(text[-(len(s) - 1) :], s) for s in stop if len(s) > 1), default=0)


def _longest_end_beginning(tail: str, s: str) -> int:
    """The longest k with tail[-k:] == s[:k] (tail shorter than s, so k < len(s))."""
    fail = [0] * len(s)  # fail[i]: the longest proper border of s[: i + 1]
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    matched = 0
    for c in tail:
        while matched and (matched == len(s) or c != s[matched]):
            matched = fail[matched - 1]
        if c == s[matched]:
            matched += 1
    return matched


def candidates(pool: int, mass: bool = False, on: tuple[int, ...] | None = None) -> Callable:
    """A decode step's results: every row's `pool` best (values, indices); with `mass` also each
    row's sum over the whole vocabulary of exp(logit - its best logit), (rows, 1): its
    log-probabilities' normalizer (log p = logit - best - log mass), one float a row (the
    vocabulary's shares summed by an all-reduce, never gathered), Mirrored: every worker holds
    the whole of it, as the candidates, so rank 0 can report log-probabilities itself when the
    workers drive the steps (the shares alone gave it a part of the mass). `on`: the workers
    that hold the mass, where not every one (a lane's head group: TensorParallelLlama.lanes)."""

    def build(logits) -> list:
        values, indices = logits.top_k(pool)
        if not mass:
            return [values, indices]
        return [values, indices, (logits - values[:, :, 0:1]).exp().sum(axis=-1).redistribute(Mirrored(on=on))]

    return build


def log_normalizer(logits: np.ndarray) -> float:
    """log sum exp of one row of logits, in float64: log p(token) = logit - this."""
    row = np.asarray(logits, np.float64)
    best = row.max()
    return float(best + np.log(np.exp(row - best).sum()))
