"""The one reply loop of both clusters (transport/replies.py), driven by a scripted `receive`:
replies gathered by rank, reports to on_message with the deadline restarted by each, a refused
report cancelling its worker, Ctrl-C cancelling everyone and waiting a short grace for the
replies, a silent worker named in DeadlineExceeded."""

from __future__ import annotations

import time

import pytest

from split_state.errors import DeadlineExceeded
from transport import protocol as p
from transport import replies
from transport.replies import gather_replies

pytestmark = pytest.mark.timeout(30)


def scripted(*events):
    """receive(): each event in turn (a (rank, message), None for a silent wait, or an exception
    to raise), then silence."""
    queue = list(events)

    def receive(wait_s: float):
        if not queue:
            time.sleep(min(wait_s, 0.01))
            return None
        event = queue.pop(0)
        if isinstance(event, BaseException):
            raise event
        return event

    return receive


def test_replies_by_rank_reports_to_on_message_and_a_refusal_cancels_that_worker():
    cancelled, seen = [], []
    receive = scripted(
        (0, p.Tokens(0, [[5]])),
        (1, p.Ok({"a": 1})),
        (7, p.Ok({})),  # a rank not asked
        (0, p.Tokens(1, [[6]])),  # refused: rank 0 is cancelled
        (0, p.Tokens(2, [[7]])),  # after the cancel: handed over all the same, its answer not asked
        (0, p.Ok({"b": 2})),
        (1, p.Ok({"late": True})),  # after rank 1's reply: dropped
    )

    def on_message(rank, message):
        seen.append((rank, message.step))
        return message.step == 0

    got = gather_replies([0, 1], 5.0, receive, cancelled.append, on_message)
    assert got == {0: p.Ok({"b": 2}), 1: p.Ok({"a": 1})}
    assert seen == [(0, 0), (0, 1), (0, 2)] and cancelled == [[0]]  # one Cancel


def test_ctrl_c_cancels_everyone_waits_a_grace_for_the_replies_then_raises_it(monkeypatch):
    monkeypatch.setattr(replies, "CANCEL_GRACE_S", 0.3)
    cancelled = []
    receive = scripted(KeyboardInterrupt(), (0, p.Ok({})), (1, p.Ok({})))
    with pytest.raises(KeyboardInterrupt):
        gather_replies([0, 1], 60.0, receive, cancelled.append, on_message=lambda r, m: True)
    assert cancelled == [[0, 1]]
    # replies that never come after Ctrl-C: the grace, not the call's minute, bounds the wait
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"\[0, 1\] did not answer within 0.3 s"):
        gather_replies([0, 1], 60.0, scripted(KeyboardInterrupt()), cancelled.append, on_message=lambda r, m: True)
    assert time.monotonic() - start < 5


def test_each_report_restarts_the_deadline_and_silence_names_the_missing_worker():
    reports = [None] * 3 + [(0, p.Tokens(k, [[k]])) for k in range(4)]
    got = []

    def receive(wait_s):
        time.sleep(0.1)
        return reports.pop(0) if reports else None

    with pytest.raises(DeadlineExceeded, match=r"workers \[0\] did not answer"):
        gather_replies([0], 0.35, receive, lambda ranks: None, lambda r, m: got.append(m.step) or True)
    assert got == [0, 1, 2, 3]  # 0.7 s of reports under a 0.35 s deadline: each restarted it
