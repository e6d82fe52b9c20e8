"""Straight-line programs: a bound program replayed often becomes one generated Python function.

A bound program is a list of closures, one per step (workers/program.py). A SmolLM2 decode step
is ~600 of them, and calling them one after the other cost rank 0 190 us a token on 1 device and
280 on 2 before any kernel ran (`bench/executor.py`: the loop, each closure's call, its argument
tuple, the wrapper that drops dead slots). The same steps written out as one function's
statements (`s[12] = c3(xp, (s[4], s[9]), c4, c5)`; a dead slot `s[4] = None`; a view of a KV
cache kept from run to run behind an identity test) run in 80 and 115 us, and what saves most is
that a written-out step runs its kernel's plan (below): ~4 us a planned step of a decode step.
CPython compiles such a function at ~8 us a statement (four a planned step: 14 ms for SmolLM2's
decode step of 1,853 statements), so writing out pays for itself after ~8 runs whatever the
program's size (SmolLM2's Q4_K_M decode on one thread: 135 tok/s run as closures, 178 written
out, 2026-11-30). A binding is written out once its runs done and announced (a Generate says how
many steps it will run, `CompiledProgram.expect`) reach `WORTH_RUNS`, twice the break-even: a
prompt's prefill run a few times never pays for it; a generation of 16 tokens or more pays at
its first step, once per load.

A line says what its closure does, nothing more: the closures stay the reference, and what the
first runs, profiling, the checks, a run that keeps every slot and device graphs use.

A kernel with a `plan` (`plan(xp, inputs, params, out, **extra)`: a function of no arguments
that does what the kernel's call on exactly these arrays does, or None) writing into a buffer of
the program's (not a fresh result) is called through its plan while its inputs are the arrays it
was planned for (identity tests in the line; a decode step's inputs are the same arena buffers,
weights and caches every run), planned again when they are not. What a kernel's own checks,
reshapes and lookups cost is paid once: ~2-5 us a call of a decode step, more in a step than
alone, because the weight products before each call have pushed the interpreter's and NumPy's
data out of the caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

WORTH_RUNS = 16  # a binding's unprofiled runs, done and announced, from which it is written out


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
    inplace: bool = False  # the kernel writes its first input and returns it (a KV cache's set_rows)


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

    body = ["runs[0] += 1"]  # the plans' clock (_Planned.replan)
    runs = names["runs"] = [0]
    planned: list[_Planned] = []
    holders: dict[int, set] = {}  # id of an array -> the plans made for it (what `forget` looks up)
    for line, dead in lines:
        if _plannable(line):
            plan = _Planned(line, xp, names, f"p{len(planned)}", holders, runs)
            planned.append(plan)
            ins = ", ".join(f"s[{i}]" for i in line.inputs)
            same = " and ".join(f"s[{i}] is {plan.name}_{k}" for k, i in enumerate(line.inputs))
            same = same or f"{plan.name} is not None"
            body.append(f"if {same}:")
            body.append(f"    s[{line.output}] = {plan.name}()")
            body.append("else:")
            body.append(f"    s[{line.output}] = {plan.name}_other({ins})")
        elif isinstance(line, OpLine):
            ins = ", ".join(f"s[{i}]" for i in line.inputs)
            args = f"[{ins}]" if _listed(line) else f"({ins},)" if len(line.inputs) == 1 else f"({ins})"
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
    source = "def run(s):\n" + "".join(f"    {statement}\n" for statement in body)
    exec(compile(source, f"<{name}>", "exec"), names)
    run = names["run"]

    def forget(freed: dict) -> None:
        """Let go of the arrays in `freed` (id -> array: the store has freed them)."""
        for key in freed.keys() & holders.keys():  # a replayed step frees a few arrays a run
            for plan in list(holders.get(key, ())):
                plan.forget(freed)

    run.forget = forget
    return run


def _plannable(line: Line) -> bool:
    """Whether a line runs its kernel's plan: the kernel has one, and its result is the same array
    every run (the program's buffer, or the first input it writes in place), never a fresh one
    (a plan returns the array it was made with)."""
    return (
        isinstance(line, OpLine)
        and (line.out is not None or line.inplace)
        and getattr(line.kernel, "plan", None) is not None
    )


def _listed(line: OpLine) -> bool:
    """Whether the closures (workers/program.py _op_call) pass this line's inputs as a list (none
    or three or more, a fresh result, any keyword), not a tuple (one or two)."""
    return len(line.inputs) not in (1, 2) or line.fresh is not None or bool(line.extra)


_NOT_SEEN = object()  # no array is this: a plan's inputs before its first call


class _Planned:
    """A planned line's state, kept in the written-out function's globals (`names`): its inputs
    as `<name>_<k>`, the plan as `<name>`, and what runs when the inputs are others as
    `<name>_other`: `replan`, until the line has been planned on REPLANS runs in a row; after
    that its inputs are new arrays every run (the sum an all-reduce makes, say) and planning
    costs more than it saves, so the kernel is called as the closure calls it. Inputs that
    change now and then (the fed positions a rope reads, new with each Generate) are planned
    again each time: a run with no replan between two replans starts the count again (counted
    over the program's life, every rope of a decode step went unplanned from a server's third
    request on)."""

    REPLANS = 3

    def __init__(self, line: OpLine, xp, names: dict, name: str, holders: dict[int, set], runs: list[int]):
        self.line, self.xp, self.names, self.name = line, xp, names, name
        self.holders = holders  # shared by a written-out function's plans: id of an array -> its plans
        self.held: tuple[int, ...] = ()  # the ids of the inputs it is planned for
        self.runs = runs  # [runs of the written-out function so far]
        self.planned, self.last_run = 0, -2  # replans on runs in a row; the run of the last one
        self.names[f"{name}_other"] = self.replan
        self._unset()

    def _unset(self) -> None:
        for k in range(len(self.line.inputs)):
            self.names[f"{self.name}_{k}"] = _NOT_SEEN
        self.names[self.name] = None
        self._hold(())

    def _hold(self, ids: tuple[int, ...]) -> None:
        """Index this plan under the ids of the arrays it is now planned for (and no others)."""
        for key in self.held:
            plans = self.holders.get(key)
            if plans is not None:
                plans.discard(self)
                if not plans:
                    del self.holders[key]
        self.held = ids
        for key in ids:
            self.holders.setdefault(key, set()).add(self)

    def replan(self, *inputs):
        line = self.line
        extra = line.extra or {}
        run = self.runs[0]
        self.planned = self.planned + 1 if run <= self.last_run + 1 else 1
        self.last_run = run
        if self.planned > self.REPLANS:
            self._unset()
            self.names[f"{self.name}_other"] = call = self._unplanned()
            return call(*inputs)
        args = list(inputs) if _listed(line) else inputs
        fast = line.kernel.plan(self.xp, args, line.params, line.out, **extra)
        if fast is None:  # the kernel's own call, still only for these inputs

            def fast(kernel=line.kernel, xp=self.xp, params=line.params, out=line.out):
                return kernel(xp, args, params, out, **extra)

        for k, array in enumerate(inputs):
            self.names[f"{self.name}_{k}"] = array
        self.names[self.name] = fast
        self._hold(tuple(map(id, inputs)))
        return fast()

    def _unplanned(self) -> Callable:
        kernel, xp, params, out, extra = self.line.kernel, self.xp, self.line.params, self.line.out, self.line.extra
        extra = extra or {}
        if _listed(self.line):
            return lambda *inputs: kernel(xp, list(inputs), params, out, **extra)
        return lambda *inputs: kernel(xp, inputs, params, out)

    def forget(self, freed: dict) -> None:
        if not freed.keys().isdisjoint(self.held):
            self._unset()
