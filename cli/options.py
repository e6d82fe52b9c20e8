"""The options every cluster command shares, and the cluster they describe.

Under a batch launcher (Open MPI's or MPICH's mpiexec, Slurm's srun, torchrun) every rank runs the
same command: rank 0 becomes the coordinator (and starts worker 0), the other ranks start their
workers (see `_join_batch_job`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from meta.api import cluster
from meta.device import MetaDevice
from meta.launchers import LaunchEnv, detect_launcher, job_directory
from split_state.errors import MetaError, WorkerLost
from transport import protocol as p
from transport.environment import BLAS_THREAD_VARS, MPI_RANK_ENV
from transport.sockets import private_dir
from workers import backends, planes

ROOT = str(Path(__file__).resolve().parent.parent)


def add_cluster_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: one per GPU, else 2)")
    ap.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="threads of each CPU worker, for BLAS and the quantized loops (llama.cpp's -t; default: cores // workers)",
    )
    ap.add_argument(
        "--backend", default="auto", choices=["auto", *backends.names()], help="auto: cuda where a GPU is, else cpu"
    )
    ap.add_argument("--devices", default="", help="device indices, one worker each, e.g. 0,2,3")
    ap.add_argument("--listen", default="", help="coordinator endpoint for remote workers, e.g. tcp://0.0.0.0:5555")
    ap.add_argument(
        "--spawn",
        type=int,
        default=None,
        help="with --listen: start ranks 0..N-1 here and wait for the rest (launch.py worker --connect); "
        "0 waits for every worker (default: all here)",
    )
    ap.add_argument("--keys", default="", help="CURVE key file (launch.py keys)")
    ap.add_argument("--insecure", action="store_true", help="tcp without keys: anyone who can reach the ports joins")
    ap.add_argument(
        "--advertise", default="", help="with --listen: this host's address as other hosts' workers reach it"
    )
    ap.add_argument("--liveness", type=float, default=5.0, help="seconds before a silent worker is lost")
    ap.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for the workers to connect")
    ap.add_argument("--log-dir", default="", help="write worker-R.log files here instead of prefixed stderr")
    ap.add_argument(
        "--data-plane",
        default="auto",
        choices=["auto", *planes.names()],
        help="between workers: shared memory on one host (ZeroMQ across hosts), plain TCP sockets (any "
        "host; not encrypted, so not with keys), ZeroMQ only, NCCL (CuPy workers on distinct GPUs), CUDA IPC "
        "(CuPy workers on one host), MPI (under mpiexec/srun); auto: NCCL where it applies, MPI under an MPI "
        "launcher, tcp for workers on several hosts without keys, else shared memory",
    )


def add_cache_type_options(ap: argparse.ArgumentParser) -> None:
    """llama.cpp's -ctk / -ctv: the KV cache's element types (generate and serve)."""
    for short, which in (("-ctk", "k"), ("-ctv", "v")):
        ap.add_argument(
            short,
            f"--cache-type-{which}",
            choices=("auto", "f32", "f16"),  # models.llama.CACHE_TYPES and loading.AUTO_CACHE, not imported here
            default="auto",
            help=f"element type of the KV cache's {'keys' if which == 'k' else 'values'} (llama.cpp's flag): f16 "
            "halves the cache and what a decode step reads of it (llama.cpp's default); f32 keeps the logits equal "
            "to the float32 reference's; auto: f16 with --weights native and --activations q8, f32 on the float32 "
            "paths (--weights f32 or --activations f32) (default: %(default)s)",
        )


def add_activations_option(ap: argparse.ArgumentParser) -> None:
    """How the quantized products multiply (generate and serve)."""
    ap.add_argument(
        "--activations",
        choices=("q8", "f32"),  # split_state.ops.ACTIVATIONS
        default="q8",
        help="q8: a CPU worker quantizes each product's activation rows into 8-bit blocks and multiplies "
        "integers, as llama.cpp does (its logits move as llama.cpp's do, by the activations' rounding); f32: "
        "float32 activations, logits equal to the dequantized weights' float32 product (default: %(default)s)",
    )


def add_split_options(ap: argparse.ArgumentParser) -> None:
    """How the model's layers go over the workers (generate and serve): llama.cpp's -sm."""
    ap.add_argument(
        "-sm",
        "--split",
        choices=("row", "layer"),  # models.loading.SPLITS
        default="row",
        help="row: every layer split over every worker (tensor parallel: two all-reduces a layer); layer: "
        "consecutive layers on groups of the workers, each layer split over its group only, one hand-over of the "
        "activation between groups a step (for slow links between hosts) (default: %(default)s)",
    )
    ap.add_argument(
        "--layer-groups",
        type=int,
        default=0,
        metavar="N",
        help="with --split layer: N groups of consecutive workers (default: one a host where the workers are on "
        "several hosts, else one a worker)",
    )
    ap.add_argument(
        "--no-pipeline",
        action="store_true",
        help="with --split layer: decode every sequence in one step at a time, instead of in lanes, one a group, "
        "whose steps overlap so each group works on one lane while the others work on theirs",
    )


def check_cluster_options(args: argparse.Namespace) -> None:
    """The cluster options' values, checked before anything slow starts."""
    for name, value in (("--liveness", args.liveness), ("--start-timeout", args.start_timeout)):
        if not value > 0:
            raise MetaError(f"{name} {value}: give a positive number of seconds")
    if args.workers is not None and args.workers < 1:
        raise MetaError(f"--workers {args.workers}: give 1 or more")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise MetaError(f"--threads {threads}: give 1 or more")
    cores = os.cpu_count() or 1
    if threads is not None and threads * (args.workers or 2) > cores:
        print(
            f"warning: {args.workers or 2} workers of {threads} threads are more than this machine's {cores} cores; "
            "they will take turns on them",
            file=sys.stderr,
        )


@contextlib.contextmanager
def open_cluster(args: argparse.Namespace, worker_env: dict[str, str] | None = None) -> Iterator[MetaDevice]:
    """A cluster from the common options; under a batch launcher, rank 0 coordinates and the
    other ranks serve as workers (this process then never returns from here normally).
    `worker_env`: set in the environment of the workers started here (models.loading's
    decode_pool_env)."""
    check_cluster_options(args)
    config = {"liveness": args.liveness, "log_dir": args.log_dir, "data_plane": args.data_plane}
    config["env"] = dict(worker_env or {})
    if getattr(args, "threads", None) is not None:
        config["blas_threads"] = args.threads
    launcher = detect_launcher(args.environ) if not args.listen else None
    listen = args.listen
    if launcher is not None and launcher.world_size > 1:
        listen = _join_batch_job(launcher, args, config)
    if listen:
        host, port = listen[len("tcp://") :].rsplit(":", 1)
        config.update(
            host=host,
            port=int(port),
            keys=args.keys,
            insecure=args.insecure,
            start_timeout=args.start_timeout,
            advertise=args.advertise,
        )
    spawn = args.spawn if args.spawn is not None else (args.workers or 0)
    if listen and args.workers and 0 < spawn < args.workers:
        config["local_workers"] = spawn
    if listen and (spawn == 0 or spawn < (args.workers or 0)):
        config["spawn"] = spawn > 0
        ranks = f" (R = {spawn}..{args.workers - 1})" if spawn else ""
        print(
            f"waiting for {(args.workers or 0) - spawn or args.workers} workers: python launch.py worker "
            f"--connect {listen} --rank R{ranks}"
            + (f" --keys {args.keys}" if args.keys else " --insecure" if args.insecure else ""),
            file=sys.stderr,
            flush=True,
        )
    devices = tuple(int(d) for d in args.devices.split(",")) if args.devices else ()
    debug = args.environ.get("META_TP_DEBUG", "") not in ("", "0")
    try:
        with cluster(workers=args.workers, backend=args.backend, devices=devices, debug=debug, **config) as dev:
            if launcher is not None and launcher.world_size > 1:
                print(
                    f"{launcher.world_size} workers, one per rank of the {launcher.source} job; data plane: "
                    f"{dev.plane or 'mixed'}",
                    file=sys.stderr,
                    flush=True,
                )
            try:
                yield dev
            except WorkerLost as exc:  # said at once; stopping the survivors follows
                print(f"error: {exc}; stopping every worker", file=sys.stderr, flush=True)
                raise SystemExit(3) from None
    except WorkerLost as exc:
        print(f"error: {exc}; every worker was stopped", file=sys.stderr)
        raise SystemExit(3) from None
    except KeyboardInterrupt:
        print("interrupted: every worker was stopped", file=sys.stderr)
        raise SystemExit(130) from None


def _join_batch_job(launcher: LaunchEnv, args: argparse.Namespace, config: dict) -> str:
    """Under a batch launcher: rank 0 coordinates and starts worker 0 (the coordinator waits on
    sockets while the workers compute, so it takes no core of its own); every other rank starts
    its worker here and waits for it, never returning. Each worker knows its job rank, so the
    workers of an MPI job join MPI as those ranks (the MPI plane). All ranks on this host with a
    job id: ipc in the job's private directory, no keys needed; else tcp to rank 0's host, with
    --keys (or --insecure). Returns the endpoint to listen on ("" for ipc)."""
    env = dict(config["env"])
    if launcher.source in ("openmpi", "pmi") or "PMIX_RANK" in args.environ:  # MPI can start in the workers
        env[MPI_RANK_ENV] = str(launcher.rank)
    args.workers = launcher.world_size
    linger = args.liveness + 2.0  # the coordinator notices a silent worker within its liveness window
    config.update(local_workers=1, env=env, start_timeout=args.start_timeout)
    if launcher.one_host and launcher.job and not args.keys and not args.insecure:
        directory = job_directory(launcher, tempfile.gettempdir(), os.getuid())
        if launcher.rank != 0:
            sys.exit(exec_worker(f"ipc://{directory}/control", launcher.rank, args, env, linger))
        config["ipc_dir"] = directory
        return ""
    port = launcher.port or 29500
    if launcher.rank != 0:
        sys.exit(exec_worker(f"tcp://{launcher.coordinator or '127.0.0.1'}:{port}", launcher.rank, args, env, linger))
    args.spawn = 1
    args.advertise = args.advertise or launcher.coordinator  # rank 0 runs on the coordinator's host
    return f"tcp://0.0.0.0:{port}"


def exec_worker(
    connect: str, rank: int, args: argparse.Namespace, extra_env: dict | None = None, linger: float = 0.0
) -> int:
    """Run a worker on this host for the coordinator at `connect`, until it exits: over tcp with
    the cluster's keys, or over ipc in a private directory of this host. A worker that fails is
    said here at once; with `linger` (a batch job's rank, whose exit ends the whole job) this
    process then waits that long, so the coordinator can say what it lost before the job ends."""
    if connect.startswith("ipc://"):
        private_dir(connect[len("ipc://") :].rsplit("/", 1)[0])  # our data inbox is bound there
    elif not args.keys and not getattr(args, "insecure", False):
        raise MetaError(
            "a worker over tcp needs the cluster's key file (--keys PATH, made by 'launch.py keys PATH'), "
            "or --insecure if the coordinator runs without keys"
        )
    beat, beat_in = p.endpoints_from_control(connect)
    # this host's cores unless told (-t): a worker joining from elsewhere is usually its host's one
    threads = getattr(args, "threads", None) or len(os.sched_getaffinity(0))
    launch = p.WorkerLaunch(
        connect=connect,
        beat=beat,
        beat_in=beat_in,
        rank=rank,
        backend=backends.auto() if args.backend == "auto" else args.backend,
        device=getattr(args, "device", 0),
        keys=args.keys,
        advertise=getattr(args, "advertise", ""),
        liveness=args.liveness,
        parent_pid=os.getpid(),  # the worker ends with this process (a launcher may kill it)
        threads=threads,
    )
    env = dict(args.environ, PYTHONPATH=ROOT + os.pathsep + args.environ.get("PYTHONPATH", ""), **(extra_env or {}))
    # BLAS reads its pool size once, at start: as many threads as the worker's loops, as a spawned
    # worker gets (left to itself OpenBLAS takes every core, and its sums' order, so a step's
    # bits, followed the thread count: a remote worker's greedy tokens differed from a spawned one's)
    for var in BLAS_THREAD_VARS:
        env.setdefault(var, str(threads))
    try:
        code = subprocess.call(launch.command(), env=env)
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            print(f"worker {rank} (pid {os.getpid()}'s child) {how}", file=sys.stderr, flush=True)
            time.sleep(linger)
        return code if code >= 0 else 128 - code
    except KeyboardInterrupt:
        return 130
