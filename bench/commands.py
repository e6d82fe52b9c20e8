"""The benchmark suite and the stress run as launch.py commands (`bench`, `stress`): declared here,
beside what they run, and added to the command line by launch.py, so that cli/ never imports
bench/ (the benchmarks use cli/'s table printer and cluster options).
"""

from __future__ import annotations

import argparse

from cli.options import add_cluster_options, open_cluster
from workers import backends


def bench(args: argparse.Namespace) -> int:
    from bench import suite

    return suite.main((["--quick"] if args.quick else []) + ["--out", args.out or "results", "--backend", args.backend])


def stress(args: argparse.Namespace) -> int:
    from bench import stress as stress_run

    if args.workers is None:
        args.workers = 2
    with open_cluster(args) as dev:
        return stress_run.run(dev, args.seconds, args.seed)


def add(sub) -> None:
    p = sub.add_parser("bench", help="the benchmark suite")
    p.add_argument("--quick", action="store_true", help="small sizes, a few repeats")
    p.add_argument("--out", default="results", help="folder for JSON and plots")
    p.add_argument("--backend", default="cpu", choices=backends.names(), help="(default: %(default)s)")
    p.set_defaults(fn=bench)
    p = sub.add_parser("stress", help="random graphs on real workers against NumPy")
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the graphs' seed (default: %(default)s)")
    add_cluster_options(p)
    p.set_defaults(fn=stress)
