"""Synthetic llama-architecture GGUF files: any shape, seeded random weights in any type the
workers keep, and a real vocabulary copied from an existing GGUF file.

Real weights of most models cannot be fetched where this runs, and a benchmark or a test of a
1.7B-shaped model must not carry 1 GB: the file is made where it is used, from a `Recipe` (shape,
types, seed), and the same recipe makes the same bytes. Its weights are random but of a sane
size (a layer keeps its activations' scale, so a decode neither overflows nor collapses to one
token), and quantized blocks are written directly (random quants, each block's float16 factors
set to a random scale near the target), so a 1 GB file takes seconds and every supported type,
K-quants included, is written the same way; `gguf.quants.dequantize` is the oracle that reads
them back in tests.

    python launch.py synthetic out.gguf --shape 1.7b --weights q4_1 --embedding q8_0

The vocabulary (`tokenizer.*` fields: tokens, merges, types, scores, special ids, pre-tokenizer,
chat template) is copied from `vocabulary` (default: the packaged SmolLM2), so prompts tokenize
as that file's do; where none is at hand, a byte-level BPE vocabulary is made (`BYTES`), so
any text still tokenizes; or the file holds placeholder tokens and no tokenizer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.gguf_file import GGUFFile
from split_state.errors import MetaError
from split_state.quant import FORMATS


class SyntheticError(MetaError, ValueError):
    """A recipe that cannot be written: a shape that does not fit its types, an unknown type."""


@dataclass(frozen=True)
class Shape:
    """A llama-architecture model's sizes. `vocab` None: the vocabulary source's size."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int | None = None
    context: int = 2048
    head_size: int | None = None  # a head's size where it is not hidden / heads (Qwen3's key_length)

    def __post_init__(self):
        for what in ("layers", "hidden", "ffn", "heads", "kv_heads", "context"):
            value = getattr(self, what)
            if not isinstance(value, int) or value <= 0:
                raise SyntheticError(f"synthetic shape: {what} must be a positive integer, not {value!r}")
        if self.vocab is not None and (not isinstance(self.vocab, int) or self.vocab <= 0):
            raise SyntheticError(f"synthetic shape: vocab must be a positive integer, not {self.vocab!r}")
        if self.head_size is not None and (not isinstance(self.head_size, int) or self.head_size <= 0):
            raise SyntheticError(f"synthetic shape: head_size must be a positive integer, not {self.head_size!r}")
        if self.head_size is None and self.hidden % self.heads:
            raise SyntheticError(f"synthetic shape: hidden {self.hidden} is not divisible by {self.heads} heads")
        if self.heads % self.kv_heads:
            raise SyntheticError(f"synthetic shape: {self.heads} heads are not divisible by {self.kv_heads} KV heads")
        if self.head_dim % 2:
            raise SyntheticError(f"synthetic shape: head size {self.head_dim} is odd; rope rotates pairs")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    def __str__(self) -> str:
        vocab = "" if self.vocab is None else f", vocab {self.vocab}"
        head = "" if self.head_size is None else f" of {self.head_size}"
        return (
            f"{self.layers} layers, hidden {self.hidden}, ffn {self.ffn}, {self.heads} heads{head} / "
            f"{self.kv_heads} KV{vocab}"
        )


# shapes people benchmark: SmolLM2's family (its vocabulary is the default source) and a tiny one
SHAPES = {
    "tiny": Shape(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2),
    "135m": Shape(layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3),
    "135m-8": Shape(layers=8, hidden=576, ffn=1536, heads=9, kv_heads=3),
    "360m": Shape(layers=32, hidden=960, ffn=2560, heads=15, kv_heads=5),
    "1.7b": Shape(layers=24, hidden=2048, ffn=8192, heads=32, kv_heads=32),
}

FLOAT_TYPES = ("f32", "f16")
WEIGHT_TYPES = FLOAT_TYPES + tuple(FORMATS)

# Each quantized format's float16 factors, as multiples of the values' target standard deviation:
# (d per unit of spread, the second factor as a multiple of d or None). With random quants the
# spread of a block's values is d times the spread of its quants (uniform 0..15 for 4 bits: 4.6;
# 0..31: 9.2; int8: 74; K-quants also times a random 6-bit scale, mean 31.5, or q6_k's int8 one),
# and the second factor (q4_1's m, q4_k's dmin) centres them on zero. The K-quants' random
# minimums add as much spread again (measured: 1.9x), hence their larger divisors.
_FACTORS = {
    "q4_0": (1 / 4.6, None),
    "q4_1": (1 / 4.6, -7.5),
    "q5_0": (1 / 9.2, None),
    "q5_1": (1 / 9.2, -15.5),
    "q8_0": (1 / 74, None),
    "q4_k": (1 / (1.9 * 31.5 * 4.6), 7.5),
    "q5_k": (1 / (1.9 * 31.5 * 9.2), 15.5),
    "q6_k": (1 / (74 * 18.5), None),
}


# qwen2: biases on q, k and v; qwen3: each head's query and key RMS-normed (attn_q_norm,
# attn_k_norm); phi3: q | k | v in one tensor (attn_qkv) and gate | up in ffn_up, a sliding window
# with Recipe.window; gemma3: qwen3's norms, norms after attention and the FFN (post_attention_norm,
# post_ffw_norm), a GELU gate, the embedding scaled, a window on the layers of its pattern
# (Recipe.window, Recipe.window_pattern) at a rope base of their own (10,000 beside the global
# layers' 1,000,000); gemma2: gemma3's but for the q/k norms, the rope base of every layer
# 10,000, attention scores soft-capped at 50 and the logits at 30; llama.cpp rotates all but
# llama's halves (NeoX)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
WINDOWED = ("phi3", "gemma2", "gemma3")  # the architectures whose files may carry a sliding window
GEMMA = ("gemma2", "gemma3")


@dataclass(frozen=True)
class Recipe:
    """What a synthetic file holds: `weights` the type of every layer matrix, `embedding` the
    token embedding's (and a tied head's), `output` an untied head's type (None: tied, as
    SmolLM2), `seed` the random weights', `architecture` one of ARCHITECTURES; rope as Llama
    3.1's (`rope_factors`: a rope_freqs.weight of frequency factors from 1 to 8) or linearly
    scaled (`rope_scale`: the positions divided by it)."""

    shape: Shape
    weights: str = "q4_1"
    embedding: str = "q8_0"
    output: str | None = None
    seed: int = 0
    architecture: str = "llama"
    rope_factors: bool = False
    rope_scale: float = 1.0
    window: int | None = None  # phi3's and gemma3's attention.sliding_window
    # gemma3's attention.sliding_window_pattern: every n-th layer global, the others windowed
    # (None: not written, llama.cpp's 6)
    window_pattern: int | None = None

    def __post_init__(self):
        if self.window is not None and (
            self.architecture not in WINDOWED or not isinstance(self.window, int) or self.window < 1
        ):
            raise SyntheticError(
                f"synthetic window {self.window!r}: a positive integer, for --architecture {' or '.join(WINDOWED)}"
            )
        if self.window_pattern is not None and (
            self.architecture not in GEMMA
            or self.window is None
            or not isinstance(self.window_pattern, int)
            or self.window_pattern < 1
        ):
            raise SyntheticError(
                f"synthetic window pattern {self.window_pattern!r}: a positive integer, for --architecture "
                f"{' or '.join(GEMMA)} with a window"
            )
        if self.architecture not in ARCHITECTURES:
            known = ", ".join(ARCHITECTURES)
            raise SyntheticError(f"synthetic architecture {self.architecture!r}: choose one of {known}")
        if not isinstance(self.rope_scale, (int, float)) or not 0 < self.rope_scale < math.inf:
            raise SyntheticError(f"synthetic rope scale must be a positive number, not {self.rope_scale!r}")
        for what in ("weights", "embedding", "output"):
            kind = getattr(self, what)
            if kind is not None and kind not in WEIGHT_TYPES:
                raise SyntheticError(f"synthetic {what} type {kind!r}: choose one of {', '.join(WEIGHT_TYPES)}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise SyntheticError(f"synthetic seed must be a non-negative integer, not {self.seed!r}")

    def tensors(self, vocab: int) -> Iterator[tuple[str, tuple[int, int] | tuple[int], str]]:
        """(GGUF name, NumPy shape, type) of every tensor, in llama.cpp's order."""
        s = self.shape
        kv, q = s.kv_heads * s.head_dim, s.heads * s.head_dim
        yield "token_embd.weight", (vocab, s.hidden), self.embedding
        yield "output_norm.weight", (s.hidden,), "f32"
        if self.output is not None:
            yield "output.weight", (vocab, s.hidden), self.output
        if self.rope_factors:
            yield "rope_freqs.weight", (s.head_dim // 2,), "f32"
        for i in range(s.layers):
            yield f"blk.{i}.attn_norm.weight", (s.hidden,), "f32"
            if self.architecture == "phi3":
                yield f"blk.{i}.attn_qkv.weight", (q + 2 * kv, s.hidden), self.weights
            else:
                yield f"blk.{i}.attn_q.weight", (q, s.hidden), self.weights
                yield f"blk.{i}.attn_k.weight", (kv, s.hidden), self.weights
                yield f"blk.{i}.attn_v.weight", (kv, s.hidden), self.weights
            if self.architecture == "qwen2":
                yield f"blk.{i}.attn_q.bias", (q,), "f32"
                yield f"blk.{i}.attn_k.bias", (kv,), "f32"
                yield f"blk.{i}.attn_v.bias", (kv,), "f32"
            if self.architecture in ("qwen3", "gemma3"):
                yield f"blk.{i}.attn_q_norm.weight", (s.head_dim,), "f32"
                yield f"blk.{i}.attn_k_norm.weight", (s.head_dim,), "f32"
            yield f"blk.{i}.attn_output.weight", (s.hidden, q), self.weights
            if self.architecture in GEMMA:
                yield f"blk.{i}.post_attention_norm.weight", (s.hidden,), "f32"
            yield f"blk.{i}.ffn_norm.weight", (s.hidden,), "f32"
            if self.architecture == "phi3":
                yield f"blk.{i}.ffn_up.weight", (2 * s.ffn, s.hidden), self.weights
            else:
                yield f"blk.{i}.ffn_gate.weight", (s.ffn, s.hidden), self.weights
                yield f"blk.{i}.ffn_up.weight", (s.ffn, s.hidden), self.weights
            yield f"blk.{i}.ffn_down.weight", (s.hidden, s.ffn), self.weights
            if self.architecture in GEMMA:
                yield f"blk.{i}.post_ffw_norm.weight", (s.hidden,), "f32"

    def check(self, vocab: int) -> None:
        """Every matrix's rows must be whole blocks of its type: said before a byte is written."""
        for name, shape, kind in self.tensors(vocab):
            fmt = FORMATS.get(kind)
            if fmt is not None and shape[-1] % fmt.block:
                raise SyntheticError(
                    f"synthetic {name}: rows of {shape[-1]} values are not whole {kind} blocks of {fmt.block}; "
                    f"choose a shape whose hidden and ffn sizes are multiples of {fmt.block}, or another type"
                )


@dataclass(frozen=True)
class Written:
    path: Path
    bytes: int
    seconds: float
    vocab: int
    vocabulary_from: str  # the file the tokenizer came from, or "placeholder tokens"


def default_vocabulary() -> Path | None:
    """The packaged SmolLM2's file, whose vocabulary the synthetic files take, if installed."""
    from models.gguf_model import ModelMissing, default_model_path

    try:
        return default_model_path()
    except ModelMissing:
        return None


def write(path: str | Path, recipe: Recipe, vocabulary: str | Path | None = None) -> Written:
    """Write `recipe` as a GGUF file at `path`, the tokenizer copied from `vocabulary` (a GGUF
    file), made here (`BYTES`: a byte-level BPE vocabulary of `recipe.shape.vocab` tokens), or,
    with none, placeholder tokens and no tokenizer."""
    from models.errors import require

    gguf = require("gguf")  # without it: a one-line ModelMissing saying how to install it
    start = time.perf_counter()
    fields, origin = _vocabulary_fields(recipe.shape, vocabulary)
    vocab = len(fields["tokenizer.ggml.tokens"][0])
    recipe.check(vocab)
    s = recipe.shape
    path = Path(path)
    arch = recipe.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"synthetic {arch} ({s}), {recipe.weights} seed {recipe.seed}")
    writer.add_uint32(f"{arch}.context_length", s.context)
    writer.add_uint32(f"{arch}.embedding_length", s.hidden)
    writer.add_uint32(f"{arch}.block_count", s.layers)
    writer.add_uint32(f"{arch}.feed_forward_length", s.ffn)
    writer.add_uint32(f"{arch}.rope.dimension_count", s.head_dim)
    writer.add_uint32(f"{arch}.attention.head_count", s.heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", s.kv_heads)
    if s.head_size is not None or arch in ("qwen3", *GEMMA):  # as their converters write them
        writer.add_uint32(f"{arch}.attention.key_length", s.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", s.head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)
    if recipe.window is not None:
        writer.add_uint32(f"{arch}.attention.sliding_window", recipe.window)
    if arch == "gemma3" and recipe.window is not None:
        writer.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
    if arch == "gemma2":  # as its converter writes them
        writer.add_float32(f"{arch}.attn_logit_softcapping", 50.0)
        writer.add_float32(f"{arch}.final_logit_softcapping", 30.0)
    if recipe.window_pattern is not None:
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", recipe.window_pattern)
    if recipe.rope_scale != 1.0:
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", float(recipe.rope_scale))
    writer.add_uint32(f"{arch}.vocab_size", vocab)
    for key, (value, kind, sub) in fields.items():
        writer.add_key_value(key, value, kind, sub_type=sub)
    plan = list(recipe.tensors(vocab))
    for name, shape, kind in plan:
        nbytes, stored, raw = _layout(shape, kind)
        writer.add_tensor_info(name, stored, np.dtype(np.uint8) if raw else _FLOAT_DTYPE[kind], nbytes, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, shape, kind) in enumerate(plan):
        # one generator per tensor, seeded by (seed, index): a tensor's values do not depend on
        # the types of the tensors before it
        rng = np.random.default_rng([recipe.seed, index])
        writer.write_tensor_data(_values(rng, name, shape, kind, _shrink(recipe, name)))
    writer.close()
    return Written(path, path.stat().st_size, time.perf_counter() - start, vocab, origin)


_FLOAT_DTYPE = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}


def _layout(shape: tuple[int, ...], kind: str):
    """(bytes, the shape add_tensor_info takes, the ggml type for raw blocks or None)."""
    import gguf

    if kind in _FLOAT_DTYPE:
        return math.prod(shape) * _FLOAT_DTYPE[kind].itemsize, shape, None
    fmt = FORMATS[kind]
    rows, cols = shape
    row_bytes = cols // fmt.block * fmt.block_bytes
    return rows * row_bytes, (rows, row_bytes), gguf.GGMLQuantizationType[kind.upper()]


def _shrink(recipe: Recipe, name: str) -> float:
    """What a tensor's spread is divided by: Gemma's embedding by sqrt(hidden), which llama.cpp
    multiplies it by (gemma3.cpp), so that the scaled rows have the spread of other families'."""
    if recipe.architecture in GEMMA and name == "token_embd.weight":
        return recipe.shape.hidden**0.25
    return 1.0


def _values(rng: np.random.Generator, name: str, shape: tuple[int, ...], kind: str, shrink: float = 1.0) -> np.ndarray:
    if name == "rope_freqs.weight":  # as Llama 3.1's: the highest frequencies kept, the lowest slowed 8x
        return np.geomspace(1.0, 8.0, shape[0]).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:  # a norm's weight: near one
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    # a matrix (out, in): values of spread 1/sqrt(in) keep a product's output at its input's scale.
    # The embedding's rows (also the tied head's) get the same spread, so each row has norm ~1:
    # with spread 1 a token's own row dominated the residual stream and the tied head chose the
    # input token again (greedy repeated one token for ever), a useless decode to compare paths on.
    spread = 1 / math.sqrt(shape[1]) / shrink
    if kind in _FLOAT_DTYPE:
        return (spread * rng.standard_normal(shape, np.float32)).astype(_FLOAT_DTYPE[kind])
    if kind == "bf16":  # bfloat16: the top half of float32
        values = (spread * rng.standard_normal(shape, np.float32)).view(np.uint32)
        return (values >> 16).astype(np.uint16).view(np.uint8).reshape(shape[0], -1)
    return _random_blocks(rng, shape, FORMATS[kind], spread)


def matrix(rng: np.random.Generator, shape: tuple[int, int], kind: str) -> np.ndarray:
    """A (out, in) matrix drawn as a synthetic file's are, in `kind`: its stored bytes (rows,
    blocks * block_bytes) for a GGUF block type (bench/qgemv.py times the GPU's products on them)."""
    return _values(rng, "matrix", shape, kind)


def _random_blocks(rng: np.random.Generator, shape: tuple[int, int], fmt, spread: float) -> np.ndarray:
    """Random quants, each block's float16 factors a random scale within 1.5x of the target's."""
    rows, cols = shape
    blocks = cols // fmt.block
    data = rng.integers(0, 256, (rows, blocks, fmt.block_bytes), dtype=np.uint8)
    per_spread, second = _FACTORS[fmt.name]
    d = (spread * per_spread * rng.uniform(0.5, 1.5, (rows, blocks))).astype(np.float16)
    data[..., fmt.factors[0] : fmt.factors[0] + 2] = d[..., None].view(np.uint8).reshape(rows, blocks, 2)
    if len(fmt.factors) > 1:
        m = (second * d.astype(np.float32)).astype(np.float16)
        data[..., fmt.factors[1] : fmt.factors[1] + 2] = m[..., None].view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * fmt.block_bytes)


BYTES = "bytes"  # `vocabulary`: a byte-level BPE vocabulary made here (byte_level_vocabulary)
PLACEHOLDER_VOCAB = 32000  # the size of a made vocabulary when the shape names none


def byte_level_vocabulary(size: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of `size` tokens with no file behind it: GPT-2's 256 byte
    characters, `size - 257` tokens each the join of two earlier ones (its merge, drawn with
    `seed` among the shorter tokens so that words of text really merge), and `<|endoftext|>`.
    `tokenizers` builds a working tokenizer from it, so a synthetic file tokenizes any text where
    no model's vocabulary can be copied (a GPU machine without the packaged SmolLM2)."""
    if size < 258:
        raise SyntheticError(f"a byte-level vocabulary needs at least 258 tokens, not {size}")
    alphabet = _byte_alphabet()
    tokens, merges, seen = list(alphabet), [], set(alphabet)
    rng = np.random.default_rng(seed)
    # common letters and the space's character first, so short words of text find their merges
    frequent = [alphabet[b] for b in b" etaoinshrdlucmfwypvbgkjqxz"]
    while len(tokens) < size - 1:
        pool = frequent if len(tokens) < 1024 else tokens[: max(512, len(tokens) // 4)]
        left, right = pool[rng.integers(len(pool))], pool[rng.integers(len(pool))]
        if left + right not in seen and len(left + right) <= 16:
            seen.add(left + right)
            tokens.append(left + right)
            merges.append(f"{left} {right}")
            if len(tokens) % 64 == 0:  # the pool grows with what was made
                frequent = tokens[: min(len(tokens), 2048)]
    return tokens + ["<|endoftext|>"], merges


def _byte_alphabet() -> list[str]:
    """GPT-2's printable character for each byte (the alphabet byte-level BPE writes bytes in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _vocabulary_fields(shape: Shape, vocabulary: str | Path | None):
    """key -> (value, GGUF value type, element type) of the tokenizer, and where it came from."""
    from gguf import GGUFValueType as T

    if vocabulary is None:
        vocab = shape.vocab or 256
        tokens = [f"<t{i}>" for i in range(vocab)]
        return {"tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING)}, "placeholder tokens"
    if vocabulary == BYTES:
        tokens, merges = byte_level_vocabulary(shape.vocab or PLACEHOLDER_VOCAB)
        types = [1] * (len(tokens) - 1) + [3]  # <|endoftext|>: a control token, the end of generation
        fields = {
            "tokenizer.ggml.model": ("gpt2", T.STRING, None),
            "tokenizer.ggml.pre": ("gpt-2", T.STRING, None),
            "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
            "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32),
            "tokenizer.ggml.merges": (merges, T.ARRAY, T.STRING),
            "tokenizer.ggml.eos_token_id": (len(tokens) - 1, T.UINT32, None),
        }
        return fields, "a byte-level vocabulary made here"
    source = GGUFFile(vocabulary)
    fields = {}
    for key, value in source.fields.items():
        if key.startswith("tokenizer."):
            fields[key] = _typed(key, value)
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SyntheticError(f"{vocabulary}: no tokenizer.ggml.tokens to copy a vocabulary from")
    if shape.vocab is not None and shape.vocab != len(tokens[0]):
        raise SyntheticError(
            f"synthetic shape: vocab {shape.vocab}, but {Path(vocabulary).name}'s vocabulary has {len(tokens[0])} "
            "tokens (leave vocab out to take the file's)"
        )
    return fields, str(vocabulary)


def _typed(key: str, value):
    """A field read by GGUFFile as a Python value, with the GGUF type llama.cpp writes it in."""
    from gguf import GGUFValueType as T

    def kind(v):
        if isinstance(v, bool):
            return T.BOOL
        if isinstance(v, int):
            return T.INT32 if key.endswith("token_type") else T.UINT32
        if isinstance(v, float):
            return T.FLOAT32
        return T.STRING

    if isinstance(value, list):
        return value, T.ARRAY, kind(value[0]) if value else T.STRING
    return value, kind(value), None
