"""Layers placed on groups of the devices (a layer split): each layer's weights held by one
group and split inside it; the planner hands the activation over at each group boundary and
reduces inside the group; the workers outside a layer's group run nothing of it.

The oracle is NumPy on the whole arrays (models/reference.py's GELU); the collectives a plan
holds are counted from its moves, and the programs are read as compiled.
"""

from __future__ import annotations

import numpy as np
import pytest

from meta.compiler import compile_plan
from models.reference import gelu_tanh
from split_state import MIRRORED, Collective, Split
from split_state.ops import NOTHING
from split_state.states import Mirrored
from split_state.transitions import classify
from transport import protocol as p

pytestmark = pytest.mark.timeout(120)

# devices -> the groups of its layers (a lone device per group, uneven groups, two hosts of two)
GROUPS = {2: [(0,), (1,)], 3: [(0, 1), (2,)], 4: [(0, 1), (2, 3)], 5: [(0, 1, 2), (3, 4)]}


def spread(size: int, group: tuple[int, ...], n: int) -> tuple[int, ...]:
    """`size` rows cut evenly over the devices of `group`, none for the others (written out)."""
    extents = [0] * n
    for i, d in enumerate(group):
        extents[d] = size // len(group) + (i < size % len(group))
    return tuple(extents)


def residual_mlp(dev, x, w_up, w_down, group):
    """x + gelu(x @ w_up) @ w_down with the weights on `group`, split inside it."""
    n = dev.n
    up = dev.tensor(w_up, Split(1, (spread(w_up.shape[1], group, n),), on=group), name="w_up")
    down = dev.tensor(w_down, Split(0, (spread(w_down.shape[0], group, n),), on=group), name="w_down")
    return x + (x @ up).gelu() @ down


def weights(rng, layers: int, hidden: int = 8, ffn: int = 12):
    return [
        (
            rng.standard_normal((hidden, ffn)).astype(np.float32) / 3,
            rng.standard_normal((ffn, hidden)).astype(np.float32) / 3,
        )
        for _ in range(layers)
    ]


def reference(x, layers):
    for w_up, w_down in layers:
        x = x + gelu_tanh(x @ w_up) @ w_down
    return x


@pytest.mark.parametrize("n", sorted(GROUPS))
def test_layers_on_groups_equal_numpy_with_one_hand_over_a_boundary(sim, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    layers = weights(rng, 2)
    dev = sim(n)
    h = dev.tensor(x, name="x")
    for (w_up, w_down), group in zip(layers, GROUPS[n]):
        h = residual_mlp(dev, h, w_up, w_down, group)
    out = h.redistribute(MIRRORED)  # every worker holds the result, as a sampler needs it
    np.testing.assert_allclose(out.numpy(), reference(x, layers), rtol=1e-5, atol=1e-5)
    reduces = [Collective.ALL_REDUCE] if len(GROUPS[n][0]) > 1 else []
    last = [Collective.ALL_REDUCE] if len(GROUPS[n][1]) > 1 else []
    assert dev.last_plan.collectives() == reduces + [Collective.HAND_OVER] + last + [Collective.HAND_OVER]
    assert dev.last_plan.states[dev.last_plan.outputs[0]] == MIRRORED
    first, second = GROUPS[n]
    hand_overs = [
        (s.src, s.dst)
        for s in dev.last_plan.steps
        if isinstance(s, p.MoveStep) and classify(s.src, s.dst) is Collective.HAND_OVER
    ]
    assert hand_overs == [(Mirrored(on=first), Mirrored(on=second)), (Mirrored(on=second), MIRRORED)]


@pytest.mark.parametrize("n", [3, 4])
def test_a_worker_outside_a_layers_group_runs_nothing_of_it(sim, n):
    rng = np.random.default_rng(10 + n)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    (w_up, w_down), (w_up2, w_down2) = weights(rng, 2)
    dev = sim(n)
    first, second = GROUPS[n]
    h = residual_mlp(dev, dev.tensor(x), w_up, w_down, first)
    h = residual_mlp(dev, h, w_up2, w_down2, second)
    np.testing.assert_allclose(h.numpy(), reference(x, [(w_up, w_down), (w_up2, w_down2)]), rtol=1e-5, atol=1e-5)
    plan = dev.last_plan
    assert plan.states[plan.outputs[0]].on == second  # read back from the group's workers only
    programs = compile_plan(plan, n)
    for d in range(n):
        kinds = [s.op for s in programs[d] if isinstance(s, p.OpStep)]
        mine = sum(1 for s in plan.steps if isinstance(s, p.OpStep)) // 2  # each layer's op steps
        if d in first:
            assert kinds[:mine].count(NOTHING) == 0 and kinds[mine:] == [NOTHING] * mine, d
        else:
            assert kinds[:mine] == [NOTHING] * mine and NOTHING not in kinds[mine:], d


def test_a_weight_on_a_group_reads_back_whole(sim):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 10)).astype(np.float32)
    dev = sim(4)
    split = dev.tensor(w, Split(1, (spread(10, (2, 3), 4),), on=(2, 3)))
    mirrored = dev.tensor(w, Mirrored(on=(1,)))
    np.testing.assert_array_equal(split.numpy(), w)
    np.testing.assert_array_equal(mirrored.numpy(), w)
    np.testing.assert_array_equal((mirrored * 2.0).numpy(), 2 * w)


def test_layers_on_groups_of_worker_processes_over_tcp(procs3_tcp):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    layers = weights(rng, 3)
    dev = procs3_tcp
    h = dev.tensor(x)
    for (w_up, w_down), group in zip(layers, [(0, 1), (2,), (0, 1)]):
        h = residual_mlp(dev, h, w_up, w_down, group)
    np.testing.assert_allclose(h.numpy(), reference(x, layers), rtol=1e-5, atol=1e-5)
    assert dev.last_plan.count(Collective.HAND_OVER) == 2


@pytest.mark.parametrize("n", [2, 4])
def test_a_hand_over_lands_in_the_arena_the_same_buffer_every_run(sim, n):
    """A group's redistribution (the activation handed from one group to the next) and a local
    cut onto a group (the input, as a layer split's mask every layer reads) write their results
    into buffers of the program's arena, as the postboxes' all-reduce does: the kernels after
    them read the same arrays every run, so they stay planned (workers/straight.py; with new
    arrays each run every kernel after them was planned again each run, and a layer split of
    SmolLM2 on 2 workers decoded at 63 tok/s, one worker alone at 100). Runs with new inputs
    keep matching NumPy."""
    rng = np.random.default_rng(20 + n)
    layers = weights(rng, 2)
    dev = sim(n)
    first, second = GROUPS[n]
    for _ in range(3):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        h = dev.tensor(x)
        for (w_up, w_down), group in zip(layers, (first, second)):
            h = residual_mlp(dev, h, w_up, w_down, group)
        np.testing.assert_allclose(h.numpy(), reference(x, layers), rtol=1e-5, atol=1e-5)
    moves = [
        (pl.step.src, pl.step.dst, pl.out)
        for server in dev.cluster.servers
        for program in server.executor.programs.values()
        for pl in program.placed
        if isinstance(pl.step, p.MoveStep)
    ]
    for src, dst in [(MIRRORED, Mirrored(on=first)), (Mirrored(on=first), Mirrored(on=second))]:
        placed = {out for s, d, out in moves if (s, d) == (src, dst)}
        assert placed == {"arena"}, (src, dst, moves)
