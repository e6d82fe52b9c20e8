"""A stop signal that wakes a ZeroMQ poll: a thread that polls its sockets for a heartbeat
interval also polls this signal's pipe, so setting it ends the wait at once. Both the
coordinator's heartbeat thread and a worker's watchdog wait that way; with a plain Event, every
close waited up to a heartbeat interval (0.5 s) for each of them to notice."""

from __future__ import annotations

import os
import threading


class StopSignal:
    def __init__(self) -> None:
        self._set = threading.Event()
        self.fd, self._write = os.pipe()  # poll `fd` (zmq.Poller takes file descriptors)
        self._closed = False

    def set(self) -> None:
        if not self._set.is_set():
            self._set.set()
            os.write(self._write, b"x")

    def is_set(self) -> bool:
        return self._set.is_set()

    def close(self) -> None:
        """After the polling thread has ended."""
        if not self._closed:
            self._closed = True
            os.close(self.fd)
            os.close(self._write)
