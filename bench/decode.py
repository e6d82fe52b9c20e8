"""One decode step of a llama-family stand-in, tensor-parallel, against the single-process NumPy
decoder with as many BLAS threads as there are workers, in the same run.

    python bench/decode.py [--quick] [--json results/decode.json] [--workers 2]

The stand-in has SmolLM2-135M's shapes (30 layers, hidden 576, 9 query heads sharing 3 KV heads,
FFN 1536, vocabulary 49152, tied head) with random float32 weights. A step: one token at the next
position, KV caches written in place, the next token picked over the split vocabulary (top-1)
and read back (the next step needs it); the step is captured once (MetaDevice.capture) and
replayed, so the coordinator builds no graph per token. The step's wall time is split into compute, collectives (moving
data and waiting on peers, from the slowest worker's own timings) and dispatch (everything else:
the coordinator's graph building, planning lookup, messages and replies).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, in_process_with_threads, table  # noqa: E402
from bench.tp_matmul import breakdown  # noqa: E402
from meta import ClusterConfig, MetaDevice, ProcessCluster  # noqa: E402
from models.llama import LlamaConfig, ReferenceDecoder, TensorParallelLlama, random_weights  # noqa: E402

STAND_IN = LlamaConfig(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152, rope_base=100000.0)
QUICK = LlamaConfig(hidden=576, layers=4, heads=9, kv_heads=3, ffn=1536, vocab=8192, rope_base=100000.0)
CTX = 256


def reference_child(cfg: LlamaConfig, steps: int, out) -> None:
    """Runs in a process whose BLAS thread count was fixed at spawn."""
    model = ReferenceDecoder(cfg, random_weights(cfg, 0), CTX)
    model.forward(np.array([[1]]), np.array([[0]]))
    times = []
    for pos in range(1, steps + 1):
        start = time.perf_counter()
        logits = model.forward(np.array([[pos % cfg.vocab]]), np.array([[pos]]))
        int(np.argmax(logits[0, -1]))
        times.append(time.perf_counter() - start)
    out.put(float(np.median(times)))


def ours(cfg: LlamaConfig, workers: int, steps: int) -> dict:
    config = ClusterConfig(workers=workers, blas_threads=1)
    with MetaDevice(ProcessCluster(config)) as dev:
        model = TensorParallelLlama(dev, cfg, random_weights(cfg, 0).__getitem__, CTX)
        decode, _ = model.capture_decode(np.array([[1]]), np.array([[0]]))  # compiles the one plan
        walls, timings = [], []
        token = np.array([[1]], np.int32)
        for pos in range(1, steps + 2):
            start = time.perf_counter()
            dev.clock.reset()
            out, *_ = decode(token, np.array([[pos]], np.int32))
            token = out.numpy().astype(np.int32)  # the next step needs this step's token
            walls.append(time.perf_counter() - start)
            timings.append(breakdown(walls[-1], dev.last_timings, dev.clock))
        walls, timings = walls[1:], timings[1:]
        median = int(np.argsort(walls)[len(walls) // 2])
        return {"plans": len(dev.plans), "step_ms": walls[median] * 1e3, "breakdown": timings[median]}


def run(quick: bool, workers: int) -> dict:
    cfg = QUICK if quick else STAND_IN
    steps = 5 if quick else 20
    base = in_process_with_threads(reference_child, (cfg, steps), workers)
    mine = ours(cfg, workers, steps)
    b = mine["breakdown"]
    return {
        "config": cfg.__dict__,
        "workers": workers,
        "numpy_ms": base * 1e3,
        "ours_ms": mine["step_ms"],
        "ratio": base * 1e3 / mine["step_ms"],
        "plans": mine["plans"],
        "compute_ms": b["compute_ms"],
        "collectives_ms": b["transfer_ms"] + b["wait_ms"],
        "waiting_ms": b["wait_ms"],
        "executor_ms": b["executor_ms"],
        "dispatch_ms": b["dispatch_ms"],
        "breakdown": b,
    }


def show(r: dict) -> None:
    cfg = r["config"]
    print(
        table(
            f"decode step, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']}/{cfg['kv_heads']} heads, "
            f"vocab {cfg['vocab']}: {r['workers']} workers vs NumPy with {r['workers']} threads",
            [
                "numpy ms",
                "ours ms",
                "numpy/ours",
                "compute ms",
                "collectives ms",
                "(waiting)",
                "executor ms",
                "dispatch ms",
                "plans",
            ],
            [
                [
                    r["numpy_ms"],
                    r["ours_ms"],
                    r["ratio"],
                    r["compute_ms"],
                    r["collectives_ms"],
                    r["waiting_ms"],
                    r["executor_ms"],
                    r["dispatch_ms"],
                    r["plans"],
                ]
            ],
        )
    )


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, "decode", lambda args: run(args.quick, args.workers), show, argv, options)


def options(ap) -> None:
    ap.add_argument("--workers", type=int, default=2)


if __name__ == "__main__":
    sys.exit(main())
