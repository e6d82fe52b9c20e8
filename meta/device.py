"""The MetaDevice: N workers presented as one device.

Its jobs, each in a module of its own: placing tensors and reading them back
(meta/placement.py, a mixin), capturing, replaying and chaining steps (meta/steps.py, a mixin),
a generation the workers drive (meta/generation.py), the workers' errors as our exceptions
(meta/remote_errors.py), one call at a time and the coordinator's clock (meta/serialized.py).
Here: the device's state, running a graph (plan cache, compile and load, execute, read back)
and the calls to the workers that every job goes through (`_call`).

dev = MetaDevice(cluster)                      # a ProcessCluster or a SimulatedCluster
w = dev.tensor(weights, Split.even(1, 4096, dev.n))
y = (dev.tensor(x) @ w).gelu()                  # lazy
y.numpy()                                       # plans, compiles (cached), runs, gathers
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import numpy as np

from meta.compiler import compile_plan, structural_key
from meta.generation import Generating
from meta.graph import Node, last_writes, topo_order, written_into
from meta.ledger import Ledger
from meta.placement import Placement, Policy
from meta.planner import Plan, plan
from meta.remote_errors import exception_from
from meta.serialized import Clock, serialized
from meta.steps import Capturing, Earlier, Step, slot_pairs
from meta.tensor import Tensor
from split_state import errors
from split_state.scatter import gather
from split_state.states import Mirrored, State, holders
from transport import protocol as p

__all__ = ["Clock", "CompiledPlan", "Earlier", "MetaDevice", "Step"]


@dataclass(frozen=True)
class CompiledPlan:
    program: int
    plan: Plan


class MetaDevice(Placement, Capturing, Generating):
    def __init__(
        self,
        cluster: Any,
        policy: Policy | None = None,
        debug: bool = False,
        trace_to: TextIO | None = None,
        check_mirrored: bool = False,
        max_plans: int = 128,
    ):
        self.cluster = cluster
        self.n = cluster.world_size
        self.policy = policy
        self.debug = debug
        self.trace_to = trace_to or sys.stderr
        self.check_mirrored = check_mirrored
        self._tensor_ids = itertools.count(1)
        self._program_ids = itertools.count(1)
        # compiled plans by structure, least recently used first; past max_plans the oldest is
        # evicted and unloaded from every worker, so shapes that change every step cannot leak
        self.plans: OrderedDict[tuple, CompiledPlan] = OrderedDict()
        self.max_plans = max_plans
        self.last_plan: Plan | None = None
        self.last_timings: dict[int, dict] = {}
        # workers time every step of every run (compute_s); off, they run untimed between
        # collectives. Benchmarks switch it on for their breakdowns and measure what it costs.
        self.profile = False
        self.ledger = Ledger()  # tensors to free, pinned programs, run ids (meta/ledger.py)
        self._feeds: dict[int, np.ndarray] = {}  # fed tensors not yet sent: they go with the next run
        self._lock = threading.RLock()
        self._depth = 0
        self.clock = Clock()
        # the workers' data plane: the planner charges the collective algorithms that run there
        planes = {info.get("data_plane", "") for info in getattr(cluster, "data_planes", ())}
        self.plane = planes.pop() if len(planes) == 1 else ""

    # -- running --------------------------------------------------------------------------------

    @serialized
    def run(self, *tensors: Tensor) -> None:
        """Make `tensors` resident: plan (cached by structure), load once, run on every worker."""
        self._run_nodes([t.node for t in tensors if not t.node.resident])

    def _run_nodes(self, outputs: list[Node]) -> tuple[CompiledPlan, list[Node], list[Node | None]] | None:
        planned = self._planned(outputs)
        if planned is None:
            return None
        compiled, leaves, outputs, order = planned
        writes = last_writes(order)  # before the outputs lose their recipes
        roots = [written_into(node) for node in outputs]  # in-place writes keep their destination's id
        out_ids = [root.tensor if root is not None else next(self._tensor_ids) for root in roots]
        fed = {leaf.tensor: self._feeds[leaf.tensor] for leaf in leaves if leaf.tensor in self._feeds}
        fresh = [t for root, t in zip(roots, out_ids) if root is None]
        self._execute(compiled, [leaf.tensor for leaf in leaves], out_ids, fed, fresh)
        for tensor in fed:  # on the workers now
            del self._feeds[tensor]
        for node, root, tensor, state in zip(outputs, roots, out_ids, compiled.plan.out_states):
            if root is None:
                self._resident(node, tensor, state)
            else:  # the destination's storage, under its id: it lives as long as either handle
                node.tensor, node.state, node.alias = tensor, state, root
                root.host = None  # written in place: a value read before is out of date
            node.op, node.inputs = "", ()  # resident now: the recipe (and its inputs) can go
        for node, root in writes.items():
            if not node.resident:  # what its destination holds now: never run again
                node.tensor, node.state, node.alias, node.op, node.inputs = root.tensor, root.state, root, "", ()
                root.host = None
        return compiled, leaves, roots

    def _planned(self, outputs: list[Node]) -> tuple[CompiledPlan, list[Node], list[Node], list[Node]] | None:
        """The compiled (loaded) plan computing `outputs` (cached by structure), its leaves, the
        outputs without repeats and the nodes it computes; None when there is nothing to compute."""
        outputs = list({id(n): n for n in outputs}.values())
        if not outputs:
            return None
        leaves, order = topo_order(outputs)
        for node in order:
            if node.freed:
                raise errors.FreedTensor(
                    f"tensor {node.name or ''} of shape {node.shape} was freed; keep the handle (or recompute it) "
                    "before reading or using it"
                )
        key = structural_key(leaves, order, outputs)
        compiled = self.plans.get(key)
        if compiled is None:
            compiled = self._compile(leaves, order, outputs)
            self.plans[key] = compiled
            self._evict()
        else:
            self.plans.move_to_end(key)
        self.last_plan = compiled.plan
        if self.debug:
            print("\n".join(compiled.plan.trace), file=self.trace_to)
        return compiled, leaves, outputs, order

    def _execute(
        self,
        compiled: CompiledPlan,
        inputs: list[int],
        out_ids: list[int],
        fed: dict,
        fresh,
        read: Sequence[int] = (),
    ) -> dict[int, np.ndarray]:
        """One RunProgram on every worker: `inputs` by slot, results stored as `out_ids`. If the
        run outlives its deadline, its `fresh` outputs are released with the next run (a worker
        serves in order: by then it has stored them). `read`: indices of outputs whose global
        values come back in the run's replies (no Get of their own): returned by tensor id."""
        released = self.ledger.take()
        feeds, data = p.pack_arrays(fed)
        message = p.RunProgram(
            compiled.program,
            self.ledger.next_run(),
            slot_pairs(range(len(inputs)), inputs),
            slot_pairs(compiled.plan.outputs, out_ids),
            released,
            feeds,
            data,
            int(self.profile),
        )
        states = {out_ids[j]: compiled.plan.out_states[j] for j in read}
        try:
            replies = self._call({d: replace(message, read=self._asked(states, d)) for d in range(self.n)})
        except errors.DeadlineExceeded:
            self.ledger.release(fresh)
            raise
        self.last_timings = {d: dict(r.info) for d, r in replies.items()}
        return self._read_back(replies, states)

    def _asked(self, states: dict[int, State], d: int) -> list[int]:
        """The tensors (of `states`: id -> state) whose values worker d sends back with a run."""
        return [t for t, state in states.items() if not self._one_copy(state) or d == self._reader(state)]

    def _read_back(self, replies: dict[int, p.Message], states: dict[int, State]) -> dict[int, np.ndarray]:
        """The global values of the tensors read back with a run (`states`: id -> state), by id."""
        if not states:
            return {}
        got = {
            d: {v.tensor: p.unpack_array(v, r.data) for v in r.values}
            for d, r in replies.items()
            if self._asked(states, d)
        }
        values = {}
        for t, state in states.items():
            if self._one_copy(state):
                values[t] = got[self._reader(state)][t]
            else:
                values[t] = gather([got[d][t] for d in range(self.n)], state, check_mirrored=self.check_mirrored)
        return values

    def _one_copy(self, state: State) -> bool:
        """Whether one worker's copy is the value: the only one's, or a Mirrored one's (unless
        mirrored copies are checked)."""
        return self.n == 1 or (isinstance(state, Mirrored) and not self.check_mirrored)

    def _reader(self, state: State) -> int:
        """The worker whose copy of a `_one_copy` state is read: its group's first."""
        return holders(state, self.n)[0]

    def _evict(self) -> None:
        evicted = []
        for key in list(self.plans):
            if len(self.plans) <= self.max_plans:
                break
            if not self.ledger.pinned(self.plans[key].program):  # captured steps keep theirs
                evicted.append(self.plans.pop(key).program)
        if evicted:
            self._call({d: p.Unload(evicted) for d in range(self.n)})

    def _compile(self, leaves: list[Node], order: list[Node], outputs: list[Node]) -> CompiledPlan:
        planned = plan(leaves, order, outputs, self.n, self.plane)
        programs = compile_plan(planned, self.n)
        program = next(self._program_ids)
        outputs = list(planned.outputs)
        try:
            self._call({d: p.LoadProgram(program, programs[d], outputs) for d in range(self.n)})
        except errors.MetaError:
            # a worker that refused it (OutOfMemory at load): the others forget it too
            with contextlib.suppress(errors.MetaError):
                self._call({d: p.Unload([program]) for d in range(self.n)})
            raise
        return CompiledPlan(program, planned)

    def _call(self, messages: dict[int, p.Message], on_message=None, watch=None) -> dict[int, p.Message]:
        start = time.perf_counter()
        try:
            if on_message is None:
                replies = self.cluster.call_all(messages)
            else:
                replies = self.cluster.call_all(messages, on_message=on_message, watch=watch)
        finally:
            self.clock.round_trip_s += time.perf_counter() - start
        failures = {d: r for d, r in replies.items() if isinstance(r, p.Error)}
        if failures:
            if any(isinstance(m, (p.RunProgram, p.RunChain, p.Generate)) for m in messages.values()):
                self._resync()
            raise exception_from(failures)
        return replies

    def _resync(self) -> None:
        """After a failed run every worker brings its data plane back to the state all share
        (the CUDA IPC plane's operation counts differ when one rank failed before a collective
        that its peers began). If that fails too, the next run says so; the run's own error is
        the one raised."""
        message = p.Resync(self.ledger.next_run())  # one run id for all: it tags their exchange
        with contextlib.suppress(errors.MetaError):
            self.cluster.call_all({d: message for d in range(self.n)})

    # -- lifetime -------------------------------------------------------------------------------

    def health(self) -> str:
        """Why the cluster cannot serve ("" while it can), asked without a call and without the
        device's lock (a server's /health asks it while a step runs; see ProcessCluster.health);
        an in-process simulator always can."""
        check = getattr(self.cluster, "health", None)
        return check() if check is not None else ""

    @serialized
    def stats(self) -> dict[int, dict]:
        self.collect()
        return {d: dict(r.info) for d, r in self._call({d: p.Stats() for d in range(self.n)}).items()}

    def close(self) -> None:
        self.cluster.close()

    def __enter__(self) -> MetaDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
