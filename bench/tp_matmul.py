"""Tensor-parallel matmul and MLP on CPU workers against single-process NumPy with the same cores.

    python bench/tp_matmul.py [--quick] [--json results/tp_matmul.json] [--workers 2]

(a) X @ W with W column-split (4096 x 4096); (b) MLP gelu(x @ W_up) @ W_down, M=512, K=4096,
N=11008, W_up column- and W_down row-parallel, the Partial result all-reduced to Mirrored;
(c) the same MLP at M=1 (decode), per step with the cached plan. Weights are resident; a step
is one run of the graph (results stay on the workers). Each worker has 1 BLAS thread; NumPy runs
in a separate process with as many BLAS threads as there are workers. (c) is compared with one raw
pyzmq round trip plus one worker's share of the compute.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, in_process_with_threads, table  # noqa: E402
from meta import ClusterConfig, MetaDevice, ProcessCluster  # noqa: E402
from meta.device import Clock  # noqa: E402
from models.reference import gelu_tanh  # noqa: E402
from split_state import MIRRORED, Split  # noqa: E402
from workers.kernels import KERNELS  # noqa: E402


def median_step(parts: list[tuple]) -> tuple:
    """The (wall, ...) record of the median step by wall time."""
    return sorted(parts, key=lambda part: part[0])[len(parts) // 2]


def timed(fn, steps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def weights(shape, seed):
    return (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(np.float32)


def single_case(m: int, k: int, n: int, kind: str, steps: int, backend: str = "cpu") -> float:
    """One process, one device: NumPy (BLAS threads fixed at spawn) or plain CuPy."""
    if backend == "cuda":
        import cupy as xp

        sync = xp.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    x, w1, w2 = (xp.asarray(weights(shape, seed)) for shape, seed in (((m, k), 1), ((k, n), 2), ((n, k), 3)))

    def step():
        y = x @ w1 if kind == "matmul" else KERNELS["gelu"](xp, [x @ w1], {}) @ w2
        sync()
        return y

    return timed(step, steps)


def numpy_child(cases: dict, steps: int, backend: str, out: mp.Queue) -> None:
    """Runs in a process whose BLAS thread count was fixed by the environment at spawn."""
    out.put({name: single_case(*case, steps, backend) for name, case in cases.items()})


def numpy_child_server(rank: int, n: int, port: int, commands: mp.Queue, results: mp.Queue) -> None:
    """A NumPy process that stays up between measurements (bench/peers.py's PeerGroup protocol):
    ("load", M, K, N) makes the MLP's arrays, ("mlp", steps) answers the time of each step."""
    arrays: dict[str, np.ndarray] = {}
    while (command := commands.get()) is not None:
        if command[0] == "load":
            m, k, nn = command[1:]
            arrays.update(x=weights((m, k), 1), up=weights((k, nn), 2), down=weights((nn, k), 3))
            results.put((rank, None))
            continue
        times = []
        for _ in range(command[1] + 1):  # the first is a warm-up
            start = time.perf_counter()
            gelu_tanh(arrays["x"] @ arrays["up"]) @ arrays["down"]
            times.append(time.perf_counter() - start)
        results.put((rank, times[1:]))


def numpy_baseline(cases: dict, steps: int, threads: int, backend: str = "cpu") -> dict:
    return in_process_with_threads(numpy_child, (cases, steps, backend), threads)


def column_slice(k: int, n: int):
    """Per-device generator: each worker builds only its columns of the up-projection."""

    def make(device, pieces):
        if not pieces:
            return np.zeros((k, 0), np.float32)
        return weights((k, n), 2)[:, pieces[0].global_start : pieces[0].global_stop]

    return make


def ours_case(dev: MetaDevice, m: int, k: int, nn: int, kind: str, steps: int) -> float:
    x = dev.tensor(weights((m, k), 1), MIRRORED, name="x")
    up = dev.from_generator((k, nn), np.float32, Split.even(1, nn, dev.n), column_slice(k, nn), name="w_up")
    down = dev.tensor(weights((nn, k), 3), Split.even(0, nn, dev.n), name="w_down") if kind == "mlp" else None
    kept, parts = [], []

    def step():
        start = time.perf_counter()
        dev.clock.reset()
        y = x @ up if down is None else ((x @ up).gelu() @ down).redistribute(MIRRORED)
        graph = time.perf_counter() - start
        dev.run(y)
        kept.append(y)  # freed after timing: a free is one more message, not part of the step
        parts.append((time.perf_counter() - start, dev.last_timings, replace(dev.clock), graph))

    seconds = timed(step, steps)
    dev.free(*kept, x, up, *([down] if down is not None else []))
    return seconds, breakdown(*median_step(parts))


def breakdown(wall: float, timings: dict[int, dict], clock: Clock, graph_s: float = 0.0) -> dict:
    """Where one step's wall time goes, each part measured on its own (none is the remainder):
    on the worker that answered last, its compute, moving data, waiting for peers inside
    collectives, the executor's own work between steps, and its work around the program
    (releases, feeds, storing results); the control messages (the coordinator's round trips,
    read-backs included, less that worker's handling); the coordinator's own work (plans,
    messages: MetaDevice.clock); and building the graph in the caller (`graph_s`). `explained`
    is their sum over the wall time, `dispatch_ms` control plus coordinator."""
    last = max(timings.values(), key=lambda t: t.get("handled_s", t.get("program_s", 0.0)))
    wait = last.get("wait_s", 0.0)
    busy = last["compute_s"] + last["comm_s"]
    program = last.get("program_s", busy)
    handled = last.get("handled_s", program)
    parts = {
        "compute_ms": last["compute_s"],
        "transfer_ms": last["comm_s"] - wait,
        "wait_ms": wait,
        "executor_ms": max(0.0, program - busy),
        "worker_other_ms": max(0.0, handled - program),
        "control_ms": max(0.0, clock.round_trip_s - handled),
        "coordinator_ms": clock.coordinator_s,
        "graph_ms": graph_s,
    }
    parts = {name: seconds * 1e3 for name, seconds in parts.items()}
    return {
        "wall_ms": wall * 1e3,
        **parts,
        "dispatch_ms": parts["control_ms"] + parts["coordinator_ms"],
        "explained": sum(parts.values()) / (wall * 1e3),
    }


def ours(dev: MetaDevice, cases: dict, steps: int) -> dict:
    return {name: ours_case(dev, *case, steps) for name, case in cases.items()}


def round_trip_us() -> float:
    import zmq

    from bench.transport import round_trips, serve  # the transport benchmark's raw measurement
    from transport.sockets import IpcDir

    ipc = IpcDir()
    endpoint = ipc.endpoint("rt")
    server = mp.get_context("spawn").Process(target=serve, args=(endpoint,), daemon=True)
    server.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        round_trips(sock, 20)
        return round_trips(sock, 300)["raw"] * 1e6
    finally:
        sock.send_multipart([b"s"])
        sock.recv_multipart()
        sock.close(0)
        ctx.term()
        server.join(5)
        ipc.close()


def local_share_s(m: int, k: int, n: int, workers: int, steps: int) -> float:
    """One worker's share of the MLP compute (1 thread, 1/workers of the columns)."""
    cases = {"share": (m, k, -(-n // workers), "mlp")}
    return numpy_baseline(cases, steps, 1)["share"]


def run(quick: bool, workers: int, backend: str = "cpu", data_plane: str = "auto") -> dict:
    k, n = (1024, 2752) if quick else (4096, 11008)
    cases = {
        "a_matmul_col_split": (k, k, k, "matmul"),
        "b_mlp_M512": (512, k, n, "mlp"),
        "c_mlp_M1_decode": (1, k, n, "mlp"),
    }
    steps = 3 if quick else 5
    base = numpy_baseline(cases, steps, workers, backend)
    config = ClusterConfig(
        workers=workers, blas_threads=1, backend=backend, devices=(0,) * workers, data_plane=data_plane
    )
    with MetaDevice(ProcessCluster(config)) as dev:
        measured = ours(dev, cases, steps)
        rt = round_trip_us()
        share = local_share_s(1, k, n, workers, steps * 4)
    mine = {name: seconds for name, (seconds, _) in measured.items()}
    rows = []
    for name, (m, kk, nn, kind) in cases.items():
        flops = 2 * m * kk * nn * (1 if kind == "matmul" else 2)
        rows.append(
            {
                "case": name,
                "M": m,
                "K": kk,
                "N": nn,
                "numpy_ms": base[name] * 1e3,
                "ours_ms": mine[name] * 1e3,
                "numpy_GFLOPs": flops / base[name] / 1e9,
                "ours_GFLOPs": flops / mine[name] / 1e9,
                "throughput_ratio": base[name] / mine[name],
                "breakdown": measured[name][1],
            }
        )
    decode_bound_ms = (rt * 1e-6 + share) * 1e3
    return {
        "workers": workers,
        "backend": backend,
        "rows": rows,
        "raw_round_trip_us": rt,
        "decode_local_compute_ms": share * 1e3,
        "decode_vs_bound": mine["c_mlp_M1_decode"] * 1e3 / decode_bound_ms,
    }


def show(results: dict) -> None:
    cols = ["case", "M", "K", "N", "numpy ms", "ours ms", "numpy GFLOP/s", "ours GFLOP/s", "ours/numpy"]
    rows = [
        [
            r["case"],
            r["M"],
            r["K"],
            r["N"],
            r["numpy_ms"],
            r["ours_ms"],
            r["numpy_GFLOPs"],
            r["ours_GFLOPs"],
            r["throughput_ratio"],
        ]
        for r in results["rows"]
    ]
    print(
        table(
            f"tensor-parallel on {results['workers']} {results['backend']} workers (1 BLAS thread each) vs one "
            f"process with {results['workers']} threads",
            cols,
            rows,
        )
    )
    print(
        f"decode: raw round trip {results['raw_round_trip_us']:.0f} us + one worker's compute "
        f"{results['decode_local_compute_ms']:.3f} ms; ours is {results['decode_vs_bound']:.2f}x that"
    )


def main(argv: list[str] | None = None) -> int:
    return cli(
        __doc__,
        "tp_matmul",
        lambda args: run(args.quick, args.workers, args.backend),
        show,
        argv,
        options,
    )


def options(ap) -> None:
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"], help="cuda: the workers share GPU 0")


if __name__ == "__main__":
    sys.exit(main())
