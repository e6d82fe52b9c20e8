"""The whole benchmark suite in one run: every benchmark beside its baseline, one summary table,
JSON and PNG plots.

    python launch.py bench [--quick] [--out results] [--backend cpu|cuda]

On a machine with fewer cores than workers the CPU figures show the runtime's overheads, not
speed-ups: two single-threaded workers on two cores can at best match two-threaded NumPy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import collectives, decode, executor, llm, peers, report, tp_matmul, transport  # noqa: E402


def memcpy_GBps(nbytes: int = 64 << 20, reps: int = 10) -> float:  # noqa: N802 - unit in the name
    """The host's copy bandwidth: the ceiling for any transfer on one machine."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def model_benchmark(quick: bool) -> dict | None:
    """The transformer benchmark, when the model package is installed."""
    try:
        from bench import model
    except ImportError:
        return None
    return model.run_if_available(quick)


def run(quick: bool, backend: str) -> dict:
    cores = os.cpu_count() or 1
    counts = [1, 2, 4]
    results: dict = {"backend": backend, "cores": cores, "memcpy_GBps": memcpy_GBps()}
    step = "[bench]"
    print(f"{step} transport ...", file=sys.stderr, flush=True)
    results["transport"] = transport.run(quick)
    print(f"{step} collectives on 2 and 4 workers ...", file=sys.stderr, flush=True)
    results["collectives"] = collectives.run(quick, [2, 4], backend)
    if backend == "cpu":
        print(
            f"{step} a small all-reduce idle, beside a busy neighbour, oversubscribed ...", file=sys.stderr, flush=True
        )
        results["under_load"] = collectives.under_load(backend)
        print(f"{step} the peers (DTensor/gloo, MPI) beside ours ...", file=sys.stderr, flush=True)
        results["peers"] = peers.run(quick, 1 if quick else 3)
    results["tp_matmul"] = {}
    for n in counts:
        print(f"{step} tensor-parallel matmul and MLP on {n} workers ...", file=sys.stderr, flush=True)
        results["tp_matmul"][n] = tp_matmul.run(quick, n, backend)
    print(f"{step} decode step of a 30-layer llama stand-in on 2 workers ...", file=sys.stderr, flush=True)
    results["decode"] = decode.run(quick, 2)
    print(f"{step} SmolLM2 generation on {'2' if quick else '1, 2 and 4'} workers ...", file=sys.stderr, flush=True)
    results["llm"] = llm.run(quick, [2] if quick else counts, [] if quick else [256, 8192], 0, rounds=1 if quick else 3)
    print(f"{step} the executor's own work per SmolLM2 decode token ...", file=sys.stderr, flush=True)
    results["executor"] = executor.run(quick, [1, 2], 2000)
    print(f"{step} model ...", file=sys.stderr, flush=True)
    results["model"] = model_benchmark(quick)
    return results


def summary_rows(results: dict) -> list[list]:
    """[benchmark, unit, ours, baseline, its value, ratio, ours/DTensor-gloo, ours/MPI]: each ratio
    is speed (> 1: ours is faster); the peer columns are filled where a peer ran the same work."""
    rows = [row + ["", ""] for row in own_rows(results)]
    peers_run = results.get("peers")
    if peers_run:
        m, k, n = peers_run["mlp_shape"]
        mlp = peers_run["mlp"]
        rows.append(
            [
                f"MLP M={m} K={k} N={n} {peers_run['workers']}w (peers run)",
                "ms",
                mlp["ours"] * 1e3,
                "1 proc, 2 thr",
                mlp["numpy"] * 1e3,
                mlp["numpy"] / mlp["ours"],
                peers.ratio(mlp["dtensor"], mlp["ours"]),
                "",
            ]
        )
        for r in peers_run["all_reduce"]:
            rows.append(
                [
                    f"all-reduce {peers_run['workers']}w {report.human_bytes(r['bytes'])} (peers run)",
                    "us",
                    r["ours"] * 1e6,
                    "gloo" if r["gloo"] else "-",
                    (r["gloo"] or 0) * 1e6,
                    peers.ratio(r["gloo"], r["ours"]),
                    peers.ratio(r["gloo"], r["ours"]),
                    peers.ratio(r["mpi"], r["ours"]),
                ]
            )
    for r in results.get("under_load") or []:
        rows.append(
            [
                f"all-reduce {r['workers']}w {report.human_bytes(r['bytes'])}, {r['condition']}",
                "us",
                r["ours_us"],
                "raw exchange",
                r["raw_us"],
                r["raw_over_ours"],
                "",
                "",
            ]
        )
    return rows


def own_rows(results: dict) -> list[list]:
    rows = []
    for r in results["transport"]["throughput"]:
        if r["bytes"] >= 1 << 20:
            rows.append(
                [
                    f"transport {r['transport']} {report.human_bytes(r['bytes'])}",
                    "GB/s",
                    r["ours_GBps"],
                    "raw pyzmq",
                    r["raw_GBps"],
                    r["ratio"],
                ]
            )
    for r in results["transport"]["latency"]:
        rows.append([f"round trip {r['transport']}", "us", r["ours_us"], "raw pyzmq", r["raw_us"], r["ratio"]])
    for r in results["collectives"]:
        rows.append(
            [
                f"all-reduce {r['workers']}w {report.human_bytes(r['bytes'])}",
                "us",
                r["all_reduce_us"],
                "raw exchange",
                r["raw_us"],
                r["raw_us"] / r["all_reduce_us"],
            ]
        )
    for n, tp in results["tp_matmul"].items():
        for r in tp["rows"]:
            rows.append(
                [f"{r['case']} {n}w", "ms", r["ours_ms"], f"1 proc, {n} thr", r["numpy_ms"], r["throughput_ratio"]]
            )
    d = results.get("decode")
    if d:
        rows.append(
            [
                f"decode step {d['config']['layers']} layers 2w",
                "ms",
                d["ours_ms"],
                "1 proc, 2 thr",
                d["numpy_ms"],
                d["ratio"],
            ]
        )
    for r in (results.get("llm") or {}).get("rows", []):
        rows.append(
            [
                f"SmolLM2 decode {r['workers']}w",
                "tok/s",
                r["ours_decode_tok_s"],
                "NumPy ref",
                r["numpy_decode_tok_s"],
                r["decode_ratio"],
            ]
        )
    model = results.get("model")
    if model:
        rows.append(
            [
                f"model {model['name']} {model['workers']}w",
                "sent/s",
                model["ours_per_s"],
                "1 process",
                model["reference_per_s"],
                model["ours_per_s"] / model["reference_per_s"],
            ]
        )
    return rows


def show(results: dict) -> None:
    print(
        report.table(
            f"summary ({results['backend']}, {results['cores']} cores; ratio > 1 means ours is faster)",
            ["benchmark", "unit", "ours", "baseline", "baseline value", "ratio", "vs DTensor/gloo", "vs MPI"],
            summary_rows(results),
        )
    )
    if results["cores"] < 4:
        print(
            f"note: {results['cores']} cores: with more workers than cores the CPU figures show overheads, "
            "not speed-ups"
        )
    print()
    print(
        report.table(
            "where a step's time goes (ms, each part measured on its own; the worker that answered last)",
            [
                "step",
                "wall",
                "compute",
                "transfer",
                "waiting on peers",
                "executor",
                "worker other",
                "control msgs",
                "coordinator",
                "graph",
                "explained",
            ],
            [
                [
                    name,
                    b["wall_ms"],
                    b["compute_ms"],
                    b["transfer_ms"],
                    b["wait_ms"],
                    b["executor_ms"],
                    b["worker_other_ms"],
                    b["control_ms"],
                    b["coordinator_ms"],
                    b["graph_ms"],
                    f"{b['explained']:.0%}",
                ]
                for name, b in step_breakdowns(results)
            ],
        )
    )
    if results.get("executor"):
        print()
        executor.show(results["executor"])


def step_breakdowns(results: dict) -> list[tuple[str, dict]]:
    """Every benchmark step that has a breakdown, by name."""
    rows = [(f"{r['case']} {n}w", r["breakdown"]) for n, tp in results["tp_matmul"].items() for r in tp["rows"]]
    if results.get("decode"):
        rows.append((f"decode step {results['decode']['workers']}w", results["decode"]["breakdown"]))
    for r in (results.get("llm") or {}).get("rows", []):
        rows.append((f"SmolLM2 decode {r['workers']}w", r["breakdown"]))
    peers_run = results.get("peers")
    if peers_run:
        rows.append((f"MLP M={peers_run['mlp_shape'][0]} {peers_run['workers']}w (peers run)", peers_run["breakdown"]))
    return rows


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for via in ("ipc", "tcp"):
        rows = [r for r in results["transport"]["throughput"] if r["transport"] == via]
        sizes = [r["bytes"] for r in rows]
        ax.plot(sizes, [r["ours_GBps"] for r in rows], "o-", label=f"ours, {via}")
        ax.plot(sizes, [r["raw_GBps"] for r in rows], "x--", label=f"raw pyzmq, {via}")
    for n in sorted({r["workers"] for r in results["collectives"]}):
        rows = [r for r in results["collectives"] if r["workers"] == n]
        ax.plot(
            [r["bytes"] for r in rows], [r["all_reduce_GBps"] for r in rows], "s-", label=f"all-reduce, {n} workers"
        )
    ax.axhline(results["memcpy_GBps"], color="gray", linestyle=":", label="memcpy limit")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="GB/s", title="bandwidth vs message size")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "bandwidth_vs_size.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    counts = sorted(results["tp_matmul"], key=int)
    for i, case in enumerate(r["case"] for r in results["tp_matmul"][counts[0]]["rows"]):
        color = f"C{i}"
        ours = [next(r for r in results["tp_matmul"][n]["rows"] if r["case"] == case)["ours_ms"] for n in counts]
        base = [next(r for r in results["tp_matmul"][n]["rows"] if r["case"] == case)["numpy_ms"] for n in counts]
        ax.plot([int(n) for n in counts], ours, "o-", color=color, label=f"{case}, ours")
        ax.plot([int(n) for n in counts], base, "x--", color=color, label=f"{case}, one process")
    ax.set(
        yscale="log",
        xlabel="workers (= threads of the baseline)",
        ylabel="ms per step",
        title=f"step time vs workers ({results['cores']} cores)",
    )
    ax.set_xticks([int(n) for n in counts])
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "step_time_vs_workers.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels, ratios = [], []
    for n in counts:
        for r in results["tp_matmul"][n]["rows"]:
            labels.append(f"{r['case']}\n{n}w")
            ratios.append(r["throughput_ratio"])
    ax.bar(range(len(ratios)), ratios, color=[f"C{counts.index(n)}" for n in counts for _ in range(3)])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax.set(ylabel="throughput, ours / one process", title="tensor-parallel vs single-process by shape")
    paths.append(_save(fig, out / "tp_vs_single.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes; about 2.5 minutes on 2 cores")
    ap.add_argument("--out", default="results", help="folder for bench.json and the plots")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = run(args.quick, args.backend)
    results["seconds"] = time.perf_counter() - start
    show(results)
    (out / "bench.json").write_text(
        json.dumps({"machine": report.machine(), "quick": args.quick, **results}, indent=2, default=str)
    )
    for path in [out / "bench.json", *plots(results, out)]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
