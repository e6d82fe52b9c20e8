"""uvicorn's h11 protocol with a deadline on every request's head: a connection that has not sent a
whole request line and headers within the deadline of opening (or of its first byte after the
previous answer) is closed. uvicorn itself waits for a head for ever (its keep-alive timer runs
only between requests, and stops at the first byte), so clients trickling headers (slowloris) or
opening connections and sending nothing held them until --max-connections shut everyone out. The
body's own deadline is the application's (models/openai_server.py)."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_head_deadline(seconds: float) -> type[asyncio.Protocol]:
    """An H11Protocol class whose connections close when a request's head takes over `seconds`."""

    class HeadDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # a head begins (or goes on): it has its deadline
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the head is in: the body's deadline is the application's

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(seconds, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline
