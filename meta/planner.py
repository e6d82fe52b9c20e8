"""Split-state inference and communication insertion.

For each node the rule table offers signatures; `choose` takes one needing no communication, else
the cheapest as charged by the collective algorithms that will run on the workers' data plane,
and a move is inserted for every input not already in the state the signature needs. Linear ops
keep Partial lazy; non-linear ones force the reduction.

An op whose inputs are held by a group of the devices (a layer placed on one host's workers:
split_state.states' `on`) runs on that group: its other inputs are handed over to the group
first (one move each, remembered, so a layer's activation crosses once), and its rule is chosen
among the group's devices as if they were the whole cluster (states restricted to the group,
the signature widened back). Which group: a resident input's (weights do not move), else the
latest input's.

A plan is written in the program IR of the wire (transport.protocol's OpStep / MoveStep), with
global shapes and parameters; the compiler localises it per device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meta.graph import MOVE, Node, topo_order
from meta.memo import Memo, frozen
from split_state.algorithms import universe
from split_state.dtypes import dtype_from_name
from split_state.ops import signatures
from split_state.rules import Signature, choose
from split_state.states import Mirrored, Partial, State, restrict, validate, widen
from split_state.transitions import Collective, classify
from transport import protocol as p

COMMUNICATING = frozenset(
    {
        Collective.ALL_GATHER,
        Collective.ALL_TO_ALL,
        Collective.ALL_REDUCE,
        Collective.REDUCE_SCATTER,
        Collective.HAND_OVER,
    }
)


@dataclass
class Plan:
    n_inputs: int  # values 0..n_inputs-1 are the resident leaves
    steps: list[p.OpStep | p.MoveStep]  # global shapes and parameters
    outputs: list[int]  # value of each requested node
    states: dict[int, State]  # the state of every value
    shapes: dict[int, tuple[int, ...]]  # the global shape of every value
    dtypes: dict[int, str]  # the dtype of every value
    # what `trace` says, formatted only when asked for (formatting every state of a decoder's
    # plan took a sixth of its planning time): (value moved, its move's value) or (op value,
    # its input values, the op)
    events: list[tuple]
    n: int
    labels: dict[int, str] = field(default_factory=dict)  # op values, for traces and errors
    names: dict[int, str] = field(default_factory=dict)  # every value's, for traces
    choices: dict[int, Choice] = field(default_factory=dict)  # op step index -> its choice (compile_plan)

    @property
    def trace(self) -> list[str]:
        """One line per op (its inputs' states, the op, its output's state) and per move."""
        states, names, lines = self.states, self.names, []
        for event in self.events:
            if len(event) == 2:
                v, moved = event
                kind = classify(states[v], states[moved]).value
                lines.append(f"    {kind}: {names[v]} {states[v]} -> {states[moved]}")
            else:
                out, ins, op = event
                inputs = ", ".join(f"{names[v]}:{states[v]}" for v in ins)
                lines.append(f"{self.labels[out]}: ({inputs}) -> {op} -> {states[out]}")
        return lines

    @property
    def out_states(self) -> list[State]:
        return [self.states[v] for v in self.outputs]

    def collectives(self) -> list[Collective]:
        """Moves that communicate (on one device every move is a local copy)."""
        if self.n == 1:
            return []
        kinds = (classify(s.src, s.dst) for s in self.steps if isinstance(s, p.MoveStep) and self._among_several(s))
        return [k for k in kinds if k in COMMUNICATING]

    def _among_several(self, step: p.MoveStep) -> bool:
        """Whether a move involves more than one device (on a group of one, nothing moves)."""
        devices = universe(step.src, step.dst, self.n)
        return devices is None or len(devices) > 1

    def count(self, kind: Collective) -> int:
        return sum(1 for c in self.collectives() if c is kind)


@dataclass(eq=False)
class Choice:
    """What planning an op over inputs in given states, shapes and dtypes gives: the signature
    `choose` picks, one parameters object for every step it stands for, and (filled by the
    compiler) each device's localised parameters and output shape. A pure function of those,
    so remembered: a decoder's 30 layers repeat each choice, which is then picked, localised
    and encoded once instead of 30 times. `group`: the devices the op runs on, where its inputs
    are held by a group of them (None: every device)."""

    sig: Signature
    params: dict
    local: dict[int, tuple[dict, tuple[int, ...]]] = field(default_factory=dict)  # device -> (params, shape)
    group: tuple[int, ...] | None = None


_CHOSEN = Memo(16384)


def _choice(
    op: str,
    params: dict,
    shape,
    states: tuple,
    shapes: tuple,
    dtypes: tuple,
    n: int,
    plane: str,
    params_key=None,
    group: tuple[int, ...] | None = None,
) -> Choice:
    """The Choice for an op over inputs in these states, shapes and dtypes (on `group` only,
    where given: every state held by it). `params_key`: frozen(params), when known."""

    def work() -> Choice:
        local = states if group is None else tuple(restrict(s, group) for s in states)
        sigs = signatures(op, list(local), list(shapes), params, shape)
        itemsizes = [dtype_from_name(d).itemsize for d in dtypes]
        if group is None:
            return Choice(choose(sigs, local, shapes, itemsizes, n, dtypes, plane)[0], params)
        # among the group's devices, as a cluster of its own (no plane-native collectives there)
        sig = choose(sigs, local, shapes, itemsizes, len(group), dtypes)[0]
        wide = Signature(tuple(widen(s, group, n) for s in sig.inputs), widen(sig.output, group, n))
        return Choice(wide, params, group=group)

    key = (
        op,
        frozen(params) if params_key is None else params_key,
        tuple(shape),
        states,
        shapes,
        dtypes,
        n,
        plane,
        group,
    )
    return _CHOSEN.get(key, work)


def op_group(held: list[tuple[bool, int, tuple[int, ...] | None]]) -> tuple[int, ...] | None:
    """The devices an op runs on, from its inputs' (resident?, order, group): a resident input's
    group (weights do not move), else the latest input's; None where no input is held by a
    group."""
    grouped = [h for h in held if h[2] is not None]
    return max(grouped)[2] if grouped else None


def _op_group(ins: list[int], state: dict[int, State], n_leaves: int) -> tuple[int, ...] | None:
    return op_group([(v < n_leaves, v, state[v].on) for v in ins])


def held_by(node: Node) -> tuple[int, ...] | None:
    """The group of devices that will hold `node`'s value as the planner places it (None: every
    device), known before planning: what an op whose shape depends on its device count asks
    (top_k's candidates, one set per device of the group)."""
    leaves, order = topo_order([node])
    rank = {leaf.id: i for i, leaf in enumerate(leaves)}
    group = {leaf.id: leaf.state.on for leaf in leaves}
    for at, n in enumerate(order, start=len(leaves)):
        rank[n.id] = at
        if n.op == MOVE:
            group[n.id] = n.params["state"].on
        else:
            group[n.id] = op_group([(c.resident, rank[c.id], group[c.id]) for c in n.inputs])
    return group[node.id]


def plan(leaves: list[Node], order: list[Node], outputs: list[Node], n: int, plane: str = "") -> Plan:
    value: dict[int, int] = {leaf.id: i for i, leaf in enumerate(leaves)}
    state: dict[int, State] = {i: leaf.state for i, leaf in enumerate(leaves)}
    meta: dict[int, tuple[tuple[int, ...], str]] = {i: (leaf.shape, leaf.dtype) for i, leaf in enumerate(leaves)}
    names = {i: leaf.name or f"t{leaf.tensor}" for i, leaf in enumerate(leaves)}
    steps: list[p.OpStep | p.MoveStep] = []
    events: list[tuple] = []
    labels: dict[int, str] = {}
    moved: dict[tuple[int, State], int] = {}
    choices: dict[int, Choice] = {}  # op step index -> its choice
    counter = len(leaves)

    def move(v: int, dst: State) -> int:
        nonlocal counter
        if state[v] == dst:
            return v
        src = state[v]
        if src.on != dst.on and (isinstance(src, Partial) or isinstance(dst, Partial)):
            # a partial sum is reduced on its own devices before it changes hands, and one is
            # made only where the value already is
            if isinstance(src, Partial):
                v = move(v, Mirrored(src.on))
            if isinstance(dst, Partial):
                v = move(v, Mirrored(dst.on))
            return move(v, dst)
        if (v, dst) not in moved:
            shape, dtype = meta[v]
            steps.append(p.MoveStep(v, counter, state[v], dst, shape, dtype))
            events.append((v, counter))
            state[counter], meta[counter], names[counter] = dst, (shape, dtype), f"{names[v]}'"
            moved[(v, dst)] = counter
            counter += 1
        return moved[(v, dst)]

    def onto(v: int, group: tuple[int, ...]) -> int:
        """Value `v` held by `group`: as it is, or handed over to be Mirrored on the group
        (`move` reduces a partial sum on its own devices first)."""
        return v if state[v].on == group else move(v, Mirrored(group))

    for node in order:
        ins = [value[c.id] for c in node.inputs]
        if node.op == MOVE:
            validate(node.params["state"], node.shape, n, name=node.name or "tensor")
            value[node.id] = move(ins[0], node.params["state"])
            continue
        group = _op_group(ins, state, len(leaves))
        if group is not None:
            ins = [onto(v, group) for v in ins]
        shapes = [meta[v][0] for v in ins]
        current = [state[v] for v in ins]
        dtypes = [meta[v][1] for v in ins]
        choice = _choice(
            node.op,
            node.params,
            node.shape,
            tuple(current),
            tuple(shapes),
            tuple(dtypes),
            n,
            plane,
            node.params_key,
            group,
        )
        sig = choice.sig
        ins = [move(v, s) for v, s in zip(ins, sig.inputs)]
        out = counter
        counter += 1
        label = node.name or f"{node.op}#{out}"
        # the choice's parameters (equal to the node's): one object for the steps it stands for
        steps.append(p.OpStep(node.op, tuple(ins), out, choice.params, node.shape, node.dtype))
        choices[len(steps) - 1] = choice
        state[out], meta[out], names[out], labels[out] = sig.output, (node.shape, node.dtype), label, label
        value[node.id] = out
        events.append((out, tuple(ins), node.op))
    outs = [value[o.id] for o in outputs]
    shapes_of = {v: shape for v, (shape, _) in meta.items()}
    dtypes_of = {v: dtype for v, (_, dtype) in meta.items()}
    return Plan(len(leaves), steps, outs, state, shapes_of, dtypes_of, events, n, labels, names, choices)
