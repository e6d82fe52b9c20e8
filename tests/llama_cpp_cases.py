"""Synthetic llama files checked against llama.cpp's own logits (tests/test_llama_cpp_logits.py),
and llama.cpp's tokens of a vocabulary file made here (tests/test_llama_cpp_vocab.py).

Each case is a recipe (models/synthetic.py: shape, types, seed, architecture, rope scaling, a
byte-level vocabulary made from nothing or a family's real one from tests/data), a prompt of token
ids and a number of greedy steps. `python tests/llama_cpp_cases.py`
writes each file, runs llama.cpp on it (llama-cpp-python, float32 KV cache, one thread) over the
prompt and its own greedy continuation, and stores the tokens and every position's logits in
tests/data/llama_cpp_logits.npz with a SHA-256 of the file's weights and sizes, so the test
(which has no llama.cpp) can make the same file again and know it holds the same model. Run it
again when a case or the synthetic writer changes.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "llama_cpp_logits.npz"


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    output: str | None  # an untied head's type, None: tied
    seed: int
    prompt: tuple[int, ...] = (5, 17, 300, 42, 999, 7, 128, 64)
    steps: int = 8
    vocab: int = 1000
    architecture: str = "llama"
    rope_factors: bool = False
    rope_scale: float = 1.0
    vocabulary: str | None = None  # a tests/data file whose vocabulary to copy; None: bytes made here
    head_size: int | None = None  # a head's size where it is not hidden / heads (Qwen3's)
    window: int | None = None  # Phi-3's and Gemma 3's sliding window
    window_pattern: int | None = None  # Gemma 3's: every n-th layer global
    # how far from llama.cpp's logits ours may be (see the Gemma cases for why theirs is wider)
    tolerance: float = 1e-4

    def recipe(self):
        from models import synthetic

        vocab = None if self.vocabulary else self.vocab
        shape = synthetic.Shape(
            self.layers, self.hidden, self.ffn, self.heads, self.kv_heads, vocab, 128, self.head_size
        )
        return synthetic.Recipe(
            shape,
            weights="f32",
            embedding="f32",
            output=self.output,
            seed=self.seed,
            architecture=self.architecture,
            rope_factors=self.rope_factors,
            rope_scale=self.rope_scale,
            window=self.window,
            window_pattern=self.window_pattern,
        )

    def write(self, folder: Path) -> Path:
        from models import synthetic

        vocabulary = ROOT / "tests" / "data" / self.vocabulary if self.vocabulary else synthetic.BYTES
        return synthetic.write(folder / f"{self.name}.gguf", self.recipe(), vocabulary).path


def gemma_case(architecture: str, seed: int) -> Case:
    """A Gemma file of 3 layers, heads of 96 where hidden / heads is 64, a window of 8 on layers
    0 and 2 (pattern 2), over 40 prompt positions (the window's five times), tolerance 3e-4."""
    return Case(
        f"{architecture}-window-8",
        3,
        256,
        512,
        4,
        2,
        output=None,
        seed=seed,
        architecture=architecture,
        head_size=96,
        window=8,
        window_pattern=2,
        prompt=tuple(range(40, 80)),
        tolerance=3e-4,
    )


LONG = tuple(range(40, 56))  # 16 positions: where scaled frequencies turn far enough to tell apart
CASES = (
    Case("tied-gqa2", layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, output=None, seed=1),
    Case("untied-gqa4", layers=2, hidden=256, ffn=384, heads=8, kv_heads=2, output="f32", seed=2),
    Case("mha-3-layers", layers=3, hidden=128, ffn=256, heads=4, kv_heads=4, output=None, seed=3),
    # Llama 3.1's rope frequency factors; linear rope scaling; Qwen2 (q/k/v biases, NeoX rope); a
    # Llama 2-style file: SentencePiece vocabulary of 32,000 tokens, untied head
    Case("llama31-rope-factors", 2, 256, 512, 4, 2, output=None, seed=4, rope_factors=True, prompt=LONG),
    Case("linear-rope-x4", 2, 256, 512, 4, 2, output=None, seed=5, rope_scale=4.0, prompt=LONG),
    Case("qwen2", 2, 256, 384, 8, 2, output="f32", seed=6, architecture="qwen2"),
    Case("llama2-spm", 2, 128, 256, 4, 4, output="f32", seed=7, steps=4, vocabulary="ggml-vocab-llama-spm.gguf"),
    # Qwen3: each head's query and key RMS-normed before rope, heads of 64 where hidden / heads is 32
    Case("qwen3", 2, 256, 384, 8, 2, output=None, seed=8, architecture="qwen3", head_size=64),
    # Phi-3: q | k | v and gate | up fused in one tensor each; a sliding window of 6 in the file,
    # which llama.cpp turns off for phi3 (its logits past position 6 show it unapplied)
    Case(
        "phi3-window-6",
        2,
        256,
        384,
        8,
        4,
        output="f32",
        seed=9,
        architecture="phi3",
        window=6,
        prompt=LONG,
        vocabulary="ggml-vocab-phi-3.gguf",
    ),
    # Gemma 3: the embedding scaled by sqrt(hidden), q/k norms, norms after attention and the FFN,
    # ggml's float16-table GELU gate, heads of 96 where hidden / heads is 64, a window of 8 on
    # layers 0 and 2 (pattern 2) at rope base 10,000 beside layer 1's 1,000,000, over 40 prompt
    # positions. The table's rounding of each gate input to float16 turns the last bits in which
    # llama.cpp's products and ours differ into a float16 step now and then, so its logits (of
    # RMS 0.25 here) come within 3e-4 of llama.cpp's, not 1e-4 (measured 1.6e-4; on an untied
    # variant of logits' RMS 1.0, 5e-4). Each of these off gives 4e-4 or more: an exact GELU, one
    # mask or one rope base for every layer, Gemma 2's caps left out
    gemma_case("gemma3", seed=10),
    # Gemma 2: Gemma 3's embedding scale, post-norms and GELU gate without the q/k norms; every
    # layer's rope at 10,000; the attention's scores soft-capped at 50 and the logits at 30 (each
    # left out moves the logits 9e-4 or more from llama.cpp's; tests/test_soft_caps.py holds
    # the final cap on its own too)
    gemma_case("gemma2", seed=11),
)


def sha256(path: Path) -> str:
    """A digest of what decides the logits: each tensor's name, type, shape and bytes, and the
    model's sizes (not the header's layout, which another version of gguf's writer may change)."""
    from models.gguf_file import GGUFFile

    f = GGUFFile(path)
    digest = hashlib.sha256()
    arch = f.fields["general.architecture"]
    for key in sorted(k for k in f.fields if k.startswith(f"{arch}.")):
        digest.update(f"{key}={f.fields[key]!r}".encode())
    for name, t in f.tensors.items():
        digest.update(f"{name}:{t.tensor_type.name}:{t.shape}".encode())
        digest.update(np.ascontiguousarray(t.data).tobytes())
    return digest.hexdigest()


def llama_cpp_run(path: Path, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(tokens: the prompt then llama.cpp's greedy choices, logits (len(tokens) - 1, vocab) of
    every position but the last), float32 KV cache (llama.cpp's default f16 would round)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path), n_ctx=64, n_batch=64, n_threads=1, logits_all=True, type_k=0, type_v=0, verbose=False
    )
    tokens = list(case.prompt)
    llm.eval(tokens)
    for _ in range(case.steps):
        tokens.append(int(np.argmax(llm.scores[len(tokens) - 1])))
        llm.eval([tokens[-1]])
    return np.array(tokens, np.int32), np.array(llm.scores[: len(tokens) - 1], np.float32)


# Llama 2's SentencePiece vocabulary with Gemma's rule: no space put before the text
# (tokenizer.ggml.add_space_prefix false); its test texts tokenized by llama.cpp on that file
NO_SPACE_PREFIX = ROOT / "tests" / "data" / "ggml-vocab-llama-spm-no-space-prefix.out"


def no_space_prefix_vocabulary(folder: Path) -> Path:
    from tests.gguf_files import copy_with_metadata

    source = ROOT / "tests" / "data" / "ggml-vocab-llama-spm.gguf"
    return copy_with_metadata(source, folder / "no-space-prefix.gguf", {"tokenizer.ggml.add_space_prefix": False})


def write_no_space_prefix_vectors(folder: Path) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=str(no_space_prefix_vocabulary(folder)), vocab_only=True, verbose=False)
    texts = (ROOT / "tests" / "data" / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    lines = [" ".join(map(str, llm.tokenize(t.encode(), add_bos=False, special=False))) for t in texts.split(SEPARATOR)]
    NO_SPACE_PREFIX.write_text("\n".join(lines) + "\n")
    print(f"wrote {NO_SPACE_PREFIX}: {len(lines)} texts")


SEPARATOR = "\n__ggml_vocab_test__\n"


def main() -> int:
    import tempfile

    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as folder:
        write_no_space_prefix_vectors(Path(folder))
    stored = {}
    with tempfile.TemporaryDirectory() as folder:
        for case in CASES:
            path = case.write(Path(folder))
            tokens, logits = llama_cpp_run(path, case)
            stored |= {f"{case.name}/tokens": tokens, f"{case.name}/logits": logits}
            stored[f"{case.name}/sha256"] = np.array(sha256(path))
            print(f"{case.name}: {len(tokens)} tokens, logits {logits.shape}, {path.stat().st_size} bytes")
    DATA.parent.mkdir(exist_ok=True)
    np.savez_compressed(DATA, **stored)
    print(f"wrote {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
