"""The tensor-parallel runtime's command line.

    python launch.py demo [--workers N] [--backend cpu|cuda|auto] [--devices 0,2,3]
    python launch.py devices
    python launch.py run SCRIPT.py [args ...]       # `dev` (a MetaDevice) is ready in the script
    python launch.py embed "a sentence" "another" [--workers N] [--out emb.npy] [--file F]
    python launch.py bench [--quick]
    python launch.py stress --seconds S --workers N --seed K
    python launch.py keys PATH                      # CURVE key pair for multi-host clusters
    python launch.py worker --connect tcp://HOST:PORT [--rank R] [--keys PATH]

Multi-host: start the coordinator with `--listen tcp://0.0.0.0:PORT --spawn 0` (it listens on PORT,
PORT+1 and PORT+2) and one `launch.py worker --connect tcp://COORDINATOR:PORT` per remote worker.
Under Slurm, Open MPI, PMI or torchrun every rank runs the same command: rank 0 becomes the
coordinator (and runs worker 0), the other ranks become workers.

Environment: META_TP_DEBUG=1 prints each planned node and every inserted collective.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from meta import ClusterConfig, MetaDevice, ProcessCluster
from split_state import MIRRORED, Split, WorkerLost
from split_state.errors import MetaError

# -- environment (read here only) ---------------------------------------------------------------


@dataclass(frozen=True)
class LaunchEnv:
    """What a batch launcher tells a process: its rank, the world size and where rank 0 is."""

    source: str
    rank: int
    world_size: int
    coordinator: str = ""  # host of rank 0, when the launcher says
    port: int = 0


def detect_launcher(env: Mapping[str, str]) -> LaunchEnv | None:
    """Slurm, Open MPI, PMI (MPICH, Intel MPI) or torchrun, from their environment variables."""
    probes = [
        ("torchrun", "RANK", "WORLD_SIZE"),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("pmi", "PMI_RANK", "PMI_SIZE"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
    ]
    for source, rank_var, size_var in probes:
        if rank_var in env and size_var in env:
            host = env.get("MASTER_ADDR", "")
            if not host and source == "slurm":
                host = _first_slurm_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
            return LaunchEnv(source, int(env[rank_var]), int(env[size_var]), host, int(env.get("MASTER_PORT", 0)))
    return None


def _first_slurm_host(nodelist: str) -> str:
    """'node[03-05,07],gpu1' -> 'node03' (the first host of a Slurm node list)."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" in head:
        prefix, rest = head.split("[", 1)
        return prefix + rest.split(",")[0].split("-")[0].rstrip("]")
    return head


def blas_threads(workers: int) -> int:
    """BLAS threads per CPU worker so that workers together use the cores once."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def visible_gpus() -> int:
    from workers.backend import cuda_device_count

    return cuda_device_count()


# -- the Python API -----------------------------------------------------------------------------


@contextlib.contextmanager
def cluster(
    workers: int | None = None,
    backend: str = "auto",
    devices: tuple[int, ...] = (),
    debug: bool | None = None,
    **config,
) -> Iterator[MetaDevice]:
    """A connected MetaDevice for scripts and notebooks; every process is stopped on exit.

    with launch.cluster(workers=4, backend="cpu") as dev:
        ...
    """
    gpus = visible_gpus() if backend in ("auto", "cuda") else 0
    if backend == "auto":
        backend = "cuda" if gpus else "cpu"
    if backend == "cuda" and not gpus:
        raise MetaError("--backend cuda: no GPU is visible (or CuPy is not installed: pip install -e '.[cuda]')")
    if workers is None:
        workers = len(devices) or (gpus if backend == "cuda" else 2)
    if backend == "cpu":
        config.setdefault("blas_threads", blas_threads(workers))
    if debug is None:
        debug = os.environ.get("META_TP_DEBUG", "") not in ("", "0")
    dev = MetaDevice(
        ProcessCluster(ClusterConfig(workers=workers, backend=backend, devices=tuple(devices), **config)), debug=debug
    )
    try:
        yield dev
    finally:
        dev.close()


# -- display ------------------------------------------------------------------------------------


def progress(done: int, total: int, label: str, start: float, stream=sys.stderr) -> None:
    """A one-line progress bar for long work (weight loading, benchmarks)."""
    if not stream.isatty() and done not in (0, total):
        return
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.perf_counter() - start, 1e-9)
    stream.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {rate:.1f}/s")
    if done >= total:
        stream.write("\n")
    stream.flush()


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from bench.report import table

    print(table(title, columns, rows))
    print()


# -- commands -----------------------------------------------------------------------------------


def timed_steps(fn, steps: int = 5) -> float:
    fn()  # compiles and caches the plan
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def describe_plane(info: dict) -> str:
    """'shm' or 'zmq', with the reason when shared memory was asked for and not used."""
    return info["data_plane"] + (f" ({info['note']})" if info.get("note") else "")


def demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    with open_cluster(args) as dev:
        n = dev.n
        startup = time.perf_counter() - start
        print_table(
            f"{n} workers started in {startup:.2f} s",
            ["rank", "backend", "device", "memory", "data plane"],
            [
                [
                    r,
                    d.backend,
                    d.device,
                    f"{d.memory_free / 2**30:.1f}/{d.memory_total / 2**30:.1f} GiB free",
                    describe_plane(plane),
                ]
                for r, (d, plane) in enumerate(zip(dev.cluster.devices, dev.cluster.data_planes))
            ],
        )
        rng = np.random.default_rng(0)
        m, k, hidden = args.tokens, args.hidden, 4 * args.hidden
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float32)
        w_up = (rng.standard_normal((k, hidden)) / np.sqrt(k)).astype(np.float32)
        w_down = (rng.standard_normal((hidden, k)) / np.sqrt(hidden)).astype(np.float32)
        xt = dev.tensor(x, MIRRORED, name="x")
        wt = dev.tensor(w, Split.even(1, k, n), name="w")
        up = dev.tensor(w_up, Split.even(1, hidden, n), name="w_up")
        down = dev.tensor(w_down, Split.even(0, hidden, n), name="w_down")
        rows = []
        cases = [
            ("matmul x @ w", lambda: xt @ wt, lambda: x @ w, f"x:M, w:{wt.state}"),
            (
                "MLP gelu(x @ w_up) @ w_down",
                lambda: ((xt @ up).gelu() @ down).redistribute(MIRRORED),
                lambda: _gelu(x @ w_up) @ w_down,
                f"x:M, w_up:{up.state}, w_down:{down.state}",
            ),
        ]
        for label, build, reference, inputs in cases:
            seconds = timed_steps(lambda: dev.run(build()))  # noqa: B023 - called right here
            out = build()
            got = out.numpy()
            plan = dev.last_plan
            error = float(np.max(np.abs(got - reference()))) if got.size else 0.0
            collectives = ", ".join(c.value for c in plan.collectives()) or "none"
            rows.append([label, inputs, str(plan.out_states[0]), collectives, f"{seconds * 1e3:.2f}", f"{error:.1e}"])
        print_table(
            f"tensor-parallel ops, x of shape {x.shape}, checked against NumPy",
            ["op", "input states", "output state", "collectives", "ms/step", "max |error|"],
            rows,
        )
        worst = max(float(r[-1]) for r in rows)
        ok = worst < 1e-3
        print(f"{'OK' if ok else 'MISMATCH'}: max error {worst:.1e} on {n} {dev.cluster.config.backend} workers")
        return 0 if ok else 1


def _gelu(x: np.ndarray) -> np.ndarray:
    from split_state.kernels import KERNELS

    return KERNELS["gelu"](np, [x], {})


def devices(args: argparse.Namespace) -> int:
    from workers.backend import registry

    print_table(
        "devices (pick GPUs with --devices)",
        ["backend", "index", "name", "description", "type", "memory"],
        [
            [
                d.backend,
                d.index,
                d.name,
                d.description,
                d.kind,
                f"{d.memory_free / 2**30:.1f}/{d.memory_total / 2**30:.1f} GiB free",
            ]
            for d in registry()
        ],
    )
    return 0


_current: MetaDevice | None = None


def current() -> MetaDevice:
    """The MetaDevice of `launch.py run`, for scripts that import launch instead of using `dev`."""
    if _current is None:
        raise MetaError("no cluster is running: start the script with 'python launch.py run SCRIPT.py'")
    return _current


def run_script(args: argparse.Namespace) -> int:
    global _current
    with open_cluster(args) as dev:
        _current = dev
        sys.argv = [args.script, *args.script_args]
        try:
            runpy.run_path(args.script, init_globals={"dev": dev}, run_name="__main__")
        finally:
            _current = None
    return 0


def keys(args: argparse.Namespace) -> int:
    from transport.sockets import CurveKeys

    CurveKeys.generate().save(args.path)
    print(f"wrote {args.path} (mode 0600): give it to the coordinator and every worker (--keys {args.path})")
    return 0


def worker(args: argparse.Namespace) -> int:
    """A worker on this host joining a coordinator elsewhere."""
    launcher = detect_launcher(os.environ)
    rank = args.rank if args.rank is not None else (launcher.rank if launcher else 0)
    return _exec_worker(args.connect, rank, args)


def _exec_worker(connect: str, rank: int, args: argparse.Namespace) -> int:
    host, port = connect[len("tcp://") :].rsplit(":", 1)
    cmd = [
        sys.executable,
        "-m",
        "workers",
        "--connect",
        connect,
        "--beat",
        f"tcp://{host}:{int(port) + 1}",
        "--beat-in",
        f"tcp://{host}:{int(port) + 2}",
        "--rank",
        str(rank),
        "--backend",
        args.backend if args.backend != "auto" else ("cuda" if visible_gpus() else "cpu"),
        "--device",
        str(args.device),
        "--liveness",
        str(args.liveness),
    ]
    if args.keys:
        cmd += ["--keys", args.keys]
    try:
        return subprocess.call(
            cmd, env=dict(os.environ, PYTHONPATH=_root() + os.pathsep + os.environ.get("PYTHONPATH", ""))
        )
    except KeyboardInterrupt:
        return 130


def _root() -> str:
    return os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def open_cluster(args: argparse.Namespace) -> Iterator[MetaDevice]:
    """A cluster from the common options; under a batch launcher, rank 0 coordinates and the
    other ranks serve as workers (this process then never returns from here normally)."""
    config = {"liveness": args.liveness, "log_dir": args.log_dir, "data_plane": args.data_plane}
    launcher = detect_launcher(os.environ) if not args.listen else None
    listen = args.listen
    if launcher is not None and launcher.world_size > 1:
        port = launcher.port or 29500
        if launcher.rank != 0:
            sys.exit(_exec_worker(f"tcp://{launcher.coordinator or '127.0.0.1'}:{port}", launcher.rank, args))
        listen, args.workers, args.spawn = f"tcp://0.0.0.0:{port}", launcher.world_size, 1
    if listen:
        host, port = listen[len("tcp://") :].rsplit(":", 1)
        config.update(host=host, port=int(port), keys=args.keys, start_timeout=args.start_timeout)
    spawn = args.spawn if args.spawn is not None else (args.workers or 0)
    if listen and spawn == 0:
        config["spawn"] = False
        print(
            f"waiting for {args.workers} workers: python launch.py worker --connect {listen} --rank R",
            file=sys.stderr,
            flush=True,
        )
    devices_ = tuple(int(d) for d in args.devices.split(",")) if args.devices else ()
    try:
        with cluster(workers=args.workers, backend=args.backend, devices=devices_, **config) as dev:
            yield dev
    except WorkerLost as exc:
        print(f"error: {exc}; every worker was stopped", file=sys.stderr)
        raise SystemExit(3) from None
    except KeyboardInterrupt:
        print("interrupted: every worker was stopped", file=sys.stderr)
        raise SystemExit(130) from None


def embed(args: argparse.Namespace) -> int:
    """Sentence embeddings with all-MiniLM-L6-v2, tensor-parallel over the workers."""
    from meta.minilm import Model, TensorParallelEncoder

    sentences = list(args.sentences)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            sentences += [line.rstrip("\n") for line in f if line.strip()]
    if not sentences:
        raise MetaError("embed: give sentences as arguments or --file PATH (one sentence per line)")
    model = Model.load()
    with open_cluster(args) as dev:
        start = time.perf_counter()
        encoder = TensorParallelEncoder(
            dev, model.weights, model.cfg, progress=lambda i, n: progress(i, n, "placing weights", start)
        )
        batches = range(0, len(sentences), args.batch)
        out, start = [], time.perf_counter()
        for i, at in enumerate(batches):
            out.append(encoder.embed(model.tokenizer(sentences[at : at + args.batch])))
            progress(i + 1, len(batches), "embedding", start)
        emb = np.concatenate(out)
    print_table(
        f"{len(sentences)} sentences on {dev.n} workers: embedding norms",
        ["#", "sentence", "norm"],
        [[i, s[:60], f"{np.linalg.norm(e):.4f}"] for i, (s, e) in enumerate(zip(sentences, emb))],
    )
    if len(sentences) <= 12:
        sims = emb @ emb.T
        print_table(
            "cosine similarity",
            ["#", *map(str, range(len(sentences)))],
            [[i, *(f"{v:.3f}" for v in row)] for i, row in enumerate(sims)],
        )
    if args.out:
        np.save(args.out, emb.astype(np.float32))
        print(f"wrote {args.out}: {emb.shape[0]} x {emb.shape[1]} float32, one row per sentence in input order")
    return 0


def bench(args: argparse.Namespace) -> int:
    from bench import suite

    return suite.main((["--quick"] if args.quick else []) + ["--out", args.out or "results", "--backend", args.backend])


def stress(args: argparse.Namespace) -> int:
    from meta import stress as stress_run

    if args.workers is None:
        args.workers = 2
    with open_cluster(args) as dev:
        return stress_run.run(dev, args.seconds, args.seed)


# -- parser -------------------------------------------------------------------------------------


def _cluster_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: one per GPU, else 2)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--devices", default="", help="GPU indices, one worker each, e.g. 0,2,3")
    p.add_argument("--listen", default="", help="coordinator endpoint for remote workers, e.g. tcp://0.0.0.0:5555")
    p.add_argument("--spawn", type=int, default=None, help="with --listen: 0 waits for remote workers")
    p.add_argument("--keys", default="", help="CURVE key file (launch.py keys)")
    p.add_argument("--liveness", type=float, default=5.0, help="seconds before a silent worker is lost")
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument("--log-dir", default="", help="write worker-R.log files here instead of prefixed stderr")
    p.add_argument(
        "--data-plane",
        default="auto",
        choices=["auto", "shm", "zmq", "nccl"],
        help="between workers: shared memory on one host (ZeroMQ across hosts), ZeroMQ only, NCCL "
        "(CuPy workers on distinct GPUs); auto: NCCL where it applies, else shared memory",
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="launch.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="tensor-parallel matmul and MLP, checked against NumPy")
    _cluster_options(p)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.set_defaults(fn=demo)
    sub.add_parser("devices", help="list backends and devices").set_defaults(fn=devices)
    p = sub.add_parser("run", help="run a script with a connected MetaDevice `dev`")
    _cluster_options(p)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(fn=run_script)
    p = sub.add_parser("embed", help="sentence embeddings with all-MiniLM-L6-v2, tensor-parallel")
    _cluster_options(p)
    p.add_argument("sentences", nargs="*")
    p.add_argument("--file", default="", help="one sentence per line")
    p.add_argument("--out", default="", help="write the embeddings here (.npy, float32)")
    p.add_argument("--batch", type=int, default=32)
    p.set_defaults(fn=embed)
    p = sub.add_parser("bench", help="the benchmark suite")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="results", help="folder for JSON and plots")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(fn=bench)
    p = sub.add_parser("stress", help="random graphs on real workers against NumPy")
    _cluster_options(p)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=stress)
    p = sub.add_parser("keys", help="make a CURVE key file")
    p.add_argument("path")
    p.set_defaults(fn=keys)
    p = sub.add_parser("worker", help="join a coordinator as a worker")
    p.add_argument("--connect", required=True, help="coordinator endpoint tcp://HOST:PORT")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--keys", default="")
    p.add_argument("--liveness", type=float, default=5.0)
    p.set_defaults(fn=worker)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except MetaError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
