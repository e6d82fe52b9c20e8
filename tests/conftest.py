"""Fixtures that own clusters: every process started is reaped and every socket closed."""

from __future__ import annotations

import pytest

from meta import ClusterConfig, MetaDevice, ProcessCluster
from meta.cluster import alive
from workers.simulator import SimulatedCluster


@pytest.fixture
def sim():
    made: list[MetaDevice] = []

    def make(n: int, **kwargs) -> MetaDevice:
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


def _process_device(n: int):
    cluster, pids = _processes(n)
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
