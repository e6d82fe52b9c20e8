"""The server's connection bounds (cli/http_connections.py) on a bare uvicorn with a one-route app:
idle connections per client, idle ones giving way to requests at the connection limit, and the
head deadline on a connection kept alive after an answer."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from cli.http_connections import bounded_connections  # noqa: E402

pytestmark = pytest.mark.timeout(60)
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@contextlib.contextmanager
def serving(max_connections: int, idle_per_client: int, head_seconds: float = 30.0):
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})

    @app.post("/early")
    async def early():  # answered without reading the body, as a body past the bound is
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": "too large"}, status_code=413)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="off",
        limit_concurrency=max_connections,
        http=bounded_connections(head_seconds, max_connections, idle_per_client),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def whole_response(conn: socket.socket) -> bytes:
    """One response read to the end of its body (its head and body may come in two reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += conn.recv(4096)
    return data


def status_of(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(HEALTH)
        return int(conn.recv(4096).split(b" ", 2)[1])


def closed_by_server(sockets, wait: float = 2.0) -> int:
    """How many of `sockets` the server has closed (each read: end of file, or nothing yet)."""
    closed = 0
    deadline = time.monotonic() + wait
    for s in sockets:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        with contextlib.suppress(TimeoutError, socket.timeout):
            closed += s.recv(1) == b""
    return closed


def open_idle(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def test_one_client_holds_at_most_its_bound_of_idle_connections():
    with serving(max_connections=1000, idle_per_client=4) as port:
        idle = open_idle(port, 40)
        try:
            assert status_of(port) == 200
            # the newest 4 stay open (the /health connection, answered and closed, took one turn)
            assert closed_by_server(idle) >= 36
        finally:
            for s in idle:
                s.close()


def test_idle_connections_give_way_to_requests_at_the_connection_limit():
    """Without the bound per client (here set above what is opened), the limit of open connections
    is reached by idle sockets: uvicorn alone then answers 503 to everyone."""
    with serving(max_connections=8, idle_per_client=100) as port:
        idle = open_idle(port, 20)
        try:
            assert [status_of(port) for _ in range(3)] == [200, 200, 200]
            assert closed_by_server(idle) >= 12
        finally:
            for s in idle:
                s.close()


def test_a_kept_alive_connection_gets_the_head_deadline_again():
    """After an answer the connection waits for the next head: half of one that then stalls is
    cut at the deadline as on a fresh connection (uvicorn's keep-alive timer stops at the first byte)."""
    with serving(max_connections=100, idle_per_client=8, head_seconds=1.0) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(HEALTH)
            assert whole_response(conn).startswith(b"HTTP/1.1 200")
            conn.sendall(b"GET /health HTTP/1.1\r\nHo")
            started = time.monotonic()
            assert conn.recv(4096) == b""
            assert 0.7 < time.monotonic() - started < 4


def test_a_client_that_reads_only_after_sending_gets_an_early_answer():
    """urllib sends the whole body before it reads: a server that answers early and closes under
    it resets the connection (a broken pipe, the 413 lost). The lingering close reads the rest."""
    import urllib.error
    import urllib.request

    with serving(max_connections=100, idle_per_client=8) as port:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/early", data=bytes(4 << 20))
        with pytest.raises(urllib.error.HTTPError) as answered:
            urllib.request.urlopen(request, timeout=30)
        assert answered.value.code == 413 and b"too large" in answered.value.read()
        assert status_of(port) == 200
