"""Split-state inference and communication insertion.

For each node the rule table offers signatures; `choose` takes one needing no communication, else
the cheapest by transition cost, and a move is inserted for every input not already in the state
the signature needs. Linear ops keep Partial lazy; non-linear ones force the reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meta.graph import MOVE, Node
from split_state.dtypes import dtype_from_name
from split_state.ops import signatures
from split_state.rules import Signature, choose
from split_state.states import State, validate
from split_state.transitions import Collective, classify

COMMUNICATING = frozenset(
    {Collective.ALL_GATHER, Collective.ALL_TO_ALL, Collective.ALL_REDUCE, Collective.REDUCE_SCATTER}
)


@dataclass(frozen=True)
class PlanOp:
    op: str
    inputs: tuple[int, ...]  # values
    output: int
    params: dict[str, Any]
    in_states: tuple[State, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    state: State
    shape: tuple[int, ...]
    dtype: str
    label: str


@dataclass(frozen=True)
class PlanMove:
    input: int
    output: int
    src: State
    dst: State
    shape: tuple[int, ...]
    dtype: str

    @property
    def collective(self) -> Collective:
        return classify(self.src, self.dst)


@dataclass
class Plan:
    n_inputs: int  # values 0..n_inputs-1 are the resident leaves
    steps: list[PlanOp | PlanMove]
    outputs: list[int]  # value of each requested node
    out_states: list[State]
    trace: list[str]
    n: int

    def collectives(self) -> list[Collective]:
        """Moves that communicate (on one device every move is a local copy)."""
        if self.n == 1:
            return []
        return [s.collective for s in self.steps if isinstance(s, PlanMove) and s.collective in COMMUNICATING]

    def count(self, kind: Collective) -> int:
        return sum(1 for c in self.collectives() if c is kind)


def plan(leaves: list[Node], order: list[Node], outputs: list[Node], n: int) -> Plan:
    value: dict[int, int] = {leaf.id: i for i, leaf in enumerate(leaves)}
    state: dict[int, State] = {i: leaf.state for i, leaf in enumerate(leaves)}
    meta: dict[int, tuple[tuple[int, ...], str]] = {i: (leaf.shape, leaf.dtype) for i, leaf in enumerate(leaves)}
    names = {i: leaf.name or f"t{leaf.tensor}" for i, leaf in enumerate(leaves)}
    steps: list[PlanOp | PlanMove] = []
    trace: list[str] = []
    moved: dict[tuple[int, State], int] = {}
    counter = len(leaves)

    def move(v: int, dst: State) -> int:
        nonlocal counter
        if state[v] == dst:
            return v
        if (v, dst) not in moved:
            shape, dtype = meta[v]
            steps.append(PlanMove(v, counter, state[v], dst, shape, dtype))
            trace.append(f"    {classify(state[v], dst).value}: {names[v]} {state[v]} -> {dst}")
            state[counter], meta[counter], names[counter] = dst, (shape, dtype), f"{names[v]}'"
            moved[(v, dst)] = counter
            counter += 1
        return moved[(v, dst)]

    for node in order:
        ins = [value[c.id] for c in node.inputs]
        if node.op == MOVE:
            validate(node.params["state"], node.shape, n, name=node.name or "tensor")
            value[node.id] = move(ins[0], node.params["state"])
            continue
        shapes = [meta[v][0] for v in ins]
        current = [state[v] for v in ins]
        sigs = signatures(node.op, current, shapes, node.params, node.shape)
        sig: Signature
        sig, _ = choose(sigs, current, shapes, [dtype_from_name(meta[v][1]).itemsize for v in ins], n)
        ins = [move(v, s) for v, s in zip(ins, sig.inputs)]
        out = counter
        counter += 1
        label = node.name or f"{node.op}#{out}"
        steps.append(
            PlanOp(
                node.op,
                tuple(ins),
                out,
                node.params,
                sig.inputs,
                tuple(shapes),
                sig.output,
                node.shape,
                node.dtype,
                label,
            )
        )
        state[out], meta[out], names[out] = sig.output, (node.shape, node.dtype), label
        value[node.id] = out
        trace.append(f"{label}: ({', '.join(f'{names[v]}:{state[v]}' for v in ins)}) -> {node.op} -> {sig.output}")
    outs = [value[o.id] for o in outputs]
    return Plan(len(leaves), steps, outs, [state[v] for v in outs], trace, n)
