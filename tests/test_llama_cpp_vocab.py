"""Our tokenizers against llama.cpp's own test vectors: its vocabulary files of the pre-tokenizers
we support (tests/data/ggml-vocab-*.gguf: GPT-2's, MPT's with its user-defined runs of spaces,
StarCoder's, Llama 3's with its whole-word tokens that skip the merges, Qwen2's) and of the
SentencePiece-style tokenizer (Llama 2's, as Mistral's and TinyLlama's; Phi-3's) and, for each,
every text of its `.inp` tokenized to the ids of its `.out` (as llama.cpp's test-tokenizer-0
does: no BOS), and decoded back to the text."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.gguf_model import GGUFModel

pytest.importorskip("tokenizers")
DATA = Path(__file__).resolve().parent / "data"
VOCABULARIES = ("gpt-2", "mpt", "starcoder", "llama-bpe", "qwen2", "llama-spm", "phi-3")
SEPARATOR = "\n__ggml_vocab_test__\n"


def vectors(name: str) -> list[tuple[str, list[int]]]:
    texts = (DATA / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = (DATA / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(ids) >= len(texts) > 40
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


@pytest.fixture(scope="module", params=VOCABULARIES)
def vocabulary(request):
    tokenizer = GGUFModel(DATA / f"ggml-vocab-{request.param}.gguf", vocabulary_only=True).tokenizer
    tokenizer.add_bos = False  # llama.cpp's vectors are tokenized without it
    return request.param, tokenizer


def test_every_test_vector_tokenizes_as_llama_cpp_does(vocabulary):
    name, tokenizer = vocabulary
    differ = [(text, ids, tokenizer.encode(text)) for text, ids in vectors(name) if tokenizer.encode(text) != ids]
    assert not differ, f"{name}: {len(differ)} differ, the first {differ[0][0]!r}: {differ[0][1]} != {differ[0][2]}"


def test_every_test_vector_decodes_back_to_its_text(vocabulary):
    name, tokenizer = vocabulary
    for text, ids in vectors(name):
        assert tokenizer.decode(ids) == text, (name, text)
