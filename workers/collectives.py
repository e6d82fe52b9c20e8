"""Collectives between workers, derived from split_state's transfer plans.

Every transition of split_state.transitions runs here on real devices: the same plans the host
reference uses, so they cannot disagree. Reductions are done by the owner of each box in rank
order; every device then receives the owner's bits, so Mirrored results are bitwise identical.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from split_state.layout import local_shape, pieces
from split_state.states import MIRRORED, State
from split_state.transitions import (
    Collective,
    Transfer,
    classify,
    embed_partial,
    exchange_plan,
    flat_split,
    reduce_plan,
)
from transport.deadline import Deadline

DIRECT_ALL_REDUCE_BYTES = 64 << 10  # below this (or with 2 workers) one exchange beats two phases

# Plans depend only on states, shape and world size: a program repeats them on every run.
_exchange_plan = functools.lru_cache(maxsize=4096)(exchange_plan)
_reduce_plan = functools.lru_cache(maxsize=4096)(reduce_plan)


@functools.lru_cache(maxsize=64)
def _everyone_plan(n: int) -> list[Transfer]:
    """Direct all-reduce of a flat tensor: every device sends all of it to every device."""
    return [Transfer(d, e, (slice(None),), (slice(None),)) for e in range(n) for d in range(n)]


class Collectives:
    def __init__(self, comm, backend):
        self.comm, self.backend, self.xp = comm, backend, backend.xp

    def redistribute(
        self, local: Any, src: State, dst: State, shape: Sequence[int], run: int, step: int, deadline: Deadline
    ) -> Any:
        shape = tuple(shape)
        n, r = self.comm.size, self.comm.rank
        kind = classify(src, dst)
        if kind is Collective.NONE:
            return local
        if kind is Collective.LOCAL_EMBED:
            return embed_partial(local, src, shape, n, r, self.xp)
        if kind is Collective.LOCAL_SLICE:
            out = self.xp.empty(local_shape(dst, shape, n, r), dtype=local.dtype)
            for p in pieces(dst, shape, n, r):
                out[p.local_index(len(shape))] = local[p.global_index(len(shape))]
            return out
        if kind is Collective.REDUCE_SCATTER:
            return self._reduce(local, _reduce_plan(dst, shape, n), local_shape(dst, shape, n, r), run, step, deadline)
        if kind is Collective.ALL_REDUCE:
            return self._all_reduce(local, run, step, deadline)
        plan = _exchange_plan(src, dst, shape, n)
        return self._exchange(local, plan, local_shape(dst, shape, n, r), run, step, deadline)

    # -- building blocks ------------------------------------------------------------------------

    def _send_mine(self, local: Any, plan: list[Transfer], run: int, step: int) -> None:
        for t in plan:
            if t.src == self.comm.rank and t.dst != self.comm.rank:
                self.comm.send(t.dst, run, step, self.backend.to_host(local[t.src_box]))

    def _receive(self, t: Transfer, target: Any, run: int, step: int, deadline: Deadline, combine) -> None:
        """Stream transfer `t` into the contiguous array `target`: combine(flat part, fragment)."""
        flat = target.reshape(-1)
        to_device = self.backend.to_device

        def sink(at: int, fragment: Any) -> None:
            combine(flat[at : at + fragment.size], to_device(fragment), at)

        self.comm.receive(t.src, run, step, deadline, target.shape, target.dtype, sink)

    def _exchange(self, local, plan, out_shape, run, step, deadline):
        self._send_mine(local, plan, run, step)  # queued, never blocking: receives below drain them
        out = self.xp.empty(out_shape, dtype=local.dtype)
        for t in plan:
            if t.dst != self.comm.rank:
                continue
            if t.src == self.comm.rank:
                out[t.dst_box] = local[t.src_box]
                continue
            target = out[t.dst_box]
            if target.flags.c_contiguous:  # straight into place
                self._receive(t, target, run, step, deadline, _assign)
            else:
                staged = self.xp.empty(target.shape, dtype=target.dtype)
                self._receive(t, staged, run, step, deadline, _assign)
                out[t.dst_box] = staged
        self.comm.flush(run, deadline)
        return out

    def _reduce(self, local, plan, out_shape, run, step, deadline):
        """Sum every device's contribution to each box this device owns, in rank order, adding
        remote contributions as their bytes arrive. The first two are added in one pass (a + b
        is b + a bit for bit), so every owner does the same arithmetic whatever its rank."""
        self._send_mine(local, plan, run, step)
        rank, n, xp = self.comm.rank, self.comm.size, self.xp
        out = None
        for at in range(0, len(plan), n):
            group = plan[at : at + n]  # one destination box, contributions from ranks 0 .. n-1
            if group[0].dst != rank:
                continue
            mine = local[group[rank].src_box]
            if n == 1:
                total = mine.copy()
            else:
                total = xp.empty(mine.shape, local.dtype)
                if rank < 2:
                    first = xp.ascontiguousarray(mine).reshape(-1)
                    self._receive(group[1 - rank], total, run, step, deadline, _added_to(first, xp))
                else:
                    self._receive(group[0], total, run, step, deadline, _assign)
                    self._receive(group[1], total, run, step, deadline, _add)
                for t in group[2:]:
                    if t.src == rank:
                        total += mine
                    else:
                        self._receive(t, total, run, step, deadline, _add)
            box = group[0].dst_box
            if out is None and total.shape == tuple(out_shape):
                out = total  # the whole result is this one box: no copy into place
            else:
                if out is None:
                    out = xp.empty(out_shape, dtype=local.dtype)
                out[box] = total
        self.comm.flush(run, deadline)
        return xp.empty(out_shape, dtype=local.dtype) if out is None else out

    def _all_reduce(self, local, run, step, deadline):
        n = self.comm.size
        flat = self.xp.ascontiguousarray(local).reshape(-1)
        if n == 2 or flat.nbytes <= DIRECT_ALL_REDUCE_BYTES:
            # every device reduces the whole tensor in rank order: same bits everywhere, one round
            out = self._reduce(flat, _everyone_plan(n), flat.shape, run, step, deadline)
        else:
            chunks = flat_split(flat.size, n)
            mine = self._reduce(
                flat,
                _reduce_plan(chunks, flat.shape, n),
                local_shape(chunks, flat.shape, n, self.comm.rank),
                run,
                step,
                deadline,
            )
            out = self._exchange(mine, _exchange_plan(chunks, MIRRORED, flat.shape, n), flat.shape, run, step, deadline)
        return out.reshape(local.shape)


def _assign(part: Any, fragment: Any, at: int) -> None:
    part[...] = fragment


def _add(part: Any, fragment: Any, at: int) -> None:
    part += fragment


def _added_to(first: Any, xp: Any):
    """Combine: the sum of this device's contribution `first` (flat) and the arriving one."""

    def combine(part: Any, fragment: Any, at: int) -> None:
        xp.add(first[at : at + part.size], fragment, out=part)

    return combine
