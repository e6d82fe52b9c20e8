"""The bounded stress run CI does on every change, plus the stress command's own contract."""

import numpy as np
import pytest

from bench import stress
from meta.device import MetaDevice
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(180)


def test_stress_on_worker_processes(procs2):
    lines = []
    assert stress.run(procs2, 35.0, seed=11, out=lines.append) == 0, "\n".join(lines)
    assert "random graphs matched NumPy on 2 workers" in lines[-1]


def test_stress_on_one_to_five_simulated_devices():
    lines = []
    simulated = lambda n: MetaDevice(SimulatedCluster(n), check_mirrored=True)  # noqa: E731
    assert stress.run(simulated, 20.0, seed=12, out=lines.append) == 0, "\n".join(lines)
    assert "on 1/2/3/4/5 workers" in lines[-1]


def test_tolerance_follows_the_least_precise_dtype_of_the_chain():
    dev = MetaDevice(SimulatedCluster(2))
    try:
        ok, graph = stress.check_graph(dev, 2026, 15097)  # bfloat16 sum, add, cast to float32, mean
    finally:
        dev.close()
    assert graph.coarsest == "bfloat16" and ok
    got, ref = np.array([1.4765625], np.float32), np.array([1.484375], np.float32)
    assert not stress.matches(got, ref) and stress.matches(got, ref, "bfloat16")


def test_graphs_are_reproducible_by_seed():
    dev = MetaDevice(SimulatedCluster(3))
    try:
        first = [stress.check_graph(dev, 5, i)[1].lines for i in range(20)]
        again = [stress.check_graph(dev, 5, i)[1].lines for i in range(20)]
    finally:
        dev.close()
    assert first == again and len({tuple(g) for g in first}) > 10


def test_a_mismatch_prints_the_seed_and_a_reproduction_and_fails(monkeypatch):
    monkeypatch.setattr(stress, "matches", lambda got, ref, precision=None: False)
    dev = MetaDevice(SimulatedCluster(2))
    try:
        lines = []
        assert stress.run(dev, 10.0, seed=3, out=lines.append) == 1
    finally:
        dev.close()
    assert "reproduce with --seed 3 (graph index 0)" in lines[0]
    assert lines[1].startswith("# graph seed [3, 0]") and "input" in lines[1]


@pytest.mark.parametrize(
    "got, ref, ok",
    [
        (np.array([1.0, 2.0], np.float32), np.array([1.0, 2.0005], np.float32), True),
        (np.array([1.0, 2.0], np.float32), np.array([1.0, 2.1], np.float32), False),
        (np.array([np.nan], np.float16), np.array([np.inf], np.float16), True),  # both overflowed
        (np.array([1.0], np.float16), np.array([np.inf], np.float16), False),
        (np.array([1], np.int32), np.array([1.0], np.float32), False),
    ],
)
def test_comparison_rules(got, ref, ok):
    assert stress.matches(got, ref) is ok
