"""Program execution on one worker: local kernels, collective steps, frees of dead slots."""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import prod
from typing import Any

from split_state.algorithms import Request
from split_state.dtypes import dtype_from_name
from split_state.errors import ProtocolError, ShapeError
from split_state.kernels import KERNELS
from split_state.layout import local_shape
from split_state.ops import OPS
from transport import protocol as p
from transport.deadline import Deadline
from workers.collectives import Collectives, HostEngine
from workers.store import TensorStore


@dataclass(frozen=True)
class Move:
    """A program's collective step as this worker runs it."""

    request: Request
    dtype: Any  # what the step's input must hold
    nbytes: int  # of this worker's result


class Executor:
    def __init__(self, backend, store: TensorStore, collective_timeout: float):
        self.backend = backend
        self.store = store
        self.collective_timeout = collective_timeout
        self.programs: dict[int, list[p.Step]] = {}
        self.moves: dict[int, list[Move | None]] = {}  # per program, each step's prepared collective
        self.collectives: Collectives | None = None

    def attach(self, comm) -> None:
        self.comm = comm
        self.moves = {}  # prepared for the previous peers
        if comm.plane == "nccl":
            from workers.nccl import NcclEngine

            self.collectives = Collectives(NcclEngine(comm, self.backend))
        else:
            self.collectives = Collectives(HostEngine(comm, self.backend))

    def load(self, program: int, steps: list[p.Step]) -> None:
        for i, step in enumerate(steps):
            if isinstance(step, p.OpStep) and step.op not in KERNELS:
                raise ProtocolError(f"program {program} step {i}: unknown op {step.op!r}")
        self.programs[program] = steps
        self.moves.pop(program, None)

    def unload(self, program: int) -> None:
        self.programs.pop(program, None)
        self.moves.pop(program, None)

    def _prepare(self, program: int) -> list[Move | None]:
        """Each collective step's request and the bytes of its result on this worker, worked out
        at the program's first run, not at every run (a decode step runs the same plan per token)."""
        n, rank = self.comm.size, self.comm.rank
        moves: list[Move | None] = []
        for step in self.programs[program]:
            if isinstance(step, p.MoveStep):
                dtype = dtype_from_name(step.dtype)
                nbytes = prod(local_shape(step.dst, step.shape, n, rank)) * dtype.itemsize
                moves.append(Move(self.collectives.request(step.src, step.dst, step.shape, dtype), dtype, nbytes))
            else:
                moves.append(None)
        self.moves[program] = moves
        return moves

    def run(self, program: int, run: int, inputs: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
        if program not in self.programs:
            raise ProtocolError(f"program {program} is not loaded on this worker")
        if self.collectives is None:
            raise ProtocolError("worker is not configured: no peers yet")
        slots = {slot: self.store.get(tensor) for slot, tensor in inputs}
        owned: dict[int, int] = {}  # slots this run allocated -> bytes
        timings = {"compute_s": 0.0, "comm_s": 0.0}
        started = time.perf_counter()
        waited = self.comm.waited
        try:
            moves = self.moves.get(program) or self._prepare(program)
            for index, step in enumerate(self.programs[program]):
                self._step(index, step, moves[index], slots, owned, run, timings)
            self.backend.synchronize()
            results = {tensor: slots[slot] for slot, tensor in outputs}
            timings["wait_s"] = self.comm.waited - waited  # part of comm_s spent blocked on peers
            timings["program_s"] = time.perf_counter() - started  # the rest is the executor's own
        except BaseException as exc:
            self._release(owned)
            if isinstance(exc, Exception):
                self.comm.abort(run, type(exc).__name__, str(exc))
            raise
        self._release(owned)
        for tensor, array in results.items():
            self.store.put(tensor, array)
        return timings

    def _release(self, owned: dict[int, int]) -> None:
        self.store.release(sum(owned.values()))
        owned.clear()

    def _step(self, index: int, step: p.Step, move: Move | None, slots: dict, owned: dict, run: int, timings: dict):
        if isinstance(step, p.FreeStep):
            for slot in step.slots:
                slots.pop(slot, None)
                self.store.release(owned.pop(slot, 0))
            return
        start = time.perf_counter()
        if move is not None:
            local = slots[step.input]
            if local.dtype != move.dtype:
                raise ShapeError(
                    f"step {index} (redistribute): slot {step.input} holds {local.dtype}, not {step.dtype}"
                )
            self.store.reserve(move.nbytes, lambda: f"step {index} (redistribute {step.src} -> {step.dst})")
            owned[step.output] = move.nbytes
            deadline = Deadline(self.collective_timeout)
            slots[step.output] = self.collectives.run(move.request, local, run, index, deadline)
            timings["comm_s"] += time.perf_counter() - start
            return
        dtype = dtype_from_name(step.dtype)
        if OPS[step.op].inplace:  # writes into its first input: that memory changes hands
            owned[step.output] = owned.pop(step.inputs[0], 0)
        else:
            nbytes = prod(step.shape) * dtype.itemsize
            self.store.reserve(nbytes, lambda: f"step {index} ({step.op})")
            owned[step.output] = nbytes
        out = KERNELS[step.op](self.backend.xp, [slots[s] for s in step.inputs], step.params)
        if tuple(out.shape) != tuple(step.shape) or out.dtype != dtype:
            raise ShapeError(
                f"step {index} ({step.op}) produced {tuple(out.shape)} {out.dtype}, "
                f"the plan expects {tuple(step.shape)} {step.dtype}"
            )
        timings["compute_s"] += time.perf_counter() - start
        slots[step.output] = out
