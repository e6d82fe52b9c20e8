"""Plans become one program per worker: local shapes and localised parameters. When a value dies
is the worker's to find (workers/program.py plans its arena by liveness), so nothing says it.

An op that runs on a group of the devices is localised as in a cluster of that group alone
(states restricted to it, the device renumbered in it); a worker outside the group holds
nothing of its result, and its program has a `nothing` step in the op's place (an empty array:
the step's value exists on every worker, so programs keep one numbering)."""

from __future__ import annotations

from meta.planner import Plan
from split_state.algorithms import cached_local_shape
from split_state.ops import NOTHING, localize
from split_state.states import restrict
from transport import protocol as p


def compile_plan(plan: Plan, n: int) -> list[list[p.Step]]:
    programs: list[list[p.Step]] = []
    for d in range(n):
        steps: list[p.Step] = []
        for i, step in enumerate(plan.steps):
            if isinstance(step, p.OpStep):
                choice = plan.choices.get(i)
                if choice is not None and choice.group is not None and d not in choice.group:
                    nothing = {"ndim": len(step.shape), "dtype": step.dtype}
                    steps.append(p.OpStep(NOTHING, (), step.output, nothing, (0,) * len(step.shape), step.dtype))
                    continue
                local = _local(plan, step, n, d) if choice is None else choice.local.get(d)
                if local is None:
                    local = choice.local[d] = _local(plan, step, n, d, choice.group)
                params, shape = local
                if params is not step.params or shape != step.shape:  # else the plan's step is this device's
                    # built directly (dataclasses.replace inspects the fields on every call)
                    step = p.OpStep(step.op, step.inputs, step.output, params, shape, step.dtype)
            steps.append(step)
        programs.append(steps)
    return programs


def _local(plan: Plan, step: p.OpStep, n: int, d: int, group=None) -> tuple[dict, tuple[int, ...]]:
    """Device d's parameters and output shape of an op step (the step's own parameters object
    where localising changes nothing); on a group, as device `group.index(d)` of a cluster of
    the group alone."""
    in_states = tuple(plan.states[v] for v in step.inputs)
    in_shapes = tuple(plan.shapes[v] for v in step.inputs)
    out_state = plan.states[step.output]
    shape = cached_local_shape(out_state, tuple(step.shape), n, d)
    if group is not None:
        in_states = tuple(restrict(s, group) for s in in_states)
        out_state, n, d = restrict(out_state, group), len(group), group.index(d)
    params = localize(step.op, step.params, in_states, in_shapes, out_state, step.shape, n, d)
    return params, shape


def structural_key(leaves, order, outputs) -> tuple:
    """Equal for graphs of the same ops, parameters, shapes, dtypes and input states."""
    index = {leaf.id: i for i, leaf in enumerate(leaves)}
    parts: list[tuple] = [("in", leaf.shape, leaf.dtype, leaf.state) for leaf in leaves]
    for j, node in enumerate(order):
        index[node.id] = len(leaves) + j
        parts.append((node.op, tuple(index[c.id] for c in node.inputs), node.params_key, node.shape, node.dtype))
    parts.append(("out", tuple(index[o.id] for o in outputs)))
    return tuple(parts)
