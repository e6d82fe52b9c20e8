"""One worker's decode (and prefill) on 1..T threads beside llama.cpp on as many, on one GGUF file.

    python bench/threads.py [--quick] [--json PATH] [--threads 1 2] [--rounds 5]
                            [--model FILE.gguf | --synthetic 1.7b] [--weights native|f32]

The file defaults to a SmolLM2-1.7B-shaped synthetic one (Q4_1 layers, Q8_0 embedding; made once
under results/). For each thread count, our worker (its quantized loops and BLAS on that many
threads, `--threads`) and llama.cpp (llama-cpp-python, `n_threads`) stay loaded and take turns
in rounds, each a prefill of the same prompt and a greedy decode after it, timed over its tokens
(ours driven by the worker, as `generate` runs it, its KV caches generate's default: float16
with the file's blocks and 8-bit activations, as llama.cpp's); the figures are the rounds' medians, the ratio the
median of each round's pair. Without llama-cpp-python our rows stand alone. `--weights f32`:
our worker on the file's weights widened to float32 (BLAS's products; llama.cpp still on the
file's blocks).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llm import (  # noqa: E402
    default_caches,
    have_llama_cpp,
    model_path,
    paired_ratio,
    prompt_ids,
    warm_llama_cpp,
    worker_driven,
)
from bench.read_speed import PlainRead, token_bytes  # noqa: E402
from bench.report import cli, table  # noqa: E402
from meta import ClusterConfig, MetaDevice, ProcessCluster  # noqa: E402


def run(quick: bool, threads: list[int], rounds: int, path: str | None, weights: str = "native") -> dict | None:
    from models.gguf_model import GGUFModel

    if path is None:
        return None
    length, steps = (16, 8) if quick else (32, 32)
    model = GGUFModel(path)
    rows = [{"threads": t} | one_worker(model, path, t, length, steps, rounds, weights) for t in threads]
    one = next((r["ours_decode_tok_s"] for r in rows if r["threads"] == 1), None)
    for r in rows:
        r["vs_one_thread"] = r["ours_decode_tok_s"] / one if one else None
    return {"model": Path(path).name, "weights": weights, "steps": steps, "rows": rows}


def one_worker(
    model,
    path: str,
    threads: int,
    length: int,
    steps: int,
    rounds: int,
    weights: str = "native",
    activations: str = "q8",
) -> dict:
    """One worker on `threads` threads and llama.cpp on as many (when installed), both loaded,
    in alternating rounds after the same `length`-token prompt: a prefill of it, then a greedy
    decode of `steps` tokens, each round's ours right before theirs, and between them a plain
    read of as many bytes as a token reads on as many threads (bench/read_speed.py: the
    ceiling of a memory-bound decode in that round). tok/s of the rounds' medians, each ratio
    the median of the rounds' pairs, and the decodes' and the read's GB/s."""
    from models.llama import TensorParallelLlama
    from models.loading import decode_pool_env, fuses_qkv

    per_token = token_bytes(model)
    env = decode_pool_env(model, weights, activations, os.environ)  # as generate starts its workers
    with MetaDevice(ProcessCluster(ClusterConfig(workers=1, blas_threads=threads, env=env))) as dev:
        net = TensorParallelLlama(
            dev,
            model.config,
            model.native if weights == "native" else model.weight,
            length + (rounds + 1) * steps + 8,
            cache_types=default_caches(activations, weights),
            fuse_qkv=fuses_qkv(model, weights),
            activations=activations,
        )
        model.release_pages()
        prompt = [list(prompt_ids(model, length)[0])]
        _, best = net.prefill(prompt, 0, pool=1)
        decode = worker_driven(dev, net, best.numpy().astype(np.int32).reshape(1, 1), length)
        decode(2)  # captured and warm
        llama = warm_llama_cpp(path, length, steps, threads) if have_llama_cpp() else None
        read = PlainRead(per_token, threads)
        timed: dict[str, list[float]] = {"ours": [], "theirs": [], "ours_prefill": [], "theirs_prefill": [], "read": []}
        try:
            for _ in range(rounds):
                start = time.perf_counter()
                net.prefill(prompt, 0, pool=1)[1].numpy()  # a prompt of a length seen: replayed
                timed["ours_prefill"].append(time.perf_counter() - start)
                if llama is not None:
                    timed["theirs_prefill"].append(llama.ask("prefill"))
                timed["ours"].append(decode(steps)[0])
                timed["read"].append(read.seconds())
                if llama is not None:
                    timed["theirs"].append(llama.ask("decode"))
        finally:
            if llama is not None:
                llama.close()
    row = {
        "ours_decode_tok_s": 1 / float(np.median(timed["ours"])),
        "ours_prefill_tok_s": length / float(np.median(timed["ours_prefill"])),
        "rounds": rounds,
        "prompt": length,
        "token_mib": per_token / 2**20,
        # (float32 weights read 4 bytes a value, not the file's)
        "ours_decode_gb_s": per_token / float(np.median(timed["ours"])) / 1e9 if weights == "native" else None,
        "plain_read_gb_s": read.gb_per_s(float(np.median(timed["read"]))),
    }
    if timed["theirs"]:
        row |= {
            "llama_cpp_decode_tok_s": 1 / float(np.median(timed["theirs"])),
            "llama_cpp_decode_gb_s": per_token / float(np.median(timed["theirs"])) / 1e9,
            "vs_llama_cpp": paired_ratio(timed["theirs"], timed["ours"]),
            "llama_cpp_prefill_tok_s": length / float(np.median(timed["theirs_prefill"])),
            "prefill_vs_llama_cpp": paired_ratio(timed["theirs_prefill"], timed["ours_prefill"]),
        }
    return row


def show(results: dict | None) -> None:
    if results is None:
        return
    cols = ["threads", "ours tok/s", "vs 1 thread", "llama.cpp tok/s", "ours / llama.cpp"]
    cols += ["prefill tok/s", "llama.cpp", "ours / it"]
    rows = [
        [r["threads"], r["ours_decode_tok_s"], r["vs_one_thread"], r.get("llama_cpp_decode_tok_s", "-")]
        + [r.get("vs_llama_cpp", "-"), r["ours_prefill_tok_s"], r.get("llama_cpp_prefill_tok_s", "-")]
        + [r.get("prefill_vs_llama_cpp", "-")]
        for r in results["rows"]
    ]
    weights = results.get("weights", "native")
    title = f"{results['model']} ({weights} weights): greedy decode, 1 worker, {results['steps']} tokens a round"
    title += f", and the {results['rows'][0]['prompt']}-token prompt's prefill; medians of the rounds"
    print(table(title, cols, rows))


def main(argv: list[str] | None = None) -> int:
    def options(ap) -> None:
        from models.synthetic import SHAPES

        ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
        ap.add_argument("--rounds", type=int, default=5)
        ap.add_argument("--model", default="", help="a GGUF file (default: a synthetic one of --synthetic's shape)")
        ap.add_argument("--synthetic", default="1.7b", choices=sorted(SHAPES))
        ap.add_argument("--weights", default="native", choices=["native", "f32"])

    def measure(args):
        path = model_path(args.model, args.synthetic)
        return run(args.quick, args.threads, 1 if args.quick else args.rounds, path, args.weights)

    return cli(__doc__, "threads", measure, show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
