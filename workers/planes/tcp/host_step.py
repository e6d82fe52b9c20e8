"""The shared-memory step of the tcp plane's host-by-host small all-reduce.

Where a cluster's workers sit on several hosts and some host holds several of them, each worker
sends its contribution to one worker of each other host over TCP, posts its own and those sent
to it for its host-mates, reads theirs, and adds them all (engine.py `_hierarchical_all_reduce`).
The posts go in postboxes as the shm plane's small all-reduce uses them (transport/shm.py
`Postbox`), with slots of as many contributions as a post of the host holds: each worker posts
into a file of its own and its mates read the post where it lies. Each worker posts once an
all-reduce and posts the next only after reading every mate's post of this one, which each made
only after reading its own previous one: so no post is written over before every mate has read
it (the postbox's two-slot rule).

Who reads a worker's posts is whom it wakes: every host-mate. So a worker maps its mates' files,
and rings their bells (the futex word of transport/shm.py's `InboxFile`) when they sleep
waiting for it.

Whether shared memory serves a host is agreed when the plane connects (engine.py
`_agree_on_host_step`): every worker of the host maps every mate's file; a file that cannot be
made or mapped (a /dev/shm not shared between them, another user's file) leaves that host's
step on TCP.
"""

from __future__ import annotations

import numpy as np

from split_state.errors import ProtocolError, TransportError
from transport.shm import LINE, POST_BYTES, InboxFile, Postbox, fence, host_box_path

BOX_CAPACITY = 1 << 18  # the smallest ring area: two postbox slots of one contribution fit (transport/shm.py)


def box_capacity(rows: int) -> int:
    """The ring area whose two postbox slots each hold `rows` contributions of up to POST_BYTES:
    BOX_CAPACITY, or the power of two above that."""
    need = Postbox.SLOTS * (LINE + rows * POST_BYTES)
    return max(BOX_CAPACITY, 1 << (need - 1).bit_length())


class HostBoxes:
    """This worker's postbox for its host's step, and the files of those whose posts it reads.
    `members`: the host's ranks in order; `rows`: the most contributions a post of the host
    holds (a worker's own and those it relays from other hosts), which sizes every slot."""

    def __init__(self, session: str, rank: int, members: tuple[int, ...], rows: int = 1):
        self.session, self.rank, self.members, self.slot_bytes = session, rank, members, rows * POST_BYTES
        self.index = members.index(rank)  # this worker's in its host: what its sleepers wait for
        self.own = InboxFile.create(host_box_path(session, rank), 1, box_capacity(rows))
        self.box = self.own.postbox(0, self.slot_bytes)
        self.files: dict[int, InboxFile] = {}  # the workers whose posts this one reads
        self._turn = 0  # the slot this worker's next post writes

    def attach(self) -> bool:
        """Map the files this worker reads (every host-mate's); False where one cannot be mapped."""
        wanted = [q for q in self.members if q != self.rank]
        try:
            for q in wanted:
                self.files[q] = InboxFile.attach(host_box_path(self.session, q), 1)
                self.files[q].postbox(0, self.slot_bytes)
        except (TransportError, ProtocolError):  # not shared here, or a file of other slots
            return False
        return True

    def slots(self, q: int, dtype: np.dtype, size: int) -> list[np.ndarray]:
        """Worker q's postbox slots (this worker's own, or one it reads) as `size` elements of
        `dtype`, views of the shared memory."""
        box = self.box if q == self.rank else self.files[q].postbox(0)
        return [box.array(k, dtype, size) for k in range(Postbox.SLOTS)]

    def post(self, flat: np.ndarray, stamp: int, own_slots: list[np.ndarray]) -> None:
        """Publish `flat` under `stamp` and wake whoever sleeps waiting for it."""
        k = self._turn
        self._turn = k ^ 1
        np.copyto(own_slots[k], flat)
        self.box.publish(k, stamp)
        fence()  # the stamp before the look at the sleeper's word (transport/shm.py on why)
        for file in self.files.values():
            if file.waits_for(self.index):
                file.ring()

    def find(self, q: int, stamp: int) -> int:
        """The slot of q's postbox holding `stamp`, or -1 while none does."""
        return self.files[q].postbox(0).find(stamp)

    def sleep(self, q: int, stamp: int, seconds: float) -> None:
        """Sleep until q rings (it does after posting) or `seconds` pass, unless its post of
        `stamp` is there already."""
        self.own.sleep(self.members.index(q) + 1, lambda: self.find(q, stamp) >= 0, seconds)

    def check(self, q: int, slot: int, stamp: int) -> None:
        """After reading q's post: it was not written over meanwhile (which the two-slot rule
        rules out unless a worker broke it)."""
        if not self.files[q].postbox(0).holds(slot, stamp):
            raise ProtocolError(f"worker {self.rank}: worker {q}'s host post changed as it was read")

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files = {}
        self.own.close()
