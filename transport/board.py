"""The token board: how rank 0 hands a worker-driven generation's tokens to a coordinator on its
host without a message per report.

A ZeroMQ message wakes three threads (the sender's I/O thread, the receiver's I/O thread and its
reader); on a 2-core machine whose cores both decode, each wake takes a time slice from a worker,
and a report cost rank 0 0.12-0.33 ms of every token (measured on a 2-vCPU VM). On the board rank 0 only
stores: each step's tokens into a ring in shared memory, then the count of steps published. The
coordinator reads the board whenever it wakes anyway (its poll of the control socket, every
`report_s`), and writes the count it has taken, and a cancel word that rank 0 reads before each
step. A rank 0 on another host cannot map the file (or finds another host's id in it) and reports
in Tokens messages instead; the coordinator reads both, by step number.

Ordering is the shared-memory rings' (transport/shm.py): one writer per word, aligned 8-byte
stores, data before the count that publishes it, which total store order (x86-64, `supported()`)
keeps in that order for the reader.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from split_state.errors import TransportError
from transport.deadline import Deadline
from transport.shm import create_mapped, host_id, map_existing, shm_root, supported

__all__ = ["TokenBoard", "supported"]

MAGIC = b"METATPB1"
HEADER = struct.Struct("<8sQQ64s")  # magic, tokens per step, capacity in steps, host id
PUBLISHED, TAKEN, CANCEL = 128, 192, 256  # one 8-byte word per cache line, each with one writer
_TAKEN, _CANCEL = (TAKEN - PUBLISHED) // 8, (CANCEL - PUBLISHED) // 8  # their indices in the words from PUBLISHED
DATA = 320  # int32 tokens, `per_step` for each step, a ring of `capacity` steps
MAX_TOKENS = 1 << 16  # the ring's size in tokens at most (256 KiB): the coordinator takes them every report_s
FULL_WAIT_S = 0.001  # a full ring: rank 0 looks again after this long (the coordinator is behind)


class TokenBoard:
    def __init__(self, path: Path, buffer: mmap.mmap, per_step: int, capacity: int, owner: bool):
        self.path, self.buffer, self.per_step, self.capacity, self.owner = path, buffer, per_step, capacity, owner
        self._words = np.frombuffer(buffer, np.int64, (DATA - PUBLISHED) // 8, PUBLISHED)
        self._tokens = np.frombuffer(buffer, np.int32, per_step * capacity, DATA).reshape(capacity, per_step)
        self._published = 0  # rank 0's copy of its own word: read back from memory costs more
        self.taken = 0  # the coordinator's: steps taken so far

    # -- the coordinator --------------------------------------------------------------------------

    @classmethod
    def create(cls, per_step: int, steps: int) -> TokenBoard:
        """A board for a generation of `steps` steps of `per_step` tokens, in a file of its own
        (unlinked by `close`)."""
        if per_step < 1 or steps < 1:
            raise TransportError(f"a token board needs a token and a step at least, got {per_step} x {steps}")
        capacity = max(1, min(steps, MAX_TOKENS // per_step))
        size = DATA + 4 * per_step * capacity
        path = shm_root() / f"meta-tp-board-{os.getpid()}-{secrets.token_hex(6)}"
        buffer = create_mapped(path, size, "a token board at")
        buffer[: HEADER.size] = HEADER.pack(MAGIC, per_step, capacity, host_id())
        return cls(path, buffer, per_step, capacity, owner=True)

    def take(self) -> tuple[int, list[list[int]]]:
        """The steps published since the last take: (the first one's number, their tokens)."""
        first, published = self.taken, int(self._words[0])
        if published <= first:
            return first, []
        steps = [self._tokens[s % self.capacity].tolist() for s in range(first, published)]
        self.taken = published
        self._words[_TAKEN] = published  # after the copies: rank 0 may now overwrite them
        return first, steps

    def cancel(self) -> None:
        self._words[_CANCEL] = 1

    # -- rank 0 ---------------------------------------------------------------------------------------

    @classmethod
    def attach(cls, path: str, per_step: int) -> TokenBoard:
        """Rank 0's view of the coordinator's board; TransportError where it cannot be one (another
        host, another generation's size, not a board)."""
        buffer = map_existing(path, DATA, "a token board")
        size = len(buffer)
        magic, tokens, capacity, host = HEADER.unpack_from(buffer)
        host = host.rstrip(b"\0")
        why = ""
        if magic != MAGIC or size != DATA + 4 * tokens * capacity:
            why = f"not a token board (magic {magic!r}, {size} bytes)"
        elif tokens != per_step:
            why = f"a board for {tokens} tokens a step, not {per_step}"
        elif host != host_id():  # a /tmp shared between machines is not shared memory
            why = f"a board of host {host!r}, not this one"
        if why:
            buffer.close()
            raise TransportError(f"{path}: {why}")
        return cls(Path(path), buffer, per_step, capacity, owner=False)

    def publish(self, chosen: Sequence[int], timeout: float) -> None:
        """One step's tokens; waits while the ring is full (the coordinator takes them every
        report_s), for `timeout` seconds at most."""
        at = self._published
        if at - int(self._words[_TAKEN]) >= self.capacity:
            deadline = Deadline(timeout)
            while at - int(self._words[_TAKEN]) >= self.capacity:
                if deadline.expired():
                    raise TransportError(f"the coordinator took no tokens from the board for {timeout:.1f} s")
                time.sleep(FULL_WAIT_S)
        self._tokens[at % self.capacity] = chosen
        self._published = at + 1
        self._words[0] = at + 1  # after the tokens: publishes them

    def is_cancelled(self) -> bool:
        return bool(self._words[_CANCEL])

    def close(self) -> None:
        del self._words, self._tokens  # the views, or the mapping cannot close
        self.buffer.close()
        if self.owner:
            self.path.unlink(missing_ok=True)
