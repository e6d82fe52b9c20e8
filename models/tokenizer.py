"""Byte-level BPE tokenizers from a GGUF file's vocabulary and merges, with `tokenizers`.

Control tokens written in a prompt's text (`<|im_start|>`, `<|im_end|>`) are parsed as the single
tokens they are, as the reference tokenizers do. No BOS token is added unless the file says
`tokenizer.ggml.add_bos_token`. Pre-tokenizers by `tokenizer.ggml.pre`: "smollm" splits digits
one by one before the GPT-2 byte-level split (as SmolLM's tokenizer.json does); other gpt2-model
files get the plain GPT-2 split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONTROL = 3  # llama.cpp's token type for control tokens
SINGLE_DIGIT_PRE = frozenset({"smollm", "llama3", "llama-bpe", "qwen2", "deepseek-llm"})


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    add_bos: bool
    bos: int

    @classmethod
    def from_gguf(cls, model) -> Tokenizer:
        from models.gguf_model import ModelError, _require

        tk = _require("tokenizers")
        kind = model.meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelError(f"{model.path.name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
        tokens = list(model.meta("tokenizer.ggml.tokens"))
        types = list(model.meta("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in model.meta("tokenizer.ggml.merges")]
        bpe = tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        backend = tk.Tokenizer(bpe)
        byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if model.meta("tokenizer.ggml.pre", "default") in SINGLE_DIGIT_PRE:
            backend.pre_tokenizer = tk.pre_tokenizers.Sequence(
                [tk.pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = tk.decoders.ByteLevel()
        control = [
            tk.AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == CONTROL
        ]
        backend.add_special_tokens(control)
        add_bos = bool(model.meta("tokenizer.ggml.add_bos_token", False))
        return cls(backend, add_bos, int(model.meta("tokenizer.ggml.bos_token_id", -1)))

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos, *ids] if self.add_bos and self.bos >= 0 else ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)
