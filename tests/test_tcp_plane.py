"""The tcp data plane's comm (workers/planes/tcp/engine.py) on its own: rendezvous, messages of
every shape matched by (source, run, step), large messages both ways at once, the bound small
all-reduce against NumPy's sums in rank order, and what a broken peer looks like (a closed
connection, garbage, an abort). Whole clusters on the plane: tests/test_collectives.py (every
algorithm against the host reference), tests/test_generation.py, tests/test_hosts.py (across
network namespaces)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from split_state.errors import ProtocolError, RemoteError, TransportError, WorkerLost
from tests.test_shm import receive_array
from transport import protocol as p
from transport.deadline import Deadline
from transport.environment import TCP_HOST_STEP_ENV
from transport.sockets import IpcDir, Security, pull
from workers import planes
from workers.planes.tcp import engine
from workers.planes.tcp.engine import TcpComm

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tcp_comms():
    """make(n) -> n TcpComms of one cluster, connected (each rank's rendezvous on its own thread,
    as each worker runs its own)."""
    ctx, ipc, made, inboxes = zmq.Context(), IpcDir(), [], []
    security = Security(ctx, None)
    session = f"s{os.getpid()}{time.monotonic_ns()}"[-16:]

    def make(n: int, hosts: list[str] | None = None) -> list[TcpComm]:
        """`hosts`: each rank's loopback address (127.0.0.x), its inbox there over tcp: ranks at
        different addresses count as on different hosts."""
        where = [f"tcp://{h}:*" for h in hosts] if hosts else [ipc.endpoint(f"t{len(inboxes)}-{r}") for r in range(n)]
        pairs = [pull(ctx, where[r], security) for r in range(n)]
        inboxes.extend(sock for sock, _ in pairs)
        endpoints = [ep for _, ep in pairs]
        comms: list = [None] * n
        errors: list = []

        def connect(rank: int) -> None:
            try:
                comms[rank] = TcpComm(rank, pairs[rank][0], endpoints, ctx, security, session)
            except Exception as exc:  # pragma: no cover - shown by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=connect, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        made.extend(comms)
        return comms

    yield make
    for comm in made:
        comm.close()
    for sock in inboxes:
        sock.close(0)
    ctx.term()
    ipc.close()


def test_the_plane_is_found_and_every_worker_can_join_it():
    assert "tcp" in planes.names()
    plane = planes.plane("tcp")
    assert plane.hosts == "many" and plane.joinable("cpu") == "" and plane.joinable("cuda") == ""


def test_messages_of_every_shape_arrive_matched_by_run_and_step(tcp_comms):
    a, b = tcp_comms(2)
    assert a.routes() == {"1": "tcp"} and b.routes() == {"0": "tcp"}
    rng = np.random.default_rng(0)
    arrays = [
        np.float32(3.5).reshape(()),  # 0-d
        np.empty((0, 4), np.float32),  # empty
        rng.integers(-128, 127, (5, 3), dtype=np.int8),
        rng.standard_normal((2, 3, 4)).astype(np.float16),
        rng.standard_normal((7, 5)).astype(np.float32)[:, 1:4],  # not contiguous
    ]
    a.send(1, 3, 0, np.ones(2, np.float32))  # a failed run's leftover: dropped
    for step, array in enumerate(arrays):
        a.send(1, 4, step, array)
    for step in reversed(range(len(arrays))):  # the last first: the others are set aside meanwhile
        got = receive_array(b, 0, 4, step, arrays[step].shape, arrays[step].dtype)
        assert got.dtype == arrays[step].dtype and np.array_equal(got, arrays[step])
    a.flush(4, Deadline(5))
    # in order, each streamed as it comes through the comm's one scratch buffer: a larger
    # message in pieces (the fragments handed over are reused), an empty one, a smaller one
    large = rng.standard_normal(engine.STREAM_BYTES // 4 + 1000).astype(np.float32)
    in_order = [large, np.empty((0, 4), np.float32), arrays[2], arrays[4]]
    for step, array in enumerate(in_order):
        a.send(1, 5, step, array)
    for step, array in enumerate(in_order):
        got = receive_array(b, 0, 5, step, array.shape, array.dtype)
        assert got.dtype == array.dtype and np.array_equal(got, array), step
    a.flush(5, Deadline(5))


def test_a_message_of_another_shape_than_the_plan_is_a_protocol_error(tcp_comms):
    a, b = tcp_comms(2)
    a.send(1, 1, 0, np.zeros((2, 3), np.float32))
    with pytest.raises(ProtocolError, match=r"worker 0 sent \(2, 3\) float32, the plan expects \(6,\) float32"):
        receive_array(b, 0, 1, 0, (6,))


def test_large_messages_both_ways_at_once_do_not_deadlock(tcp_comms):
    """Each sends 24 MiB before either reads: more than the kernel's buffers hold, so the sends
    queue and are pumped while each waits for the other's bytes."""
    a, b = tcp_comms(2)
    rng = np.random.default_rng(1)
    big = [rng.standard_normal(6 << 20).astype(np.float32) for _ in range(2)]
    got: dict = {}

    def side(comm, peer):
        comm.send(peer, 1, 0, big[comm.rank])
        got[comm.rank] = receive_array(comm, peer, 1, 0, big[peer].shape, seconds=20)
        comm.flush(1, Deadline(20))

    threads = [threading.Thread(target=side, args=(c, 1 - c.rank)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert np.array_equal(got[0], big[1]) and np.array_equal(got[1], big[0])


def contribution(rank: int, call: int, shape) -> np.ndarray:
    return np.random.default_rng((rank, call)).standard_normal(shape).astype(np.float32)


def on_every_rank(comms, side) -> None:
    threads = [threading.Thread(target=side, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def assert_rank_order_sums(results: dict, calls: int, shape) -> None:
    """Each rank's result of each call is NumPy's ((x0 + x1) + x2) + ... of the contributions,
    bit for bit (the oracle: nothing of the plane's)."""
    n = len(results)
    for call in range(calls):
        xs = [contribution(r, call, shape) for r in range(n)]
        expected = xs[0] + xs[1]
        for x in xs[2:]:
            expected = expected + x
        for r in range(n):
            assert results[r][call].tobytes() == expected.tobytes(), (r, call)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_bound_all_reduce_sums_in_rank_order(tcp_comms, n):
    """Every rank's result is NumPy's (x0 + x1) + x2 ..., bit for bit, call after call; with an
    unrelated message (a generation's stop flag) ahead of a step's contribution, and with the
    results written into the caller's buffer."""
    comms = tcp_comms(n)
    shape = (3, 257)
    results: dict = {}

    def side(comm):
        out = np.empty(shape, np.float32)
        run = comm.bound_all_reduce(np.dtype(np.float32), shape, out)
        mine = []
        for call in range(5):
            if comm.rank == 0 and call == 2:
                for d in range(1, n):
                    comm.send(d, 10 + call, 1 << 30, np.array([0, 1], np.int8))
            assert run(contribution(comm.rank, call, shape), 10 + call, 3, Deadline(10)) is out
            mine.append(out.copy())
        results[comm.rank] = mine

    on_every_rank(comms, side)
    assert_rank_order_sums(results, 5, shape)
    for d in range(1, n):  # the stop flags were kept for their own step
        flag = receive_array(comms[d], 0, 12, 1 << 30, (2,), np.int8)
        assert flag.tolist() == [0, 1]


@pytest.mark.parametrize("step", ["shm", "tcp"])
@pytest.mark.parametrize("hosts", [[1, 1, 2, 2], [1, 2, 1, 3, 2], [1, 1, 1, 2, 2]], ids=["2x2", "2+2+1", "3+2"])
def test_across_hosts_the_small_all_reduce_goes_host_by_host_with_the_same_bits(tcp_comms, hosts, step, monkeypatch):
    """Ranks at different addresses count as different hosts: every rank sends its contribution
    to one rank of each other host, posts its own and those it received for its host-mates
    (through shared memory, or over TCP where asked) and adds all of them in rank order; every
    rank gets NumPy's ((x0 + x1) + x2) + ... bit for bit, and the bytes each rank sends over TCP
    follow that pattern (a direct exchange would send n - 1 contributions from every rank)."""
    if step == "tcp":
        monkeypatch.setenv(TCP_HOST_STEP_ENV, "tcp")
    n, shape = len(hosts), (2, 300)
    comms = tcp_comms(n, [f"127.0.0.{h}" for h in hosts])
    assert comms[0].hosts == tuple(sorted(set(hosts)).index(h) for h in hosts)
    for r in range(n):  # a host of several workers shares memory unless told not to
        assert (comms[r].host_boxes is not None) == (step == "shm" and hosts.count(hosts[r]) > 1)
    results: dict = {}

    def side(comm):
        run = comm.bound_all_reduce(np.dtype(np.float32), shape)
        got = []
        for call in range(3):
            got.append(run(contribution(comm.rank, call, shape), 20 + call, 1, Deadline(10)))
        results[comm.rank] = got

    on_every_rank(comms, side)
    assert_rank_order_sums(results, 3, shape)
    for call in range(3):
        assert len({id(results[r][call]) for r in range(n)}) == n  # each call's result its own
    one, host_count = 2 * 300 * 4, len(set(hosts))
    for r in range(n):
        host = [q for q in range(n) if hosts[q] == hosts[r]]
        others = [[q for q in range(n) if hosts[q] == h] for h in sorted(set(hosts)) if h != hosts[r]]
        # its own to one rank of each other host; over TCP inside, its post (its own and the
        # contributions sent to it: from each rank of another host at its place modulo its
        # host's size) to each mate
        relayed = sum(1 for g in others for at in range(len(g)) if at % len(host) == host.index(r))
        inside = (step == "tcp") * (len(host) - 1) * (1 + relayed) * one
        assert comms[r].bytes_sent == 3 * ((host_count - 1) * one + inside), (r, comms[r].bytes_sent)


def test_posts_of_the_largest_contributions_and_their_relays_fit_their_slots(tcp_comms):
    """2 hosts x 2 with contributions of DIRECT_BYTES: each post holds two of them (its own and
    the one relayed), past one postbox slot of the shm plane, and the sums hold bit for bit."""
    comms = tcp_comms(4, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"])
    shape = (engine.DIRECT_BYTES // 4,)
    assert all(c.host_boxes is not None and c.host_boxes.slot_bytes >= 2 * engine.DIRECT_BYTES for c in comms)
    results: dict = {}

    def side(comm):
        run = comm.bound_all_reduce(np.dtype(np.float32), shape)
        results[comm.rank] = [
            run(contribution(comm.rank, call, shape), 30 + call, 1, Deadline(10)) for call in range(3)
        ]

    on_every_rank(comms, side)
    assert_rank_order_sums(results, 3, shape)


def test_each_contribution_reaches_each_other_host_once_and_every_rank_gets_all():
    """host_routes, against a count made here: every rank sends to one rank of each other
    host, at its own place there modulo that host's size; what each rank receives is exactly
    what was sent to it; and a rank's own post with its mates' posts hold every rank once."""
    groups = ((0, 1, 2), (3, 4), (5,), (6, 7, 8, 9))
    sent, received = [], []
    for g in groups:
        for at, r in enumerate(g):
            routes = engine.host_routes(groups, r)
            assert routes.sends_to == tuple(h[at % len(h)] for h in groups if h != g)
            assert routes.mates == tuple(q for q in g if q != r) and routes.posts[r] == (r, *routes.relays)
            sent += [(r, q) for q in routes.sends_to]
            received += [(q, r) for q in routes.relays]
            held = [q for m in g for q in routes.posts[m]]
            assert sorted(held) == list(range(10)), (r, held)
    assert sorted(sent) == sorted(received) and len(sent) == sum(len(g) * (len(groups) - 1) for g in groups)
    assert engine.post_rows(groups, (0, 1, 2)) == 1 + 1 + 1 + 2  # rank 0: 3, 5, 6 and 9


def test_a_host_whose_files_cannot_be_shared_keeps_its_step_on_tcp(tcp_comms, monkeypatch):
    """A worker that cannot map a mate's file says so; its whole host then takes its mates'
    contributions over TCP (the other host still shares memory), with the same bits, and no
    file is left behind."""
    from workers.planes.tcp import host_step

    real = host_step.InboxFile.attach

    def attach(path, world):
        if str(path).endswith("-0-host"):  # rank 1 cannot map rank 0's file
            raise TransportError("not shared here")
        return real(path, world)

    monkeypatch.setattr(host_step.InboxFile, "attach", attach)
    comms = tcp_comms(4, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"])
    assert [c.host_boxes is not None for c in comms] == [False, False, True, True]
    shared = str(comms[2].host_boxes.own.path)
    assert shared.endswith("-2-host")
    for r in (0, 1):  # made before the answer, removed after it
        assert not Path(shared.replace("-2-host", f"-{r}-host")).exists()
    results: dict = {}

    def side(comm):
        run = comm.bound_all_reduce(np.dtype(np.float32), (5,))
        results[comm.rank] = [run(contribution(comm.rank, 0, (5,)), 3, 2, Deadline(10))]

    on_every_rank(comms, side)
    assert_rank_order_sums(results, 1, (5,))
    # rank 1: its own to rank 3, and its post (its own and rank 3's) to rank 0; rank 3: its own to rank 1
    assert comms[1].bytes_sent == 5 * 4 + 2 * 5 * 4 and comms[3].bytes_sent == 5 * 4


def test_a_worker_waiting_on_its_silent_mate_hears_an_abort_and_else_its_deadline(tcp_comms):
    """Host by host through shared memory, a worker whose host-mate never posts (it died, or
    failed) is not left waiting: an abort from any worker ends the wait at once, and without
    one the deadline does, naming the mate."""
    comms = tcp_comms(4, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"])
    member = comms[1]
    run = member.bound_all_reduce(np.dtype(np.float32), (8,))
    for r in (7, 8):  # rank 3's contribution is there: the wait is for rank 0's post
        comms[3].send(1, r, 1, np.ones(8, np.float32))
    comms[3].flush(8, Deadline(5))
    threading.Timer(0.2, comms[3].abort, args=(7, "ValueError", "boom")).start()
    start = time.monotonic()
    with pytest.raises(RemoteError, match="run 7 aborted: worker 3 reports ValueError: boom"):
        run(np.ones(8, np.float32), 7, 1, Deadline(10))
    assert time.monotonic() - start < 1.5
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="no data from worker 0 within 0.5 s") as caught:
        run(np.ones(8, np.float32), 8, 1, Deadline(0.5))
    assert caught.value.rank == 0 and time.monotonic() - start < 1.5


def test_a_worker_waiting_on_a_mate_that_exited_is_told_by_its_closed_connection(tcp_comms):
    """A worker awaits its host-mate's post in shared memory, not on its socket; a mate whose
    process ends (its connections closed) is still seen within milliseconds, not at the
    collective's deadline."""
    comms = tcp_comms(4, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"])
    waiting = comms[0]
    run = waiting.bound_all_reduce(np.dtype(np.float32), (8,))
    comms[2].send(0, 4, 1, np.ones(8, np.float32))  # rank 2's contribution is there: the wait is for rank 1's post
    comms[2].flush(4, Deadline(5))
    threading.Timer(0.2, comms[1].close).start()
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="worker 1 closed its connection") as caught:
        run(np.ones(8, np.float32), 4, 1, Deadline(20))
    assert caught.value.rank == 1 and time.monotonic() - start < 2


def test_a_peer_that_closes_its_connection_is_lost_at_once(tcp_comms):
    a, b = tcp_comms(2)
    a.links[1].sock.close()
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="worker 0 closed its connection") as caught:
        receive_array(b, 0, 1, 0, (4,), seconds=20)
    assert caught.value.rank == 0 and time.monotonic() - start < 1
    with pytest.raises(WorkerLost):  # and stays lost
        receive_array(b, 0, 2, 0, (4,), seconds=1)


def test_garbage_on_the_connection_is_a_protocol_error_naming_the_sender(tcp_comms):
    a, b = tcp_comms(2)
    header = bytearray(engine.HEADER.pack(1, 0, 8, b"float99", 1) + engine.DIM.pack(2))
    a.links[1].sock.sendall(bytes(header) + bytes(8))
    with pytest.raises(ProtocolError, match="worker 0 sent a message of dtype b'float99'"):
        receive_array(b, 0, 1, 0, (2,))
    good = engine.HEADER.pack(1, 0, 12, b"float32", 1) + engine.DIM.pack(2)  # 12 bytes is not 2 floats
    _, c = tcp_comms(2)
    c.links[0].sock.sendall(good)
    with pytest.raises(ProtocolError, match=r"claims shape \(2,\)"):
        receive_array(_, 1, 1, 0, (2,))


def test_a_message_claiming_more_than_the_cap_is_refused_before_anything_is_allocated(tcp_comms):
    a, b = tcp_comms(2)
    huge = engine.MAX_PAYLOAD + 4
    a.links[1].sock.sendall(engine.HEADER.pack(1, 0, huge, b"uint8", 1) + engine.DIM.pack(huge))
    with pytest.raises(ProtocolError, match=f"a message of {huge} bytes"):
        receive_array(b, 0, 1, 0, (4,))


def test_an_abort_ends_a_wait_for_data(tcp_comms):
    a, b = tcp_comms(2)
    threading.Timer(0.2, a.abort, args=(7, "ValueError", "boom")).start()
    start = time.monotonic()
    with pytest.raises(RemoteError, match="run 7 aborted: worker 0 reports ValueError: boom"):
        receive_array(b, 0, 7, 0, (4,), seconds=20)
    assert time.monotonic() - start < 2


def test_a_wait_broken_off_midway_skips_the_rest_of_that_message(tcp_comms):
    """An abort that ends a wait while a message is half read (its sender stalled) leaves the
    connection where the next message starts."""
    a, b = tcp_comms(2)
    message = np.arange(1000, dtype=np.float32)
    whole = bytes(engine.header_bytes(5, 0, message)) + message.tobytes()
    a.links[1].sock.sendall(whole[:1500])  # the header and part of the payload
    threading.Timer(0.2, a.abort, args=(5, "ValueError", "stalled")).start()
    with pytest.raises(RemoteError):
        receive_array(b, 0, 5, 0, (1000,), seconds=20)
    a.links[1].sock.sendall(whole[1500:])
    b.forget_aborts()
    a.send(1, 6, 0, message * 2)
    assert np.array_equal(receive_array(b, 0, 6, 0, (1000,)), message * 2)


def test_a_connection_that_does_not_greet_with_the_session_is_dropped():
    session = b"0123456789abcdef"
    for greeting, expected in [
        (engine.GREETING.pack(engine.MAGIC, 2, session), 2),
        (engine.GREETING.pack(b"HTTP", 2, session), -1),  # a stranger
        (engine.GREETING.pack(engine.MAGIC, 2, b"x" * 16), -1),  # another cluster
        (engine.GREETING.pack(engine.MAGIC, 0, session), -1),  # not a higher rank
        (b"MTP", -1),  # closed before greeting
    ]:
        mine, theirs = socket.socketpair()
        theirs.sendall(greeting)
        theirs.close()
        assert engine._greeting(mine, session, rank=1, size=4, links={}) == expected, greeting
        mine.close()


def test_with_curve_keys_the_plane_falls_back_to_zeromq_and_says_why(monkeypatch):
    class Keys:
        keys = object()

    with pytest.raises(planes.PlaneUnavailable, match="does not encrypt"):
        planes.plane("tcp").connect(0, p.Configure(2, ["ipc://a", "ipc://b"], "tcp", session="s"), None, None, Keys())


def test_a_rendezvous_without_its_peers_fails_in_time(monkeypatch):
    ctx, ipc = zmq.Context(), IpcDir()
    security = Security(ctx, None)
    inbox, ep = pull(ctx, ipc.endpoint("alone"), security)
    monkeypatch.setattr(engine, "RENDEZVOUS_SECONDS", 0.5)
    try:
        with pytest.raises(TransportError, match=r"workers \[0\] did not say where their tcp plane listens"):
            TcpComm(1, inbox, [ipc.endpoint("gone"), ep], ctx, security, "s")
    finally:
        inbox.close(0)
        ctx.term()
        ipc.close()
