"""The text split before BPE, as llama.cpp splits it for the file's `tokenizer.ggml.pre`
(src/llama-vocab.cpp). Each expected split is worked out by hand from llama.cpp's patterns for
that pre-tokenizer (each pattern isolating its matches in the pieces the one before left), with
spaces written as the byte-level alphabet's "Ġ"; the packaged SmolLM2's own ids are checked in
test_llm.py."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from models.gguf_model import GGUFModel, ModelError  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402


class FakeFile(GGUFModel):
    """What Tokenizer.from_gguf reads of a GGUF file: its metadata (read by GGUFModel's own
    typed accessors), no tensors."""

    def __init__(self, pre: str | None):  # no file to open
        self.path = Path("tiny.gguf")
        self.fields = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"],
        }
        if pre is not None:
            self.fields["tokenizer.ggml.pre"] = pre
        self.file = types.SimpleNamespace(fields=self.fields)


def pieces(pre: str | None, text: str) -> list[str]:
    backend = Tokenizer.from_gguf(FakeFile(pre)).backend
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    "pre, text, expected",
    [
        # SmolLM's family: \p{N} first (every digit alone), then the GPT-2 pattern
        ("smollm", "I'll pay 12345.", ["I", "'ll", "Ġpay", "Ġ", "1", "2", "3", "4", "5", "."]),
        ("starcoder", "x 42", ["x", "Ġ", "4", "2"]),
        # GPT-2's: numbers whole, contractions lower-case only
        ("gpt-2", "I'LL pay 12345.", ["I", "'", "LL", "Ġpay", "Ġ12345", "."]),
        # llama.cpp's default (no pre-tokenizer named): punctuation runs, GPT-2, numbers, then
        # every three digits
        (None, "Hi, $5 <=> 12345 x", ["Hi", ",", "Ġ", "$", "5", "Ġ", "<=>", "Ġ", "123", "45", "Ġx"]),
    ],
)
def test_the_text_is_split_as_llama_cpp_splits_it_for_the_files_pre_tokenizer(pre, text, expected):
    assert pieces(pre, text) == expected


@pytest.mark.parametrize("pre", ["deepseek-llm", "tekken", "falcon"])
def test_a_pre_tokenizer_split_otherwise_is_refused_by_name(pre):
    """DeepSeek's, Mistral's Tekken and Falcon's split otherwise: taken as another family's their
    tokens would silently differ from llama.cpp's (Llama 3's and Qwen2's are taken now:
    test_llama_cpp_vocab.py holds them to llama.cpp's vectors)."""
    with pytest.raises(
        ModelError,
        match=rf"tiny.gguf: pre-tokenizer '{pre}' is not supported.*supported: .*llama-bpe.*qwen2",
    ):
        Tokenizer.from_gguf(FakeFile(pre))


class FakeSpmFile(GGUFModel):
    """A SentencePiece-style vocabulary (`tokenizer.ggml.model` "llama"), no tensors: <unk>, <s>,
    </s> (control), the byte tokens of "é" (0xC3 0xA9), pieces with their scores."""

    PIECES = {"▁": -1.0, "a": -2.0, "b": -2.0, "c": -2.0, "ab": -5.0, "bc": -3.0, "▁a": -4.0, "▁ab": -0.5}

    def __init__(self, **extra):
        self.path = Path("spm.gguf")
        tokens = ["<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", *self.PIECES]
        self.fields = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 5 + list(self.PIECES.values()),
            "tokenizer.ggml.token_type": [2, 3, 3, 6, 6] + [1] * len(self.PIECES),
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            **extra,
        }
        self.file = types.SimpleNamespace(fields=self.fields)


def spm_ids(*pieces: str) -> list[int]:
    tokens = ["<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", *FakeSpmFile.PIECES]
    return [tokens.index(p) for p in pieces]


def test_a_sentencepiece_vocabulary_merges_the_best_scored_pair_first_as_llama_cpp():
    """Worked by hand from llama.cpp's llm_tokenizer_spm: " abc" is "▁abc" after the space
    prefix; pairs that are tokens: ▁a (-4), ab (-5), bc (-3): bc first (the best score), then
    ▁a; then ▁a+bc is no token: [▁a, bc]. "é" has no token: its UTF-8 bytes' tokens. BOS by
    default; </s> in the text is the control token, and the text after it gets the prefix."""
    from models.tokenizer import from_gguf

    tokenizer = from_gguf(FakeSpmFile())
    assert tokenizer.encode("abc") == [1, *spm_ids("▁a", "bc")]
    assert tokenizer.encode("ab") == [1, *spm_ids("▁ab")]  # ▁a (-4) then ▁a+b = ▁ab (-0.5)
    assert tokenizer.encode("é a") == [1, *spm_ids("▁", "<0xC3>", "<0xA9>", "▁a")]
    assert tokenizer.encode("c</s>a") == [1, *spm_ids("▁", "c", "</s>", "▁a")]
    ids = tokenizer.encode("ab é")
    assert tokenizer.decode(ids[1:]) == "ab é"  # the prefix space taken off
    assert tokenizer.decode(ids, skip_special=True) == " ab é"  # as llama.cpp: not after a BOS it drops
    assert tokenizer.decode(ids[1:], continuation=True) == " ab é"  # a generation's first word keeps it
    assert tokenizer.decode(spm_ids("</s>", "▁a")) == "</s> a"
    plain = {"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}
    no_prefix = from_gguf(FakeSpmFile(**plain))
    assert no_prefix.encode("ab") == spm_ids("ab") and no_prefix.encode("ca") == spm_ids("c", "a")


def test_a_long_text_is_tokenized_with_the_gil_released():
    """The server tokenizes a prompt on a thread while the coordinator's heartbeat thread must keep
    beating: a tokenizer that held the GIL for a multi-megabyte prompt (tokenizers' `encode` does)
    silenced the heartbeats long enough for every worker to leave. Another Python thread keeps
    running while the text is tokenized."""
    import threading
    import time

    tokenizer = Tokenizer.from_gguf(FakeFile("smollm"))
    text, took = "ab b a " * 200_000, 0.0
    while took < 0.3 and len(text) < 64 << 20:  # long enough to tell a held GIL apart on any machine
        text += text
        ticks, done = [], threading.Event()

        def tick(ticks=ticks, done=done):
            while not done.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.002)

        ticker = threading.Thread(target=tick)
        ticker.start()
        started = time.monotonic()
        ids = tokenizer.encode(text)
        took = time.monotonic() - started
        done.set()
        ticker.join()
    assert ids[:4] == [2, 1, 0, 2]  # "ab b a ab" (spaces are no token of this vocabulary): tokenized
    during = [t for t in ticks if started <= t <= started + took]
    longest = max(b - a for a, b in zip([started, *during], [*during, started + took]))
    assert longest < max(0.1, took / 4), f"other threads stood still {longest:.2f} s of a {took:.2f} s encode"


def test_a_tokens_bytes_are_its_own_even_where_its_text_is_part_of_a_character(model):
    """Logprobs' `bytes` (OpenAI's): the packaged SmolLM2's byte-level tokens "Ã" and "é" stand for
    the single bytes 0xC3 and 0xE9 (the first halves of two-byte characters; their decoded text is
    U+FFFD), "Ġthe" for " the", and a control token for its text."""
    from models.batching import Token
    from models.openai_protocol import logprob_fields

    tokenizer, vocabulary = model.tokenizer, model.vocabulary
    cases = {
        "\u00c3": b"\xc3",
        "\u00e9": b"\xe9",
        "\u0120the": b" the",
        "\u010a": b"\n",
        "<|im_start|>": b"<|im_start|>",
    }
    for text, expected in cases.items():
        assert tokenizer.token_bytes(vocabulary.index(text)) == expected, text
    half = vocabulary.index("\u00c3")
    (entry,) = logprob_fields(tokenizer, [Token(half, -0.5, ((half, -0.5),))], chat=True)["content"]
    assert entry["token"] == "\ufffd" and entry["bytes"] == [0xC3] and entry["top_logprobs"][0]["bytes"] == [0xC3]


def test_a_sentencepiece_byte_tokens_bytes_are_its_one_byte():
    from models.spm_tokenizer import SentencePieceTokenizer
    from models.tokenizer import TokenType

    tokens = ["<unk>", "<s>", "<0xE2>", "\u2581the", "\u00e9"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.BYTE, TokenType.NORMAL, TokenType.NORMAL]
    spm = SentencePieceTokenizer(tokens, [0.0] * 5, types, add_bos=True, bos=1)
    assert [spm.token_bytes(i) for i in range(5)] == [b"<unk>", b"<s>", b"\xe2", b" the", b"\xc3\xa9"]


def test_sentencepiece_special_tokens_are_cut_out_longest_first_and_may_begin_the_text():
    """Worked by hand (llama.cpp's tokenizer_st_partition, then llm_tokenizer_spm): "<x>y" and
    "<x>" are both user-defined: "<x>ya" holds the longer, and the "a" after it gets the space
    prefix and merges to "▁a". A text that begins with a special token has no stretch before it
    (no lone "▁" token)."""
    from models.spm_tokenizer import SentencePieceTokenizer
    from models.tokenizer import TokenType

    tokens = ["<unk>", "<s>", "</s>", "<x>", "<x>y", "\u2581", "a", "y", "\u2581a"]
    special = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.USER_DEFINED]
    scores = [0.0] * 5 + [-1.0, -2.0, -2.0, -1.5]
    spm = SentencePieceTokenizer(tokens, scores, special + [TokenType.NORMAL] * 4, add_bos=False, bos=1)
    assert spm.encode("<x>ya") == [4, 8]
    assert spm.encode("</s>a") == [2, 8]
    assert spm.encode("a<x>") == [8, 3]
