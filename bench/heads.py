"""Attention's head split on N workers, side by side in one run: the split the model chooses (on
CPU workers whose KV heads do not divide among them, the query heads evenly, a cut group's KV head
on both sides: HeadSplit.even_queries) against whole KV groups (the split before it), beside
llama.cpp with N threads, on one GGUF file.

    python bench/heads.py [--quick] [--json PATH] [--workers 2] [--rounds 7] [--model FILE.gguf]

The file defaults to the packaged SmolLM2-135M-Instruct (9 query heads of 3 KV heads: 5 | 4
against 6 | 3 on 2 workers). Both models stay loaded (one cluster of N workers each, one
decoding at a time) and llama.cpp too; each round decodes the same number of greedy tokens on
each, driven by the workers as `generate` runs it, in an order that turns every round; the
figures are the rounds' medians, the ratios the medians of each round's pairs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llm import model_path, side_by_side  # noqa: E402
from bench.report import cli, paired_ratio, table  # noqa: E402


def run(quick: bool, workers: int, rounds: int, path: str | None) -> dict | None:
    from models.gguf_model import GGUFModel
    from models.llama import HeadSplit

    if path is None:
        return None
    whole = HeadSplit.whole_groups(GGUFModel(path).config, workers)
    variants = {"chosen": ({}, {}), "whole KV groups": ({}, {"heads": whole})}
    got = side_by_side(path, workers, variants, rounds, quick, lambda net: " | ".join(map(str, net.heads.query)))
    seconds = got["seconds"]
    rows = []
    for name in variants:
        tok_s = 1 / float(np.median(seconds[name]))
        row = {"split": name, "query_heads": got["described"][name], "decode_tok_s": tok_s}
        row["vs_whole_groups"] = paired_ratio(seconds["whole KV groups"], seconds[name])
        if seconds["llama.cpp"]:
            row["vs_llama_cpp"] = paired_ratio(seconds["llama.cpp"], seconds[name])
        rows.append(row)
    llama_tok_s = 1 / float(np.median(seconds["llama.cpp"])) if seconds["llama.cpp"] else None
    return {"model": Path(path).name, "workers": workers, "steps": got["steps"], "rounds": rounds, "rows": rows} | {
        "llama_cpp_decode_tok_s": llama_tok_s
    }


def show(results: dict | None) -> None:
    if results is None:
        return
    cols = ["split", "query heads", "tok/s", "vs whole groups", "vs llama.cpp"]
    rows = [
        [r["split"], r["query_heads"], r["decode_tok_s"], r["vs_whole_groups"], r.get("vs_llama_cpp", "-")]
        for r in results["rows"]
    ]
    llama, n = results["llama_cpp_decode_tok_s"], results["workers"]
    title = f"{results['model']}: greedy decode on {n} workers, {results['steps']} tokens a round, "
    title += f"medians of {results['rounds']} rounds" + (f"; llama.cpp {n} threads {llama:.1f} tok/s" if llama else "")
    print(table(title, cols, rows))


def main(argv: list[str] | None = None) -> int:
    def options(ap) -> None:
        ap.add_argument("--workers", type=int, default=2)
        ap.add_argument("--rounds", type=int, default=7)
        ap.add_argument("--model", default="", help="a GGUF file (default: the packaged SmolLM2-135M-Instruct)")

    def measure(args):
        return run(args.quick, args.workers, 1 if args.quick else args.rounds, model_path(args.model, ""))

    return cli(__doc__, "heads", measure, show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
