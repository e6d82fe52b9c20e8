"""The CUDA IPC plane (workers/planes/ipc/engine.py) on the CuPy stand-in, three workers sharing device 0:
all-reduces above the one-shot size take two shots, tensors above a buffer half go in pieces,
and phases whose sends do not fit a half go through host memory; every result has the bits of
the rank-order sum or the host reference. (The small cases, every transition on this plane, are
tests/test_collectives.py's `cuda3` rows; the decode and LLM suites run on it as `cuda2`.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from meta import MetaDevice
from split_state import MIRRORED, PARTIAL, Split, apply_reference
from split_state.errors import MetaError, TransportError
from split_state.scatter import check_identical
from tests.conftest import IPC_REGION_MIB, _ipc_env
from tests.test_collectives import assert_bitwise, rank_order_sum, run_transition
from transport import protocol as p
from workers.planes.ipc import engine as ipc

HALF = IPC_REGION_MIB << 20  # the bytes of a half in the cuda3 fixture's workers

pytestmark = pytest.mark.timeout(180)


def test_the_cuda_workers_sharing_a_device_joined_the_ipc_plane(cuda3):
    assert {d["data_plane"] for d in cuda3.cluster.data_planes} == {"ipc"}


@pytest.mark.parametrize(
    "elements",
    [
        ipc.ONE_SHOT_BYTES // 4 + 5,  # two shots, uneven chunks
        HALF // 4 * 2 + 7,  # two whole halves' pieces and a remainder
    ],
)
def test_large_all_reduces_take_two_shots_in_pieces_and_give_the_rank_order_sum(cuda3, elements):
    n = cuda3.n
    x = np.zeros((elements,), np.float32)
    program = 10 + elements % 89
    locals_, got = run_transition(cuda3.cluster.call_all, n, x, PARTIAL, MIRRORED, program=program, run=program)
    assert_bitwise(got, [rank_order_sum(locals_)] * n)
    check_identical(got)


def test_a_phase_whose_sends_do_not_fit_a_half_goes_through_host_memory(cuda3):
    n = cuda3.n
    share = HALF // 4 // (n - 1) + 64  # each rank sends its share to n - 1 peers: over a half
    x = np.random.default_rng(3).standard_normal((n * share,)).astype(np.float32)
    src = Split.even(0, x.shape[0], n)
    locals_, got = run_transition(cuda3.cluster.call_all, n, x, src, MIRRORED, program=200, run=200)
    assert_bitwise(got, apply_reference(locals_, src, MIRRORED))


@pytest.mark.parametrize("text", ["0", "-4", "eight", "1.5"])
def test_a_half_size_that_is_not_a_whole_positive_mib_count_is_refused_by_name(monkeypatch, text):
    monkeypatch.setenv(ipc.REGION_ENV, text)
    with pytest.raises(TransportError, match=f"{ipc.REGION_ENV}={text!r}"):
        ipc.region_mib()
    monkeypatch.setenv(ipc.REGION_ENV, "3")
    assert ipc.region_mib() == 3


def test_a_chain_that_failed_on_one_rank_part_way_leaves_the_plane_usable(fresh_cluster):
    """The same through a chain: its second call fails on worker 1 alone (a weight it lacks)
    after the first call's all-reduce; the coordinator resyncs the plane, and the next chains
    give NumPy's result."""
    from meta.steps import Earlier

    dev = MetaDevice(fresh_cluster(3, backend="cuda", devices=(0, 0, 0), env=_ipc_env(), data_plane="ipc"))
    rng = np.random.default_rng(8)
    x_host = rng.integers(-2, 3, (4, 6)).astype(np.float32)
    w_hosts = [rng.integers(-2, 3, (6, 6)).astype(np.float32) for _ in range(3)]
    ws = [dev.tensor(w, Split.even(0, 6, 3)) for w in w_hosts]
    x = dev.tensor(x_host)

    def layer(h, w):
        return [(h @ w).redistribute(MIRRORED)]

    step = dev.prepare(layer, x, ws[0])

    def chained(a, b):
        return dev.chain([(step, (x, a)), (step, (Earlier(0, 0), b))], read=[0])[-1][0].numpy()

    assert np.array_equal(chained(ws[0], ws[1]), x_host @ w_hosts[0] @ w_hosts[1])
    dev.cluster.call_all({1: p.Free([ws[2].node.tensor])})  # worker 1 alone loses its slice
    with pytest.raises(MetaError, match="worker 1"):
        chained(ws[0], ws[2])
    for a, b in [(0, 1), (1, 0), (1, 1)]:  # more than one operation: both halves of the buffers
        assert np.array_equal(chained(ws[a], ws[b]), x_host @ w_hosts[a] @ w_hosts[b])


def test_a_run_that_failed_on_one_rank_before_a_collective_leaves_the_plane_usable(fresh_cluster):
    """Worker 1 lacks an input, so it fails before the all-reduce its peers begin: their
    operation counts then differ from its own. The failure reaches the peers at once (not at
    their collective deadline), the coordinator resyncs the plane, and the next runs on the same
    workers give NumPy's result (integers: every summation order gives the same bits)."""
    dev = MetaDevice(fresh_cluster(3, backend="cuda", devices=(0, 0, 0), env=_ipc_env(), data_plane="ipc"))
    rng = np.random.default_rng(7)
    a_host = rng.integers(-4, 5, (4, 6)).astype(np.float32)
    b_host = rng.integers(-4, 5, (6, 5)).astype(np.float32)
    a = dev.tensor(a_host, Split.even(1, 6, 3))
    b = dev.tensor(b_host, Split.even(0, 6, 3))
    assert np.array_equal((a @ b).redistribute(MIRRORED).numpy(), a_host @ b_host)  # a working plane
    dev.cluster.call_all({1: p.Free([b.node.tensor])})  # worker 1 alone loses its slice of b
    start = time.monotonic()
    with pytest.raises(MetaError, match="worker 1"):
        (a @ b).redistribute(MIRRORED).numpy()
    assert time.monotonic() - start < 10, "the peers waited out their collective deadline"
    for seed in range(3):  # more than one operation: both halves of the buffers in use again
        b2_host = np.random.default_rng(seed).integers(-4, 5, (6, 5)).astype(np.float32)
        b2 = dev.tensor(b2_host, Split.even(0, 6, 3))
        assert np.array_equal((a @ b2).redistribute(MIRRORED).numpy(), a_host @ b2_host)
