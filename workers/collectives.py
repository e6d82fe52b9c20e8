"""Collectives between workers, derived from split_state's transfer plans.

Every transition of split_state.transitions runs here on real devices: the same plans the host
reference uses, so they cannot disagree. Reductions are done by the owner of each box in rank
order; every device then receives the owner's bits, so Mirrored results are bitwise identical.
"""

from __future__ import annotations

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
            return self._reduce(local, reduce_plan(dst, shape, n), local_shape(dst, shape, n, r), run, step, deadline)
        if kind is Collective.ALL_REDUCE:
            return self._all_reduce(local, run, step, deadline)
        plan = exchange_plan(src, dst, shape, n)
        return self._exchange(local, plan, local_shape(dst, shape, n, r), run, step, deadline)

    # -- building blocks ------------------------------------------------------------------------

    def _send_mine(self, local: Any, plan: list[Transfer], run: int, step: int) -> None:
        for t in plan:
            if t.src == self.comm.rank and t.dst != self.comm.rank:
                self.comm.send(t.dst, run, step, self.backend.to_host(local[t.src_box]))

    def _take(self, local: Any, t: Transfer, run: int, step: int, deadline: Deadline) -> Any:
        if t.src == self.comm.rank:
            return local[t.src_box]
        return self.backend.to_device(self.comm.recv(t.src, run, step, deadline))

    def _exchange(self, local, plan, out_shape, run, step, deadline):
        self._send_mine(local, plan, run, step)  # sends never block: the peer's inbox queues them
        out = self.xp.empty(out_shape, dtype=local.dtype)
        for t in plan:
            if t.dst == self.comm.rank:
                out[t.dst_box] = self._take(local, t, run, step, deadline)
        return out

    def _reduce(self, local, plan, out_shape, run, step, deadline):
        self._send_mine(local, plan, run, step)
        out = self.xp.empty(out_shape, dtype=local.dtype)
        acc = None
        for t in plan:  # grouped by destination box, contributions in rank order
            if t.dst != self.comm.rank:
                continue
            part = self._take(local, t, run, step, deadline)
            if t.src == 0:
                acc = part.copy()
            else:
                acc += part
            if t.src == self.comm.size - 1:
                out[t.dst_box] = acc
        return out

    def _all_reduce(self, local, run, step, deadline):
        n = self.comm.size
        flat = self.xp.ascontiguousarray(local).reshape(-1)
        if n == 2 or flat.nbytes <= DIRECT_ALL_REDUCE_BYTES:
            # every device reduces the whole tensor in rank order: same bits everywhere, one round
            everyone = [Transfer(d, e, (slice(None),), (slice(None),)) for e in range(n) for d in range(n)]
            out = self._reduce(flat, everyone, flat.shape, run, step, deadline)
        else:
            chunks = flat_split(flat.size, n)
            mine = self._reduce(
                flat,
                reduce_plan(chunks, flat.shape, n),
                local_shape(chunks, flat.shape, n, self.comm.rank),
                run,
                step,
                deadline,
            )
            out = self._exchange(mine, exchange_plan(chunks, MIRRORED, flat.shape, n), flat.shape, run, step, deadline)
        return out.reshape(local.shape)
