"""`launch.py demo`: a tensor-parallel matmul and MLP on the workers, checked against NumPy."""

from __future__ import annotations

import argparse
import time

import numpy as np

from cli.display import describe_plane, memory, print_table
from cli.options import add_cluster_options, open_cluster
from models.reference import gelu_tanh
from split_state import MIRRORED, Split


def timed_steps(fn, steps: int = 5) -> float:
    fn()  # compiles and caches the plan
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    with open_cluster(args) as dev:
        n = dev.n
        print_table(
            f"{n} workers started in {time.perf_counter() - start:.2f} s",
            ["rank", "backend", "device", "memory", "data plane"],
            [
                [r, d.backend, d.device, memory(d.memory_free, d.memory_total), describe_plane(plane)]
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
        cases = [
            ("matmul x @ w", lambda: xt @ wt, lambda: x @ w, f"x:M, w:{wt.state}"),
            (
                "MLP gelu(x @ w_up) @ w_down",
                lambda: ((xt @ up).gelu() @ down).redistribute(MIRRORED),
                lambda: gelu_tanh(x @ w_up) @ w_down,
                f"x:M, w_up:{up.state}, w_down:{down.state}",
            ),
        ]
        rows = []
        for label, build, reference, inputs in cases:
            seconds = timed_steps(lambda: dev.run(build()))  # noqa: B023 - called right here
            got = build().numpy()
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


def add(sub) -> None:
    p = sub.add_parser("demo", help="tensor-parallel matmul and MLP, checked against NumPy")
    p.add_argument("--tokens", type=int, default=64, help="rows of the MLP's input (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=512, help="the model width (default: %(default)s)")
    add_cluster_options(p)
    p.set_defaults(fn=demo)
