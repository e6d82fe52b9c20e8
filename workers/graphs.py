"""Device graphs: a bound program's runs of kernels captured once and replayed every run (CUDA
graphs through CuPy's stream capture), piecewise as vLLM captures a model around its attention.

A program splits into pieces: a collective, a step whose result is a fresh array each run (a
result the run hands out, or what a collective sends; with an engine whose collectives a graph
can hold, NCCL's, only the former and collectives whose result is handed out), a kernel marked
`eager` (the shared attention over the used cache: how much it reads follows the
mask; the CUDA backend's reads the mask on the device and is eager only where the shared kernel
takes a step: a prompt over a long cache, a head dim its own kernels do not hold),
an op the backend never captures (`backend.uncaptured`: CuPy's cuBLAS products where the CUDA
backend has no cuBLAS handle of its own) and a kernel that reads device data on the host (found
when its capture fails) run eagerly; every run of other kernels between them is a segment. A
segment runs eagerly the first time, is captured the second and from then on replayed: one
launch instead of a call per kernel.

A graph replays on the memory it was captured on. So a segment keeps the arrays it read:
- an input that was the same array in the first two runs (a weight, a KV cache, a
  generation's fed tokens) is read in place; if it changes (a new generation's caches), the
  segment runs eagerly once and is captured again;
- an input that changed (a collective's result, a coordinator's new feed) is copied into a
  buffer of the segment before each replay (a few KiB in a decode step);
- its results lie in the arena (or are views of what it read), the same arrays every run, and
  are set in their slots on replay;
- what its kernels allocate while captured, and its buffers, come from a pool of its own: a
  graph writes its temporaries again at every replay, so no other segment's graph, buffer or
  result may ever be handed that memory (with one pool per program, a segment captured later
  was given a block another graph still wrote as a temporary: the cache position a decode step
  wrote at came back as a float's bits);
- after the capture its slots hold the inputs again, as after a replay: the kernels outside
  read what the program gave, never the segment's buffer.

A backend that can capture defines `begin_capture()`, `end_capture() -> graph`,
`launch(graph)` and `capture_pool()` (workers/backends/cuda/__init__.py); others run every call eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from transport import protocol as p
from workers.kernels.fused import reads, writes_in_place

WARMUP_SIGHTINGS = 2  # a segment is captured at its second run: the first tells what changes


def can_capture(backend) -> bool:
    return hasattr(backend, "begin_capture")


def piecewise(
    bound: list[tuple[Any, Callable, Any]],
    backend,
    kernels: dict,
    captured_moves: bool = False,
    returned: frozenset[int] = frozenset(),
) -> list[Callable]:
    """The program's calls with every run of capturable steps made one Segment (a kernel marked
    `eager` never is: its shapes follow the data; nor an op in `backend.uncaptured`).
    `captured_moves`: the collectives' engine can be captured (NCCL's): a collective, and a step
    whose result is fresh only because a collective sends it, join the segments; a step whose
    result the run hands out (`returned`: its buffer) stays outside, since a graph writes the
    same memory at every replay."""
    pieces: list[Callable] = []
    run: list[tuple[p.OpStep, Callable]] = []
    never = getattr(backend, "uncaptured", frozenset())
    for placed, call, _ in bound:
        step = placed.step
        if isinstance(step, p.MoveStep):
            # a move between groups of the workers (a layer split's) may run host-staged on a
            # group's own engine (workers/collectives.py): never inside a graph
            between_groups = step.src.on is not None and step.dst.on is not None
            eager = not captured_moves or step.output in returned or between_groups
        else:
            fresh = placed.out == "fresh" and (not captured_moves or step.output in returned)
            eager = fresh or step.op in never or runs_eagerly(kernels[step.op], step)
        if eager:
            if run:
                pieces.append(Segment(run, backend))
                run = []
            pieces.append(call)
        else:
            run.append((step, call))
    if run:
        pieces.append(Segment(run, backend))
    return pieces


def runs_eagerly(kernel, step) -> bool:
    """A kernel's `eager`: True, or a predicate over the step (a kernel eager for some shapes
    only: the CUDA backend's attention takes the steps of its own kernels in a graph, not others)."""
    eager = getattr(kernel, "eager", False)
    return bool(eager(step)) if callable(eager) else bool(eager)


class Segment:
    """Consecutive kernels, replayed as one graph once captured (the module docstring says when)."""

    def __init__(self, steps: list[tuple[p.OpStep, Callable]], backend):
        self.steps, self.backend = steps, backend
        self.pool: Callable | None = None  # its own, made at its first capture
        written: set[int] = set()
        external: list[int] = []
        for step, _ in steps:
            for slot in reads(step):
                if slot not in written and slot not in external:
                    external.append(slot)
            written.add(step.output)
        self.external = tuple(external)
        self.written = tuple(dict.fromkeys(step.output for step, _ in steps))
        # inputs a step writes in place (a KV cache's set_rows), each with its first such step: a
        # graph must write the real array, never a staged copy of it, so where one of them is
        # another array from run to run (one layer program serving every layer's caches) the
        # segment splits there and that step runs eagerly
        self.written_in_place: dict[int, int] = {}
        root: dict[int, int] = {}
        for k, (step, _) in enumerate(steps):
            if isinstance(step, p.OpStep) and writes_in_place(step.op):
                target = root.get(step.inputs[0], step.inputs[0])
                if target in self.external:
                    self.written_in_place.setdefault(target, k)
                root[step.output] = target
        self.calls = [call for _, call in steps]
        self.pieces: list[Callable] | None = None  # after a failed capture: the segment split
        self.refused: tuple[str, str] | None = None  # then: (the op run eagerly, why its capture failed)
        self.graph = None
        self.held: tuple = ()  # the arrays the graph reads in place (None: staged)
        self.staged: dict[int, Any] = {}  # input slot -> the segment's buffer copied into
        self.results: list[tuple[int, Any]] = []
        self.last_seen: tuple = ()
        self.sightings = 0
        self.captures = 0
        self.replays = 0

    def __call__(self, slots: list) -> None:
        if self.pieces is not None:
            for piece in self.pieces:
                piece(slots)
            return
        inputs = tuple(slots[s] for s in self.external)
        if self.graph is not None:
            if all(h is None or h is a for h, a in zip(self.held, inputs, strict=True)):
                self._replay(slots, inputs)
                return
            # an input read in place changed (a new generation's caches): learn again
            self.graph, self.last_seen, self.sightings = None, (), 0
        if self.last_seen:  # what changed since the last run is copied in from now on
            changed = [
                s for s, before, now in zip(self.external, self.last_seen, inputs, strict=True) if before is not now
            ]
            moved = [self.written_in_place[s] for s in changed if s in self.written_in_place]
            if moved:  # a destination of an in-place write changes: never staged (see __init__)
                self._split(min(moved))
                self(slots)
                return
            self.staged.update({s: None for s in changed if s not in self.staged})
        self.last_seen = inputs
        self.sightings += 1
        if self.sightings < WARMUP_SIGHTINGS:
            for call in self.calls:
                call(slots)
            return
        self._capture(slots, inputs)

    def _replay(self, slots: list, inputs: tuple) -> None:
        xp = self.backend.xp
        for slot, value in zip(self.external, inputs, strict=True):
            buffer = self.staged.get(slot)
            if buffer is not None:
                xp.copyto(buffer, value)
        for slot, value in self.results:
            slots[slot] = value
        self.backend.launch(self.graph)
        self.replays += 1

    def _capture(self, slots: list, inputs: tuple) -> None:
        xp = self.backend.xp
        if self.pool is None:
            self.pool = self.backend.capture_pool()
        for slot, value in zip(self.external, inputs, strict=True):
            if slot in self.staged:
                buffer = self.staged[slot]
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    with self.pool():
                        buffer = self.staged[slot] = xp.empty(value.shape, value.dtype)
                xp.copyto(buffer, value)  # before the capture: the graph reads the buffer
                slots[slot] = buffer
        self.backend.begin_capture()
        done = 0
        try:
            with self.pool():
                for call in self.calls:
                    call(slots)
                    done += 1
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured (or a real error: rerun below)
            with contextlib.suppress(Exception):
                self.backend.end_capture()
            self.pool = None  # what the abandoned capture allocated: no graph will write it
            self._split(done)
            self.refused = (self.steps[done][0].op, f"{type(exc).__name__}: {exc}"[:200])
            for slot, value in zip(self.external, inputs, strict=True):
                slots[slot] = value
            self(slots)  # eagerly, through the split pieces; a real error raises here
            return
        self.graph = self.backend.end_capture()
        self.captures += 1
        self.held = tuple(None if s in self.staged else a for s, a in zip(self.external, inputs, strict=True))
        self.results = [(slot, slots[slot]) for slot in self.written]
        for slot, value in zip(self.external, inputs, strict=True):
            slots[slot] = value
        self.backend.launch(self.graph)
        self.replays += 1

    def _split(self, at: int) -> None:
        """Step `at` could not be captured: it runs eagerly, the steps around it are segments."""
        before, after = self.steps[:at], self.steps[at + 1 :]
        pieces: list[Callable] = []
        if before:
            pieces.append(Segment(before, self.backend))
        pieces.append(self.steps[at][1])
        if after:
            pieces.append(Segment(after, self.backend))
        self.pieces = pieces


def refusals(pieces: list[Callable]) -> list[tuple[str, str]]:
    """(op, why) of every step among `pieces` whose capture failed, so that it runs eagerly at
    every run: on a GPU, what keeps a step from replaying as one graph."""
    found: list[tuple[str, str]] = []
    for piece in pieces:
        if isinstance(piece, Segment) and piece.pieces is not None:
            found += [piece.refused] if piece.refused is not None else []
            found += refusals(piece.pieces)
    return found


def segments(pieces: list[Callable]) -> list[Segment]:
    """Every Segment among `pieces`, those a failed capture split included."""
    found: list[Segment] = []
    for piece in pieces:
        if isinstance(piece, Segment):
            found += segments(piece.pieces) if piece.pieces is not None else [piece]
    return found


def per_run(pieces: list[Callable], steps: list) -> tuple[int, list[str]]:
    """(graphs a run of `pieces` launches once every segment is captured, the ops of `steps`
    (the program's, in order) it runs outside them): on a GPU, what a decode token costs beyond
    its kernels. A collective is "redistribute"."""
    found = segments(pieces)
    inside = {id(step) for segment in found for step, _ in segment.steps}
    outside = [s.op if isinstance(s, p.OpStep) else "redistribute" for s in steps if id(s) not in inside]
    return len(found), outside
