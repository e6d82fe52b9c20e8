"""A prompt's attention timed alone on a GPU: the tiled kernels the CUDA workers run for it
(workers/backends/cuda/kernels/prefill_attend.py) against the shared kernel they ran before (cuBLAS
products with a softmax between them, workers/kernels/fused.py), on one layer of SmolLM2-1.7B's
shape (32 heads of 64, one KV head each, a float16 cache of 4,096 positions) for one prefill
step: a chunk of 128 tokens (models/llama.py PREFILL_CHUNK) ending at position 128 (a new
prompt), 1,024 or 4,096 (a long prompt's later chunks, over the cache before them), causal.

    python bench/attention.py [--quick] [--json PATH]

Each kernel's time is a CUDA-event mean over many calls on the same operands. The shared kernel
finds the used positions on the host once a run (a wait for the device, the first layer's); here
it is given them, so its figure is its device work alone, its best case. The tiled kernels skip
the closed tiles (the causal corner, the unused cache) and make no score matrix: the table prints
the scratch the shared kernel wants for the scores (two float32 heads x tokens x used positions
buffers). Their results are held to each other within float32 rounding (the sums run in other
orders). Without a CUDA GPU it says so and measures nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, table  # noqa: E402

HEADS, DIM = 32, 64  # SmolLM2-1.7B: 32 query heads, 32 KV heads, head dim 64
CHUNK, CTX = 128, 4096  # a prefill step's tokens, the cache's positions
ENDS = (128, 1024, 4096)  # where the step's chunk ends: a new prompt's, a long prompt's later ones


def measure(args) -> dict:
    from bench.gpu_check import gpus

    if gpus() == 0:
        reason = "no CUDA GPU (the cuda backend sees no device here)"
        print(f"bench/attention.py measures nothing here: {reason}", file=sys.stderr)
        return {"skipped": reason}
    import cupy

    from workers.backends.cuda.kernels import device

    kernels = device.compile_all(cupy)
    calls = 5 if args.quick else 20
    rng = np.random.default_rng(0)
    return {"rows": [_one_chunk(cupy, kernels, end, calls, rng) for end in ENDS[: 2 if args.quick else None]]}


def _one_chunk(cupy, kernels: dict, end: int, calls: int, rng) -> dict:
    """Both kernels on one layer's chunk of CHUNK tokens ending at position `end`: their times
    and agreement."""
    from workers.backends.cuda.kernels import prefill_attend
    from workers.kernels.fused import FUSED_KERNELS, KV_BUCKET, used_positions

    scale = 1 / np.sqrt(DIM)
    tokens = min(CHUNK, end)
    q = cupy.asarray(rng.standard_normal((1, HEADS, 1, tokens, DIM)).astype(np.float32))
    keys = cupy.asarray(rng.standard_normal((1, HEADS, CTX, DIM)).astype(np.float16))
    values = cupy.asarray(rng.standard_normal((1, HEADS, CTX, DIM)).astype(np.float16))
    opened = np.arange(CTX)[None, :] <= np.arange(end - tokens, end)[:, None]  # causal: token t at end - tokens + t
    mask = cupy.asarray(np.where(opened, 0, -np.inf).astype(np.float32).reshape(1, 1, 1, tokens, CTX))
    ours_out = cupy.full(q.shape, np.nan, cupy.float32)
    shared_out = cupy.full(q.shape, np.nan, cupy.float32)
    k_view = keys[:, :, None].swapaxes(-1, -2)  # as the decoder multiplies by the keys
    operands = (q, k_view, mask, values[:, :, None])
    used = used_positions(cupy, mask, KV_BUCKET)
    memo = {("used positions", id(mask), KV_BUCKET): (used, mask)}
    params = {"scale": scale, "bucket": KV_BUCKET}
    row = {"tokens": tokens, "end": end, "heads": HEADS, "dim": DIM}
    row["scores_scratch_bytes"] = 2 * HEADS * tokens * used * 4
    ours = (cupy, kernels, q, keys, values, mask, 0, scale, ours_out)
    row["ours_us"] = _timed(cupy, calls, prefill_attend.launch, *ours)
    row["shared_us"] = _timed(cupy, calls, FUSED_KERNELS["attention"], cupy, operands, params, shared_out, memo=memo)
    got, want = cupy.asnumpy(ours_out), cupy.asnumpy(shared_out)
    row["max_abs_diff"] = float(np.abs(got - want).max())
    row["agree"] = bool(np.allclose(got, want, rtol=1e-4, atol=1e-5))
    row["speedup"] = row["shared_us"] / row["ours_us"]
    return row


def _timed(cupy, calls: int, fn, *args, **kwargs) -> float:
    """Microseconds a call of fn(*args, **kwargs) on the device: a CUDA-event mean over `calls`
    calls after two."""
    for _ in range(2):
        fn(*args, **kwargs)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn(*args, **kwargs)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls


def show(results: dict) -> None:
    if "skipped" in results:
        print(f"skipped: {results['skipped']}")
        return
    cols = ["tokens", "ending at", "ours us", "shared us", "ours vs shared", "scores' scratch MiB", "max |diff|"]
    cols.append("agree")
    rows = [
        [
            r["tokens"],
            r["end"],
            r["ours_us"],
            r["shared_us"],
            f"{r['speedup']:.2f}x",
            r["scores_scratch_bytes"] / (1 << 20),
            f"{r['max_abs_diff']:.1e}",
            "yes" if r["agree"] else "NO",
        ]
        for r in results["rows"]
    ]
    title = f"a prefill step's attention, one layer: {HEADS} heads of {DIM}, a float16 cache of {CTX}, causal"
    print(table(title, cols, rows))


if __name__ == "__main__":
    sys.exit(cli(__doc__, "attention", measure, show))
