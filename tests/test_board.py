"""The token board (transport/board.py): what rank 0 publishes the coordinator takes, in order
and once, across the ring's wrap; a full ring waits for the coordinator, within a deadline; a
file that is not this generation's board on this host is refused by name."""

from __future__ import annotations

import threading

import pytest

from split_state.errors import TransportError
from transport import board as b
from transport.board import TokenBoard

pytestmark = [pytest.mark.timeout(30), pytest.mark.skipif(not b.supported(), reason="needs total store order")]


@pytest.fixture
def board():
    made = []

    def make(per_step: int, steps: int) -> TokenBoard:
        made.append(TokenBoard.create(per_step, steps))
        return made[-1]

    yield make
    for one in made:
        one.close()


def test_published_steps_are_taken_in_order_across_the_wrap(board):
    coordinator = board(2, 3)  # a ring of 3 steps
    assert coordinator.capacity == 3
    rank0 = TokenBoard.attach(str(coordinator.path), 2)
    written = [[10 * s, 10 * s + 1] for s in range(8)]
    seen = []
    try:
        assert coordinator.take() == (0, [])
        for s, chosen in enumerate(written):
            rank0.publish(chosen, timeout=1.0)
            if s % 2:  # taken every other step: two steps at a time
                first, steps = coordinator.take()
                assert first == len(seen)
                seen += steps
        seen += coordinator.take()[1]
    finally:
        rank0.close()
    assert seen == written
    assert coordinator.path.exists()  # rank 0's close leaves the coordinator's file


def test_a_full_ring_waits_for_the_coordinator_and_then_goes_on(board):
    coordinator = board(1, 2)
    rank0 = TokenBoard.attach(str(coordinator.path), 1)
    try:
        rank0.publish([1], 1.0)
        rank0.publish([2], 1.0)
        later = threading.Timer(0.2, coordinator.take)
        later.start()
        rank0.publish([3], 5.0)  # waits until the coordinator has taken steps 0 and 1
        later.join()
        assert coordinator.take() == (2, [[3]])
        rank0.publish([4], 1.0)
        rank0.publish([5], 1.0)
        with pytest.raises(TransportError, match="took no tokens"):
            rank0.publish([6], 0.05)  # nobody takes steps 3 and 4: the wait ends at its deadline
        assert coordinator.take() == (3, [[4], [5]])  # the step that timed out was not published
    finally:
        rank0.close()


def test_the_cancel_word_reaches_rank_0(board):
    coordinator = board(1, 4)
    rank0 = TokenBoard.attach(str(coordinator.path), 1)
    try:
        assert not rank0.is_cancelled()
        coordinator.cancel()
        assert rank0.is_cancelled()
    finally:
        rank0.close()


def test_close_removes_the_coordinator_s_file(board):
    coordinator = TokenBoard.create(3, 5)
    path = coordinator.path
    assert path.exists()
    coordinator.close()
    assert not path.exists()


def test_what_is_not_this_generation_s_board_on_this_host_is_refused(board, tmp_path, monkeypatch):
    coordinator = board(2, 4)
    with pytest.raises(TransportError, match="for 2 tokens a step, not 3"):
        TokenBoard.attach(str(coordinator.path), 3)
    with pytest.raises(TransportError, match="cannot open"):
        TokenBoard.attach(str(tmp_path / "missing"), 2)
    stranger = tmp_path / "stranger"
    stranger.write_bytes(b"\0" * 4096)
    with pytest.raises(TransportError, match="not a token board"):
        TokenBoard.attach(str(stranger), 2)
    monkeypatch.setattr(b, "host_id", lambda: b"another-host/boot")
    with pytest.raises(TransportError, match="not this one"):
        TokenBoard.attach(str(coordinator.path), 2)


@pytest.mark.parametrize("per_step, steps", [(0, 4), (2, 0)])
def test_an_empty_board_is_refused(per_step, steps):
    with pytest.raises(TransportError, match="needs a token and a step"):
        TokenBoard.create(per_step, steps)
