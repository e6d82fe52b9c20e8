"""The coordinator's wait for the replies to one request sent to several workers: one loop for
every cluster (meta/cluster.py's processes, workers/simulator.py's threads), which differ only in
how a message arrives (`receive`) and how a worker is told to cancel (`cancel`).

Reports a worker sends before its reply (Tokens) go to `on_message` as they come and each
restarts the deadline; when it returns False, or on Ctrl-C, the workers are sent a Cancel and
their replies are still awaited (after Ctrl-C for at most CANCEL_GRACE_S), so they stay usable.
A `watch` is looked at whenever the loop wakes, for reports that come another way (a
generation's token board), every `every_ms` at least.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from split_state.errors import DeadlineExceeded
from transport import protocol as p
from transport.deadline import Deadline

CANCEL_GRACE_S = 30.0  # after Ctrl-C, how long a cancelled request may take to answer

OnMessage = Callable[[int, p.Message], bool]  # a report from a worker; False: cancel


@dataclass(frozen=True)
class Watch:
    """What a call looks at whenever it wakes, besides its messages: reports that come another
    way (a generation's token board, transport/board.py), every `every_ms` at least."""

    every_ms: int
    # show: False once the call is cancelled (what comes then is taken, not shown); returns None:
    # nothing new; True: shown (the workers are making progress); False: refused, cancel
    look: Callable[[bool], bool | None]
    cancel: Callable[[], None]  # told when the call sends its Cancels


def gather_replies(
    ranks: Collection[int],
    seconds: float,
    receive: Callable[[float], tuple[int, p.Message] | None],
    cancel: Callable[[Collection[int]], None],
    on_message: OnMessage | None = None,
    watch: Watch | None = None,
    poll_s: float | None = None,
    check: Callable[[], None] = lambda: None,
    who: str = "workers",
) -> dict[int, p.Message]:
    """Every rank's reply. `receive(wait_s)`: the next (rank, message) of this request, or None
    when none came within wait_s; `cancel(ranks)`: send them a Cancel; `check()`: raise where the
    cluster cannot answer any more (a worker that exited); `poll_s`: the longest wait between
    checks (None: the deadline's). Raises DeadlineExceeded naming the silent ranks."""
    replies: dict[int, p.Message] = {}
    interrupted: KeyboardInterrupt | None = None
    cancelled = False
    deadline = Deadline(seconds)
    waits = [w for w in (poll_s, None if watch is None else max(1, watch.every_ms) / 1000) if w is not None]

    def cancel_all(which: Collection[int]) -> None:
        nonlocal cancelled
        cancelled = True
        cancel(which)
        if watch is not None:
            watch.cancel()

    while len(replies) < len(ranks):
        try:
            check()
            if watch is not None:
                seen = watch.look(not cancelled)
                if seen is not None:
                    deadline = Deadline(seconds)
                if seen is False and not cancelled:
                    cancel_all(ranks)
            if deadline.expired():
                missing = sorted(set(ranks) - set(replies))
                raise DeadlineExceeded(f"{who} {missing} did not answer within {deadline.seconds:.1f} s")
            got = receive(min([*waits, deadline.remaining()]))
            if got is None:
                continue
            rank, message = got
            if rank not in ranks or rank in replies:
                continue  # not asked, or after this worker's reply (the Ok of a late Cancel)
            if isinstance(message, p.Tokens) and on_message is not None:
                deadline = Deadline(seconds)
                # after the Cancel left, reports of the steps already under way are still handed
                # over (a caller may want every step the workers ran), their answer not asked
                if not on_message(rank, message) and not cancelled:
                    cancel_all([rank])
                continue
            replies[rank] = message
        except KeyboardInterrupt as exc:
            if (on_message is None and watch is None) or interrupted is not None:
                raise
            interrupted = exc
            cancel_all(ranks)
            deadline = Deadline(min(seconds, CANCEL_GRACE_S))
    if interrupted is not None:
        raise interrupted
    return replies
