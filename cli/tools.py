"""The smaller commands: devices, run, keys, worker."""

from __future__ import annotations

import argparse
import runpy
import sys

from cli.display import memory, print_table
from cli.options import add_cluster_options, exec_worker, open_cluster
from meta.device import MetaDevice
from meta.launchers import detect_launcher
from split_state.errors import MetaError
from workers import backends

_current: MetaDevice | None = None


def current() -> MetaDevice:
    """The MetaDevice of `launch.py run`, for scripts that import launch instead of using `dev`."""
    if _current is None:
        raise MetaError("no cluster is running: start the script with 'python launch.py run SCRIPT.py'")
    return _current


def devices(args: argparse.Namespace) -> int:
    print_table(
        "devices (pick GPUs with --devices)",
        ["backend", "index", "name", "description", "type", "memory"],
        [
            [d.backend, d.index, d.name, d.description, d.kind, memory(d.memory_free, d.memory_total)]
            for d in backends.registry()
        ],
    )
    return 0


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
    from pathlib import Path

    from transport.sockets import CurveKeys

    if Path(args.path).exists() and not args.force:
        raise MetaError(
            f"{args.path} exists: give --force to replace it (workers holding the old key would then be refused)"
        )
    CurveKeys.generate().save(args.path)
    print(f"wrote {args.path} (mode 0600): give it to the coordinator and every worker (--keys {args.path})")
    return 0


def worker(args: argparse.Namespace) -> int:
    """A worker on this host joining a coordinator elsewhere."""
    launcher = detect_launcher(args.environ)
    rank = args.rank if args.rank is not None else (launcher.rank if launcher else 0)
    return exec_worker(args.connect, rank, args)


def add(sub) -> None:
    sub.add_parser("devices", help="list backends and devices").set_defaults(fn=devices)
    p = sub.add_parser("run", help="run a script with a connected MetaDevice `dev`")
    p.add_argument("script", help="a Python file; `dev` is a connected MetaDevice in it")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    add_cluster_options(p)
    p.set_defaults(fn=run_script)
    p = sub.add_parser("keys", help="make a CURVE key file")
    p.add_argument("path", help="where to write the key file")
    p.add_argument("--force", action="store_true", help="replace an existing key file")
    p.set_defaults(fn=keys)
    p = sub.add_parser("worker", help="join a coordinator as a worker")
    p.add_argument("--connect", required=True, help="coordinator endpoint tcp://HOST:PORT")
    p.add_argument("--rank", type=int, default=None, help="this worker's rank (default: the launcher's)")
    p.add_argument("--backend", default="auto", choices=["auto", *backends.names()], help="(default: %(default)s)")
    p.add_argument("--device", type=int, default=0, help="device index (default: %(default)s)")
    p.add_argument("--keys", default="", help="the cluster's CURVE key file (launch.py keys)")
    p.add_argument("--insecure", action="store_true", help="join a coordinator that runs without keys")
    p.add_argument("--advertise", default="", help="this host's address as the other workers reach it")
    p.add_argument("--liveness", type=float, default=5.0, help="seconds to wait on a silent coordinator (%(default)s)")
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="threads for BLAS and the quantized loops (default: this host's cores)",
    )
    p.set_defaults(fn=worker)
