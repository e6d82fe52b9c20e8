"""A live receiver for transport tests: a thread serving requests through transport.reply."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import zmq

from transport import protocol as p
from transport.reply import respond
from transport.sockets import IpcDir, Security, router


def echo_handler(message):
    if isinstance(message, p.Get):
        return p.Tensor(message.tensor, np.arange(4, dtype=np.float32))
    if isinstance(message, p.Put):
        return p.Ok({"bytes": int(message.array.nbytes)})
    return p.Ok({"type": type(message).__name__})


@contextlib.contextmanager
def live_receiver(keys=None, endpoint=None):
    """Yields (context, endpoint); the server thread stops and every socket closes on exit."""
    ctx = zmq.Context()
    ipc = IpcDir()
    security = Security(ctx, keys)
    stop = threading.Event()
    ready = threading.Event()
    bound = {}

    def serve():
        sock, bound["endpoint"] = router(ctx, endpoint or ipc.endpoint("echo"), security)
        ready.set()
        try:
            while not stop.is_set():
                if sock.poll(50):
                    route, *frames = sock.recv_multipart(copy=False)
                    sock.send_multipart([route, *respond(frames, echo_handler)], copy=False)
        finally:
            sock.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(5)
    try:
        yield ctx, bound["endpoint"]
    finally:
        stop.set()
        thread.join(5)
        security.close()
        ctx.term()
        ipc.close()


def on_ranks(n: int, rank_main, timeout: float = 30.0) -> list:
    """rank_main(r) for r in 0..n-1, each on its own thread (ranks that talk to each other);
    their results in rank order. The first exception of any rank is raised here."""
    results: list = [None] * n
    errors: list = []

    def body(r: int) -> None:
        try:
            results[r] = rank_main(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout} s"
    return results
