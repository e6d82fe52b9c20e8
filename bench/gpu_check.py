"""The GPU path checked on a machine with an NVIDIA GPU, in one command.

    python bench/gpu_check.py [--quick] [--json PATH] [--model GGUF] [--no-tests] [--only STEP ...]

Runs, each on the CUDA backend with several workers sharing GPU 0 (CUDA IPC between them, the
default there; the sweep also through shared memory):
1. the CuPy tests: the API check against the installed CuPy, the stand-in suites, and the tests
   that skip without a GPU (the backend's stream ordering on a real device, NCCL, two workers
   on one GPU); then the CUDA-backend rows of the op, transition, decode, generation, LLM and
   IPC suites with their workers on the GPU instead of the stand-in;
2. `launch.py demo --backend cuda`;
3. `launch.py generate --backend cuda`, whose tokens must equal `--backend cpu`'s (the packaged
   SmolLM2, or `--model GGUF`);
4. the all-reduce sweep (bench/collectives.py) and the tensor-parallel MLP (bench/tp_matmul.py)
   against one CuPy process, each over the shm and the ipc planes;
5. the decode table: synthetic files made here by `launch.py synthetic` (SmolLM2-135M's shape cut
   to 8 layers, and a SmolLM2-1.7B shape, Q4_1 layers, Q8_0 embedding: nothing large travels to
   the machine), each with float32 and native weights on 1 CUDA worker: decode and prefill tok/s,
   the percent of the memory-bandwidth bound (the resident weights' bytes a token reads, over the
   GPU's datasheet bandwidth), the device graphs a decode step launches (the goal: 1) and every
   program's replays per token (a prefill's included), the GPU memory the worker holds
   (its CuPy pool, from the worker's stats) beside the weights' bytes, and the first tokens
   against `--backend cpu`'s;
6. the host's cores: one CPU worker decoding the 1.7B-shaped file with 1, 4, 8 and 16 threads (up
   to the machine's cores; bench/threads.py, beside llama.cpp where llama-cpp-python is installed),
   each count's tok/s and its ratio to 1 thread (the CPU issue's goal: 16 threads >= 4x 1);
7. the small all-reduce over 2 hosts x 2 CPU workers on the tcp plane (bench/collectives.py
   --hosts: hosts told apart by loopback addresses, a core for every worker here), host by host
   with shared memory inside each host, against the raw socket exchange plus the shm step (the
   hosts issue's goal: within 1.3x);
8. the decode products' kernel alone (bench/qgemv.py): its thread block in several shapes on the
   1.7B shape's Q4_1 products, each one's GB/s against the bandwidth bound;
9. a prompt's attention alone (bench/attention.py): the tiled kernels of our own against the
   shared kernel (cuBLAS products and a softmax) on one layer of the 1.7B shape, a 128-token
   prefill step ending at 128 to 4,096 positions, their results held to each other.
Prints one table and writes one JSON (`--json`). Without a CUDA GPU it says so in one line and
exits 1; a failed check exits 2. `--only` runs the steps named (STEPS: a device session of 15
minutes reruns what failed, not the whole check).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[0] != str(ROOT):  # ahead of bench/, whose transport.py would shadow the package
    sys.path.insert(0, str(ROOT))

from bench.report import cli, table  # noqa: E402
from meta.backends import local_backends  # noqa: E402

PROMPT = "The capital of France is"
CUPY_TESTS = [
    "tests/test_cupy_api.py",
    "tests/test_device_kernels.py",
    "tests/test_prefill_attention.py",
    "tests/test_rope_kernels.py",
    "tests/test_layer_kernels.py",
    "tests/test_cupy_standin.py",
    "tests/test_graphs.py",
    "tests/test_cuda_backend.py",
    "tests/test_cublas.py",
    "tests/test_nccl.py",
    "tests/test_ipc.py",
    "tests/test_workers.py",
]
# set for the test run below: tests/conftest.py then starts the CUDA-backend fixtures' workers
# on the installed CuPy and the real GPU 0 instead of the stand-in
ON_GPU_ENV = "META_TP_TESTS_ON_GPU"
# the suites whose CUDA-backend rows (the cuda2 / cuda3 fixtures) run again with their workers
# on the real GPU instead of the stand-in (tests/conftest.py ON_GPU_ENV)
ON_GPU_TESTS = [
    "tests/test_ipc.py",
    "tests/test_collectives.py",
    "tests/test_meta.py",
    "tests/test_decode.py",
    "tests/test_generation.py",
    "tests/test_llm.py",
]


def gpus() -> int:
    backend = local_backends().get("cuda")
    return backend.device_count if backend is not None else 0


FAILURE_LINES = 40  # of a failed command's output, kept in the JSON: what failed, and why


def _command(args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[bool, str, float]:
    """(ok, the output's last line, seconds); a failed command's output also goes in
    `_failures` (its FAILED and assertion lines first), for the JSON."""
    start = time.perf_counter()
    try:
        environ = {**os.environ, **(env or {})}
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environ)
    except subprocess.TimeoutExpired:
        return False, f"no answer within {timeout:.0f} s", time.perf_counter() - start
    lines = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode != 0:
        said = [line for line in lines if line.startswith(("FAILED", "E   ", "ERROR"))]
        _failures.append({"command": " ".join(args[1:])[:200], "lines": (said or lines)[:FAILURE_LINES]})
    return done.returncode == 0, (lines[-1:] or [""])[0][-200:], time.perf_counter() - start


_failures: list[dict] = []


def cpu_like_cuda(weights: str = "native") -> list[str]:
    """generate's options that give a CPU run the CUDA path's numerics: float32 activations (the
    CUDA products multiply the dequantized weights; the CPU's default, 8-bit activations, moves the
    logits and soon the greedy tokens of a random synthetic file) and the KV caches the CUDA run
    takes by default (models.loading.cache_types_for with 8-bit activations: float16 beside the
    file's blocks, float32 beside float32 weights)."""
    from bench.llm import ACTIVATIONS, default_caches

    key, value = default_caches(ACTIVATIONS, weights)
    return ["--activations", "f32", "--cache-type-k", key, "--cache-type-v", value]


def _generate(backend: str, workers: int, folder: Path, model: str = "") -> tuple[bool, str, list[int]]:
    out = folder / f"{backend}.json"
    devices = ["--devices", ",".join(["0"] * workers)] if backend == "cuda" else cpu_like_cuda()
    devices += ["--model", model] if model else []
    ok, detail, _ = _command(
        [sys.executable, "launch.py", "generate", PROMPT, "-n", "16", "--temp", "0", "--ctx", "256",
         "--backend", backend, "--workers", str(workers), *devices, "--json", str(out)],
        900,
    )  # fmt: skip
    tokens = json.loads(out.read_text())[0]["tokens"] if ok and out.exists() else []
    return ok, detail, tokens


# the decode table's synthetic files: name -> `launch.py synthetic` options
DECODE_FILES = {"135m-8": ["--shape", "135m-8"], "1.7b": ["--shape", "1.7b"]}
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, the SXM datasheets'
PREFILL_TOKENS = 128
LONG_TEXT = "The history of tensor parallelism begins with slices of matrices."


def long_prompt(path: Path, tokens: int = PREFILL_TOKENS) -> str:
    """LONG_TEXT's words, repeated, up to `tokens` tokens of the file's own vocabulary (the
    packaged SmolLM2's where the synthetic tool found it, else a byte-level one made there, which
    takes ~5x the tokens for the same text)."""
    from models.gguf_model import GGUFModel

    encode = GGUFModel(path).tokenizer.encode
    words = (LONG_TEXT.split() * tokens)[:tokens]
    while len(words) > 1 and len(encode(" ".join(words))) > tokens:
        words = words[: max(1, len(words) * 9 // 10)]
    return " ".join(words)


def _bandwidth() -> float | None:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def _decode_row(path: Path, weights: str, folder: Path, steps: int) -> dict:
    """One row of the decode table: 1 CUDA worker on `path` with `weights`."""
    from models.gguf_model import GGUFModel

    common = ["launch.py", "generate", "-m", str(path), "--temp", "0", "--ignore-eos", "--weights", weights]
    out, stats = folder / f"{path.stem}-{weights}.json", folder / f"{path.stem}-{weights}-stats.json"
    ok, detail, seconds = _command(
        [sys.executable, *common, PROMPT, "-n", str(steps), "--ctx", "512", "--backend", "cuda", "--workers", "1",
         "--json", str(out), "--stats", str(stats)],
        900,
    )  # fmt: skip
    row = {"file": path.stem, "weights": weights, "ok": ok, "detail": detail, "seconds": seconds}
    if not ok:
        return row
    run = json.loads(out.read_text())[0]
    workers = list(json.loads(stats.read_text()).values())
    replays = sum(s["graphs"]["replays"] for s in workers)
    step = decode_step_graphs(workers)
    resident = GGUFModel(path).resident_bytes(weights)
    bandwidth = _bandwidth()
    row |= {
        "decode_tok_s": run["decode_tokens_per_s"],
        "graphs_per_token": replays / max(1, len(run["tokens"])),
        "decode_step_graphs": step["graphs"],
        "outside_graphs": sorted(step["outside"]),
        "outside_counts": step["outside"],
        "refused": step["refused"],
        "resident_mib": resident / 2**20,
        # measured: what the worker's CuPy pool hands out (weights, caches, arena, graph pools, cuBLAS's workspace)
        "device_mib": max((s.get("device_memory", {}).get("pool_used", 0) for s in workers), default=0) / 2**20,
        "bound_tok_s": bandwidth / resident if bandwidth else None,
        "tokens": run["tokens"],
    }
    row["bound_percent"] = 100 * row["decode_tok_s"] / row["bound_tok_s"] if bandwidth else None
    long = folder / f"{path.stem}-{weights}-prefill.json"
    ok, _, _ = _command(
        [sys.executable, *common, long_prompt(path), "-n", "1", "--ctx", "512", "--backend", "cuda", "--workers", "1",
         "--json", str(long)],
        900,
    )  # fmt: skip
    if ok:
        prefill = json.loads(long.read_text())[0]
        row |= {"prefill_tokens": len(prefill["prompt_tokens"]), "prefill_tok_s": prefill["prompt_tokens_per_s"]}
    cpu = folder / f"{path.stem}-{weights}-cpu.json"
    # the CPU path's first tokens: float32 activations there (cpu_like_cuda) decode a 1.7B file at a
    # few tokens/s on 4 workers
    compared = min(steps, 16)
    ok, _, _ = _command(
        [sys.executable, *common, PROMPT, "-n", str(compared), "--ctx", "512", "--backend", "cpu", "--workers", "4",
         *cpu_like_cuda(weights), "--json", str(cpu)],
        900,
    )  # fmt: skip
    row["tokens_equal_cpu"] = ok and json.loads(cpu.read_text())[0]["tokens"] == run["tokens"][:compared]
    return row


def decode_step_graphs(workers: list[dict]) -> dict:
    """From the workers' stats (`launch.py generate --stats`): the decode step's device graphs a
    run (the program of the generation the workers drove: workers/executor.py graph_counts's
    `driven`; by their replays, a prefill's one-layer program, run once a layer, was taken for
    it on the 1.7B shape: 4 graphs and four ops outside, where the decode step had 1 graph), how
    many times a run calls each op outside them, and why a capture failed for each op that failed
    one (graph_counts's `refused`: where a step is split, whether a kernel read the device on the
    host or the step's shape is one the backend runs eagerly)."""
    driven = [s["graphs"]["per_run"].get(s["graphs"].get("driven") or "") for s in workers]
    programs = [p for s in workers for p in s["graphs"]["per_run"].values()]
    step = next((p for p in driven if p is not None), None)
    step = step or max(programs, key=lambda p: p["replays"], default={"graphs": None, "outside": []})
    refused: dict[str, str] = {}
    for s in workers:
        for op, why in s["graphs"].get("refused", {}).items():
            refused.setdefault(op, why)
    return {"graphs": step["graphs"], "outside": dict(collections.Counter(step["outside"])), "refused": refused}


def _outside(row: dict) -> str:
    counts = row.get("outside_counts", {})  # none on a row whose run failed
    return " ".join(op if n == 1 else f"{op} x{n}" for op, n in sorted(counts.items())) or "-"


def decode_table(quick: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, options in DECODE_FILES.items():
            path = Path(folder) / f"synthetic-{name}.gguf"
            ok, detail, _ = _command([sys.executable, "launch.py", "synthetic", str(path), *options], 600)
            if not ok:
                rows.append({"file": path.stem, "weights": "-", "ok": False, "detail": detail, "seconds": 0.0})
                continue
            for weights in ("f32", "native"):
                rows.append(_decode_row(path, weights, Path(folder), 32 if quick else 128))
    return rows


def threads_table(quick: bool) -> list[dict]:
    """bench/threads.py's rows for 1, 4, 8 and 16 threads (those the machine has cores for, and
    all of its cores up to 16) on a 1.7B-shaped synthetic file made here."""
    from bench import threads
    from bench.llm import model_path

    cores = min(16, os.cpu_count() or 1)
    counts = sorted({t for t in (1, 4, 8, 16) if t <= cores} | {cores})
    with tempfile.TemporaryDirectory() as folder:
        result = threads.run(quick, counts, 1 if quick else 3, model_path(synthetic="1.7b", folder=folder))
    return result["rows"] if result else []


# the steps above by name, for --only
STEPS = ("tests", "demo", "generate", "sweeps", "mlp", "decode", "threads", "hosts", "qgemv", "attention")


def run(quick: bool, workers: int = 2, model: str = "", tests: bool = True, only: frozenset[str] = frozenset()) -> dict:
    """The checks (every step of STEPS, or those in `only`), their figures and what failed."""
    from bench import collectives, tp_matmul

    checks = []
    decode: list[dict] = []

    def wanted(step: str) -> bool:
        return not only or step in only

    def record(name: str, ok: bool, detail: str, seconds: float, **figures) -> None:
        checks.append({"check": name, "ok": ok, "detail": detail, "seconds": seconds, **figures})

    if tests and wanted("tests"):
        command = [sys.executable, "-m", "pytest", "-q", *CUPY_TESTS, "-k", "cuda or cupy or graph or ipc or gpu"]
        ok, detail, seconds = _command(command, 1800)
        record("CuPy tests", ok, detail, seconds)
        command = [sys.executable, "-m", "pytest", "-q", *ON_GPU_TESTS, "-k", "cuda or ipc"]
        ok, detail, seconds = _command(command, 1800, {ON_GPU_ENV: "1"})
        record("CUDA-backend suites, workers on the GPU", ok, detail, seconds)
    devices = ",".join(["0"] * workers)
    if wanted("demo"):
        ok, detail, seconds = _command(
            [sys.executable, "launch.py", "demo", "--backend", "cuda", "--workers", str(workers), "--devices", devices],
            600,
        )
        record("demo --backend cuda", ok, detail, seconds)
    if wanted("generate"):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            ok_gpu, detail, on_gpu = _generate("cuda", workers, Path(folder), model)
            ok_cpu, _, on_cpu = _generate("cpu", workers, Path(folder), model)
        same = ok_gpu and ok_cpu and on_gpu == on_cpu
        said = detail if not ok_gpu else f"{len(on_gpu)} tokens"
        record("generate: cuda tokens == cpu tokens", same, said, time.perf_counter() - start)
    sweeps = {}
    # through host memory, and GPU to GPU (the goal: ipc >= 20x shm at 64 MiB)
    for plane in ("shm", "ipc") if wanted("sweeps") else ():
        start = time.perf_counter()
        try:
            sweeps[plane] = collectives.run(quick, [workers], backend="cuda", data_plane=plane)
            said = f"{len(sweeps[plane])} sizes"
            if plane == "ipc" and "shm" in sweeps:
                largest = (
                    sweeps["shm"][-1]["bytes"],
                    sweeps["shm"][-1]["all_reduce_us"] / sweeps["ipc"][-1]["all_reduce_us"],
                )
                said += f"; at {largest[0] >> 20} MiB {largest[1]:.1f}x the shm plane"
            record(f"all-reduce sweep ({plane})", True, said, time.perf_counter() - start, rows=sweeps[plane])
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other checks still run
            record(f"all-reduce sweep ({plane})", False, repr(exc)[:200], time.perf_counter() - start)
    for plane in ("shm", "ipc") if wanted("mlp") else ():
        start = time.perf_counter()
        name = f"TP MLP vs one CuPy process ({plane})"
        try:
            mlp = tp_matmul.run(quick, workers, "cuda", plane)
            ratios = ", ".join(f"{r['case']} {r['throughput_ratio']:.2f}" for r in mlp.get("rows", []))
            record(name, True, f"ratios {ratios}", time.perf_counter() - start, result=mlp)
        except Exception as exc:  # noqa: BLE001
            record(name, False, repr(exc)[:200], time.perf_counter() - start)
    if wanted("decode"):
        start = time.perf_counter()
        decode = decode_table(quick)
        equal = all(r["ok"] and r.get("tokens_equal_cpu") for r in decode)
        record("decode table: runs, tokens == cpu tokens", equal, f"{len(decode)} rows", time.perf_counter() - start)
    if wanted("threads"):
        _threads(quick, record)
    if wanted("hosts"):
        _hosts(quick, record)
    if wanted("qgemv"):
        _qgemv(quick, record)
    if wanted("attention"):
        _attention(quick, record)
    failures = list(_failures)
    _failures.clear()
    return {
        "workers": workers,
        "checks": checks,
        "decode": decode,
        "ok": all(c["ok"] for c in checks),
        "failures": failures,
    }


def _threads(quick: bool, record) -> None:
    start = time.perf_counter()
    try:
        cores = threads_table(quick)
        said = ", ".join(
            f"{r['threads']} threads {r['ours_decode_tok_s']:.1f} tok/s ({r['vs_one_thread']:.2f}x)" for r in cores
        )
        record("CPU decode by threads, 1 worker (1.7B file)", True, said, time.perf_counter() - start, rows=cores)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the GPU checks' results stand
        record("CPU decode by threads, 1 worker (1.7B file)", False, repr(exc)[:200], time.perf_counter() - start)


def _qgemv(quick: bool, record) -> None:
    from types import SimpleNamespace

    from bench import qgemv

    start = time.perf_counter()
    try:
        found = qgemv.measure(SimpleNamespace(quick=quick, format="q4_1"))["rows"]
        best = {}
        for r in found:  # each product's fastest thread block beside the workers' (the first variant)
            best.setdefault(r["product"], [r, r])
            best[r["product"]][1] = max(best[r["product"]][1], r, key=lambda v: v["gb_s"])
        said = ", ".join(
            f"{name} {ours['gb_s']:.0f} GB/s, {b['ksplit']}x{b['rows']} {b['gb_s']:.0f}"
            for name, (ours, b) in best.items()
        )
        ok = all(r["sums_agree"] for r in found)
        record("qgemv thread blocks, 1.7B products (Q4_1)", ok, said, time.perf_counter() - start, rows=found)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        record("qgemv thread blocks, 1.7B products (Q4_1)", False, repr(exc)[:200], time.perf_counter() - start)


def _attention(quick: bool, record) -> None:
    from types import SimpleNamespace

    from bench import attention

    start = time.perf_counter()
    name = "prompt attention alone: ours vs cuBLAS + softmax (1.7B heads)"
    try:
        found = attention.measure(SimpleNamespace(quick=quick))["rows"]
        said = ", ".join(
            f"{r['tokens']} tokens to {r['end']} {r['ours_us']:.0f} vs {r['shared_us']:.0f} us ({r['speedup']:.2f}x)"
            for r in found
        )
        record(name, all(r["agree"] for r in found), said, time.perf_counter() - start, rows=found)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        record(name, False, repr(exc)[:200], time.perf_counter() - start)


def _hosts(quick: bool, record) -> None:
    from bench import collectives

    start = time.perf_counter()
    try:
        hosts = collectives.across_hosts(rounds=1 if quick else 3)
        said = ", ".join(f"{r['bytes'] >> 10} KiB {r['ratio']:.2f}x the floor" for r in hosts)
        record("all-reduce, 2 hosts x 2 CPU workers (tcp + shm)", True, said, time.perf_counter() - start, rows=hosts)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        record("all-reduce, 2 hosts x 2 CPU workers (tcp + shm)", False, repr(exc)[:200], time.perf_counter() - start)


def show(results: dict) -> None:
    rows = [(c["check"], "ok" if c["ok"] else "FAILED", f"{c['seconds']:.1f}", c["detail"]) for c in results["checks"]]
    print(table(f"GPU check, {results['workers']} workers on GPU 0", ["check", "result", "s", "detail"], rows))
    if results.get("decode"):
        cols = ["file", "weights", "decode tok/s", "bound tok/s", "% of bound", "replays/token", "prefill tok/s"]
        cols += ["tokens == cpu", "weights MiB", "GPU MiB", "step graphs", "outside them"]
        rows = [
            [r["file"], r["weights"]]
            + [r.get(k, "-") for k in ("decode_tok_s", "bound_tok_s", "bound_percent", "graphs_per_token")]
            + [r.get("prefill_tok_s", "-"), r.get("tokens_equal_cpu", "-"), r.get("resident_mib", "-")]
            + [r.get("device_mib", "-")]
            + [r.get("decode_step_graphs", "-"), _outside(r)]
            for r in results["decode"]
        ]
        print(
            table("decode on 1 CUDA worker (synthetic files, greedy, -n 128; prefill: a 128-token prompt)", cols, rows)
        )
        for r in results["decode"]:  # why a step's kernels fell out of its graphs, where a capture failed
            for op, why in r.get("refused", {}).items():
                print(f"  {r['file']} {r['weights']}: {op} runs outside the graphs, its capture failed: {why}")
    for failed in results.get("failures", []):  # what failed and why, not only a count
        print(f"\n{failed['command']}:")
        print("\n".join(f"  {line[:300]}" for line in failed["lines"]))


class NoGpu(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    outcome: dict = {}

    def measure(args) -> dict:  # after the options are read: --help works without a GPU
        if gpus() == 0:
            raise NoGpu
        outcome.update(run(args.quick, args.workers, args.model, not args.no_tests, frozenset(args.only)))
        return outcome

    def options(ap) -> None:
        ap.add_argument("--workers", type=int, default=2)
        ap.add_argument(
            "--model", default="", help="a GGUF file for the generate check (default: the packaged SmolLM2)"
        )
        ap.add_argument("--no-tests", action="store_true", help="skip the CuPy tests (run them on their own)")
        ap.add_argument("--only", nargs="+", choices=STEPS, default=[], help="run these steps only")

    try:
        status = cli(__doc__, "gpu_check", measure, show, argv, options)
    except NoGpu:
        print("gpu_check: no CUDA GPU was found (the cuda backend sees no device here)", file=sys.stderr)
        return 1
    return status or (0 if outcome.get("ok") else 2)


if __name__ == "__main__":
    sys.exit(main())
