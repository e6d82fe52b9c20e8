"""Sockets: endpoints, the control plane (ROUTER/DEALER), CURVE security, bounded receives."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from split_state.errors import DeadlineExceeded, TransportError
from transport.deadline import Deadline
from transport.protocol import DEFAULT_LIMITS, Limits, Message, encode

HIGH_WATER_MARK = 1000
SEND_TIMEOUT_MS = 10_000  # a send with no live peer (e.g. a refused CURVE handshake) blocks otherwise


COORDINATOR = -1  # the coordinator's rank, for keys
MAX_RANKS = 4096  # the ranks an authenticator admits keys of


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's key file (Z85 text). Every party derives from its secret one key pair per
    rank (the coordinator's is rank -1) and uses its own; servers admit only the derived public
    keys and learn from the handshake which rank a connection belongs to, so one rank's key
    cannot speak for another. A client without the file cannot complete the handshake."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_bytes(b"public " + self.public + b"\nsecret " + self.secret + b"\n")
        path.chmod(0o600)

    @classmethod
    def load(cls, path: str | Path) -> CurveKeys:
        values = {}
        for line in Path(path).read_bytes().splitlines():
            key, _, value = line.partition(b" ")
            values[key] = value.strip()
        if set(values) != {b"public", b"secret"} or len(values[b"public"]) != 40 or len(values[b"secret"]) != 40:
            raise TransportError(f"{path} is not a key file made by 'launch.py keys'")
        return cls(values[b"public"], values[b"secret"])

    def for_rank(self, rank: int) -> tuple[bytes, bytes]:
        """(public, secret) of `rank`, derived from the cluster secret."""
        return _rank_keys(self.secret, rank)


@functools.lru_cache(maxsize=8 * MAX_RANKS)
def _rank_keys(secret: bytes, rank: int) -> tuple[bytes, bytes]:
    seed = hashlib.sha256(b"meta-tp rank key\0" + secret + rank.to_bytes(4, "big", signed=True)).digest()
    derived = z85.encode(seed)
    return zmq.curve_public(derived), derived


def curve_server(sock: zmq.Socket, keys: CurveKeys, rank: int = COORDINATOR) -> None:
    sock.curve_publickey, sock.curve_secretkey = keys.for_rank(rank)
    sock.curve_server = True


def curve_client(sock: zmq.Socket, keys: CurveKeys, rank: int = COORDINATOR, server: int = COORDINATOR) -> None:
    sock.curve_serverkey = keys.for_rank(server)[0]
    sock.curve_publickey, sock.curve_secretkey = keys.for_rank(rank)


class _RankKeys:
    """ZAP credentials provider: admits the cluster's derived keys and names their rank."""

    def __init__(self, keys: CurveKeys):
        self.ranks = {keys.for_rank(r)[0]: r for r in range(COORDINATOR, MAX_RANKS)}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.ranks

    def user_id(self, key: bytes) -> str:  # key: raw 32 bytes, as pyzmq passes it here
        return str(self.ranks[z85.encode(key)])


class Security:
    """A party's CURVE identity (its rank's key pair) and the ZAP authenticator of its context
    when keys are in use; a no-op otherwise (ipc in a private directory, or --insecure)."""

    def __init__(self, context: zmq.Context, keys: CurveKeys | None, rank: int = COORDINATOR):
        self.keys, self.rank = keys, rank
        self._auth: ThreadAuthenticator | None = None
        if keys is not None:
            provider = _RankKeys(keys)
            self._auth = ThreadAuthenticator(context)
            self._auth.curve_user_id = provider.user_id  # messages then carry the sender's rank
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=provider)

    def server(self, sock: zmq.Socket) -> None:
        if self.keys is not None:
            curve_server(sock, self.keys, self.rank)

    def client(self, sock: zmq.Socket, server: int = COORDINATOR) -> None:
        if self.keys is not None:
            curve_client(sock, self.keys, self.rank, server)

    def sender(self, frame: Any) -> int | None:
        """The rank whose key sent the message `frame` belongs to (None without keys)."""
        if self.keys is None:
            return None
        try:
            return int(frame.get("User-Id"))
        except (AttributeError, ValueError, TypeError, zmq.ZMQError):
            return None

    def may_speak_for(self, frame: Any, rank: int) -> bool:
        """Whether the message's sender may send on behalf of `rank`: itself, or the coordinator."""
        sender = self.sender(frame)
        return self.keys is None or sender in (rank, COORDINATOR)

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class IpcDir:
    """A private (0700) directory for ipc:// endpoints, removed on close: a fresh one, or `path`
    (made here if missing; refused unless it is ours alone)."""

    def __init__(self, path: str = "") -> None:
        if path:
            self.path = private_dir(path)
        else:
            self.path = tempfile.mkdtemp(prefix="meta-tp-")
            os.chmod(self.path, 0o700)

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.path}/{name}"

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def private_dir(path: str) -> str:
    """`path` as a directory only this user can enter, made if missing. A known name in a shared
    temporary folder could have been made first by someone else: then it is refused."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TransportError(f"cannot make the socket directory {path}: {exc}") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise TransportError(f"{path} is not a private directory of this user (mode 0700): remove it and retry")
    return path


def endpoint_host(endpoint: str) -> str:
    """The host a tcp endpoint names (tcp://HOST:PORT; an IPv6 address without its brackets);
    "" for an ipc endpoint (this host)."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")


def is_local(host: str) -> bool:
    """A wildcard or loopback address: the coordinator is on this host."""
    return host in ("", "*", "0.0.0.0", "::", "localhost") or host.startswith("127.") or host == "::1"


def local_address(toward: str) -> str:
    """This host's address on the interface that routes to `toward` (no packet is sent: a UDP
    socket is only connected, which asks the routing table); loopback if there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(toward), 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _common(sock: zmq.Socket) -> None:
    sock.linger = 0
    sock.sndtimeo = SEND_TIMEOUT_MS
    sock.sndhwm = HIGH_WATER_MARK
    sock.rcvhwm = HIGH_WATER_MARK


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the concrete endpoint (tcp port 0 or '*' picks a free port)."""
    if endpoint.startswith("tcp://") and endpoint.endswith((":0", ":*")):
        endpoint = endpoint.rsplit(":", 1)[0] + ":*"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {endpoint}: {exc}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def router(context: zmq.Context, endpoint: str, security: Security) -> tuple[zmq.Socket, str]:
    """The coordinator's control socket; ROUTER_MANDATORY makes sends to unknown peers fail loudly."""
    sock = context.socket(zmq.ROUTER)
    _common(sock)
    sock.router_mandatory = True
    security.server(sock)
    return sock, bind(sock, endpoint)


def dealer(context: zmq.Context, endpoint: str, identity: bytes, security: Security) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    _common(sock)
    sock.identity = identity
    security.client(sock)  # to the coordinator
    sock.connect(endpoint)
    return sock


class HandshakeWatch:
    """Why a client socket's CURVE handshake failed, if it did: a refused key is otherwise
    silent (ZeroMQ retries in the background and the messages just never arrive)."""

    EVENTS = (
        zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    )

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.monitor = sock.get_monitor_socket(self.EVENTS)

    def failure(self) -> str:
        """The first handshake failure seen so far ("" if none), without waiting."""
        from zmq.utils.monitor import parse_monitor_message

        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return f"the coordinator at {event['endpoint'].decode()} refused this worker's key (wrong key file?)"
            if event["event"] & self.EVENTS:
                return (
                    f"the secure handshake with {event['endpoint'].decode()} failed: the coordinator's public key "
                    "in the key file is not the one it has (wrong key file?)"
                )
        return ""

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)


def pull(context: zmq.Context, endpoint: str, security: Security) -> tuple[zmq.Socket, str]:
    """A worker's data-plane inbox: peers PUSH collective payloads to it."""
    sock = context.socket(zmq.PULL)
    _common(sock)  # a bounded queue: a peer that floods it blocks (and times out) on its own side
    security.server(sock)
    return sock, bind(sock, endpoint)


def push(context: zmq.Context, endpoint: str, security: Security, server: int = COORDINATOR) -> zmq.Socket:
    """A PUSH to the inbox of rank `server` (the coordinator's heartbeat inbox by default)."""
    sock = context.socket(zmq.PUSH)
    _common(sock)
    security.client(sock, server)
    sock.connect(endpoint)
    return sock


def send(
    sock: zmq.Socket, message: Message, request_id: int = 0, route: bytes | None = None, limits: Limits = DEFAULT_LIMITS
) -> None:
    frames = encode(message, request_id, limits)
    send_frames(sock, frames, route)


def send_frames(sock: zmq.Socket, frames: list[Any], route: bytes | None = None, track: bool = False):
    """Send `frames` without copying the large ones: ZeroMQ reads a frame of COPY_THRESHOLD
    bytes or more from the caller's memory after this returns. With `track`, a tracker of when
    it is done with them where some frame is that large (else None: every frame was copied)."""
    if route is not None:
        frames = [route, *frames]
    track = track and any(memoryview(f).nbytes >= zmq.COPY_THRESHOLD for f in frames)
    try:
        tracker = sock.send_multipart(frames, copy=False, track=track)
    except zmq.Again as exc:
        raise TransportError(f"send timed out{_to(route)}: no peer took the message") from exc
    except zmq.ZMQError as exc:
        raise TransportError(f"send failed{_to(route)}: {exc}") from exc
    return tracker if track else None


def _to(route: bytes | None) -> str:
    return f" to {route.decode(errors='replace')}" if route else ""


def recv_frames(sock: zmq.Socket, deadline: Deadline) -> list[zmq.Frame]:
    """Frames of the next message, or DeadlineExceeded: nothing waits forever."""
    if not sock.poll(deadline.remaining_ms()):
        raise DeadlineExceeded(f"no message within {deadline.seconds:.1f} s")
    return sock.recv_multipart(copy=False)
