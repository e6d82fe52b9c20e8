"""An in-process cluster: N simulated devices, each a WorkerServer on its own thread.

Messages still go through the protocol's encode/decode, and collectives through the same code
over in-process queues, so a simulated run gives the same bits as real worker processes.
"""

from __future__ import annotations

import queue
import threading

from split_state.errors import DeadlineExceeded
from transport import protocol as p
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
            frames = respond(item, server.handle)
            self._replies.put((rank, frames))

    def call_all(self, messages: dict[int, p.Message], timeout: float | None = None) -> dict[int, p.Message]:
        timeout = self.call_timeout if timeout is None else timeout
        for rank, message in messages.items():
            self._inboxes[rank].put(p.encode(message))
        replies = {}
        while len(replies) < len(messages):
            try:
                rank, frames = self._replies.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(messages) - set(replies))
                raise DeadlineExceeded(f"simulated devices {missing} did not answer within {timeout} s") from None
            replies[rank] = p.decode(frames)[0]
        return replies

    def abort_peers(self, lost: int, message: str) -> None:
        for q in self._data:
            q.put(p.Abort(lost, -1, "WorkerLost", message))

    def close(self) -> None:
        for q in self._inboxes:
            q.put(None)
        for t in self._threads:
            t.join(5)
