"""The tensor-parallel runtime's command line.

    python launch.py demo [--workers N] [--backend auto|cpu|cuda] [--devices 0,2,3]
    python launch.py devices
    python launch.py run SCRIPT.py [args ...]       # `dev` (a MetaDevice) is ready in the script
    python launch.py generate "PROMPT" [-n 64] [--chat] [--temp 0.8] [-m MODEL.gguf]   # or -i: a conversation
    python launch.py serve [--workers N] [--port 8000] [--max-slots 8] [--api-key KEY]
    python launch.py embed "a sentence" "another" [--workers N] [--out emb.npy] [--file F]
    python launch.py bench [--quick]
    python launch.py stress --seconds S --workers N --seed K
    python launch.py keys PATH                      # CURVE key pair for multi-host clusters
    python launch.py worker --connect tcp://HOST:PORT [--rank R] (--keys PATH | --insecure)

Multi-host: start the coordinator with `--listen tcp://0.0.0.0:PORT --spawn 0` (it listens on PORT,
PORT+1 and PORT+2) and one `launch.py worker --connect tcp://COORDINATOR:PORT` per remote worker.
Under Slurm, Open MPI, PMI or torchrun every rank runs the same command: rank 0 becomes the
coordinator (and runs worker 0), the other ranks become workers.

Environment: META_TP_DEBUG=1 prints each planned node and every inserted collective.

`launch.py COMMAND --help` shows each command's options and their defaults. Installed with pip,
the same commands are `meta-tp COMMAND ...`.

This file is the entry point and the only reader of the environment; the commands live in cli/,
the Python API in meta/api.py (re-exported here as `launch.cluster`).
"""

from __future__ import annotations

import os
import signal

if __name__ == "__main__":
    # Ctrl-C while the imports below run (a second or more on a slow machine) ends quietly with
    # 130, as it does once the command runs, where Python's own handler is back. Set before any
    # other import, and it exits at once (os._exit: nothing has started yet), since an exception
    # raised from the handler can land in an import lock's weakref callback, where Python prints
    # "Exception ignored" and a traceback
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

import contextlib  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import cli  # noqa: E402
from bench import commands as bench_commands  # noqa: E402
from cli.tools import current  # noqa: E402
from meta.api import cluster as _cluster  # noqa: E402
from meta.device import MetaDevice  # noqa: E402
from meta.launchers import LaunchEnv, blas_threads, detect_launcher, worker_cpus  # noqa: E402

__all__ = ["LaunchEnv", "blas_threads", "cluster", "current", "detect_launcher", "main", "parser", "worker_cpus"]


@contextlib.contextmanager
def cluster(
    workers: int | None = None, backend: str = "auto", devices: tuple[int, ...] = (), **config
) -> Iterator[MetaDevice]:
    """A connected MetaDevice for scripts and notebooks; every process is stopped on exit.

    with launch.cluster(workers=4, backend="cpu") as dev:
        ...
    """
    config.setdefault("debug", os.environ.get("META_TP_DEBUG", "") not in ("", "0"))
    with _cluster(workers, backend, devices, **config) as dev:
        yield dev


def parser():
    """launch.py's whole command line: cli/'s commands and the benchmarks' (bench/commands.py)."""
    return cli.parser(__doc__, EXTRA_COMMANDS)


EXTRA_COMMANDS = (bench_commands,)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, os.environ, __doc__, EXTRA_COMMANDS)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before a command took charge of Ctrl-C (building its options, say)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
