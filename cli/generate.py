"""`launch.py generate`: text from a llama-family GGUF model, tensor-parallel over the workers.

Flags mean what llama-cli's mean (-m, -p, -f, -n, -c, --temp, --top-k, --top-p, --min-p,
--repeat-penalty, --repeat-last-n, --seed, -sys, -i), so its users need not learn new ones.
Everything that can be checked is checked before any worker starts: the options, the model
file's metadata against its tensors, the prompts' text and their length against --ctx.

One prompt streams its text; several decode together as a batch, each printed as plain text
(the first streams when stdout is a terminal); `--json -` writes JSON lines instead. With
`-i`, or with no prompt on a terminal, it is a conversation: the model stays loaded and each
reply streams, until end of input or /exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np

from cli.display import progress, widening_notice
from cli.options import (
    add_activations_option,
    add_cache_type_options,
    add_cluster_options,
    add_split_options,
    open_cluster,
)

EXIT = "/exit"


def generate(args: argparse.Namespace) -> int:
    from models.generate import LLM
    from models.gguf_model import GGUFModel, ModelError
    from models.loading import check_context, check_lengths, check_text_fits, decode_pool_env, prompt_text
    from models.requests import Sampling

    model = GGUFModel(args.model or None)
    model.check()
    check_context(args.ctx, model.context_length)
    most = args.ctx * model.longest_token_bytes  # bytes of text the context could hold at most
    prompts = gather_prompts(args, most)
    interactive = args.interactive or (not prompts and sys.stdin.isatty())
    if not prompts and not interactive:
        raise ModelError('give a prompt, e.g. launch.py generate "The capital of France is" (or -f FILE, or -i)')
    if prompts and interactive:
        raise ModelError("--interactive reads its messages from the input; give no prompt with it")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise ModelError(f"--max-new-tokens {args.max_new_tokens}: give 0 or more")
    check_sampling_flags(args)
    sampling = Sampling(
        args.temperature, args.top_k, args.top_p, args.seed, args.min_p, args.repeat_penalty, args.repeat_last_n
    )
    args.template_kwargs = template_kwargs(args.chat_template_kwargs)
    chat = args.chat or bool(args.system) or interactive or bool(args.template_kwargs)
    if interactive:  # the template must render and the tokenizer load before the workers start
        prompt_text(model, [{"role": "user", "content": "hello"}], True, args.system, args.template_kwargs)
        model.tokenizer  # noqa: B018 - built now: a file whose text it cannot split is refused here
    else:
        new = 32 if args.max_new_tokens is None else args.max_new_tokens
        texts = [
            check_text_fits(prompt_text(model, p, chat, args.system, args.template_kwargs), args.ctx, model)
            for p in prompts
        ]
        lengths = [len(model.tokenizer.encode(text)) for text in texts]
        check_lengths(lengths, new, args.ctx, model.context_length)
    widening_notice(model, args.weights)
    with open_cluster(args, decode_pool_env(model, args.weights, args.activations, args.environ)) as dev:
        compiling = first_compile_notice(dev)
        start = time.perf_counter()
        llm = LLM(
            dev,
            model,
            ctx=args.ctx,
            batch=max(1, len(prompts)),
            progress=lambda i, n: progress(i, n, "placing layers", start),
            weights=args.weights,
            cache_types=(args.cache_type_k, args.cache_type_v),
            activations=args.activations,
            split=args.split,
            layer_groups=args.layer_groups,
            pipelined=not args.no_pipeline,
        )
        if interactive or compiling:
            # a one-shot run would only move the same work before its prompt, unless the loops
            # compile: then loading its steps waits for that, not its prefill figure
            if not args.no_warmup:
                llm.warm_up(sampling)
        if interactive:
            return converse(llm, args, sampling)
        out = _one_batch(llm, args, prompts, new, sampling, chat)
        if args.stats:  # each worker's counters: device graphs replayed and refused, memory
            with open(args.stats, "w", encoding="utf-8") as f:
                json.dump({str(rank): stats for rank, stats in dev.stats().items()}, f, indent=1, default=str)
    if args.json and args.json != "-":
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([x.as_json() for x in out], f, indent=1)
    if args.logits_out:
        np.save(args.logits_out, llm.last_logits.astype(np.float32))
    return 0


def gather_prompts(args: argparse.Namespace, most: int) -> list[str]:
    """The prompts from the command line, -p and -f (a whole file is one prompt; - is stdin). A
    file is read up to `most` bytes (what the context could hold): a longer one is refused unread
    (-f /dev/zero included)."""
    from models.gguf_model import ModelError

    prompts = [*args.prompts, *args.prompt]
    for path in args.file:
        try:
            if path == "-":
                raw = sys.stdin.buffer.read(most + 2)
            else:
                with open(path, "rb") as f:
                    raw = f.read(most + 2)
        except OSError as exc:
            raise ModelError(f"-f {path}: {exc.strerror}") from None
        if len(raw.removesuffix(b"\n")) > most:  # one trailing newline is dropped below
            raise ModelError(f"-f {path}: longer than a context of {args.ctx} tokens could hold ({most} bytes at most)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelError(f"-f {path}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
        prompts.append(text[:-1] if text.endswith("\n") else text)  # one trailing newline dropped, as llama.cpp's -f
    return prompts


# the flag of each sampling field (models/requests.py's SAMPLING_RANGES says what each takes)
SAMPLING_FLAGS = {
    "temperature": "--temp",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty",
    "repeat_last_n": "--repeat-last-n",
}


def check_sampling_flags(args: argparse.Namespace) -> None:
    """A sampling flag out of range, named (the Sampling's own check would name its field)."""
    from models.gguf_model import ModelError
    from models.requests import sampling_refusal

    for name, flag in SAMPLING_FLAGS.items():
        refusal = sampling_refusal(name, getattr(args, name))
        if refusal is not None:
            raise ModelError(f"{flag} {getattr(args, name)}: {refusal}")


def template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of the template's further variables ("": none)."""
    from models.gguf_model import ModelError
    from models.template_sandbox import variables_refusal

    if not text:
        return {}
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"--chat-template-kwargs is not JSON: {exc}") from None
    why = variables_refusal(given)
    if why is not None:
        raise ModelError(f"--chat-template-kwargs {why}")
    return given


def _one_batch(llm, args, prompts: list[str], new: int, sampling, chat: bool):
    lines = args.json == "-"
    quiet = lines or (len(prompts) > 1 and not sys.stdout.isatty())
    live = None if quiet else _Stream(llm.tokenizer, args.special, args.stop)
    out = llm.generate(
        prompts,
        new,
        sampling,
        chat=chat,
        stop_at_eos=not args.ignore_eos,
        special=args.special,
        stop_strings=args.stop,
        keep_logits=bool(args.logits_out),
        on_token=None if live is None else (lambda b, token: b == 0 and live(b, token)),
        system=args.system,
        template_kwargs=args.template_kwargs,
    )
    if lines:
        for g in out:
            print(json.dumps(g.as_json()), flush=True)
    else:
        for b, g in enumerate(out):
            if b > 0:
                print()  # a blank line between prompts' texts
            sys.stdout.write(live.finish(g.text) if b == 0 and live is not None else g.text)
            print(flush=True)
    prompt_tokens = sum(len(x.prompt_tokens) for x in out)
    generated = sum(len(x.tokens) for x in out)
    g, dev = out[0], llm.dev
    print(
        f"{len(out)} prompt(s) on {dev.n} {dev.cluster.config.backend} workers: prefill {prompt_tokens} tokens in "
        f"{g.prefill_s:.2f} s ({prompt_tokens / g.prefill_s:.1f} tokens/s), decode {generated} tokens in "
        f"{g.decode_s:.2f} s ({max(0, generated - len(out)) / g.decode_s if g.decode_s else 0:.1f} tokens/s)",
        file=sys.stderr,
    )
    return out


def first_compile_notice(dev, stream=sys.stderr) -> bool:
    """One line when the CPU workers compile their loops on this machine's first run (numba's
    cache empty): True then."""
    from workers.backends.cpu.numba_cpu import compiled_here

    if dev.cluster.config.backend != "cpu" or compiled_here():
        return False
    stream.write(
        "note: compiling the CPU loops once on this machine (about two minutes on 2 cores); "
        "later runs load them from numba's cache\n"
    )
    stream.flush()
    return True


def converse(llm, args, sampling) -> int:
    """A conversation on the loaded model: each message read, its reply streamed, until end of
    input or /exit. The caches keep the conversation, so each turn prefills only what is new."""
    from models.gguf_model import ModelError

    terminal = sys.stdin.isatty()
    print(
        f"chatting with {llm.model.path.name}: {EXIT} or end of input (Ctrl-D) ends it; a line ending in \\ "
        "goes on in the next; Ctrl-C cuts a reply short",
        file=sys.stderr,
        flush=True,
    )
    messages: list[dict] = []
    while (text := read_message(terminal)) is not None and text.strip() != EXIT:
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        room = llm.ctx - len(llm.prompt_ids(messages, True, args.system, args.template_kwargs))
        new = room if args.max_new_tokens is None else min(args.max_new_tokens, max(room, 0))
        stream = _Stream(llm.tokenizer, args.special, args.stop)
        try:
            reply = llm.chat(
                messages,
                new,
                sampling=sampling,
                system=args.system,
                template_kwargs=args.template_kwargs,
                stop_at_eos=not args.ignore_eos,
                special=args.special,
                stop_strings=args.stop,
                on_token=stream,
            )
        except KeyboardInterrupt:  # the reply is cut short; the conversation goes on without this turn
            messages.pop()
            print("\n[interrupted]", flush=True)
            continue
        except ModelError as exc:  # the conversation outgrew --ctx: say so, keep the model loaded
            messages.pop()
            print(f"error: {exc}", file=sys.stderr, flush=True)
            continue
        sys.stdout.write(stream.finish(reply.text))
        print(flush=True)
        messages.append({"role": "assistant", "content": reply.text})
    return 0


def read_message(terminal: bool) -> str | None:
    """The next message (lines ending in a backslash go on in the next), or None at the end."""
    lines: list[str] = []
    while True:
        try:
            line = input("> " if not lines else "  ") if terminal else sys.stdin.readline()
        except EOFError:
            line = None
        except UnicodeDecodeError as exc:
            print(f"error: that line is not UTF-8 text ({exc.reason}); type it again", file=sys.stderr, flush=True)
            continue
        if line is None or (not terminal and line == ""):
            return "\n".join(lines) if lines else None
        line = line.rstrip("\n")
        if not line.endswith("\\"):
            return "\n".join([*lines, line])
        lines.append(line[:-1])


class _Stream:
    """Prints one text as its tokens arrive (whole characters only)."""

    def __init__(self, tokenizer, special: bool = False, stop: Sequence[str] = ()):
        from models.requests import TextStream

        self.text = TextStream(tokenizer, special, stop)

    def __call__(self, prompt: int, token: int) -> None:
        sys.stdout.write(self.text.push(token))
        sys.stdout.flush()

    def finish(self, text: str) -> str:
        """What is still to print once the text is final."""
        return self.text.finish(text)


def add(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a llama-family GGUF model, tensor-parallel",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=_Help,
    )
    p.add_argument("prompts", nargs="*", help="prompts; several decode together as a batch")
    p.add_argument("-p", "--prompt", action="append", default=[], help="a prompt (repeatable), as llama-cli takes it")
    p.add_argument(
        "-f", "--file", action="append", default=[], metavar="FILE", help="a prompt from a file; - reads stdin"
    )
    p.add_argument(
        "-m", "--model", default="", help="a llama-architecture .gguf file (default: SmolLM2-135M-Instruct, packaged)"
    )
    p.add_argument(
        "-n",
        "--max-new-tokens",
        "--n-predict",
        type=int,
        metavar="N",
        default=None,
        help="at most this many new tokens (default: 32; in a conversation, until the end of the turn or the context)",
    )
    p.add_argument(
        "-c", "--ctx", "--ctx-size", type=int, default=2048, metavar="N", help="KV cache length, tokens per sequence"
    )
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K best only (0: no limit)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the best whose probability reaches P")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than P times the best")
    p.add_argument(
        "--repeat-penalty", type=float, default=1.0, help="lower the recent tokens' logits by this factor (1: off)"
    )
    p.add_argument("--repeat-last-n", type=int, default=64, help="the recent tokens --repeat-penalty counts")
    p.add_argument("-s", "--seed", type=int, default=0, help="the sampler's seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("-sys", "--system", default="", help="a system message (implies --chat)")
    p.add_argument(
        "--chat-template-kwargs",
        default="",
        help="a JSON object of more variables for the chat template, as llama-server's "
        "(Qwen3's '{\"enable_thinking\": false}'; implies --chat)",
    )
    p.add_argument(
        "-i", "--interactive", action="store_true", help="a conversation read from the input (default on a terminal)"
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="in a conversation, skip loading every prompt length's step at start (the first reply then plans its own)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past the model's end-of-generation tokens (EOS, end of turn), where it stops by default",
    )
    p.add_argument("--stop-at-eos", action="store_true", help="the default; kept for older scripts")
    p.add_argument("--special", action="store_true", help="show control tokens (<|im_end|>, ...) in the text")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STRING",
        help="end the text where it first contains STRING (repeatable; the text stops before it)",
    )
    p.add_argument(
        "--weights",
        choices=("native", "f32"),  # models.loading.WEIGHTS, without importing the models here
        default="native",
        help="native: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and BF16 matrices stay in the file's blocks "
        "on the workers (a fifth of the memory and about twice the decode speed of float32 here), other types "
        "float32; f32: every weight float32 (logits equal to the float32 reference's)",
    )
    add_cache_type_options(p)
    add_activations_option(p)
    add_split_options(p)
    p.add_argument(
        "--json", default="", help="write prompts, token ids, text, finish reason and timings here; - : JSON lines"
    )
    p.add_argument(
        "--stats", default="", help="write each worker's counters (device graphs replayed and refused, memory) here"
    )
    p.add_argument("--logits-out", default="", help="write the last prompt position's logits (.npy)")
    add_cluster_options(p)
    p.set_defaults(fn=generate)


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in --help (unless its help says it); the description as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.default in (None, False, "", []):  # nothing worth saying
            return text
        return super()._get_help_string(action)
