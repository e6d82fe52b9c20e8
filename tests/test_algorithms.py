"""Collective algorithms: the bytes each worker actually sends equal what the planner charged.

Every transition between a set of states (Mirrored, Partial, even and uneven splits with empty
devices, several segments, another axis) runs on 1-8 ranks over in-process queues, at sizes on
both sides of the direct/two-phase all-reduce threshold. Each rank's comm counts the payload
bytes it sends; the algorithm `select` picked must have predicted exactly that, per rank.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest

from split_state import MIRRORED, PARTIAL, Split, apply_reference, scatter, select, transition
from split_state.algorithms import DIRECT_ALL_REDUCE_BYTES, Request
from tests.transport_helpers import on_ranks
from transport.deadline import Deadline
from workers.backends.cpu import Backend as NumpyBackend
from workers.collectives import Collectives, HostEngine
from workers.comm import QueueComm

pytestmark = pytest.mark.timeout(120)


def states_for(shape: tuple[int, ...], n: int) -> list:
    rows, cols = shape
    uneven = [0] * n
    uneven[0], uneven[-1] = rows - rows // 3, rows // 3  # device 1..n-2 hold nothing (n > 2)
    if n == 1:
        uneven = [rows]
    half = cols // 2
    return [
        MIRRORED,
        PARTIAL,
        Split.even(0, rows, n),
        Split(0, (tuple(uneven),)),
        Split.even(1, cols, n),
        Split.even(1, (half, cols - half), n),  # two segments
    ]


def run_on_ranks(n: int, x: np.ndarray, src, dst, contributions=None) -> tuple[list, list[int]]:
    """Run src -> dst on n threads; (each rank's result, each rank's bytes sent)."""
    queues = [queue.Queue() for _ in range(n)]
    comms = [QueueComm(r, queues) for r in range(n)]
    locals_ = contributions if contributions is not None else scatter(x, src, n)

    def rank_main(r: int):
        coll = Collectives(HostEngine(comms[r], NumpyBackend(0)))
        return coll.redistribute(locals_[r], src, dst, x.shape, 1, 0, Deadline(20))

    results = on_ranks(n, rank_main)
    return results, [c.bytes_sent for c in comms]


# rows x 128 float32: just under, at, and just over the direct all-reduce threshold, and small
ROWS = [DIRECT_ALL_REDUCE_BYTES // (128 * 4) - 1, DIRECT_ALL_REDUCE_BYTES // (128 * 4), 3]


@pytest.mark.parametrize("n", range(1, 9))
def test_bytes_sent_equal_the_charged_cost_for_every_transition(n):
    rng = np.random.default_rng(n)
    checked = 0
    for rows in ROWS + [DIRECT_ALL_REDUCE_BYTES // (128 * 4) + 1]:
        shape = (rows, 128)
        x = rng.standard_normal(shape).astype(np.float32)
        states = states_for(shape, n)
        big = rows * 128 * 4 > DIRECT_ALL_REDUCE_BYTES
        pairs = [(PARTIAL, MIRRORED)] if big else [(s, d) for s in states for d in states]
        for src, dst in pairs:
            parts = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)] if src == PARTIAL else None
            got, sent = run_on_ranks(n, x, src, dst, parts)
            r = Request(src, dst, shape, n, 4)
            algorithm = select(r)
            what = f"{src} -> {dst} on {n} ranks, {rows}x128 float32, {algorithm.name}"
            assert sent == list(algorithm.sent(r)), what
            assert transition(src, dst, shape, n, 4).bytes_per_device == max(sent) + algorithm.deferred(r), what
            expected = apply_reference(parts if parts is not None else scatter(x, src, n), src, dst)
            for g, e in zip(got, expected):
                assert g.shape == e.shape and g.tobytes() == e.tobytes(), what
            checked += 1
    assert checked == 3 * 36 + 1


def test_the_threshold_picks_the_algorithm():
    at = (DIRECT_ALL_REDUCE_BYTES // 4,)
    over = (DIRECT_ALL_REDUCE_BYTES // 4 + 1,)
    assert select(Request(PARTIAL, MIRRORED, at, 3, 4)).name == "direct_all_reduce"
    assert select(Request(PARTIAL, MIRRORED, over, 3, 4)).name == "reduce_scatter_all_gather"
    assert select(Request(PARTIAL, MIRRORED, over, 2, 4)).name == "direct_all_reduce"  # 2 ranks: one round
    assert select(Request(PARTIAL, MIRRORED, over, 3, 4, "float32", "nccl")).name == "native_all_reduce"
    assert select(Request(PARTIAL, MIRRORED, over, 3, 2, "int16", "nccl")).name != "native_all_reduce"


def test_mpi_gathers_and_scatters_one_block_per_rank_natively_and_charges_what_the_plan_moves():
    from split_state.algorithms import Exchange, ReduceScatter, Request, rank_blocks, select

    uneven = Split(0, ((5, 0, 3),))
    assert rank_blocks(uneven, (8, 4)) == (20, 0, 12)
    assert rank_blocks(Split(1, ((2, 6),)), (1, 8, 3)) == (6, 18)  # only size-1 axes before it
    assert rank_blocks(Split(1, ((2, 6),)), (2, 8)) is None
    assert rank_blocks(Split(0, ((2, 2), (1, 3))), (8,)) is None  # two segments: not one block each
    assert rank_blocks(MIRRORED, (8,)) is None

    def algorithm(src, dst, shape, dtype="float32", plane="mpi", n=3):
        return select(Request(src, dst, shape, n, 4 if dtype != "float16" else 2, dtype, plane))

    assert algorithm(PARTIAL, uneven, (8, 4)).name == "native_reduce_scatter"
    assert algorithm(PARTIAL, uneven, (8, 4), dtype="float16").name == "reduce_scatter"  # MPI cannot sum it
    assert algorithm(PARTIAL, uneven, (8, 4), plane="shm").name == "reduce_scatter"
    assert algorithm(uneven, MIRRORED, (8, 4), dtype="float16").name == "native_all_gather"  # bytes move
    assert algorithm(uneven, MIRRORED, (8, 4), plane="nccl").name == "exchange"
    assert algorithm(Split(1, ((2, 1, 1),)), MIRRORED, (2, 4)).name == "exchange"
    for src, dst, generic in ((PARTIAL, uneven, ReduceScatter()), (uneven, MIRRORED, Exchange())):
        r = Request(src, dst, (8, 4), 3, 4, "float32", "mpi")
        assert select(r).sent(r) == generic.sent(r)  # the plan's bytes, from transfers
