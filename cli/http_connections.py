"""uvicorn's h11 protocol with the bounds a public server needs on its connections:

- a deadline on every request's head: a connection that has not sent a whole request line and
  headers within the deadline of opening (or of its first byte after the previous answer) is
  closed. uvicorn itself waits for a head for ever (its keep-alive timer runs only between
  requests, and stops at the first byte), so clients trickling headers (slowloris) or opening
  connections and sending nothing held them until --max-connections shut everyone out;
- idle connections (open, no request under way) bounded per client address: past the bound the
  client's oldest idle one is closed, so one client reopening hundreds of connections as the head
  deadline closes them holds at most that many;
- idle connections give way to work: when a connection arrives at the limit of open connections,
  the oldest idle one (anyone's) is closed, so uvicorn's 503 "Exceeded concurrency limit" is
  answered only when that many requests are really under way, and /health and real requests go
  on being served while idle sockets pile up.

- a lingering close: a request answered before its body is all in (413 for a body past the
  bound, unread) does not close the connection under the client still sending, which would reset
  it and lose the answer for a client that reads only after sending (urllib: a broken pipe); the
  rest of the body is read and dropped, up to LINGER_BYTES and while it keeps coming within
  LINGER_SECONDS, as nginx's lingering close does.

The body's own deadline is the application's (models/openai_server.py)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

IDLE_PER_CLIENT = 32  # an HTTP client's pool keeps ~20 (httpx's default); a browser 6 a host
LINGER_SECONDS = 5.0  # a lingering close ends once the client sends nothing for this long
LINGER_BYTES = 64 << 20  # or once it has sent this much more


class LingeringClose:
    """A connection's transport whose close() lingers while the client is still sending a request
    body (the answer already written): our side is shut for writing, what comes is dropped, and
    the socket closes when the client closes it, falls silent or sends too much."""

    def __init__(self, transport: asyncio.Transport, protocol: H11Protocol):
        self._transport, self._protocol = transport, protocol
        self.lingering, self._dropped, self._timer = False, 0, None

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        if self._protocol.conn.their_state is not h11.SEND_BODY:
            self._transport.close()
            return
        self.lingering = True
        if self._transport.can_write_eof():
            self._transport.write_eof()
        self._transport.resume_reading()  # uvicorn may have paused it at its high-water mark
        self._wait()

    def drop(self, data: bytes) -> None:
        """Bytes that came while lingering."""
        self._dropped += len(data)
        if self._dropped > LINGER_BYTES:
            self._transport.close()
        else:
            self._wait()

    def _wait(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._protocol.loop.call_later(LINGER_SECONDS, self._transport.close)


def bounded_connections(
    head_seconds: float, max_connections: int, idle_per_client: int = IDLE_PER_CLIENT
) -> type[asyncio.Protocol]:
    """An H11Protocol class for one server: heads within `head_seconds`, at most `idle_per_client`
    idle connections per client address, idle ones closed to make room at `max_connections`."""
    idle: OrderedDict[H11Protocol, str] = OrderedDict()  # the server's idle connections, oldest first

    def close_oldest(of_client: str | None = None, sparing=None) -> bool:
        for conn, client in idle.items():
            if conn is not sparing and of_client in (None, client):
                del idle[conn]
                conn.transport.close()
                return True
        return False

    class BoundedConnection(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(LingeringClose(transport, self))
            self._arm()
            self._now_idle()
            # uvicorn answers 503 to a request that finds this many connections open: make room
            open_now = len(self.connections) - sum(c.transport.is_closing() for c in idle)
            if open_now >= max_connections:
                close_oldest(sparing=self)

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                self.transport.drop(data)
                return
            if self.conn.their_state is h11.IDLE:
                self._arm()  # a head begins (or goes on): it has its deadline
            idle.pop(self, None)  # a request is under way
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the head is in: the body's deadline is the application's

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._now_idle()  # kept alive, waiting for the next request

        def connection_lost(self, exc) -> None:
            idle.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def _now_idle(self) -> None:
            client = self.client[0] if self.client else ""
            idle[self] = client
            if sum(c == client for c in idle.values()) > idle_per_client:
                close_oldest(of_client=client, sparing=self)

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(head_seconds, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                idle.pop(self, None)
                self.transport.close()

    return BoundedConnection
