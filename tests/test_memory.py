"""Memory accounting on the workers: intermediates count against the budget, dead ones are freed
as the program goes, and every byte reserved during a run is given back."""

import os
import time

import numpy as np
import pytest

from meta import MetaDevice
from split_state import MIRRORED, OutOfMemory, Split
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def budgeted():
    made = []

    def make(n: int, budget: int) -> MetaDevice:
        cluster = SimulatedCluster(n)
        for server in cluster.servers:
            server.store.budget = budget
        made.append(MetaDevice(cluster, check_mirrored=True))
        return made[-1]

    yield make
    for dev in made:
        dev.close()


def in_flight(dev) -> list[int]:
    return [s["in_flight"] for s in dev.stats().values()]


def test_an_intermediate_past_the_budget_fails_even_with_a_small_output(budgeted):
    dev = budgeted(2, budget=64 << 10)
    x = dev.tensor(np.ones((256, 1), np.float32))  # 1 KiB
    y = dev.tensor(np.ones((1, 256), np.float32))
    outer = x @ y  # 256 KiB on every device: over the budget
    with pytest.raises(OutOfMemory, match=r"step \d+ \(matmul\) needs 262144 bytes"):
        outer.sum(axis=0).sum(axis=0).numpy()  # 4 bytes of output
    assert in_flight(dev) == [0, 0]
    assert np.array_equal(x.numpy(), np.ones((256, 1), np.float32))  # stored tensors unharmed


def affine_chain(x_host: np.ndarray, x, rounds: int = 12):
    """(x * 0.5 + 0.25, `rounds` times, on the device: 2 * rounds intermediates; the same in
    float64 on the host)."""
    y, expected = x, x_host.astype(np.float64)
    for _ in range(rounds):
        y = y * 0.5 + 0.25
        expected = expected * 0.5 + 0.25
    return y.numpy(), expected


def test_a_long_chain_fits_only_because_dead_intermediates_are_freed(budgeted):
    size = 64 << 10  # bytes of x on every device
    dev = budgeted(2, budget=int(3.5 * size))  # x + two live intermediates + the output's growth
    x_host = np.linspace(-1, 1, size // 4, dtype=np.float32)
    # 24 intermediates: 24 x the size of x if none were freed
    got, expected = affine_chain(x_host, dev.tensor(x_host))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert in_flight(dev) == [0, 0]


def test_reserved_bytes_come_back_after_many_runs_and_failures(budgeted):
    dev = budgeted(3, budget=1 << 20)
    w = dev.tensor(np.ones((64, 64), np.float32), Split.even(1, 64, 3))
    x = dev.tensor(np.ones((8, 64), np.float32))
    for i in range(60):
        out = (x @ w).redistribute(MIRRORED)
        dev.run(out)
        dev.free(out)
        if i % 20 == 0:
            with pytest.raises(OutOfMemory):
                dev.run(dev.tensor(np.ones((600, 1), np.float32)) @ dev.tensor(np.ones((1, 600), np.float32)))
    stats = dev.stats()
    assert [s["in_flight"] for s in stats.values()] == [0, 0, 0]
    for rank, s in stats.items():
        expected = 8 * 64 * 4 + 64 * Split.even(1, 64, 3).extent(rank) * 4  # x (Mirrored) + w's slice
        assert s["used"] == expected, (rank, s)


def test_the_budget_at_exactly_what_a_program_needs_and_one_byte_less(budgeted):
    """What a program needs, worked out by hand: the stored input, an arena of two live
    intermediates (exp and tanh; the add overwrites one of them) and the 4-byte result in its own
    64-byte-aligned buffer."""
    size = 16 << 10
    need = size + 2 * size + 64
    for budget, fits in ((need, True), (need - 1, False)):
        dev = budgeted(1, budget=budget)
        x = dev.tensor(np.ones(size // 4, np.float32))
        graph = (x.exp() + x.tanh()).sum(axis=0)
        if fits:
            np.testing.assert_allclose(graph.numpy(), (np.e + np.tanh(1.0)) * (size // 4), rtol=1e-5)
        else:
            with pytest.raises(OutOfMemory):
                dev.run(graph)


def test_a_workers_peak_memory_is_its_own_not_its_coordinators(fresh_cluster):
    """A worker is forked from the coordinator and then runs `python -m workers`: getrusage's
    peak survives that exec, so a coordinator holding 600 MiB made every worker it spawned
    report a 600 MiB peak before loading anything."""
    ballast = np.ones(600 << 18, np.float32)  # 600 MiB, every page touched
    try:
        cluster = fresh_cluster(1)
    finally:
        del ballast
    (stats,) = MetaDevice(cluster).stats().values()
    assert 0 < stats["max_rss_kib"] < 400 << 10, stats["max_rss_kib"]
    assert stats["max_rss_kib"] >= stats["rss_kib"] > 0


def resident_compiler_code_kib(pid: int | str = "self") -> int | None:
    """Resident KiB of libllvmlite's executable mappings in process `pid` (from its smaps); None
    while the process has not loaded the library (numba not imported yet)."""
    total, inside, mapped = 0, False, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header
                inside = fields[1] == "r-xp" and len(fields) > 5 and "libllvmlite" in fields[5]
                mapped = mapped or inside
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total if mapped else None


def numba_kernels():
    from workers.backends.cpu import numba_cpu

    if not numba_cpu.AVAILABLE or not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs numba and Linux's /proc")
    return numba_cpu


def test_prepared_kernels_run_without_the_compilers_code_resident():
    """After prepare, LLVM's machine code (~50 MiB) is not resident, and the loaded loops still
    give the formula's values: nothing they run lives in those pages."""
    numba_cpu = numba_kernels()
    numba_cpu.prepare()  # once per process: conftest's session start ran it already
    numba_cpu.release_compiler_code()  # anything the tests compiled since, dropped again
    assert 0 <= resident_compiler_code_kib() < 1024, resident_compiler_code_kib()
    x, w = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32), np.full(64, 0.5, np.float32)
    got = numba_cpu.OVERRIDES["rms_norm_mul"](np, (x, w), {"axis": 2, "eps": 1e-5})
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * 0.5, rtol=2e-6)
    assert resident_compiler_code_kib() < 1024  # running the loops read none of it back


def test_a_worker_hands_back_the_compilers_code_and_runs_without_it(fresh_cluster):
    """A worker prepares its numba loops in the background as it starts, then drops LLVM's code
    pages; running the loops after that reads none of them back."""
    numba_kernels()
    cluster = fresh_cluster(1)
    (pid,) = cluster.pids.values()
    dev = MetaDevice(cluster)
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * 2.0
    weight = dev.tensor(np.full(32, 2.0, np.float32))
    deadline = time.monotonic() + 60
    # numba not imported yet (None), or preparing (tens of MiB; a cold numba cache compiles)
    while (resident := resident_compiler_code_kib(pid)) is None or resident >= 1024:
        assert time.monotonic() < deadline, f"LLVM's code still resident: {resident} KiB"
        time.sleep(0.05)
    for _ in range(2):
        got = (dev.tensor(x).rms_norm(axis=-1, eps=1e-5) * weight).numpy()  # fused: a numba loop
        np.testing.assert_allclose(got, expected, rtol=2e-6)
    assert resident_compiler_code_kib(pid) < 1024, resident_compiler_code_kib(pid)
