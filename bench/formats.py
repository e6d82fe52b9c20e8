"""One worker's decode and prefill on a file of each quantization type, beside llama.cpp on the
same file and threads, in one run.

    python bench/formats.py [--quick] [--json PATH] [--types q4_0 q4_1 ...] [--threads 1 2]
                            [--rounds 3] [--shape 1.7b] [--layers 8] [--activations q8]

Each file is synthetic (models/synthetic.py; made once under results/): --shape's sizes cut to
--layers layers, every matrix and the tied embedding (the output head) in the one type, seeded
random blocks, SmolLM2's vocabulary; q4_k_m is llama.cpp's Q4_K_M mix (q4_k_m_path). The
default shape is SmolLM2-1.7B's, whose 2,048-wide rows are whole K-quant blocks (SmolLM2-135M's
576 are not: llama.cpp's K files store such tensors as Q5_0 / Q5_1 / Q8_0, which is why those
types are here too). For each type our worker (its
loops and BLAS on --threads threads) and llama.cpp (llama-cpp-python, the same threads) stay
loaded and take turns, round by round: a prefill of the same prompt, then a greedy decode
(bench/threads.py's one_worker). The figures are the rounds' medians, the ratios the medians of
each round's pairs. GB/s: the bytes a decode token reads (bench/read_speed.py) times tokens/s,
ours and llama.cpp's, beside a plain read of as many bytes on the same threads in the same rounds:
where a decode nears the plain read, it is the memory's speed, not the products', that bounds it.
Without llama-cpp-python our columns stand alone. --activations: our
quantized products' (q8, llama.cpp's 8-bit activations, the default; f32, exact); our KV caches
are what generate gives those activations by default (float16 with q8, as llama.cpp's; float32
with f32).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llm import synthetic_path  # noqa: E402
from bench.report import cli, table  # noqa: E402
from bench.threads import one_worker  # noqa: E402
from split_state.quant import FORMATS  # noqa: E402

# the block formats (not bf16), and llama.cpp's Q4_K_M mix (q4_k_m_path)
TYPES = tuple(name for name, fmt in FORMATS.items() if fmt.block > 1) + ("q4_k_m",)


def q4_k_m_path(shape: str, layers: int, folder: str) -> str:
    """The shape's file in llama.cpp's Q4_K_M mix, as users download it: a float16 synthetic
    file requantized by llama.cpp's own quantizer (its rules per tensor: Q4_K, Q6_K for the
    output and some attn_v and ffn_down layers, Q5_0 / Q8_0 where rows are not whole 256-value
    blocks). Without llama-cpp-python: Q4_K matrices and a Q6_K embedding (the mix's main parts;
    the file's name says so)."""
    from bench.activations import q4_k_m_of
    from bench.llm import have_llama_cpp

    if not have_llama_cpp():
        return synthetic_path(shape, "q4_k", "q6_k", layers, folder)
    return q4_k_m_of(synthetic_path(shape, "f16", "f16", layers, folder), folder)


def run(
    quick: bool,
    types: list[str],
    threads: list[int],
    rounds: int,
    shape: str,
    layers: int,
    folder: str = "results",
    activations: str = "q8",
) -> dict:
    from models.gguf_model import GGUFModel

    length, steps = (16, 8) if quick else (64, 32)
    rows = []
    for kind in types:
        path = (
            q4_k_m_path(shape, layers, folder)
            if kind == "q4_k_m"
            else synthetic_path(shape, kind, kind, layers, folder)
        )
        for count in threads:
            row = one_worker(GGUFModel(path), path, count, length, steps, rounds, activations=activations)
            rows.append({"type": kind, "threads": count, "file_mib": os.path.getsize(path) / 2**20} | row)
    return {
        "shape": shape,
        "layers": layers,
        "threads": threads,
        "activations": activations,
        "steps": steps,
        "prompt": length,
        "rows": rows,
    }


def show(results: dict) -> None:
    cols = ["type", "threads", "MiB", "decode tok/s", "llama.cpp", "ours / llama.cpp", "GB/s ours", "llama.cpp"]
    cols += ["plain read", "prefill tok/s", "llama.cpp", "ours / it"]
    rows = [
        [r["type"], r["threads"], r["file_mib"], r["ours_decode_tok_s"], r.get("llama_cpp_decode_tok_s", "-")]
        + [r.get("vs_llama_cpp", "-"), r["ours_decode_gb_s"], r.get("llama_cpp_decode_gb_s", "-")]
        + [r["plain_read_gb_s"], r["ours_prefill_tok_s"], r.get("llama_cpp_prefill_tok_s", "-")]
        + [r.get("prefill_vs_llama_cpp", "-")]
        for r in results["rows"]
    ]
    title = (
        f"{results['shape']} shape, {results['layers']} layers, every matrix in the type; 1 worker "
        f"({results['activations']} activations) and llama.cpp on the same threads: greedy decode of "
        f"{results['steps']} tokens, prefill of {results['prompt']}"
    )
    print(table(title, cols, rows))


def main(argv: list[str] | None = None) -> int:
    def options(ap) -> None:
        from models.synthetic import SHAPES

        ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
        ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
        ap.add_argument("--activations", default="q8", choices=("q8", "f32"))
        ap.add_argument("--rounds", type=int, default=3)
        ap.add_argument("--shape", default="1.7b", choices=sorted(SHAPES))
        ap.add_argument("--layers", type=int, default=8)

    def measure(args):
        types = args.types[:2] if args.quick else args.types
        rounds = 1 if args.quick else args.rounds
        return run(args.quick, types, args.threads, rounds, args.shape, args.layers, activations=args.activations)

    return cli(__doc__, "formats", measure, show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
