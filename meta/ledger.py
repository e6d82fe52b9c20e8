"""The coordinator's ledger of what the workers are owed: the tensors whose handles were collected
(their storage is freed with the next message that runs, never with one of its own), the
programs that live captured steps pin (never evicted), and the run ids (each run's, never given
twice). One object that MetaDevice and its parts (placement, captured steps, generation) share
through its methods, where each reached into the device's private lists.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable


class Ledger:
    def __init__(self) -> None:
        self._released: list[int] = []
        self._pinned: set[int] = set()
        self._runs = itertools.count(1)
        # No lock: a handle's finalizer appends from whichever thread the collector runs in, and
        # may run inside any of these methods (a collection started by their own allocation), so
        # a lock would deadlock there. Each method is one list operation or a swap, which the
        # GIL keeps whole; an append that lands between a swap's read and its write goes to the
        # list handed out, and one after `pending` stays past the `count` that `sent` drops.

    # -- storage to free ----------------------------------------------------------------------------

    def release(self, tensors: Iterable[int]) -> None:
        """Free these tensors' storage with the next message that runs."""
        self._released.extend(tensors)

    def release_one(self, tensor: int) -> None:
        """release([tensor]): what a handle's finalizer calls."""
        self._released.append(tensor)

    def take(self) -> list[int]:
        """The tensors to free, now handed to a message that will free them."""
        released, self._released = self._released, []
        return released

    def pending(self) -> list[int]:
        """The tensors to free, left in the ledger until `sent` says a message took them."""
        return list(self._released)

    def sent(self, count: int) -> None:
        """The first `count` of `pending()` went with a message."""
        del self._released[:count]

    # -- programs ----------------------------------------------------------------------------------

    def pin(self, program: int, owner: object) -> None:
        """Keep `program` loaded while `owner` (a captured step) lives."""
        self._pinned.add(program)
        weakref.finalize(owner, self._pinned.discard, program)

    def pinned(self, program: int) -> bool:
        return program in self._pinned

    # -- run ids ------------------------------------------------------------------------------------

    def next_run(self) -> int:
        return next(self._runs)

    def reserve_runs(self, count: int) -> int:
        """The first of `count` consecutive run ids, none of them given out again (a worker-driven
        generation's steps each take one)."""
        first = next(self._runs)
        self._runs = itertools.count(first + count)
        return first
