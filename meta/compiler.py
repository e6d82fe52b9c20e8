"""Plans become one program per worker: local shapes and localised parameters. When a value dies
is the worker's to find (workers/program.py plans its arena by liveness), so nothing says it."""

from __future__ import annotations

from meta.planner import Plan
from split_state.algorithms import cached_local_shape
from split_state.ops import localize
from transport import protocol as p


def compile_plan(plan: Plan, n: int) -> list[list[p.Step]]:
    programs: list[list[p.Step]] = []
    for d in range(n):
        steps: list[p.Step] = []
        for i, step in enumerate(plan.steps):
            if isinstance(step, p.OpStep):
                choice = plan.choices.get(i)
                local = _local(plan, step, n, d) if choice is None else choice.local.get(d)
                if local is None:
                    local = choice.local[d] = _local(plan, step, n, d)
                params, shape = local
                if params is not step.params or shape != step.shape:  # else the plan's step is this device's
                    # built directly (dataclasses.replace inspects the fields on every call)
                    step = p.OpStep(step.op, step.inputs, step.output, params, shape, step.dtype)
            steps.append(step)
        programs.append(steps)
    return programs


def _local(plan: Plan, step: p.OpStep, n: int, d: int) -> tuple[dict, tuple[int, ...]]:
    """Device d's parameters and output shape of an op step (the step's own parameters object
    where localising changes nothing)."""
    in_states = tuple(plan.states[v] for v in step.inputs)
    in_shapes = tuple(plan.shapes[v] for v in step.inputs)
    out_state = plan.states[step.output]
    params = localize(step.op, step.params, in_states, in_shapes, out_state, step.shape, n, d)
    return params, cached_local_shape(out_state, tuple(step.shape), n, d)


def structural_key(leaves, order, outputs) -> tuple:
    """Equal for graphs of the same ops, parameters, shapes, dtypes and input states."""
    index = {leaf.id: i for i, leaf in enumerate(leaves)}
    parts: list[tuple] = [("in", leaf.shape, leaf.dtype, leaf.state) for leaf in leaves]
    for j, node in enumerate(order):
        index[node.id] = len(leaves) + j
        parts.append((node.op, tuple(index[c.id] for c in node.inputs), node.params_key, node.shape, node.dtype))
    parts.append(("out", tuple(index[o.id] for o in outputs)))
    return tuple(parts)
