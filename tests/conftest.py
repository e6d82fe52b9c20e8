"""Fixtures that own clusters: every process started is reaped and every socket closed."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from bench.gpu_check import ON_GPU_ENV  # "1": the CUDA fixtures' workers on the real GPU
from meta import ClusterConfig, MetaDevice, ProcessCluster
from meta.cluster import alive
from workers.simulator import SimulatedCluster

# CI runs the same examples every time (a failure there is reproducible, not luck); developers
# can explore new ones with HYPOTHESIS_PROFILE=explore.
settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


def _release_freed_arrays_to_the_system() -> None:
    """glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so
    later arrays of up to that size come from its heaps, which keep their pages when the arrays
    are freed: the in-process simulated clusters' weights and caches, made and dropped test after
    test, held the test process at 5-6 GB RSS with no array alive. A fixed threshold of 128 KiB
    (mallopt M_MMAP_THRESHOLD, which also stops the raising) gives every large array back as it
    goes (a simulated 2- and 3-device SmolLM2 in turn: 1,280 MB RSS after, 746 MB with it)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to set
        pass


def pytest_sessionstart(session):
    """The CPU kernels' numba loops compiled into numba's cache once, here, before any worker
    starts and outside every test's timeout: cold, they take about two minutes on 2 cores
    (workers/backends/cpu/numba_cpu.py's prepare), which a test that starts workers would
    otherwise spend waiting."""
    _release_freed_arrays_to_the_system()
    from workers.backends.cpu import numba_cpu

    if numba_cpu.AVAILABLE:
        numba_cpu.prepare()


def pytest_sessionfinish(session, exitstatus):
    """The CuPy stand-in's shared files (tests/cupy_standin/ipc.py) of the workers a test killed
    or that left by os._exit: no finalizer of theirs ran."""
    from tests.cupy_standin.ipc import sweep_orphans

    sweep_orphans()


@pytest.fixture
def sim():
    made: list[MetaDevice] = []

    def make(n: int, **kwargs) -> MetaDevice:
        kwargs.setdefault("check_mirrored", True)  # every Mirrored read: bitwise identical copies
        dev = MetaDevice(SimulatedCluster(n), **kwargs)
        made.append(dev)
        return dev

    yield make
    for dev in made:
        dev.close()


def _processes(n: int, **config):
    cluster = ProcessCluster(ClusterConfig(workers=n, **config))
    pids = list(cluster.pids.values())
    return cluster, pids


def _process_device(n: int, **config):
    cluster, pids = _processes(n, **config)
    dev = MetaDevice(cluster, check_mirrored=True)
    yield dev
    dev.close()
    assert alive(pids) == [], "worker processes left behind"


@pytest.fixture(scope="module")
def procs2():
    yield from _process_device(2)


@pytest.fixture(scope="module")
def procs3():
    yield from _process_device(3)


@pytest.fixture(scope="module")
def procs3_zmq():
    """Three workers whose collectives go over ZeroMQ, as between hosts."""
    yield from _process_device(3, data_plane="zmq")


@pytest.fixture(scope="module")
def procs3_tcp():
    """Three workers whose collectives go over plain TCP sockets (workers/planes/tcp/)."""
    yield from _process_device(3, data_plane="tcp")


IPC_REGION_MIB = 1  # the IPC plane's halves in the stand-in fixtures: small /dev/shm files, many pieces


def _ipc_env() -> dict[str, str]:
    from workers.planes.ipc.engine import REGION_ENV

    return {**_standin_env(), REGION_ENV: str(IPC_REGION_MIB)}


def _on_gpu() -> bool:
    return os.environ.get(ON_GPU_ENV, "") == "1"


def _standin_env() -> dict[str, str]:
    """A worker's environment where `import cupy` gives tests/cupy_standin (no GPU needed), or
    the real CuPy under ON_GPU_ENV."""
    from tests.cupy_standin import SHIM

    # the stand-in first, then whatever path the tests run with (packages installed there)
    path = os.pathsep.join(p for p in (SHIM, os.environ.get("PYTHONPATH", "")) if p)
    return {} if _on_gpu() else {"PYTHONPATH": path}


@pytest.fixture(scope="module")
def cuda1():
    """One worker on the CUDA backend, on the asynchronous CuPy stand-in: no collectives, so its
    programs' kernels make the longest device graphs."""
    yield from _process_device(1, backend="cuda", devices=(0,), env=_standin_env())


@pytest.fixture(scope="module")
def cuda2():
    """Two workers on the CUDA backend, on the asynchronous CuPy stand-in, sharing device 0;
    their collectives go through CUDA IPC."""
    yield from _process_device(2, backend="cuda", devices=(0, 0), env=_ipc_env(), data_plane="ipc")


@pytest.fixture(scope="module")
def cuda_nccl2():
    """Two workers on the stand-in's two devices: their collectives go through NCCL (the
    stand-in's communicator between the processes)."""
    if _on_gpu():
        from meta.backends import local_backends

        cuda = local_backends().get("cuda")
        if cuda is None or cuda.device_count < 2:
            pytest.skip("the NCCL plane needs two GPUs")
    yield from _process_device(2, backend="cuda", devices=(0, 1), env={**_standin_env(), "CUPY_STANDIN_DEVICES": "2"})


@pytest.fixture(scope="module")
def cuda3():
    """Three workers sharing the stand-in's device 0: their collectives go through CUDA IPC."""
    yield from _process_device(3, backend="cuda", devices=(0, 0, 0), env=_ipc_env(), data_plane="ipc")


@pytest.fixture(scope="module")
def cuda3_shm():
    """As cuda3, with the collectives staged through host memory (the shm plane)."""
    yield from _process_device(3, backend="cuda", devices=(0, 0, 0), env=_standin_env(), data_plane="shm")


@pytest.fixture(scope="module")
def model():
    """The packaged SmolLM2-135M-Instruct GGUF model; the test skips where it is not installed."""
    from models.gguf_model import GGUFModel, ModelMissing

    try:
        return GGUFModel()
    except ModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture
def fresh_cluster():
    """Clusters a test may break (kill a worker, exhaust memory): closed and checked after."""
    made = []

    def make(n: int = 2, **config) -> ProcessCluster:
        cluster, pids = _processes(n, **config)
        made.append((cluster, pids))
        return cluster

    yield make
    for cluster, pids in made:
        cluster.close()
        assert alive(pids) == [], "worker processes left behind"


def _orphaned_workers() -> list[int]:
    """`python -m workers` processes that lost their parent (re-parented to init)."""
    from pathlib import Path

    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == 1 and b"workers" in cmd[1:4] and b"-m" in cmd[1:4]:
            found.append(int(entry))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_orphaned_workers():
    """After the whole session: no worker process may have outlived its coordinator."""
    import signal
    import time

    yield
    deadline = time.monotonic() + 8.0  # the liveness window of the slowest test cluster, and some
    while (orphans := _orphaned_workers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"worker processes outlived their coordinator: {orphans}"


@pytest.fixture(autouse=True)
def fresh_cuda_context():
    """The CuPy stand-in's context starts anew after each test, as a new process's would: a test
    whose kernel failed (CUDA's errors are sticky: tests/cupy_standin/runtime.py's Context) must
    not fail the tests after it in the same process."""
    import sys

    yield
    runtime = sys.modules.get("tests.cupy_standin.runtime")
    if runtime is not None:
        runtime.CONTEXT.reset()
