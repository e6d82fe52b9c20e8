"""Worker behaviour: error replies, memory budget, liveness, orphans, the CuPy backend."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from meta import MetaDevice
from meta.cluster import alive
from split_state import MIRRORED, OutOfMemory, ShapeError, Split
from transport import protocol as p
from workers.backends.cuda import Backend as CudaBackend

pytestmark = pytest.mark.timeout(120)


def test_failing_op_returns_error_with_traceback_and_worker_stays_usable(procs2):
    dev = procs2
    table = dev.tensor(np.arange(12, dtype=np.float32).reshape(4, 3), Split.even(0, 4, 2))
    ids = dev.tensor(np.array([0, 9], dtype=np.int32))  # 9 is out of range
    with pytest.raises(ShapeError, match=r"ids must lie in \[0, 4\)") as info:
        from meta import get_rows

        get_rows(table, ids).numpy()
    assert "Traceback" in info.value.remote_traceback
    # the same workers still serve, and the stored table is intact
    assert np.array_equal(table.numpy(), np.arange(12, dtype=np.float32).reshape(4, 3))
    good = dev.tensor(np.array([3, 0], dtype=np.int32))
    assert np.array_equal(get_rows(table, good).numpy(), np.array([[9, 10, 11], [0, 1, 2]], np.float32))


def test_memory_budget_refuses_and_leaves_stored_tensors_intact(fresh_cluster):
    dev = MetaDevice(fresh_cluster(2, memory_budget=4096))
    small = dev.tensor(np.arange(256, dtype=np.float32), Split.even(0, 256, 2))  # 512 B per worker
    with pytest.raises(OutOfMemory, match="budget"):
        dev.tensor(np.ones(4096, np.float32), MIRRORED)  # 16 KiB per worker
    # an intermediate past the budget fails the run, not the store
    with pytest.raises(OutOfMemory):
        (small.redistribute(MIRRORED).reshape(1, 256).T @ small.redistribute(MIRRORED).reshape(1, 256)).numpy()
    assert np.array_equal(small.numpy(), np.arange(256, dtype=np.float32))
    stats = dev.stats()
    assert all(s["used"] == 512 for s in stats.values()), stats


COORDINATOR = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from meta import ClusterConfig, ProcessCluster
    cluster = ProcessCluster(ClusterConfig(workers=2, liveness=2.0))
    print(" ".join(str(pid) for pid in cluster.pids.values()), cluster.ipc.path, flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_workers_exit_when_their_coordinator_dies(how):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    coordinator = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR.format(root=root)], stdout=subprocess.PIPE, text=True
    )
    try:
        *pids, ipc_dir = coordinator.stdout.readline().split()
        pids = [int(x) for x in pids]
        assert len(pids) == 2 and alive(pids) == pids and os.path.isdir(ipc_dir)
        if how == "sigkill":
            coordinator.kill()
        else:
            coordinator.terminate()
        coordinator.wait(5)
        deadline = time.monotonic() + 8.0
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive(pids) == [], "workers outlived their coordinator"
        assert not os.path.exists(ipc_dir), "the dead coordinator's socket directory was left behind"
    finally:
        coordinator.kill()
        coordinator.wait()


def test_put_with_wrong_local_shape_is_refused(procs2):
    reply = procs2.cluster.call_all({0: p.Put(999, Split(0, ((2, 2),)), (4,), np.zeros(3, np.float32))})
    assert isinstance(reply[0], p.Error) and reply[0].kind == "SplitError" and "needs (2,)" in reply[0].message


@pytest.mark.skipif(CudaBackend.device_count() == 0, reason="needs CuPy and a CUDA device")
def test_cupy_backend_runs_kernels_and_transfers():
    from workers.kernels import KERNELS

    backend = CudaBackend(0)
    a = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((32, 16)).astype(np.float32)
    got = backend.to_host(KERNELS["matmul"](backend.xp, [backend.to_device(a), backend.to_device(b)], {}))
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)
    assert backend.info().memory_total > 0


@pytest.mark.skipif(CudaBackend.device_count() == 0, reason="needs CuPy and a CUDA device")
def test_two_cuda_workers_sharing_one_gpu(fresh_cluster):
    dev = MetaDevice(fresh_cluster(2, backend="cuda", devices=(0, 0)))
    assert {d["data_plane"] for d in dev.cluster.data_planes} == {"ipc"}, "auto's choice for one shared GPU"
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32)
    y = (dev.tensor(x, Split.even(1, 64, 2)) @ dev.tensor(w, Split.even(0, 64, 2))).redistribute(MIRRORED)
    np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-4, atol=1e-4)


def test_a_flushed_zmq_send_is_done_with_its_array_so_the_program_may_write_it_again():
    """ZeroMQ sends a large frame (COPY_THRESHOLD bytes or more) from the array itself, after
    send returns; a collective flushes before it returns and the program then writes its
    buffers again (the next layer's product). So flush waits until ZeroMQ is done with them:
    every array written over right after the flush still arrives as it was sent (without the
    wait, each of them arrived as -1s)."""
    import zmq

    from transport.deadline import Deadline
    from transport.sockets import IpcDir, Security, pull
    from workers.comm import ZmqComm

    ctx, ipc = zmq.Context(), IpcDir()
    security = Security(ctx, None)
    inbox0, ep0 = pull(ctx, ipc.endpoint("d0"), security)
    inbox1, ep1 = pull(ctx, ipc.endpoint("d1"), security)
    a = ZmqComm(0, inbox0, [ep0, ep1], ctx, security)
    b = ZmqComm(1, inbox1, [ep0, ep1], ctx, security)
    buffer = np.zeros(1 << 20, np.float32)  # 4 MiB: sent in place
    try:
        for step in range(5):
            buffer[:] = step
            a.send(1, 7, step, buffer)
            a.flush(7, Deadline(5))
            buffer[:] = -1
        for step in range(5):
            got = b.recv(0, 7, step, Deadline(5))
            assert got.min() == got.max() == step, (step, got.min(), got.max())
    finally:
        for comm in (a, b):
            comm.close()
        for sock in (inbox0, inbox1):
            sock.close(0)
        ctx.term()
        ipc.close()


def test_data_plane_drops_foreign_messages_and_keeps_waiting():
    import zmq

    from transport.deadline import Deadline
    from transport.sockets import IpcDir, Security, pull, push
    from workers.comm import ZmqComm

    ctx, ipc = zmq.Context(), IpcDir()
    security = Security(ctx, None)
    inbox0, ep0 = pull(ctx, ipc.endpoint("d0"), security)
    inbox1, ep1 = pull(ctx, ipc.endpoint("d1"), security)
    comm = ZmqComm(1, inbox1, [ep0, ep1], ctx, security)
    sender = push(ctx, ep1, security)
    try:
        queued = [
            [b"junk"],
            p.encode(p.Hello(0, 0, "", "", 0, 0, "")),
            p.encode(p.Get(1)),
            p.encode(p.Chunk(0, 1, 0, np.arange(3.0))),
        ]
        for frames in queued:  # foreign and malformed messages ahead of the real data
            sender.send_multipart(frames)
        time.sleep(0.2)
        assert np.array_equal(comm.recv(0, 1, 0, Deadline(5)), np.arange(3.0))
    finally:
        comm.close()
        for sock in (sender, inbox0, inbox1):
            sock.close(0)
        ctx.term()
        ipc.close()
