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


class CountingTokenizer(BytesTokenizer):
    """BytesTokenizer over pieces of a long text, counting the tokens it decodes."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces, self.decoded = pieces, 0

    def decode(self, ids, skip_special=False, continuation=False) -> str:
        self.decoded += len(ids)
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_a_long_stream_shows_the_whole_texts_characters_decoding_each_token_a_bounded_number_of_times():
    """2,000 tokens of text whose characters (2 to 4 bytes) are cut anywhere between tokens:
    the pieces shown are the text's, whole characters each, and the tokens decoded over the
    stream grow with its length, not with its square (the settled text is decoded once)."""
    text = "".join("é世🙂a "[i % 5] for i in range(1500)).encode()
    cuts = [0]
    while cuts[-1] < len(text):
        cuts.append(min(len(text), cuts[-1] + 1 + (cuts[-1] * 7919) % 3))
    pieces = {i: text[a:b] for i, (a, b) in enumerate(zip(cuts, cuts[1:]))}
    tokenizer = CountingTokenizer(pieces)
    stream = TextStream(tokenizer)
    shown = [stream.push(i) for i in range(len(pieces))] + [stream.finish()]
    assert len(pieces) > 1000
    assert "".join(shown) == text.decode()
    assert all("\ufffd" not in piece for piece in shown)
    assert tokenizer.decoded < 20 * len(pieces)  # every token again at every push: ~len(pieces) ** 2 / 2


def test_a_models_tokens_pushed_one_by_one_show_the_text_it_decodes_them_to():
    """SmolLM2's tokenizer (byte-level BPE) on text in several scripts, longer than the settled
    window many times over: the pieces shown make its decoding of every token at once."""
    from models.gguf_model import GGUFModel

    tokenizer = GGUFModel().tokenizer
    ids = tokenizer.encode("Ünïcödé  text, 日本語のテキスト, emoji 🙂🚀 and\n\tspaces   here. " * 20)
    stream = TextStream(tokenizer)
    shown = "".join([stream.push(i) for i in ids] + [stream.finish()])
    assert shown == tokenizer.decode(ids, continuation=True)
