"""The CuPy stand-in (tests/cupy_standin) keeps CuPy's rules: work runs late and in stream
order, a missing wait is caught, capture forbids host synchronisation and graphs replay on the
memory they were captured on. The CUDA backend's own ordering is checked under it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cupy_standin import cupy as cp
from tests.cupy_standin import install
from tests.cupy_standin import runtime as rt


@pytest.fixture
def slow_streams(monkeypatch):
    """Every piece of work waits a little before it runs: a host that does not wait sees it missing."""
    monkeypatch.setenv("CUPY_STANDIN_DELAY_S", "0.05")
    monkeypatch.setenv("CUPY_STANDIN_DELAY_ODDS", "1")


def test_results_equal_numpy_and_work_on_one_stream_runs_in_order():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = cp.asarray(a)
    y = cp.exp(x / 10) @ x.T
    y += 1
    y[0, :] = -1
    np.testing.assert_allclose(y.get(), np.concatenate([-np.ones((1, 4)), (np.exp(a / 10) @ a.T + 1)[1:]]), rtol=1e-6)
    assert int(x.sum()) == a.sum() and x.reshape(6, 4).base is x


def test_reading_on_another_stream_without_an_event_is_a_race():
    producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with producer:
        x = cp.ones((256,), cp.float32) * 3
    with consumer, pytest.raises(rt.RaceError, match="no event or synchronize"):
        x + 1
    consumer.wait_event(producer.record())
    with consumer:
        assert float((x + 1).sum()) == 4 * 256


def test_writing_what_another_stream_still_reads_is_a_race():
    reader, writer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.zeros((64,), cp.float32)
    writer.wait_event(cp.cuda.get_current_stream().record())
    reader.wait_event(cp.cuda.get_current_stream().record())
    with reader:
        y = x * 2
    with writer, pytest.raises(rt.RaceError, match="writes bytes"):
        x.fill(1)
    reader.synchronize()  # the host waited for the reader: the writer may go on after it
    with writer:
        x.fill(1)
    assert y.get().sum() == 0
    writer.synchronize()  # x's memory goes back to the null stream's blocks: nothing may still write it


def test_an_asynchronous_copy_into_pinned_memory_is_garbage_until_waited_for(slow_streams):
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.arange(8, dtype=cp.float32)
    host = rt.PINNED_POOL.empty((8,), np.float32)
    x.get(out=host, stream=stream, blocking=False)
    assert np.isnan(host).all()  # not yet copied: the stand-in's fresh memory is NaN
    stream.synchronize()
    np.testing.assert_array_equal(host, np.arange(8, dtype=np.float32))


def test_a_host_to_device_copy_takes_pageable_data_at_once_and_pinned_data_late(slow_streams):
    stream = cp.cuda.Stream(non_blocking=True)
    pageable, pinned = np.ones(4, np.float32), rt.PINNED_POOL.empty((4,), np.float32)
    pinned[:] = 1
    with stream:
        a, b = cp.asarray(pageable), cp.asarray(pinned)
    pageable[:] = 7  # the host may reuse pageable memory at once ...
    pinned[:] = 7  # ... but pinned memory is read when the copy runs
    with stream:
        assert a.get().tolist() == [1] * 4 and b.get().tolist() == [7] * 4


def test_device_arrays_never_convert_to_numpy_implicitly():
    x = cp.ones(3)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError):
        x + np.ones(3)


def test_a_failed_kernel_surfaces_at_the_next_synchronize_and_the_stream_stays_failed():
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.ones((2, 3))
        stream.issue(lambda: 1 / 0, writes=[x._a], what="a faulty kernel")
        y = x + 1  # issued fine: the failure is not known yet
        with pytest.raises(rt.CUDARuntimeError, match="ZeroDivisionError"):
            stream.synchronize()
        with pytest.raises(rt.CUDARuntimeError):
            y.get()


def test_a_failed_kernel_fails_every_stream_after_it_as_cudas_sticky_errors_do():
    """A read-back on a copy stream, ordered after a kernel that failed on the compute stream,
    raises: it does not return whatever the result's buffer held (fresh memory's NaN, or an
    earlier step's result, which a test could take for a pass)."""
    compute, copies = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with compute:
        out = cp.zeros((4,), cp.float32)
        compute.issue(lambda: 1 / 0, writes=[out._a], what="a faulty kernel")
    copies.wait_event(compute.record())
    host = rt.PINNED_POOL.empty((4,), np.float32)
    out.get(out=host, stream=copies, blocking=False)
    with pytest.raises(rt.CUDARuntimeError, match="a kernel on stream .* failed: ZeroDivisionError"):
        copies.synchronize()
    fresh = cp.cuda.Stream(non_blocking=True)  # a stream made after it too: the context is gone
    with fresh, pytest.raises(rt.CUDARuntimeError, match="ZeroDivisionError"):
        cp.ones(2).get()
    event = cp.cuda.Event()
    event.record(fresh)
    with pytest.raises(rt.CUDARuntimeError, match="ZeroDivisionError"):
        event.synchronize()


def test_a_captured_graph_runs_nothing_until_launched_and_replays_on_its_memory():
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.asarray(np.arange(4, dtype=np.float32))
        out = cp.zeros(4, cp.float32)
        stream.synchronize()
        stream.begin_capture()
        cp.multiply(x, 2, out=out)
        out += 1
        graph = stream.end_capture()
        assert out.get().tolist() == [0, 0, 0, 0]  # captured, not run
        graph.launch(stream)
        assert out.get().tolist() == [1, 3, 5, 7]
        x.set(np.full(4, 10, np.float32))  # new data in the captured input
        graph.launch(stream)
        assert out.get().tolist() == [21] * 4


def test_a_host_synchronisation_during_capture_fails_and_invalidates_the_capture():
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.ones(4)
        stream.synchronize()
        stream.begin_capture()
        with pytest.raises(rt.CUDARuntimeError, match="StreamCaptureUnsupported"):
            int(x.sum())
        with pytest.raises(rt.CUDARuntimeError, match="Invalidated"):
            stream.end_capture()
        assert not stream.is_capturing()
        stream.begin_capture()  # a copy from pageable host memory is host-synchronous too
        with pytest.raises(rt.CUDARuntimeError, match="StreamCaptureUnsupported"):
            cp.asarray(np.ones(4))
        with pytest.raises(rt.CUDARuntimeError, match="Invalidated"):
            stream.end_capture()
        stream.begin_capture()  # so is asking whether the stream is done (cudaStreamQuery)
        with pytest.raises(rt.CUDARuntimeError, match="StreamCaptureUnsupported"):
            stream.done  # noqa: B018 - the property's read is the call under test
        with pytest.raises(rt.CUDARuntimeError, match="Invalidated"):
            stream.end_capture()


def test_a_floating_point_product_during_capture_is_refused_as_cupy_refuses_cublas():
    """CuPy 14 raises before calling cuBLAS while the stream captures (cupy/cupy#6290); the
    capture goes on. Integer products are CuPy's own kernels: captured."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a, n = cp.ones((2, 3), dtype=cp.float32), cp.ones((2, 3), dtype=cp.int32)
        stream.synchronize()
        stream.begin_capture()
        with pytest.raises(NotImplementedError, match="calling cuBLAS API during stream capture"):
            cp.matmul(a, a.T)
        with pytest.raises(NotImplementedError, match="calling cuBLAS API during stream capture"):
            _ = a @ a.T
        product = n @ n.T
        graph = stream.end_capture()
        graph.launch(stream=stream)
        assert product.get().tolist() == [[3, 3], [3, 3]]


def test_a_freed_block_is_reused_by_the_next_allocation_on_its_stream():
    """As CuPy's pool: what a graph captured in a freed temporary may belong to another array."""
    a = cp.empty(1000, cp.float32)
    address = a.data.ptr
    del a
    assert cp.empty(1000, cp.float32).data.ptr == address
    with cp.cuda.Stream(non_blocking=True):
        assert cp.empty(1000, cp.float32).data.ptr != address  # another stream: its own blocks


def test_the_cuda_backend_orders_host_copies_after_the_compute_stream(monkeypatch, slow_streams):
    install(monkeypatch)
    from workers.backends.cuda import Backend

    backend = Backend(0)
    x = backend.to_device(np.arange(1000, dtype=np.float32))
    got = backend.to_host(backend.xp.sqrt(x * x))
    np.testing.assert_allclose(got, np.arange(1000, dtype=np.float32))
    monkeypatch.setattr(rt.Stream, "wait_event", lambda self, event: None)  # the planted bug
    with pytest.raises(rt.RaceError):
        backend.to_host(backend.xp.sqrt(x * x))


def _ipc_reader(handles: list[bytes], wait: bool, conn) -> None:
    """Another process: open the writer's memory and event, read when told the record is issued."""
    from tests.cupy_standin import MODULES

    cupy = MODULES["cupy"]
    runtime = cupy.cuda.runtime
    ptr = runtime.ipcOpenMemHandle(handles[0], runtime.cudaIpcMemLazyEnablePeerAccess)
    event = runtime.ipcOpenEventHandle(handles[1])
    conn.send("opened")
    conn.recv()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        if wait:
            runtime.streamWaitEvent(stream.ptr, event, 0)
        memory = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, 16, None), 0)
        conn.send(cupy.ndarray((4,), np.float32, memptr=memory).copy().get())
    runtime.eventDestroy(event)
    runtime.ipcCloseMemHandle(ptr)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", [True, False])
def test_another_process_reads_ipc_memory_right_only_after_waiting_for_the_writers_event(wait, monkeypatch):
    """CUDA IPC: a peer process that reads an allocation without waiting for the writer's
    interprocess event reads it before the write lands (garbage here), every time. The write
    lands a second late here: with the default 2 ms, a reader slowed by a loaded machine read
    after it (seen once in CI)."""
    import multiprocessing

    monkeypatch.setenv("CUPY_STANDIN_IPC_DELAY_S", "1.0")  # read by the stream made below

    runtime = cp.cuda.runtime
    ptr = runtime.malloc(16)
    event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
    handles = [runtime.ipcGetMemHandle(ptr), runtime.ipcGetEventHandle(event.ptr)]
    ours, theirs = multiprocessing.Pipe()
    reader = multiprocessing.get_context("spawn").Process(target=_ipc_reader, args=(handles, wait, theirs))
    reader.start()
    try:
        assert ours.poll(30) and ours.recv() == "opened"
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            memory = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, 16, None), 0)
            cp.ndarray((4,), np.float32, memptr=memory)[...] = cp.arange(1, 5, dtype=cp.float32)
            event.record(stream)
        ours.send("recorded")
        assert ours.poll(30)
        got = ours.recv()
        if wait:
            np.testing.assert_array_equal(got, [1, 2, 3, 4])
        else:
            assert np.isnan(got).all()  # the stand-in's fresh memory: 0xFF bytes
        stream.synchronize()
    finally:
        reader.join(30)
        reader.kill()
        runtime.free(ptr)


def _allocate_and_exit_hard(folder: str, told) -> None:
    """A worker's end by os._exit (or a kill): an IPC allocation and an interprocess event made,
    no finalizer run."""
    import os

    from tests.cupy_standin import ipc

    ipc._FOLDER = folder
    ipc.malloc(16)
    event = ipc.SharedEventState()  # noqa: F841 - held until the exit
    told.send(sorted(os.listdir(folder)))
    os._exit(0)


@pytest.mark.timeout(60)
def test_the_files_a_dead_maker_left_are_swept_and_a_live_makers_stay(tmp_path):
    """tests/conftest.py sweeps them when the session ends: an allocation and an event that a
    worker ended without its finalizers left in /dev/shm were kept for good before."""
    import multiprocessing
    import os

    from tests.cupy_standin import ipc

    ours, theirs = multiprocessing.Pipe()
    maker = multiprocessing.get_context("spawn").Process(target=_allocate_and_exit_hard, args=(str(tmp_path), theirs))
    maker.start()
    assert ours.poll(30)
    left = ours.recv()
    maker.join(30)
    pid = str(maker.pid)
    assert [name.split("-")[:3] for name in left] == [["standin", "event", pid], ["standin", "ipc", pid]]
    live = f"standin-ipc-{os.getpid()}-abc"  # this process's, as its own allocations are named
    (tmp_path / live).write_bytes(bytes(16))
    (tmp_path / "standin-ipc-notapid").write_bytes(bytes(16))  # not of this scheme: left alone
    removed = ipc.sweep_orphans(str(tmp_path))
    assert sorted(os.path.basename(path) for path in removed) == left
    assert sorted(os.listdir(tmp_path)) == sorted([live, "standin-ipc-notapid"])
