"""A program compiled once, at load, into prebound calls over a static memory plan.

Loading a program (the coordinator's steps for this worker):
1. fuses the decoder patterns of workers/kernels/fused.py;
2. plans memory: every intermediate gets a place in the worker's arena by liveness (first fit,
   as ggml-alloc and XLA do), so buffers are reused within a run and across runs; views
   (reshape) and in-place writes (set_rows) share their source's buffer; results the program
   returns, and values a collective sends, get buffers of their own each run (a data plane may
   still hold what it sent, and results outlive the run), except where the engine copies what it
   sends and writes its result where it is told (the shared-memory postboxes' small
   all-reduces): both then in the arena, so the kernels either side keep their plans;
3. prices the plan: the arena's size and the per-run buffers, checked against the budget now.

Binding (at the first run, again when the arena moves or the peers change) makes one closure per
step holding its kernel, parameters, output buffer and collective request; a view of an arena
buffer (a reshape) is made then, once, and set in its slot each run instead of being called. A
run then fills the input slots from the store and calls the closures in order: no lookups,
validation, timers or accounting per step. Profiling (RunProgram.profile) times each step; the
first run after a bind checks every step's result against the plan. A binding run often enough
to pay for it (its runs, done and announced by a Generate, reach straight.WORTH_RUNS) is written
out as one function (workers/straight.py); on a backend that captures device graphs, the calls
between collectives become graph segments instead (workers/graphs.py), collectives included
where the engine's can be captured (NCCL's): a run then ends in the engine's wait for the device,
with the collective deadline. A run may also return once its work is issued (`wait=False`: the
GPU decode loop issues the next step before it reads the last one's tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from math import prod
from typing import Any

import numpy as np

from split_state.algorithms import moves_nothing
from split_state.dtypes import dtype_from_name
from split_state.errors import ProtocolError, ShapeError
from split_state.layout import local_shape
from transport import protocol as p
from transport.deadline import Deadline
from workers import graphs, layouts, straight
from workers.arena import Arena, aligned
from workers.kernels import OVERWRITES_INPUT, VIEW_OPS
from workers.kernels.fused import PATTERNS, Pattern, for_kernels, fuse, reads, scratch_bytes, writes_in_place


@dataclass(frozen=True)
class Placed:
    """A step of the compiled program: the (possibly fused) step, its index in the program as
    loaded (collective traffic is tagged with it, the same on every worker whatever was fused),
    where its output lives and its scratch buffer."""

    step: p.OpStep | p.MoveStep
    index: int
    # "arena", "fresh" (its own array each run), "alias" (a view or in-place write), "move" (a
    # collective's result, a new array each run; "arena" where the engine writes into a buffer)
    out: str
    offset: int = -1  # in the arena, for "arena"
    scratch: tuple[tuple[int, ...], int] | None = None  # (shape, arena offset)


class CompiledProgram:
    def __init__(
        self,
        program: int,
        steps: list[p.Step],
        outputs: list[int],
        kernels: dict[str, Callable],
        world: tuple[int, int] | None = None,
        patterns: tuple[Pattern, ...] = PATTERNS,
        writes_into: Callable[[p.MoveStep], bool] | None = None,
    ):
        """`world`: (devices, this rank) when known, to price collective results exactly;
        `patterns`: the fused patterns to apply (none: every step runs its own kernel);
        `writes_into(step)`: whether the engine's collective for a redistribution is done with
        its input when it returns and writes its result into a buffer it is given (the
        shared-memory postboxes: Collectives.writes_into); both then live in the arena."""
        self.program, self.world = program, world
        for i, step in enumerate(steps):
            if isinstance(step, p.OpStep) and step.op not in kernels:
                raise ProtocolError(f"program {program} step {i}: unknown op {step.op!r}")
        self.kernels = kernels
        for step in steps:  # kernels that compile (numba) do it now, not during a run
            prepare = getattr(kernels.get(step.op), "prepare", None) if isinstance(step, p.OpStep) else None
            if prepare is not None:
                prepare()
        live = [(s, i) for i, s in enumerate(steps)]
        # slot -> the slot it stands for, where a redistribution that moves nothing was dropped
        self.renamed: dict[int, int] = {}
        if world is not None:
            live = _without_idle_moves(live, set(outputs), world[0], self.renamed)
        fused = [
            (step, _scratch_for(kernels, step, scratch), live[at][1])
            for step, scratch, at in fuse([s for s, _ in live], frozenset(outputs), for_kernels(patterns, kernels))
        ]
        self.outputs = frozenset(outputs)
        planned = _plan(fused, self.outputs, world, writes_into if world is not None else None)
        self.placed, self.arena_bytes, self.fresh_bytes, self.arena_slots, self.dead, self.on_inputs, self.returned = (
            planned
        )
        slots = {0}
        for step in steps:
            slots.update(_slots(step))
        self.nslots = max(slots) + 1
        arena_steps = [pl for pl in self.placed if pl.out == "arena"]
        self.biggest = max(arena_steps, key=lambda pl: self._local_bytes(pl.step), default=None)
        self.calls: list[Callable] = []
        self.dropping: list = []  # (placed, call, its buffer) of each step that runs, once bound
        self.kept_views: list[list] = []  # [source, view] of each view of an input kept across runs
        self.bound_to: tuple[int, int] | None = None  # (arena generation, collectives id)
        self.checked = False
        self.memo: dict = {}
        self.run_id = 0
        self.comm_s = 0.0

    def describe_peak(self) -> str:
        if self.biggest is None:
            return f"program {self.program}"
        step = self.biggest.step
        what = step.op if isinstance(step, p.OpStep) else f"redistribution {step.src} -> {step.dst}"
        return f"program {self.program} step {self.biggest.index} ({what}) needs {self._local_bytes(step)} bytes"

    def _local_bytes(self, step: p.OpStep | p.MoveStep) -> int:
        return prod(_result_shape(step, self.world)) * dtype_from_name(step.dtype).itemsize

    # -- binding ----------------------------------------------------------------------------------

    def bind(self, arena: Arena, collectives, backend, collective_timeout: float) -> None:
        xp = backend.xp
        bound: list[tuple[Placed, Callable, Any]] = []
        # the slots whose value is the same array every run: arena buffers, and views of them
        # (a reshape of q, of the attention's output), which are made here once instead of by a
        # call per run: a decode step has ~8 per layer
        fixed: dict[int, Any] = {}
        preset: list[tuple[int, Any]] = []
        kept: list[list] = []  # the views of inputs kept from run to run: [source, view] each
        lines: list[straight.Line] = []  # what each bound call does, for write_out
        for placed in self.placed:
            step = placed.step
            if isinstance(step, p.MoveStep):
                out = None
                if placed.out == "arena":  # the engine writes the result here: the same array every run
                    shape = _result_shape(step, self.world)
                    fixed[step.output] = out = arena.view(placed.offset, shape, dtype_from_name(step.dtype))
                bound.append((placed, self._move_call(placed, collectives, collective_timeout, out), None))
                lines.append(straight.CallLine(bound[-1][1]))
                continue
            out = (
                arena.view(placed.offset, tuple(step.shape), dtype_from_name(step.dtype))
                if placed.out == "arena"
                else None
            )
            if out is not None:
                fixed[step.output] = out
            if step.op in VIEW_OPS and placed.out == "alias" and step.inputs[0] in fixed:
                source = fixed[step.inputs[0]]
                view = self.kernels[step.op](xp, (source,), step.params, None)
                if xp.may_share_memory(view, source):  # a view, not a copy made now (which has a base too)
                    _check(placed, view, None, arena.memory)
                    fixed[step.output] = view
                    preset.append((step.output, view))
                    continue
            if step.op in VIEW_OPS and placed.out == "alias" and step.inputs[0] in self.on_inputs:
                last: list = [None, None]
                kept.append(last)
                bound.append((placed, _view_call(self.kernels[step.op], xp, step, last), None))
                lines.append(straight.ViewLine(bound[-1][1], step.inputs[0], step.output, last))
                continue
            scratch = None
            if placed.scratch is not None:
                shape, offset = placed.scratch
                scratch = arena.view(offset, shape, np.float32)
            kernel = self.kernels[step.op]
            memo = self.memo if getattr(kernel, "memo", False) else None
            fresh = placed.out == "fresh"
            bound.append((placed, _op_call(kernel, xp, step, out, scratch, fresh, memo), out))
            extra = None
            if scratch is not None or memo is not None:
                extra = {"scratch": scratch} if scratch is not None else {}
                if memo is not None:
                    extra["memo"] = memo
            shape_dtype = (tuple(step.shape), dtype_from_name(step.dtype)) if fresh else None
            line = straight.OpLine(kernel, step.inputs, step.output, step.params, out, extra, shape_dtype)
            lines.append(line._replace(inplace=True) if writes_in_place(step.op) else line)
        # the calls that drop per-run memory after its last read; the plain ones (`keep`) for a run
        # that asks for slots the load did not declare (they must stay until the run ends)
        dropping = []
        # written out as one function once run often enough (workers/straight.py); not where
        # device graphs replay the kernels
        self.lines: list | None = []
        for (placed, call, out), line in zip(bound, lines):
            dead = self.dead.get(placed.step.output, ())
            dropping.append((placed, _dropping(call, dead) if dead else call, out))
            self.lines.append((line, dead))
        calls = [call for _, call, _ in dropping]
        self.replays, self.expected, self.xp = 0, 0, xp
        # an engine whose collectives a device graph can hold (NCCL's) waits for the device itself,
        # with the deadline and abort watch a collective's wait has: a replayed graph holding a
        # collective whose peer was lost would otherwise spin in a plain synchronize forever
        engine = getattr(collectives, "engine", None)
        captured_moves = bool(getattr(engine, "captures", False))
        if captured_moves:
            self.finish = lambda run: engine.wait_device(run, Deadline(collective_timeout))
        else:
            self.finish = lambda run: backend.synchronize()
        if graphs.can_capture(backend):  # runs of kernels replayed as device graphs
            calls = graphs.piecewise(dropping, backend, self.kernels, captured_moves, self.returned)
            self.lines = None
        self.bound, self.dropping, self.calls, self.preset, self.arena = bound, dropping, calls, preset, arena
        self.kept_views = kept
        self.keeping_calls = [call for _, call, _ in bound]
        self.bound_to = (arena.generation, id(collectives))
        self.checked = False

    def _move_call(self, placed: Placed, collectives, timeout: float, out: Any = None) -> Callable:
        step, index = placed.step, placed.index
        dtype = dtype_from_name(step.dtype)
        run_collective = collectives.prepared(collectives.request(step.src, step.dst, step.shape, dtype), out)
        source, target = step.input, step.output

        def call(slots: list) -> None:
            local = slots[source]
            if local.dtype != dtype:
                raise ShapeError(f"step {index} (redistribute): slot {source} holds {local.dtype}, not {step.dtype}")
            start = time.perf_counter()
            slots[target] = run_collective(local, self.run_id, index, Deadline(timeout))
            self.comm_s += time.perf_counter() - start

        return call

    def expect(self, runs: int) -> None:
        """The caller is about to run this binding `runs` times (a Generate's steps): counted
        towards writing it out (workers/straight.py) from the next run."""
        self.expected = runs

    def forget(self, freed: dict) -> None:
        """Drop the views kept of the arrays in `freed` (id -> array: the store has freed them)."""
        for last in self.kept_views:
            if id(last[0]) in freed:
                last[:] = (None, None)
        if len(self.calls) == 1 and hasattr(self.calls[0], "forget"):  # written out (workers/straight.py)
            self.calls[0].forget(freed)  # its planned lines

    # -- running ----------------------------------------------------------------------------------

    def run(
        self,
        slots: list,
        run: int,
        backend,
        profile: bool,
        keep: bool = False,
        same_data: bool = False,
        wait: bool = True,
    ) -> dict[str, float]:
        """`keep`: every slot stays until the run ends (the run asks for undeclared slots);
        `same_data`: the run follows this program's last run within one RunChain (a decoder's
        layers), whose inputs the chain does not rewrite in place: what kernels found from them
        (the memo, which holds the arrays it is keyed by) still holds. `wait=False`: the run
        returns once its kernels are issued, not done (a GPU's decode loop issues the next step
        behind it; program_s is then the issuing's time)."""
        self.run_id, self.comm_s = run, 0.0
        if not same_data:
            self.memo.clear()  # what kernels found from this run's data (the attention's used positions)
        started = time.perf_counter()
        compute = 0.0
        for slot, view in self.preset:
            slots[slot] = view
        if profile or not self.checked:
            for placed, call, out in self.bound if keep else self.dropping:
                start = time.perf_counter()
                call(slots)
                if isinstance(placed.step, p.OpStep):
                    if profile:
                        backend.synchronize()  # a GPU kernel's time, not its launch's
                    compute += time.perf_counter() - start
                    if not self.checked:
                        _check(placed, slots[placed.step.output], out, self.arena.memory)
            self.checked = True
        else:
            calls = self.keeping_calls if keep else self.calls
            if not keep and self.lines is not None:
                self.replays += 1
                if self.replays + self.expected >= straight.WORTH_RUNS:
                    self.calls = calls = [straight.write_out(self.lines, self.xp, f"program {self.program}")]
                    self.lines = None
            for call in calls:
                call(slots)
        if wait or profile:
            self.finish(run)
        program = time.perf_counter() - started
        # unprofiled, the time between collectives counts as compute: the steps are not timed
        compute = compute if profile else program - self.comm_s
        return {"compute_s": compute, "comm_s": self.comm_s, "program_s": program, "profiled": profile}


def _dropping(call: Callable, dead: tuple[int, ...]) -> Callable:
    def run(slots: list) -> None:
        call(slots)
        for slot in dead:
            slots[slot] = None

    return run


def _without_idle_moves(
    live: list[tuple[p.Step, int]], outputs: set[int], n: int, renamed: dict[int, int]
) -> list[tuple[p.Step, int]]:
    """The program without the redistributions that move nothing (one device, or the same
    layout: the Keep algorithm, which hands back its input): their readers read the input
    instead. A decode step on one worker has ~8 per layer; as calls they cost ~1 us each, and
    they kept their inputs out of the arena (what a collective sends gets a buffer per run).
    Every rank drops the same steps (it depends on the states and `n` only), and the steps
    left keep their indices, which tag collective traffic. `renamed` gets each dropped output's
    source, for a run that asks for a slot the load did not declare an output."""
    kept: list[tuple[p.Step, int]] = []
    for step, index in live:
        if isinstance(step, p.OpStep):
            if renamed and any(s in renamed for s in step.inputs):
                step = replace(step, inputs=tuple(renamed.get(s, s) for s in step.inputs))
        elif isinstance(step, p.MoveStep):
            source = renamed.get(step.input, step.input)
            if step.output not in outputs and moves_nothing(step.src, step.dst, n):
                renamed[step.output] = source
                continue
            if source != step.input:
                step = replace(step, input=source)
        kept.append((step, index))
    return kept


def _slots(step: p.Step) -> tuple[int, ...]:
    if isinstance(step, p.OpStep):
        return (*step.inputs, step.output)
    if isinstance(step, p.MoveStep):
        return (step.input, step.output)
    return tuple(step.slots)


def _scratch_for(kernels: dict, step, planned: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The scratch a fused step gets: what its pattern plans for, unless its kernel says what it
    wants of that (`scratch_for(step, planned) -> shape or None`: a backend whose kernel for
    some shapes needs less, as the CUDA backend's tiled prompt attention needs none)."""
    wants = getattr(kernels.get(step.op), "scratch_for", None) if planned is not None else None
    return planned if wants is None else wants(step, planned)


def _result_shape(step, world: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape of a step's result on this worker: a collective's, this worker's part where the
    world (devices, rank) is known."""
    if isinstance(step, p.MoveStep) and world is not None:
        return tuple(local_shape(step.dst, step.shape, *world))
    return tuple(step.shape)


def _nbytes(step) -> int:
    return prod(step.shape) * dtype_from_name(step.dtype).itemsize


def _view_call(kernel, xp, step: p.OpStep, last: list) -> Callable:
    """A view op's step on an input or what aliases one (the keys of a KV cache that set_rows
    wrote in place): the same array every run of a generation, so its view is made again only
    when the source is another array than the last run's (~90 calls of ~2 us a decode step). A
    view that turns out a copy (a reshape of a transposed view) is never kept: it would not see
    the next writes. `last` holds [the source, its view]; CompiledProgram.forget drops it when
    the store frees the source, so a kept view never keeps a freed cache in memory."""
    params, o, (a,) = step.params, step.output, step.inputs

    def call(slots):
        source = slots[a]
        if source is last[0]:
            slots[o] = last[1]
            return
        view = kernel(xp, (source,), params, None)
        last[:] = (source, view) if xp.may_share_memory(view, source) else (None, None)
        slots[o] = view

    return call


def _op_call(kernel, xp, step: p.OpStep, out, scratch, fresh: bool, memo: dict | None = None) -> Callable:
    """The step as one call: its kernel, parameters and output buffer bound (`fresh`: a new
    array every run, for results that outlive it; `memo`: the run's memo, for a kernel that
    takes one)."""
    params, o, ins = step.params, step.output, step.inputs
    if fresh or scratch is not None or memo is not None:
        shape, dtype, empty = tuple(step.shape), dtype_from_name(step.dtype), xp.empty
        extra = {} if scratch is None else {"scratch": scratch}
        if memo is not None:
            extra["memo"] = memo

        def call(slots):
            target = empty(shape, dtype) if fresh else out
            slots[o] = kernel(xp, [slots[i] for i in ins], params, target, **extra)

    elif len(ins) == 1:
        (a,) = ins

        def call(slots):
            slots[o] = kernel(xp, (slots[a],), params, out)

    elif len(ins) == 2:
        a, b = ins

        def call(slots):
            slots[o] = kernel(xp, (slots[a], slots[b]), params, out)

    else:

        def call(slots):
            slots[o] = kernel(xp, [slots[i] for i in ins], params, out)

    return call


def _check(placed: Placed, value: Any, out: Any, arena: Any) -> None:
    """A step's result is what the plan says, and lies where the plan put it: a kernel that
    returned another array than its `out` (a view of some input) would let the next step that
    reuses the memory change a result."""
    step = placed.step
    if tuple(value.shape) != tuple(step.shape) or value.dtype != dtype_from_name(step.dtype):
        raise ShapeError(
            f"step {placed.index} ({step.op}) produced {tuple(value.shape)} {value.dtype}, "
            f"the plan expects {tuple(step.shape)} {step.dtype}"
        )
    misplaced = value is not out if out is not None else placed.out == "fresh" and _overlaps(value, arena)
    if misplaced:
        raise ShapeError(f"step {placed.index} ({step.op}): its kernel did not write into the buffer it was given")


def _overlaps(value: Any, arena: Any) -> bool:
    if not arena.nbytes or not value.nbytes:
        return False
    return bool(np.may_share_memory(value, arena)) if isinstance(value, np.ndarray) else False


def _plan(fused: list, outputs: set[int], world: tuple[int, int] | None, writes_into=None):
    """Where every step's output lives, the arena's size, the bytes of per-run buffers, the
    slots whose value lies in the arena, after which step (by its output slot) each per-run
    slot is dropped, and the slots that are an input or alias one (a view of a weight, a cache
    written in place). A redistribution whose engine `writes_into` a buffer gets one in the
    arena, and what it sends stays there too."""
    steps = [s for s, _, _ in fused]
    last_read: dict[int, int] = {}
    root: dict[int, int] = {}
    known: dict[int, layouts.Layout] = {}  # the layouts of what this program computes, and views of it
    for j, step in enumerate(steps):
        for slot in reads(step):
            last_read[slot] = j
        # a view that is a result gets its own copy: a later in-place write into what it views (a
        # cache, a weight) must not change a value already handed out; so does a reshape that
        # cannot be a view of its input (workers/layouts.py): a buffer of its own in the arena
        view = isinstance(step, p.OpStep) and step.op in VIEW_OPS and step.output not in outputs
        source = known.get(step.inputs[0]) if view else None
        layout = _view_layout(step, source) if source is not None else None
        if source is not None and layout is None and step.op == "reshape":
            view = False  # NumPy would copy: into the arena instead
        aliases = view or (isinstance(step, p.OpStep) and writes_in_place(step.op))
        root[step.output] = root.get(step.inputs[0], step.inputs[0]) if aliases else step.output
        if not isinstance(step, p.OpStep):
            continue  # a collective's result: its layout is not known
        if not aliases:  # a buffer of its own
            known[step.output] = layouts.contiguous(step.shape)
        elif view:
            if layout is not None:
                known[step.output] = layout
        elif step.inputs[0] in known:  # written in place: its destination's layout
            known[step.output] = known[step.inputs[0]]
    # a buffer lives until the last read of anything that aliases it; results and what a
    # collective sends get buffers of their own
    end = len(steps)
    death: dict[int, int] = {}
    fresh: set[int] = set()
    for slot, r in root.items():
        death[r] = max(death.get(r, -1), last_read.get(slot, -1), end if slot in outputs else -1)
        if slot in outputs:
            fresh.add(r)
    # a collective that copies what it sends before returning and writes its result where it
    # is told (a decode step's all-reduces on one host): both in the arena, where the kernels
    # before and after it find the same arrays every run (workers/straight.py plans them)
    buffered = {
        step.output
        for step in steps
        if isinstance(step, p.MoveStep) and writes_into is not None and step.output not in fresh and writes_into(step)
    }
    for step in steps:
        if isinstance(step, p.MoveStep) and step.output not in buffered:
            fresh.add(root.get(step.input, step.input))
    placed: list[Placed] = []
    allocator = _FirstFit()
    in_arena: set[int] = set()
    own: dict[int, tuple[int, int, tuple, str]] = {}  # arena slot -> (offset, size, shape, dtype)
    fresh_bytes = 0
    for j, (step, scratch_shape, index) in enumerate(fused):
        allocator.free_before(j)
        if isinstance(step, p.MoveStep):  # the engine's result: charged per run, or in the arena
            shape = _result_shape(step, world)
            size = aligned(prod(shape) * dtype_from_name(step.dtype).itemsize)
            if step.output in buffered:
                offset = allocator.take(size, death[step.output])
                own[step.output] = (offset, size, tuple(shape), step.dtype)
                placed.append(Placed(step, index, "arena", offset))
                in_arena.add(step.output)
                continue
            fresh_bytes += size
            placed.append(Placed(step, index, "move"))
            continue
        scratch = None
        if scratch_shape is not None:
            scratch = (scratch_shape, allocator.take(aligned(scratch_bytes(scratch_shape)), j))
        if root[step.output] != step.output:
            placed.append(Placed(step, index, "alias", scratch=scratch))
        elif step.output in fresh:
            fresh_bytes += aligned(_nbytes(step))
            placed.append(Placed(step, index, "fresh", scratch=scratch))
        else:
            size = aligned(_nbytes(step))
            reused = _dying_input(step, j, death, own, size) if step.op in OVERWRITES_INPUT else None
            if reused is not None:
                offset = own.pop(reused)[0]
                allocator.extend(offset, size, death[step.output])
            else:
                offset = allocator.take(size, death[step.output])
            own[step.output] = (offset, size, tuple(step.shape), step.dtype)
            placed.append(Placed(step, index, "arena", offset, scratch))
            in_arena.add(step.output)
    arena_slots = frozenset(slot for slot, r in root.items() if r in in_arena)
    # per-run memory (a fresh result, a collective's, or a view of one) goes back after its last
    # reader: a 128-token prefill on two workers otherwise held all 60 of its all-reduces'
    # buffers (and what they sent) until its end, ~35 MiB of peak RSS per worker
    per_run = fresh | {step.output for step in steps if isinstance(step, p.MoveStep) and step.output not in buffered}
    dead: dict[int, list[int]] = {}  # a step's output slot -> the per-run slots it reads last
    for slot, r in root.items():
        if r in per_run and slot not in outputs and slot in last_read:
            dead.setdefault(steps[last_read[slot]].output, []).append(slot)
    on_inputs = frozenset(slot for slot, r in root.items() if r not in root) | frozenset(last_read.keys() - root.keys())
    dead_after = {out: tuple(slots) for out, slots in dead.items()}
    returned = frozenset(root.get(slot, slot) for slot in outputs)  # the buffers a run hands out
    return placed, allocator.peak, fresh_bytes, arena_slots, dead_after, on_inputs, returned


def _view_layout(step: p.OpStep, source: layouts.Layout) -> layouts.Layout | None:
    """The layout of view step `step` of an input laid out as `source`, or None when it cannot
    be told or, for a reshape, when it must copy."""
    shape = tuple(step.shape)
    if step.op != "slice" and prod(source[0]) != prod(shape):
        return None
    if step.op == "transpose":
        got = layouts.transposed(source, step.params["axes"])
        return got if got[0] == shape else None
    if step.op == "slice":
        return (shape, source[1]) if len(shape) == len(source[0]) else None
    return layouts.reshaped(source, shape) if step.op == "reshape" else None


def _dying_input(step: p.OpStep, j: int, death: dict, own: dict, size: int) -> int | None:
    """An input of `step` whose arena buffer nothing reads after step j and that has the
    output's shape and dtype: the output may overwrite it."""
    for slot in step.inputs:
        held = own.get(slot)
        if held is not None and death[slot] == j and held[1:] == (size, tuple(step.shape), step.dtype):
            return slot
    return None


class _FirstFit:
    """Offsets for buffers with lifetimes: a new buffer goes into the lowest gap that fits among
    the buffers still alive; `peak` is the arena size the plan needs."""

    def __init__(self) -> None:
        self.live: list[tuple[int, int, int]] = []  # (offset, size, last step it is read)
        self.peak = 0

    def free_before(self, step: int) -> None:
        self.live = [b for b in self.live if b[2] >= step]

    def extend(self, offset: int, size: int, until: int) -> None:
        """The buffer of `size` bytes at `offset` passes to a value that lives until step `until`."""
        self.live = [(o, n, until if (o, n) == (offset, size) else u) for o, n, u in self.live]

    def take(self, size: int, until: int) -> int:
        if not size:  # an empty slice's: no bytes to keep apart from the others
            return 0
        at = 0
        for offset, length, _ in sorted(self.live):
            if offset - at >= size:
                break
            at = max(at, offset + length)
        self.live.append((at, size, until))
        self.peak = max(self.peak, at + size)
        return at
