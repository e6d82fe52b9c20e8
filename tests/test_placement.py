"""Where a CPU worker keeps a tensor: 16 bytes past a cache line's start, every time
(workers/backends/cpu/placement.py says why), its values and layout those it was sent; and when:
weights past a few MiB after the worker's kernels are loaded (workers/server.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from split_state.states import Mirrored
from transport import protocol as p
from workers import server as server_module
from workers.backends.cpu import Backend
from workers.backends.cpu.packing import ensure_packed, layout_of
from workers.backends.cpu.placement import resident_copy
from workers.server import KERNELS_BEFORE_BYTES, WorkerServer

pytestmark = pytest.mark.timeout(60)


def _start(array: np.ndarray) -> int:
    return array.ctypes.data % 64


@pytest.mark.parametrize(
    "shape, dtype",
    [((3, 5), np.float32), ((7,), np.float16), ((2, 3, 144, 64), np.uint8), ((), np.int64), ((0, 4), np.float32)],
)
def test_copy_keeps_values_and_starts_16_bytes_into_a_line(shape, dtype):
    rng = np.random.default_rng(1)
    for size in range(40):  # many allocations: the heap hands out every multiple of 16
        original = rng.integers(0, 100, shape).astype(dtype) if shape else np.array(size, dtype)
        copy = resident_copy(original)
        assert copy.shape == original.shape and copy.dtype == original.dtype
        assert copy.flags.c_contiguous and copy.flags.writeable
        assert np.array_equal(copy, original)
        if copy.size:
            assert _start(copy) == 16
            copy.flat[0] += 1  # a copy: the original is not its memory
            assert not np.array_equal(copy, original)


def test_copy_of_a_strided_view_is_its_values_in_order():
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    view = base[::2, 1::3]
    copy = resident_copy(view)
    assert np.array_equal(copy, [[1, 4, 7], [21, 24, 27], [41, 44, 47]]) and _start(copy) == 16


def test_a_kept_weight_can_be_packed_in_place():
    w = resident_copy(np.random.default_rng(2).integers(0, 256, (1, 2, 144, 64), dtype=np.uint8))
    assert ensure_packed(w, "q4_k") and layout_of(w) == "q4_k"


class _Plain:
    """A backend without `resident`: the store keeps a plain copy."""

    def __init__(self) -> None:
        self.inner = Backend()

    def __getattr__(self, name):
        if name == "resident":
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("backend", [Backend(), _Plain()], ids=["cpu", "without-resident"])
def test_a_put_tensor_is_kept_where_the_backend_places_it(backend):
    server = WorkerServer(0, backend, connect=lambda configure: None)
    server.world_size = 1
    sent = [np.random.default_rng(k).integers(0, 256, (k + 1, 144, 64), dtype=np.uint8) for k in range(20)]
    for tensor, array in enumerate(sent):
        assert isinstance(server.handle(p.Put(tensor, Mirrored(), array.shape, array)), p.Ok)
    kept = [server.store.get(tensor) for tensor in range(len(sent))]
    assert all(np.array_equal(k, s) and k is not s for k, s in zip(kept, sent))
    starts = {_start(k) for k in kept}
    if isinstance(backend, Backend):
        assert starts == {16}


def _timed_put(server: WorkerServer, tensor: int, nbytes: int) -> float:
    array = np.zeros(nbytes, np.uint8)
    start = time.perf_counter()
    assert isinstance(server.handle(p.Put(tensor, Mirrored(), array.shape, array)), p.Ok)
    return time.perf_counter() - start


def test_weights_past_a_few_mib_wait_for_the_kernels_once(monkeypatch):
    """Loading the loops holds the compiler's code resident for a while: the first Put that takes
    the store past KERNELS_BEFORE_BYTES waits for it (the peak is then the weights alone);
    smaller ones before it do not, nor do any after it."""
    server = WorkerServer(0, Backend(), connect=lambda configure: None)
    server.world_size = 1
    server.executor.kernels_prepared = False
    threading.Timer(0.4, lambda: setattr(server.executor, "kernels_prepared", True)).start()
    assert _timed_put(server, 0, 1 << 20) < 0.2  # the store stays under the bound
    assert _timed_put(server, 1, KERNELS_BEFORE_BYTES) >= 0.3  # waited for the kernels
    assert server.executor.kernels_prepared
    assert _timed_put(server, 2, KERNELS_BEFORE_BYTES) < 0.2


def test_a_cold_compile_is_waited_for_only_so_long(monkeypatch):
    monkeypatch.setattr(server_module, "KERNELS_WAIT_S", 0.3)
    server = WorkerServer(0, Backend(), connect=lambda configure: None)
    server.world_size = 1
    server.executor.kernels_prepared = False  # and never ready
    assert 0.25 <= _timed_put(server, 0, KERNELS_BEFORE_BYTES) < 2.0
    assert _timed_put(server, 1, KERNELS_BEFORE_BYTES) < 0.2  # once: the next ones go on beside it
    assert np.array_equal(server.store.get(1), np.zeros(KERNELS_BEFORE_BYTES, np.uint8))
