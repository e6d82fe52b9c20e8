"""Plans become one program per worker: local shapes, localised parameters, frees after last use."""

from __future__ import annotations

from meta.planner import Plan
from split_state.algorithms import cached_local_shape
from split_state.ops import localize
from transport import protocol as p


def compile_plan(plan: Plan, n: int) -> list[list[p.Step]]:
    last_use: dict[int, int] = {}
    for i, step in enumerate(plan.steps):
        for v in step.inputs if isinstance(step, p.OpStep) else (step.input,):
            last_use[v] = i
    keep = set(plan.outputs) | set(range(plan.n_inputs))  # outputs stay; inputs belong to the store
    dies_at: dict[int, list[int]] = {}
    for v, at in last_use.items():
        if v not in keep:
            dies_at.setdefault(at, []).append(v)
    programs: list[list[p.Step]] = []
    for d in range(n):
        steps: list[p.Step] = []
        for i, step in enumerate(plan.steps):
            steps.append(_localize(plan, step, n, d) if isinstance(step, p.OpStep) else step)
            if i in dies_at:
                steps.append(p.FreeStep(tuple(sorted(dies_at[i]))))
        programs.append(steps)
    return programs


def _localize(plan: Plan, step: p.OpStep, n: int, d: int) -> p.OpStep:
    """Device d's version of an op step: its local output shape and localised parameters."""
    in_states = tuple(plan.states[v] for v in step.inputs)
    in_shapes = tuple(plan.shapes[v] for v in step.inputs)
    out_state = plan.states[step.output]
    params = localize(step.op, step.params, in_states, in_shapes, out_state, step.shape, n, d)
    # built directly (dataclasses.replace inspects the fields on every call): a prefill's plan
    # has ~1,400 op steps per device
    return p.OpStep(
        step.op, step.inputs, step.output, params, cached_local_shape(out_state, tuple(step.shape), n, d), step.dtype
    )


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
