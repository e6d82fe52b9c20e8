"""`launch.py generate`: text from a llama-family GGUF model, tensor-parallel over the workers."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np

from cli.display import progress
from cli.options import add_cluster_options, open_cluster


def generate(args: argparse.Namespace) -> int:
    from models.generate import LLM, Sampling, prompt_text
    from models.gguf_model import GGUFModel, ModelError

    if not args.prompts:
        raise ModelError('generate: give one or more prompts, e.g. launch.py generate "The capital of France is"')
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    model = GGUFModel(args.model or None)
    for prompt in args.prompts:  # the file's chat template is checked before any worker starts
        prompt_text(model, prompt, args.chat)
    with open_cluster(args) as dev:
        start = time.perf_counter()
        llm = LLM(
            dev,
            model,
            ctx=args.ctx,
            batch=len(args.prompts),
            progress=lambda i, n: progress(i, n, "placing layers", start),
            weights=args.weights,
        )
        stream = _Stream(llm.tokenizer, args.special, args.stop) if len(args.prompts) == 1 else None
        out = llm.generate(
            args.prompts,
            args.max_new_tokens,
            sampling,
            chat=args.chat,
            stop_at_eos=not args.ignore_eos,
            special=args.special,
            stop_strings=args.stop,
            keep_logits=bool(args.logits_out),
            on_token=stream,
        )
    if stream is not None:
        stream.finish(out[0].text)
        print(flush=True)
    else:
        for g in out:
            print(f"{g.prompt!r} -> {g.text!r}")
    g = out[0]
    prompt_tokens = sum(len(x.prompt_tokens) for x in out)
    new = sum(len(x.tokens) for x in out)
    print(
        f"{len(out)} prompt(s) on {dev.n} {dev.cluster.config.backend} workers: prefill {prompt_tokens} tokens in "
        f"{g.prefill_s:.2f} s ({prompt_tokens / g.prefill_s:.1f} tokens/s), decode {new} tokens in "
        f"{g.decode_s:.2f} s ({max(0, new - len(out)) / g.decode_s if g.decode_s else 0:.1f} tokens/s)",
        file=sys.stderr,
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([x.as_json() for x in out], f, indent=1)
    if args.logits_out:
        np.save(args.logits_out, llm.last_logits.astype(np.float32))
    return 0


class _Stream:
    """Prints a single prompt's text as its tokens arrive (whole characters only)."""

    def __init__(self, tokenizer, special: bool = False, stop: Sequence[str] = ()):
        from models.generate import TextStream

        self.text = TextStream(tokenizer, special, stop)

    def __call__(self, prompt: int, token: int) -> None:
        sys.stdout.write(self.text.push(token))
        sys.stdout.flush()

    def finish(self, text: str) -> None:
        sys.stdout.write(self.text.finish(text))


def add(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a llama-family GGUF model, tensor-parallel")
    p.add_argument("prompts", nargs="*")
    p.add_argument("--model", default="", help="a llama-architecture .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="at most this many (default: %(default)s); fewer at the end"
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
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--ctx", type=int, default=2048, help="KV cache length (tokens per sequence)")
    p.add_argument(
        "--weights",
        choices=("native", "f32"),  # models.generate.WEIGHTS, without importing the models here
        default="f32",
        help="f32: every weight float32 (the fastest here); native: Q4_0, Q4_1 and Q8_0 matrices stay in the "
        "file's blocks on the workers (a fifth of the memory, slower decode for now), other types float32 "
        "(default: %(default)s)",
    )
    p.add_argument("--json", default="", help="write prompts, token ids, text and timings here")
    p.add_argument("--logits-out", default="", help="write the last prompt position's logits (.npy)")
    add_cluster_options(p)
    p.set_defaults(fn=generate)
