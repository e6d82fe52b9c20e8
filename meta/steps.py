"""Captured steps: a graph run once and replayed with new arguments (`capture`, `prepare`, a
`Step`'s call), and chains of them in one message per worker (`chain`). The capturing half of
MetaDevice (meta/device.py), a mixin over the device's state; a replay builds no graph and plans
nothing: it binds the step's compiled program to fresh ids and sends one message."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from meta.graph import Node, written_into
from meta.serialized import serialized
from meta.tensor import Tensor
from split_state.dtypes import dtype_from_name
from split_state.errors import ShapeError
from split_state.states import MIRRORED
from transport import protocol as p

if TYPE_CHECKING:
    from meta.device import MetaDevice


class Capturing:
    """MetaDevice's capturing, replaying and chaining methods."""

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
        return Step(self, compiled, leaves, args, values, [written_into(node) for node in nodes])

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
            self.ledger.release(bound.fed)  # fed values are single-use
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
        self,
        calls: Sequence[tuple[Step, Sequence[np.ndarray | Tensor]]],
        read: Sequence[int] = (),
        keep: bool = True,
        new_data: Sequence[int] = (),
        also_read: Sequence[Earlier] = (),
    ) -> list[list[Tensor]]:
        """Run captured steps one after another in one message per worker (RunChain): each
        call is (step, its arguments), and an argument may be an output of an earlier call
        (Earlier(call, index); its handle exists before anything runs). Returns each call's
        outputs; those of the last call at indices `read` come back with the chain. What a
        prefill runs: the embedding, one decoder layer's step per layer with that layer's
        weights and caches, the head; one layer planned and loaded instead of every layer.
        Without `keep`, what the calls before the last make anew is freed on the workers after
        its last reader in the chain (a prefill's residual between layers: two of them alive
        at a time, not one per layer), and their handles are freed ones. `new_data`: the calls
        from which the steps read other data than the calls before (a long prompt's next chunk:
        other positions, another mask), so a step run again finds what it found from them anew
        (RunChain.new_data). A chain of several chunks lets each worker go on to the next chunk
        as soon as its own part of one is done: layers on groups work on successive chunks at
        once (llama.cpp's pipeline parallelism of a layer split's micro-batches); a worker keeps
        what comes early for any run of the chain (workers/server.py), so the groups may
        all-reduce among themselves while the one before runs ahead. `also_read`: outputs of
        earlier calls that come back with the chain too, and are kept without `keep` (the heads
        of a prefill's lanes before the last)."""
        if not calls:
            raise ShapeError("chain: give one or more (step, arguments) calls")
        _check_reads(calls[-1][0], read)
        for ref in also_read:
            if not 0 <= ref.call < len(calls) - 1:
                raise ShapeError(f"chain: also_read {ref} names a call before the last of {len(calls)}")
            _check_reads(calls[ref.call][0], [ref.index])
        if any(not (type(i) is int and 0 <= i < len(calls)) for i in new_data):
            raise ShapeError(f"chain: new data at calls {list(new_data)}, of calls 0..{len(calls) - 1}")
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
                runs.append(self.ledger.next_run())
                inputs.append(slot_pairs(range(len(bound.inputs)), bound.inputs))
                outputs.append(slot_pairs(step.compiled.plan.outputs, bound.out_ids))
                results.append(self._outputs(step, bound, {}))
            last, last_ids = calls[-1][0], outputs[-1][:, 1].tolist()
            states = {last_ids[j]: last.compiled.plan.out_states[j] for j in read}
            kept = {
                int(outputs[r.call][r.index, 1]): calls[r.call][0].compiled.plan.out_states[r.index] for r in also_read
            }
            states |= kept
            released = self.ledger.pending()
            feeds, data = p.pack_arrays({**fed, **sent})
            frees: list[list[int]] = [[] for _ in calls] if not keep else []
            last_call = len(calls) - 1
            dropped = [t for t, at in made_by.items() if at < last_call and t not in kept] if not keep else []
            for t in dropped:
                frees[last_read.get(t, made_by[t])].append(t)
            message = p.RunChain(
                programs,
                runs,
                inputs,
                outputs,
                released,
                feeds,
                data,
                int(self.profile),
                frees=frees,
                new_data=sorted(set(new_data) - {0}),
            )
            messages = {d: replace(message, read=self._asked(states, d)) for d in range(self.n)}
            self.ledger.sent(len(released))  # they go with it
        except BaseException:
            self._feeds.update(sent)  # nothing left: the caller's fed tensors go with a later run
            self._discard(calls, results, fresh)
            raise
        finally:
            self.ledger.release(fed)
        try:
            replies = self._call(messages)
        except BaseException:
            self._discard(calls, results, fresh)
            raise
        self.last_timings = {d: dict(r.info) for d, r in replies.items()}
        if dropped:  # freed on the workers: their handles are freed ones
            self._discard(calls[:-1], results[:-1], [], kept=kept)
        handles = {h.node.tensor: h for h in [*results[-1], *(results[r.call][r.index] for r in also_read)]}
        for tensor, value in self._read_back(replies, states).items():
            if tensor in handles:
                handles[tensor].node.host = value
        return results

    def _discard(self, calls, results: list[list[Tensor]], fresh: list[int], kept=()) -> None:
        """The outputs of a chain that failed: a chain that failed part way stored some of
        them, released with the next message; their handles (never handed out) let go. Or
        those a chain without `keep` freed on the workers, but for the `kept` tensors."""
        for (step, _), handles in zip(calls, results):
            for j in step.made:
                if handles[j].node.tensor in kept:
                    continue
                handles[j].node.finalizer.detach()
                handles[j].node.tensor = handles[j].node.state = None
        self.ledger.release(fresh)


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
        dev.ledger.pin(compiled.program, self)

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


def slot_pairs(slots: Sequence[int], tensors: Sequence[int]) -> np.ndarray:
    """[slot, tensor id] pairs as the wire carries them (transport.protocol.SlotPairs)."""
    pairs = np.empty((len(tensors), 2), np.int64)
    pairs[:, 0] = slots
    pairs[:, 1] = tensors
    return pairs
