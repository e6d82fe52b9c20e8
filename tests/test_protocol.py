import dataclasses
import re

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from split_state import DTYPES, MIRRORED, PARTIAL, ProtocolError, Split
from split_state.sampling import Rule
from transport import protocol as p


def round_trip(message, limits=p.DEFAULT_LIMITS):
    frames = p.encode(message, request_id=41, limits=limits)
    frames = [bytes(f) for f in frames]  # as if received
    decoded, rid = p.decode(frames, limits)
    assert rid == 41
    return decoded


EXAMPLES = [
    p.Hello(
        rank=1,
        pid=123,
        backend="cuda",
        device="gpu:1",
        memory_total=10,
        memory_free=5,
        data_endpoint="ipc://x",
        planes=["shm", "nccl"],
        device_index=1,
    ),
    p.Configure(world_size=3, peers=["ipc://a", "ipc://b", "ipc://c"], collective="zmq", nccl_id=b"\x00\x01"),
    p.Get(tensor=7),
    p.Free(tensors=[1, 2, 3]),
    p.LoadProgram(
        program=5,
        steps=[
            p.OpStep("matmul", (0, 1), 2, {"spans": ((0, 3, 0),), "eps": 1e-5, "name": "x"}, (4, 2), "float32"),
            p.MoveStep(2, 3, PARTIAL, Split(0, ((2, 2),)), (4, 2), "float32"),
            p.MoveStep(3, 4, Split(0, ((2, 2),)), MIRRORED, (4, 2), "bfloat16"),
        ],
        outputs=[4],
    ),
    p.RunProgram(program=5, run=3, inputs=[[0, 10], [1, 11]], outputs=[[4, 12]], profile=1, read=[12]),
    p.RunChain(
        programs=[5, 6, 5],
        runs=[3, 4, 5],
        inputs=[[[0, 10]], [[0, 12], [1, 11]], []],
        outputs=[[[4, 12]], [[2, 13]], [[1, 14]]],
        release=[7],
        profile=1,
        read=[14],
        frees=[[], [12], [13]],
        new_data=[2],
    ),
    p.Ran(info={"compute_s": 0.5}, values=[p.Feed(12, "int64", (1, 2), 0)], data=np.arange(16, dtype=np.uint8)),
    p.Generate(
        program=5,
        run=9,
        steps=20,
        inputs=[[0, 10], [1, 11]],
        outputs=[[4, 12], [5, 13]],
        tokens=10,
        positions=11,
        values=12,
        indices=13,
        sampling=p.GenerateSettings(
            Rule(0.7, top_p=0.9, repeat_penalty=1.3, repeat_last_n=4),
            ("123", "45", "0", "0"),
            (2,),
            (False, True),
            ((5, 6), ()),
            0.25,
            "/dev/shm/board",
        ),
    ),
    p.Tokens(step=3, tokens=[[17, 4], [2, 9]]),
    p.Cancel(),
    p.NcclId(),
    p.Resync(run=12),
    p.Unload(programs=[5, 6]),
    p.Ok(info={"a": 1, "b": (1.5, "x"), "c": None}),
    p.Error(kind="OutOfMemory", message="too big", traceback="Traceback..."),
    p.Error(kind="WorkerLost", message="worker 0: worker 1 closed its connection", origin=-1, lost=1),
    p.Heartbeat(rank=2),
    p.Shutdown(),
    p.Stats(),
    p.Abort(rank=1, run=-1, kind="WorkerLost", message="worker 1 lost"),
]
# a Generate whose sequences each choose their own way (a server's batch)
_GENERATE = next(m for m in EXAMPLES if isinstance(m, p.Generate))
_OWN_CHOICES = (p.OwnChoice(Rule(0.5, top_k=3), ("9", "7", "1", "5"), 5), p.OwnChoice(Rule(), ("1", "2", "0", "0"), 1))
EXAMPLES.append(dataclasses.replace(_GENERATE, sampling=dataclasses.replace(_GENERATE.sampling, own=_OWN_CHOICES)))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert round_trip(message) == message


def test_an_error_names_the_peer_a_worker_found_gone_only_when_it_found_it_itself():
    """Error.lost: a WorkerLost of the worker's own (a peer's closed connection) names that
    peer; one that an Abort brought (origin set: the sender's failure, passed on) and every
    other error name none."""
    from split_state.errors import ShapeError, WorkerLost

    own = p.error_from(WorkerLost("worker 0: worker 2 closed its connection", rank=2))
    assert (own.kind, own.lost, own.origin) == ("WorkerLost", 2, -1)
    passed_on = WorkerLost("run 4 aborted: worker 1 reports WorkerLost: ...", rank=1)
    passed_on.origin = 1
    assert p.error_from(passed_on).lost == -1
    assert p.error_from(WorkerLost("no rank said")).lost == -1
    assert p.error_from(ShapeError("bad")).lost == -1


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} | {p.Put, p.Tensor, p.Chunk} == set(p._REGISTRY.values())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_arrays_of_every_dtype_and_shape_round_trip(dtype, shape):
    x = (np.arange(int(np.prod(shape))) % 7).astype(DTYPES[dtype]).reshape(shape)
    got = round_trip(p.Put(1, MIRRORED, shape, x))
    assert got.array.dtype == x.dtype and got.array.shape == x.shape
    assert np.array_equal(got.array.view(np.uint8), x.view(np.uint8)) if shape else got.array == x


def test_feeds_travel_with_a_run():
    data = np.arange(16, dtype=np.uint8)
    message = p.RunProgram(1, 2, [[0, 3]], [[1, 4]], [9], [p.Feed(3, "int32", (1, 2), 8)], data)
    got = round_trip(message)
    assert got.feeds == [p.Feed(3, "int32", (1, 2), 8)] and np.array_equal(got.feed_data, data)
    bad = p.encode(message)
    h = msgpack.unpackb(bytes(bad[0]))
    h["f"]["feeds"] = [[3, "int32", [1, 2], -1]]
    with pytest.raises(ProtocolError, match="negative offset"):
        p.decode([msgpack.packb(h), *bad[1:]])


def test_slot_pairs_travel_as_whole_int64_pairs():
    """A run's [slot, tensor] pairs, given as lists or as an (n, 2) array, arrive as lists of the
    same ints (past 32 bits too); a field that is not whole pairs, or holds more pairs than the
    item limit, is a ProtocolError naming it."""
    pairs = [[0, 10], [1, 2**40 + 3], [7, -1]]
    as_array = p.RunProgram(1, 2, np.array(pairs, np.int64), np.zeros((0, 2), np.int64))
    got = round_trip(as_array)
    assert got.inputs == pairs and got.outputs == []
    assert all(type(x) is int for pair in got.inputs for x in pair)
    with pytest.raises(ValueError, match="slot pairs"):
        p.encode(p.RunProgram(1, 2, [[0, 1, 2]], []))
    frames = p.encode(p.RunProgram(1, 2, pairs, []))
    h = msgpack.unpackb(bytes(frames[0]))
    h["f"]["inputs"] = h["f"]["inputs"][:-3]
    with pytest.raises(ProtocolError, match="'inputs'.*not whole"):
        p.decode([msgpack.packb(h), *frames[1:]])
    many = p.RunProgram(1, 2, [[i, i] for i in range(20)], [])
    assert _decodes(many, max_items=20) and not _decodes(many, max_items=19)


def test_a_chain_of_runs_holds_one_of_each_list_per_run():
    """A RunChain whose lists differ in length (a run without its outputs) is a ProtocolError
    naming the counts, not a chain that runs some programs with another's slots."""
    chain = p.RunChain([1, 2], [5, 6], [[[0, 1]], [[0, 2]]], [[[1, 2]], [[1, 3]]])
    assert round_trip(chain).inputs == [[[0, 1]], [[0, 2]]]
    frames = p.encode(chain)
    h = msgpack.unpackb(bytes(frames[0]))
    h["f"]["outputs"] = h["f"]["outputs"][:1]
    with pytest.raises(ProtocolError, match="2 programs has 2 run ids, 2 input and 1 output"):
        p.decode([msgpack.packb(h), *frames[1:]])
    h["f"]["outputs"] = [b"\x00" * 8, b""]  # half a pair
    with pytest.raises(ProtocolError, match="'outputs'.*not whole"):
        p.decode([msgpack.packb(h), *frames[1:]])
    h = msgpack.unpackb(bytes(frames[0]))
    h["f"]["frees"] = [[3]]  # tensors to free after one run of two
    with pytest.raises(ProtocolError, match="2 programs has 1 lists of tensors to free"):
        p.decode([msgpack.packb(h), *frames[1:]])
    h = msgpack.unpackb(bytes(frames[0]))
    h["f"]["new_data"] = [2]  # new data at a run the chain does not have
    with pytest.raises(ProtocolError, match="2 programs has new data at runs \\[2\\]"):
        p.decode([msgpack.packb(h), *frames[1:]])


def test_non_contiguous_arrays_are_made_contiguous():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2].T
    got = round_trip(p.Tensor(3, x))
    assert np.array_equal(got.array, x)


def test_arrays_above_the_chunk_size_are_split_and_reassembled():
    limits = p.Limits(chunk_bytes=1000)
    x = np.random.default_rng(0).standard_normal(2600).astype(np.float32)  # 10400 bytes -> 11 chunks
    frames = p.encode(p.Tensor(1, x), limits=limits)
    assert len(frames) == 12 and all(memoryview(f).nbytes <= 1000 for f in frames[1:])
    got, _ = p.decode([bytes(f) for f in frames], limits)
    assert np.array_equal(got.array, x)


def test_single_frame_arrays_are_received_without_a_copy():
    x = np.arange(1000, dtype=np.float64)
    frames = p.encode(p.Tensor(1, x))
    payload = bytearray(frames[1])
    got, _ = p.decode([frames[0], payload])
    payload[0:8] = np.float64(99).tobytes()
    assert got.array[0] == 99  # the array views the frame


@settings(max_examples=500, deadline=None)
@given(frames=st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_bytes_only_ever_raise_protocol_error(frames):
    try:
        p.decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    header=st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=5)
        | st.binary(max_size=5),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
        max_leaves=20,
    )
)
def test_random_msgpack_headers_only_ever_raise_protocol_error(header):
    # fields of every message type, under the current version so they reach the field decoders
    for kind in p.MsgType:
        frames = [msgpack.packb({"v": p.PROTOCOL_VERSION, "t": int(kind), "id": 0, "f": header, "a": []})]
        try:
            p.decode(frames)
        except ProtocolError as exc:
            assert "protocol version" not in str(exc)
    try:
        p.decode([msgpack.packb(header)])
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_wrongly_typed_fields_of_every_message_are_protocol_errors(data):
    """Take a valid header of each example message and replace one field by a random plain value:
    decoding either succeeds with a valid message or raises ProtocolError, never anything else."""
    message = data.draw(st.sampled_from(EXAMPLES))
    frames = p.encode(message)
    h = msgpack.unpackb(bytes(frames[0]))
    if not h["f"]:
        return
    name = data.draw(st.sampled_from(sorted(h["f"])))
    ints = st.integers(-(2**63), 2**64 - 1)
    h["f"][name] = data.draw(st.none() | st.booleans() | ints | st.text(max_size=3) | st.lists(ints, max_size=3))
    try:
        p.decode([msgpack.packb(h), *frames[1:]])
    except ProtocolError:
        pass


def test_every_dtype_outside_the_allowlist_is_refused():
    x = np.zeros(2, np.complex64)
    frames = p.encode(p.Put(1, MIRRORED, (2,), np.zeros(2, np.float32)))
    h = msgpack.unpackb(bytes(frames[0]))
    for bad in ("complex64", "O", "float128", "U3", "object"):
        h["a"][0][0] = bad
        with pytest.raises(ProtocolError, match=f"dtype {bad!r} is not supported"):
            p.decode([msgpack.packb(h), x.tobytes()])


def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def _decodes(message, **limits) -> bool:
    frames = [bytes(f) for f in p.encode(message, request_id=1)]
    try:
        p.decode(frames, p.Limits(**limits))
    except ProtocolError:
        return False
    return True


def _header_size(message) -> int:
    return len(bytes(p.encode(message, request_id=1)[0]))


@pytest.mark.parametrize(
    ("limit", "at_limit", "message"),
    [
        # each message sits exactly at the limit: accepted; one less is refused
        ("array_bytes", 96, p.Tensor(1, np.zeros((4, 6), np.float32))),
        ("max_ndim", 5, p.Tensor(1, np.zeros((1, 2, 1, 2, 1), np.int8))),
        ("max_arrays", 1, p.Tensor(1, np.zeros(3, np.int8))),
        ("max_items", 9, p.Free(tensors=list(range(9)))),
        # params {"x": [[[1]]]}: the map is level 0, its value level 1, the innermost 1 level 4
        (
            "max_depth",
            4,
            p.LoadProgram(program=1, steps=[p.OpStep("add", (0,), 1, {"x": _nested(3)}, (1,), "float32")]),
        ),
        ("header_bytes", None, p.Hello(1, 2, "cpu", "x" * 300, 0, 0, "ipc://x")),
    ],
)
def test_every_decoding_limit_holds_at_the_limit_and_refuses_one_past_it(limit, at_limit, message):
    at_limit = _header_size(message) if at_limit is None else at_limit
    assert _decodes(message, **{limit: at_limit}), f"{limit}={at_limit} refused a message at the limit"
    assert not _decodes(message, **{limit: at_limit - 1}), f"{limit}={at_limit - 1} took one past the limit"


def test_the_frame_count_limit_holds_at_the_limit_and_refuses_one_past_it():
    """An array of n bytes in chunks of c may come in up to ceil(n / c) + 1 frames (a sender may
    split differently by one), never more: a peer cannot make us hold many tiny frames."""
    array = np.arange(10, dtype=np.uint8)
    header = msgpack.unpackb(bytes(p.encode(p.Tensor(1, array), 1)[0]))

    def frames(count: int) -> list[bytes]:
        header["a"][0][2] = count
        cuts = np.array_split(array, count)
        return [msgpack.packb(header), *(c.tobytes() for c in cuts)]

    limits = p.Limits(chunk_bytes=5)  # ceil(10 / 5) + 1 = 3 frames at most
    assert np.array_equal(p.decode(frames(3), limits)[0].array, array)
    with pytest.raises(ProtocolError, match="bad frame count 4"):
        p.decode(frames(4), limits)


def test_a_programs_parameters_travel_once_and_a_step_naming_others_is_refused():
    """A program's op steps name their parameters by index in a table holding each parameters
    object once (a decoder's layers share them); a step naming an index the table lacks
    (negative, or one past it) is a ProtocolError, not another step's parameters."""
    shared = {"axis": 1, "spans": ((0, 3, 0),)}
    steps = [
        p.OpStep("add", (0, 1), 2, shared, (4,), "float32"),
        p.OpStep("add", (2, 1), 3, shared, (4,), "float32"),
        p.OpStep("mul", (3, 3), 4, {"axis": 0, "spans": ((0, 3, 0),)}, (4,), "float32"),
    ]
    frames = p.encode(p.LoadProgram(program=1, steps=steps, outputs=[4]))
    header = msgpack.unpackb(bytes(frames[0]))
    table, encoded = header["f"]["steps"]
    assert table == [{"axis": 1, "spans": [[0, 3, 0]]}, {"axis": 0, "spans": [[0, 3, 0]]}]
    assert [s[4] for s in encoded] == [0, 0, 1]
    assert p.decode(frames)[0].steps == steps
    for bad in (-1, 2, 7):
        encoded[2][4] = bad
        with pytest.raises(ProtocolError, match=f"names parameters {bad} of 2"):
            p.decode([msgpack.packb(header), *frames[1:]])


@pytest.mark.parametrize(
    "field, at, bad, says",
    [
        ("inputs", 1, [0, True], "'inputs' must be an int, got bool"),
        ("inputs", 1, [0, 1.0], "'inputs' must be an int, got float"),
        ("inputs", 1, "01", "'inputs' must be a list"),
        ("shape", 4, [4, -1], "'shape' has a negative dimension"),
        ("shape", 4, [4, "2"], "'shape' must be an int, got str"),
        ("dtype", 5, "float80", "'dtype'"),
    ],
)
def test_a_malformed_field_of_one_step_is_named(field, at, bad, says):
    """Each op step's lists are checked as a whole in the usual case (workers/program.py decodes
    ~1,000 steps a program): a bool, float or string among them, or a negative dimension, is
    still a ProtocolError that names the field."""
    steps = [p.OpStep("add", (0, 1), 2, {}, (4, 2), "float32"), p.OpStep("add", (2, 1), 3, {}, (4, 2), "float32")]
    frames = p.encode(p.LoadProgram(program=1, steps=steps, outputs=[3]))
    header = msgpack.unpackb(bytes(frames[0]))
    header["f"]["steps"][1][1][1 + at] = bad
    with pytest.raises(ProtocolError, match=re.escape(says)):
        p.decode([msgpack.packb(header), *frames[1:]])


# -- the data plane's chunks: a fixed binary header (p.encode_chunk) ------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_chunks_of_every_dtype_and_shape_round_trip_under_their_binary_header(dtype, shape):
    x = (np.arange(int(np.prod(shape))) % 7).astype(DTYPES[dtype]).reshape(shape)
    frames = p.encode(p.Chunk(3, 2**40, -1, x))
    assert bytes(frames[0][:4]) == p.CHUNK_MAGIC
    got, rid = p.decode(frames)
    assert (got.src, got.run, got.step, rid) == (3, 2**40, -1, 0)
    assert got.array.dtype == x.dtype and got.array.shape == x.shape
    assert np.array_equal(got.array.view(np.uint8), x.view(np.uint8)) if shape else got.array == x


def _chunk_head(src=1, run=2, step=3, code=1, ndim=1, extents=(4,)) -> bytes:
    import struct

    return (
        p.CHUNK_MAGIC + struct.pack("<Iqq BB", src, run, step, code, ndim) + struct.pack(f"<{len(extents)}Q", *extents)
    )


@pytest.mark.parametrize(
    "frames, says",
    [
        ([p.CHUNK_MAGIC + b"\x01\x02"], "shorter than"),
        ([_chunk_head(ndim=2), bytes(16)], "for 2 dimensions"),  # two dimensions, one extent
        ([_chunk_head(ndim=40, extents=(1,) * 40), bytes(4)], "for 40 dimensions"),  # past max_ndim
        ([_chunk_head(code=99), bytes(16)], "dtype code 99"),
        ([_chunk_head(), bytes(12)], "needs 16 bytes, frames hold 12"),  # float32 x 4
        ([_chunk_head()], "0 frames"),
        ([_chunk_head(), bytes(8), bytes(8), bytes(0)], "3 frames for 16 bytes"),
        ([_chunk_head(extents=(2**40,)), bytes(4)], "exceed the"),
    ],
)
def test_a_malformed_chunk_header_is_a_protocol_error_naming_what(frames, says):
    with pytest.raises(ProtocolError, match=re.escape(says)):
        p.decode(frames)


@settings(max_examples=500, deadline=None)
@given(rest=st.binary(max_size=80), frames=st.lists(st.binary(max_size=64), max_size=3))
def test_random_bytes_after_the_chunk_magic_only_ever_raise_protocol_error(rest, frames):
    try:
        p.decode([p.CHUNK_MAGIC + rest, *frames])
    except ProtocolError:
        pass


def _settings_body(**changes):
    body = {
        "rule": Rule(0.7).as_wire(),
        "rng": ["1", "2", "0", "0"],
        "stop": [2],
        "done": [False],
        "recent": [],
        "report_s": 0.05,
        "board": "",
        "own": [],
        "logprobs": [],
    }
    return body | changes


_OWN = {"rule": Rule(0.7).as_wire(), "rng": ["1", "2", "0", "0"], "pool": 40}


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"rule": {"temperature": 0.7}}, "'rule' must be a map of"),
        ({"rng": ["1", "2"]}, "four decimal strings"),
        ({"rng": ["1", "x", "0", "0"]}, "four decimal strings"),
        ({"done": [0]}, "'done' must be a list of true or false"),
        ({"recent": [[1], [2]]}, "'recent' holds 2 sequences, 'done' 1"),
        ({"report_s": -1}, "'report_s' must be a number"),
        ({"report_s": "1"}, "'report_s' must be a number"),
        ({"stop": ["2"]}, "'stop' must be an int"),
        ({"board": 3}, "'board' must be a string"),
        ({"extra": 1}, "must be a map of"),
        ({"own": {}}, "'own' must be a list"),
        ({"own": [_OWN, _OWN]}, "'own' holds 2 sequences, 'done' 1"),
        ({"own": [_OWN | {"pool": 0}]}, "pool must be a count of candidates"),
        ({"own": [_OWN | {"pool": True}]}, "pool must be a count of candidates"),
        ({"own": [_OWN | {"rng": ["1"]}]}, "four decimal strings"),
        ({"own": [_OWN | {"rule": {}}]}, "'rule' must be a map of"),
        ({"own": [{"rule": _OWN["rule"]}]}, "each of 'own' must be a map of"),
        ({"logprobs": [2, 2]}, "'logprobs' must be one count per sequence (1)"),
        ({"logprobs": [21]}, "each -1 (none) to 20"),
        ({"logprobs": [-2]}, "each -1 (none) to 20"),
        ({"logprobs": ["2"]}, "'logprobs' must be an int"),
    ],
)
def test_a_generates_settings_are_checked_field_by_field(changes, says):
    """The settings a worker's decode loop reads are a typed message part: a wrong field is a
    ProtocolError naming it when decoded, never a KeyError in the loop."""
    with pytest.raises(ProtocolError, match=re.escape(says)):
        p._settings(_settings_body(**changes), "sampling", p.DEFAULT_LIMITS)
    assert p._settings(_settings_body(), "sampling", p.DEFAULT_LIMITS).rule == Rule(0.7)
