"""Defects of one host found by review, each pinned by a test: threads sharing a MetaDevice, runs
past their deadline, the default memory budget, allocation failures, NumPy scalars, freed handles."""

import threading

import numpy as np
import pytest

from meta import MetaDevice
from split_state import MIRRORED, DeadlineExceeded, FreedTensor, Split
from transport import protocol as p

pytestmark = pytest.mark.timeout(120)


def test_threads_sharing_a_device_take_turns(fresh_cluster):
    dev = MetaDevice(fresh_cluster(2, call_timeout=20.0))
    w = dev.tensor(np.eye(32, dtype=np.float32), Split.even(1, 32, 2))
    results, errors = {}, []

    def work(k: int) -> None:
        try:
            for i in range(20):
                x = dev.tensor(np.full((4, 32), k + i, np.float32))
                results[(k, i)] = float((x @ w).redistribute(MIRRORED).numpy()[0, 0])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {(k, i): float(k + i) for k in (0, 100) for i in range(20)}


def test_a_run_past_its_deadline_leaves_nothing_stored(fresh_cluster):
    cluster = fresh_cluster(2, call_timeout=60.0)
    dev = MetaDevice(cluster)
    a = dev.tensor(np.ones((1500, 1500), np.float32) / 1500, Split.even(1, 1500, 2))
    before = {r: s["tensors"] for r, s in dev.stats().items()}
    cluster.config = type(cluster.config)(**{**cluster.config.__dict__, "call_timeout": 0.05})
    slow = a.redistribute(MIRRORED)
    for _ in range(8):
        slow = slow @ a.redistribute(MIRRORED)
    with pytest.raises(DeadlineExceeded):
        dev.run(slow)
    cluster.config = type(cluster.config)(**{**cluster.config.__dict__, "call_timeout": 60.0})
    dev.run(dev.tensor(np.ones(2, np.float32)) * 2.0)  # its release list frees the late outputs
    after = {r: s["tensors"] for r, s in dev.stats().items()}
    assert after == before, (before, after)


def test_default_budget_is_sized_from_the_device(procs2):
    for rank, s in procs2.stats().items():
        assert s["budget"] == int(procs2.cluster.devices[rank].memory_total * 0.9)


def test_an_allocation_failure_is_out_of_memory():
    with pytest.raises(MemoryError) as info:
        np.empty(1 << 62, np.uint8)
    assert p.error_from(info.value).kind == "OutOfMemory"


def test_numpy_scalars_work_like_python_scalars(sim):
    dev = sim(2)
    x = dev.tensor(np.arange(4, dtype=np.float32), Split.even(0, 4, 2))
    for got, expected in [
        (x * np.float32(2), np.arange(4) * 2),
        (np.float32(2) * x, np.arange(4) * 2),
        (x / np.float64(4), np.arange(4) / 4),
        (x + np.float32(1), np.arange(4) + 1),
        (np.float32(1) - x, 1 - np.arange(4)),
    ]:
        assert type(got).__name__ == "Tensor"
        np.testing.assert_allclose(got.numpy(), expected)


def test_using_a_freed_tensor_says_so(sim):
    dev = sim(2)
    x = dev.tensor(np.ones(3, np.float32))
    x.free()
    with pytest.raises(FreedTensor, match="was freed"):
        x.numpy()
    with pytest.raises(FreedTensor, match="was freed"):
        (x * 2.0).numpy()


@pytest.mark.parametrize("n", [1, 3])
def test_a_view_read_before_an_in_place_write_keeps_its_value(sim, n):
    """A transpose, reshape or slice of a tensor is a value: written in place later (a cache
    row), the tensor changes, the view already made does not. The workers once kept such a
    result as a view of the tensor's memory, which the write then changed."""
    dev = sim(n)
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = dev.tensor(a, Split.even(1, 6, n))
    views = {"transpose": x.T, "reshape": x.reshape(6, 4), "slice": x[1:3]}
    for view in views.values():
        view.numpy()  # run: each is stored on the workers now
    ids, row = dev.tensor(np.array([1], np.int32)), dev.tensor(np.full((1, 6), -1, np.float32))
    written = x.set_rows(ids, row, axis=0)
    expect = a.copy()
    expect[1] = -1
    np.testing.assert_array_equal(written.numpy(), expect)
    np.testing.assert_array_equal(views["transpose"].numpy(), a.T)
    np.testing.assert_array_equal(views["reshape"].numpy(), a.reshape(6, 4))
    np.testing.assert_array_equal(views["slice"].numpy(), a[1:3])
