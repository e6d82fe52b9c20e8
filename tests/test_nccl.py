"""The NCCL data plane's logic, with a host stand-in for the library (no GPUs needed).

`NcclEngine` runs every collective algorithm with NCCL calls; here those calls run on NumPy arrays
among threads, so the plans, buffer shapes, rank-order sums and abort handling are checked. The
real library runs only where CuPy sees two GPUs (see the test at the end)."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from meta.cluster import ClusterConfig, ProcessCluster
from split_state import MIRRORED, PARTIAL, Split
from split_state.errors import MetaError, RemoteError, TransportError, UnsupportedDtype, WorkerLost
from tests.test_collectives import CASES, assert_bitwise, expected_locals, inputs_for, resolve
from tests.transport_helpers import on_ranks
from transport.deadline import Deadline
from transport.sockets import IpcDir, Security, pull
from workers.backends.cpu import Backend as NumpyBackend
from workers.backends.cuda import Backend as CudaBackend
from workers.collectives import Collectives
from workers.planes.nccl.engine import NcclComm, NcclEngine, nccl_available, nccl_type

pytestmark = pytest.mark.timeout(60)


class HostNccl:
    """What NCCL does, for n ranks in threads: point-to-point queues and a summing all-reduce."""

    def __init__(self, n: int):
        self.n = n
        self.queues = {(s, d): queue.Queue() for s in range(n) for d in range(n)}
        self.barrier = threading.Barrier(n, timeout=10)
        self.contributions: list = [None] * n
        self.calls: list[tuple[int, str]] = []

    def device(self, rank: int) -> SimpleNamespace:
        def all_reduce(array):
            self.calls.append((rank, "all_reduce"))
            self.contributions[rank] = array.copy()
            self.barrier.wait()
            total = self.contributions[0] + self.contributions[1] if self.n > 1 else self.contributions[0].copy()
            for part in self.contributions[2:]:
                total += part
            self.barrier.wait()
            array[...] = total

        def exchange(sends, recvs):
            self.calls.append((rank, "exchange"))
            for array, peer in sends:
                assert array.flags.c_contiguous and peer != rank
                self.queues[(rank, peer)].put(array.copy())
            for array, peer in recvs:
                got = self.queues[(peer, rank)].get(timeout=10)
                assert got.shape == array.shape and got.dtype == array.dtype, (got.shape, array.shape)
                array[...] = got

        return SimpleNamespace(all_reduce=all_reduce, exchange=exchange, done=lambda: True, capturing=lambda: False)


class ThreadComm:
    plane = "nccl"

    def __init__(self, rank: int, n: int, device):
        self.rank, self.size, self.device, self.waited = rank, n, device, 0.0

    def wait(self, run, deadline) -> None:
        pass

    def check_usable(self) -> None:
        pass


def run_ranks(n: int, x: np.ndarray, src, dst) -> tuple[list, list, HostNccl]:
    lib = HostNccl(n)
    locals_ = inputs_for(x, src, n)

    def rank_main(r: int):
        coll = Collectives(NcclEngine(ThreadComm(r, n, lib.device(r)), NumpyBackend(0)))
        return coll.redistribute(locals_[r], src, dst, x.shape, 1, 0, Deadline(10))

    results = on_ranks(n, rank_main, timeout=20)
    return locals_, results, lib


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[1]}")
def test_nccl_collectives_give_the_reference_bits(case, n):
    shape = (7, 5)
    src, dst = (resolve(c, n, shape) for c in case)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    locals_, got, lib = run_ranks(n, x, src, dst)
    assert_bitwise(got, expected_locals(locals_, src, dst))
    kinds = {kind for _, kind in lib.calls}
    if n > 1 and src == PARTIAL and dst == MIRRORED:
        assert kinds == {"all_reduce"}  # one library all-reduce, not point-to-point
    elif n > 1 and src != dst and "exchange" not in kinds:
        assert src == MIRRORED or dst == PARTIAL  # only local slicing or embedding moves nothing


def test_nccl_reduce_scatter_of_large_uneven_boxes():
    n, shape = 3, (64, 300)
    dst = Split(0, ((40, 0, 24),))
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    locals_, got, _ = run_ranks(n, x, PARTIAL, dst)
    assert_bitwise(got, expected_locals(locals_, PARTIAL, dst))


def test_nccl_types_cover_the_supported_dtypes():
    assert nccl_type(np.float32) == 7 and nccl_type(np.float16) == 6 and nccl_type(np.int64) == 4
    with pytest.raises(UnsupportedDtype, match="no NCCL equivalent"):
        nccl_type(np.int16)


def test_all_reduce_of_a_type_nccl_cannot_sum_goes_point_to_point():
    x = np.arange(35, dtype=np.int16).reshape(7, 5)
    locals_, got, lib = run_ranks(3, x, PARTIAL, MIRRORED)
    assert_bitwise(got, expected_locals(locals_, PARTIAL, MIRRORED))
    assert {kind for _, kind in lib.calls} == {"exchange"}


class StuckDevice:
    """A GPU whose collective never completes (a peer died inside NCCL)."""

    def __init__(self):
        self.aborted = 0

    def done(self) -> bool:
        return False

    def capturing(self) -> bool:
        return False

    def abort(self) -> None:
        self.aborted += 1

    def close(self) -> None:
        raise AssertionError("an aborted communicator must not be destroyed again")


@pytest.fixture
def nccl_comm():
    ctx, ipc = zmq.Context(), IpcDir()
    security = Security(ctx, None)
    inbox, ep = pull(ctx, ipc.endpoint("d1"), security)
    other, ep0 = pull(ctx, ipc.endpoint("d0"), security)
    device = StuckDevice()
    comm = NcclComm(1, inbox, [ep0, ep], ctx, security, device)
    peer = NcclComm(0, other, [ep0, ep], ctx, security, SimpleNamespace(close=lambda: None))
    yield comm, peer, device
    comm.close()
    peer.close()
    inbox.close(0)
    other.close(0)
    ctx.term()
    ipc.close()


def test_a_stuck_nccl_collective_aborts_the_communicator_at_the_deadline(nccl_comm):
    comm, _, device = nccl_comm
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="did not finish within 0.3 s"):
        comm.wait(1, Deadline(0.3))
    assert time.monotonic() - start < 2 and device.aborted == 1
    with pytest.raises(TransportError, match="NCCL communicator was aborted"):
        comm.check_usable()


def test_a_replayed_graph_is_waited_for_with_the_deadline_and_collectives_are_not_while_captured(nccl_comm):
    """A decode step's graph holds its NCCL collectives (NcclEngine.captures): while its stream is
    captured, a collective is recorded and not waited for (a capturing stream cannot be
    queried); a program holding them waits for the device through wait_device, which a lost
    peer (a collective that never completes) ends at the deadline with the communicator aborted,
    where a plain synchronize would wait forever."""
    from split_state.algorithms import Tag

    comm, _, device = nccl_comm
    posted = []
    device.all_reduce = posted.append
    device.capturing = lambda: True
    engine = NcclEngine(comm, SimpleNamespace(xp=np))
    assert engine.captures
    out = engine.all_reduce(np.ones(4, np.float32), Tag(1, 0, Deadline(0.3)))  # captured: returns at once
    assert len(posted) == 1 and posted[0] is out and device.aborted == 0
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="did not finish within 0.3 s"):
        engine.wait_device(2, Deadline(0.3))
    assert time.monotonic() - start < 2 and device.aborted == 1
    assert comm.waited == 0  # waiting for a whole program is not waiting on peers


def test_a_peer_abort_ends_an_nccl_wait_at_once(nccl_comm):
    comm, peer, device = nccl_comm
    peer.abort(4, "ValueError", "bad op")
    start = time.monotonic()
    with pytest.raises(RemoteError, match="worker 0 reports ValueError: bad op"):
        comm.wait(4, Deadline(10))
    assert time.monotonic() - start < 2 and device.aborted == 1


def test_data_plane_choice_follows_what_the_workers_say_they_can_join():
    from transport import protocol as p

    def choose(planes=(("shm", "zmq"), ("shm", "zmq")), on=None, at=None, keys=None, **config):
        on = on or [-1] * len(planes)  # the GPU each worker says it runs on
        at = at or ["ipc://here"] * len(planes)  # where each worker's data inbox is
        hellos = [p.Hello(r, 1, "x", "", 0, 0, at[r], list(joins), on[r]) for r, joins in enumerate(planes)]
        cluster = SimpleNamespace(config=ClusterConfig(**config), world_size=len(planes), devices=hellos, keys=keys)
        return ProcessCluster._data_plane(cluster)

    nccl = (("shm", "zmq", "nccl"), ("shm", "zmq", "nccl"))
    assert choose() == "shm"
    assert choose(data_plane="zmq") == "zmq"
    assert choose(nccl, backend="cuda", devices=(0, 1)) == "nccl"
    assert choose(nccl, backend="cuda", devices=(0, 0)) == "shm"  # one GPU: NCCL refuses two ranks on it
    assert choose((nccl[0], ("shm", "zmq")), backend="cuda", devices=(0, 1)) == "shm"  # rank 1 has no NCCL
    ipc = (("ipc", "shm", "zmq", "nccl"), ("ipc", "shm", "zmq", "nccl"))  # CuPy workers on this host
    assert choose(ipc, backend="cuda", devices=(0, 1)) == "nccl"
    assert choose(ipc, backend="cuda", devices=(0, 0)) == "ipc"  # one GPU shared: NCCL refuses, IPC serves
    assert choose(ipc, backend="cuda", devices=(0, 0), local_workers=1) == "shm"  # the rest join from elsewhere
    assert choose((*ipc, ipc[0]), backend="cuda", devices=(0, 0, 1)) == "shm"  # no peer access assumed
    assert choose((ipc[0], ("shm", "zmq")), backend="cuda", devices=(0, 0)) == "shm"  # rank 1 cannot join it
    assert choose(ipc, backend="cpu") == "shm"
    # without --devices the workers take GPUs round the ones there are: what they say counts
    assert choose(ipc, on=(0, 0), backend="cuda") == "ipc"  # one GPU on this host
    assert choose(ipc, on=(0, 1), backend="cuda") == "nccl"
    assert choose(ipc, backend="cuda", devices=(0, 0), data_plane="ipc") == "ipc"
    mpi = (("shm", "zmq", "mpi"), ("zmq", "mpi"))  # the ranks of an MPI job, maybe on two hosts
    assert choose(mpi) == "mpi"
    assert choose((mpi[0], ("shm", "zmq"))) == "shm"  # rank 1 was not started by the job
    assert choose((mpi[0], mpi[0]), data_plane="shm") == "shm"
    assert choose(mpi[:1]) == "shm"  # one worker: nobody to reduce with
    tcp = (("shm", "tcp", "zmq"), ("shm", "tcp", "zmq"))
    two_hosts = ["tcp://127.0.0.1:5000", "tcp://10.1.2.3:5000"]
    assert choose(tcp) == "shm"  # one host
    assert choose(tcp, at=["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]) == "shm"
    assert choose(tcp, at=["tcp://10.1.2.3:5000", "tcp://10.1.2.3:5001"]) == "shm"
    assert choose(tcp, at=two_hosts) == "tcp"  # several hosts: plain sockets
    assert choose(tcp, at=two_hosts, keys=object()) == "shm"  # with keys the data stays on CURVE
    assert choose((tcp[0], ("shm", "zmq")), at=two_hosts) == "shm"  # rank 1 cannot join it
    with pytest.raises(MetaError, match=r"workers \[0, 1\] cannot join it"):
        choose(data_plane="nccl")
    with pytest.raises(MetaError, match=r"'carrier_pigeon': workers \[0, 1\] cannot join it"):
        choose(data_plane="carrier_pigeon")
    with pytest.raises(MetaError, match="data_plane must be 'auto' or a plane's name"):
        ProcessCluster(ClusterConfig(data_plane="carrier pigeon"))


def test_the_coordinator_does_not_import_the_workers():
    """meta/ and workers/ are siblings over transport/ and split_state/: what the coordinator
    needs of the workers (backends, NCCL, the CPU binding's variable) it asks or reads there."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "meta"
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "workers"]
    assert found == []


def test_the_backends_are_asked_of_a_worker_process():
    from meta.backends import local_backends, resolve

    assert resolve("cpu").host_threads and resolve("cpu").device_count == 1
    assert set(local_backends()) == {"cpu", "cuda"}
    assert resolve("auto").name == ("cuda" if CudaBackend.device_count() else "cpu")
    with pytest.raises(MetaError, match="unknown backend 'tpu'"):
        resolve("tpu")


@pytest.mark.skipif(CudaBackend.device_count() < 2 or not nccl_available(), reason="needs two GPUs and NCCL")
def test_nccl_on_two_gpus(fresh_cluster):
    from meta import MetaDevice

    cluster = fresh_cluster(2, backend="cuda", devices=(0, 1))
    assert [d["data_plane"] for d in cluster.data_planes] == ["nccl", "nccl"]
    dev = MetaDevice(cluster, check_mirrored=True)
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((96, 32)).astype(np.float32)
    y = (dev.tensor(x, Split.even(1, 96, 2)) @ dev.tensor(w, Split.even(0, 96, 2))).redistribute(MIRRORED)
    np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-4, atol=1e-4)
    z = dev.tensor(x, Split(0, ((40, 24),))).redistribute(Split.even(1, 96, 2)).redistribute(MIRRORED)
    assert z.numpy().tobytes() == x.tobytes()
