"""Data planes as a registry (workers/planes/): each module found by name declares what it
supports; workers say in Hello which they can join, and the coordinator and the command line
take the names from there."""

from __future__ import annotations

import platform

import pytest

from split_state.errors import TransportError
from workers import planes

pytestmark = pytest.mark.timeout(60)


def test_every_plane_module_declares_itself():
    assert planes.names() == ("ipc", "mpi", "nccl", "shm", "tcp", "zmq")
    for name in planes.names():
        plane = planes.plane(name)
        assert plane.name == name and plane.hosts in ("one", "many") and set(plane.kinds) <= {"cpu", "gpu"}
    with pytest.raises(TransportError, match="unknown data plane 'pigeon'"):
        planes.plane("pigeon")


def test_a_cpu_worker_can_join_shared_memory_tcp_and_zeromq_not_nccl():
    shared = ["shm"] if platform.machine() in ("x86_64", "AMD64") else []
    assert planes.joinable_planes("cpu") == [*shared, "tcp", "zmq"]
    assert "cuda backend" in planes.plane("nccl").joinable("cpu")
    assert "cuda backend" in planes.plane("ipc").joinable("cpu")


def test_only_a_worker_started_by_an_mpi_jobs_rank_can_join_mpi(monkeypatch):
    from transport.environment import MPI_RANK_ENV

    mpi = planes.plane("mpi")
    monkeypatch.delenv(MPI_RANK_ENV, raising=False)
    assert "not started by a rank of an MPI job" in mpi.joinable("cpu")
    monkeypatch.setenv(MPI_RANK_ENV, "1")
    assert "cpu backend" in mpi.joinable("cuda")
    pytest.importorskip("mpi4py")
    assert mpi.joinable("cpu") == ""


def test_workers_say_which_planes_they_can_join_and_the_cli_offers_the_registry(fresh_cluster):
    from launch import parser

    cluster = fresh_cluster(2)
    assert [h.planes for h in cluster.devices] == [planes.joinable_planes("cpu")] * 2
    generate = parser()._subparsers._group_actions[0].choices["generate"]
    option = next(a for a in generate._actions if "--data-plane" in a.option_strings)
    assert option.choices == ["auto", *planes.names()]
