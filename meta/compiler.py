"""Plans become one program per worker: local shapes, localised parameters, frees after last use."""

from __future__ import annotations

from meta.planner import Plan, PlanOp
from split_state.layout import local_shape
from split_state.ops import localize
from transport import protocol as p


def compile_plan(plan: Plan, n: int) -> list[list[p.Step]]:
    last_use: dict[int, int] = {}
    for i, step in enumerate(plan.steps):
        for v in step.inputs if isinstance(step, PlanOp) else (step.input,):
            last_use[v] = i
    keep = set(plan.outputs) | set(range(plan.n_inputs))  # outputs stay; inputs belong to the store
    programs: list[list[p.Step]] = []
    for d in range(n):
        steps: list[p.Step] = []
        for i, step in enumerate(plan.steps):
            if isinstance(step, PlanOp):
                params = localize(step.op, step.params, step.in_states, step.in_shapes, step.state, step.shape, n, d)
                steps.append(
                    p.OpStep(
                        step.op, step.inputs, step.output, params, local_shape(step.state, step.shape, n, d), step.dtype
                    )
                )
            else:
                steps.append(p.MoveStep(step.input, step.output, step.src, step.dst, step.shape, step.dtype))
            dead = tuple(sorted(v for v, at in last_use.items() if at == i and v not in keep))
            if dead:
                steps.append(p.FreeStep(dead))
        programs.append(steps)
    return programs


def structural_key(leaves, order, outputs) -> tuple:
    """Equal for graphs of the same ops, parameters, shapes, dtypes and input states."""
    index = {leaf.id: i for i, leaf in enumerate(leaves)}
    parts: list[tuple] = [("in", leaf.shape, leaf.dtype, leaf.state) for leaf in leaves]
    for j, node in enumerate(order):
        index[node.id] = len(leaves) + j
        parts.append((node.op, tuple(index[c.id] for c in node.inputs), _hashable(node.params), node.shape, node.dtype))
    parts.append(("out", tuple(index[o.id] for o in outputs)))
    return tuple(parts)


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value
