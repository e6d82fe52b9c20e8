"""Command line of the tensor-parallel runtime.

python launch.py demo      show split states, which slices each device holds, and a round trip
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from split_state import MIRRORED, PARTIAL, Split, gather, pieces, scatter, transition


def demo(args: argparse.Namespace) -> int:
    n = args.workers
    shape = (6, 12)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    states = [
        ("column split", Split.even(1, 12, n)),
        ("fused QKV, 3 segments by heads of 2", Split.even(1, (4, 4, 4), n, granularity=2)),
        ("uneven row split", Split.from_extents(0, [6] + [0] * (n - 1))),
        ("mirrored", MIRRORED),
        ("partial", PARTIAL),
    ]
    print(f"global tensor {shape} float32 on {n} devices (NumPy axes: axis 0 is outermost)\n")
    for label, state in states:
        locals_ = scatter(x, state, n)
        ok = np.array_equal(gather(locals_, state), x)
        print(f"{label:38s} {state!s:24s} round trip {'exact' if ok else 'MISMATCH'}")
        for d in range(n):
            held = ", ".join(
                f"[{p.global_start}:{p.global_stop})" for p in pieces(state, shape, n, d) if p.axis is not None
            )
            print(
                f"    device {d}: local {locals_[d].shape} {('axis ' + str(state.axis) + ' ' + held) if held else ''}"
            )
    t = transition(PARTIAL, MIRRORED, shape, n, 4)
    print(f"\nPartial -> Mirrored takes {t}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launch.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="split-state demonstration")
    p.add_argument("--workers", type=int, default=2)
    p.set_defaults(fn=demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
