"""The MetaDevice: N workers presented as one device.

dev = MetaDevice(cluster)                      # a ProcessCluster or a SimulatedCluster
w = dev.tensor(weights, Split.even(1, 4096, dev.n))
y = (dev.tensor(x) @ w).gelu()                  # lazy
y.numpy()                                       # plans, compiles (cached), runs, gathers
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import numpy as np

from meta.compiler import compile_plan, structural_key
from meta.graph import Node, topo_order
from meta.planner import Plan, plan
from meta.tensor import Tensor
from split_state import errors
from split_state.dtypes import dtype_from_name, dtype_name
from split_state.errors import MetaError, RemoteError, ShapeError
from split_state.layout import Piece, local_shape, pieces
from split_state.ops import OPS
from split_state.scatter import extract, gather
from split_state.states import MIRRORED, State, validate
from transport import protocol as p
from transport.board import TokenBoard
from transport.board import supported as board_supported
from transport.replies import Watch

Policy = Callable[[str, tuple[int, ...]], State | None]
PLACE_BYTES = 16 << 20  # slices of one tensor held for one Put message at most (more: sent device by device)

# error kinds a worker reports that map back onto our own exception types
_TYPED = {
    name: getattr(errors, name)
    for name in (
        "SplitError",
        "ShapeError",
        "UnsupportedDtype",
        "ProtocolError",
        "OutOfMemory",
        "WorkerLost",
        "DeadlineExceeded",
        "ConsistencyError",
        "TransportError",
    )
}


def serialized(method):
    """One call at a time per MetaDevice: threads that share one take turns (the workers serve
    one request at a time, and plans, ids and feeds are the device's own state)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            if self._depth:  # a call inside another: the outer one is timing
                return method(self, *args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._depth -= 1
                self.clock.inside_s += time.perf_counter() - start

    return locked


@dataclass
class Clock:
    """Where the coordinator's time went since `reset`: inside the device's methods, and of
    that, waiting for the workers' replies (round trips); the rest is its own work (graphs,
    plans, messages). Benchmarks read it to account for a step's wall time."""

    inside_s: float = 0.0
    round_trip_s: float = 0.0

    @property
    def coordinator_s(self) -> float:
        return self.inside_s - self.round_trip_s

    def reset(self) -> None:
        self.inside_s = self.round_trip_s = 0.0


@dataclass(frozen=True)
class CompiledPlan:
    program: int
    plan: Plan


class MetaDevice:
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
        self._run_ids = itertools.count(1)
        # compiled plans by structure, least recently used first; past max_plans the oldest is
        # evicted and unloaded from every worker, so shapes that change every step cannot leak
        self.plans: OrderedDict[tuple, CompiledPlan] = OrderedDict()
        self.max_plans = max_plans
        self.last_plan: Plan | None = None
        self.last_timings: dict[int, dict] = {}
        # workers time every step of every run (compute_s); off, they run untimed between
        # collectives. Benchmarks switch it on for their breakdowns and measure what it costs.
        self.profile = False
        self._released: list[int] = []  # resident tensors whose handles were collected
        self._feeds: dict[int, np.ndarray] = {}  # fed tensors not yet sent: they go with the next run
        self._pinned: set[int] = set()  # programs of captured steps: never evicted while they live
        self._lock = threading.RLock()
        self._depth = 0
        self.clock = Clock()
        # the workers' data plane: the planner charges the collective algorithms that run there
        planes = {info.get("data_plane", "") for info in getattr(cluster, "data_planes", ())}
        self.plane = planes.pop() if len(planes) == 1 else ""

    # -- placement ------------------------------------------------------------------------------

    @serialized
    def tensor(self, array: Any, state: State | None = None, name: str = "") -> Tensor:
        """A resident tensor from a host array: each worker receives only its slice."""
        array = np.asarray(array)
        dtype = dtype_name(array.dtype)
        state = self._placement(name, array.shape, state)
        return self._place(
            name,
            array.shape,
            dtype,
            state,
            lambda d: extract(array, state, self.n, d),
        )

    @serialized
    def from_generator(
        self,
        shape: Sequence[int],
        dtype: Any,
        state: State | None,
        make: Callable[[int, tuple[Piece, ...]], np.ndarray],
        name: str = "",
    ) -> Tensor:
        """A resident tensor built per device: `make(device, pieces)` returns that device's local
        array, so a large weight never exists whole on the host."""
        shape = tuple(int(s) for s in shape)
        state = self._placement(name, shape, state)
        return self._place(
            name, shape, dtype_name(dtype), state, lambda d: np.asarray(make(d, pieces(state, shape, self.n, d)))
        )

    @serialized
    def feed(self, array: Any, name: str = "") -> Tensor:
        """A small Mirrored input (token ids, positions) that travels inside the next run's message
        instead of a placement round trip of its own; its value is known here, so reading it
        costs nothing."""
        array = np.array(array, copy=True)
        dtype = dtype_name(array.dtype)
        tensor = next(self._tensor_ids)
        self._feeds[tensor] = array
        node = self._resident(Node("", (), {}, tuple(array.shape), dtype, name), tensor, MIRRORED)
        return Tensor(self, node)

    def placeholder(self, shape: Sequence[int], dtype: Any, state: State, name: str = "") -> Tensor:
        """A stand-in for prepare(): a tensor of this shape, dtype and state that holds nothing
        on the workers. A step prepared over it is called with a real one in its place (the
        output of another step, say); a run that reads the placeholder itself fails on the
        workers (the tensor is not stored)."""
        shape = tuple(int(s) for s in shape)
        validate(state, shape, self.n, name=name or "placeholder")
        node = Node("", (), {}, shape, dtype_name(np.dtype(dtype)), name or "placeholder")
        node.tensor, node.state = next(self._tensor_ids), state  # nothing stored: nothing to release
        return Tensor(self, node)

    def _placement(self, name: str, shape: tuple[int, ...], state: State | None) -> State:
        if state is None and self.policy is not None:
            state = self.policy(name, tuple(shape))
        state = MIRRORED if state is None else state
        validate(state, shape, self.n, name=name or "tensor")
        return state

    def _place(self, name, shape, dtype, state, local) -> Tensor:
        tensor = next(self._tensor_ids)
        messages = {}
        try:
            for d in range(self.n):
                array = local(d)
                expected = local_shape(state, shape, self.n, d)
                if tuple(array.shape) != expected or dtype_name(array.dtype) != dtype:
                    raise errors.SplitError(
                        f"{name or 'tensor'}: device {d} local array is {array.shape} {array.dtype}, "
                        f"{state} of {shape} needs {expected} {dtype}"
                    )
                messages[d] = p.Put(tensor, state, tuple(shape), array)
                if sum(m.array.nbytes for m in messages.values()) >= PLACE_BYTES:
                    # a large weight goes a device at a time: its slices never all exist on this
                    # host at once (one slice, not a whole copy, beside the source)
                    self._call(messages)
                    messages = {}
            if messages:
                self._call(messages)
        except MetaError:
            with contextlib.suppress(MetaError):  # a lost cluster cannot free; the first error is the news
                self._free_ids([tensor])  # nothing half-placed stays behind
            raise
        return Tensor(self, self._resident(Node("", (), {}, tuple(shape), dtype, name), tensor, state))

    def _resident(self, node: Node, tensor: int, state: State) -> Node:
        """Mark `node` resident; when nothing references it any more its storage is released on
        the workers with the next run (no message of its own)."""
        node.tensor, node.state = tensor, state
        node.finalizer = weakref.finalize(node, self._released.append, tensor)
        return node

    # -- reading and freeing --------------------------------------------------------------------

    @serialized
    def get(self, t: Tensor) -> np.ndarray:
        """The global value as a host array, whatever the state (Partial is summed)."""
        self.run(t)
        node = t.node
        if node.tensor in self._feeds:
            return self._feeds[node.tensor].copy()
        if node.host is not None:  # read back with the run that made it
            return node.host.copy()
        if self._one_copy(node.state):
            return np.array(self._call({0: p.Get(node.tensor)})[0].array, copy=True)
        replies = self._call({d: p.Get(node.tensor) for d in range(self.n)})
        locals_ = [np.asarray(replies[d].array) for d in range(self.n)]
        return gather(locals_, node.state, check_mirrored=self.check_mirrored)

    @serialized
    def free(self, *tensors: Tensor) -> None:
        ids = [t.node.tensor for t in tensors if t.node.resident]
        for t in tensors:
            if t.node.finalizer is not None:
                t.node.finalizer.detach()
            t.node.tensor, t.node.state, t.node.finalizer = None, None, None
        self._free_ids(ids)

    @serialized
    def collect(self) -> None:
        """Release now the storage of tensors whose handles are gone (runs do it anyway)."""
        released, self._released[:] = list(self._released), []
        self._free_ids(released)

    def _free_ids(self, ids: list[int]) -> None:
        for tensor in ids:
            self._feeds.pop(tensor, None)
        if ids:
            self._call({d: p.Free(ids) for d in range(self.n)})

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
        writes = _last_writes(order)  # before the outputs lose their recipes
        roots = [_written(node) for node in outputs]  # in-place writes keep their destination's id
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
        released, self._released[:] = list(self._released), []
        feeds, data = p.pack_arrays(fed)
        message = p.RunProgram(
            compiled.program,
            next(self._run_ids),
            _slot_pairs(range(len(inputs)), inputs),
            _slot_pairs(compiled.plan.outputs, out_ids),
            released,
            feeds,
            data,
            int(self.profile),
        )
        states = {out_ids[j]: compiled.plan.out_states[j] for j in read}
        try:
            replies = self._call({d: replace(message, read=self._asked(states, d)) for d in range(self.n)})
        except errors.DeadlineExceeded:
            self._released.extend(fresh)
            raise
        self.last_timings = {d: dict(r.info) for d, r in replies.items()}
        return self._read_back(replies, states)

    def _asked(self, states: dict[int, State], d: int) -> list[int]:
        """The tensors (of `states`: id -> state) whose values worker d sends back with a run."""
        return [t for t, state in states.items() if d == 0 or not self._one_copy(state)]

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
                values[t] = got[0][t]
            else:
                values[t] = gather([got[d][t] for d in range(self.n)], state, check_mirrored=self.check_mirrored)
        return values

    def _one_copy(self, state: State) -> bool:
        """Whether any one worker's copy is the value: the only one's, or a Mirrored one's
        (unless mirrored copies are checked)."""
        return self.n == 1 or (state == MIRRORED and not self.check_mirrored)

    @serialized
    def capture(
        self, build: Callable[..., Sequence[Tensor]], *values: np.ndarray | Tensor
    ) -> tuple[Step, list[Tensor]]:
        """Run `build(*args)` with `values` as its arguments (a real step), and return it as a
        Step that replays the same compiled program with new values of the same shapes (no
        graph to build, plan or key on the coordinator; one message per worker), with this
        run's outputs. A host array is fed (its values travel with the run); a Tensor is passed
        as it is, and a replay may pass another of the same shape, dtype and state (a decoder
        layer's step run with each layer's weights and caches). In-place writes (a KV cache) go
        on in place at every replay, into the tensor passed where the step writes an argument."""
        args = self._arguments(values)
        outputs = list(build(*args))
        ran = self._run_nodes([t.node for t in outputs])
        if ran is None:
            raise ShapeError("capture: the graph has nothing to compute")
        compiled, leaves, roots = ran
        return Step(self, compiled, leaves, args, values, roots), outputs

    @serialized
    def prepare(self, build: Callable[..., Sequence[Tensor]], *values: np.ndarray | Tensor) -> Step:
        """The Step capture() would return, planned, compiled and loaded on every worker, but
        not run: nothing is computed or written, and the graph `build` made is dropped (handles
        it changed, a model's caches, are the caller's to put back). Its first call runs it,
        as any later one: what llama.cpp's warm-up run and vLLM's start-up capture save the
        first request (~50 ms of a SmolLM2 prefill step's planning and loading). A host array
        stands for any value of its shape and dtype, fed or passed Mirrored."""
        args = self._arguments(values)
        try:
            outputs = list(build(*args))
            planned = self._planned([t.node for t in outputs])
        finally:
            for arg, value in zip(args, values):  # nothing runs: they are not sent
                if not isinstance(value, Tensor):
                    self._feeds.pop(arg.node.tensor, None)
        if planned is None:
            raise ShapeError("prepare: the graph has nothing to compute")
        compiled, leaves, nodes, _ = planned
        return Step(self, compiled, leaves, args, values, [_written(node) for node in nodes])

    def _arguments(self, values: Sequence[np.ndarray | Tensor]) -> list[Tensor]:
        """A step's arguments: host arrays fed, Tensors resident (computed now if they are not:
        a step's argument is an input of its program, not part of it)."""
        self._realize(values)
        args = []
        for value in values:
            if isinstance(value, Tensor):
                if value.device is not self:
                    raise ShapeError("a step's argument is a tensor of another device")
                args.append(value)
            else:
                args.append(self.feed(value))
        return args

    def _realize(self, values: Sequence[Any]) -> None:
        """Compute the tensors among `values` that are not resident yet, in one run (a model's
        caches with writes still pending): a step's arguments are its program's inputs."""
        lazy = [v.node for v in values if isinstance(v, Tensor) and v.node.tensor is None and v.device is self]
        if lazy:
            self._run_nodes(lazy)

    def _bind(self, step: Step, values: Sequence[np.ndarray | Tensor]) -> _Bound:
        """A run of captured `step` with these arguments: its input tensor ids (fresh ids for
        fed arrays; a Tensor's own), what travels with it, its output ids (in-place results
        keep their tensor's: the argument's, where the step writes one) and which are new."""
        if len(values) != len(step.specs):
            raise ShapeError(f"captured step takes {len(step.specs)} arguments, got {len(values)}")
        inputs = list(step.leaf_ids)
        fed: dict[int, np.ndarray] = {}
        sent: dict[int, np.ndarray] = {}
        passed: dict[int, Tensor] = {}
        feeds = self._feeds
        for k, (slot, (shape, dtype, state, name), value) in enumerate(zip(step.feed_slots, step.specs, values)):
            if isinstance(value, Tensor):
                node = value.node
                if value.device is not self or node.tensor is None:
                    raise ShapeError(f"captured step: argument {k} must be a resident tensor of this device")
                if node.shape != shape or node.dtype != name or (node.state is not state and node.state != state):
                    raise ShapeError(
                        f"captured step: argument {k} was {shape} {dtype} {state}, got {node.shape} {node.dtype} "
                        f"{node.state}; capture another step for other shapes or states"
                    )
                passed[k] = value
                if slot is not None:
                    inputs[slot] = node.tensor
                    if node.tensor in feeds:  # fed by the caller, not sent yet: it goes now
                        sent[node.tensor] = feeds.pop(node.tensor)
                continue
            array = np.asarray(value)
            if state != MIRRORED:
                raise ShapeError(f"captured step: argument {k} is a {state} tensor of {shape}; pass one, not an array")
            if array.shape != shape or array.dtype != dtype:
                raise ShapeError(
                    f"captured step: a feed of {shape} {dtype} got {array.shape} {array.dtype} (argument {k}); "
                    "capture another step for other shapes"
                )
            if slot is not None:
                inputs[slot] = next(self._tensor_ids)
                fed[inputs[slot]] = array
        out_ids = list(step.root_ids)
        written = list(step.written)
        for j, k in step.arg_roots.items():
            if k in passed:  # written in place into the tensor passed
                out_ids[j], written[j] = passed[k].node.tensor, passed[k]
        for j in step.made:
            out_ids[j] = next(self._tensor_ids)
        return _Bound(inputs, fed, sent, out_ids, [out_ids[j] for j in step.made], written)

    @serialized
    def _replay(self, step: Step, values: Sequence[np.ndarray | Tensor], read: Sequence[int]) -> list[Tensor]:
        _check_reads(step, read)
        self._realize(values)
        bound = self._bind(step, values)
        try:
            got = self._execute(
                step.compiled, bound.inputs, bound.out_ids, {**bound.fed, **bound.sent}, bound.fresh, read
            )
        finally:
            self._released.extend(bound.fed)  # fed values are single-use
        return self._outputs(step, bound, got)

    def _outputs(self, step: Step, bound: _Bound, values: dict[int, np.ndarray]) -> list[Tensor]:
        """The handles of a run's outputs: the in-place ones' (the same every run, or the
        argument written), new ones for the rest, with the values read back."""
        out = list(bound.written)
        for j in step.made:
            shape, dtype = step.outs[j]
            tensor = bound.out_ids[j]
            node = self._resident(Node("", (), {}, shape, dtype), tensor, step.compiled.plan.out_states[j])
            node.host = values.get(tensor)
            out[j] = Tensor(self, node)
        for handle in bound.written:
            if handle is not None:
                handle.node.host = None  # written in place: a value read before is out of date
                if handle.node.alias is not None:
                    handle.node.alias.host = None
        return out

    @serialized
    def chain(
        self, calls: Sequence[tuple[Step, Sequence[np.ndarray | Tensor]]], read: Sequence[int] = (), keep: bool = True
    ) -> list[list[Tensor]]:
        """Run captured steps one after another in one message per worker (RunChain): each
        call is (step, its arguments), and an argument may be an output of an earlier call
        (Earlier(call, index); its handle exists before anything runs). Returns each call's
        outputs; those of the last call at indices `read` come back with the chain. What a
        prefill runs: the embedding, one decoder layer's step per layer with that layer's
        weights and caches, the head; one layer planned and loaded instead of every layer.
        Without `keep`, what the calls before the last make anew is freed on the workers after
        its last reader in the chain (a prefill's residual between layers: two of them alive
        at a time, not one per layer), and their handles are freed ones."""
        if not calls:
            raise ShapeError("chain: give one or more (step, arguments) calls")
        _check_reads(calls[-1][0], read)
        self._realize([v for _, values in calls for v in values])
        programs, runs, inputs, outputs = [], [], [], []
        fed: dict[int, np.ndarray] = {}
        sent: dict[int, np.ndarray] = {}
        fresh: list[int] = []
        results: list[list[Tensor]] = []
        made_by: dict[int, int] = {}  # a tensor the chain makes -> the call making it
        last_read: dict[int, int] = {}  # -> the last call reading it
        try:
            for at, (step, values) in enumerate(calls):
                values = [_earlier(results, at, v) if isinstance(v, Earlier) else v for v in values]
                bound = self._bind(step, values)
                fed.update(bound.fed)
                sent.update(bound.sent)
                fresh.extend(bound.fresh)
                for t in bound.inputs:
                    if t in made_by:
                        last_read[t] = at
                made_by.update(dict.fromkeys(bound.fresh, at))
                programs.append(step.compiled.program)
                runs.append(next(self._run_ids))
                inputs.append(_slot_pairs(range(len(bound.inputs)), bound.inputs))
                outputs.append(_slot_pairs(step.compiled.plan.outputs, bound.out_ids))
                results.append(self._outputs(step, bound, {}))
            last, last_ids = calls[-1][0], outputs[-1][:, 1].tolist()
            states = {last_ids[j]: last.compiled.plan.out_states[j] for j in read}
            released = list(self._released)
            feeds, data = p.pack_arrays({**fed, **sent})
            frees: list[list[int]] = [[] for _ in calls] if not keep else []
            dropped = [t for t, at in made_by.items() if at < len(calls) - 1] if not keep else []
            for t in dropped:
                frees[last_read.get(t, made_by[t])].append(t)
            message = p.RunChain(programs, runs, inputs, outputs, released, feeds, data, int(self.profile), frees=frees)
            messages = {d: replace(message, read=self._asked(states, d)) for d in range(self.n)}
            del self._released[: len(released)]  # they go with it
        except BaseException:
            self._feeds.update(sent)  # nothing left: the caller's fed tensors go with a later run
            self._discard(calls, results, fresh)
            raise
        finally:
            self._released.extend(fed)
        try:
            replies = self._call(messages)
        except BaseException:
            self._discard(calls, results, fresh)
            raise
        self.last_timings = {d: dict(r.info) for d, r in replies.items()}
        if dropped:  # freed on the workers: their handles are freed ones
            self._discard(calls[:-1], results[:-1], [])
        for tensor, value in self._read_back(replies, states).items():
            for handle in results[-1]:
                if handle.node.tensor == tensor:
                    handle.node.host = value
        return results

    def _discard(self, calls, results: list[list[Tensor]], fresh: list[int]) -> None:
        """The outputs of a chain that failed: a chain that failed part way stored some of
        them, released with the next message; their handles (never handed out) let go."""
        for (step, _), handles in zip(calls, results):
            for j in step.made:
                handles[j].node.finalizer.detach()
                handles[j].node.tensor = handles[j].node.state = None
        self._released.extend(fresh)

    @serialized
    def generate(
        self,
        step: Step,
        tokens: np.ndarray,
        positions: np.ndarray,
        steps: int,
        sampling: dict,
        on_tokens: Callable[[int, list[int]], bool],
    ) -> dict:
        """Run captured decode `step` up to `steps` times on the workers, which feed each step's
        chosen tokens back themselves (transport.protocol.Generate): the step's feeds are
        (tokens, positions), its first two outputs the candidates (values, indices) of
        Tensor.top_k. `on_tokens(step, tokens)` gets each step's tokens as they come (read
        from the token board every `sampling["report_s"]` seconds, or from Tokens messages that
        gather steps for that long: workers/generation.py); False cancels after the step under
        way (as Ctrl-C does), and the steps reported with it are not shown. Returns rank 0's
        account (steps run, cancelled, times)."""
        if len(step.specs) != 2 or None in step.feed_slots:
            raise ShapeError("generate: the captured step must read two feeds, tokens and positions")
        bound = self._bind(step, (tokens, positions))
        inputs, fed, out_ids, fresh = bound.inputs, {**bound.fed, **bound.sent}, bound.out_ids, bound.fresh
        run = next(self._run_ids)
        self._run_ids = itertools.count(run + steps + 1)  # one run id per step, none reused
        feeds, data = p.pack_arrays(fed)
        token_id, position_id = (inputs[slot] for slot in step.feed_slots)
        board = _token_board(len(sampling.get("done", ())), steps)
        if board is not None:
            sampling = {**sampling, "board": str(board.path)}
        shown = _Shown(on_tokens)
        message = p.Generate(
            step.compiled.program,
            run,
            steps,
            _slot_pairs(range(len(inputs)), inputs),
            _slot_pairs(step.compiled.plan.outputs, out_ids),
            token_id,
            position_id,
            out_ids[0],
            out_ids[1],
            sampling,
            feeds,
            data,
        )
        watch = None
        if board is not None:
            every_ms = int(1000 * float(sampling.get("report_s", p.REPORT_SECONDS)))
            watch = Watch(every_ms, lambda show: shown.steps(*board.take(), show=show), board.cancel)
        try:
            replies = self._call(
                {d: message for d in range(self.n)}, lambda rank, m: shown.steps(m.step, m.tokens) is not False, watch
            )
            if board is not None:  # what rank 0 published after the last look: before its reply
                shown.steps(*board.take())
        finally:
            self._released.extend([*bound.fed, *fresh])  # freed with the next message that runs
            if board is not None:
                board.close()
        return dict(replies[0].info)

    def _evict(self) -> None:
        evicted = []
        for key in list(self.plans):
            if len(self.plans) <= self.max_plans:
                break
            if self.plans[key].program not in self._pinned:  # captured steps keep theirs
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
            raise _exception(failures)
        return replies

    def _resync(self) -> None:
        """After a failed run every worker brings its data plane back to the state all share
        (the CUDA IPC plane's operation counts differ when one rank failed before a collective
        that its peers began). If that fails too, the next run says so; the run's own error is
        the one raised."""
        message = p.Resync(next(self._run_ids))  # one run id for all: it tags their exchange
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


class Step:
    """A captured step (MetaDevice.capture): call it with new arguments, get its outputs."""

    def __init__(self, dev: MetaDevice, compiled, leaves, args: Sequence[Tensor], values, roots):
        self.dev, self.compiled, self.leaves = dev, compiled, list(leaves)  # leaves stay alive with it
        slots = {leaf.tensor: i for i, leaf in enumerate(self.leaves)}
        self.feed_slots = [slots.get(a.node.tensor) for a in args]  # None: an argument the step does not read
        # each argument's (shape, dtype, state, dtype's name): a replay passes an array fed
        # (Mirrored) or a tensor of the same
        self.specs = [(a.node.shape, dtype_from_name(a.node.dtype), a.node.state, a.node.dtype) for a in args]
        self.roots = roots
        plan = compiled.plan
        self.outs = [(plan.shapes[v], plan.dtypes[v]) for v in plan.outputs]
        # what every run binds alike, worked out once: ~300 inputs of a decode step
        self.leaf_ids = [leaf.tensor for leaf in self.leaves]
        self.root_ids = [root.tensor if root is not None else None for root in roots]
        self.made = [j for j, root in enumerate(roots) if root is None]  # outputs each run makes anew
        # outputs written in place into a tensor argument: a replay writes the one it passes
        passed = {a.node.tensor: k for k, (a, v) in enumerate(zip(args, values)) if isinstance(v, Tensor)}
        self.arg_roots = {j: passed[t] for j, t in enumerate(self.root_ids) if t in passed}
        self.written: list[Tensor | None] = [None] * len(roots)  # the in-place ones' handles
        for j, root in enumerate(roots):
            if root is not None:
                node = Node("", (), {}, *self.outs[j])
                node.tensor, node.state, node.alias = root.tensor, plan.out_states[j], root
                self.written[j] = Tensor(dev, node)
        dev._pinned.add(compiled.program)
        weakref.finalize(self, dev._pinned.discard, compiled.program)

    def __call__(self, *values: np.ndarray | Tensor, read: Sequence[int] = ()) -> list[Tensor]:
        """The outputs of a run with these arguments; those at indices `read` come back with
        the run, so reading them (.numpy()) needs no round trip of its own."""
        return self.dev._replay(self, values, tuple(read))


@dataclass(frozen=True)
class Earlier:
    """An argument of a call in MetaDevice.chain: output `index` of call `call` before it."""

    call: int
    index: int


@dataclass(frozen=True)
class _Bound:
    """A run of a captured step as MetaDevice._bind made it."""

    inputs: list[int]  # tensor id by input slot
    fed: dict[int, np.ndarray]  # arrays fed to it, by their fresh ids: released after the run
    sent: dict[int, np.ndarray]  # the caller's fed tensors sent with it: their handles release them
    out_ids: list[int]
    fresh: list[int]  # out_ids made anew
    written: list[Tensor | None]  # the handles of outputs written in place


def _earlier(results: list[list[Tensor]], at: int, ref: Earlier) -> Tensor:
    if not (0 <= ref.call < at and 0 <= ref.index < len(results[ref.call])):
        raise ShapeError(f"chain: call {at} takes output {ref.index} of call {ref.call}, which it does not follow")
    return results[ref.call][ref.index]


def _check_reads(step: Step, read: Sequence[int]) -> None:
    for j in read:
        if not (type(j) is int and 0 <= j < len(step.roots)) or step.roots[j] is not None:
            raise ShapeError(
                f"captured step: cannot read output {j!r} with the run; read outputs 0..{len(step.roots) - 1} "
                "that the step makes anew (one written in place, a cache, reads with .numpy())"
            )


class _Shown:
    """The steps of a generation as `on_tokens` sees them: each once and in order, whichever
    way it came (rank 0 sends the first in a Tokens message and puts it on the token board
    too), none after a refusal."""

    def __init__(self, on_tokens: Callable[[int, list[int]], bool]):
        self.on_tokens = on_tokens
        self.next = 0  # the first step not shown yet
        self.refused = False

    def steps(self, first: int, tokens: Sequence[Sequence[int]], show: bool = True) -> bool | None:
        """None: nothing new; False: refused (now or before)."""
        if not tokens:
            return None
        for k, chosen in enumerate(tokens, first):
            if not show or self.refused:
                break
            if k >= self.next:  # else shown already, from the other way
                self.next = k + 1
                self.refused = not self.on_tokens(k, list(chosen))
        return not self.refused


def _token_board(per_step: int, steps: int) -> TokenBoard | None:
    """A board for rank 0's tokens (transport/board.py), or None where shared memory cannot
    carry them: rank 0 then sends Tokens messages only."""
    if not board_supported() or per_step < 1 or steps < 1:
        return None
    try:
        return TokenBoard.create(per_step, steps)
    except errors.TransportError:
        return None


def _slot_pairs(slots: Sequence[int], tensors: Sequence[int]) -> np.ndarray:
    """[slot, tensor id] pairs as the wire carries them (transport.protocol.SlotPairs)."""
    pairs = np.empty((len(tensors), 2), np.int64)
    pairs[:, 0] = slots
    pairs[:, 1] = tensors
    return pairs


def _last_writes(order: list[Node]) -> dict[Node, Node]:
    """The last in-place write (a chain's outermost) into each resident tensor among the nodes
    a run computed, and that tensor: after the run its storage holds that node's value. A
    decode step's cache writes (not outputs of it) were left as recipes, and the next graph
    over the caches ran them again."""
    last: dict[int, tuple[Node, Node]] = {}
    for node in order:
        if node.op in OPS and OPS[node.op].inplace:
            root = _written(node)
            if root is not None:
                last[id(root)] = (node, root)
    return dict(last.values())


def _written(node: Node) -> Node | None:
    """The resident node an in-place op (a chain of them) writes into, if any."""
    start = node
    while node.op in OPS and OPS[node.op].inplace:
        node = node.inputs[0]
    if node is start or not node.resident:
        return None
    return node.alias or node


def _exception(failures: dict[int, p.Error]) -> MetaError:
    """The root cause among the workers' errors (peers that merely aborted come last)."""
    ranked = sorted(failures.items(), key=lambda kv: (kv[1].origin >= 0, kv[0]))
    rank, err = ranked[0]
    said = f"worker {rank}: "  # many of a worker's errors already name it so
    text = err.message if err.message.startswith(said) else said + err.message
    if len(failures) > 1:
        text += f" (workers {sorted(failures)} failed)"
    cls = _TYPED.get(err.kind)
    if cls is None:
        return RemoteError(text, rank=rank, kind=err.kind, remote_traceback=err.traceback)
    exc = cls(text) if cls is not errors.WorkerLost else cls(text, rank=rank)
    exc.remote_traceback = err.traceback
    return exc
