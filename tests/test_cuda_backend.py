"""The CUDA backend's stream discipline: a host copy is ordered after the kernels that produced
the data. Checked here against a stand-in of CuPy's stream API (no GPU needed), and for real on a
GPU, where a copy racing a long kernel would read unfinished data."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from workers.backends.cuda import Backend as CudaBackend


class Log(list):
    pass


def fake_cupy(log: Log):
    """Just enough of cupy/cupyx for the backend: streams and events that log what they do."""

    class Event:
        def __init__(self, stream):
            self.stream = stream

    class Stream:
        current = None

        def __init__(self, non_blocking=False):
            self.name = f"stream{len([e for e in log if e[0] == 'stream'])}"
            log.append(("stream", self.name))

        def use(self):
            Stream.current = self
            log.append(("use", self.name))

        def record(self):
            log.append(("record", self.name))
            return Event(self)

        def wait_event(self, event):
            log.append(("wait", self.name, event.stream.name))

        def synchronize(self):
            log.append(("synchronize", self.name))

    class Array:
        def __init__(self, data):
            self.data, self.shape, self.dtype = data, data.shape, data.dtype

        def get(self, out, stream):
            log.append(("copy to host", stream.name))
            out[...] = self.data

    cuda = types.SimpleNamespace(
        Stream=Stream,
        Device=lambda index: types.SimpleNamespace(use=lambda: None),
        set_pinned_memory_allocator=lambda malloc: log.append(("pinned pool",)),
    )

    def ascontiguousarray(a):
        log.append(("pack", Stream.current.name))
        return a

    cupy = types.SimpleNamespace(
        cuda=cuda,
        get_default_pinned_memory_pool=lambda: types.SimpleNamespace(malloc=None),
        ascontiguousarray=ascontiguousarray,
        # the kernels of our own, compiled at start-up (tests/test_device_kernels.py checks them)
        RawModule=lambda code, options=(): types.SimpleNamespace(get_function=lambda name: None),
    )
    cupyx = types.SimpleNamespace(empty_pinned=lambda shape, dtype: np.empty(shape, dtype))
    return cupy, cupyx, Array


def test_host_copies_wait_for_the_compute_stream(monkeypatch):
    log = Log()
    cupy, cupyx, Array = fake_cupy(log)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    backend = CudaBackend(0)
    compute, copy = backend.compute.name, backend.copy.name
    assert ("use", compute) in log and ("pinned pool",) in log  # kernels run on the compute stream
    log.clear()
    got = backend.to_host(Array(np.arange(6.0)))
    assert np.array_equal(got, np.arange(6.0))
    assert log == [
        ("pack", compute),
        ("record", compute),  # everything issued so far, the producer included ...
        ("wait", copy, compute),  # ... is waited for by the copy stream ...
        ("copy to host", copy),  # ... before the copy starts
        ("synchronize", copy),
    ]


@pytest.mark.skipif(CudaBackend.device_count() == 0, reason="needs CuPy and a CUDA device")
def test_a_host_copy_right_after_a_long_kernel_sees_its_result():
    backend = CudaBackend(0)
    xp = backend.xp
    a = xp.ones((4096, 4096), xp.float32)
    for trial in range(5):
        out = a @ a  # long enough that an unordered copy would start before it ends
        out += trial
        got = backend.to_host(out)
        assert float(got[0, 0]) == 4096.0 + trial and float(got[-1, -1]) == 4096.0 + trial
