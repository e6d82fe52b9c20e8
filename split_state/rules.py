"""Propagation rules: which (input states -> output state) signatures an op accepts.

Most ops are described by axis labels, as an einsum is: a label shared by inputs and output may
be split (every operand holding it split alike), a label the inputs share but the output lacks is
contracted (split on it gives Partial), and `fixed` labels (normalised, concatenated, broadcast
axes) may not be split. Linear ops also list which Partial/Mirrored input patterns give Partial.
The all-Mirrored signature is always valid, so a redistribution always exists: no op aborts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from split_state.algorithms import transition
from split_state.states import MIRRORED, PARTIAL, Split, State


@dataclass(frozen=True)
class Signature:
    inputs: tuple[State, ...]
    output: State

    def __str__(self) -> str:
        return "(" + ", ".join(str(s) for s in self.inputs) + f") -> {self.output}"


@dataclass(frozen=True)
class Labels:
    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    fixed: frozenset[str] = field(default_factory=frozenset)
    partial: tuple[tuple[bool, ...], ...] = ()  # True = Partial, False = Mirrored; output Partial


def label_signatures(labels: Labels, states: Sequence[State]) -> list[Signature]:
    """Signatures that keep some input's split, then the linear Partial patterns, then all-Mirrored."""
    sigs: list[Signature] = []
    for i, st in enumerate(states):
        if not isinstance(st, Split):
            continue
        label = labels.inputs[i][st.axis]
        if label in labels.fixed:
            continue
        required = tuple(st.with_axis(lab.index(label)) if label in lab else MIRRORED for lab in labels.inputs)
        out = st.with_axis(labels.output.index(label)) if label in labels.output else PARTIAL
        sigs.append(Signature(required, out))
    for pattern in labels.partial:
        sigs.append(Signature(tuple(PARTIAL if p else MIRRORED for p in pattern), PARTIAL))
    sigs.append(Signature((MIRRORED,) * len(labels.inputs), MIRRORED))
    return list(dict.fromkeys(sigs))


def choose(
    signatures: Sequence[Signature],
    states: Sequence[State],
    shapes: Sequence[Sequence[int]],
    itemsizes: Sequence[int],
    n: int,
    dtypes: Sequence[str] = (),
    plane: str = "",
) -> tuple[Signature, int]:
    """The cheapest signature by bytes moved per device, as charged by the algorithms that will
    run on `plane`; among equals, the one with fewest moves (on one device every move is free,
    and a free move is still a step), then the earlier (split-keeping) one."""
    dtypes = dtypes or ("",) * len(states)
    best: tuple[Signature, int] | None = None
    best_moves = 0
    for sig in signatures:
        cost = sum(
            transition(cur, req, shape, n, size, dtype, plane).bytes_per_device
            for cur, req, shape, size, dtype in zip(states, sig.inputs, shapes, itemsizes, dtypes)
        )
        moves = sum(cur != req for cur, req in zip(states, sig.inputs))
        if best is None or (cost, moves) < (best[1], best_moves):
            best, best_moves = (sig, cost), moves
    assert best is not None, "every rule offers the all-Mirrored signature"
    return best
