"""launch.py end to end: demo, Ctrl-C, orphans, two hosts on loopback with CURVE, launchers."""

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import launch
from meta.cluster import alive

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def launch_cmd(*args):
    return [sys.executable, str(ROOT / "launch.py"), *args]


def test_demo_runs_and_checks_against_numpy():
    out = subprocess.run(
        launch_cmd("demo", "--workers", "2", "--backend", "cpu", "--hidden", "64"),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    assert "2 workers started" in out.stdout
    assert "all_reduce" in out.stdout and "S1[32|32]" in out.stdout
    assert "OK: max error" in out.stdout


def test_a_directory_with_its_own_workers_models_and_cli_packages_does_not_shadow_ours(tmp_path):
    """Users run the tool from their own projects: packages there named like ours must not be
    what our coordinator or its workers import."""
    for name in ("workers", "models", "cli", "meta", "transport", "split_state"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise SystemExit('the wrong package was imported')\n")
        (tmp_path / name / "__main__.py").write_text("raise SystemExit('the wrong package was run')\n")
    out = subprocess.run(
        launch_cmd("demo", "--workers", "2", "--backend", "cpu", "--hidden", "32"),
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wrong package" not in out.stderr and "OK: max error" in out.stdout


def test_every_option_has_help_and_help_shows_the_defaults():
    import argparse

    from launch import parser

    top = parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "generate" in top.format_usage()
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    text = " ".join(commands["generate"].format_help().split())
    for shown in ("-c N, --ctx N, --ctx-size N", "(default: 2048)", "(default: 1.0)", "--min-p", "-f FILE"):
        assert shown in text, shown


def test_an_unknown_option_prints_that_commands_usage():
    out = subprocess.run(launch_cmd("generate", "hi", "--no-such-flag"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage: launch.py generate" in out.stderr
    assert "unrecognized arguments: --no-such-flag" in out.stderr


def test_more_cpu_workers_than_cores_warn_once(fresh_cluster, capfd, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    fresh_cluster(2, backend="cpu", bind="off")
    assert capfd.readouterr().err.count("2 CPU workers on 1 cores") == 1


def test_devices_lists_the_cpu_backend():
    out = subprocess.run(launch_cmd("devices"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "cpu:0" in out.stdout


SLEEPER = textwrap.dedent("""
    import sys, time
    print(" ".join(str(p) for p in dev.cluster.pids.values()), dev.cluster.ipc.path, flush=True)
    time.sleep(60)
""")


def test_ctrl_c_stops_every_worker_and_removes_ipc_files(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(
        launch_cmd("run", "--workers", "2", "--backend", "cpu", str(script)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        *pids, ipc_dir = proc.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and alive(pids) == pids and os.path.isdir(ipc_dir)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(10)
        assert time.monotonic() - start < 6
        assert code == 130
        assert alive(pids) == [], "orphaned workers"
        assert not os.path.exists(ipc_dir), "ipc files left behind"
        assert "interrupted" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def free_port_triple() -> int:
    for _ in range(100):
        port = random.randint(20000, 60000)
        try:
            for offset in range(3):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError("no free ports")


REMOTE_SCRIPT = textwrap.dedent("""
    import numpy as np
    from split_state import Split, MIRRORED
    x = dev.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), Split.even(1, 4, dev.n))
    print("remote sum", float(x.redistribute(MIRRORED).numpy().sum()), flush=True)
""")


@pytest.mark.parametrize("right_key", [True, False])
def test_two_hosts_on_loopback_with_curve(tmp_path, right_key):
    key, other = tmp_path / "cluster.key", tmp_path / "other.key"
    assert launch.main(["keys", str(key)]) == 0 and launch.main(["keys", str(other)]) == 0
    script = tmp_path / "remote.py"
    script.write_text(REMOTE_SCRIPT)
    port = free_port_triple()
    endpoint = f"tcp://127.0.0.1:{port}"
    coordinator = subprocess.Popen(
        launch_cmd(
            "run",
            "--listen",
            endpoint,
            "--spawn",
            "0",
            "--workers",
            "1",
            "--backend",
            "cpu",
            "--keys",
            str(key),
            "--start-timeout",
            "6",
            str(script),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    worker = subprocess.Popen(
        launch_cmd(
            "worker",
            "--connect",
            endpoint,
            "--rank",
            "0",
            "--backend",
            "cpu",
            "--keys",
            str(key if right_key else other),
            "--liveness",
            "3",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = coordinator.communicate(timeout=40)
        if right_key:
            assert coordinator.returncode == 0, err
            assert "remote sum 66.0" in out
            assert worker.wait(10) == 0  # told to shut down
        else:
            assert coordinator.returncode == 2
            assert "did not connect" in err
            assert worker.wait(15) == 2  # told why by its own handshake, not left to time out
            assert "wrong key file" in worker.stderr.read()
    finally:
        for proc in (coordinator, worker):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-09,12]"},
            launch.LaunchEnv("slurm", 3, 8, "gpu07", 0),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "4",
                "MASTER_ADDR": "10.0.0.5",
                "MASTER_PORT": "6000",
            },
            launch.LaunchEnv("openmpi", 1, 4, "10.0.0.5", 6000),
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, launch.LaunchEnv("pmi", 0, 2, "", 0)),
        (
            {
                "RANK": "2",
                "WORLD_SIZE": "3",
                "MASTER_ADDR": "node1",
                "MASTER_PORT": "29500",
                "SLURM_PROCID": "9",
                "SLURM_NTASKS": "16",
            },
            launch.LaunchEnv("torchrun", 2, 3, "node1", 29500),
        ),
        ({"HOME": "/root"}, None),
    ],
)
def test_launcher_detection(env, expected):
    assert launch.detect_launcher(env) == expected


def test_blas_threads_do_not_oversubscribe():
    cores = os.cpu_count()
    assert launch.blas_threads(1) == cores
    assert launch.blas_threads(cores) == 1 and launch.blas_threads(4 * cores) == 1


def test_worker_cpus_are_disjoint_shares_of_the_allowed_cpus_or_none():
    assert launch.worker_cpus(2, 1, {5, 3}) == [(3,), (5,)]
    assert launch.worker_cpus(2, 2, range(5)) == [(0, 1), (2, 3)]
    assert launch.worker_cpus(3, 1, [0, 1]) is None, "three workers do not go round two cores once"
    assert launch.worker_cpus(2, 2, [0, 1, 2]) is None
    assert launch.worker_cpus(0, 1, [0]) is None


def _task_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of process `pid` may run on."""
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.timeout(60)
def test_spawned_cpu_workers_run_on_their_own_cores_unless_told_not_to(fresh_cluster):
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    cluster = fresh_cluster(2, blas_threads=1)
    per_worker = [_task_cpus(proc.pid) for proc in cluster.processes]
    for threads in per_worker:
        assert len(threads) > 1, "the worker's own threads (ZeroMQ, watchdog) are there to check"
        assert all(cpus == threads[0] and len(cpus) == 1 and cpus <= allowed for cpus in threads)
    assert per_worker[0][0] != per_worker[1][0], "two workers bound to the same core"
    unbound = fresh_cluster(2, blas_threads=1, bind="off")
    assert all(cpus == allowed for proc in unbound.processes for cpus in _task_cpus(proc.pid))


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _interrupt_demo(when_workers_spawned: bool, delay: float) -> str:
    """Ctrl-C to a `launch.py demo` `delay` seconds after start, or after its workers are spawned."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test's own group stays out of it
    )
    try:
        deadline = time.monotonic() + 30
        while when_workers_spawned and len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("when_workers_spawned", "delay"),
    # 0.15 s: inside launch.py's imports (0.3 s and more), past the interpreter's own start (20 ms
    # idle, more on a busy machine), where a Ctrl-C is Python's to report and no handler of ours is set
    [(False, 0.15), (True, 0.1), (True, 0.25)],
    ids=["coordinator-importing", "workers-importing", "workers-connecting"],
)
def test_ctrl_c_while_workers_start_prints_no_worker_traceback(when_workers_spawned, delay):
    """Ctrl-C reaches the terminal's whole process group; spawned workers have a session of their
    own, so only the coordinator sees it: it stops them and says so in one line. Ctrl-C while the
    coordinator itself still imports (a second on a slow machine) ends as quietly."""
    err = _interrupt_demo(when_workers_spawned, delay)
    assert "Traceback" not in err, err[-2000:]


def test_more_workers_than_a_host_can_hold_fail_before_any_starts():
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "demo", "--workers", "1000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "1000 workers on this host" in out.stderr and "[worker" not in out.stderr
    assert time.monotonic() - start < 10


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from split_state import PARTIAL, MIRRORED
    x = dev.tensor(np.ones(4, np.float32), PARTIAL)
    pids = " ".join(str(proc.pid) for proc in dev.cluster.processes)
    print("killing", time.time(), pids, file=sys.stderr, flush=True)
    os.kill(dev.cluster.processes[1].pid, signal.SIG{sig})
    while True:
        x.redistribute(MIRRORED).numpy()
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_a_lost_worker_is_reported_at_once_and_every_process_is_gone_soon_after(tmp_path, sig):
    """Error within 0.5 s of detection, every process gone within 1 s more: a killed worker is
    detected by its exit, a stopped one by its silence over the liveness window (1 s here)."""
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT.format(sig=sig))
    proc = subprocess.Popen(
        launch_cmd("run", "--workers", "2", "--liveness", "1", str(script)),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines, seen = [], {}
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("killing"):
                _, at, *pids = line.split()
                seen["kill"], seen["pids"] = float(at), [int(pid) for pid in pids]
            if line.startswith("error:"):
                seen["error"] = time.time()
        proc.wait(10)
        gone = time.time()
        assert proc.returncode == 3 and "error" in seen, "".join(lines)
        detection = 0.0 if sig == "KILL" else 1.0  # the liveness window
        assert seen["error"] - seen["kill"] < detection + 0.5, "".join(lines)
        assert gone - seen["error"] < 1.0, "".join(lines)
        assert alive(seen["pids"]) == [], "a worker outlived the coordinator"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize(
    "option, value",
    [("liveness", 0.0), ("liveness", float("nan")), ("start_timeout", 0.0), ("workers", 0), ("threads", 0)],
)
def test_cluster_options_that_cannot_work_are_refused_before_anything_starts(option, value):
    import argparse

    from cli.options import check_cluster_options
    from split_state.errors import MetaError

    args = argparse.Namespace(liveness=5.0, start_timeout=60.0, workers=2)
    setattr(args, option, value)
    with pytest.raises(MetaError, match="--" + option.replace("_", "-")):
        check_cluster_options(args)


def test_threads_reach_the_workers_command_line():
    """-t N: each worker is told its thread count (BLAS and the quantized loops)."""
    from transport import protocol as p

    launch = p.WorkerLaunch("ipc:///x/c", "ipc:///x/b", "ipc:///x/i", 0, threads=3)
    assert "--threads" in launch.argv() and p.WorkerLaunch.parse(launch.argv()).threads == 3


@pytest.mark.parametrize("threads, preset, blas", [(None, None, "ALL"), (3, None, "3"), (3, "1", "1")])
def test_a_remote_worker_gets_its_threads_and_blas_pools_of_that_size(monkeypatch, threads, preset, blas):
    """`launch.py worker -t N`: the worker's loops and its BLAS pools take N threads (default: this
    host's cores), unless the user set a pool's size; left alone, OpenBLAS took every core and
    its sums' order with it, so a remote worker's greedy tokens differed from a spawned one's."""
    import cli.options
    from transport import protocol as p

    cores = len(os.sched_getaffinity(0))
    started = {}
    monkeypatch.setattr(cli.options.subprocess, "call", lambda cmd, env: started.update(cmd=cmd, env=env) or 0)
    environ = {} if preset is None else {"OPENBLAS_NUM_THREADS": preset}
    args = argparse.Namespace(
        backend="cpu", keys="", insecure=True, liveness=5.0, threads=threads, environ=environ, advertise=""
    )
    assert cli.options.exec_worker("tcp://127.0.0.1:5000", 1, args) == 0
    told = p.WorkerLaunch.parse(started["cmd"][started["cmd"].index("workers") + 1 :])
    assert told.threads == (threads or cores) and told.rank == 1
    assert started["env"]["OPENBLAS_NUM_THREADS"] == (str(cores) if blas == "ALL" else blas)
    assert started["env"]["OMP_NUM_THREADS"] == str(threads or cores)


def test_a_prompt_file_loses_one_trailing_newline_as_llama_cpps_does(tmp_path):
    import argparse

    from cli.generate import gather_prompts

    (tmp_path / "one.txt").write_bytes(b"Hello\n")
    (tmp_path / "two.txt").write_bytes(b"Hello\n\n")
    (tmp_path / "none.txt").write_bytes(b"Hello")
    files = [str(tmp_path / name) for name in ("one.txt", "two.txt", "none.txt")]
    args = argparse.Namespace(prompts=[], prompt=[], file=files, ctx=2)
    assert gather_prompts(args, 6) == ["Hello", "Hello\n", "Hello"]


def test_a_prompt_file_longer_than_the_context_could_hold_is_refused_unread(tmp_path):
    """-f reads at most what --ctx tokens could hold (here 6 bytes, a trailing newline besides):
    /dev/zero is refused at once instead of filling the memory."""
    import argparse

    from cli.generate import gather_prompts
    from models.gguf_model import ModelError

    (tmp_path / "fits.txt").write_bytes(b"Hello!\n")
    (tmp_path / "long.txt").write_bytes(b"Hello!!")
    fits = argparse.Namespace(prompts=[], prompt=[], file=[str(tmp_path / "fits.txt")], ctx=2)
    assert gather_prompts(fits, 6) == ["Hello!"]
    for path in (tmp_path / "long.txt", "/dev/zero"):
        args = argparse.Namespace(prompts=[], prompt=[], file=[str(path)], ctx=2)
        with pytest.raises(ModelError, match="longer than a context of 2 tokens could hold"):
            gather_prompts(args, 6)


@pytest.mark.parametrize(
    "flag, value",
    [("--temp", "-1"), ("--top-p", "-0.5"), ("--top-p", "1.5"), ("--min-p", "1"), ("--repeat-penalty", "0"),
     ("--top-k", "-2"), ("--repeat-last-n", "-1"), ("--temp", "nan")],
)  # fmt: skip
def test_a_bad_sampling_flag_is_named_in_one_line(flag, value):
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "generate", "hi", flag, value, "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    shown = f"{flag} {float(value) if flag not in ('--top-k', '--repeat-last-n') else int(value)}"
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and shown in out.stderr, out.stderr
    assert "Sampling(" not in out.stderr


def test_keys_refuses_to_overwrite_without_force(tmp_path):
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, str(ROOT / "launch.py"), "keys", str(tmp_path / "k"), *a],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run().returncode == 0
    first = (tmp_path / "k").read_bytes()
    refused = run()
    assert refused.returncode == 2 and "--force" in refused.stderr and (tmp_path / "k").read_bytes() == first
    assert run("--force").returncode == 0 and (tmp_path / "k").read_bytes() != first


def test_a_text_longer_than_the_context_could_hold_is_refused_before_it_is_tokenized():
    """A chat template may render megabytes (inside its sandbox's bounds): the text is measured
    against the context times the vocabulary's longest token, in characters and in UTF-8 bytes,
    before the tokenizer sees it."""
    import types

    from models.gguf_model import ModelError
    from models.loading import check_text_fits

    model = types.SimpleNamespace(longest_token_bytes=3)
    assert check_text_fits("abcdef", 2, model) == "abcdef"
    assert check_text_fits("\u00e9\u00e9\u00e9", 2, model) == "\u00e9\u00e9\u00e9"  # 6 bytes
    for text in ("abcdefg", "\u00e9\u00e9\u00e9\u00e9"):  # 7 characters; 4 characters in 8 bytes
        with pytest.raises(ModelError, match="longer than a context of 2 tokens could hold"):
            check_text_fits(text, 2, model)


def test_the_workers_hear_their_decode_runs_no_blas_only_where_it_does_not(tmp_path):
    """models.loading.decode_pool_env: the workers of a file every matrix of which is in a block
    format, kept native, multiplied with 8-bit activations, are told their decode runs no BLAS
    (their loops' threads may spin longer: workers/binding.py); not where float32 weights or
    activations (BLAS) take turns with the loops, where a matrix is float16, or where the user
    set their own spin."""
    from models import synthetic
    from models.gguf_model import GGUFModel
    from models.loading import decode_pool_env
    from transport.environment import INTEGER_DECODE_ENV, POOL_SPIN_ENV

    shape = synthetic.Shape(layers=1, hidden=64, ffn=128, heads=2, kv_heads=1, vocab=64, context=32)
    blocked = GGUFModel(synthetic.write(tmp_path / "q.gguf", synthetic.Recipe(shape, "q4_1", "q8_0")).path)
    half = GGUFModel(synthetic.write(tmp_path / "h.gguf", synthetic.Recipe(shape, "q4_1", "f16")).path)
    assert blocked.all_blocked() and not half.all_blocked()
    assert decode_pool_env(blocked, "native", "q8", {}) == {INTEGER_DECODE_ENV: "1"}
    for model, weights, activations, environ in [
        (blocked, "f32", "q8", {}),
        (blocked, "native", "f32", {}),
        (half, "native", "q8", {}),
        (blocked, "native", "q8", {POOL_SPIN_ENV: "77"}),
    ]:
        assert decode_pool_env(model, weights, activations, environ) == {}


@pytest.mark.parametrize("rank", [None, 0, 1])  # no batch job; a batch job's rank 0, rank 1
def test_the_pools_environment_reaches_the_workers_started_here(monkeypatch, rank):
    """open_cluster's worker_env goes into the cluster's environment for the workers it spawns,
    and, under a batch launcher, into the environment of the worker another rank starts."""
    import contextlib
    import types

    import cli.options

    seen = {}

    @contextlib.contextmanager
    def cluster(**config):
        seen.update(config)
        yield types.SimpleNamespace(plane="shm")

    monkeypatch.setattr(cli.options, "cluster", cluster)
    monkeypatch.setattr(cli.options, "exec_worker", lambda connect, rank, args, env, linger: seen.update(env=env))
    environ = {} if rank is None else {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(rank)}
    args = argparse.Namespace(
        liveness=5.0, start_timeout=60.0, workers=None, threads=None, log_dir="", data_plane="auto", listen="",
        environ=environ, keys="", insecure=True, advertise="", spawn=None, devices="", backend="cpu",
    )  # fmt: skip
    with contextlib.suppress(SystemExit), cli.options.open_cluster(args, {"GOMP_SPINCOUNT": "20000"}):
        pass
    assert seen["env"]["GOMP_SPINCOUNT"] == "20000"
