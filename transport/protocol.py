"""The wire protocol: the only place message shapes and wire conventions exist.

Here are the message types and their fields, the program steps they carry, worker identities on
the control socket, the heartbeat frame, the tcp port rule (control on PORT, heartbeats on
PORT+1 and PORT+2), the worker command line, and the byte layout of shared-memory records.

A message is a msgpack header frame followed by raw buffer frames. The header is a map:
    {"v": version, "t": type, "id": request id, "f": {field: value}, "a": [[dtype, shape, n_frames], ...]}
Arrays travel as raw frames (split into chunks of at most `Limits.chunk_bytes`), in the order the
message's array fields are declared. Nothing is pickled. `decode` checks everything and raises
ProtocolError; it never returns a half-valid message. One exception to the msgpack header: the
data plane's Chunk, the message of every collective, has a fixed binary header (encode_chunk)
that its magic bytes tell apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import struct
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from math import prod
from typing import Any, ClassVar

import msgpack
import numpy as np

from split_state.dtypes import DTYPES, dtype_from_name, dtype_name
from split_state.errors import ProtocolError, SplitError, UnsupportedDtype, WorkerLost
from split_state.sampling import Rule
from split_state.states import State, decode_state, encode_state

# 9: Generate.lanes (pipelined generation); 8: RunChain.new_data; 7: RunChain; 6: no free steps (a worker
# plans its memory by liveness itself); 5: parameters in a table
PROTOCOL_VERSION = 9


@dataclass(frozen=True)
class Limits:
    """Caps applied when decoding; a peer cannot make us allocate past them."""

    header_bytes: int = 1 << 20
    array_bytes: int = 1 << 34
    chunk_bytes: int = 16 << 20
    max_arrays: int = 4096
    max_ndim: int = 32
    max_items: int = 1 << 16  # entries of any msgpack array or map in a header
    max_depth: int = 8  # nesting of plain values inside op parameters


DEFAULT_LIMITS = Limits()


# -- identities, endpoints, heartbeats, the worker command line ----------------------------------

HEARTBEAT_FRAME = b"beat"  # what the coordinator publishes; any message on that socket counts
PORT_OFFSETS = {"control": 0, "beat": 1, "beat-in": 2}  # over tcp: one address, three ports


def worker_identity(rank: int, nonce: int) -> bytes:
    """A worker's identity on the coordinator's ROUTER socket: its rank and a number of its own
    (its pid), so that a second worker claiming a rank already taken still connects (ZeroMQ
    would drop a duplicate identity unseen) and can be told why it is refused."""
    return f"w{rank}.{nonce}".encode()


def rank_of(identity: bytes) -> int:
    """The rank a worker identity claims, or -1 for anything else."""
    rank, dot, nonce = identity[1:].partition(b".")
    if identity[:1] != b"w" or not dot or not rank.isdigit() or not nonce.isdigit():
        return -1
    return int(rank)


def tcp_endpoint(host: str, port: int, name: str) -> str:
    """The coordinator's tcp endpoint for socket `name` (port 0: any free port)."""
    return f"tcp://{host}:{port + PORT_OFFSETS[name] if port else '*'}"


def endpoints_from_control(control: str) -> tuple[str, str]:
    """(heartbeat out, heartbeat in) of a coordinator known by its control endpoint: over tcp on
    the two ports after it, over ipc beside it in its directory."""
    if control.startswith("ipc://"):
        where = control.rsplit("/", 1)[0]
        return f"{where}/beat", f"{where}/beat-in"
    host, port = control[len("tcp://") :].rsplit(":", 1)
    return tcp_endpoint(host, int(port), "beat"), tcp_endpoint(host, int(port), "beat-in")


@dataclass(frozen=True)
class WorkerLaunch:
    """The command line of `python -m workers`: what a coordinator spawns and a remote host runs."""

    connect: str  # coordinator control endpoint
    beat: str  # coordinator heartbeat endpoint (PUB)
    beat_in: str  # coordinator heartbeat inbox (PULL)
    rank: int
    backend: str = "cpu"
    device: int = -1  # device index for backends with several devices (-1: rank modulo their count)
    data: str = ""  # endpoint to bind the data inbox (default: beside --connect)
    advertise: str = ""  # the host other workers reach this one's data inbox at (default: derived)
    keys: str = ""  # CURVE key file made by 'launch.py keys'
    heartbeat: float = 0.5  # seconds between heartbeats
    liveness: float = 5.0  # seconds of coordinator silence before exiting
    collective_timeout: float = 30.0
    parent_pid: int = 0  # exit when this process is gone
    threads: int = 1  # threads the worker's kernels use: BLAS and the quantized decode loops

    def command(self) -> list[str]:
        """The command line that starts this worker here. -P: the working directory is not put on
        the module path, so a directory with its own `workers` (or `models`, `cli`) package cannot
        shadow ours; the caller puts the project's root on PYTHONPATH."""
        return [sys.executable, "-P", "-m", "workers", *self.argv()]

    def argv(self) -> list[str]:
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default or f.default is dataclasses.MISSING:
                out += ["--" + f.name.replace("_", "-"), str(value)]
        return out

    @classmethod
    def parse(cls, argv: Sequence[str] | None, backends: Sequence[str] = ()) -> WorkerLaunch:
        ap = argparse.ArgumentParser(prog="python -m workers", description=cls.__doc__)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            required = f.default is dataclasses.MISSING
            choices = list(backends) if f.name == "backend" and backends else None
            ap.add_argument(
                "--" + f.name.replace("_", "-"),
                type=hints[f.name],
                required=required,
                default=None if required else f.default,
                choices=choices,
            )
        return cls(**vars(ap.parse_args(argv)))


# -- shared-memory rings (transport/shm.py): file header and record layout ------------------------

SHM_FILE_MAGIC = b"METATPS1"
SHM_RECORD_MAGIC = 0x4D54_5052  # "MTPR"
SHM_FILE_HEADER = struct.Struct("<8sIQQ64s")  # magic, world size, ring capacity, owner pid, host id
SHM_RECORD_PREFIX = struct.Struct("<IIqqq24s")  # magic, ndim, run, step, nbytes, dtype name; shape follows
# the owner's "asleep" word (uint64, on its own cache line of the file header): 0 while it runs;
# while it sleeps, 1 + the rank whose bytes or freed space it waits for, or SHM_WAITING_ANY. On the
# next line, its bell: a uint32 futex word that a peer publishing progress for it bumps and wakes.
SHM_WAITING_OFFSET = 2048
SHM_BELL_OFFSET = 2048 + 64
SHM_WAITING_ANY = 1 << 63
# the owner's stop word (uint64, on the line after): rank 0 of a worker-driven generation stores
# 2 * run + cancel there after each step, for the owner to read after `run` (workers/generation.py)
SHM_STOP_OFFSET = 2048 + 128


class MsgType(enum.IntEnum):
    HELLO = 1
    CONFIGURE = 2
    PUT = 3
    GET = 4
    FREE = 5
    LOAD_PROGRAM = 6
    RUN_PROGRAM = 7
    TENSOR = 8
    OK = 9
    ERROR = 10
    HEARTBEAT = 11
    SHUTDOWN = 12
    STATS = 13
    CHUNK = 14
    ABORT = 15
    UNLOAD = 16
    GENERATE = 17
    TOKENS = 18
    CANCEL = 19
    NCCL_ID = 20
    RESYNC = 21
    RAN = 22
    RUN_CHAIN = 23


# -- program steps ------------------------------------------------------------------------------

Shape = tuple[int, ...]
Params = dict[str, Any]
# [slot, tensor id] pairs of a run: one bin of little-endian int64s on the wire, not a msgpack
# array of arrays (a decode step binds ~300 inputs: per-item packing and checks cost ~0.5 ms a
# token). Given as a list of pairs or an (n, 2) integer array; decoded as a list of pairs.
SlotPairs = typing.NewType("SlotPairs", list)


@dataclass(frozen=True)
class OpStep:
    """Run a local kernel: slots `inputs` -> slot `output` of local shape `shape`."""

    op: str
    inputs: tuple[int, ...]
    output: int
    params: Params
    shape: Shape
    dtype: str


@dataclass(frozen=True)
class MoveStep:
    """Redistribute slot `input` (global `shape`) from state `src` to `dst` into slot `output`."""

    input: int
    output: int
    src: State
    dst: State
    shape: Shape
    dtype: str


@dataclass(frozen=True)
class Feed:
    """A small array carried inside a message's byte buffer: bytes [offset, offset + size) of
    it. A RunProgram's feeds are Mirrored inputs stored as tensor `tensor` before the program
    runs; a Ran's are the values of tensors read back with the run (no round trip of their own)."""

    tensor: int
    dtype: str
    shape: Shape
    offset: int


def pack_arrays(arrays: dict[int, np.ndarray]) -> tuple[list[Feed], np.ndarray]:
    """Arrays by tensor id as Feeds and their bytes in one buffer, each at a 64-byte aligned offset."""
    feeds, at = [], 0
    for tensor, array in arrays.items():
        feeds.append(Feed(tensor, dtype_name(array.dtype), tuple(array.shape), at))
        at += -(-array.nbytes // 64) * 64
    data = np.zeros(at, np.uint8)
    for feed, array in zip(feeds, arrays.values()):
        data[feed.offset : feed.offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return feeds, data


def unpack_array(feed: Feed, data: np.ndarray) -> np.ndarray:
    """A copy of `feed`'s array out of `data`, or ProtocolError if it reaches past the buffer."""
    dtype = dtype_from_name(feed.dtype)
    count = prod(feed.shape)
    if feed.offset + count * dtype.itemsize > data.nbytes:
        raise ProtocolError(f"array of tensor {feed.tensor} reaches past the {data.nbytes} bytes sent with it")
    return np.frombuffer(data, dtype=dtype, count=count, offset=feed.offset).reshape(feed.shape).copy()


Step = OpStep | MoveStep


# -- messages -----------------------------------------------------------------------------------

_REGISTRY: dict[MsgType, type] = {}


def _message(kind: MsgType) -> Callable[[type], type]:
    def register(cls: type) -> type:
        cls.KIND = kind
        _REGISTRY[kind] = cls
        return cls

    return register


@_message(MsgType.HELLO)
@dataclass(frozen=True)
class Hello:
    rank: int
    pid: int
    backend: str
    device: str
    memory_total: int
    memory_free: int
    data_endpoint: str
    planes: list[str] = dataclasses.field(default_factory=list)  # the data planes it can join (workers/planes/)
    device_index: int = -1  # the GPU it runs on (-1: no GPU): workers sharing one are told apart from these
    KIND: ClassVar[MsgType]


@_message(MsgType.CONFIGURE)
@dataclass(frozen=True)
class Configure:
    world_size: int
    peers: list[str]  # data endpoints by rank
    collective: str  # data plane: a name of workers/planes/ ("shm", "tcp", "zmq", "nccl", "mpi", "ipc")
    nccl_id: bytes = b""
    memory_budget: int = 0  # bytes; 0 keeps the worker's default
    session: str = ""  # names this cluster's shared-memory files
    KIND: ClassVar[MsgType]


@_message(MsgType.PUT)
@dataclass(frozen=True)
class Put:
    tensor: int
    state: State
    shape: Shape  # global shape
    array: np.ndarray  # this worker's local slice
    KIND: ClassVar[MsgType]


@_message(MsgType.GET)
@dataclass(frozen=True)
class Get:
    tensor: int
    KIND: ClassVar[MsgType]


@_message(MsgType.FREE)
@dataclass(frozen=True)
class Free:
    tensors: list[int]
    KIND: ClassVar[MsgType]


@_message(MsgType.LOAD_PROGRAM)
@dataclass(frozen=True)
class LoadProgram:
    program: int
    steps: list[Step]
    # slots the program's runs return: a worker's memory plan gives them buffers of their own,
    # never arena memory that the next run overwrites
    outputs: list[int] = field(default_factory=list)
    KIND: ClassVar[MsgType]


@_message(MsgType.UNLOAD)
@dataclass(frozen=True)
class Unload:
    """Forget these programs (the coordinator's plan cache evicted them)."""

    programs: list[int]
    KIND: ClassVar[MsgType]


@_message(MsgType.RUN_PROGRAM)
@dataclass(frozen=True)
class RunProgram:
    program: int
    run: int  # a fresh id per run: tags its collective traffic so stale data is never mixed in
    inputs: SlotPairs  # [slot, tensor id] pairs read from the store
    outputs: SlotPairs  # [slot, tensor id] pairs written to the store
    release: list[int] = field(default_factory=list)  # tensors whose handles are gone: free first
    feeds: list[Feed] = field(default_factory=list)
    feed_data: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8), compare=False)
    profile: int = 0  # 1: time every step (compute_s); off, a step runs with no timer around it
    read: list[int] = field(default_factory=list)  # tensors whose local values come back in a Ran reply
    KIND: ClassVar[MsgType]


@_message(MsgType.RUN_CHAIN)
@dataclass(frozen=True)
class RunChain:
    """Loaded programs run one after another in one message: run i is program `programs[i]`
    under run id `runs[i]`, its inputs and outputs as a RunProgram's (`inputs[i]`,
    `outputs[i]`), so a later run reads what an earlier one stored (a prefill's embedding, then
    one decoder layer's program once per layer, then the head). The releases and feeds come
    before the first run, the values `read` after the last, and the tensors in `frees[i]` are
    freed after run i (what the chain made for its later runs only); the reply is a RunProgram's (its
    account summed over the runs). A run that fails ends the chain: the runs after it do not
    start. A program run again in one chain keeps what its kernels found from the data they
    read (the positions a mask lets through, the range of the ids written): a chain does not
    rewrite those in place between its runs, except at the runs listed in `new_data` (a long
    prompt's next chunk, whose positions differ: its programs find them anew)."""

    programs: list[int]
    runs: list[int]
    inputs: list[SlotPairs]
    outputs: list[SlotPairs]
    release: list[int] = field(default_factory=list)
    feeds: list[Feed] = field(default_factory=list)
    feed_data: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8), compare=False)
    profile: int = 0
    read: list[int] = field(default_factory=list)
    frees: list[list[int]] = field(default_factory=list)  # none, or for each run the tensors freed after it
    new_data: list[int] = field(default_factory=list)  # the runs from which programs read new data
    KIND: ClassVar[MsgType]

    def __post_init__(self) -> None:
        if any(not 0 <= i < len(self.programs) for i in self.new_data):
            raise ValueError(f"a chain of {len(self.programs)} programs has new data at runs {self.new_data}")
        if not len(self.programs) == len(self.runs) == len(self.inputs) == len(self.outputs):
            raise ValueError(
                f"a chain of {len(self.programs)} programs has {len(self.runs)} run ids, {len(self.inputs)} input "
                f"and {len(self.outputs)} output lists: one of each per run"
            )
        if self.frees and len(self.frees) != len(self.programs):
            raise ValueError(f"a chain of {len(self.programs)} programs has {len(self.frees)} lists of tensors to free")


# the least time between two reports of a generation's tokens (Tokens messages) or two looks of
# the coordinator at its token board (transport/board.py), unless the Generate says (`report_s`)
REPORT_SECONDS = 0.05


@dataclass(frozen=True)
class OwnChoice:
    """One sequence's own way of choosing in a Generate (a server's batch: each job its own
    sampling and seed): its rule, its generator's exact state, and how many of the step's
    candidates (best first) it chooses among."""

    rule: Rule
    rng: tuple[str, ...]
    pool: int


@dataclass(frozen=True)
class GenerateSettings:
    """How a Generate's workers choose, stop and report, the same on every rank."""

    rule: Rule  # how each sequence's next token is chosen (unless `own` says)
    rng: tuple[str, ...]  # the generator's exact state (split_state.sampling.generator_state)
    stop: tuple[int, ...]  # token ids that end a sequence
    done: tuple[bool, ...]  # per sequence: already ended (its tokens still fed, never reported)
    recent: tuple[tuple[int, ...], ...] = ()  # per sequence its latest tokens (the repeat penalty's window)
    report_s: float = REPORT_SECONDS  # the least seconds between two reports
    board: str = ""  # the coordinator's token board's path (transport/board.py), "" none
    # per sequence its own rule, generator and pool (then `rule` and `rng` are not used); empty:
    # every sequence follows `rule` over all the candidates, drawing from the one `rng` in turn
    own: tuple[OwnChoice, ...] = ()
    # per sequence how many of the best tokens' log-probabilities to report beside its chosen
    # token's (-1: none); empty: none at all. Where given, the Generate's `sums` holds each
    # row's sum of exp(logit - best), and the reports are Tokens messages (Tokens.logprobs)
    logprobs: tuple[int, ...] = ()


@_message(MsgType.GENERATE)
@dataclass(frozen=True)
class Generate:
    """Run the captured decode program `program` up to `steps` times on the workers, feeding
    each step's chosen tokens back: runs `run`, `run + 1`, ... Each step the workers rewrite the
    stored tensors `tokens` (chosen tokens) and `positions` (+1) in place, run the program
    (inputs and outputs as in RunProgram), read the candidate pairs it stored as `values` and
    `indices`, and choose every sequence's next token the same way on every rank (`sampling`:
    GenerateSettings). Rank 0 reports the chosen
    tokens on the board where it can map it (and the first step in a Tokens message too), else
    in Tokens messages under the request's id; it stops at a Cancel (or the board's cancel
    word); every rank stops at the same step.

    With `lanes`, a pipelined generation (workers/pipelined.py): each further lane is another
    program over the next rows, [program, tokens, positions, values, indices, sums, rows] (the
    message's own program is lane 0, over the sequences the others leave), bound by
    `lane_inputs` and `lane_outputs`. Lane k's step s runs as run `run + s * lanes + k`, the
    lanes in turn; only worker `reporter` reads the candidates (the head's group holds them),
    chooses, reports, and after each lane's step sends every other rank that lane's tokens and
    whether to stop, which they read before the lane's next step: so the first groups run one
    lane while the last works on another."""

    program: int
    run: int
    steps: int
    inputs: SlotPairs
    outputs: SlotPairs
    tokens: int
    positions: int
    values: int
    indices: int
    sampling: GenerateSettings
    feeds: list[Feed] = field(default_factory=list)
    feed_data: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8), compare=False)
    sums: int = -1  # the stored output of each row's probability mass, where `sampling.logprobs` asks
    lanes: list[list[int]] = field(default_factory=list)
    lane_inputs: list[SlotPairs] = field(default_factory=list)
    lane_outputs: list[SlotPairs] = field(default_factory=list)
    reporter: int = 0
    KIND: ClassVar[MsgType]


LANE_FIELDS = ("program", "tokens", "positions", "values", "indices", "sums", "rows")  # a Generate's `lanes` entry


@_message(MsgType.TOKENS)
@dataclass(frozen=True)
class Tokens:
    """Steps `step`, `step + 1`, ... of a Generate: for each, the token chosen for every sequence
    (from rank 0; the first step at once, later ones gathered for a short while, see
    workers/generation.py)."""

    step: int
    tokens: list[list[int]]
    # where the Generate asked for them: per step and sequence, the chosen token's log-probability,
    # then (token, log-probability) of the best `GenerateSettings.logprobs[sequence]` (NaN beyond
    # them, and in a row that asked for none): shape (steps, sequences, 1 + 2 * the most asked)
    logprobs: np.ndarray = field(default_factory=lambda: np.empty((0, 0, 0), np.float64), compare=False)
    KIND: ClassVar[MsgType]


@_message(MsgType.CANCEL)
@dataclass(frozen=True)
class Cancel:
    """Stop the Generate of the same request id after the step under way (to rank 0, no reply)."""

    KIND: ClassVar[MsgType]


@_message(MsgType.NCCL_ID)
@dataclass(frozen=True)
class NcclId:
    """Make a fresh NCCL unique id (to rank 0, which then hosts NCCL's bootstrap root); the reply
    is Ok({"nccl_id": hex string}), which the coordinator relays to every rank in Configure."""

    KIND: ClassVar[MsgType]


@_message(MsgType.RESYNC)
@dataclass(frozen=True)
class Resync:
    """After a run failed on some worker, to every worker: bring the data plane back to one
    state on every rank (the CUDA IPC plane's operation counts, which a failed operation leaves
    apart), its traffic tagged with the fresh run id `run`. Ok once this worker's plane is usable."""

    run: int
    KIND: ClassVar[MsgType]


@_message(MsgType.TENSOR)
@dataclass(frozen=True)
class Tensor:
    tensor: int
    array: np.ndarray
    KIND: ClassVar[MsgType]


@_message(MsgType.OK)
@dataclass(frozen=True)
class Ok:
    info: Params = field(default_factory=dict)
    KIND: ClassVar[MsgType]


@_message(MsgType.RAN)
@dataclass(frozen=True)
class Ran:
    """The reply to a RunProgram that reads tensors back: the run's account (`info`, as an Ok's)
    and this worker's local values of the tensors it was asked for, each a Feed into `data`."""

    info: Params
    values: list[Feed]
    data: np.ndarray = field(compare=False)
    KIND: ClassVar[MsgType]


@_message(MsgType.ERROR)
@dataclass(frozen=True)
class Error:
    kind: str  # the exception class name, e.g. "ProtocolError", "OutOfMemory"
    message: str
    traceback: str = ""
    origin: int = -1  # the worker whose failure this follows from (an Abort it sent); -1: this one's own
    # the peer this worker found gone (a WorkerLost naming it: its connection closed, or it was
    # silent past a collective's deadline); -1: none. The coordinator then stops waiting for that
    # peer's reply: across hosts it cannot see the process, and its liveness window is seconds
    lost: int = -1
    KIND: ClassVar[MsgType]


@_message(MsgType.HEARTBEAT)
@dataclass(frozen=True)
class Heartbeat:
    rank: int
    KIND: ClassVar[MsgType]


@_message(MsgType.SHUTDOWN)
@dataclass(frozen=True)
class Shutdown:
    KIND: ClassVar[MsgType]


@_message(MsgType.STATS)
@dataclass(frozen=True)
class Stats:
    KIND: ClassVar[MsgType]


@_message(MsgType.CHUNK)
@dataclass(frozen=True)
class Chunk:
    """Data plane: one box of a collective, from worker `src`, for run `run`, step `step`."""

    src: int
    run: int
    step: int
    array: np.ndarray
    KIND: ClassVar[MsgType]


@_message(MsgType.ABORT)
@dataclass(frozen=True)
class Abort:
    """Data plane: run `run` cannot finish (-1: every run) because of worker `rank`."""

    rank: int
    run: int
    kind: str
    message: str
    KIND: ClassVar[MsgType]


Message = (
    Hello
    | Configure
    | Put
    | Get
    | Free
    | LoadProgram
    | Unload
    | RunProgram
    | RunChain
    | Generate
    | Tokens
    | Cancel
    | NcclId
    | Resync
    | Tensor
    | Ok
    | Error
    | Heartbeat
    | Shutdown
    | Stats
    | Chunk
    | Abort
)


# -- field codecs -------------------------------------------------------------------------------


Decoder = Callable[[Any, str, "Limits"], Any]  # (value, field name, limits) -> checked value


def _fail(what: str) -> typing.NoReturn:
    raise ProtocolError(what)


def _int(v: Any, name: str, limits: Limits) -> int:
    if type(v) is not int:
        _fail(f"field {name!r} must be an int, got {type(v).__name__}")
    return v


def _str(v: Any, name: str, limits: Limits) -> str:
    if not isinstance(v, str):
        _fail(f"field {name!r} must be a string, got {type(v).__name__}")
    return v


def _bytes(v: Any, name: str, limits: Limits) -> bytes:
    if not isinstance(v, bytes):
        _fail(f"field {name!r} must be bytes, got {type(v).__name__}")
    return v


def _list(item: Decoder) -> Decoder:
    def check(v: Any, name: str, limits: Limits) -> list:
        if not isinstance(v, list):
            _fail(f"field {name!r} must be a list, got {type(v).__name__}")
        return [item(x, name, limits) for x in v]

    return check


def _encode_pairs(v: Any) -> bytes:
    pairs = np.asarray(v, dtype="<i8")
    if pairs.size == 0:
        return b""
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"slot pairs must be [slot, tensor] pairs, got shape {pairs.shape}")
    return pairs.tobytes()


def _pairs(v: Any, name: str, limits: Limits) -> list[list[int]]:
    raw = _bytes(v, name, limits)
    if len(raw) % 16:
        _fail(f"field {name!r}: {len(raw)} bytes are not whole [slot, tensor] int64 pairs")
    if len(raw) // 16 > limits.max_items:
        _fail(f"field {name!r}: {len(raw) // 16} pairs exceed the limit of {limits.max_items}")
    return np.frombuffer(raw, "<i8").reshape(-1, 2).tolist()


_INT = {int}


def _ints(v: Any, name: str, limits: Limits) -> list[int]:
    """A list of ints (no bools): the types checked at once in C, as a program's ~1,000 steps
    each hold two such lists; item by item only to name what is wrong."""
    if type(v) is list and set(map(type, v)) <= _INT:
        return v
    return _list(_int)(v, name, limits)


def _shape(v: Any, name: str, limits: Limits) -> Shape:
    dims = _ints(v, name, limits)
    if dims and min(dims) < 0:
        _fail(f"field {name!r} has a negative dimension: {dims}")
    return tuple(dims)


def _state(v: Any, name: str, limits: Limits) -> State:
    try:
        return decode_state(v)
    except SplitError as exc:
        _fail(f"field {name!r}: {exc}")


def _params(v: Any, name: str, limits: Limits) -> Params:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        _fail(f"field {name!r} must be a map with string keys")
    _check_plain(v, name, 0, limits.max_depth)
    return {k: _freeze(x) for k, x in v.items()}


def _check_plain(v: Any, name: str, depth: int, max_depth: int) -> None:
    if depth > max_depth:
        _fail(f"field {name!r} nests deeper than {max_depth}")
    if isinstance(v, (list, tuple)):
        for x in v:
            _check_plain(x, name, depth + 1, max_depth)
    elif isinstance(v, dict):
        for x in v.values():
            _check_plain(x, name, depth + 1, max_depth)
    elif not (v is None or isinstance(v, (bool, int, float, str))):
        _fail(f"field {name!r} holds a {type(v).__name__}, not a plain value")


def _freeze(v: Any) -> Any:
    """Lists in parameters become tuples so parameters compare and hash like the sender's."""
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def _thaw(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_thaw(x) for x in v]
    if isinstance(v, dict):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return v


def _encode_steps(steps: Sequence[Step]) -> list:
    """[parameters, steps]: an op step names its parameters by their index in the first list,
    which holds each parameters object once. A decoder's layers share them (a SmolLM2 prefill
    program's ~1,070 op steps have ~60), so a worker checks each once, not once a step."""
    table: list = []
    index: dict[int, int] = {}  # id of a parameters object -> its place in the table
    encoded = []
    for step in steps:
        if isinstance(step, OpStep):
            at = index.get(id(step.params))
            if at is None:
                at = index[id(step.params)] = len(table)
                table.append(_thaw(step.params))
            encoded.append(["op", step.op, list(step.inputs), step.output, at, list(step.shape), step.dtype])
        else:
            s, d = encode_state(step.src), encode_state(step.dst)
            encoded.append(["move", step.input, step.output, s, d, list(step.shape), step.dtype])
    return [table, encoded]


def _steps(v: Any, name: str, limits: Limits) -> list[Step]:
    if not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, list) for x in v):
        _fail(f"field {name!r} must be [parameters, steps], two lists")
    table = [_params(x, f"{name} parameters", limits) for x in v[0]]
    return [_step(x, name, limits, table) for x in v[1]]


def _feed(v: Any, name: str, limits: Limits) -> Feed:
    if not isinstance(v, list) or len(v) != 4:
        _fail(f"{name}: a feed must be [tensor, dtype, shape, offset]")
    feed = Feed(
        _int(v[0], "tensor", limits),
        _dtype_field(v[1], "dtype", limits),
        _shape(v[2], "shape", limits),
        _int(v[3], "offset", limits),
    )
    if feed.offset < 0:
        _fail(f"{name}: negative offset {feed.offset}")
    return feed


def _dtype_field(v: Any, name: str, limits: Limits) -> str:
    if type(v) is str and v in DTYPES:
        return v
    try:
        dtype_from_name(v)
    except UnsupportedDtype as exc:
        _fail(f"field {name!r}: {exc}")
    return v


def _step(v: Any, name: str, limits: Limits, params: list[Params]) -> Step:
    """One step; an op step's parameters are `params[i]` for the index i it holds."""
    if not isinstance(v, list) or not v:
        _fail(f"{name}: a step must be a non-empty list")
    tag, rest = v[0], v[1:]
    if tag == "op" and len(rest) == 6:
        at = _int(rest[3], "params", limits)
        if not 0 <= at < len(params):
            _fail(f"{name}: an op step names parameters {at} of {len(params)}")
        return OpStep(
            _str(rest[0], "op", limits),
            tuple(_ints(rest[1], "inputs", limits)),
            _int(rest[2], "output", limits),
            params[at],
            _shape(rest[4], "shape", limits),
            _dtype_field(rest[5], "dtype", limits),
        )
    if tag == "move" and len(rest) == 6:
        return MoveStep(
            _int(rest[0], "input", limits),
            _int(rest[1], "output", limits),
            _state(rest[2], "src", limits),
            _state(rest[3], "dst", limits),
            _shape(rest[4], "shape", limits),
            _dtype_field(rest[5], "dtype", limits),
        )
    _fail(f"{name}: malformed step {str(v)[:80]}")


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; a decode step's pool holds at least this many


def _encode_settings(g: GenerateSettings) -> dict:
    return {
        "rule": g.rule.as_wire(),
        "rng": list(g.rng),
        "stop": [int(t) for t in g.stop],
        "done": [bool(d) for d in g.done],
        "recent": [[int(t) for t in r] for r in g.recent],
        "report_s": float(g.report_s),
        "board": g.board,
        "own": [{"rule": c.rule.as_wire(), "rng": list(c.rng), "pool": int(c.pool)} for c in g.own],
        "logprobs": [int(n) for n in g.logprobs],
    }


def _rule(v: Any, name: str) -> Rule:
    if not isinstance(v, dict) or set(v) != {f.name for f in fields(Rule)}:
        _fail(f"field {name!r}: 'rule' must be a map of {sorted(f.name for f in fields(Rule))}")
    return Rule.from_wire(v)


def _generator(v: Any, name: str, limits: Limits) -> tuple[str, ...]:
    rng = _list(_str)(v, "rng", limits)
    if len(rng) != 4 or not all(x.isascii() and x.isdigit() for x in rng):
        _fail(f"field {name!r}: 'rng' must be a generator's state, four decimal strings")
    return tuple(rng)


def _own(v: Any, name: str, limits: Limits) -> tuple[OwnChoice, ...]:
    if not isinstance(v, list) or len(v) > limits.max_items:
        _fail(f"field {name!r}: 'own' must be a list of at most {limits.max_items} choices")
    out = []
    for choice in v:
        if not isinstance(choice, dict) or set(choice) != {"rule", "rng", "pool"}:
            _fail(f"field {name!r}: each of 'own' must be a map of ['pool', 'rng', 'rule']")
        pool = choice["pool"]
        if type(pool) is not int or pool < 1:
            _fail(f"field {name!r}: an 'own' pool must be a count of candidates, 1 or more")
        out.append(OwnChoice(_rule(choice["rule"], name), _generator(choice["rng"], name, limits), pool))
    return tuple(out)


def _settings(v: Any, name: str, limits: Limits) -> GenerateSettings:
    """A Generate's settings, each field checked: a wrong one is named."""
    keys = {"rule", "rng", "stop", "done", "recent", "report_s", "board", "own", "logprobs"}
    if not isinstance(v, dict) or set(v) != keys:
        _fail(f"field {name!r} must be a map of {sorted(keys)}")
    rule = _rule(v["rule"], name)
    rng = _generator(v["rng"], name, limits)
    done = v["done"]
    if not isinstance(done, list) or not all(type(d) is bool for d in done):
        _fail(f"field {name!r}: 'done' must be a list of true or false")
    recent = [tuple(r) for r in _list(_ints)(v["recent"], "recent", limits)]
    if recent and len(recent) != len(done):
        _fail(f"field {name!r}: 'recent' holds {len(recent)} sequences, 'done' {len(done)}")
    report_s = v["report_s"]
    if type(report_s) not in (int, float) or not 0 <= report_s < float("inf"):
        _fail(f"field {name!r}: 'report_s' must be a number of seconds, 0 or more")
    stop = tuple(_ints(v["stop"], "stop", limits))
    board = _str(v["board"], "board", limits)
    own = _own(v["own"], name, limits)
    if own and len(own) != len(done):
        _fail(f"field {name!r}: 'own' holds {len(own)} sequences, 'done' {len(done)}")
    logprobs = tuple(_ints(v["logprobs"], "logprobs", limits))
    if logprobs and (len(logprobs) != len(done) or not all(-1 <= n <= MAX_TOP_LOGPROBS for n in logprobs)):
        _fail(
            f"field {name!r}: 'logprobs' must be one count per sequence ({len(done)}), each -1 (none) to "
            f"{MAX_TOP_LOGPROBS}"
        )
    return GenerateSettings(rule, rng, stop, tuple(done), tuple(recent), float(report_s), board, own, logprobs)


# annotation -> (encode, decode); arrays are handled apart from the header fields
_CODECS: dict[Any, tuple[Callable[[Any], Any], Decoder]] = {
    int: (lambda v: int(v), _int),
    str: (lambda v: v, _str),
    bytes: (lambda v: bytes(v), _bytes),
    State: (encode_state, _state),
    Shape: (lambda v: [int(d) for d in v], _shape),
    Params: (_thaw, _params),
    list[int]: (lambda v: [int(x) for x in v], _ints),
    list[str]: (list, _list(_str)),
    list[list[int]]: (lambda v: [[int(x) for x in p] for p in v], _list(_ints)),
    SlotPairs: (_encode_pairs, _pairs),
    list[SlotPairs]: (lambda v: [_encode_pairs(x) for x in v], _list(_pairs)),
    list[Step]: (_encode_steps, _steps),
    list[Feed]: (lambda v: [[f.tensor, f.dtype, list(f.shape), f.offset] for f in v], _list(_feed)),
    GenerateSettings: (_encode_settings, _settings),
}
_ARRAY = np.ndarray


def _field_types(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls, globalns=globals())
    return [(f.name, hints[f.name]) for f in fields(cls)]


_SCHEMAS = {kind: _field_types(cls) for kind, cls in _REGISTRY.items()}


# -- encode -------------------------------------------------------------------------------------


def encode(message: Message, request_id: int = 0, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    """Frames for `message`: [header, *array chunks]. Arrays are made contiguous, not copied.
    A Chunk (the data plane's) gets the fixed binary header of encode_chunk."""
    if type(message) is Chunk:
        return encode_chunk(message, limits)
    header_fields: dict[str, Any] = {}
    descriptors: list[list[Any]] = []
    frames: list[Any] = []
    for name, kind in _SCHEMAS[message.KIND]:
        value = getattr(message, name)
        if kind is _ARRAY:
            array = np.asarray(value)
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array).reshape(array.shape)  # keeps 0-d arrays 0-d
            chunks = _chunks(array, limits.chunk_bytes)
            descriptors.append([dtype_name(array.dtype), list(array.shape), len(chunks)])
            frames.extend(chunks)
        else:
            header_fields[name] = _CODECS[kind][0](value)
    header = {
        "v": PROTOCOL_VERSION,
        "t": int(message.KIND),
        "id": int(request_id),
        "f": header_fields,
        "a": descriptors,
    }
    return [msgpack.packb(header, use_bin_type=True), *frames]


# The data plane's Chunk has a fixed binary header instead of msgpack: a decode step's all-reduce
# of 4 KiB over ZeroMQ spent ~15 us of its ~85 us packing and unpacking a msgpack header and
# checking it against the schema (the raw exchange of the same bytes: 58 us). The header: the
# magic (a first byte no msgpack map has, so decode tells the two apart), src, run, step, the
# dtype's index in DTYPES, the number of dimensions, then each extent; the array's frames follow.
CHUNK_MAGIC = b"\x00mtc"
_CHUNK_HEAD = struct.Struct("<4sIqqBB")
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
_DTYPE_OF_CODE = tuple(DTYPES.values())


def encode_chunk(chunk: Chunk, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    array = np.asarray(chunk.array)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).reshape(array.shape)
    shape = array.shape
    head = _CHUNK_HEAD.pack(
        CHUNK_MAGIC, chunk.src, chunk.run, chunk.step, _DTYPE_CODES[dtype_name(array.dtype)], len(shape)
    )
    return [head + struct.pack(f"<{len(shape)}Q", *shape), *_chunks(array, limits.chunk_bytes)]


def _decode_chunk(head: memoryview, frames: Sequence[Any], limits: Limits) -> Chunk:
    if head.nbytes < _CHUNK_HEAD.size:
        _fail(f"chunk header of {head.nbytes} bytes, shorter than {_CHUNK_HEAD.size}")
    _, src, run, step, code, ndim = _CHUNK_HEAD.unpack_from(head)
    if ndim > limits.max_ndim or head.nbytes != _CHUNK_HEAD.size + 8 * ndim:
        _fail(f"chunk header of {head.nbytes} bytes for {ndim} dimensions")
    if code >= len(_DTYPE_OF_CODE):
        _fail(f"chunk dtype code {code} is not one of {len(_DTYPE_OF_CODE)}")
    shape = struct.unpack_from(f"<{ndim}Q", head, _CHUNK_HEAD.size)
    dtype = _DTYPE_OF_CODE[code]
    nbytes = prod(shape) * dtype.itemsize
    if nbytes > limits.array_bytes:
        _fail(f"chunk: declared {nbytes} bytes exceed the {limits.array_bytes}-byte cap")
    if not 1 <= len(frames) <= max(1, -(-nbytes // limits.chunk_bytes)) + 1:
        _fail(f"chunk: {len(frames)} frames for {nbytes} bytes")
    bufs = [_buffer(f) for f in frames]
    got = sum(b.nbytes for b in bufs)
    if got != nbytes:
        _fail(f"chunk: shape {list(shape)} of {dtype_name(dtype)} needs {nbytes} bytes, frames hold {got}")
    return Chunk(src, run, step, _assemble(bufs, dtype, shape, nbytes))


def _chunks(array: np.ndarray, chunk_bytes: int) -> list[memoryview]:
    flat = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
    if flat.nbytes <= chunk_bytes:
        return [flat]
    return [flat[i : i + chunk_bytes] for i in range(0, flat.nbytes, chunk_bytes)]


# -- decode -------------------------------------------------------------------------------------


def _buffer(frame: Any) -> memoryview:
    """A frame's bytes without a copy: zmq.Frame (copy=False), bytes or memoryview."""
    buf = getattr(frame, "buffer", frame)
    try:
        return memoryview(buf).cast("B")
    except TypeError as exc:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not a buffer") from exc


def decode_header(frame: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    raw = _buffer(frame)
    if raw.nbytes > limits.header_bytes:
        _fail(f"header of {raw.nbytes} bytes exceeds the {limits.header_bytes}-byte limit")
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.header_bytes,
            max_bin_len=limits.header_bytes,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        _fail(f"header must be a map, got {type(header).__name__}")
    if header.get("v") != PROTOCOL_VERSION:
        _fail(f"unknown protocol version {header.get('v')!r}; this side speaks {PROTOCOL_VERSION}")
    if set(header) != {"v", "t", "id", "f", "a"}:
        _fail(f"header keys {sorted(map(str, header))} != ['a', 'f', 'id', 't', 'v']")
    return header


def request_id(frames: Sequence[Any]) -> int:
    """The request id of a message, best effort, for error replies to undecodable messages."""
    try:
        value = decode_header(frames[0]).get("id")
        return value if type(value) is int else 0
    except (ProtocolError, IndexError):
        return 0


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> tuple[Message, int]:
    """(message, request id) from frames, or ProtocolError saying exactly what is wrong."""
    if not frames:
        _fail("empty message")
    first = _buffer(frames[0])
    if first[:4] == CHUNK_MAGIC:
        return _decode_chunk(first, frames[1:], limits), 0
    header = decode_header(frames[0], limits)
    kind = header["t"]
    if type(kind) is not int or kind not in _REGISTRY:
        _fail(f"unknown message type {kind!r}")
    rid = header["id"]
    if type(rid) is not int:
        _fail("request id must be an int")
    cls = _REGISTRY[MsgType(kind)]
    schema = _SCHEMAS[MsgType(kind)]
    values = header["f"]
    descriptors = header["a"]
    if not isinstance(values, dict) or not isinstance(descriptors, list):
        _fail("header fields must be a map and arrays a list")
    expected = {n for n, k in schema if k is not _ARRAY}
    if set(values) != expected:
        missing, extra = sorted(expected - set(values)), sorted(set(values) - expected)
        _fail(f"{cls.__name__}: missing fields {missing}, unexpected fields {extra}")
    array_fields = [n for n, k in schema if k is _ARRAY]
    if len(descriptors) != len(array_fields):
        _fail(f"{cls.__name__}: carries {len(array_fields)} arrays, header lists {len(descriptors)}")
    arrays = _decode_arrays(descriptors, frames[1:], limits)
    kwargs = {}
    for name, k in schema:
        kwargs[name] = arrays.pop(0) if k is _ARRAY else _CODECS[k][1](values[name], name, limits)
    try:
        return cls(**kwargs), rid
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


def _decode_arrays(descriptors: list[Any], frames: Sequence[Any], limits: Limits) -> list[np.ndarray]:
    if len(descriptors) > limits.max_arrays:
        _fail(f"{len(descriptors)} arrays exceed the limit of {limits.max_arrays}")
    arrays, at = [], 0
    for i, desc in enumerate(descriptors):
        if not isinstance(desc, list) or len(desc) != 3:
            _fail(f"array {i}: descriptor must be [dtype, shape, n_frames]")
        name, shape, n_frames = desc
        try:
            dtype = dtype_from_name(name)
        except UnsupportedDtype as exc:
            raise ProtocolError(f"array {i}: {exc}") from None
        shape = _shape(shape, f"array {i} shape", limits)
        if len(shape) > limits.max_ndim:
            _fail(f"array {i}: {len(shape)} dimensions exceed the limit of {limits.max_ndim}")
        nbytes = prod(shape) * dtype.itemsize
        if nbytes > limits.array_bytes:
            _fail(f"array {i}: declared {nbytes} bytes exceed the {limits.array_bytes}-byte cap")
        if type(n_frames) is not int or n_frames < 1 or n_frames > max(1, -(-nbytes // limits.chunk_bytes)) + 1:
            _fail(f"array {i}: bad frame count {n_frames!r} for {nbytes} bytes")
        if at + n_frames > len(frames):
            _fail(f"array {i}: needs {n_frames} frames, only {len(frames) - at} left")
        bufs = [_buffer(f) for f in frames[at : at + n_frames]]
        at += n_frames
        got = sum(b.nbytes for b in bufs)
        if got != nbytes:
            _fail(f"array {i}: shape {shape} of {dtype_name(dtype)} needs {nbytes} bytes, frames hold {got}")
        arrays.append(_assemble(bufs, dtype, shape, nbytes))
    if at != len(frames):
        _fail(f"{len(frames) - at} extra frames after the declared arrays")
    return arrays


def _assemble(bufs: list[memoryview], dtype: np.dtype, shape: Shape, nbytes: int) -> np.ndarray:
    if len(bufs) == 1:
        # zero copy: the array views the received frame (read-only); callers copy before writing
        return np.frombuffer(bufs[0], dtype=dtype, count=prod(shape)).reshape(shape)
    out = np.empty(nbytes, dtype=np.uint8)
    at = 0
    for b in bufs:
        out[at : at + b.nbytes] = np.frombuffer(b, dtype=np.uint8)
        at += b.nbytes
    return out.view(dtype).reshape(shape)


def error_from(exc: BaseException, traceback_text: str = "") -> Error:
    origin = getattr(exc, "origin", -1)
    # an allocation that failed on the device (NumPy's or CuPy's MemoryError) is an OutOfMemory
    kind = "OutOfMemory" if isinstance(exc, MemoryError) else type(exc).__name__
    # its own finding only: a WorkerLost that an Abort brought names the Abort's sender
    lost = getattr(exc, "rank", None) if isinstance(exc, WorkerLost) and origin == -1 else None
    return Error(
        kind, str(exc), traceback_text, origin if type(origin) is int else -1, lost if type(lost) is int else -1
    )
