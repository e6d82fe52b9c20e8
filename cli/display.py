"""What the commands print: tables, progress bars, a worker's data plane in words."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

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


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(columns)]
    # numbers right-aligned, text left-aligned; a column is numeric when its first row is
    numeric = [bool(rows) and isinstance(rows[0][i], (int, float)) for i in range(len(columns))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    lines = [title, line(columns), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    print(table(title, columns, rows))
    print()


def describe_plane(info: dict) -> str:
    """'shm' or 'zmq', with the reason when shared memory was asked for and not used."""
    return info["data_plane"] + (f" ({info['note']})" if info.get("note") else "")


def memory(free: int, total: int) -> str:
    return f"{free / 2**30:.1f}/{total / 2**30:.1f} GiB free"
