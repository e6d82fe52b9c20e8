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

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from meta.device import MetaDevice
from models.gguf_model import GGUFModel, ModelError
from models.llama import TensorParallelLlama
from workers.generation import choose, generator_state

POOL = 256  # candidates per sequence a sampled step considers


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit (within POOL)
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ModelError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {self}")

    @property
    def pool(self) -> int:
        if self.temperature == 0:
            return 1
        return min(self.top_k, POOL) if self.top_k else POOL


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


def stop_string_at(text: str, stop_strings: Sequence[str]) -> int | None:
    """Where the first of `stop_strings` to occur in `text` begins, or None."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None


class TextStream:
    """A generation's text as its tokens arrive: each `push` returns the new text that is safe
    to show (whole characters only, nothing past a stop string, and the end that may still begin
    one held back)."""

    def __init__(self, tokenizer, special: bool = False, stop: Sequence[str] = ()):
        self.tokenizer, self.special, self.stop = tokenizer, special, list(stop)
        self.tokens: list[int] = []
        self.shown = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special=not self.special)
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

    def final_text(self) -> str:
        """The whole text, cut at the first stop string."""
        text = self.tokenizer.decode(self.tokens, skip_special=not self.special)
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
    """The length of the longest end of `text` that begins one of `stop`."""
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def prompt_text(model: GGUFModel, prompt: str, chat: bool) -> str:
    """The text the model reads for `prompt`: as given, or wrapped in the file's chat template
    (rendered in a sandbox; an unsafe or broken template is a TemplateError naming the file)."""
    if not chat:
        return prompt
    template = model.chat_template
    if template is None:
        raise ModelError(f"{model.path.name} has no chat template; drop --chat")
    return template.render([{"role": "user", "content": prompt}])


WEIGHTS = ("native", "f32")  # kept in the file's blocks where the workers compute on them; all float32


class LLM:
    def __init__(
        self,
        dev: MetaDevice,
        model: GGUFModel,
        ctx: int = 2048,
        batch: int = 1,
        progress=None,
        weights: str = "f32",
    ):
        if ctx > model.context_length:
            raise ModelError(f"--ctx {ctx} exceeds the model's context length {model.context_length}")
        if weights not in WEIGHTS:
            raise ModelError(f"--weights {weights!r}: one of {', '.join(WEIGHTS)}")
        self.dev, self.model, self.ctx, self.batch = dev, model, ctx, batch
        source = model.native if weights == "native" else model.weight
        self.net = TensorParallelLlama(dev, model.config, source, ctx, batch, progress=progress)
        self.tokenizer = model.tokenizer
        self._decode: dict[int, object] = {}  # captured decode steps by candidate pool size
        self.last_logits: np.ndarray | None = None  # (prompts, vocab) of the last prefill

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        return self.tokenizer.encode(prompt_text(self.model, prompt, chat))

    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int = 32,
        sampling: Sampling = Sampling(),
        chat: bool = False,
        stop_at_eos: bool = True,
        special: bool = False,
        stop_strings: Sequence[str] = (),
        keep_logits: bool = False,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[Generation]:
        """Generate for every prompt (at most `batch` of them); `on_token(prompt index, token)`
        is called as tokens arrive. A sequence ends at the model's end-of-generation tokens
        (EOS, end of turn) unless `stop_at_eos` is False, and where its text first contains one
        of `stop_strings` (the text ends before it); control tokens are left out of the text
        unless `special`."""
        if any(not s for s in stop_strings):
            raise ModelError("an empty stop string would stop before the first token; give text to stop at")
        if not 1 <= len(prompts) <= self.batch:
            raise ModelError(f"{len(prompts)} prompts for a model placed for a batch of {self.batch}")
        out = [Generation(p, self.prompt_ids(p, chat)) for p in prompts]
        lengths = [len(g.prompt_tokens) for g in out]
        if min(lengths) == 0:
            raise ModelError("an empty prompt: give at least one token of text")
        if max(lengths) + max_new_tokens > self.ctx:
            raise ModelError(
                f"a prompt of {max(lengths)} tokens plus {max_new_tokens} new ones exceeds the context of "
                f"{self.ctx} tokens; raise --ctx (up to {self.model.context_length}) or shorten the prompt"
            )
        rng = np.random.default_rng(sampling.seed)
        start = time.perf_counter()
        picks = self._prefill([g.prompt_tokens for g in out], sampling.pool, keep_logits)
        tokens = [choose(v, i, sampling.temperature, sampling.top_p, rng) for v, i in picks]
        prefill_s = time.perf_counter() - start
        positions = np.array(lengths)
        done = [False] * len(out)
        stop = sorted(self.model.end_of_generation) if stop_at_eos else []

        def record(chosen: Sequence[int]) -> bool:
            """Take one step's tokens; True once every sequence is done."""
            for b, g in enumerate(out):
                if not done[b]:
                    g.tokens.append(chosen[b])
                    if on_token is not None:
                        on_token(b, chosen[b])
                    done[b] = chosen[b] in stop
                    if stop_strings and not done[b]:
                        text = self.tokenizer.decode(g.tokens, skip_special=not special)
                        done[b] = stop_string_at(text, stop_strings) is not None
                    if done[b]:
                        g.finish_reason = "stop"
            return all(done)

        start = time.perf_counter()
        finished, left = record(tokens), max_new_tokens - 1
        if not finished and left > 0 and sampling.pool not in self._decode:
            # the first decode step is captured (and run) here; the workers replay it after
            picks = self._decode_step(tokens, positions, sampling.pool)
            tokens = [choose(v, i, sampling.temperature, sampling.top_p, rng) for v, i in picks]
            positions, left = positions + 1, left - 1
            finished = record(tokens)
        if not finished and left > 0:
            self._drive(tokens, positions, left, sampling, rng, done, stop, record)
        decode_s = time.perf_counter() - start
        for g in out:
            g.text = self.tokenizer.decode(g.tokens, skip_special=not special)
            cut = stop_string_at(g.text, stop_strings)
            g.text = g.text if cut is None else g.text[:cut]
            g.prefill_s, g.decode_s, g.sampling = prefill_s, decode_s, sampling
        return out

    def _drive(self, tokens, positions, steps: int, sampling: Sampling, rng, done, stop, record) -> None:
        """The rest of the decode loop on the workers: they choose each token themselves (with
        this generator's state) and report it; an exception in `record` (Ctrl-C in a stream
        callback) cancels them after the step under way and is raised here once they stopped."""
        batch = self.batch
        t = np.zeros((batch, 1), np.int32)
        t[: len(tokens), 0] = tokens
        p = np.zeros((batch, 1), np.int32)
        p[: len(tokens), 0] = positions
        raised: list[BaseException] = []

        def on_tokens(step: int, chosen: list[int]) -> bool:
            try:
                return not record(chosen[: len(tokens)])  # all done (a stop string): cancel
            except BaseException as exc:  # noqa: BLE001 - re-raised once the workers stopped
                raised.append(exc)
                return False

        settings = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "rng": generator_state(rng),
            "stop": stop,
            "done": list(done),
        }
        self.dev.generate(self._decode[sampling.pool], t, p, steps, settings, on_tokens)
        if raised:
            raise raised[0]

    def _prefill(self, prompts: list[list[int]], pool: int, keep_logits: bool):
        batch, longest = self.batch, max(len(p) for p in prompts)
        tokens = np.zeros((batch, longest), np.int32)
        positions = np.tile(np.arange(longest, dtype=np.int32), (batch, 1))
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = p
        last = [len(p) - 1 for p in prompts] + [0] * (batch - len(prompts))
        logits = self.net.step(tokens, positions, last=last)  # (batch, 1, vocab): the last positions'
        values, indices = logits.top_k(pool)  # only candidates travel
        # the whole vocabulary, gathered only when asked for
        rows = [logits[b : b + 1] for b in range(len(prompts))] if keep_logits else []
        self.dev.run(values, indices, *rows, *self.net.caches())
        if keep_logits:
            self.last_logits = np.stack([r.numpy().reshape(-1).astype(np.float32) for r in rows])
        v, i = values.numpy(), indices.numpy()
        return [(v[b, 0], i[b, 0]) for b in range(len(prompts))]

    def _decode_step(self, tokens: list[int], positions: np.ndarray, pool: int):
        batch = self.batch
        t = np.zeros((batch, 1), np.int32)
        t[: len(tokens), 0] = tokens
        p = np.zeros((batch, 1), np.int32)
        p[: len(tokens), 0] = positions
        step = self._decode.get(pool)
        if step is None:
            step, (values, indices, *_) = self.net.capture_decode(t, p, build=lambda logits: list(logits.top_k(pool)))
            self._decode[pool] = step
        else:
            values, indices, *_ = step(t, p)
        v, i = values.numpy(), indices.numpy()
        return [(v[b, 0], i[b, 0]) for b in range(len(tokens))]
