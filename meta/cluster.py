"""Worker processes as seen from the coordinator: start, connect, call, watch, stop.

`ProcessCluster` starts `python -m workers` processes (or accepts workers started elsewhere
with `launch.py worker --connect`), collects their Hello, tells each its peers, and serves
`call_all`: send one message per worker, wait for every reply within a deadline. A heartbeat
thread publishes the coordinator's heartbeat and records the workers'; a worker that dies or
falls silent fails every pending call with WorkerLost naming it, and the others are told to
abort at once. Only transport is used to talk to workers.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import zmq

from meta.launchers import worker_cpus
from split_state.errors import DeadlineExceeded, MetaError, ProtocolError, TransportError, WorkerLost, WorkerTimeout
from transport import protocol as p
from transport.deadline import Deadline, Liveness
from transport.environment import BLAS_THREAD_VARS, CPUS_ENV
from transport.replies import OnMessage, Watch, gather_replies
from transport.shm import remove_session
from transport.sockets import (
    CurveKeys,
    IpcDir,
    Security,
    bind,
    endpoint_host,
    is_local,
    pull,
    push,
    recv_frames,
    router,
    send,
)
from transport.stop_signal import StopSignal

POLL_MS = 100
# how long a send that finds a worker's connection closed waits for its process to be seen exited
UNREACHABLE_SETTLE_S = 1.0
BIND_MODES = ("auto", "off")


MAX_WORKERS_PER_CORE = 8  # beyond this a host only thrashes: refused before any worker starts


@dataclass(frozen=True)
class ClusterConfig:
    workers: int = 2
    backend: str = "cpu"
    devices: tuple[int, ...] = ()  # GPU index per worker (cuda)
    host: str = ""  # "" : ipc on this host; otherwise tcp on this address, e.g. "127.0.0.1" or "0.0.0.0"
    ipc_dir: str = ""  # with ipc: a known private directory for the endpoints (a batch job's ranks find it)
    advertise: str = ""  # over tcp: the address workers spawned here give peers on other hosts
    port: int = 0
    keys: str = ""  # CURVE key file
    spawn: bool = True  # False: wait for workers started with 'launch.py worker --connect'
    local_workers: int = -1  # with spawn: start ranks 0 .. local_workers-1 here (-1: all), the rest join
    insecure: bool = False  # tcp without keys: anyone who can reach the ports can join
    heartbeat: float = 0.5
    liveness: float = 5.0
    start_timeout: float = 60.0
    call_timeout: float = 300.0
    collective_timeout: float = 30.0
    blas_threads: int = 1  # each worker's threads (BLAS and the quantized loops): cores // workers by default
    memory_budget: int = 0
    # between workers: a plane of workers/planes/ that every worker can join ("shm" shared memory
    # on one host, ZeroMQ across hosts; "zmq"; "nccl" for CuPy workers on distinct GPUs; "ipc" for
    # CuPy workers on this host; "mpi" for workers that are an MPI job's ranks), or "auto": nccl
    # where it applies, then ipc (CuPy workers spawned here on one GPU), then mpi, else shm
    data_plane: str = "auto"
    # "auto": CPU workers spawned here each on their own cores when they go round once; "off"
    bind: str = "auto"
    log_dir: str = ""
    env: dict[str, str] = field(default_factory=dict)


class ProcessCluster:
    def __init__(self, config: ClusterConfig):
        if config.workers < 1:
            raise MetaError(f"a cluster needs at least one worker, got {config.workers}")
        if not config.data_plane.isidentifier():  # which planes exist, the workers say (workers/planes/)
            raise MetaError(f"data_plane must be 'auto' or a plane's name, got {config.data_plane!r}")
        if config.bind not in BIND_MODES:
            raise MetaError(f"bind must be one of {BIND_MODES}, got {config.bind!r}")
        self.session = secrets.token_hex(8)
        self.config = config
        self.world_size = config.workers
        self.context = zmq.Context()
        self._key_dir = None  # ephemeral keys for workers spawned here, over tcp
        self.keys = self._cluster_keys()
        self.security = Security(self.context, self.keys)
        self.ipc = IpcDir(config.ipc_dir) if not config.host else None
        self.processes: list[subprocess.Popen] = []
        self.pids: dict[int, int] = {}
        self.routes: dict[int, bytes] = {}  # each rank's identity on the control socket, from its Hello
        self.liveness = Liveness(config.liveness)
        self._lock = threading.Lock()
        # the control socket is read by a call, or between calls by the heartbeat thread (latecomers
        # must be told why they cannot join even while the user is idle): one at a time
        self._control_lock = threading.Lock()
        self._formed = False
        self._stop = StopSignal()  # ends the heartbeat thread's wait at once
        self._request = 0
        self._data: dict[int, zmq.Socket] = {}
        self.closed = False
        self.lost: WorkerLost | None = None
        try:
            self.control, self.endpoint = router(self.context, self._endpoint("control"), self.security)
            self._beat_out = self.context.socket(zmq.PUB)
            self._beat_out.linger = 0
            self.security.server(self._beat_out)
            self.beat_endpoint = bind(self._beat_out, self._endpoint("beat"))
            self._beat_in, self.beat_in_endpoint = pull(self.context, self._endpoint("beat-in"), self.security)
            self._beats = threading.Thread(target=self._heartbeat_loop, daemon=True)
            self._beats.start()
            if config.spawn:
                self._spawn()
            with self._control_lock:
                self.devices = self._handshake()
            plane = self._data_plane()
            nccl_id = b""
            if plane == "nccl":  # rank 0 makes it (and hosts NCCL's bootstrap root); every rank gets it
                reply = self.call_all({0: p.NcclId()}, config.start_timeout)[0]
                nccl_id = bytes.fromhex(reply.info["nccl_id"])
            replies = self.call_all(
                {
                    r: p.Configure(
                        self.world_size,
                        [h.data_endpoint for h in self.devices],
                        plane,
                        nccl_id=nccl_id,
                        memory_budget=config.memory_budget,
                        session=self.session,
                    )
                    for r in range(self.world_size)
                },
                config.start_timeout,
            )
            failed = sorted((r, m) for r, m in replies.items() if isinstance(m, p.Error))
            if failed:  # the worker's own words, typed: not an attribute error on its reply
                rank, error = failed[0]
                raise TransportError(f"worker {rank} could not join the {plane} data plane: {error.message}")
            self.data_planes = [replies[r].info for r in range(self.world_size)]
            self._formed = True
        except BaseException:
            self.close()
            raise

    # -- start ----------------------------------------------------------------------------------

    def _data_plane(self) -> str:
        """The plane the workers say they can all join: NCCL for CuPy workers each on its own GPU
        (one host, spawned here) when every one has NCCL; MPI for the workers of an MPI job's
        ranks; CUDA IPC for CuPy workers spawned here sharing one GPU (NCCL refuses that); plain
        TCP sockets for workers on several hosts without keys (a small all-reduce about one
        exchange of its bytes, against several through ZeroMQ); else shared memory (ZeroMQ
        where it cannot be shared, and for every peer on another host when the cluster has
        CURVE keys). The coordinator decides from their Hellos, not from its own imports."""
        config = self.config
        lacking = lambda plane: [h.rank for h in self.devices if plane not in h.planes]  # noqa: E731
        if config.data_plane != "auto":
            if lacking(config.data_plane):
                raise MetaError(
                    f"data_plane {config.data_plane!r}: workers {lacking(config.data_plane)} cannot join it "
                    f"(they can join {', '.join(self.devices[0].planes)}; nccl needs the cuda backend and CuPy "
                    "with NCCL >= 2.7; mpi needs workers started by the ranks of an MPI job, with mpi4py)"
                )
            return config.data_plane
        # the GPUs the workers say they run on (without --devices, rank r takes GPU r modulo the count)
        said = tuple(h.device_index for h in self.devices)
        devices = said if min(said, default=-1) >= 0 else config.devices or tuple(range(self.world_size))
        distinct = len(set(devices)) == self.world_size
        if config.backend == "cuda" and config.spawn and self.world_size > 1 and distinct and not lacking("nccl"):
            return "nccl"
        every_one_here = config.spawn and config.local_workers < 0
        one_gpu = len(set(devices)) == 1  # across GPUs CUDA IPC would need peer access between them
        if config.backend == "cuda" and every_one_here and self.world_size > 1 and one_gpu and not lacking("ipc"):
            return "ipc"
        if self.world_size > 1 and not lacking("mpi"):  # workers that are an MPI job's ranks
            return "mpi"
        if self.keys is None and len(worker_hosts(self.devices)) > 1 and not lacking("tcp"):
            return "tcp"  # workers on several hosts, no keys: plain sockets (CURVE stays on ZeroMQ)
        return "shm"

    def _endpoint(self, name: str) -> str:
        """ipc in a private directory on one host; over tcp the heartbeat sockets sit on the two
        ports after the control port, so a remote worker needs only the control address."""
        if self.ipc is not None:
            return self.ipc.endpoint(name)
        return p.tcp_endpoint(self.config.host, self.config.port, name)

    def worker_command(self, rank: int) -> list[str]:
        """The command line that starts worker `rank` on this host."""
        c = self.config
        launch = p.WorkerLaunch(
            connect=self.endpoint,
            beat=self.beat_endpoint,
            beat_in=self.beat_in_endpoint,
            rank=rank,
            backend=c.backend,
            device=c.devices[rank] if c.devices else -1,  # -1: the worker takes the rank's turn round its devices
            keys=c.keys,
            advertise=c.advertise,
            heartbeat=c.heartbeat,
            liveness=c.liveness,
            collective_timeout=c.collective_timeout,
            parent_pid=os.getpid(),
            threads=c.blas_threads,
        )
        return launch.command()

    def _cluster_keys(self) -> CurveKeys | None:
        """tcp is authenticated: the key file given, or a fresh key pair when every worker is
        spawned here; remote workers without keys need an explicit `insecure`."""
        c = self.config
        if c.keys:
            return CurveKeys.load(c.keys)
        if not c.host:
            return None  # ipc in a private (0700) directory
        if c.insecure:
            print(
                f"warning: tcp without keys on {c.host}, ports {c.port or '(any)'}..: anyone who can reach them "
                "can join as a worker, read tensors and inject results; use --keys (launch.py keys PATH) on "
                "untrusted networks",
                file=sys.stderr,
                flush=True,
            )
            return None
        if c.spawn and c.local_workers < 0:
            self._key_dir = IpcDir()
            keys = CurveKeys.generate()
            path = os.path.join(self._key_dir.path, "cluster.key")
            keys.save(path)
            self.config = replace(c, keys=path)  # spawned workers read it from the private directory
            return keys
        raise MetaError(
            f"tcp on {c.host} without keys: workers on other hosts would join unauthenticated. Make a key file "
            "with 'launch.py keys PATH', give it to the coordinator and every worker (--keys PATH), or accept "
            "anyone who can reach the ports with --insecure"
        )

    def _spawn(self) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        local = self.world_size if self.config.local_workers < 0 else self.config.local_workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if local > MAX_WORKERS_PER_CORE * cores:  # checked before any process starts
            raise MetaError(
                f"{local} workers on this host of {cores} cores: at most {MAX_WORKERS_PER_CORE * cores} "
                f"({MAX_WORKERS_PER_CORE} per core) start here; use fewer, or spread them over hosts "
                "(launch.py worker --connect)"
            )
        if self.config.backend == "cpu" and local > cores:
            print(
                f"warning: {local} CPU workers on {cores} cores: they take turns on the cores, and a tensor-parallel "
                f"step runs at the pace of the slowest; --workers {cores} or fewer is faster",
                file=sys.stderr,
                flush=True,
            )
        cpus = self._worker_cpus(local)
        for rank in range(local):
            env = dict(os.environ, **self.config.env)
            if cpus is not None:
                env[CPUS_ENV] = ",".join(map(str, cpus[rank]))
            env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
            threads = str(self.config.blas_threads)
            for var in BLAS_THREAD_VARS:
                env[var] = threads  # one worker per core: BLAS must not oversubscribe
            cmd = self.worker_command(rank)
            if self.config.log_dir:
                Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
                with open(Path(self.config.log_dir) / f"worker-{rank}.log", "ab") as log:
                    proc = subprocess.Popen(
                        cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                    )
            else:
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    # a session of their own: Ctrl-C at the terminal reaches the coordinator, which
                    # stops its workers, and not each worker (a traceback apiece while importing)
                    start_new_session=True,
                )
                threading.Thread(target=_prefix_lines, args=(proc.stdout, f"[worker {rank}] "), daemon=True).start()
            self.processes.append(proc)
            self.pids[rank] = proc.pid

    def _worker_cpus(self, local: int) -> list[tuple[int, ...]] | None:
        c = self.config
        if c.bind == "off" or c.backend != "cpu" or not hasattr(os, "sched_getaffinity"):
            return None
        return worker_cpus(local, c.blas_threads, os.sched_getaffinity(0))

    def _handshake(self) -> list[p.Hello]:
        """Wait for a Hello from every rank. Anything else that arrives (a malformed message, a
        rank out of range or already taken, a key holder speaking for another rank) is dropped,
        its sender told why when it can be reached, and the waiting goes on: one stray message
        must not stop a cluster from forming. The drops are counted in one line on stderr."""
        hellos: dict[int, p.Hello] = {}
        refused: list[str] = []
        deadline = Deadline(self.config.start_timeout)
        while len(hellos) < self.world_size:
            self._check_processes()
            try:
                route, *frames = recv_frames(self.control, Deadline(min(0.2, deadline.remaining())))
            except DeadlineExceeded:
                if deadline.expired():
                    missing = sorted(set(range(self.world_size)) - set(hellos))
                    also = f" ({len(refused)} start-up messages refused, the first: {refused[0]})" if refused else ""
                    raise DeadlineExceeded(
                        f"workers {missing} did not connect to {self.endpoint} within "
                        f"{self.config.start_timeout} s{also}"
                    ) from None
                continue
            message, reason = self._vet(route.bytes, frames, hellos)
            if reason:
                refused.append(reason)
                self._refuse(route.bytes, reason)
                continue
            hellos[message.rank] = message
            self.routes[message.rank] = route.bytes
            self.pids.setdefault(message.rank, message.pid)
            self.liveness.heard(message.rank)
        if refused:
            print(
                f"coordinator: refused {len(refused)} start-up message(s) not from a worker of this cluster; "
                f"the first: {refused[0]}",
                file=sys.stderr,
                flush=True,
            )
        for rank, hello in hellos.items():
            self._data[rank] = push(self.context, hello.data_endpoint, self.security, server=rank)
            self._data[rank].sndtimeo = 100
        return [hellos[r] for r in range(self.world_size)]

    def _vet(self, route: bytes, frames: list, hellos: dict[int, p.Hello]) -> tuple[p.Hello | None, str]:
        """(the Hello, "") of a worker of this cluster, or (None, why this start-up message is not)."""
        try:
            message, _ = p.decode(frames)
        except ProtocolError as exc:
            return None, f"a malformed message ({exc})"
        if not isinstance(message, p.Hello):
            return None, f"a {type(message).__name__} where a Hello was expected"
        rank = message.rank
        if not 0 <= rank < self.world_size:
            return None, f"a Hello from rank {rank}, but this cluster has ranks 0..{self.world_size - 1}"
        sender = self.security.sender(frames[0])
        if sender not in (None, rank):
            return None, f"a Hello as rank {rank} from the holder of rank {sender}'s key"
        if p.rank_of(route) != rank:
            return None, f"a Hello as rank {rank} under the identity {route!r}"
        if rank in hellos:
            return None, f"a second worker as rank {rank} (pid {message.pid}; rank {rank} is pid {hellos[rank].pid})"
        return message, ""

    def _refuse(self, route: bytes, reason: str) -> None:
        """Tell a refused worker why (it prints the reason and exits), when it can be reached."""
        if p.rank_of(route) < 0:
            return
        try:
            send(self.control, p.Error("Refused", f"the coordinator refused it: {reason}"), 0, route=route)
        except MetaError:
            pass

    # -- liveness -------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._beat_in, zmq.POLLIN)
        poller.register(self._stop.fd, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._beat_out.send(p.HEARTBEAT_FRAME)
            except zmq.ZMQError:
                return
            deadline = time.monotonic() + self.config.heartbeat
            while (left := deadline - time.monotonic()) > 0 and self._beat_in in dict(poller.poll(int(left * 1000))):
                try:
                    frames = self._beat_in.recv_multipart(copy=False)
                    message, _ = p.decode(frames)
                except (ProtocolError, zmq.ZMQError):
                    continue
                # only the cluster's own ranks (their Hello accepted) are watched: a refused
                # worker's or a stranger's beats must never make a rank that then goes silent
                if (
                    isinstance(message, p.Heartbeat)
                    and self.security.sender(frames[0]) in (None, message.rank)
                    and message.rank in self.routes
                ):
                    with self._lock:
                        self.liveness.heard(message.rank)
            self._read_while_idle()

    def _read_while_idle(self) -> None:
        """Between calls, read what came on the control socket: a latecomer's Hello is told why it
        cannot join (else it would wait out its liveness window untold); anything else is a late
        reply of a finished call, which a call would drop too."""
        if not self._formed or not self._control_lock.acquire(blocking=False):
            return
        try:
            while not self.closed and self.control.poll(0):
                route, *frames = self.control.recv_multipart(copy=False)
                if self.routes.get(p.rank_of(route.bytes)) != route.bytes:
                    self._tell_latecomer(route.bytes, p.decode(frames)[0])
        except (zmq.ZMQError, ProtocolError):
            pass
        finally:
            self._control_lock.release()

    def _tell_latecomer(self, route: bytes, message: p.Message) -> None:
        if isinstance(message, p.Hello):
            self._refuse(route, f"rank {message.rank} is taken and the cluster has formed")

    def _check_processes(self) -> None:
        for rank, proc in enumerate(self.processes):
            code = proc.poll()
            if code is not None:
                self._lose(rank, f"worker {rank} (pid {proc.pid}) exited with code {code}")
        with self._lock:
            silent = [(r, self.liveness.silent_for(r)) for r in self.liveness.lost()]
        for rank, seconds in silent:
            text = (
                f"worker {rank} (pid {self.pids.get(rank)}) silent for {seconds:.1f} s "
                f"(liveness window {self.config.liveness} s)"
            )
            self._lose(rank, text, WorkerTimeout)

    def health(self) -> str:
        """Why the cluster cannot serve ("" while it can), read without a call and without
        side effects (a server's /health asks it from another thread than the calls'): a
        worker lost before, a local worker that exited, one silent past its liveness window."""
        if self.lost is not None:
            return str(self.lost)
        if self.closed:
            return "the cluster is closed"
        for rank, proc in enumerate(self.processes):
            code = proc.poll()
            if code is not None:
                return f"worker {rank} (pid {proc.pid}) exited with code {code}"
        with self._lock:
            silent = [(r, self.liveness.silent_for(r)) for r in self.liveness.lost()]
        if silent:
            rank, seconds = silent[0]
            return f"worker {rank} silent for {seconds:.1f} s (liveness window {self.config.liveness} s)"
        return ""

    def _lose(self, rank: int, text: str, kind: type[WorkerLost] = WorkerLost) -> None:
        self.lost = kind(text, rank=rank)
        self.abort_peers(rank, text)
        raise self.lost

    def abort_peers(self, lost: int, text: str) -> None:
        """Wake every other worker that may be waiting on `lost` inside a collective."""
        for rank, sock in self._data.items():
            if rank != lost:
                try:
                    send(sock, p.Abort(lost, -1, "WorkerLost", text))
                except MetaError:
                    pass

    # -- calls ----------------------------------------------------------------------------------

    def call_all(
        self,
        messages: dict[int, p.Message],
        timeout: float | None = None,
        on_message: OnMessage | None = None,
        watch: Watch | None = None,
    ) -> dict[int, p.Message]:
        """Send each worker its message; return every reply, or raise WorkerLost/DeadlineExceeded.
        With `on_message`, reports a worker sends before its reply (Tokens) go to it as they come,
        and each restarts the deadline; when it returns False, or on Ctrl-C, that worker is sent
        a Cancel and the replies are still awaited, so the workers stay usable. With `watch`,
        the same for reports that come another way."""
        if self.lost is not None:
            raise WorkerLost(f"cluster unusable: {self.lost}", rank=self.lost.rank)
        if self.closed:
            raise TransportError("cluster is closed")
        with self._control_lock:
            return self._call_all(messages, timeout, on_message, watch)

    def _call_all(
        self, messages: dict[int, p.Message], timeout: float | None, on_message: OnMessage | None, watch: Watch | None
    ) -> dict[int, p.Message]:
        self._check_processes()  # a dead worker is WorkerLost, not an unroutable send
        self._request += 1
        rid = self._request
        for rank, message in messages.items():
            self._send_to(rank, message, rid)

        def receive(wait_s: float) -> tuple[int, p.Message] | None:
            if not self.control.poll(int(wait_s * 1000)):
                return None
            route, *frames = self.control.recv_multipart(copy=False)
            try:
                message, got = p.decode(frames)
            except ProtocolError:
                return None
            rank = p.rank_of(route.bytes)
            if self.routes.get(rank) != route.bytes:
                self._tell_latecomer(route.bytes, message)
                return None
            if got == rid and isinstance(message, p.Error) and message.lost in self.routes and message.lost != rank:
                # a worker found a peer gone (its connection closed): that peer will not answer,
                # and a peer on another host is not ours to watch exit; lost now, not at liveness
                self._lose(message.lost, f"worker {message.lost} lost: {message.message}")
            return (rank, message) if got == rid else None  # else another request's

        def cancel(ranks) -> None:
            for rank in ranks:
                self._send_to(rank, p.Cancel(), rid)

        seconds = self.config.call_timeout if timeout is None else timeout
        return gather_replies(
            messages, seconds, receive, cancel, on_message, watch, POLL_MS / 1000, self._check_processes
        )

    def _send_to(self, rank: int, message: p.Message, rid: int) -> None:
        """Send one worker its message. A worker that dies between the check of the processes
        and the send has its connection closed, and ZeroMQ drops its route at once ("Host
        unreachable"): that is a lost worker, named as such (with its exit code where it is
        ours and has exited by now), not a transport error."""
        try:
            send(self.control, message, rid, route=self.routes[rank])
        except TransportError as exc:
            end = time.monotonic() + UNREACHABLE_SETTLE_S
            while time.monotonic() < end:  # the process whose connection closed is exiting
                self._check_processes()  # raises WorkerLost, naming its exit code, once it has
                time.sleep(0.01)
            self._lose(rank, f"worker {rank} (pid {self.pids.get(rank)}) unreachable: {exc}")

    # -- stop -----------------------------------------------------------------------------------

    def close(self, grace: float = 3.0) -> None:
        """Ask workers to stop, then terminate and kill what is left; reap all; close sockets."""
        if self.closed:
            return
        self.closed = True
        lost = self.lost.rank if self.lost is not None else None
        told = False  # workers not told to stop (still starting, say) get no grace to stop by themselves
        if getattr(self, "devices", None):
            # the socket is another thread's while it reads between calls or (closing from a signal
            # handler or another thread) makes a call; then the workers go by terminate below
            if self._control_lock.acquire(timeout=1.0):
                try:  # the survivors of a lost worker are told at once too, not left to the grace period
                    for rank, route in self.routes.items():
                        if rank != lost:
                            send(self.control, p.Shutdown(), 0, route=route)
                    told = True
                except MetaError:
                    pass
                finally:
                    self._control_lock.release()
        for proc in self.processes:
            if lost is not None and proc.pid == self.pids.get(lost) and proc.poll() is None:
                proc.kill()  # dead or stopped: nothing to wait for
        end = time.monotonic() + (grace if told else 0.0)
        for proc in self.processes:
            try:
                proc.wait(max(0.05, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._stop.set()
        if getattr(self, "_beats", None) is not None:
            self._beats.join(2)
        if getattr(self, "_beats", None) is None or not self._beats.is_alive():
            self._stop.close()
        for sock in [
            *self._data.values(),
            getattr(self, "control", None),
            getattr(self, "_beat_out", None),
            getattr(self, "_beat_in", None),
        ]:
            if sock is not None:
                sock.close(0)
        self.security.close()
        # destroy, not term: term waits for every socket of the context to close, and a Ctrl-C that
        # lands between making a socket and keeping it leaves one only the traceback holds
        self.context.destroy(linger=0)
        if self.ipc is not None:
            self.ipc.close()
        if self._key_dir is not None:
            self._key_dir.close()
        remove_session(self.session)  # inbox files of workers that could not remove their own

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prefix_lines(stream, prefix: str) -> None:
    """Copy a worker's output to our stderr, each line tagged with the worker's rank."""
    with stream:
        for line in iter(stream.readline, b""):
            sys.stderr.write(prefix + line.decode(errors="replace"))
            sys.stderr.flush()


def alive(pids: Sequence[int]) -> list[int]:
    """The pids that still exist (zombies excluded): used by tests and the orphan check."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def worker_hosts(hellos) -> set[str]:
    """The hosts the workers' data endpoints name; an ipc endpoint or loopback is this host."""
    return set(host_of_each(hellos))


def host_of_each(hellos) -> list[str]:
    """Each worker's host, by rank ("" for this host: an ipc endpoint, loopback, or a worker
    that names no endpoint, as a simulated one)."""
    hosts = [endpoint_host(getattr(hello, "data_endpoint", "")) for hello in hellos]
    return ["" if is_local(host) else host for host in hosts]
