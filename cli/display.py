"""What the commands print: tables, progress bars, a worker's data plane in words."""

from __future__ import annotations

import sys
import time

from bench.report import table
from split_state.quant import FORMATS


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


def widening_notice(model, weights: str, stream=sys.stderr) -> None:
    """One line naming the matrix types `--weights native` cannot keep in their blocks."""
    widened = model.widened() if weights == "native" else []
    if widened:
        kept = ", ".join(name.upper() for name in FORMATS)
        stream.write(f"note: {', '.join(widened)} matrices become float32 on the workers (kept in blocks: {kept})\n")


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    print(table(title, columns, rows))
    print()


def describe_plane(info: dict) -> str:
    """'shm' or 'zmq', with the reason when shared memory was asked for and not used."""
    return info["data_plane"] + (f" ({info['note']})" if info.get("note") else "")


def memory(free: int, total: int) -> str:
    return f"{free / 2**30:.1f}/{total / 2**30:.1f} GiB free"
