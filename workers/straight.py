"""Straight-line programs: a bound program replayed often becomes one generated Python function.

A bound program is a list of closures, one per step (workers/program.py). A SmolLM2 decode step
is ~600 of them, and calling them one after the other cost rank 0 190 us a token on 1 device and
280 on 2 before any kernel ran (`bench/executor.py`: the loop, each closure's call, its argument
tuple, the wrapper that drops dead slots). The same steps written out as one function's
statements (`s[12] = c3(xp, (s[4], s[9]), c4, c5)`; a dead slot `s[4] = None`; a view of a KV
cache kept from run to run behind an identity test) run in 80 and 115 us. CPython compiles such
a function at 20-30 us a statement (17-30 ms for a decode step) and a run saves ~0.2 us a call,
so writing out pays for itself after ~150 runs whatever the program's size: a binding is
written out once its runs done and announced (a Generate says how many steps it will run,
`CompiledProgram.expect`) reach `WORTH_RUNS`. A prompt's prefill run a few times, or a short
generation, never pays for it; a long generation pays at its first step, once per load.

A line says what its closure does, nothing more: the closures stay the reference, and what the
first runs, profiling, the checks, a run that keeps every slot and device graphs use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

WORTH_RUNS = 128  # a binding's unprofiled runs, done and announced, from which it is written out


# The lines are NamedTuples: every bind makes one a step (~2,000 for a prefill) whether or not
# the binding is ever written out, and a frozen dataclass costs three times as much to make.


class OpLine(NamedTuple):
    """A kernel's call: `s[output] = kernel(xp, inputs, params, out, **extra)`; with `fresh`
    (shape, dtype), `out` is a new array each run."""

    kernel: Callable
    inputs: tuple[int, ...]
    output: int
    params: Any
    out: Any
    extra: dict | None = None
    fresh: tuple | None = None


class ViewLine(NamedTuple):
    """A view of an input (workers/program.py `_view_call`): `last` holds [the source, its view]
    of the last run; the closure makes it again when the source is another array."""

    call: Callable
    source: int
    output: int
    last: list


class CallLine(NamedTuple):
    """A step kept as its closure (a collective)."""

    call: Callable


Line = OpLine | ViewLine | CallLine


def write_out(lines: Sequence[tuple[Line, Sequence[int]]], xp, name: str) -> Callable[[list], None]:
    """One function running `lines` in order on a slot list, each followed by its dead slots."""
    names: dict[str, Any] = {"xp": xp, "empty": xp.empty}

    def const(value: Any) -> str:
        key = f"c{len(names)}"
        names[key] = value
        return key

    body = []
    for line, dead in lines:
        if isinstance(line, OpLine):
            ins = ", ".join(f"s[{i}]" for i in line.inputs)
            # the closures' argument types: a tuple for one or two inputs, else a list
            args = f"({ins},)" if len(line.inputs) == 1 else f"({ins})" if len(line.inputs) == 2 else f"[{ins}]"
            if line.fresh is not None or line.extra:
                args = f"[{ins}]"
            out = (
                f"empty({const(line.fresh[0])}, {const(line.fresh[1])})" if line.fresh is not None else const(line.out)
            )
            extra = "".join(f", {k}={const(v)}" for k, v in (line.extra or {}).items())
            body.append(f"s[{line.output}] = {const(line.kernel)}(xp, {args}, {const(line.params)}, {out}{extra})")
        elif isinstance(line, ViewLine):
            last = const(line.last)
            body.append(f"if s[{line.source}] is {last}[0]:")
            body.append(f"    s[{line.output}] = {last}[1]")
            body.append("else:")
            body.append(f"    {const(line.call)}(s)")
        else:
            body.append(f"{const(line.call)}(s)")
        body.extend(f"s[{slot}] = None" for slot in dead)
    source = "def run(s):\n" + "".join(f"    {statement}\n" for statement in body or ["pass"])
    exec(compile(source, f"<{name}>", "exec"), names)
    return names["run"]
