"""`cupy.cuda.nccl` for the stand-in: communicators between processes over Unix sockets.

As NCCL: every call is issued to a stream (by its pointer) and runs there in order; an
all-reduce gives every rank the same bits (here: the rank-order sum); grouped sends and receives
are posted together, so a group whose sends and receives pair up across ranks never deadlocks;
pointers name device memory (the stand-in's allocations, found by address); abort() ends what
waits. The unique id carries the folder where the ranks meet.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import tempfile
import threading
import time

import numpy as np

from tests.cupy_standin import runtime as rt

DTYPES = {
    0: np.int8,
    1: np.uint8,
    2: np.int32,
    3: np.uint32,
    4: np.int64,
    5: np.uint64,
    6: np.float16,
    7: np.float32,
    8: np.float64,
}
NCCL_SUM = 0
ID_BYTES = 128
DEADLINE_S = 60.0
available = True


class NcclError(RuntimeError):
    pass


def get_version() -> int:
    return 22000  # 2.20


def get_unique_id() -> tuple[int, ...]:
    folder = tempfile.mkdtemp(prefix="nccl-").encode()
    if len(folder) >= ID_BYTES:
        raise NcclError("the temporary folder's path is too long for a unique id")
    raw = folder.ljust(ID_BYTES, b"\0")
    return struct.unpack(f"{ID_BYTES}b", raw)


_group: list[list] = []  # the calls of the open group (groupStart nests, as NCCL's)


def groupStart() -> None:  # noqa: N802 - NCCL's name
    _group.append([])


def groupEnd() -> None:  # noqa: N802
    calls = _group.pop()
    if _group:
        _group[-1].extend(calls)
        return
    by_stream: dict[int, list] = {}
    for call in calls:
        by_stream.setdefault(call[0], []).append(call)
    for stream_ptr, group in by_stream.items():
        _issue_group(stream_ptr, group)


def _issue_group(stream_ptr: int, calls: list) -> None:
    comm = calls[0][1]
    sends = [(array, peer) for _, _, kind, array, peer in calls if kind == "send"]
    recvs = [(array, peer) for _, _, kind, array, peer in calls if kind == "recv"]

    def run() -> None:
        for array, peer in sends:  # never blocks for long: the peer's reader drains its socket
            comm._send(peer, array.tobytes())
        for array, peer in recvs:
            array[...] = np.frombuffer(comm._receive(peer, array.nbytes), array.dtype).reshape(array.shape)

    rt.stream_at(stream_ptr).issue(
        run, reads=[a for a, _ in sends], writes=[a for a, _ in recvs], what=f"NCCL group of rank {comm.rank}"
    )


class NcclCommunicator:
    def __init__(self, ndev: int, commId, rank: int):
        self.size, self.rank = ndev, rank
        self.folder = bytes(struct.pack(f"{ID_BYTES}b", *commId)).rstrip(b"\0").decode()
        self.aborted = False
        self.inbox = {peer: queue.Queue() for peer in range(ndev) if peer != rank}
        self.outgoing: dict[int, socket.socket] = {}
        self.incoming: list[socket.socket] = []
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(self.folder, f"rank{rank}"))
        listener.listen(ndev)
        deadline = time.monotonic() + DEADLINE_S
        for peer in self.inbox:
            path = os.path.join(self.folder, f"rank{peer}")
            while True:
                try:
                    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    out.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    out.close()
                    if time.monotonic() > deadline:
                        raise NcclError(f"rank {peer} never joined the communicator") from None
                    time.sleep(0.01)
            out.sendall(struct.pack("<i", rank))
            self.outgoing[peer] = out
        listener.settimeout(DEADLINE_S)
        for _ in self.inbox:
            conn, _ = listener.accept()
            peer = struct.unpack("<i", _exactly(conn, 4))[0]
            self.incoming.append(conn)
            threading.Thread(target=self._read, args=(conn, peer), daemon=True).start()
        listener.close()
        os.unlink(os.path.join(self.folder, f"rank{rank}"))  # every peer is connected

    def _read(self, conn: socket.socket, peer: int) -> None:
        try:
            while True:
                (length,) = struct.unpack("<q", _exactly(conn, 8))
                self.inbox[peer].put(_exactly(conn, length))
        except OSError:
            self.inbox[peer].put(None)  # closed: whoever waits learns it

    def _send(self, peer: int, data: bytes) -> None:
        if self.aborted:
            raise NcclError("the communicator was aborted")
        self.outgoing[peer].sendall(struct.pack("<q", len(data)) + data)

    def _receive(self, peer: int, nbytes: int) -> bytes:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            if self.aborted:
                raise NcclError("the communicator was aborted")
            try:
                data = self.inbox[peer].get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise NcclError(f"rank {peer} sent nothing within {DEADLINE_S} s") from None
                continue
            if data is None:
                raise NcclError(f"rank {peer} closed its connection")
            if len(data) != nbytes:
                raise NcclError(f"rank {peer} sent {len(data)} bytes where {nbytes} were expected")
            return data

    # -- NCCL's calls --------------------------------------------------------------------------------

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        if op != NCCL_SUM:
            raise NcclError(f"the stand-in sums only (op {op})")
        dtype = np.dtype(DTYPES[datatype])
        send, recv = rt.array_at(sendbuf, count, dtype), rt.array_at(recvbuf, count, dtype)

        def run() -> None:
            mine = send.copy()
            for peer in self.inbox:
                self._send(peer, mine.tobytes())
            parts = {self.rank: mine}
            for peer in self.inbox:
                parts[peer] = np.frombuffer(self._receive(peer, mine.nbytes), dtype)
            total = parts[0].copy()
            for r in range(1, self.size):  # rank order: every rank gets the same bits
                total = (total + parts[r]).astype(dtype)
            recv[...] = total

        rt.stream_at(stream).issue(run, reads=[send], writes=[recv], what=f"ncclAllReduce of rank {self.rank}")

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._point(stream, "send", rt.array_at(sendbuf, count, np.dtype(DTYPES[datatype])), peer)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._point(stream, "recv", rt.array_at(recvbuf, count, np.dtype(DTYPES[datatype])), peer)

    def _point(self, stream: int, kind: str, array: np.ndarray, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise NcclError(f"rank {self.rank}: invalid peer {peer}")
        call = (stream, self, kind, array, peer)
        if _group:
            _group[-1].append(call)
        else:
            _issue_group(stream, [call])

    def abort(self) -> None:
        self.aborted = True
        self._close()

    def destroy(self) -> None:
        self._close()
        if self.rank == 0:
            try:
                os.rmdir(self.folder)
            except OSError:
                pass

    def _close(self) -> None:
        for s in [*self.outgoing.values(), *self.incoming]:
            try:
                s.close()
            except OSError:
                pass


def _exactly(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise OSError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
