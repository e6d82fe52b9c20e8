"""The lazy graph: nodes record ops; a node becomes resident once a run has produced it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from meta.memo import frozen
from split_state.ops import OPS
from split_state.states import State

MOVE = "redistribute"  # pseudo-op: the user asked for a state; the planner inserts the move

_ids = itertools.count()


@dataclass(eq=False)
class Node:
    op: str  # an op of split_state.ops.OPS, MOVE, or "" for a resident tensor
    inputs: tuple[Node, ...]
    params: dict[str, Any]
    shape: tuple[int, ...]
    dtype: str
    name: str = ""
    id: int = field(default_factory=lambda: next(_ids))
    # set once resident on the workers
    tensor: int | None = None
    state: State | None = None
    finalizer: Any = None  # releases the storage when the node is garbage collected
    alias: Node | None = None  # an in-place write's result: the resident node whose storage it is
    host: Any = None  # its global value, when the run that made it read it back (Step's `read`)
    # frozen(params), worked out once: the plan cache's key and the planner's choices both need it
    frozen_params: Any = field(default=None, repr=False)

    @property
    def params_key(self) -> tuple:
        if self.frozen_params is None:
            self.frozen_params = frozen(self.params)
        return self.frozen_params

    @property
    def resident(self) -> bool:
        return self.tensor is not None

    @property
    def freed(self) -> bool:
        """A handle whose storage was freed: no value, no recipe to compute one again."""
        return self.tensor is None and self.op == ""


def topo_order(outputs: list[Node]) -> tuple[list[Node], list[Node]]:
    """(resident leaves, nodes to compute) reachable from `outputs`, each in a deterministic order."""
    leaves: list[Node] = []
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(n, False) for n in reversed(outputs)]
    while stack:
        node, expanded = stack.pop()
        if node.id in seen and not expanded:
            continue
        if node.resident:
            seen.add(node.id)
            leaves.append(node)
            continue
        if expanded:
            order.append(node)
            continue
        seen.add(node.id)
        stack.append((node, True))
        for child in reversed(node.inputs):
            if child.id not in seen:
                stack.append((child, False))
    return leaves, order


def last_writes(order: list[Node]) -> dict[Node, Node]:
    """The last in-place write (a chain's outermost) into each resident tensor among the nodes
    a run computed, and that tensor: after the run its storage holds that node's value. A
    decode step's cache writes (not outputs of it) were left as recipes, and the next graph
    over the caches ran them again."""
    last: dict[int, tuple[Node, Node]] = {}
    for node in order:
        if node.op in OPS and OPS[node.op].inplace:
            root = written_into(node)
            if root is not None:
                last[id(root)] = (node, root)
    return dict(last.values())


def written_into(node: Node) -> Node | None:
    """The resident node an in-place op (a chain of them) writes into, if any."""
    start = node
    while node.op in OPS and OPS[node.op].inplace:
        node = node.inputs[0]
    if node is start or not node.resident:
        return None
    return node.alias or node
