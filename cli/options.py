"""The options every cluster command shares, and the cluster they describe.

Under a batch launcher (Slurm, Open MPI, PMI, torchrun) every rank runs the same command: rank 0
becomes the coordinator (and runs worker 0), the other ranks become workers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from meta.api import cluster
from meta.device import MetaDevice
from meta.launchers import detect_launcher
from split_state.errors import MetaError, WorkerLost
from transport import protocol as p
from workers import backends, planes

ROOT = str(Path(__file__).resolve().parent.parent)


def add_cluster_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: one per GPU, else 2)")
    ap.add_argument(
        "--backend", default="auto", choices=["auto", *backends.names()], help="auto: cuda where a GPU is, else cpu"
    )
    ap.add_argument("--devices", default="", help="device indices, one worker each, e.g. 0,2,3")
    ap.add_argument("--listen", default="", help="coordinator endpoint for remote workers, e.g. tcp://0.0.0.0:5555")
    ap.add_argument("--spawn", type=int, default=None, help="with --listen: 0 waits for remote workers")
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
        help="between workers: shared memory on one host (ZeroMQ across hosts), ZeroMQ only, NCCL "
        "(CuPy workers on distinct GPUs); auto: NCCL where it applies, else shared memory",
    )


def check_cluster_options(args: argparse.Namespace) -> None:
    """The cluster options' values, checked before anything slow starts."""
    for name, value in (("--liveness", args.liveness), ("--start-timeout", args.start_timeout)):
        if not value > 0:
            raise MetaError(f"{name} {value}: give a positive number of seconds")
    if args.workers is not None and args.workers < 1:
        raise MetaError(f"--workers {args.workers}: give 1 or more")


@contextlib.contextmanager
def open_cluster(args: argparse.Namespace) -> Iterator[MetaDevice]:
    """A cluster from the common options; under a batch launcher, rank 0 coordinates and the
    other ranks serve as workers (this process then never returns from here normally)."""
    check_cluster_options(args)
    config = {"liveness": args.liveness, "log_dir": args.log_dir, "data_plane": args.data_plane}
    launcher = detect_launcher(args.environ) if not args.listen else None
    listen = args.listen
    if launcher is not None and launcher.world_size > 1:
        port = launcher.port or 29500
        if launcher.rank != 0:
            sys.exit(exec_worker(f"tcp://{launcher.coordinator or '127.0.0.1'}:{port}", launcher.rank, args))
        listen, args.workers, args.spawn = f"tcp://0.0.0.0:{port}", launcher.world_size, 1
        config["local_workers"] = 1  # rank 0's own worker; the other ranks start theirs
        args.advertise = args.advertise or launcher.coordinator  # rank 0 runs on the coordinator's host
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
    if listen and spawn == 0:
        config["spawn"] = False
        print(
            f"waiting for {args.workers} workers: python launch.py worker --connect {listen} --rank R",
            file=sys.stderr,
            flush=True,
        )
    devices = tuple(int(d) for d in args.devices.split(",")) if args.devices else ()
    debug = args.environ.get("META_TP_DEBUG", "") not in ("", "0")
    try:
        with cluster(workers=args.workers, backend=args.backend, devices=devices, debug=debug, **config) as dev:
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


def exec_worker(connect: str, rank: int, args: argparse.Namespace) -> int:
    """Run a worker on this host for the coordinator at `connect` (tcp), until it exits."""
    if not args.keys and not getattr(args, "insecure", False):
        raise MetaError(
            "a worker over tcp needs the cluster's key file (--keys PATH, made by 'launch.py keys PATH'), "
            "or --insecure if the coordinator runs without keys"
        )
    beat, beat_in = p.endpoints_from_control(connect)
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
    )
    env = dict(args.environ, PYTHONPATH=ROOT + os.pathsep + args.environ.get("PYTHONPATH", ""))
    try:
        return subprocess.call(launch.command(), env=env)
    except KeyboardInterrupt:
        return 130
