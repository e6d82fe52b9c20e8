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

from bench.llm import have_llama_cpp, model_path, paired_ratio, prompt_ids, warm_llama_cpp, worker_driven  # noqa: E402
from bench.report import cli, table  # noqa: E402
from meta import ClusterConfig, MetaDevice, ProcessCluster  # noqa: E402


def run(quick: bool, workers: int, rounds: int, path: str | None) -> dict | None:
    from models.generate import fuses_qkv
    from models.gguf_model import GGUFModel
    from models.llama import HeadSplit, TensorParallelLlama

    if path is None:
        return None
    length, steps = (16, 8) if quick else (32, 64)
    model = GGUFModel(path)
    ctx = length + (rounds + 1) * steps + 8
    splits = {"chosen": None, "whole KV groups": HeadSplit.whole_groups(model.config, workers)}
    devices, decoders, heads = [], {}, {}
    llama = None
    try:
        for name, split in splits.items():
            dev = MetaDevice(ProcessCluster(ClusterConfig(workers=workers, blas_threads=1)))
            devices.append(dev)
            net = TensorParallelLlama(
                dev, model.config, model.native, ctx, fuse_qkv=fuses_qkv(model, "native"), heads=split
            )
            _, best = net.prefill([list(prompt_ids(model, length)[0])], 0, pool=1)
            decoders[name] = worker_driven(dev, net, best.numpy().astype(np.int32).reshape(1, 1), length)
            decoders[name](2)  # captured and warm
            heads[name] = " | ".join(str(q) for q in net.heads.query)
        model.release_pages()
        if have_llama_cpp():
            llama = warm_llama_cpp(path, length, steps, workers)
        seconds: dict[str, list[float]] = {name: [] for name in [*decoders, "llama.cpp"]}
        for r in range(rounds):
            order = list(decoders)
            for name in order[r % len(order) :] + order[: r % len(order)]:
                seconds[name].append(decoders[name](steps)[0])
            if llama is not None:
                seconds["llama.cpp"].append(llama.ask("decode"))
    finally:
        if llama is not None:
            llama.close()
        for dev in devices:
            dev.close()
    rows = []
    for name in decoders:
        row = {"split": name, "query_heads": heads[name], "decode_tok_s": 1 / float(np.median(seconds[name]))}
        row["vs_whole_groups"] = paired_ratio(seconds["whole KV groups"], seconds[name])
        if seconds["llama.cpp"]:
            row["vs_llama_cpp"] = paired_ratio(seconds["llama.cpp"], seconds[name])
        rows.append(row)
    llama_tok_s = 1 / float(np.median(seconds["llama.cpp"])) if seconds["llama.cpp"] else None
    return {"model": Path(path).name, "workers": workers, "steps": steps, "rounds": rounds, "rows": rows} | {
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
