"""Fused patterns against their steps, side by side in one run: N workers fusing every pattern
against N workers leaving some unfused (META_TP_UNFUSED, read by each worker), beside llama.cpp
with N threads, on one GGUF file's native weights.

    python bench/fusion.py [--quick] [--json PATH] [--workers 2] [--rounds 7] [--model FILE.gguf]
                           [--unfused rope_set_rows] [--swap]

The file defaults to the packaged SmolLM2-135M-Instruct. Both models stay loaded (one cluster of
N workers each, one decoding at a time) and llama.cpp too; each round decodes the same number of
greedy tokens on each, driven by the workers as `generate` runs it, in an order that turns every
round (bench/llm.py alternate); the figures are the rounds' medians, the ratios the medians of
each round's pairs. On a 2-vCPU VM the variant whose workers started first ran 0.89-0.96x the
other in A/A runs (--unfused attention, a pattern SmolLM2's 2-worker decode does not use): run
it with and without --swap (the other starts first) and take both. Both prefills' chosen tokens
are compared (the tests hold the decoded tokens equal: tests/test_fused.py, tests/test_quant.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llm import model_path, side_by_side  # noqa: E402
from bench.report import cli, paired_ratio, table  # noqa: E402

DEFAULT_UNFUSED = "rope_set_rows"


def run(quick: bool, workers: int, rounds: int, path: str | None, unfused: str, swap: bool = False) -> dict | None:
    from workers.kernels.fused import UNFUSED_ENV, left_fused

    if path is None:
        return None
    left_fused(unfused)  # a wrong name: refused here, before any worker starts
    variants = {"every pattern fused": ({}, {}), f"unfused: {unfused}": ({UNFUSED_ENV: unfused}, {})}
    built = dict(list(variants.items())[::-1]) if swap else variants
    got = side_by_side(path, workers, built, rounds, quick)
    seconds, names = got["seconds"], list(variants)
    rows = []
    for name in names:
        row = {"variant": name, "decode_tok_s": 1 / float(np.median(seconds[name]))}
        row["vs_unfused"] = paired_ratio(seconds[names[1]], seconds[name])
        if seconds["llama.cpp"]:
            row["vs_llama_cpp"] = paired_ratio(seconds["llama.cpp"], seconds[name])
        rows.append(row)
    llama_tok_s = 1 / float(np.median(seconds["llama.cpp"])) if seconds["llama.cpp"] else None
    return {
        "model": Path(path).name,
        "workers": workers,
        "steps": got["steps"],
        "rounds": rounds,
        "rows": rows,
        "llama_cpp_decode_tok_s": llama_tok_s,
        "same_first_token": len(set(got["first"].values())) == 1,
        "built_first": next(iter(built)),
    }


def show(results: dict | None) -> None:
    if results is None:
        return
    cols = ["variant", "tok/s", "vs unfused", "vs llama.cpp"]
    rows = [[r["variant"], r["decode_tok_s"], r["vs_unfused"], r.get("vs_llama_cpp", "-")] for r in results["rows"]]
    llama, n = results["llama_cpp_decode_tok_s"], results["workers"]
    title = f"{results['model']}: greedy decode on {n} workers, {results['steps']} tokens a round, "
    title += f"medians of {results['rounds']} rounds" + (f"; llama.cpp {n} threads {llama:.1f} tok/s" if llama else "")
    print(table(title, cols, rows))
    print(f"built first: {results['built_first']}")
    if not results["same_first_token"]:
        print("the variants chose different first tokens")


def main(argv: list[str] | None = None) -> int:
    def options(ap) -> None:
        ap.add_argument("--workers", type=int, default=2)
        ap.add_argument("--rounds", type=int, default=7)
        ap.add_argument("--model", default="", help="a GGUF file (default: the packaged SmolLM2-135M-Instruct)")
        ap.add_argument("--unfused", default=DEFAULT_UNFUSED, help="the patterns the second variant leaves unfused")
        ap.add_argument("--swap", action="store_true", help="start the unfused variant's workers first")

    def measure(args):
        rounds = 1 if args.quick else args.rounds
        return run(args.quick, args.workers, rounds, model_path(args.model, ""), args.unfused, args.swap)

    return cli(__doc__, "fusion", measure, show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
