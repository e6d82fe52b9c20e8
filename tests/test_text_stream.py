"""Streamed text (models/requests.py's TextStream): whole characters only, nothing past a stop
string, and the stop string found earliest in the text wins (whichever is listed first). The
tokenizer here maps each id to bytes of UTF-8, an oracle independent of any model."""

from __future__ import annotations

import pytest

from models.requests import TextStream, stop_string_at

PIECES = {1: b"hel", 2: b"lo ", 3: b"wor", 4: b"ld", 5: "é".encode()[:1], 6: "é".encode()[1:], 7: b"!"}


class BytesTokenizer:
    def decode(self, ids, skip_special=False, continuation=False) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def shown(ids, stop=()) -> list[str]:
    stream = TextStream(BytesTokenizer(), stop=stop)
    return [stream.push(i) for i in ids] + [stream.finish()]


def test_a_character_whose_bytes_are_still_arriving_is_not_shown_early():
    pieces = shown([1, 5, 6, 7])
    assert pieces == ["hel", "", "é", "!", ""]
    assert "\ufffd" not in "".join(pieces)


def test_the_stop_string_earliest_in_the_text_wins_whatever_its_place_in_the_list():
    assert stop_string_at("hello world", ["world", "lo"]) == 3
    assert "".join(shown([1, 2, 3, 4], stop=["world", "lo"])) == "hel"
    assert "".join(shown([1, 2, 3, 4], stop=["lo", "world"])) == "hel"


@pytest.mark.parametrize("stop", [["o w"], ["lo wo"], ["xyz"]])
def test_the_end_that_may_begin_a_stop_string_is_held_back_until_it_cannot(stop):
    pieces = shown([1, 2, 3, 4], stop=stop)
    text = "hello world"
    cut = text.find(stop[0])
    assert "".join(pieces) == (text if cut < 0 else text[:cut])
    seen = ""
    for piece in pieces:  # never a character that a stop string could still take back
        seen += piece
        assert cut < 0 or len(seen) <= cut
