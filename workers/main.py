"""The worker process: connect, say hello, serve until shutdown or until the coordinator is lost.

A watchdog thread owns the heartbeat sockets: it sends this worker's heartbeat and exits the
process when the coordinator has been silent past the liveness window (or the parent process
that started us is gone), even if the main thread is stuck in a kernel. No orphans.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import threading
import time
import traceback

import numpy as np
import zmq

from split_state.errors import MetaError
from transport import protocol as p
from transport.deadline import Deadline
from transport.reply import respond
from transport.sockets import (
    CurveKeys,
    HandshakeWatch,
    Security,
    dealer,
    endpoint_host,
    is_local,
    local_address,
    pull,
    push,
    recv_frames,
    send,
    send_frames,
)
from transport.stop_signal import StopSignal
from workers import planes
from workers.backends import make_backend, names
from workers.backends.cpu import numba_cpu
from workers.comm import ZmqComm
from workers.kernels.fused import UNFUSED_ENV, left_fused
from workers.planes.shm import SHARED_FILES
from workers.server import WorkerServer
from workers.store import map_large_allocations

EXIT_COORDINATOR_LOST = 17


def parse(argv: list[str] | None) -> p.WorkerLaunch:
    return p.WorkerLaunch.parse(argv, backends=names())


def data_endpoint(args: p.WorkerLaunch) -> tuple[str, str]:
    """(where to bind the data inbox, the host peers reach it at; "" keeps the bound address).

    On one host: an ipc endpoint beside the coordinator's. Over tcp: the interface that routes to
    the coordinator, advertised as itself; a coordinator on this host (loopback or a wildcard
    address) keeps the inbox on loopback unless `advertise` names this host for other hosts'
    workers, in which case the inbox listens on every interface."""
    if args.data:
        return args.data, args.advertise
    if args.connect.startswith("ipc://"):
        return args.connect.rsplit("/", 1)[0] + f"/data-{args.rank}-{os.getpid()}", ""
    host = endpoint_host(args.connect)
    if is_local(host):
        return ("tcp://0.0.0.0:*", args.advertise) if args.advertise else ("tcp://127.0.0.1:*", "")
    return f"tcp://{local_address(host)}:*", args.advertise


def watchdog(args: p.WorkerLaunch, context: zmq.Context, security: Security, stop: StopSignal) -> None:
    """Heartbeats out, coordinator heartbeats in; exits the process when the coordinator is gone.
    Any failure of the watchdog itself also exits: a worker must never outlive its watch."""
    try:
        _watch(args, context, security, stop)
    except BaseException as exc:  # noqa: BLE001 - fail safe, whatever went wrong
        if not stop.is_set():
            _exit(args.rank, f"its watchdog failed: {type(exc).__name__}: {exc}", orphaned(args))


def _watch(args: p.WorkerLaunch, context: zmq.Context, security: Security, stop: StopSignal) -> None:
    beat_in = context.socket(zmq.SUB)
    beat_in.linger = 0
    security.client(beat_in)
    beat_in.subscribe(b"")
    beat_in.connect(args.beat)
    beat_out = push(context, args.beat_in, security)
    beat_out.sndtimeo = 0  # a heartbeat that cannot leave now is simply skipped
    poller = zmq.Poller()
    poller.register(beat_in, zmq.POLLIN)
    poller.register(stop.fd, zmq.POLLIN)
    last = time.monotonic()
    try:
        while not stop.is_set():
            try:
                send(beat_out, p.Heartbeat(args.rank))
            except MetaError:
                pass
            if beat_in in dict(poller.poll(int(args.heartbeat * 1000))):
                while beat_in.poll(0):  # drain: only the latest beat matters
                    beat_in.recv_multipart()
                last = time.monotonic()
            if orphaned(args):
                _exit(args.rank, "its parent exited", True)
            if time.monotonic() - last > args.liveness:
                _exit(args.rank, f"no coordinator heartbeat for {args.liveness:.1f} s", orphaned(args))
    finally:
        beat_in.close(0)
        beat_out.close(0)


def cancel_seen(control: zmq.Socket, rid: int, pending: collections.deque) -> bool:
    """Whether a Cancel of request `rid` has come, without waiting; other requests that came
    meanwhile are kept for after the one under way."""
    seen = False
    while control.poll(0):
        frames = control.recv_multipart(copy=False)
        try:
            message, got = p.decode(frames)
        except MetaError:
            pending.append(frames)  # answered with its error in turn
            continue
        if isinstance(message, p.Cancel):
            seen = seen or got == rid
        else:
            pending.append(frames)
    return seen


def orphaned(args: p.WorkerLaunch) -> bool:
    return bool(args.parent_pid) and os.getppid() != args.parent_pid


_IPC_DIRS: list[str] = []  # the coordinator's private socket directory: gone with it, removed here


def _exit(rank: int, why: str, coordinator_gone: bool) -> None:
    """Exit now, removing this worker's own files, and the coordinator's socket directory only
    when the coordinator is known to be gone: a worker that merely stopped hearing it (starved
    of CPU while the coordinator lives) must not pull the sockets from under every other worker."""
    try:
        for path in SHARED_FILES:
            path.unlink(missing_ok=True)
        for directory in _IPC_DIRS if coordinator_gone else ():
            shutil.rmtree(directory, ignore_errors=True)
        print(f"worker {rank}: exiting, {why}", file=sys.stderr, flush=True)
    finally:  # stderr may be a pipe to the dead coordinator: exit regardless
        os._exit(EXIT_COORDINATOR_LOST)


PREPARING: list[threading.Thread] = []  # the thread compiling the numba loops in the background


def still_compiling() -> bool:
    """Whether the kernels' compilation is still under way: a job that ends within a cold
    cache's first 40 s (a demo, a short generation) ends with it inside LLVM, and a daemon thread
    in native code crashes the interpreter's teardown (SIGSEGV, seen): the process then exits
    without one (`leave`)."""
    return any(thread.is_alive() for thread in PREPARING)


def leave(code: int) -> None:
    """End the worker process with `code` once `main` returned. While the kernels still compile
    it exits without the interpreter's teardown (`still_compiling`), so atexit's handlers do not
    run: the planes' exit duties run in their place (the MPI plane's MPI_Finalize, without which
    mpiexec fails the whole job however well it went)."""
    if still_compiling():
        sys.stdout.flush()
        sys.stderr.flush()
        planes.exit_duties()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:  # the executor reads it at every load: a wrong name stops the worker now, in one line
        left_fused(os.environ.get(UNFUSED_ENV, ""))
    except ValueError as exc:
        print(f"worker {args.rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.connect.startswith("ipc://") and os.path.basename(os.path.dirname(args.connect[6:])).startswith("meta-tp-"):
        _IPC_DIRS.append(os.path.dirname(args.connect[6:]))
    np.seterr(all="ignore")  # as on GPUs: overflow gives inf/nan, never a warning per op
    map_large_allocations()  # freed message buffers go back to the system (workers/store.py)
    backend = make_backend(args.backend, args.device, args.rank)
    numba_cpu.set_threads(args.threads)  # the CPU decode loops' threads (a GPU worker's loops never run)
    context = zmq.Context()
    security = Security(context, CurveKeys.load(args.keys) if args.keys else None, rank=args.rank)
    bind_at, advertise = data_endpoint(args)
    inbox, data_ep = pull(context, bind_at, security)
    if advertise:  # what peers on other hosts can reach, on the port that was bound
        data_ep = f"tcp://{advertise}:{data_ep.rsplit(':', 1)[1]}"
    control = dealer(context, args.connect, p.worker_identity(args.rank, os.getpid()), security)
    # with keys, a refused handshake is otherwise silent: watch it until the coordinator speaks
    handshake = HandshakeWatch(control) if args.keys else None
    stop = StopSignal()
    dog = threading.Thread(target=watchdog, args=(args, context, security, stop), daemon=True)
    dog.start()
    comms: list[ZmqComm] = []

    def connect(configure: p.Configure) -> ZmqComm:
        for old in comms:
            old.close()
        comms[:] = [planes.connect(args.rank, configure, inbox, context, security)]
        return comms[0]

    server = WorkerServer(args.rank, backend, connect, args.collective_timeout)
    server.executor.freeze_programs = True  # this process is the worker's alone
    # kernels that compile (numba) get ready while the coordinator connects and places the first
    # weights (past a few MiB, they wait: workers/server.py KERNELS_BEFORE_BYTES)
    server.executor.kernels_prepared = False
    PREPARING.append(threading.Thread(target=server.executor.prepare_kernels, daemon=True, name="prepare-kernels"))
    PREPARING[-1].start()
    info = backend.info()
    try:
        send(
            control,
            p.Hello(
                args.rank,
                os.getpid(),
                info.backend,
                info.description,
                info.memory_total,
                info.memory_free,
                data_ep,
                planes.joinable_planes(info.backend),
                info.index if info.kind == "gpu" else -1,
            ),
        )
        pending: collections.deque = collections.deque()  # requests that came during a Generate
        while not server.stopping:
            if pending:
                frames = pending.popleft()
            else:
                try:
                    frames = recv_frames(control, Deadline(0.5))
                except MetaError:
                    refused = handshake.failure() if handshake is not None else ""
                    if refused:
                        server.refused = refused
                        break
                    if orphaned(args) or not dog.is_alive():  # belt and braces: never outlive the watch
                        gone = orphaned(args)
                        _exit(args.rank, "its parent exited" if gone else "its watchdog stopped", gone)
                    continue  # nothing yet; the watchdog decides when waiting is over
            if handshake is not None:  # the coordinator got through: the handshake is done
                handshake.close()
                handshake = None
            rid = p.request_id(frames)
            server.emit = lambda message, rid=rid: send(control, message, rid)
            server.cancelled = lambda rid=rid: cancel_seen(control, rid, pending)
            send_frames(control, respond(frames, server.handle))
    except KeyboardInterrupt:
        pass
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        stop.set()
        dog.join(2)
        if not dog.is_alive():
            stop.close()
        for comm in comms:
            comm.close()
        inbox.close(0)
        if handshake is not None:
            handshake.close()
        control.close(0)
        security.close()
        context.destroy(linger=0)  # also a socket an exception left unclosed: term would wait for it
    if server.refused:
        print(f"worker {args.rank}: exiting, {server.refused}", file=sys.stderr, flush=True)
        return 2
    return 0
