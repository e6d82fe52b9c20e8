"""Closed to strangers: tcp is authenticated unless --insecure is given, and what a peer can push
into a worker's data plane is bounded to the run in progress and the next."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from meta import ClusterConfig, MetaDevice, ProcessCluster
from split_state import MIRRORED, DeadlineExceeded, MetaError, Split, TransportError
from transport import protocol as p
from transport.deadline import Deadline
from transport.sockets import recv_frames, send
from workers import comm as comm_module
from workers.comm import QueueComm

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent


def test_spawned_tcp_workers_get_keys_and_a_stranger_cannot_join(fresh_cluster):
    cluster = fresh_cluster(2, host="127.0.0.1")
    assert cluster.keys is not None  # an ephemeral key pair for the workers spawned here
    dev = MetaDevice(cluster)
    x = dev.tensor(np.arange(8, dtype=np.float32), Split.even(0, 8, 2))
    assert np.array_equal(x.redistribute(MIRRORED).numpy(), np.arange(8, dtype=np.float32))
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.linger, stranger.sndtimeo = 0, 500
    stranger.identity = p.worker_identity(0, 1)
    stranger.connect(cluster.endpoint)
    try:
        with pytest.raises((DeadlineExceeded, TransportError, zmq.Again)):
            send(stranger, p.Hello(0, 1, "cpu", "", 0, 0, "tcp://127.0.0.1:1"))
            recv_frames(stranger, Deadline(1.0))  # no handshake, no reply
    finally:
        stranger.close(0)
        ctx.term()
    assert np.array_equal(x.numpy(), np.arange(8, dtype=np.float32))  # the cluster carries on


def test_tcp_with_remote_workers_needs_keys_or_an_explicit_insecure():
    with pytest.raises(MetaError, match="without keys.*--insecure"):
        ProcessCluster(ClusterConfig(workers=1, host="127.0.0.1", spawn=False))


def test_a_worker_needs_the_key_file_or_insecure():
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "worker", "--connect", "tcp://127.0.0.1:1", "--backend", "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "needs the cluster's key file" in out.stderr


def test_insecure_tcp_says_who_can_connect(capfd, fresh_cluster):
    fresh_cluster(1, host="127.0.0.1", insecure=True)
    assert "anyone who can reach them can join" in capfd.readouterr().err


def chunk(run: int, nbytes: int = 16) -> p.Chunk:
    return p.Chunk(1, run, 0, np.zeros(nbytes, np.uint8))


def test_data_for_runs_other_than_the_current_and_next_is_dropped():
    comm = QueueComm(0, [queue.Queue(), queue.Queue()])
    for run in (3, 5, 6, 7, 10**6):  # awaiting run 5: 3 is stale, 7 and 10**6 cannot be in flight
        comm._take(chunk(run), 5)
    assert sorted(c.run for c in comm._stash[1]) == [5, 6]


def test_what_is_set_aside_for_the_next_run_is_bounded(monkeypatch):
    monkeypatch.setattr(comm_module, "MAX_EARLY_BYTES", 100)
    comm = QueueComm(0, [queue.Queue(), queue.Queue()])
    for _ in range(10):
        comm._take(chunk(6, 40), 5)
    assert sum(c.array.nbytes for c in comm._stash[1]) == 80


def test_an_abort_of_every_run_does_not_outlive_the_run_it_woke():
    comm = QueueComm(0, [queue.Queue(), queue.Queue()])
    comm._take(p.Abort(1, -1, "WorkerLost", "forged"), 5)
    with pytest.raises(Exception, match="aborted"):
        comm._raise_if_aborted(5)
    comm.forget_aborts()  # what a worker does when the next RunProgram arrives
    comm._raise_if_aborted(6)


def test_data_plane_queues_are_bounded(fresh_cluster):
    from transport.sockets import HIGH_WATER_MARK, Security, pull, push

    ctx = zmq.Context()
    try:
        inbox, endpoint = pull(ctx, "tcp://127.0.0.1:*", Security(ctx, None))
        out = push(ctx, endpoint, Security(ctx, None))
        assert inbox.rcvhwm == HIGH_WATER_MARK and out.sndhwm == HIGH_WATER_MARK
        inbox.close(0)
        out.close(0)
    finally:
        ctx.term()


def test_a_key_holder_speaks_only_for_its_own_rank(tmp_path):
    """Rank 1's key cannot forge rank 0's data or aborts; the coordinator may abort for a worker."""
    from transport.sockets import COORDINATOR, CurveKeys, IpcDir, Security, pull, push
    from workers.comm import ZmqComm

    keys, ipc = CurveKeys.generate(), IpcDir()
    contexts = {r: zmq.Context() for r in (0, 1, COORDINATOR)}  # one authenticator per context
    security = {r: Security(ctx, keys, rank=r) for r, ctx in contexts.items()}
    inbox, ep0 = pull(contexts[0], ipc.endpoint("d0"), security[0])
    comm = ZmqComm(0, inbox, [ep0, ipc.endpoint("d1")], contexts[0], security[0])
    sends = {r: push(contexts[r], ep0, security[r], server=0) for r in (1, COORDINATOR)}
    try:
        for sender, message in [
            (1, p.Chunk(0, 5, 0, np.zeros(2))),  # forged: rank 1 posing as rank 0
            (1, p.Abort(0, -1, "WorkerLost", "forged")),  # forged: an abort in rank 0's name
            (1, p.Chunk(1, 5, 0, np.ones(2))),
            (1, p.Abort(1, 5, "ValueError", "rank 1's own failure")),
            (COORDINATOR, p.Abort(1, -1, "WorkerLost", "the coordinator lost rank 1")),
        ]:
            send(sends[sender], message)
        got = []
        while (message := comm._next(2.0)) is not None:
            got.append(message)
            if len(got) == 3:
                break
        assert sorted((type(m).__name__, m.src if isinstance(m, p.Chunk) else m.rank, m.run) for m in got) == [
            ("Abort", 1, -1),
            ("Abort", 1, 5),
            ("Chunk", 1, 5),
        ]  # two connections: their messages interleave in any order
        assert comm._next(0.3) is None  # the forged two never arrive
    finally:
        comm.close()
        for sock in (inbox, *sends.values()):
            sock.close(0)
        for r, ctx in contexts.items():
            security[r].close()
            ctx.term()
        ipc.close()


def test_forged_heartbeats_do_not_hide_a_stopped_worker(fresh_cluster):
    import os
    import signal
    import threading
    import time

    from split_state import WorkerTimeout
    from transport.sockets import Security, push

    cluster = fresh_cluster(2, host="127.0.0.1", liveness=2.0, call_timeout=15.0)
    dev = MetaDevice(cluster)
    ctx = zmq.Context()
    forger_security = Security(ctx, cluster.keys, rank=1)  # a key holder: worker 1's identity
    forger = push(ctx, cluster.beat_in_endpoint, forger_security)
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            send(forger, p.Heartbeat(0))  # "worker 0 is alive"
            time.sleep(0.1)

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    os.kill(cluster.processes[0].pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerTimeout, match="worker 0"):
            dev.tensor(np.ones(4, np.float32)).numpy()
        assert time.monotonic() - start < 6.0
    finally:
        os.kill(cluster.processes[0].pid, signal.SIGCONT)
        stop.set()
        thread.join(2)
        forger.close(0)
        forger_security.close()
        ctx.term()


def test_a_strangers_heartbeats_for_a_rank_the_cluster_lacks_never_stop_it(fresh_cluster):
    """On an insecure coordinator anyone can send a Heartbeat: one naming rank 99 (or a refused
    worker's mistyped rank) must not be watched, or its silence after it would be taken for a
    lost worker and end a healthy job."""
    import time

    from transport.sockets import Security, push

    cluster = fresh_cluster(2, host="127.0.0.1", insecure=True, liveness=1.0)
    dev = MetaDevice(cluster)
    ctx = zmq.Context()
    security = Security(ctx, None)
    stranger = push(ctx, cluster.beat_in_endpoint, security)
    try:
        for rank in (99, 7, -1):
            send(stranger, p.Heartbeat(rank))
        time.sleep(2.5)  # past the liveness window of the ranks a stranger named
        assert np.array_equal(dev.tensor(np.arange(4, dtype=np.float32), MIRRORED).numpy(), np.arange(4))
    finally:
        stranger.close(0)
        security.close()
        ctx.term()


def _worker(endpoint: str, rank: int) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "launch.py"), "worker", "--connect", endpoint, "--rank", str(rank)]
    return subprocess.Popen([*cmd, "--backend", "cpu", "--insecure"], stderr=subprocess.PIPE, text=True)


def _stranger(ctx: zmq.Context, endpoint: str, identity: bytes, frames: list) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger, sock.identity = 0, identity
    sock.connect(endpoint)
    sock.send_multipart(frames)
    return sock


def _coordinator_in_background(made: dict, **config) -> threading.Thread:
    """A coordinator waiting for its workers on a thread: made["cluster"] once formed, or made["error"]."""

    def start() -> None:
        try:
            made["cluster"] = ProcessCluster(ClusterConfig(workers=1, host="127.0.0.1", spawn=False, **config))
        except BaseException as exc:  # noqa: BLE001 - reported by the test's assertion
            made["error"] = exc

    thread = threading.Thread(target=start)
    thread.start()
    return thread


@pytest.mark.timeout(90)
def test_stray_start_up_messages_are_refused_and_the_cluster_still_forms(capfd):
    """With --insecure anyone who reaches the port can send: a malformed message, a Hello from a
    rank the cluster does not have, or one under another rank's identity is dropped (its sender
    told why when it can be), and the real worker still joins. A second worker claiming a rank
    that is taken is told so and exits, even while no call is under way, instead of waiting out
    its liveness window."""
    from tests.test_launch import free_port_triple

    port = free_port_triple()
    endpoint = f"tcp://127.0.0.1:{port}"
    made: dict = {}
    thread = _coordinator_in_background(made, port=port, insecure=True, start_timeout=30)
    ctx = zmq.Context()
    hello = p.encode(p.Hello(7, 1, "cpu", "", 0, 0, "tcp://127.0.0.1:1"), 0)
    strangers = [
        _stranger(ctx, endpoint, b"x", [b"\x00not msgpack"]),
        _stranger(ctx, endpoint, p.worker_identity(7, 1), hello),
        _stranger(ctx, endpoint, p.worker_identity(0, 2), p.encode(p.Hello(1, 2, "cpu", "", 0, 0, "tcp://x:1"), 0)),
    ]
    time.sleep(0.5)  # the strays come first
    real = _worker(endpoint, 0)
    duplicate = None
    try:
        thread.join(60)
        assert "cluster" in made, made.get("error")
        reply, _ = p.decode(recv_frames(strangers[1], Deadline(5)))
        assert isinstance(reply, p.Error) and "ranks 0..0" in reply.message
        assert "refused 3 start-up message(s)" in capfd.readouterr().err
        cluster = made["cluster"]
        dev = MetaDevice(cluster)
        x = dev.tensor(np.arange(4, dtype=np.float32), MIRRORED)
        duplicate = _worker(endpoint, 0)
        assert duplicate.wait(20) == 2  # told while the coordinator is idle, between calls
        assert "rank 0 is taken" in duplicate.stderr.read()
        assert np.array_equal((x * 2).numpy(), 2 * np.arange(4))  # the real worker carries on
        cluster.close()
        assert real.wait(10) == 0
    finally:
        for sock in strangers:
            sock.close(0)
        ctx.term()
        if "cluster" in made:
            made["cluster"].close()
        thread.join(5)
        for proc in (real, duplicate):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()


@pytest.mark.timeout(90)
def test_a_key_holder_cannot_join_as_another_rank(tmp_path, capfd):
    """With keys, a holder of rank 1's key who says Hello as rank 0 (under rank 0's identity, so
    only the key gives it away) is dropped and told why; the real rank 0 still joins."""
    from tests.test_launch import free_port_triple
    from transport.sockets import CurveKeys, Security, dealer

    key = tmp_path / "cluster.key"
    keys = CurveKeys.generate()
    keys.save(key)
    port = free_port_triple()
    endpoint = f"tcp://127.0.0.1:{port}"
    made: dict = {}
    thread = _coordinator_in_background(made, port=port, keys=str(key), start_timeout=30)
    ctx = zmq.Context()
    impostor_security = Security(ctx, keys, rank=1)
    impostor = dealer(ctx, endpoint, p.worker_identity(0, 4242), impostor_security)
    send(impostor, p.Hello(0, 4242, "cpu", "", 0, 0, "tcp://127.0.0.1:1"))
    real = None
    try:
        reply, _ = p.decode(recv_frames(impostor, Deadline(20)))  # refused before any real worker
        assert isinstance(reply, p.Error) and "holder of rank 1's key" in reply.message
        cmd = [sys.executable, str(ROOT / "launch.py"), "worker", "--connect", endpoint, "--rank", "0"]
        real = subprocess.Popen([*cmd, "--backend", "cpu", "--keys", str(key)], stderr=subprocess.PIPE, text=True)
        thread.join(60)
        assert "cluster" in made, made.get("error")
        assert "refused 1 start-up message(s)" in capfd.readouterr().err
        dev = MetaDevice(made["cluster"])
        assert np.array_equal((dev.tensor(np.arange(4, dtype=np.float32), MIRRORED) * 3).numpy(), 3 * np.arange(4))
        made["cluster"].close()
        assert real.wait(10) == 0
    finally:
        impostor.close(0)
        impostor_security.close()
        ctx.term()
        if "cluster" in made:
            made["cluster"].close()
        thread.join(5)
        if real is not None:
            if real.poll() is None:
                real.kill()
            real.wait()


def test_a_stranger_with_its_own_curve_keys_and_the_servers_public_key_is_refused():
    """Knowing a worker's public key (public keys are not secrets) and speaking CURVE with a key
    pair of its own does not get a stranger in: the authenticator admits the cluster's keys only.
    The same socket set up with rank 1's keys is the control that does get through."""
    from transport.sockets import CurveKeys, IpcDir, Security, pull

    keys, ipc = CurveKeys.generate(), IpcDir()
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    security = Security(server_ctx, keys, rank=0)
    inbox, endpoint = pull(server_ctx, ipc.endpoint("d0"), security)
    sockets = [inbox]

    def pusher(public: bytes, secret: bytes) -> zmq.Socket:
        sock = client_ctx.socket(zmq.PUSH)
        sock.linger, sock.sndtimeo = 0, 500
        sock.curve_serverkey = keys.for_rank(0)[0]
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    try:
        stranger = pusher(*zmq.curve_keypair())
        send(stranger, p.Chunk(1, 5, 0, np.zeros(2)))
        assert not inbox.poll(1000), "a stranger's message arrived"
        member = pusher(*keys.for_rank(1))
        send(member, p.Chunk(1, 5, 0, np.ones(2)))
        assert inbox.poll(5000), "the control message from rank 1's keys did not arrive"
    finally:
        for sock in sockets:
            sock.close(0)
        security.close()
        server_ctx.term()
        client_ctx.term()
        ipc.close()
