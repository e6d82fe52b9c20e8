"""The decode step's quantized products timed alone on a GPU: the kernel the CUDA workers run for
them (workers/backends/cuda/kernels/qgemv.py), built for several shapes of its thread block, on
the products of one decode step of SmolLM2-1.7B's shape (one x row, its weights in one format).

    python bench/qgemv.py [--quick] [--json PATH] [--format q4_1]

A thread block of the kernel is `rows` output rows x `ksplit` threads over each row's blocks; a
product of n output rows launches n / rows thread blocks, each thread summing blocks / ksplit of
its row's blocks one after another. The workers build it at 32 x 16: 64 thread blocks for a
2,048-row product, on a GPU of 132 multiprocessors. Each variant's time is a CUDA-event mean over
many launches of the same product; its GB/s the weight's bytes over that time, beside the GPU's
datasheet bandwidth (bench/gpu_check.py BANDWIDTH); its sums are held to the workers' variant
within float32 rounding (a variant sums a row's blocks in another order). What the table is for:
the first GPU run decoded the 1.7B shape's Q4_1 file at ~150 GB/s (3 % of the H200's bound) where
its float32 products, cuBLAS's, read ~1 TB/s. Without a CUDA GPU it says so and measures nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, table  # noqa: E402

# (output rows, input width) of the products of one layer of SmolLM2-1.7B (hidden 2,048, 32 heads
# of 64, FFN 8,192), as the workers keep them (q, k and v in one product; gate and up in one)
SHAPES = {"wq|wk|wv": (6144, 2048), "wo": (2048, 2048), "gate|up": (16384, 2048), "down": (2048, 8192)}
# (ksplit, rows) of a thread block: the workers' first; at most 1,024 threads a block
VARIANTS = ((16, 32), (32, 32), (64, 16), (32, 8), (128, 8), (8, 64))
LANES = 64  # the rows the workers interleave (split_state/quant.py MAX_LANES)


def measure(args) -> dict:
    from bench.gpu_check import _bandwidth, gpus

    if gpus() == 0:
        reason = "no CUDA GPU (the cuda backend sees no device here)"
        print(f"bench/qgemv.py measures nothing here: {reason}", file=sys.stderr)
        return {"skipped": reason}
    import cupy

    from models.synthetic import matrix
    from split_state.quant import FORMATS, interleave
    from workers.backends.cuda.kernels import device, qgemv

    fmt, launches = args.format, 50 if args.quick else 400
    bandwidth = _bandwidth()
    modules = {
        v: cupy.RawModule(code=device.full_source(qgemv.source_for(*v)), options=device.OPTIONS) for v in VARIANTS
    }
    rng = np.random.default_rng(0)
    rows_out = []
    for name, (n, width) in SHAPES.items():
        blocks = width // FORMATS[fmt].block
        file_blocks = matrix(rng, (n, width), fmt).reshape(n, blocks, FORMATS[fmt].block_bytes)
        w = cupy.asarray(np.ascontiguousarray(interleave(file_blocks, LANES)))
        x = cupy.asarray(rng.standard_normal((1, width)).astype(np.float32))
        reference = None
        for ksplit, rows in VARIANTS:
            kernel = modules[(ksplit, rows)].get_function(qgemv.kernel_name(fmt))
            out = cupy.full((1, n), np.nan, np.float32)
            grid, block = (-(-n // rows), 1), (rows, ksplit)
            call = (w, x, out, out, np.int32(0), np.int32(n), np.int32(LANES), np.int32(blocks), np.int32(1))
            for _ in range(5):
                kernel(grid, block, call)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(launches):
                kernel(grid, block, call)
            end.record()
            end.synchronize()
            seconds = cupy.cuda.get_elapsed_time(start, end) / 1e3 / launches
            got = cupy.asnumpy(out)
            reference = got if reference is None else reference
            scale = float(np.abs(reference).max()) or 1.0
            rows_out.append(
                {
                    "product": name,
                    "n": n,
                    "width": width,
                    "ksplit": ksplit,
                    "rows": rows,
                    "thread_blocks": grid[0],
                    "us": seconds * 1e6,
                    "gb_s": w.nbytes / seconds / 1e9,
                    "percent_of_bound": 100 * w.nbytes / seconds / bandwidth if bandwidth else None,
                    "sums_agree": bool(np.allclose(got, reference, rtol=1e-4, atol=1e-5 * scale)),
                }
            )
    return {"format": fmt, "lanes": LANES, "rows": rows_out}


def show(results: dict) -> None:
    if "skipped" in results:
        print(f"skipped: {results['skipped']}")
        return
    cols = ["product", "n x width", "ksplit x rows", "thread blocks", "us", "GB/s", "% of bound", "sums agree"]
    rows = [
        [
            r["product"],
            f"{r['n']} x {r['width']}",
            f"{r['ksplit']} x {r['rows']}",
            r["thread_blocks"],
            r["us"],
            r["gb_s"],
            "-" if r["percent_of_bound"] is None else r["percent_of_bound"],
            "yes" if r["sums_agree"] else "NO",
        ]
        for r in results["rows"]
    ]
    title = f"qgemv_{results['format']}, one x row, {results['lanes']} lanes (the workers' thread block: 16 x 32)"
    print(table(title, cols, rows))


def _options(ap) -> None:
    from split_state.quant import FORMATS

    ap.add_argument("--format", default="q4_1", choices=list(FORMATS), help="the weights' GGUF block format")


if __name__ == "__main__":
    sys.exit(cli(__doc__, "qgemv", measure, show, None, _options))
