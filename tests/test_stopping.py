"""The one rule for when a sequence ends (models/requests.py Stopping), which LLM.generate and the
server's batcher both keep: each reason on its own, their order where two hold at once, and the
text decoded only where stop strings ask for it."""

from __future__ import annotations

import pytest

from models.requests import Stopping

pytestmark = pytest.mark.timeout(30)


def never_decoded() -> str:
    raise AssertionError("the text was decoded with no stop string to look for")


def test_an_end_token_stops_and_other_tokens_go_on():
    rule = Stopping(frozenset({2, 7}))
    assert rule.reason([5, 7], never_decoded) == "stop"
    assert rule.reason([7, 5], never_decoded) is None  # only the last token counts
    assert Stopping().reason([2], never_decoded) is None  # EOS ignored: no end ids


def test_a_stop_string_in_the_text_stops():
    rule = Stopping(stop_strings=("\n\n", "END"))
    assert rule.reason([1, 2], lambda: "a story\n\nthe") == "stop"
    assert rule.reason([1, 2], lambda: "a story ENDS") == "stop"
    assert rule.reason([1, 2], lambda: "a story EN") is None


def test_max_tokens_and_a_full_context_end_with_length():
    rule = Stopping(max_tokens=3)
    assert rule.reason([1, 1], never_decoded) is None
    assert rule.reason([1, 1, 1], never_decoded) == "length"
    assert Stopping().reason([1] * 100, never_decoded) is None  # no bound: the caller's loop counts
    assert Stopping().reason([1], never_decoded, room=False) == "length"


def test_a_natural_stop_on_the_last_allowed_token_is_a_stop():
    """As OpenAI's API reports it: an end token (or a stop string) that is also the last token
    max_tokens allows finishes with "stop", not "length"."""
    assert Stopping(frozenset({9}), max_tokens=2).reason([4, 9], never_decoded) == "stop"
    assert Stopping(stop_strings=("x",), max_tokens=1).reason([4], lambda: "x") == "stop"
