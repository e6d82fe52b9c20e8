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


def test_a_sentencepiece_vocabulary_without_the_space_prefix_tokenizes_as_llama_cpp_does(tmp_path):
    """Gemma's rule (tokenizer.ggml.add_space_prefix false) on Llama 2's vocabulary, a copy of
    its file with that flag (tests/llama_cpp_cases.py makes it): every test text tokenized to the
    ids llama.cpp gave on that copy, and decoded back to the text."""
    from tests.llama_cpp_cases import NO_SPACE_PREFIX, no_space_prefix_vocabulary

    tokenizer = GGUFModel(no_space_prefix_vocabulary(tmp_path), vocabulary_only=True).tokenizer
    tokenizer.add_bos = False
    texts = [text for text, _ in vectors("llama-spm")]
    expected = [[int(i) for i in line.split()] for line in NO_SPACE_PREFIX.read_text().split("\n")[: len(texts)]]
    assert any(a != b for a, b in zip(expected, (ids for _, ids in vectors("llama-spm"))))  # the flag matters
    for text, ids in zip(texts, expected):
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids) == text, text
