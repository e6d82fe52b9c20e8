"""The shared-memory data plane: rings, the comm that uses them, and its fallbacks."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from meta import MetaDevice
from split_state import MIRRORED, PARTIAL, Split
from split_state.dtypes import DTYPES
from split_state.errors import ProtocolError, RemoteError, TransportError, WorkerLost
from transport import protocol as p
from transport import shm
from transport.deadline import Deadline
from transport.shm import LINE, InboxFile, RingReader, RingWriter
from transport.sockets import IpcDir, Security, pull
from workers import comm
from workers.comm import HostComm, ZmqComm
from workers.planes import connect as make_comm

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shm.supported(), reason="the shared-memory ring needs an x86-64 CPU"),
]


@pytest.fixture
def ring_file(tmp_path):
    files = []

    def make(world: int = 2, capacity: int = 4096) -> InboxFile:
        f = InboxFile.create(tmp_path / f"inbox-{len(files)}", world, capacity)
        files.append(f)
        return f

    yield make
    for f in files:
        f.close()


def read_record(reader: RingReader, writer: RingWriter) -> tuple[tuple, np.ndarray]:
    """Read the next record whole, pumping the writer whenever the reader runs dry."""
    while (header := reader.peek()) is None:
        assert not writer.pump() or reader.available(), "nothing queued and nothing to read"
    out = np.empty(header.shape, header.dtype)
    flat, at = out.reshape(-1), 0
    while reader.current is header:
        fragment = reader.fragment()
        if fragment is None:
            writer.pump()
            continue
        assert fragment.ctypes.data % LINE == 0 and not fragment.flags.writeable and fragment.dtype == header.dtype
        flat[at : at + fragment.size] = fragment
        at += fragment.size
        reader.consume(fragment.nbytes)
    return (header.run, header.step), out


ARRAYS = st.tuples(
    st.sampled_from(["float32", "float16", "bfloat16", "int32", "int64", "float64"]),
    st.lists(st.integers(0, 40), min_size=0, max_size=4).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(ARRAYS, min_size=1, max_size=12), capacity_lines=st.integers(4, 40))
def test_ring_carries_any_sequence_of_records_bit_for_bit(tmp_path_factory, specs, capacity_lines):
    """Records larger than the ring, empty ones, every dtype, wrap-around at any point."""
    f = InboxFile.create(tmp_path_factory.mktemp("ring") / "inbox", 2, capacity_lines * LINE)
    try:
        writer, reader = RingWriter(f.rings[0]), RingReader(f.rings[0])
        rng = np.random.default_rng(len(specs))
        sent = []
        for i, (dtype, shape) in enumerate(specs):
            raw = rng.integers(0, 256, size=int(np.prod(shape)) * DTYPES[dtype].itemsize, dtype=np.uint8)
            array = raw.view(DTYPES[dtype]).reshape(shape)
            sent.append(((7, i), array))
            writer.post(7, i, array)  # queued: most do not fit until the reader frees space
        for key, array in sent:
            got_key, got = read_record(reader, writer)
            assert got_key == key and got.shape == array.shape and got.dtype == array.dtype
            assert got.tobytes() == array.tobytes()
        assert writer.pump() and reader.available() == 0
    finally:
        f.close()


def test_reader_keeps_its_place_when_a_wait_is_abandoned(ring_file):
    f = ring_file(capacity=1024)
    writer, reader = RingWriter(f.rings[1]), RingReader(f.rings[1])
    big = np.arange(1000, dtype=np.float32)  # 4000 bytes through a 1024-byte ring
    writer.post(1, 0, big)
    writer.post(1, 1, np.arange(5, dtype=np.int32))
    header = reader.peek()
    first = reader.fragment()
    reader.consume(first.nbytes)  # ... and the waiter gives up here (a deadline, an abort)
    assert reader.peek() is header  # the same record, not a misread of its middle
    rest = [first.copy()]
    while reader.current is header:
        writer.pump()
        if (fragment := reader.fragment()) is not None:
            rest.append(fragment.copy())
            reader.consume(fragment.nbytes)
    assert np.array_equal(np.concatenate(rest), big)
    assert read_record(reader, writer)[0] == (1, 1)


def test_corrupted_ring_and_unknown_dtype_are_protocol_errors(ring_file):
    f = ring_file()
    writer, reader = RingWriter(f.rings[0]), RingReader(f.rings[0])
    writer.post(1, 0, np.ones(4, np.float32))
    f.rings[0].data[:4] = 0xFF  # the record's magic
    with pytest.raises(ProtocolError, match="corrupted"):
        reader.peek()
    g = ring_file()
    writer, reader = RingWriter(g.rings[0]), RingReader(g.rings[0])
    writer.post(1, 0, np.ones(4, np.float32))
    name_at = struct.calcsize("<IIqqq")
    g.rings[0].data[name_at : name_at + 8] = np.frombuffer(b"complex8", np.uint8)
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        reader.peek()


def test_inbox_files_refuse_wrong_peers(ring_file, tmp_path):
    f = ring_file(world=3)
    with pytest.raises(TransportError, match="not an inbox for 2 workers"):
        InboxFile.attach(f.path, 2)
    with pytest.raises(TransportError, match="cannot open"):
        InboxFile.attach(tmp_path / "missing", 3)
    with pytest.raises(TransportError, match="cannot create"):
        InboxFile.create(tmp_path / "no-such-dir" / "inbox", 2, 4096)
    with pytest.raises(TransportError, match="cannot create"):
        InboxFile.create(f.path, 3, 4096)  # exists: never reuse another cluster's file
    f.buffer[struct.calcsize("<8sIQQ") : struct.calcsize("<8sIQQ") + 6] = b"elsewh"
    with pytest.raises(TransportError, match="belongs to host"):
        InboxFile.attach(f.path, 3)
    peer = InboxFile.attach(ring_file(world=3).path, 3)
    peer.close()


def test_ring_capacity_bounds_memory_per_worker():
    assert shm.ring_capacity(2) == 4 << 20
    assert shm.ring_capacity(16) == 1 << 20
    assert shm.ring_capacity(1000) == 256 << 10
    for n in (2, 3, 5, 8, 16):
        assert shm.ring_capacity(n) % LINE == 0 and (n - 1) * shm.ring_capacity(n) <= 16 << 20


# -- HostComm in one process: two ranks, real sockets and files -----------------------------------


@pytest.fixture
def comm_pair():
    ctx, ipc, session = zmq.Context(), IpcDir(), f"test{os.getpid()}{time.monotonic_ns()}"
    security = Security(ctx, None)
    inboxes, endpoints = zip(*(pull(ctx, ipc.endpoint(f"d{r}"), security) for r in range(2)))
    comms = []

    def make(rank: int, kind=HostComm):
        args = (rank, inboxes[rank], list(endpoints), ctx, security)
        comms.append(kind(*args, session) if kind is HostComm else kind(*args))
        return comms[-1]

    yield make, session
    for c in comms:
        c.close()
    for sock in inboxes:
        sock.close(0)
    ctx.term()
    ipc.close()
    assert shm.remove_session(session) == 0, "inbox files left behind"


def receive_array(comm, src, run, step, shape, dtype=np.float32, seconds=5.0):
    out = np.empty(shape, dtype)
    flat = out.reshape(-1)

    def sink(at, fragment):
        flat[at : at + fragment.size] = fragment

    comm.receive(src, run, step, Deadline(seconds), tuple(shape), np.dtype(dtype), sink)
    return out


def test_host_comm_matches_steps_drops_stale_runs_and_sets_aside_later_ones(comm_pair):
    make, _ = comm_pair
    a, b = make(0), make(1)
    stale, first, second = (np.full(3, v, np.float32) for v in (1, 2, 3))
    a.send(1, run=4, step=0, array=stale)  # a failed run's leftover
    a.send(1, run=5, step=1, array=second)
    a.send(1, run=5, step=0, array=first)
    assert a.routes() == {"1": "shm"}
    assert np.array_equal(receive_array(b, 0, 5, 0, (3,)), first)  # past the stale one and step 1
    assert np.array_equal(receive_array(b, 0, 5, 1, (3,)), second)  # set aside earlier
    a.flush(5, Deadline(1))


def test_host_comm_checks_what_arrives_against_the_plan(comm_pair):
    make, _ = comm_pair
    a, b = make(0), make(1)
    a.send(1, 1, 0, np.ones((2, 3), np.float32))
    with pytest.raises(ProtocolError, match=r"sent \(2, 3\) float32, the plan expects \(3, 2\) float32"):
        receive_array(b, 0, 1, 0, (3, 2))


def test_host_comm_waits_end_with_typed_errors(comm_pair):
    make, _ = comm_pair
    a, b = make(0), make(1)
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="no data from worker 0") as lost:
        receive_array(b, 0, 1, 0, (3,), seconds=0.3)
    assert lost.value.rank == 0 and time.monotonic() - start < 2
    a.abort(2, "ValueError", "bad input")
    with pytest.raises(RemoteError, match="worker 0 reports ValueError: bad input"):
        receive_array(b, 0, 2, 0, (3,))
    # a sender whose receiver takes nothing: the flush gives up at its deadline
    a.send(1, 3, 0, np.zeros(2 << 20, np.float32))  # 8 MiB through a 4 MiB ring
    with pytest.raises(WorkerLost, match=r"workers \[1\] took no data"):
        a.flush(3, Deadline(0.3))


# -- postboxes: small all-reduces read where they lie ----------------------------------------------


def in_threads(comms, work):
    """work(rank, comm) in a thread per comm; the first error is raised here."""
    errors = []

    def guarded(rank, comm_):
        try:
            work(rank, comm_)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(r, c)) for r, c in enumerate(comms)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]


def both_all_reduce(comms, steps, run=7, seconds=5.0):
    """Each comm (in its own thread) runs the bound all-reduces `steps`: (step, its addends one
    per rank, shape). Returns every comm's results, in step order."""
    results = [[] for _ in comms]

    def rank_loop(rank, comm_):
        for step, parts, shape in steps:
            bound = comm_.bound_all_reduce(parts[0].dtype, shape)
            results[rank].append(bound(parts[rank], run, step, Deadline(seconds)))

    in_threads(comms, rank_loop)
    return results


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_postbox_all_reduces_give_every_rank_the_sum_in_rank_order(comm_pair, dtype):
    make, _ = comm_pair
    comms = [make(0), make(1)]
    rng = np.random.default_rng(3)
    shapes = [(576,), (3, 5), (), (0,), (16, 1024)]  # 2.3 KiB, small, a scalar, empty, a full 64 KiB slot
    steps = [
        (k + 1, [(rng.standard_normal(shape) * 10).astype(dtype) for _ in range(2)], shape)
        for k, shape in enumerate(shapes * 2)
    ]
    results = both_all_reduce(comms, steps)
    for k, (_, (a, b), shape) in enumerate(steps):
        expected = (a.astype(np.float64) + b.astype(np.float64)).astype(dtype)  # one rounding of the exact sum
        for got in (results[0][k], results[1][k]):
            assert got.shape == shape and got.dtype == np.dtype(dtype)
            assert np.array_equal(got.reshape(-1).view(np.uint8), expected.reshape(-1).view(np.uint8))


def test_a_postbox_all_reduce_writes_into_its_buffer_and_is_done_with_its_input_on_return(comm_pair):
    """What a program's arena plan relies on (workers/program.py `writes_into`): each call's sum
    is the buffer given, the same array every call, and the caller may write over its input as
    soon as the call returns (it was copied): a peer still reading gets the value posted."""
    make, _ = comm_pair
    comms = [make(0), make(1)]
    shape, rng = (3, 192), np.random.default_rng(5)
    parts = [[rng.standard_normal(shape).astype(np.float32) for _ in range(2)] for _ in range(6)]
    outs = [np.empty(shape, np.float32) for _ in comms]
    results: list[list] = [[], []]

    def work(rank, comm_):
        bound = comm_.bound_all_reduce(np.dtype(np.float32), shape, outs[rank])
        mine = np.empty(shape, np.float32)
        for step, addends in enumerate(parts, 1):
            mine[...] = addends[rank]
            got = bound(mine, 4, step, Deadline(5.0))
            mine[...] = np.nan  # written over at once, as the arena's next use would
            assert got is outs[rank]
            results[rank].append(got.copy())

    in_threads(comms, work)
    for step, (a, b) in enumerate(parts):
        expected = (a.astype(np.float64) + b.astype(np.float64)).astype(np.float32)
        for rank in (0, 1):
            np.testing.assert_array_equal(results[rank][step], expected)
    with pytest.raises(ProtocolError, match="buffer"):
        comms[0].bound_all_reduce(np.dtype(np.float32), shape, np.empty((3, 192), np.float64))


def test_collectives_write_into_a_buffer_through_the_postboxes_and_through_the_phases(comm_pair):
    """Collectives.writes_into: a small all-reduce goes through the postboxes, a large one and a
    gather through the phases, whose last writes into the buffer; either way each call's result
    is that buffer, the same every call, and the input may be written over once a call returns.
    An embedding into a Partial makes an array of its own."""
    from workers.backends.cpu import Backend
    from workers.collectives import Collectives, HostEngine

    make, _ = comm_pair
    comms = [make(0), make(1)]
    colls = [Collectives(HostEngine(c, Backend(0))) for c in comms]
    f32 = np.dtype(np.float32)
    small, big = (2, 64), (2, shm.POST_BYTES // 4 + 3)
    gather = Split(1, ((big[1] // 2, big[1] - big[1] // 2),))
    for src, dst, shape in ((PARTIAL, MIRRORED, small), (PARTIAL, MIRRORED, big), (gather, MIRRORED, big)):
        assert colls[0].writes_into(colls[0].request(src, dst, shape, f32))
    assert not colls[0].writes_into(colls[0].request(MIRRORED, PARTIAL, small, f32))
    rng = np.random.default_rng(8)
    sums = [[rng.standard_normal(big).astype(np.float32) for _ in range(2)] for _ in range(3)]
    whole = [rng.standard_normal(big).astype(np.float32) for _ in range(3)]
    outs = {kind: [np.empty(big, np.float32) for _ in comms] for kind in ("sum", "gather")}
    got: dict = {(kind, rank): [] for kind in outs for rank in (0, 1)}

    def work(rank, comm_):
        add = colls[rank].prepared(colls[rank].request(PARTIAL, MIRRORED, big, f32), outs["sum"][rank])
        cut = colls[rank].prepared(colls[rank].request(gather, MIRRORED, big, f32), outs["gather"][rank])
        half = slice(0, big[1] // 2) if rank == 0 else slice(big[1] // 2, big[1])
        for k in range(3):
            mine = sums[k][rank].copy()
            result = add(mine, 6 + k, 1, Deadline(5.0))
            mine[...] = np.nan  # the program's next use of the input's memory
            assert result is outs["sum"][rank]
            got["sum", rank].append(result.copy())
            mine = whole[k][:, half].copy()
            result = cut(mine, 6 + k, 2, Deadline(5.0))
            mine[...] = np.nan
            assert result is outs["gather"][rank]
            got["gather", rank].append(result.copy())

    in_threads(comms, work)
    for rank in (0, 1):
        for k in range(3):
            a, b = sums[k]
            expected = (a.astype(np.float64) + b.astype(np.float64)).astype(np.float32)
            np.testing.assert_array_equal(got["sum", rank][k], expected)
            np.testing.assert_array_equal(got["gather", rank][k], whole[k])


def test_consecutive_posts_alternate_slots_whichever_step_makes_them(comm_pair):
    """A worker's posts take turns over its two slots across all its bound all-reduces: two steps
    bound apart must not both write the first slot (the second would overwrite the first while a
    peer may still read it)."""
    make, _ = comm_pair
    comms = [make(0), make(1)]
    ones = [np.ones(4, np.float32), np.ones(4, np.float32)]
    both_all_reduce(comms, [(1, ones, (4,)), (2, ones, (4,))], run=9)
    for rank, c in enumerate(comms):
        box = c.own.postbox(rank)
        assert sorted([box.find(shm.post_stamp(9, 1)), box.find(shm.post_stamp(9, 2))]) == [0, 1]


def test_postboxes_are_for_small_tensors_on_this_host(comm_pair):
    make, _ = comm_pair
    a, _ = make(0), make(1)
    assert a.bound_all_reduce(np.dtype(np.float32), (shm.POST_BYTES // 4 + 1,)) is None  # the rings carry it
    with pytest.raises(ProtocolError, match="do not fit a stamp"):
        shm.post_stamp(1, 1 << 24)


def test_a_postbox_wait_ends_with_worker_lost_at_its_deadline(comm_pair):
    make, _ = comm_pair
    a, _ = make(0), make(1)
    bound = a.bound_all_reduce(np.dtype(np.float32), (4,))
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="no data from worker 1") as lost:
        bound(np.ones(4, np.float32), 3, 1, Deadline(0.3))  # worker 1 never posts
    assert lost.value.rank == 1 and time.monotonic() - start < 2


def test_a_post_overwritten_while_it_is_read_is_a_protocol_error(comm_pair):
    """The re-check after reading: worker 1's post is found, then its slot is written over (as a
    post two steps later would, were the alternation broken) before worker 0 has checked it: the
    sum would mix two steps' data, so it is refused rather than returned."""
    make, _ = comm_pair
    a, b = make(0), make(1)
    bound = a.bound_all_reduce(np.dtype(np.float32), (4,))
    theirs, stamp = b.own.postbox(1), shm.post_stamp(5, 1)
    theirs.array(0, np.dtype(np.float32), 4)[:] = 2.0
    theirs.publish(0, stamp)
    seen = a.peer_files[1].postbox(1)  # the box worker 0 reads worker 1's posts through
    real_find = seen.find

    def find_then_overwrite(wanted):
        slot = real_find(wanted)
        if slot >= 0:
            theirs.publish(slot, shm.post_stamp(5, 3))
        return slot

    seen.find = find_then_overwrite
    with pytest.raises(ProtocolError, match="worker 1's post for run 5, step 1 changed as it was read"):
        bound(np.ones(4, np.float32), 5, 1, Deadline(1.0))


# -- sleeping and waking: waits that give the core away -------------------------------------------


def test_a_sleeper_wakes_when_rung_and_otherwise_at_its_timeout(ring_file):
    inbox = ring_file()
    start = time.monotonic()
    inbox.sleep(1 + 1, lambda: False, 0.2)  # nobody rings: the whole timeout
    assert 0.15 < time.monotonic() - start < 2
    assert int(inbox.waiting[0]) == 0, "the asleep word is cleared on waking"
    peer = InboxFile.attach(inbox.path, 2)
    try:
        threading.Timer(0.1, peer.ring).start()
        start = time.monotonic()
        inbox.sleep(1 + 1, lambda: False, 5.0)
        assert time.monotonic() - start < 2, "the bell did not wake the sleeper"
    finally:
        peer.close()


def test_a_ring_between_announcing_and_sleeping_is_not_lost(ring_file):
    """The peer publishes and rings after the sleeper read its bell but before the futex call:
    the sleep must not start (it would otherwise wait for its whole timeout)."""
    inbox = ring_file()

    def peer_rings_now() -> bool:
        assert inbox.waits_for(1), "whom the sleeper waits for is announced before it checks"
        inbox.ring()
        return False

    start = time.monotonic()
    inbox.sleep(1 + 1, peer_rings_now, 5.0)
    assert time.monotonic() - start < 1


def test_waits_for_names_the_awaited_rank_or_any(ring_file):
    inbox = ring_file(world=3)
    assert not inbox.waits_for(0) and not inbox.waits_for(1)
    inbox.waiting[0] = 1 + 1
    assert inbox.waits_for(1) and not inbox.waits_for(0) and not inbox.waits_for(2)
    assert not inbox.waits_for(1, space=True), "a receiver waiting for data is not woken by reads of its bytes"
    inbox.waiting[0] = p.SHM_WAITING_ANY
    assert all(inbox.waits_for(r) and inbox.waits_for(r, space=True) for r in range(3))


def test_a_waiting_receiver_sleeps_instead_of_spinning(comm_pair):
    """A receiver waiting 0.5 s for a peer that sends nothing uses little CPU time: with
    more runnable processes than cores, a spinning wait takes the core its peer needs."""
    make, _ = comm_pair
    make(0)
    b = make(1)
    b.send(0, 1, 0, np.zeros(1, np.float32))  # maps the peer's file: the route is shared memory
    cpu = time.thread_time()
    with pytest.raises(WorkerLost):
        receive_array(b, 0, 1, 0, (3,), seconds=0.5)
    assert time.thread_time() - cpu < 0.15


def test_a_sleeping_receiver_is_woken_by_the_sender(comm_pair, monkeypatch):
    """With sleeps of up to 5 s, only the sender's bell can end the wait soon after the send."""
    monkeypatch.setattr(comm, "BLOCK_SECONDS", 5.0)
    make, _ = comm_pair
    a, b = make(0), make(1)
    b.send(0, 1, 0, np.zeros(1, np.float32))
    data = np.arange(5, dtype=np.float32)
    threading.Timer(0.3, lambda: a.send(1, 1, 0, data)).start()
    start = time.monotonic()
    assert np.array_equal(receive_array(b, 0, 1, 0, (5,), seconds=20), data)
    assert time.monotonic() - start < 2


def test_a_sender_waiting_for_ring_space_is_woken_by_the_reader(comm_pair, monkeypatch):
    """A record larger than the ring: the sender sleeps (up to 5 s) until the reader frees room,
    and only the reader's bell, rung as it consumes, ends each of those sleeps soon."""
    monkeypatch.setattr(comm, "BLOCK_SECONDS", 5.0)
    make, _ = comm_pair
    a, b = make(0), make(1)
    big = np.random.default_rng(0).standard_normal(3 * shm.ring_capacity(2) // 4).astype(np.float32)
    a.send(1, 1, 0, big)  # three rings' worth: most of it stays queued
    got = []
    reader = threading.Timer(0.3, lambda: got.append(receive_array(b, 0, 1, 0, big.shape, seconds=20)))
    reader.start()
    start = time.monotonic()
    a.flush(1, Deadline(20))
    reader.join(20)
    assert time.monotonic() - start < 2 and np.array_equal(got[0], big)


def test_with_more_workers_than_cores_a_waiter_yields_while_it_spins(comm_pair):
    make, _ = comm_pair
    a = make(0)
    make(1)
    a.send(1, 1, 0, np.zeros(1, np.float32))
    a.cores = 4
    assert not a._waiter(Deadline(1)).polite
    a.cores = 1
    assert a._waiter(Deadline(1)).polite


def test_sender_falls_back_to_zmq_for_a_peer_without_an_inbox_file(comm_pair):
    make, _ = comm_pair
    a = make(0)
    b = make(1, kind=ZmqComm)  # e.g. another host: no file to map
    data = np.arange(10, dtype=np.float32)
    a.send(1, 1, 0, data)
    assert a.routes() == {"1": "zmq"}
    assert np.array_equal(receive_array(b, 0, 1, 0, (10,)), data)
    b.send(0, 1, 1, data * 2)  # and the shm receiver accepts ZeroMQ data too
    assert np.array_equal(receive_array(a, 1, 1, 1, (10,)), data * 2)


def test_connecting_reports_why_shared_memory_was_not_used(monkeypatch, tmp_path):
    ctx, ipc = zmq.Context(), IpcDir()
    security = Security(ctx, None)
    inbox, ep = pull(ctx, ipc.endpoint("d0"), security)
    try:
        monkeypatch.setattr(shm, "shm_root", lambda: tmp_path / "absent")
        configure = p.Configure(2, [ep, ep], "shm", session="x")
        comm = make_comm(0, configure, inbox, ctx, security)
        assert comm.plane == "zmq" and "cannot create shared-memory inbox" in comm.note
        comm.close()
        comm = make_comm(0, p.Configure(2, [ep, ep], "zmq", session="x"), inbox, ctx, security)
        assert comm.plane == "zmq" and comm.note == ""
        comm.close()
    finally:
        inbox.close(0)
        ctx.term()
        ipc.close()


# -- worker processes ---------------------------------------------------------------------------


def session_files(cluster) -> list:
    return sorted(shm.shm_root().glob(f"meta-tp-{cluster.session}-*"))


def test_large_collectives_stream_through_the_rings_bitwise(fresh_cluster):
    """12 MiB: three times a ring, so every byte goes through wrap-around and back-pressure."""
    cluster = fresh_cluster(2)
    assert [d["data_plane"] for d in cluster.data_planes] == ["shm", "shm"]
    dev = MetaDevice(cluster, check_mirrored=True)
    n, size = 2, 3 << 20
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    summed = dev.from_generator((size,), np.float32, PARTIAL, lambda d, _: parts[d])
    got = summed.redistribute(MIRRORED).numpy()
    assert got.tobytes() == (parts[0] + parts[1]).tobytes()
    x = rng.standard_normal((size // 64, 64)).astype(np.float32)
    gathered = dev.tensor(x, Split.even(0, x.shape[0], n)).redistribute(MIRRORED).numpy()
    assert gathered.tobytes() == x.tobytes()
    assert all(s["routes"] == {str(1 - s["rank"]): "shm"} for s in dev.stats().values())


def test_inbox_files_are_removed_by_their_workers_and_after_a_killed_worker(fresh_cluster):
    cluster = fresh_cluster(2)
    assert len(session_files(cluster)) == 2
    cluster.call_all({r: p.Shutdown() for r in range(2)})
    for proc in cluster.processes:  # exited by themselves: the coordinator has not cleaned up yet
        proc.wait(10)
    assert session_files(cluster) == []
    cluster.close()
    cluster = fresh_cluster(2)
    assert len(session_files(cluster)) == 2
    os.kill(cluster.pids[1], signal.SIGKILL)  # cannot remove its own file
    cluster.close()
    assert session_files(cluster) == []


def test_zmq_data_plane_on_request(fresh_cluster):
    cluster = fresh_cluster(2, data_plane="zmq")
    assert [d["data_plane"] for d in cluster.data_planes] == ["zmq", "zmq"]
    assert session_files(cluster) == []
    dev = MetaDevice(cluster)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.array_equal(dev.tensor(x, Split.even(1, 4, 2)).redistribute(MIRRORED).numpy(), x)


def test_a_worker_loads_its_all_reduces_into_the_arena(comm_pair):
    """The executor asks its collectives which redistributions write into a buffer when it loads
    a program (workers/executor.py): an all-reduce and what it sends are planned into the arena,
    a postbox-sized one (the postboxes write there) and one bigger than a slot (its phases' last
    does); an embedding into a Partial keeps buffers of its own each run."""
    from workers.backends.cpu import Backend
    from workers.executor import Executor
    from workers.store import TensorStore

    make, _ = comm_pair
    comm0, _ = make(0), make(1)
    executor = Executor(Backend(0), TensorStore(1 << 26), 5.0)
    executor.attach(comm0)
    small, big = (1, 576), (2, shm.POST_BYTES // 4)
    for shape, src, dst, expected in (
        (small, PARTIAL, MIRRORED, ["arena", "arena"]),
        (big, PARTIAL, MIRRORED, ["arena", "arena"]),
        (small, MIRRORED, PARTIAL, ["fresh", "move"]),
    ):
        steps = [
            p.OpStep("scale", (0,), 1, {"factor": 2.0}, shape, "float32"),
            p.MoveStep(1, 2, src, dst, shape, "float32"),
            p.OpStep("scale", (2,), 3, {"factor": 3.0}, shape, "float32"),
        ]
        executor.load(7, steps, [3])
        assert [pl.out for pl in executor.programs[7].placed][:2] == expected, (shape, src, dst)
        executor.unload(7)
