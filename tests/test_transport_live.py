"""Malformed and hostile messages against a live receiver; CURVE authentication."""

import msgpack
import numpy as np
import pytest
import zmq

from split_state import MIRRORED, DeadlineExceeded, TransportError
from tests.transport_helpers import live_receiver
from transport import protocol as p
from transport.deadline import Deadline
from transport.sockets import COORDINATOR, CurveKeys, Security, curve_client, dealer, recv_frames, send

pytestmark = pytest.mark.timeout(60)


def header(t=p.MsgType.GET, fields=None, arrays=None, **over):
    h = {
        "v": p.PROTOCOL_VERSION,
        "t": t if isinstance(t, str) else int(t),
        "id": 9,
        "f": {"tensor": 1} if fields is None else fields,
        "a": arrays or [],
    }
    h.update(over)
    return msgpack.packb(h)


PUT_FIELDS = {"tensor": 1, "state": ["M"], "shape": [2]}
F32x2 = np.zeros(2, np.float32).tobytes()

MALFORMED = {
    "empty header": [b""],
    "not msgpack": [b"\xc1\xc1"],
    "header is a list": [msgpack.packb([1, 2, 3])],
    "wrong version": [header(v=99)],
    "missing version": [msgpack.packb({"t": 4, "id": 0, "f": {}, "a": []})],
    "unknown type": [header(t=99)],
    "type is a string": [header(t="GET")],
    "id is a string": [header(id="x")],
    "missing field": [header(fields={})],
    "extra field": [header(fields={"tensor": 1, "evil": 2})],
    "field of wrong type": [header(fields={"tensor": "one"})],
    "bool where int expected": [header(fields={"tensor": True})],
    "bogus dtype": [header(p.MsgType.PUT, PUT_FIELDS, [["complex64", [2], 1]]), F32x2],
    "dtype not a string": [header(p.MsgType.PUT, PUT_FIELDS, [[7, [2], 1]]), F32x2],
    "lying shape": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [10], 1]]), F32x2],
    "negative dimension": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [-2], 1]]), F32x2],
    "giant declared size": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [2**40, 2**40], 1]]), F32x2],
    "too many dimensions": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [1] * 40, 1]]), F32x2],
    "truncated frames": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [2], 2]]), F32x2[:4]],
    "short frame": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [2], 1]]), F32x2[:4]],
    "extra frames": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [2], 1]]), F32x2, b"junk"],
    "zero frame count": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [2], 0]])],
    "huge frame count": [header(p.MsgType.PUT, PUT_FIELDS, [["float32", [2], 10**6]]), F32x2],
    "descriptor not a list": [header(p.MsgType.PUT, PUT_FIELDS, ["float32"]), F32x2],
    "missing array": [header(p.MsgType.PUT, PUT_FIELDS, [])],
    "msgpack bomb (declared 4G-entry array)": [b"\xdd\xff\xff\xff\xff\x00"],
    "msgpack bomb (declared 4 GiB string)": [b"\xdb\xff\xff\xff\xff"],
    "oversized header": [msgpack.packb({"v": 1, "pad": "x" * (2 << 20)})],
    "integer map keys": [msgpack.packb({1: 2})],
    "bad split state": [header(p.MsgType.PUT, dict(PUT_FIELDS, state=["S", 0, [[1.5]]]), [["float32", [2], 1]]), F32x2],
    "malformed program step": [
        header(p.MsgType.LOAD_PROGRAM, {"program": 1, "steps": [[], [["op", "add"]]], "outputs": []})
    ],
    "deeply nested params": [
        header(
            p.MsgType.LOAD_PROGRAM,
            {
                "program": 1,
                "steps": [[{"x": [[[[[[[[[[[1]]]]]]]]]]]}], [["op", "add", [0], 1, 0, [1], "float32"]]],
                "outputs": [],
            },
        )
    ],
    "no frames at all": [],
}


# What each case must be rejected for: the table reaches the check it targets, not an earlier one.
REASONS = {
    "empty header": "not valid msgpack",
    "not msgpack": "not valid msgpack",
    "header is a list": "header must be a map",
    "wrong version": "unknown protocol version 99",
    "missing version": "unknown protocol version None",
    "unknown type": "unknown message type 99",
    "type is a string": "unknown message type 'GET'",
    "id is a string": "request id must be an int",
    "missing field": "missing fields ['tensor']",
    "extra field": "unexpected fields ['evil']",
    "field of wrong type": "field 'tensor' must be an int, got str",
    "bool where int expected": "field 'tensor' must be an int, got bool",
    "bogus dtype": "dtype 'complex64' is not supported",
    "dtype not a string": "dtype 7 is not supported",
    "lying shape": "needs 40 bytes, frames hold 8",
    "negative dimension": "negative dimension",
    "giant declared size": "exceed the 17179869184-byte cap",
    "too many dimensions": "40 dimensions exceed the limit of 32",
    "truncated frames": "needs 2 frames, only 1 left",
    "short frame": "needs 8 bytes, frames hold 4",
    "extra frames": "1 extra frames after the declared arrays",
    "zero frame count": "bad frame count 0",
    "huge frame count": "bad frame count 1000000",
    "descriptor not a list": "descriptor must be [dtype, shape, n_frames]",
    "missing array": "carries 1 arrays, header lists 0",
    "msgpack bomb (declared 4G-entry array)": "exceeds max_array_len",
    "msgpack bomb (declared 4 GiB string)": "not valid msgpack",
    "oversized header": "exceeds the 1048576-byte limit",
    "integer map keys": "not allowed for map key",
    "bad split state": "malformed split segments",
    "malformed program step": "malformed step",
    "deeply nested params": "nests deeper than 8",
    "no frames at all": "empty message",
}


def test_every_case_names_its_reason():
    assert set(REASONS) == set(MALFORMED)


def ask(sock, frames, seconds=5.0):
    sock.send_multipart(frames)
    return p.decode(recv_frames(sock, Deadline(seconds)))[0]


def test_table_has_at_least_25_cases():
    assert len(MALFORMED) >= 25


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_message_gets_protocol_error_and_receiver_keeps_serving(name):
    with live_receiver() as (ctx, endpoint):
        sock = dealer(ctx, endpoint, b"client", Security(ctx, None))
        try:
            frames = MALFORMED[name]
            if frames:
                reply = ask(sock, frames)
                assert isinstance(reply, p.Error) and reply.kind == "ProtocolError", reply
                assert REASONS[name] in reply.message, reply.message
            # the receiver is still up and serves a valid request right after
            send(sock, p.Get(tensor=3), request_id=1)
            reply, rid = p.decode(recv_frames(sock, Deadline(5)))
            assert isinstance(reply, p.Tensor) and reply.tensor == 3 and rid == 1
        finally:
            sock.close(0)


def test_valid_put_is_served():
    with live_receiver() as (ctx, endpoint):
        sock = dealer(ctx, endpoint, b"client", Security(ctx, None))
        try:
            send(sock, p.Put(1, MIRRORED, (3,), np.ones(3, np.float64)))
            reply, _ = p.decode(recv_frames(sock, Deadline(5)))
            assert reply == p.Ok({"bytes": 24})
        finally:
            sock.close(0)


def plain_dealer(ctx, endpoint, keys=None):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 1000
    if keys is not None:
        curve_client(sock, keys)
    sock.connect(endpoint)
    return sock


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_curve_admits_only_holders_of_the_key(transport):
    keys = CurveKeys.generate()
    endpoint = "tcp://127.0.0.1:0" if transport == "tcp" else None
    with live_receiver(keys, endpoint) as (ctx, bound):
        with_key = plain_dealer(ctx, bound, keys)
        no_key = plain_dealer(ctx, bound)
        wrong_key = plain_dealer(ctx, bound, CurveKeys(keys.public, CurveKeys.generate().secret))
        # the right server key (public, all a stranger needs to start a handshake) with a key
        # pair of its own: only the server's check of client keys stops this one
        foreign = ctx.socket(zmq.DEALER)
        foreign.linger, foreign.sndtimeo = 0, 1000
        foreign.curve_serverkey = keys.for_rank(COORDINATOR)[0]
        foreign.curve_publickey, foreign.curve_secretkey = zmq.curve_keypair()
        foreign.connect(bound)
        try:
            send(with_key, p.Get(tensor=5))
            reply, _ = p.decode(recv_frames(with_key, Deadline(5)))
            assert isinstance(reply, p.Tensor)
            for sock in (no_key, wrong_key, foreign):
                # the handshake fails: the send times out (no peer) or the reply never comes
                with pytest.raises((DeadlineExceeded, TransportError)):
                    send(sock, p.Get(tensor=5))
                    recv_frames(sock, Deadline(1.0))
        finally:
            for s in (with_key, no_key, wrong_key, foreign):
                s.close(0)


def test_key_files_round_trip(tmp_path):
    keys = CurveKeys.generate()
    keys.save(tmp_path / "cluster.key")
    assert CurveKeys.load(tmp_path / "cluster.key") == keys
    assert (tmp_path / "cluster.key").stat().st_mode & 0o777 == 0o600


def test_a_stop_signal_ends_a_poll_at_once():
    """The coordinator's heartbeat thread and a worker's watchdog poll for a heartbeat interval;
    setting their stop signal must end that wait at once (a close waited 0.5 s per thread)."""
    import threading
    import time

    import zmq

    from transport.stop_signal import StopSignal

    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.bind("inproc://stop-signal-test")
    stop = StopSignal()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(stop.fd, zmq.POLLIN)
    try:
        threading.Timer(0.1, stop.set).start()
        start = time.monotonic()
        events = dict(poller.poll(5000))
        assert time.monotonic() - start < 2.0 and stop.fd in events and sock not in events
        assert stop.is_set()
        stop.set()  # twice is harmless
    finally:
        stop.close()
        sock.close(0)
        context.term()
