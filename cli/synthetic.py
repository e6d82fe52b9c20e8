"""`launch.py synthetic OUT.gguf`: a llama-architecture GGUF file of any shape with seeded random
weights (models/synthetic.py), for benchmarks and checks of models that cannot be downloaded."""

from __future__ import annotations

import argparse
from pathlib import Path

from models import synthetic


def make(args: argparse.Namespace) -> int:
    base = synthetic.SHAPES[args.shape]
    sizes = {
        k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "context", "head_size")
    }
    shape = synthetic.Shape(**{k: getattr(base, k) if v is None else v for k, v in sizes.items()})
    recipe = synthetic.Recipe(
        shape,
        args.weights,
        args.embedding,
        args.output,
        args.seed,
        architecture=args.architecture,
        rope_factors=args.rope_factors,
        rope_scale=args.rope_scale,
        window=args.window,
        window_pattern=args.window_pattern,
    )
    if args.vocabulary == "none":
        vocabulary = None
    elif args.vocabulary == synthetic.BYTES:
        vocabulary = synthetic.BYTES
    elif args.vocabulary:
        vocabulary = Path(args.vocabulary)
    else:  # the packaged SmolLM2's, or one made here where it is not installed
        vocabulary = synthetic.default_vocabulary() or synthetic.BYTES
    written = synthetic.write(args.out, recipe, vocabulary)
    print(
        f"wrote {written.path} ({written.bytes / 2**20:.1f} MiB, {written.seconds:.1f} s): {shape}, "
        f"{recipe.architecture}, weights {recipe.weights}, embedding {recipe.embedding}, "
        f"head {recipe.output or 'tied'}, "
        f"seed {recipe.seed}, {written.vocab} tokens from {written.vocabulary_from}"
    )
    return 0


def add(sub) -> None:
    p = sub.add_parser("synthetic", help="write a llama GGUF file of any shape with random weights")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument(
        "--shape", default="tiny", choices=sorted(synthetic.SHAPES), help="sizes to start from (%(default)s)"
    )
    for size in ("layers", "hidden", "ffn", "heads", "kv-heads", "vocab", "context", "head-size"):
        p.add_argument(f"--{size}", type=int, default=None, help=f"override the shape's {size}")
    p.add_argument("--weights", default="q4_1", choices=synthetic.WEIGHT_TYPES, help="layer matrices (%(default)s)")
    p.add_argument("--embedding", default="q8_0", choices=synthetic.WEIGHT_TYPES, help="(default: %(default)s)")
    p.add_argument(
        "--output", default=None, choices=synthetic.WEIGHT_TYPES, help="an untied head's type (default: tied)"
    )
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (%(default)s)")
    p.add_argument(
        "--architecture",
        default="llama",
        choices=synthetic.ARCHITECTURES,
        help="qwen2: q/k/v biases; qwen3: q/k norms; phi3: fused qkv and gate|up; gemma2: post-norms, a GELU "
        "gate, the embedding scaled, soft caps; gemma3: gemma2's without soft caps, with q/k norms (%(default)s)",
    )
    p.add_argument("--window", type=int, default=None, help="phi3, gemma2 or gemma3: the sliding window's positions")
    p.add_argument(
        "--window-pattern",
        type=int,
        default=None,
        help="gemma2 or gemma3: every N-th layer global, the others windowed",
    )
    p.add_argument("--rope-factors", action="store_true", help="Llama 3.1's rope frequency factors (rope_freqs)")
    p.add_argument("--rope-scale", type=float, default=1.0, help="linear rope scaling's factor (%(default)s)")
    p.add_argument(
        "--vocabulary",
        default="",
        help="a GGUF file whose tokenizer to copy (default: the packaged SmolLM2, else 'bytes': a byte-level "
        "BPE vocabulary made here; 'none': placeholder tokens, no tokenizer)",
    )
    p.set_defaults(fn=make)
