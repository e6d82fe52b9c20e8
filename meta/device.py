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

from meta.cluster import Watch
from meta.compiler import compile_plan, structural_key
from meta.graph import Node, topo_order
from meta.planner import Plan, plan
from meta.tensor import Tensor
from split_state import errors
from split_state.dtypes import dtype_name
from split_state.errors import MetaError, RemoteError, ShapeError
from split_state.layout import Piece, local_shape, pieces
from split_state.ops import OPS
from split_state.scatter import extract, gather
from split_state.states import MIRRORED, State, validate
from transport import protocol as p
from transport.board import TokenBoard
from transport.board import supported as board_supported

Policy = Callable[[str, tuple[int, ...]], State | None]

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

    def _placement(self, name: str, shape: tuple[int, ...], state: State | None) -> State:
        if state is None and self.policy is not None:
            state = self.policy(name, tuple(shape))
        state = MIRRORED if state is None else state
        validate(state, shape, self.n, name=name or "tensor")
        return state

    def _place(self, name, shape, dtype, state, local) -> Tensor:
        tensor = next(self._tensor_ids)
        messages = {}
        for d in range(self.n):
            array = local(d)
            expected = local_shape(state, shape, self.n, d)
            if tuple(array.shape) != expected or dtype_name(array.dtype) != dtype:
                raise errors.SplitError(
                    f"{name or 'tensor'}: device {d} local array is {array.shape} {array.dtype}, "
                    f"{state} of {shape} needs {expected} {dtype}"
                )
            messages[d] = p.Put(tensor, state, tuple(shape), array)
        try:
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
        compiled, leaves, outputs = planned
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
        return compiled, leaves, roots

    def _planned(self, outputs: list[Node]) -> tuple[CompiledPlan, list[Node], list[Node]] | None:
        """The compiled (loaded) plan computing `outputs` (cached by structure), its leaves, and
        the outputs without repeats; None when there is nothing to compute."""
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
        return compiled, leaves, outputs

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
        asked = {d: [t for t, state in states.items() if d == 0 or not self._one_copy(state)] for d in range(self.n)}
        try:
            replies = self._call({d: replace(message, read=asked[d]) if asked[d] else message for d in range(self.n)})
        except errors.DeadlineExceeded:
            self._released.extend(fresh)
            raise
        self.last_timings = {d: dict(r.info) for d, r in replies.items()}
        if not states:
            return {}
        got = {d: {v.tensor: p.unpack_array(v, r.data) for v in r.values} for d, r in replies.items() if asked[d]}
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
    def capture(self, build: Callable[..., Sequence[Tensor]], *values: np.ndarray) -> tuple[Step, list[Tensor]]:
        """Run `build(*feeds)` with `values` fed (a real step), and return it as a Step that
        replays the same compiled program with new values of the same shapes (no graph to build,
        plan or key on the coordinator; one message per worker), with this run's outputs.
        In-place writes (a KV cache) go on in place at every replay."""
        feeds = [self.feed(v) for v in values]
        outputs = list(build(*feeds))
        ran = self._run_nodes([t.node for t in outputs])
        if ran is None:
            raise ShapeError("capture: the graph has nothing to compute")
        compiled, leaves, roots = ran
        slots = {leaf.tensor: i for i, leaf in enumerate(leaves)}
        step = Step(self, compiled, leaves, [slots.get(f.node.tensor) for f in feeds], values, roots)
        return step, outputs

    @serialized
    def prepare(self, build: Callable[..., Sequence[Tensor]], *values: np.ndarray) -> Step:
        """The Step capture() would return, planned, compiled and loaded on every worker, but
        not run: nothing is computed or written, and the graph `build` made is dropped (handles
        it changed, a model's caches, are the caller's to put back). Its first call runs it,
        as any later one: what llama.cpp's warm-up run and vLLM's start-up capture save the
        first request (~50 ms of a SmolLM2 prefill step's planning and loading)."""
        feeds = [self.feed(v) for v in values]
        try:
            outputs = list(build(*feeds))
            planned = self._planned([t.node for t in outputs])
        finally:
            for f in feeds:  # nothing runs: they are not sent
                self._feeds.pop(f.node.tensor, None)
        if planned is None:
            raise ShapeError("prepare: the graph has nothing to compute")
        compiled, leaves, nodes = planned
        slots = {leaf.tensor: i for i, leaf in enumerate(leaves)}
        roots = [_written(node) for node in nodes]
        return Step(self, compiled, leaves, [slots.get(f.node.tensor) for f in feeds], values, roots)

    def _bind(self, step: Step, arrays: Sequence[np.ndarray]):
        """A run of captured `step` with new feed values: its input tensor ids (fresh ids for
        the fed ones), the fed arrays by id, its output ids (in-place results keep their
        tensor's), and which of those are new."""
        inputs = list(step.leaf_ids)
        fed: dict[int, np.ndarray] = {}
        for slot, example, array in zip(step.feed_slots, step.examples, arrays):
            array = np.asarray(array)
            if array.shape != example.shape or array.dtype != example.dtype:
                raise ShapeError(
                    f"captured step: a feed of {example.shape} {example.dtype} got {array.shape} {array.dtype}; "
                    "capture another step for other shapes"
                )
            if slot is not None:
                inputs[slot] = next(self._tensor_ids)
                fed[inputs[slot]] = array
        out_ids = list(step.root_ids)
        for j in step.made:
            out_ids[j] = next(self._tensor_ids)
        return inputs, fed, out_ids, [out_ids[j] for j in step.made]

    @serialized
    def _replay(self, step: Step, arrays: Sequence[np.ndarray], read: Sequence[int]) -> list[Tensor]:
        for j in read:
            if not (type(j) is int and 0 <= j < len(step.roots)) or step.roots[j] is not None:
                raise ShapeError(
                    f"captured step: cannot read output {j!r} with the run; read outputs 0..{len(step.roots) - 1} "
                    "that the step makes anew (one written in place, a cache, reads with .numpy())"
                )
        inputs, fed, out_ids, fresh = self._bind(step, arrays)
        try:
            values = self._execute(step.compiled, inputs, out_ids, fed, fresh, read)
        finally:
            self._released.extend(fed)  # fed values are single-use
        out = list(step.written)  # in-place results: the same handles every run
        for j in step.made:
            shape, dtype = step.outs[j]
            node = self._resident(Node("", (), {}, shape, dtype), out_ids[j], step.compiled.plan.out_states[j])
            node.host = values.get(out_ids[j])
            out[j] = Tensor(self, node)
        for root in step.roots:
            if root is not None:
                root.host = None  # written in place: a value read before is out of date
        return out

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
        if len(step.examples) != 2 or None in step.feed_slots:
            raise ShapeError("generate: the captured step must read two feeds, tokens and positions")
        inputs, fed, out_ids, fresh = self._bind(step, (tokens, positions))
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
            self._released.extend([*fed, *fresh])  # freed with the next message that runs
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
            if any(isinstance(m, (p.RunProgram, p.Generate)) for m in messages.values()):
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
    """A captured step (MetaDevice.capture): call it with new feed values, get its outputs."""

    def __init__(self, dev: MetaDevice, compiled, leaves, feed_slots, examples, roots):
        self.dev, self.compiled, self.leaves = dev, compiled, list(leaves)  # leaves stay alive with it
        self.feed_slots, self.examples, self.roots = feed_slots, [np.asarray(e) for e in examples], roots
        plan = compiled.plan
        self.outs = [(plan.shapes[v], plan.dtypes[v]) for v in plan.outputs]
        # what every run binds alike, worked out once: ~300 inputs of a decode step
        self.leaf_ids = [leaf.tensor for leaf in self.leaves]
        self.root_ids = [root.tensor if root is not None else None for root in roots]
        self.made = [j for j, root in enumerate(roots) if root is None]  # outputs each run makes anew
        self.written: list[Tensor | None] = [None] * len(roots)  # the in-place ones' handles
        for j, root in enumerate(roots):
            if root is not None:
                node = Node("", (), {}, *self.outs[j])
                node.tensor, node.state, node.alias = root.tensor, plan.out_states[j], root
                self.written[j] = Tensor(dev, node)
        dev._pinned.add(compiled.program)
        weakref.finalize(self, dev._pinned.discard, compiled.program)

    def __call__(self, *arrays: np.ndarray, read: Sequence[int] = ()) -> list[Tensor]:
        """The outputs of a run with these feed values; those at indices `read` come back with
        the run, so reading them (.numpy()) needs no round trip of its own."""
        if len(arrays) != len(self.examples):
            raise ShapeError(f"captured step takes {len(self.examples)} feeds, got {len(arrays)}")
        return self.dev._replay(self, arrays, tuple(read))


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
