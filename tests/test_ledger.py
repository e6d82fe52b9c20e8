"""The coordinator's ledger (meta/ledger.py): run ids never given twice, released tensors handed
to exactly one message, programs pinned while their owner lives."""

from __future__ import annotations

import gc

import pytest

from meta.ledger import Ledger

pytestmark = pytest.mark.timeout(30)


def test_reserved_runs_are_never_given_again():
    ledger = Ledger()
    before = ledger.next_run()
    first = ledger.reserve_runs(5)
    after = [ledger.next_run() for _ in range(3)]
    assert before < first and set(range(first, first + 5)).isdisjoint(after + [before])
    assert after == sorted(after) and after[0] == first + 5


def test_released_tensors_go_with_one_message_each():
    ledger = Ledger()
    ledger.release([3, 4])
    ledger.release_one(5)
    pending = ledger.pending()
    ledger.release_one(6)  # arrives while a message is being made: it waits for the next one
    ledger.sent(len(pending))
    assert pending == [3, 4, 5] and ledger.take() == [6] and ledger.take() == []


def test_a_program_is_pinned_while_its_owner_lives():
    class Owner:
        pass

    ledger, owner = Ledger(), Owner()
    ledger.pin(7, owner)
    assert ledger.pinned(7) and not ledger.pinned(8)
    del owner
    gc.collect()
    assert not ledger.pinned(7)
