"""An in-process cluster: N simulated devices, each a WorkerServer on its own thread.

Messages still go through the protocol's encode/decode, and collectives through the same code
over in-process queues, so a simulated run gives the same bits as real worker processes.
"""

from __future__ import annotations

import queue
import threading

from transport import protocol as p
from transport.replies import gather_replies
from transport.reply import respond
from workers.backends import make_backend
from workers.comm import QueueComm
from workers.server import WorkerServer


class SimulatedCluster:
    def __init__(self, n: int, backend: str = "cpu", collective_timeout: float = 30.0):
        if n < 1:
            raise ValueError(f"a cluster needs at least one device, got {n}")
        self.world_size = n
        self.call_timeout = 300.0
        self._data = [queue.Queue() for _ in range(n)]
        self._inboxes = [queue.Queue() for _ in range(n)]
        self._replies: queue.Queue = queue.Queue()
        self._cancel = [threading.Event() for _ in range(n)]  # a Cancel for the request under way
        self.servers = [
            WorkerServer(r, make_backend(backend, 0), self._connector(r), collective_timeout) for r in range(n)
        ]
        self.devices = [s.backend.info() for s in self.servers]
        self._threads = [threading.Thread(target=self._serve, args=(r,), daemon=True) for r in range(n)]
        for t in self._threads:
            t.start()
        replies = self.call_all({r: p.Configure(n, [f"sim:{i}" for i in range(n)], "queue") for r in range(n)}, 10.0)
        self.data_planes = [replies[r].info for r in range(n)]

    def _connector(self, rank: int):
        return lambda configure: QueueComm(rank, self._data)

    def _serve(self, rank: int) -> None:
        server = self.servers[rank]
        while True:
            item = self._inboxes[rank].get()
            if item is None:
                return
            rid = p.request_id(item)
            server.emit = lambda message, rid=rid: self._replies.put((rank, p.encode(message, rid)))
            server.cancelled = self._cancel[rank].is_set
            frames = respond(item, server.handle)
            self._replies.put((rank, frames))

    def call_all(
        self, messages: dict[int, p.Message], timeout: float | None = None, on_message=None, watch=None
    ) -> dict[int, p.Message]:
        """As ProcessCluster.call_all (the same loop: transport/replies.py), reports (Tokens) to
        `on_message` and a `watch` included."""
        for event in self._cancel:
            event.clear()
        for rank, message in messages.items():
            self._inboxes[rank].put(p.encode(message))

        def receive(wait_s: float) -> tuple[int, p.Message] | None:
            try:
                rank, frames = self._replies.get(timeout=wait_s)
            except queue.Empty:
                return None
            return rank, p.decode(frames)[0]

        def cancel(ranks) -> None:
            for rank in ranks:
                self._cancel[rank].set()

        seconds = self.call_timeout if timeout is None else timeout
        return gather_replies(messages, seconds, receive, cancel, on_message, watch, who="simulated devices")

    def abort_peers(self, lost: int, message: str) -> None:
        for q in self._data:
            q.put(p.Abort(lost, -1, "WorkerLost", message))

    def close(self) -> None:
        for q in self._inboxes:
            q.put(None)
        for t in self._threads:
            t.join(5)
