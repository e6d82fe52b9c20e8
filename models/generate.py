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
from models.errors import ModelError
from models.gguf_model import GGUFModel
from models.llama import CACHE_TYPES, TensorParallelLlama, qkv_fusable
from split_state.ops import ACTIVATIONS
from split_state.sampling import TEMPERATURE_FLOOR, Rule, choose, generator_state
from transport.protocol import GenerateSettings

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
        # a continuation: the first word's space is the generation's (a SentencePiece-style
        # tokenizer would take it off the text's start)
        return self.tokenizer.decode(self.tokens, skip_special=not self.special, continuation=True)

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


Prompt = str | Sequence[Mapping[str, str]]  # text, or a conversation: [{"role": ..., "content": ...}]


def messages_of(prompt: Prompt, system: str = "") -> list[dict]:
    """A prompt as chat messages: text is one user turn; `system` goes first unless the
    conversation has its own system message."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
        for m in messages:
            if set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
                raise ModelError(f"a chat message is a {{'role': str, 'content': str}} mapping; got {m!r}")
    if system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def prompt_text(model: GGUFModel, prompt: Prompt, chat: bool, system: str = "") -> str:
    """The text the model reads for `prompt`: text as given, or (with `chat`, and always for a
    list of messages) the conversation in the file's chat template, rendered in a sandbox (an
    unsafe or broken template is a TemplateError naming the file)."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = prompt[exc.start : exc.end].encode("utf-8", "surrogateescape")
            raise ModelError(f"the prompt is not UTF-8 text: byte(s) {bad!r} at character {exc.start}") from None
        if not chat:
            return prompt
    template = model.chat_template
    if template is None:
        raise ModelError(f"{model.path.name} has no chat template; drop --chat (and --system, --interactive)")
    return template.render(messages_of(prompt, system))


def check_text_fits(text: str, ctx: int, model: GGUFModel, what: str = "the prompt") -> str:
    """`text`, refused before it is tokenized where it is longer than any `ctx` tokens of the
    model could be (tokenizing megabytes costs seconds and gigabytes, to then say it does not fit)."""
    most = ctx * model.longest_token_bytes
    if len(text) > most or len(text.encode("utf-8", "surrogatepass")) > most:
        raise ModelError(f"{what} is longer than a context of {ctx} tokens could hold ({most} bytes at most)")
    return text


def check_context(ctx: int, model_ctx: int) -> None:
    if not 0 < ctx <= model_ctx:
        raise ModelError(f"--ctx {ctx}: give 1 to the model's context length, {model_ctx}")


def check_lengths(lengths: Sequence[int], max_new_tokens: int, ctx: int, model_ctx: int) -> None:
    """Prompts of these token counts, and `max_new_tokens` more each, fit in `ctx`."""
    if min(lengths) == 0:
        raise ModelError("an empty prompt: give at least one token of text")
    if max_new_tokens < 0:
        raise ModelError(f"--max-new-tokens {max_new_tokens}: give 0 or more")
    if max(lengths) + max_new_tokens > ctx:
        raise ModelError(
            f"a prompt of {max(lengths)} tokens plus {max_new_tokens} new ones exceeds the context of "
            f"{ctx} tokens; raise --ctx (up to {model_ctx}) or shorten the prompt"
        )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def check_fits(
    dev: MetaDevice, model: GGUFModel, weights: str, ctx: int, batch: int, cache_types: tuple[str, str] = ("f32", "f32")
) -> None:
    """Refuse, before any weight moves, a model that cannot fit the workers' memory budgets:
    each worker holds at least its share of the weights (1/N of them) and the KV cache of its
    whole KV heads (the worker with the most: ceil(kv heads / N)) at `ctx` positions. A model
    that passes may still run short by the uneven part of the split, the worker's programs and
    its working memory: that is the workers' OutOfMemory, as before."""
    cfg, n = model.config, dev.n
    share = model.resident_bytes(weights) / n
    position = sum(np.dtype(CACHE_TYPES[c]).itemsize for c in cache_types) * cfg.head_dim  # a key and a value
    kv = cfg.layers * batch * -(-cfg.kv_heads // n) * ctx * position
    budget = min(info["budget"] for info in dev.stats().values())
    if share + kv > budget:
        mib = 1 << 20
        raise ModelError(
            f"{model.path.name} cannot fit: each of {n} workers needs at least {share / mib:.0f} MiB of "
            f"{weights} weights and {kv / mib:.0f} MiB of KV cache at --ctx {ctx}"
            + (f" for {batch} sequences" if batch > 1 else "")
            + f", over its {budget / mib:.0f} MiB budget; use more workers"
            + (", --weights native" if weights != "native" else "")
            + " or a smaller --ctx"
        )


def check_cache_types(cache_types: Sequence[str]) -> None:
    for flag, kind in zip(("--cache-type-k", "--cache-type-v"), cache_types):
        if kind not in CACHE_TYPES:
            raise ModelError(f"{flag} {kind!r}: one of {', '.join(CACHE_TYPES)}")


WEIGHTS = ("native", "f32")  # kept in the file's blocks where the workers compute on them; all float32


def fuses_qkv(model: GGUFModel, weights: str) -> bool:
    """Whether the model's q, k and v weights become one (TensorParallelLlama's fuse_qkv): where
    every layer's are of one kind as `weights` keeps them (a Q4_K_M file's V is often Q6_K where
    its Q and K are Q4_K: then they stay three)."""
    return qkv_fusable(lambda name: model.kept_format(name, weights), model.config)


def place_model(
    dev: MetaDevice,
    model: GGUFModel,
    ctx: int,
    batch: int,
    weights: str = "native",
    cache_types: Sequence[str] = ("f32", "f32"),
    progress=None,
    activations: str = "q8",
) -> TensorParallelLlama:
    """The model's weights and caches (`batch` rows of `ctx` positions) placed on the workers,
    after every check that can refuse it first (context, weights, cache types, the workers'
    memory); the coordinator's copy of the file then goes. The one loader of LLM and the
    server's ContinuousBatcher."""
    check_context(ctx, model.context_length)
    if weights not in WEIGHTS:
        raise ModelError(f"--weights {weights!r}: one of {', '.join(WEIGHTS)}")
    if activations not in ACTIVATIONS:
        raise ModelError(f"--activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
    check_cache_types(cache_types)
    check_fits(dev, model, weights, ctx, batch, tuple(cache_types))
    source = model.native if weights == "native" else model.weight
    fuse = fuses_qkv(model, weights)
    net = TensorParallelLlama(
        dev,
        model.config,
        source,
        ctx,
        batch,
        progress=progress,
        cache_types=tuple(cache_types),
        fuse_qkv=fuse,
        activations=activations,
    )
    model.release_pages()  # the workers hold the weights: the coordinator's copy of the file goes
    return net


class LLM:
    def __init__(
        self,
        dev: MetaDevice,
        model: GGUFModel,
        ctx: int = 2048,
        batch: int = 1,
        progress=None,
        weights: str = "native",
        cache_types: tuple[str, str] = ("f32", "f32"),
        activations: str = "q8",
    ):
        """`cache_types`: the KV caches' element types (K, V), models.llama.CACHE_TYPES's names.
        `activations`: the quantized products' ("q8", llama.cpp's 8-bit activations and integer
        products, or "f32", exact float32 products)."""
        self.dev, self.model, self.ctx, self.batch = dev, model, ctx, batch
        self.net = place_model(dev, model, ctx, batch, weights, cache_types, progress, activations)
        self.tokenizer = model.tokenizer
        self._decode: dict[int, object] = {}  # captured decode steps by candidate pool size
        self.last_logits: np.ndarray | None = None  # (prompts, vocab) of the last prefill
        self._cached: list[int] = []  # the tokens batch row 0's caches hold at positions 0..

    def warm_up(self, sampling: Sampling = Sampling()) -> int:
        """Load, without running, the steps generating under `sampling` will run: the prefill
        step of every padded prompt length (a long prompt's chunks included) and the decode
        step, so the first prompt is as fast as a later one (llama.cpp's warm-up at load; a
        prefill length is three small programs, its embedding, one layer and its head). Returns
        how many prefill lengths and decode steps were loaded."""
        pool = sampling.pool
        loaded = self.net.warm_up(pool)
        if pool not in self._decode:
            self._decode[pool] = self.net.prepare_decode(self.batch, build=candidates(pool))
            loaded += 1
        return loaded

    def prompt_ids(self, prompt: Prompt, chat: bool, system: str = "") -> list[int]:
        return self.tokenizer.encode(
            check_text_fits(prompt_text(self.model, prompt, chat, system), self.ctx, self.model)
        )

    def chat(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int = 256, **options) -> Generation:
        """The next assistant turn of a conversation, `[{"role": "user", "content": ...}, ...]`,
        in the file's chat template. Batch row 0's caches keep the conversation: when the next
        call's conversation begins with the same tokens, only what is new is prefilled (as
        llama.cpp's interactive mode does). Options: those of `generate`."""
        return self.generate([messages], max_new_tokens, chat=True, reuse_prefix=True, **options)[0]

    def generate(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 32,
        sampling: Sampling = Sampling(),
        chat: bool = False,
        stop_at_eos: bool = True,
        special: bool = False,
        stop_strings: Sequence[str] = (),
        keep_logits: bool = False,
        on_token: Callable[[int, int], None] | None = None,
        system: str = "",
        reuse_prefix: bool = False,
    ) -> list[Generation]:
        """Generate for every prompt (at most `batch` of them): text, or a conversation (a list
        of messages, always in the chat template; `system` is the system message of each that
        has none). `on_token(prompt index, token)` is called as tokens arrive. A sequence ends
        at the model's end-of-generation tokens (EOS, end of turn) unless `stop_at_eos` is
        False, and where its text first contains one of `stop_strings` (the text ends before
        it); control tokens are left out of the text unless `special`. `reuse_prefix` (one
        prompt): prefill only what follows the tokens batch row 0's caches already hold."""
        if any(not s for s in stop_strings):
            raise ModelError("an empty stop string would stop before the first token; give text to stop at")
        if not 1 <= len(prompts) <= self.batch:
            raise ModelError(f"{len(prompts)} prompts for a model placed for a batch of {self.batch}")
        out = [Generation(_shown(p), self.prompt_ids(p, chat, system)) for p in prompts]
        lengths = [len(g.prompt_tokens) for g in out]
        check_lengths(lengths, max_new_tokens, self.ctx, self.model.context_length)
        start = 0
        if reuse_prefix and len(out) == 1:  # never the whole prompt: its last token's logits are needed
            start = min(common_prefix(self._cached, out[0].prompt_tokens), lengths[0] - 1)
        rng = np.random.default_rng(sampling.seed)
        rule, window = sampling.rule, sampling.penalized
        recent = [collections.deque(g.prompt_tokens[-window:] if window else (), maxlen=window) for g in out]
        clock = time.perf_counter()
        picks = self._prefill([g.prompt_tokens[start:] for g in out], sampling.pool, keep_logits, start)
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
        if not finished and left > 0 and sampling.pool not in self._decode:
            # the first decode step is captured (and run) here; the workers replay it after
            picks = self._decode_step(tokens, positions, sampling.pool)
            tokens = [choose(v, i, rule, rng, recent[b]) for b, (v, i) in enumerate(picks)]
            positions, left = positions + 1, left - 1
            finished = record(tokens)
        if not finished and left > 0:
            self._drive(tokens, positions, left, sampling, rng, done, stop, recent, record)
        decode_s = time.perf_counter() - clock
        # what row 0's caches hold now: its prompt, and every token fed back (all but the last)
        self._cached = out[0].prompt_tokens + out[0].tokens[:-1]
        for g in out:
            g.text = self.tokenizer.decode(g.tokens, skip_special=not special, continuation=True)
            cut = stop_string_at(g.text, stop_strings)
            g.text = g.text if cut is None else g.text[:cut]
            g.prefill_s, g.decode_s, g.sampling = prefill_s, decode_s, sampling
        return out

    def _drive(self, tokens, positions, steps: int, sampling: Sampling, rng, done, stop, recent, record) -> None:
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

        settings = GenerateSettings(
            sampling.rule,
            tuple(generator_state(rng)),
            tuple(stop),
            tuple(done),
            tuple(tuple(r) for r in recent),
        )
        self.dev.generate(self._decode[sampling.pool], t, p, steps, settings, on_tokens)
        if raised:
            raise raised[0]

    def _prefill(self, prompts: list[list[int]], pool: int, keep_logits: bool, start: int = 0):
        """Each prompt's tokens written into the caches from position `start` on (the earlier
        ones are cached already); the candidates for each prompt's next token."""
        values, indices, *logits = self.net.prefill(prompts, start, pool, logits=keep_logits)
        if keep_logits:  # the whole vocabulary, gathered only when asked for
            self.last_logits = logits[0].numpy()[: len(prompts), 0].astype(np.float32)
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
            step, (values, indices, *_) = self.net.capture_decode(t, p, build=candidates(pool))
            self._decode[pool] = step
        else:
            values, indices, *_ = step(t, p)
        v, i = values.numpy(), indices.numpy()
        return [(v[b, 0], i[b, 0]) for b in range(len(tokens))]


def candidates(pool: int, mass: bool = False) -> Callable:
    """A decode step's results: every row's `pool` best (values, indices); with `mass` also each
    row's sum over the whole vocabulary of exp(logit - its best logit), (rows, 1): its
    log-probabilities' normalizer (log p = logit - best - log mass), one float a row (the
    vocabulary's shares summed by an all-reduce, never gathered)."""

    def build(logits) -> list:
        values, indices = logits.top_k(pool)
        if not mass:
            return [values, indices]
        return [values, indices, (logits - values[:, :, 0:1]).exp().sum(axis=-1)]

    return build


def log_normalizer(logits: np.ndarray) -> float:
    """log sum exp of one row of logits, in float64: log p(token) = logit - this."""
    row = np.asarray(logits, np.float64)
    best = row.max()
    return float(best + np.log(np.exp(row - best).sum()))


def _shown(prompt: Prompt) -> str:
    """A prompt as a Generation records it: text as given; a conversation's last message."""
    return prompt if isinstance(prompt, str) else (prompt[-1]["content"] if prompt else "")
