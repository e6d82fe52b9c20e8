"""Program execution on one worker: programs compiled at load (workers/program.py) over one
arena, run with their collectives."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from split_state.dtypes import dtype_from_name
from split_state.errors import OutOfMemory, ProtocolError
from transport import protocol as p
from workers import graphs
from workers.arena import Arena
from workers.collectives import Collectives
from workers.kernels import kernels_for
from workers.kernels.fused import UNFUSED_ENV, left_fused
from workers.program import CompiledProgram
from workers.store import TensorStore


class Executor:
    def __init__(self, backend, store: TensorStore, collective_timeout: float):
        self.backend = backend
        self.store = store
        self.collective_timeout = collective_timeout
        self.kernels = kernels_for(backend)
        # fused patterns applied to programs loaded from now on (all but those META_TP_UNFUSED names)
        self.patterns = left_fused(os.environ.get(UNFUSED_ENV, ""))
        self.arena = Arena(backend.xp, store)
        self.programs: dict[int, CompiledProgram] = {}
        self.collectives: Collectives | None = None
        self.comm = None
        self._kernels_ready = threading.Event()  # clear while prepare_kernels runs in the background
        self._kernels_ready.set()
        # a worker process sets this: a loaded program's thousands of objects live until it is
        # unloaded, and leaving them to the garbage collector's full passes cost a load 30-50 ms
        # whenever one came due (measured on SmolLM2's prefill steps). Frozen after a load, they
        # are unfrozen at an unload, so the next full pass collects what was unloaded
        self.freeze_programs = False
        self.driven: int | None = None  # the program of the last generation the workers drove (its decode step)

    @property
    def kernels_prepared(self) -> bool:
        """False while prepare_kernels runs in the background."""
        return self._kernels_ready.is_set()

    @kernels_prepared.setter
    def kernels_prepared(self, ready: bool) -> None:
        (self._kernels_ready.set if ready else self._kernels_ready.clear)()

    def await_kernels(self, seconds: float) -> bool:
        """Wait up to `seconds` for prepare_kernels to end; whether it has."""
        return self._kernels_ready.wait(seconds)

    def prepare_kernels(self) -> None:
        """Compile every kernel that compiles (numba loops) ahead of the first program using it."""
        try:
            for kernel in self.kernels.values():
                prepare = getattr(kernel, "prepare", None)
                if prepare is not None:
                    try:
                        prepare()
                    except Exception:  # noqa: BLE001 - loading the program that needs it reports it
                        return
        finally:
            self.kernels_prepared = True

    def attach(self, comm) -> None:
        self.comm = comm
        self.collectives = Collectives(comm.engine(self.backend))

    def _writes_into(self, step: p.MoveStep) -> bool:
        c = self.collectives
        return c is not None and c.writes_into(c.request(step.src, step.dst, step.shape, dtype_from_name(step.dtype)))

    def load(self, program: int, steps: list[p.Step], outputs: list[int] = ()) -> None:
        """Compile, plan memory and charge it: OutOfMemory here, before any step of it runs."""
        world = (self.comm.size, self.comm.rank) if self.comm is not None else None
        compiled = CompiledProgram(program, steps, list(outputs), self.kernels, world, self.patterns, self._writes_into)
        others = [c for pid, c in self.programs.items() if pid != program]
        store = self.store
        if store.used + max(store.arena, compiled.arena_bytes) + compiled.fresh_bytes > store.budget:
            raise OutOfMemory(
                f"{compiled.describe_peak()}: the program needs a {compiled.arena_bytes}-byte arena and "
                f"{compiled.fresh_bytes} bytes of results and collectives beside {store.used} stored, over a "
                f"{store.budget}-byte budget; free tensors, raise the budget or run smaller steps"
            )
        self.arena.resize(max([compiled.arena_bytes] + [c.arena_bytes for c in others]))
        if self.collectives is not None:  # bound now, not at its first run (a warm-up loads ahead)
            compiled.bind(self.arena, self.collectives, self.backend, self.collective_timeout)
        self.programs[program] = compiled
        if self.freeze_programs:
            gc.freeze()

    def graph_counts(self) -> dict:
        """Device graphs of the loaded programs: segments, captures and replays so far, and the
        steps run eagerly because their capture failed (`eager`: how many; `refused`: each op
        once, with why), the bytes the segments' own pools hold (`pool_bytes`), and for each
        program the graphs one run launches and the ops it runs outside them (`per_run`), and which
        program is the decode step of the last generation the workers drove (`driven`: a reader
        cannot tell it by its replays, which a prefill's one-layer program, run once a layer,
        outnumbers on a deep model)."""
        found = [s for c in self.programs.values() for s in graphs.segments(c.calls)]
        # per program where graphs replay: the graphs a run launches, the steps it runs outside
        # them, and its segments' replays so far (`driven` says which is the decode step)
        runs = {
            program: (
                *graphs.per_run(c.calls, [placed.step for placed, _, _ in c.dropping]),
                sum(s.replays for s in graphs.segments(c.calls)),
            )
            for program, c in self.programs.items()
            if graphs.can_capture(self.backend)
        }
        refused = [r for c in self.programs.values() for r in graphs.refusals(c.calls)]
        return {
            "segments": len(found),
            "captures": sum(s.captures for s in found),
            "replays": sum(s.replays for s in found),
            "eager": len(refused),
            "refused": dict(reversed(refused)),  # an op's first reason
            "pool_bytes": sum(s.pool.total_bytes() for s in found if s.pool is not None),
            "driven": None if self.driven is None else str(self.driven),
            "per_run": {
                str(program): {"graphs": n, "outside": ops, "replays": replays}
                for program, (n, ops, replays) in runs.items()
            },
        }

    @contextlib.contextmanager
    def _telling_peers(self, run: int) -> Iterator[None]:
        """A failure here ends run `run` on every peer at once (an Abort), not at their deadline."""
        try:
            yield
        except Exception as exc:
            self.comm.abort(run, type(exc).__name__, str(exc))
            raise

    def unload(self, program: int) -> None:
        if self.programs.pop(program, None) is not None:
            if self.freeze_programs:
                gc.unfreeze()
            self.arena.resize(max([c.arena_bytes for c in self.programs.values()], default=0))

    def free(self, tensors) -> None:
        """Free stored tensors, and any view a program kept of them (workers/program.py): one
        pass over the kept views for all of them (a replayed step frees a few every run)."""
        freed = {}
        for tensor in tensors:
            array = self.store.tensors.get(tensor)
            self.store.free(tensor)
            if array is not None:
                freed[id(array)] = array  # held until the pass is done: the ids stay theirs
        if freed:
            for compiled in self.programs.values():
                compiled.forget(freed)

    def input_slots(self, program: int, inputs: list[list[int]]) -> list:
        """The program's slot list with its inputs filled from the store."""
        compiled = self.programs.get(program)
        if compiled is None:
            raise ProtocolError(f"program {program} is not loaded on this worker")
        slots: list = [None] * compiled.nslots
        for slot, tensor in inputs:
            if not 0 <= slot < compiled.nslots:
                raise ProtocolError(f"program {program} has no input slot {slot}")
            slots[slot] = self.store.get(tensor)
        return slots

    def run(
        self,
        program: int,
        run: int,
        inputs: list[list[int]],
        outputs: list[list[int]],
        profile: bool = False,
        read: Sequence[int] = (),
        same_data: bool = False,
    ) -> dict[str, Any]:
        """Run `program` once; `read`: output tensors the caller will read back, checked to be
        outputs before anything runs; `same_data`: see CompiledProgram.run."""
        return self.repeated(program, run, inputs, outputs, profile, read, same_data=same_data)(run)

    def repeated(
        self,
        program: int,
        first_run: int,
        inputs: list[list[int]],
        outputs: list[list[int]],
        profile: bool = False,
        read: Sequence[int] = (),
        runs: int = 0,
        same_data: bool = False,
    ) -> Callable[[int], dict[str, Any]]:
        """A function running `program` under a given run id, as often as the caller likes over
        the same stored inputs (a generation's steps write their fed tensors in place):
        checked and bound once, from `first_run` on. What stays the same from run to
        run is worked out once: the outputs a run writes in place (a decode step's ~60 KV
        caches of its 62) are known after the first and not looked at again, ~70 us a token.
        `runs`: how many times the caller means to run it (a Generate's steps), which counts
        towards writing the program out as one function (workers/straight.py)."""
        # a request for a program this worker never loaded is not a run of the cluster's (its
        # run id may be a later real run's): refused here without aborting that run on the peers
        compiled = self.programs.get(program)
        if compiled is None:
            raise ProtocolError(f"program {program} is not loaded on this worker")
        if self.collectives is None:
            raise ProtocolError("worker is not configured: no peers yet")
        store, backend, comm = self.store, self.backend, self.comm
        with self._telling_peers(first_run):  # else they would wait for this worker until their deadline
            if read and not set(read) <= {tensor for _, tensor in outputs}:
                raise ProtocolError(f"run {first_run} reads tensors {sorted(set(read))}, not all among its outputs")
            if compiled.bound_to != (self.arena.generation, id(self.collectives)):
                compiled.bind(self.arena, self.collectives, self.backend, self.collective_timeout)
            compiled.expect(runs)
            filled = self.input_slots(program, inputs)
        if runs:
            self.driven = program
        fresh = compiled.fresh_bytes

        def peak() -> str:
            return compiled.describe_peak() + " (results and collectives)"

        undeclared = any(slot not in compiled.outputs for slot, _ in outputs)  # declared ones are never renamed
        # (tensor, slot, whether the value lies in the arena: the next run overwrites it)
        made = [(t, s, s in compiled.arena_slots) for t, s in ((t, compiled.renamed.get(s, s)) for s, t in outputs)]
        stored = store.tensors

        def step(run: int, wait: bool = True) -> dict[str, Any]:
            """`wait=False`: returns once the run's work is issued (program.run's `wait`)."""
            waited = comm.waited
            slots = list(filled)
            with self._telling_peers(run):
                store.reserve(fresh, peak)  # what the run makes, until the results are stored
                try:
                    timings = compiled.run(
                        slots, run, backend, profile, keep=undeclared, same_data=same_data, wait=wait
                    )
                    results = [(t, slots[s].copy() if copy else slots[s]) for t, s, copy in made]
                finally:
                    store.release(fresh)
            timings["wait_s"] = comm.waited - waited  # part of comm_s spent blocked on peers
            stays = []
            for (tensor, value), output in zip(results, made):
                # an in-place result (a KV cache) is stored already, and is the same array at
                # every run (the input slots are): not looked at again
                if stored.get(tensor) is not value:
                    store.put(tensor, value)
                    stays.append(output)
            made[:] = stays
            return timings

        return step
