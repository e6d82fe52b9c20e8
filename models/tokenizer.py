"""Tokenizers from a GGUF file: `from_gguf` picks by `tokenizer.ggml.model`: byte-level BPE ("gpt2",
here, with `tokenizers`) or SentencePiece-style ("llama": models/spm_tokenizer.py).

Control tokens written in a prompt's text (`<|im_start|>`, `<|im_end|>`) are parsed as the single
tokens they are, as the reference tokenizers do. No BOS token is added unless the file says
`tokenizer.ggml.add_bos_token`.

The text is split before BPE as llama.cpp splits it for the file's `tokenizer.ggml.pre`
(src/llama-vocab.cpp): SmolLM's family splits digits one by one, then by the GPT-2 pattern; the
GPT-2 family by that pattern alone; Llama 3's (`llama-bpe`) by its own pattern (digits in
threes), a word that is a whole token skipping the merges; Qwen2's as Llama 3's with digits one by
one; a file that names none ("default") by llama.cpp's default patterns in turn. Tokens of the
user-defined type (GPT-NeoX's runs of spaces) are cut out whole first. Any other pre-tokenizer
(DeepSeek's, Falcon's, ...) is refused by name: its tokens would differ from llama.cpp's in
numbers, contractions and punctuation, silently. tests/test_llama_cpp_vocab.py holds each
supported family to llama.cpp's own test vectors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from models.gguf_file import shown_name


class TokenType(enum.IntEnum):
    """llama.cpp's token types (tokenizer.ggml.token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3  # BOS, EOS, <|im_end|>: one token even where its text is in a prompt
    USER_DEFINED = 4  # added by the model's authors, matched whole in the text (GPT-NeoX's runs of spaces)
    UNUSED = 5
    BYTE = 6  # <0xE2>: a SentencePiece vocabulary's byte fallback


GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# pre-tokenizers whose words that are whole tokens skip the merges (llama.cpp's ignore_merges)
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})
# tokenizer.ggml.pre -> the patterns llama.cpp splits by, in turn (each match and each stretch
# between matches a piece of its own); "digits" for SmolLM's family, whose first pattern is \p{N}
# Llama 3's (and Qwen2's, digits one by one): contractions in either case, letters with one
# leading non-letter, digits in threes, punctuation runs with their line ends, line breaks
LLAMA3_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", "[0-9][0-9][0-9]"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (LLAMA3_PATTERN,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (QWEN2_PATTERN,)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), (GPT2_PATTERN,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), ("digits", GPT2_PATTERN)
    ),
}


def from_gguf(model):
    """The tokenizer of `model` (a GGUFModel) by its `tokenizer.ggml.model`."""
    from models.errors import ModelError

    kind = model.meta_str("tokenizer.ggml.model")
    if kind == "gpt2":
        return Tokenizer.from_gguf(model)
    if kind == "llama":
        return _sentencepiece(model)
    raise ModelError(
        f"{model.path.name}: tokenizer model {shown_name(kind)!r} is not supported (byte-level BPE 'gpt2' and "
        "SentencePiece-style 'llama' are)"
    )


def _sentencepiece(model):
    from models.errors import ModelError
    from models.spm_tokenizer import SentencePieceTokenizer

    tokens = list(model.vocabulary)
    scores = model.meta_list("tokenizer.ggml.scores", float, [0.0] * len(tokens))
    types = list(model.token_types) or [1] * len(tokens)
    if len(scores) != len(tokens):
        raise ModelError(f"{model.path.name}: {len(scores)} token scores for a vocabulary of {len(tokens)}")
    return SentencePieceTokenizer(
        tokens,
        scores,
        types,
        add_bos=model.meta_bool("tokenizer.ggml.add_bos_token", True),
        bos=model.token_id("tokenizer.ggml.bos_token_id"),
        add_space_prefix=model.meta_bool("tokenizer.ggml.add_space_prefix", True),
        add_eos=model.meta_bool("tokenizer.ggml.add_eos_token", False),
        eos=model.token_id("tokenizer.ggml.eos_token_id"),
        unknown=model.token_id("tokenizer.ggml.unknown_token_id"),
    )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each of its 256 characters to the byte it
    stands for (printable Latin-1 bytes are themselves; the others, space and control bytes
    included, are the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_OF_CHARACTER = _byte_level_alphabet()


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    add_bos: bool
    bos: int

    @classmethod
    def from_gguf(cls, model) -> Tokenizer:
        from models.errors import ModelError, require

        tk = require("tokenizers")
        tokens = list(model.vocabulary)
        types = list(model.token_types) or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in model.meta_list("tokenizer.ggml.merges", str)]
        pre = model.meta_str("tokenizer.ggml.pre", "default")
        vocab = {t: i for i, t in enumerate(tokens)}
        for pair in merges:  # tokenizers panics (a BaseException) on a merge it cannot place
            if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
                raise ModelError(
                    f"{model.path.name}: merge {' '.join(pair)[:60]!r} in tokenizer.ggml.merges is not two tokens "
                    "of the vocabulary whose join is one too"
                )
        try:
            bpe = tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in IGNORE_MERGES)
        except Exception as exc:
            raise ModelError(f"{model.path.name}: the vocabulary and merges do not make a BPE model: {exc}") from None
        backend = tk.Tokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(tk, pre, model.path.name)
        backend.decoder = tk.decoders.ByteLevel()
        control = [t for t, kind in zip(tokens, types) if kind == TokenType.CONTROL]
        control = [tk.AddedToken(t, special=True, normalized=False) for t in control]
        backend.add_special_tokens(control)
        # user-defined tokens (GPT-NeoX's runs of spaces, written as raw text in the file) are cut
        # out of the text whole before it is split, as llama.cpp's tokenizer_st_partition does
        added = [t for t, kind in zip(tokens, types) if kind == TokenType.USER_DEFINED]
        backend.add_tokens([tk.AddedToken(t, special=False, normalized=False) for t in added])
        add_bos = model.meta_bool("tokenizer.ggml.add_bos_token", False)
        return cls(backend, add_bos, model.token_id("tokenizer.ggml.bos_token_id"))

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: it releases the GIL while Rust tokenizes (encode holds it for the
        # whole text: ~0.5 s a MB, in which the coordinator's heartbeat thread could not run)
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos, *ids] if self.add_bos and self.bos >= 0 else ids

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for (alone it may hold part of a UTF-8 character, which
        its decoded text shows as U+FFFD): an added token's text as written, any other token's
        characters read back through byte-level BPE's alphabet."""
        text = self.backend.id_to_token(token)
        if text is None:
            raise ValueError(f"token id {token} is outside the vocabulary")
        if token in self.backend.get_added_tokens_decoder() or not all(c in BYTE_OF_CHARACTER for c in text):
            return text.encode("utf-8")
        return bytes(BYTE_OF_CHARACTER[c] for c in text)

    def decode(self, ids: list[int], skip_special: bool = False, continuation: bool = False) -> str:
        """The text of `ids`; `continuation` (ids that continue a text) changes nothing here:
        byte-level BPE adds no space in front (SentencePiece-style tokenizers do)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)


def _pre_tokenizer(tk, pre: str, file: str):
    """`tokenizers`' pre-tokenizer splitting as llama.cpp does for pre-tokenizer `pre`: each
    pattern isolates its matches in the pieces the one before left, then the bytes are mapped
    to the byte-level alphabet the vocabulary is written in."""
    from models.errors import ModelError

    patterns = PRE_TOKENIZERS.get(pre)
    if patterns is None:
        raise ModelError(
            f"{file}: pre-tokenizer {shown_name(pre)!r} is not supported (its text would split otherwise than "
            f"llama.cpp splits it); supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    steps = [
        tk.pre_tokenizers.Digits(individual_digits=True)
        if pattern == "digits"
        else tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated")
        for pattern in patterns
    ]
    return tk.pre_tokenizers.Sequence([*steps, tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
