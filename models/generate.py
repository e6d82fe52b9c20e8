"""Text generation with a llama-family GGUF model, tensor-parallel on a MetaDevice.

    llm = LLM(dev, GGUFModel())             # weights placed per device, KV caches preallocated
    out = llm.generate(["The capital of France is"], max_new_tokens=8)
    out[0].text                              # ' Paris.\\n\\nThe answer'

Several prompts decode together as a batch, each at its own position: the prefill writes every
prompt in one step (shorter prompts are padded at their end; padded positions are overwritten by
the decode steps before any token can attend to them), then one captured decode step (one plan,
no graph built per token) runs for every new token. The next token is picked over the vocabulary
split across devices: each device proposes its best candidates and only those travel. Greedy
when temperature is 0; otherwise sampled with temperature, top-k and top-p among the best
POOL candidates of the whole vocabulary (the tail beyond them is not sampled).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from meta.device import MetaDevice
from models.decode_steps import DecodeSteps
from models.errors import ModelError
from models.gguf_model import GGUFModel
from models.loading import (
    AUTO_CACHE,
    Prompt,
    check_lengths,
    check_text_fits,
    common_prefix,
    place_model,
    prompt_text,
)
from models.requests import Sampling, Stopping, candidates, stop_string_at
from split_state.sampling import choose, generator_state
from transport.protocol import GenerateSettings

GREEDY = Sampling()  # the default: the best candidate every step (Sampling is frozen)


@dataclass
class Generation:
    prompt: str
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "length"  # "stop": an end-of-generation token ended it
    sampling: Sampling | None = None

    def as_json(self) -> dict:
        return {
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "sampling": dataclasses.asdict(self.sampling) if self.sampling is not None else None,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prompt_tokens_per_s": len(self.prompt_tokens) / self.prefill_s if self.prefill_s else 0.0,
            "decode_tokens_per_s": max(0, len(self.tokens) - 1) / self.decode_s if self.decode_s else 0.0,
        }


class LLM:
    def __init__(
        self,
        dev: MetaDevice,
        model: GGUFModel,
        ctx: int = 2048,
        batch: int = 1,
        progress=None,
        weights: str = "native",
        cache_types: tuple[str, str] = (AUTO_CACHE, AUTO_CACHE),
        activations: str = "q8",
        split: str = "row",
        layer_groups: int = 0,
        pipelined: bool = True,
    ):
        """`cache_types`: the KV caches' element types (K, V), models.llama.CACHE_TYPES's names,
        or "auto": float16 with the file's blocks and 8-bit activations (llama.cpp's), float32
        on the float32 paths (models.loading.cache_types_for).
        `activations`: the quantized products' ("q8", llama.cpp's 8-bit activations and integer
        products, or "f32", exact float32 products).
        `split`: "row", every layer split over every worker, or "layer", consecutive layers on
        groups of the workers (`layer_groups` of them, else one a host, or one a worker on one
        host), each split over its group (models.loading.layer_groups_for).
        `pipelined`: where the layers are on groups, several prompts decode in lanes, one a
        group, whose steps overlap (workers/pipelined.py: each group works on one lane while
        the others work on theirs); False: one step of every prompt at a time."""
        self.dev, self.model, self.ctx, self.batch = dev, model, ctx, batch
        self.net = place_model(dev, model, ctx, batch, weights, cache_types, progress, activations, split, layer_groups)
        self.tokenizer = model.tokenizer
        self.pipelined = pipelined
        self._steps = DecodeSteps(self.net)  # each lane's decode step, by its candidates' pool
        self.last_logits: np.ndarray | None = None  # (prompts, vocab) of the last prefill
        self._cached: list[int] = []  # the tokens batch row 0's caches hold at positions 0..
        self._written = 0  # one past the last position any step wrote in row 0's caches

    def warm_up(self, sampling: Sampling = GREEDY) -> int:
        """Load, without running, the steps generating under `sampling` will run: the prefill
        step of every padded prompt length (a long prompt's chunks included) and the decode
        step, so the first prompt is as fast as a later one (llama.cpp's warm-up at load; a
        prefill length is three small programs, its embedding, one layer and its head). Returns
        how many prefill lengths and decode steps were loaded."""
        pool = sampling.pool
        loaded = self.net.warm_up(pool)
        every_row = range(self.batch)
        loaded += self._steps.prepare(every_row, 1, pool, self._build(pool, [every_row]))
        lanes = self.net.lanes(self.batch) if self.pipelined else []
        for lane in lanes if len(lanes) > 1 else ():  # a batch of every row's prompts goes in these
            loaded += self._steps.prepare(lane, len(lanes), pool, self._build(pool, lanes))
        return loaded

    def prompt_ids(self, prompt: Prompt, chat: bool, system: str = "", template_kwargs=None) -> list[int]:
        text = prompt_text(self.model, prompt, chat, system, template_kwargs)
        return self.tokenizer.encode(check_text_fits(text, self.ctx, self.model))

    def chat(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int = 256, **options) -> Generation:
        """The next assistant turn of a conversation, `[{"role": "user", "content": ...}, ...]`,
        in the file's chat template. Batch row 0's caches keep the conversation's prompt: when
        the next call's conversation begins with the same tokens, only the rest (the last answer
        and what is new, from the last whole chunk of PREFILL_CHUNK tokens it holds) is
        prefilled, its logits the whole prompt's prefill's bit for bit. Options: those of
        `generate`."""
        return self.generate([messages], max_new_tokens, chat=True, reuse_prefix=True, **options)[0]

    def generate(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 32,
        sampling: Sampling = GREEDY,
        chat: bool = False,
        stop_at_eos: bool = True,
        special: bool = False,
        stop_strings: Sequence[str] = (),
        keep_logits: bool = False,
        on_token: Callable[[int, int], None] | None = None,
        system: str = "",
        reuse_prefix: bool = False,
        template_kwargs: Mapping[str, object] | None = None,
    ) -> list[Generation]:
        """Generate for every prompt (at most `batch` of them): text, or a conversation (a list
        of messages, always in the chat template; `system` is the system message of each that
        has none). `on_token(prompt index, token)` is called as tokens arrive. A sequence ends
        at the model's end-of-generation tokens (EOS, end of turn) unless `stop_at_eos` is
        False, and where its text first contains one of `stop_strings` (the text ends before
        it); control tokens are left out of the text unless `special`. `reuse_prefix` (one
        prompt): prefill only what follows the tokens batch row 0's caches already hold.
        `template_kwargs`: more variables for the chat template (Qwen3's enable_thinking)."""
        if any(not s for s in stop_strings):
            raise ModelError("an empty stop string would stop before the first token; give text to stop at")
        if not 1 <= len(prompts) <= self.batch:
            raise ModelError(f"{len(prompts)} prompts for a model placed for a batch of {self.batch}")
        out = [Generation(_shown(p), self.prompt_ids(p, chat, system, template_kwargs)) for p in prompts]
        lengths = [len(g.prompt_tokens) for g in out]
        check_lengths(lengths, max_new_tokens, self.ctx, self.model.context_length)
        start = 0
        if reuse_prefix and len(out) == 1:  # whole chunks of what row 0 holds (kept_prefix)
            start = self.net.kept_prefix(common_prefix(self._cached, out[0].prompt_tokens), lengths[0], self._written)
        rng = np.random.default_rng(sampling.seed)
        rule, window = sampling.rule, sampling.penalized
        recent = [collections.deque(g.prompt_tokens[-window:] if window else (), maxlen=window) for g in out]
        clock = time.perf_counter()
        # until this call ends, what it does not write: a call that fails (Ctrl-C in a stream
        # callback) leaves the positions from `start` on written by a prompt never recorded
        self._cached, self._written = self._cached[:start], self.ctx
        picks = self._prefill([g.prompt_tokens[start:] for g in out], sampling.pool, keep_logits, start)
        written = self.net.prefill_reach([n - start for n in lengths], start)
        tokens = [choose(v, i, rule, rng, recent[b]) for b, (v, i) in enumerate(picks)]
        prefill_s = time.perf_counter() - clock
        positions = np.array(lengths)
        done = [max_new_tokens == 0] * len(out)
        ends = frozenset(self.model.end_of_generation) if stop_at_eos else frozenset()
        stopping = Stopping(ends, tuple(stop_strings))
        stop = sorted(stopping.end_ids)

        def record(chosen: Sequence[int]) -> bool:
            """Take one step's tokens; True once every sequence is done."""
            for b, g in enumerate(out):
                if not done[b]:
                    g.tokens.append(chosen[b])
                    recent[b].append(chosen[b])
                    if on_token is not None:
                        on_token(b, chosen[b])

                    def text(g=g) -> str:
                        return self.tokenizer.decode(g.tokens, skip_special=not special, continuation=True)

                    reason = stopping.reason(g.tokens, text)
                    if reason is not None:
                        done[b], g.finish_reason = True, reason
            return all(done)

        clock = time.perf_counter()
        finished, left = record(tokens), max_new_tokens - 1
        lanes = self.net.lanes(len(out)) if self.pipelined else [range(len(out))]
        if not finished and left > 0 and not self._captured(lanes, sampling.pool):
            # the first decode step is captured (and run) here; the workers replay it after
            picks = self._decode_step(tokens, positions, sampling.pool, lanes)
            tokens = [choose(v, i, rule, rng, recent[b]) for b, (v, i) in enumerate(picks)]
            positions, left = positions + 1, left - 1
            finished = record(tokens)
        if not finished and left > 0:
            ran = self._drive(tokens, positions, left, sampling, rng, done, stop, recent, record, lanes)
            positions = positions + ran
        decode_s = time.perf_counter() - clock
        # what a next call may keep of row 0's caches (net.kept_prefix): a lone prompt, which went
        # in by a whole prefill's chunks (several go by the shortest's). Not the tokens fed back:
        # a decode step's attention sums in another order than a prefill row's (with 8-bit
        # activations a prompt going on from them moved logits by up to 0.2). The steps past the
        # end (the workers stop after the step under way) wrote further (`_written`)
        self._cached = list(out[0].prompt_tokens) if len(out) == 1 else []
        self._written = max(written, int(positions[0]))
        for g in out:
            g.text = self.tokenizer.decode(g.tokens, skip_special=not special, continuation=True)
            cut = stop_string_at(g.text, stop_strings)
            g.text = g.text if cut is None else g.text[:cut]
            g.prefill_s, g.decode_s, g.sampling = prefill_s, decode_s, sampling
        return out

    def _drive(self, tokens, positions, steps: int, sampling: Sampling, rng, done, stop, recent, record, lanes) -> int:
        """The rest of the decode loop on the workers: they choose each token themselves (with
        this generator's state) and report it; an exception in `record` (Ctrl-C in a stream
        callback) cancels them after the step under way and is raised here once they stopped.
        With several lanes, each lane's step over its rows (a pipelined generation). Returns
        the steps the workers ran (each wrote the caches one position further)."""
        raised: list[BaseException] = []

        def on_tokens(step: int, chosen: list[int]) -> bool:
            try:
                return not record(chosen[: len(tokens)])  # all done (a stop string): cancel
            except BaseException as exc:  # noqa: BLE001 - re-raised once the workers stopped
                raised.append(exc)
                return False

        settings = GenerateSettings(
            sampling.rule,
            tuple(generator_state(rng)),
            tuple(stop),
            tuple(done),
            tuple(tuple(r) for r in recent),
        )
        calls = self._steps_of(tokens, positions, sampling.pool, lanes)
        info = self.dev.generate(*calls[0], steps, settings, on_tokens, lanes=calls[1:])
        if raised:
            raise raised[0]
        return int(info["steps"])

    def _captured(self, lanes: list[range], pool: int) -> bool:
        return all(self._steps.get(rows, len(lanes), pool) is not None for rows in self._stepped(lanes))

    def _stepped(self, lanes: list[range]) -> list[range]:
        """The rows each lane's step runs: every batch row's where there is one lane."""
        return [range(self.batch)] if len(lanes) == 1 else lanes

    def _build(self, pool: int, lanes: list[range]):
        """A decode step's results: on every worker, or a lane's on the head's group."""
        return candidates(pool) if len(lanes) == 1 else candidates(pool, on=self.net.head_group)

    def _steps_of(self, tokens, positions, pool: int, lanes: list[range]):
        """(captured step or None, fed tokens, fed positions) of each lane: one step of every
        batch row (the prompts' first, the others fed zeros), or each lane's step of its rows."""
        stepped = self._stepped(lanes)
        t, p = np.zeros((self.batch, 1), np.int32), np.zeros((self.batch, 1), np.int32)
        t[: len(tokens), 0], p[: len(tokens), 0] = tokens, positions
        return [
            (self._steps.get(rows, len(lanes), pool), t[rows.start : rows.stop], p[rows.start : rows.stop])
            for rows in stepped
        ]

    def _prefill(self, prompts: list[list[int]], pool: int, keep_logits: bool, start: int = 0):
        """Each prompt's tokens written into the caches from position `start` on (the earlier
        ones are cached already); the candidates for each prompt's next token. Several short
        new prompts on layer groups go in lanes (prefill_in_lanes), as they decode."""
        if self.pipelined and not keep_logits and self.net.prefills_in_lanes(prompts, start):
            v, i = self.net.prefill_in_lanes(prompts, pool)
            return [(v[b, 0], i[b, 0]) for b in range(len(prompts))]
        values, indices, *logits = self.net.prefill(prompts, start, pool, logits=keep_logits)
        if keep_logits:  # the whole vocabulary, gathered only when asked for
            self.last_logits = logits[0].numpy()[: len(prompts), 0].astype(np.float32)
        v, i = values.numpy(), indices.numpy()
        return [(v[b, 0], i[b, 0]) for b in range(len(prompts))]

    def _decode_step(self, tokens: list[int], positions: np.ndarray, pool: int, lanes: list[range]):
        """One decode step run by the coordinator, each lane's step captured where it is not
        yet: the candidates for each prompt's next token."""
        picks = []
        build = self._build(pool, lanes)
        fed = self._steps_of(tokens, positions, pool, lanes)
        for lane, rows, (_, t, p) in zip(lanes, self._stepped(lanes), fed):
            values, indices, *_ = self._steps.run(rows, len(lanes), pool, build, t, p)
            v, i = values.numpy(), indices.numpy()
            picks += [(v[b, 0], i[b, 0]) for b in range(len(lane))]
        return picks


def _shown(prompt: Prompt) -> str:
    """A prompt as a Generation records it: text as given; a conversation's last message."""
    return prompt if isinstance(prompt, str) else (prompt[-1]["content"] if prompt else "")
