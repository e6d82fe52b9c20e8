"""A llama-family decoder: a single-process NumPy reference and the tensor-parallel model.

Weights are NumPy-oriented (`x @ W`, W of shape (in, out)); names:

    embed (vocab, hidden)          token embedding (also the output head when tied)
    L.attn_norm, L.ffn_norm (hidden,)
    L.wq (hidden, heads*hd), L.wk, L.wv (hidden, kv_heads*hd), L.wo (heads*hd, hidden)
    L.w_gate, L.w_up (hidden, ffn), L.w_down (ffn, hidden)      for L = "l0", "l1", ...
    norm (hidden,), output (hidden, vocab) when the head is not tied

Tensor parallelism (DESIGN §8): attention split by heads (HeadSplit: whole KV heads and the query
heads sharing them, or, when the KV heads do not divide among the devices, the query heads
evenly with a KV head whose group is cut held by both sides), so attention needs no
communication; wo and w_down row-parallel, w_gate|w_up one column-parallel weight of two
segments (and, with fuse_qkv, wq|wk|wv one of three: one product a layer for the attention's
inputs): two all-reduces per layer. The KV cache is resident, split like the heads, preallocated
to the context and written in place. The embedding table is split by vocabulary rows (its lookup
is Partial: one more all-reduce per step), and the head's logits come out split by vocabulary,
so the next token is picked by a per-device top-k and a small combine.

Layer split (`LayerGroups`, llama.cpp's `-sm layer`): consecutive layers on groups of the workers
(one a host, or one a worker), each layer split as above over its group's workers alone (states
held by the group: split_state.states' `on`); the embedding on the first group, the head on the
last. The planner hands the residual over at each group boundary (one activation a boundary a
step) and the chosen tokens' candidates back to every worker, so generation runs unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from meta.device import MetaDevice
from meta.steps import Earlier, Step
from meta.tensor import Tensor, get_rows, qget_rows, qmatmul, where
from models import reference as ref
from split_state.errors import ShapeError
from split_state.layout import local_shape
from split_state.ops import ACTIVATIONS
from split_state.quant import interleave, lanes_for, quant_format
from split_state.states import MIRRORED, Mirrored, Split, State, widen


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    eps: float = 1e-5
    rope_base: float = 10000.0
    rope_mode: str = "normal"  # "normal": adjacent pairs (ggml, llama.cpp's GGUF layout); "neox": halves
    tied: bool = True
    # each rope frequency's multiplier (head_dim / 2 of them: 1 / a linear scaling's factor, Llama
    # 3.1's 1 / frequency factor), None: 1
    rope_freqs: tuple[float, ...] | None = None
    qkv_bias: bool = False  # biases added to q, k and v (Qwen2)
    # a head's size where it is not hidden / heads (Qwen3: 128 for a 1,024 hidden and 16 heads;
    # the file's attention.key_length), None: hidden / heads
    head_size: int | None = None
    qk_norm: bool = False  # each head's query and key RMS-normed (times q_norm, k_norm) before rope (Qwen3)
    # sliding-window attention (Phi-3's attention.sliding_window, Gemma's): a token sees the
    # positions less than `window` before its own, as llama.cpp's standard SWA; None: all before it
    window: int | None = None
    # which layers the window applies to (Gemma 3: five of every six); empty: every layer
    windowed: tuple[bool, ...] = ()
    # a windowed layer's rope base (Gemma 3's 10,000 beside its global layers' 1,000,000); its rope
    # is never scaled (rope_freqs are the global layers'); None: rope_base, scaled as the others
    window_rope_base: float | None = None
    # Gemma's: the embedding scaled by sqrt(hidden); attention's and the FFN's outputs RMS-normed
    # (attn_post_norm, ffn_post_norm) before they join the residual; the gate "gelu" (ggml's tanh
    # GELU through its float16 table, Tensor.gelu_f16) rather than "silu"; the query scaled by
    # `attn_scale` rather than 1 / sqrt(head_dim); the logits soft-capped: c * tanh(logits / c)
    embed_scale: float | None = None
    post_norms: bool = False
    gate: str = "silu"
    attn_scale: float | None = None
    final_softcap: float | None = None
    # Gemma 2's: each attention score (scaled) soft-capped, c * tanh(score / c), before the mask
    attn_softcap: float | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def scale(self) -> float:
        """What a query times a key is scaled by before the softmax."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def is_windowed(self, layer: int) -> bool:
        return self.window is not None and (not self.windowed or self.windowed[layer])

    def rope_of(self, layer: int) -> tuple[float, tuple[float, ...] | None]:
        """Layer `layer`'s rope base and frequency multipliers."""
        if self.window_rope_base is not None and self.is_windowed(layer):
            return self.window_rope_base, None
        return self.rope_base, self.rope_freqs

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def random_weights(cfg: LlamaConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Weights of the right shapes and scale, for stand-ins and tests."""
    rng = np.random.default_rng(seed)
    hd, h = cfg.head_dim, cfg.hidden

    def w(shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)

    out = {"embed": w((cfg.vocab, h), 1.0 / 0.02**2), "norm": (1 + 0.1 * rng.standard_normal(h)).astype(dtype)}
    for i in range(cfg.layers):
        out |= {
            f"l{i}.attn_norm": (1 + 0.1 * rng.standard_normal(h)).astype(dtype),
            f"l{i}.ffn_norm": (1 + 0.1 * rng.standard_normal(h)).astype(dtype),
            f"l{i}.wq": w((h, cfg.heads * hd), h),
            f"l{i}.wk": w((h, cfg.kv_heads * hd), h),
            f"l{i}.wv": w((h, cfg.kv_heads * hd), h),
            f"l{i}.wo": w((cfg.heads * hd, h), cfg.heads * hd),
            f"l{i}.w_gate": w((h, cfg.ffn), h),
            f"l{i}.w_up": w((h, cfg.ffn), h),
            f"l{i}.w_down": w((cfg.ffn, h), cfg.ffn),
        }
        if cfg.qk_norm:
            out |= {f"l{i}.{n}": (1 + 0.1 * rng.standard_normal(hd)).astype(dtype) for n in QK_NORMS}
        if cfg.post_norms:
            out |= {f"l{i}.{n}": (1 + 0.1 * rng.standard_normal(h)).astype(dtype) for n in POST_NORMS}
        if cfg.qkv_bias:
            out |= {f"l{i}.bq": w((cfg.heads * hd,), 4.0)}
            out |= {f"l{i}.{b}": w((cfg.kv_heads * hd,), 4.0) for b in ("bk", "bv")}
    if not cfg.tied:
        out["output"] = w((h, cfg.vocab), h)
    return out


# -- the single-process NumPy reference ------------------------------------------------------------


# the KV cache's element types (llama.cpp's --cache-type-k / -v names): float16 halves what a decode
# step reads of a long context, its keys and values rounded to float16 as they are written
CACHE_TYPES = {"f32": np.float32, "f16": np.float16}


class ReferenceDecoder:
    """One process, NumPy, float32 arithmetic: a preallocated KV cache per layer written in place,
    positions per sequence. `forward(tokens, positions)` returns logits (batch, tokens, vocab).
    `cache_types` (K, V): the caches' element types (CACHE_TYPES); what they hold is computed in
    float32 and rounded as it is stored."""

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: dict[str, np.ndarray],
        ctx: int,
        batch: int = 1,
        cache_types: tuple[str, str] = ("f32", "f32"),
    ):
        self.cfg, self.w, self.ctx = cfg, {k: np.asarray(v, np.float32) for k, v in weights.items()}, ctx
        shape = (batch, cfg.kv_heads, ctx, cfg.head_dim)
        k_type, v_type = (CACHE_TYPES[c] for c in cache_types)
        self.k = [np.zeros(shape, k_type) for _ in range(cfg.layers)]
        self.v = [np.zeros(shape, v_type) for _ in range(cfg.layers)]

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.eps) * weight

    def forward(self, tokens: np.ndarray, positions: np.ndarray, last: Sequence[int] | None = None) -> np.ndarray:
        """`last`: one token index per row; the logits are then (batch, 1, vocab), of those only."""
        cfg, w, hd = self.cfg, self.w, self.cfg.head_dim
        batch, t = tokens.shape
        x = w["embed"][tokens]  # (batch, tokens, hidden)
        if cfg.embed_scale is not None:
            x = x * np.float32(cfg.embed_scale)
        keep = np.arange(self.ctx)[None, None, :] <= positions[:, :, None]  # (batch, tokens, ctx)
        masks = {False: np.where(keep, 0.0, -np.inf).astype(np.float32)}
        if cfg.window is not None:
            keep &= np.arange(self.ctx)[None, None, :] > positions[:, :, None] - cfg.window
            masks[True] = np.where(keep, 0.0, -np.inf).astype(np.float32)
        for i in range(cfg.layers):
            p = f"l{i}."
            mask = masks[cfg.is_windowed(i)]
            h = self._norm(x, w[p + "attn_norm"])
            q, k, v = (h @ w[p + n] + (w[p + b] if cfg.qkv_bias else 0) for n, b in QKV)
            base, freqs = cfg.rope_of(i)
            rotate = (positions, base, cfg.rope_mode, freqs)
            q, k = q.reshape(batch, t, cfg.heads, hd), k.reshape(batch, t, cfg.kv_heads, hd)
            if cfg.qk_norm:  # each head's vector RMS-normed, before rope
                q, k = self._norm(q, w[p + "q_norm"]), self._norm(k, w[p + "k_norm"])
            q, k = ref.rope(q, *rotate), ref.rope(k, *rotate)
            v = v.reshape(batch, t, cfg.kv_heads, hd)
            for b in range(batch):
                self.k[i][b][:, positions[b]] = k[b].transpose(1, 0, 2)
                self.v[i][b][:, positions[b]] = v[b].transpose(1, 0, 2)
            q = q.reshape(batch, t, cfg.kv_heads, cfg.group, hd).transpose(0, 2, 3, 1, 4)  # (b, kv, g, t, hd)
            # a Python float: a NumPy float64 scalar would turn every later value into float64
            keys, values = self.k[i].astype(np.float32), self.v[i].astype(np.float32)
            scores = q @ keys[:, :, None].transpose(0, 1, 2, 4, 3)
            scores = scores / math.sqrt(hd) if cfg.attn_scale is None else scores * np.float32(cfg.scale)
            if cfg.attn_softcap is not None:
                cap = np.float32(cfg.attn_softcap)
                scores = np.tanh(scores / cap) * cap
            scores = scores + mask[:, None, None]
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            attn = (scores / scores.sum(-1, keepdims=True)) @ values[:, :, None]  # (b, kv, g, t, hd)
            out = attn.transpose(0, 3, 1, 2, 4).reshape(batch, t, cfg.heads * hd) @ w[p + "wo"]
            x = x + (self._norm(out, w[p + "attn_post_norm"]) if cfg.post_norms else out)
            h = self._norm(x, w[p + "ffn_norm"])
            gate, up = h @ w[p + "w_gate"], h @ w[p + "w_up"]
            out = (ref.gelu_f16(gate) if cfg.gate == "gelu" else gate / (1.0 + np.exp(-gate))) * up
            out = out @ w[p + "w_down"]
            x = x + (self._norm(out, w[p + "ffn_post_norm"]) if cfg.post_norms else out)
        if last is not None:
            x = x[np.arange(batch), np.asarray(last)][:, None]
        x = self._norm(x, w["norm"])
        logits = x @ (w["embed"].T if cfg.tied else w["output"])
        if cfg.final_softcap is not None:
            logits = np.tanh(logits / np.float32(cfg.final_softcap)) * np.float32(cfg.final_softcap)
        assert logits.dtype == np.float32, "the reference computes in float32 throughout"
        return logits


# -- tensor parallel -------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight kept in its file's ggml blocks (split_state/quant.py): `blocks` is (rows, row
    blocks, block bytes) with a linear layer's rows its outputs, as GGUF stores it ((out, in),
    the transpose of the float32 (in, out) layout). The workers get it interleaved (`placed`)."""

    format: str
    blocks: np.ndarray

    def placed(self, state, name: str, n: int, rows_axis: int = 1):
        """(the workers' interleaved array (a view), its split state) for `state`, a split of the
        float32 weight whose axis `rows_axis` holds this weight's rows: 1 for a linear layer's
        (in, out), 0 for an embedding table's (vocab, hidden). A split of the rows splits whole
        groups of lanes (any extents: the lanes are chosen to divide them); a split of a linear
        layer's inputs splits the blocks, on block boundaries only."""
        rows = self.blocks.shape[0]
        split = isinstance(state, Split)
        extents = [e for seg in state.segments for e in seg] if split and state.axis == rows_axis else []
        lanes = lanes_for([rows, *extents], quant_format(self.format).lanes)
        array = interleave(self.blocks, lanes)
        if not split:
            return array, state
        if extents:
            return array, Split(0, tuple(tuple(e // lanes for e in seg) for seg in state.segments), state.on)
        block = quant_format(self.format).block
        if any(e % block for seg in state.segments for e in seg):
            raise ShapeError(
                f"{name}: a {self.format} weight splits its inputs on {block}-value blocks, and "
                f"{state.segments} over {n} devices does not fall on them"
            )
        return array, Split(1, tuple(tuple(e // block for e in seg) for seg in state.segments), state.on)


def qkv_fusable(kinds: Callable[[str], str | None], cfg: LlamaConfig) -> bool:
    """Whether every layer's wq, wk and wv are of one kind (`kinds(name)`: the format a weight is
    kept in, None for float), so they can be one weight (TensorParallelLlama's fuse_qkv)."""
    return all(len({kinds(f"l{i}.{n}") for n, _ in QKV}) == 1 for i in range(cfg.layers))


def _query_unit(source: Source, cfg: LlamaConfig) -> int:
    """The fewest query heads a device may hold apart (besides none): a wo kept quantized splits
    its inputs, the heads' values, on whole blocks (16-value heads of a 32-value format go two
    by two). As _down_block, only a quantized first layer makes it look at the others."""
    if not isinstance(source("l0.wo"), QuantizedWeight):
        return 1
    quantized = [w for i in range(cfg.layers) if isinstance(w := source(f"l{i}.wo"), QuantizedWeight)]
    block = max((quant_format(w.format).block for w in quantized), default=1)
    return block // math.gcd(block, cfg.head_dim)


def _down_block(source: Source, cfg: LlamaConfig) -> int:
    """The largest block of the w_down weights kept quantized (32 if none): their inputs, the
    FFN, split on it. Only a quantized first layer makes it look at the others, so a float32
    source is not asked for a weight twice."""
    if not isinstance(source("l0.w_down"), QuantizedWeight):
        return 32
    blocks = [
        quant_format(w.format).block
        for i in range(cfg.layers)
        if isinstance(w := source(f"l{i}.w_down"), QuantizedWeight)
    ]
    return max(blocks, default=32)


# a decoder layer's weights, "l{i}." + each
LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate_up", "w_down")
LAYER_WEIGHTS_FUSED = ("attn_norm", "w_qkv", "wo", "ffn_norm", "w_gate_up", "w_down")  # with fuse_qkv
QKV = (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))  # the attention's input products and their biases
QKV_BIASES = tuple(b for _, b in QKV)  # a layer's further weights with LlamaConfig.qkv_bias
QK_NORMS = ("q_norm", "k_norm")  # a layer's further weights with LlamaConfig.qk_norm: one head's size each
POST_NORMS = ("attn_post_norm", "ffn_post_norm")  # a layer's further weights with LlamaConfig.post_norms
PREFILL_STEPS = 24  # prefill chains a model keeps (one per padded length, pool, logits, slot or not)
PREFILL_CHUNK = 128  # the most tokens of a prompt one prefill step takes while its prompts go on
# the most runs of one prefill chain (one message a worker): a long prompt's chunks go ~1,000 runs
# at a time (32 chunks of a 30-layer model), whose header (~300 bytes a run) stays well inside
# a message's 1 MiB (transport.protocol.Limits.header_bytes)
PREFILL_CHAIN_RUNS = 1024


def cache_lengths(cfg: LlamaConfig, ctx: int) -> list[int]:
    """The positions each layer's K and V caches hold: `ctx`, or, on a windowed layer, a ring of
    the window plus a prefill step's tokens (its padding included) where that is fewer (position p in slot p % ring: a
    step's writes never reach a slot a query of it still sees). So a long context costs memory
    on the global layers only (Gemma 3 at 32,768: a sixth of its layers' caches)."""
    step = padded_length(PREFILL_CHUNK, 1 << 30)  # a prefill step's most tokens, its padding included
    ring = None if cfg.window is None else cfg.window + step
    return [ring if ring is not None and ring < ctx and cfg.is_windowed(i) else ctx for i in range(cfg.layers)]


@dataclass(frozen=True)
class LayerGroups:
    """Which workers hold which layers: `groups` (each a sorted tuple of workers, all of one
    size, together every worker once), the layers in consecutive runs over them in order:
    `counts` of them each where given (`balanced`), else as many each (the first groups one more
    where they do not divide). The embedding is on the first group, the final norm and head on
    the last."""

    groups: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        groups = tuple(tuple(int(d) for d in g) for g in self.groups)
        flat = sorted(d for g in groups for d in g)
        if not groups or flat != list(range(len(flat))) or len({len(g) for g in groups}) != 1:
            raise ValueError(f"layer groups {self.groups}: groups of one size that hold every worker 0..n-1 once")
        if any(list(g) != sorted(g) for g in groups):
            raise ValueError(f"layer groups {self.groups}: list each group's workers in order")
        counts = tuple(int(c) for c in self.counts)
        if counts and (len(counts) != len(groups) or min(counts) < 1):
            raise ValueError(f"layer counts {self.counts}: one a group ({len(groups)}), each 1 or more")
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "counts", counts)

    def balanced(self, layer_costs: Sequence[float], head_cost: float) -> LayerGroups:
        """These groups with as many consecutive layers each as makes the most any group costs
        least: a layer's cost each (its weights' elements, a token's multiply-adds with them),
        and the last group the head's besides (the output, or a tied table's copy: on
        SmolLM2-135M as much as eight layers). The groups of a layer split take turns in one
        sequence's step, whatever the cut, but run side by side in pipelined lanes and a long
        prompt's chunks, whose pace the busiest sets (vLLM's VLLM_PP_LAYER_PARTITION sets such
        a cut by hand). Measured on SmolLM2-135M Q4_1, 2 groups of one worker, 8 lanes' rows:
        19 + 11 layers decoded at 512-521 tok/s, the even 15 + 15 at 449-468, 21 + 9 at 455-463
        (2-core Intel VM)."""
        count, layers = len(self.groups), len(layer_costs)
        if layers < count:
            return self
        prefix = np.concatenate([[0.0], np.cumsum(layer_costs, dtype=np.float64)])
        # best[g][i]: the least possible most-cost of groups 0..g holding layers 0..i-1
        best = np.full((count, layers + 1), np.inf)
        cut = np.zeros((count, layers + 1), np.int64)
        best[0, 1:] = prefix[1:]
        for g in range(1, count):
            for i in range(g + 1, layers + 1):
                extra = head_cost if g == count - 1 else 0.0
                starts = np.arange(g, i)  # group g holds layers starts..i-1
                costs = np.maximum(best[g - 1, starts], prefix[i] - prefix[starts] + extra)
                j = int(np.argmin(costs))
                best[g, i], cut[g, i] = costs[j], starts[j]
        counts, end = [], layers
        for g in range(count - 1, 0, -1):
            start = int(cut[g, end])
            counts.append(end - start)
            end = start
        return LayerGroups(self.groups, (end, *reversed(counts)))

    @classmethod
    def even(cls, n: int, count: int) -> LayerGroups:
        """`count` groups of consecutive workers of `n`."""
        if count < 1 or n % count:
            raise ValueError(f"{count} layer groups of {n} workers: the groups must be of one size")
        size = n // count
        return cls(tuple(tuple(range(g * size, (g + 1) * size)) for g in range(count)))

    @property
    def size(self) -> int:
        return len(self.groups[0])

    def of_layer(self, layer: int, layers: int) -> tuple[int, ...]:
        if self.counts and sum(self.counts) != layers:
            raise ValueError(f"layer counts {self.counts} for {layers} layers")
        base, extra = divmod(layers, len(self.groups))
        counts = self.counts or [base + (g < extra) for g in range(len(self.groups))]
        first = 0
        for count, group in zip(counts, self.groups):
            first += count
            if layer < first:
                return group
        raise IndexError(f"layer {layer} of {layers}")


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads each device holds: `query[d]` query heads (in order) and the KV heads
    `kv[d]` they read (the model's indices, in order). The devices' KV heads side by side are
    the model's KV axis as the workers hold it (`kv_source`): a KV head held by two devices is
    there twice, its K and V products and cache rows computed by both. `kv_of_head`: each query
    head's KV head on that axis."""

    query: tuple[int, ...]
    kv: tuple[tuple[int, ...], ...]
    kv_of_head: tuple[int, ...]

    @classmethod
    def whole_groups(cls, cfg: LlamaConfig, n: int) -> HeadSplit:
        """Whole KV heads per device with their query heads (some devices may hold none)."""
        return cls._holding(cfg, tuple(e * cfg.group for e in Split.even(0, cfg.kv_heads, n).segments[0]))

    @classmethod
    def even_queries(cls, cfg: LlamaConfig, n: int, unit: int = 1) -> HeadSplit:
        """The query heads evenly in units of `unit` heads (at most one unit more on the first
        devices), each device holding the KV heads of its query heads: SmolLM2's 9 heads of 3
        KV heads on 2 devices split 5 | 4 over KV heads (0, 1) | (1, 2), where whole groups
        split 6 | 3 and the first device did twice the second's attention (its products,
        scores and cache writes)."""
        return cls._holding(cfg, Split.even(0, cfg.heads, n, granularity=unit).segments[0])

    @classmethod
    def for_workers(cls, cfg: LlamaConfig, n: int, unit: int = 1) -> HeadSplit:
        """even_queries (in units of `unit` heads: wo's inputs split on whole blocks) where the
        KV heads do not divide among the devices, else whole_groups (the same split where they
        divide). Both backends run the gqa_attention op a shared KV head needs inside a decode
        step's device graph (the CUDA backend's mapped attention kernels)."""
        if cfg.kv_heads % n and cfg.heads % unit == 0 and cfg.attn_softcap is None:
            return cls.even_queries(cfg, n, unit)
        return cls.whole_groups(cfg, n)  # soft-capped scores: the fused gqa_attention has no cap

    @classmethod
    def _holding(cls, cfg: LlamaConfig, query: Sequence[int]) -> HeadSplit:
        """Query heads `query[d]` per device, in order, with the KV heads they read."""
        g, first, kv, kv_of_head = cfg.group, 0, [], []
        for q in query:
            held = tuple(range(first // g, -(-(first + q) // g))) if q else ()
            base = sum(len(k) for k in kv)
            kv_of_head.extend(base + h // g - first // g for h in range(first, first + q))
            kv.append(held)
            first += q
        return cls(tuple(query), tuple(kv), tuple(kv_of_head))

    @property
    def kv_source(self) -> tuple[int, ...]:
        return tuple(h for heads in self.kv for h in heads)

    @property
    def shared(self) -> bool:
        """Whether some KV head is held by two devices (else the workers' KV axis is the model's)."""
        return len(self.kv_source) != len(set(self.kv_source))


def _heads_taken(source: Source, plan: HeadSplit, hd: int) -> Source:
    """`source` with wk, wv (and bk, bv) on the workers' KV axis: each KV head's columns (rows of
    a weight kept in its blocks) where plan.kv_source has it, a shared head's twice."""
    columns = np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in plan.kv_source])
    kv_names = tuple(n for pair in QKV[1:] for n in pair)

    def taken(name: str):
        weight = source(name)
        if name.rsplit(".", 1)[-1] not in kv_names:
            return weight
        if isinstance(weight, QuantizedWeight):  # its rows are the outputs
            return QuantizedWeight(weight.format, weight.blocks[columns])
        return np.asarray(weight)[..., columns]

    return taken


def _product(x: Tensor, weight: Tensor, fmt: str | None, activations: str) -> Tensor:
    """x @ weight, on the file's blocks when the weight is kept quantized (`fmt`: its format),
    x's rows in 8-bit blocks first where `activations` is "q8" (meta.tensor.qmatmul)."""
    return x @ weight if fmt is None else qmatmul(x, weight, fmt, activations)


def _row_of(cache: Tensor, row: Tensor) -> Tensor:
    """Batch row `row` (a fed 0-d index) of a cache (batch, kv heads, ctx, hd) split by KV
    heads, as (1, kv heads, ctx, hd) split alike: a lookup in the cache flattened to one row
    per batch row (each device copies its heads' part of the row)."""
    batch, *rest = cache.shape
    return get_rows(cache.reshape(batch, math.prod(rest)), row.reshape(1)).reshape(1, *rest)


def _as_cached(new: Tensor, cache: Tensor) -> Tensor:
    """New keys or values as the cache holds them (rounded to float16 in a float16 cache), so
    that attention over them sees what it would read back from the cache."""
    return new if new.dtype == cache.dtype else new.astype(cache.dtype)


def padded_length(tokens: int, room: int) -> int:
    """The length a prompt of `tokens` is padded to, at most `room` (the positions left in the
    cache): a multiple of 8 up to 32, then of a quarter of the power of two below it (40, 48,
    ..., 64, 80, ..., 128, 160, ...), so at most a quarter of a prompt past 32 tokens is padding
    and a context of n positions has about 4 log2(n / 8) lengths, each planned once. A prefill
    step costs its padded rows: with a floor of 16, a 17-token prompt took 32 rows and a 1-token
    one 16, 1.3-1.9x the time of 24 and 8 on two workers of SmolLM2 (a server's time to first
    token, and the time every prompt of a burst holds the running streams up)."""
    granule = max(8, 1 << max(0, tokens.bit_length() - 3))
    return max(tokens, min(room, -(-tokens // granule) * granule))


@dataclass(frozen=True)
class PrefillChain:
    """The captured steps a prefill of one padded length runs in one chain (MetaDevice.chain):
    the embedding, each layer's step (one per kind of layer, shared), the head. One layer is
    planned and loaded, not thirty: a first prompt's planning and loading is a few
    milliseconds, not a tenth of its prefill."""

    embed: Step
    layers: list[Step]
    head: Step


Source = Callable[[str], "np.ndarray | QuantizedWeight"]  # weight name -> the whole weight (a GGUF file, a dict)


class TensorParallelLlama:
    """The decoder on a MetaDevice. `step(tokens, positions)` builds one step's graph (lazy) and
    returns the logits handle, split by vocabulary; `pick(logits, k)` the top-k over them."""

    def __init__(
        self,
        dev: MetaDevice,
        cfg: LlamaConfig,
        source: Source,
        ctx: int,
        batch: int = 1,
        progress=None,
        cache_types: tuple[str, str] = ("f32", "f32"),
        fuse_qkv: bool = False,
        heads: HeadSplit | None = None,
        activations: str = "f32",
        layer_groups: LayerGroups | None = None,
    ):
        """`cache_types` (K, V): the KV caches' element types, CACHE_TYPES's names. `fuse_qkv`:
        wq | wk | wv as one weight `w_qkv` of three segments, one product a layer where there
        were three (the source's q, k and v weights must be of one kind in every layer: all
        float, or all kept in one format; see qkv_fusable). `heads`: how the attention heads
        split (by default HeadSplit.for_workers). `activations`: the quantized products' ("f32":
        exact, float32 activations; "q8": llama.cpp's 8-bit activations and integer products,
        what LLM, the server and generate run unless told). `layer_groups`: the layers on
        groups of the workers (a layer split), each split over its group only; None: every
        layer over every worker."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
        self.activations = activations
        self.dev, self.cfg, self.ctx, self.batch = dev, cfg, ctx, batch
        self.fuse_qkv = fuse_qkv
        unknown = [c for c in cache_types if c not in CACHE_TYPES]
        if len(cache_types) != 2 or unknown:
            raise ValueError(f"cache types are two of {', '.join(CACHE_TYPES)} (K, V), got {cache_types}")
        self.cache_types = tuple(cache_types)
        if layer_groups is not None and max(d for g in layer_groups.groups for d in g) != dev.n - 1:
            raise ValueError(f"layer groups {layer_groups.groups} for {dev.n} workers")
        self.layer_groups = None if layer_groups is None or len(layer_groups.groups) == 1 else layer_groups
        # the workers one layer is split over: all of them, or a group's
        n, hd = (dev.n if self.layer_groups is None else self.layer_groups.size), cfg.head_dim
        if heads is None:
            heads = HeadSplit.for_workers(cfg, n, _query_unit(source, cfg))
        if len(heads.query) != n or sum(heads.query) != cfg.heads:
            raise ValueError(f"heads: {heads.query} query heads per device, for {cfg.heads} over {n} devices")
        self.heads = heads
        if self.heads.shared:
            source = _heads_taken(source, self.heads, hd)
        self.kv_heads = len(self.heads.kv_source)  # the workers' KV axis: the model's, or with shared heads twice
        kv_cols = tuple(len(kv) * hd for kv in self.heads.kv)
        q_cols = tuple(q * hd for q in self.heads.query)
        vocab_rows = Split.even(0, cfg.vocab, n)
        # whole blocks of the FFN per device (32 values, 256 for K-quants), so a quantized w_down
        # splits on them
        block = _down_block(source, cfg)
        ffn = Split.even(0, cfg.ffn // block, n).scaled(block) if cfg.ffn % block == 0 else Split.even(0, cfg.ffn, n)
        self.ffn_extents = ffn.segments[0]
        self.w: dict[str, Tensor] = {}
        self.formats: dict[str, str] = {}  # the weights kept quantized, and their format
        place = self._placer(source)
        place("embed", vocab_rows)
        place("norm", MIRRORED)
        if not cfg.tied:
            place("output", Split.even(1, cfg.vocab, n))
        elif self.layer_groups is not None:
            # the head's table on the head's group too (as llama.cpp duplicates a tied output):
            # the logits come from where the last layer is, not a hand-over back to the first
            place("head", vocab_rows, source_name="embed")
        for i in range(cfg.layers):
            self._place_layer(source, place, f"l{i}.", q_cols, kv_cols)
            if progress is not None:
                progress(i + 1, cfg.layers)
        cache = Split(1, (tuple(len(kv) for kv in self.heads.kv),))  # split by KV heads
        # K and V as (batch, kv heads, ctx, hd): a position's key is one contiguous row, written
        # in one piece, and the used positions are one contiguous block per head (read in half
        # the time of the first n columns of (hd, ctx), 64 strided runs at 256 positions)
        k_type, v_type = (CACHE_TYPES[c] for c in cache_types)
        lengths = cache_lengths(cfg, ctx)
        caches = [self._on(cache, f"l{i}.") for i in range(cfg.layers)]
        self.k = [self._zeros((batch, self.kv_heads, m, hd), c, k_type) for m, c in zip(lengths, caches)]
        self.v = [self._zeros((batch, self.kv_heads, m, hd), c, v_type) for m, c in zip(lengths, caches)]
        # the windowed layers' ring (cache_lengths), None where their caches hold the context
        self.ring = next((n for n in lengths if n < ctx), None)
        # (padded length, pool, logits, for a slot) -> captured step; a slot is fed, so one step
        # serves every slot of a server (8 slots x 8 lengths were 64 steps for 16 kept)
        self._prefills: dict[tuple, object] = {}
        self.positions_ctx = dev.tensor(np.arange(ctx, dtype=np.int32).reshape(1, ctx))
        self._mask_tensors()

    def _place_layer(self, source: Source, place, p: str, q_cols: tuple, kv_cols: tuple) -> None:
        """Layer p's weights on the devices, each split as its products take it (q_cols, kv_cols:
        each device's query and KV columns)."""
        place(p + "attn_norm", MIRRORED)
        place(p + "ffn_norm", MIRRORED)
        for norm in QK_NORMS if self.cfg.qk_norm else ():
            place(p + norm, MIRRORED)  # a head's size: every device's heads use all of it
        for norm in POST_NORMS if self.cfg.post_norms else ():
            place(p + norm, MIRRORED)
        if self.fuse_qkv:
            qkv_parts = (("wq", q_cols), ("wk", kv_cols), ("wv", kv_cols))
            self.w[p + "w_qkv"] = self._fused(source, p, qkv_parts, "w_qkv")
        else:
            place(p + "wq", Split(1, (q_cols,)))
            place(p + "wk", Split(1, (kv_cols,)))
            place(p + "wv", Split(1, (kv_cols,)))
        if self.cfg.qkv_bias:  # split as their product's columns
            place(p + "bq", Split(0, (q_cols,)))
            place(p + "bk", Split(0, (kv_cols,)))
            place(p + "bv", Split(0, (kv_cols,)))
        place(p + "wo", Split(0, (q_cols,)))
        place(p + "w_down", Split(0, (self.ffn_extents,)))
        ffn_parts = (("w_gate", self.ffn_extents), ("w_up", self.ffn_extents))
        self.w[p + "w_gate_up"] = self._fused(source, p, ffn_parts, "w_gate_up")

    def _mask_tensors(self) -> None:
        """What a step's masks are made from (the window, the ring's slots), on the devices once."""
        cfg, dev = self.cfg, self.dev
        # the masks a step makes: False, the causal one, for layers without a window; True, the
        # causal one within the window, for layers with one
        self.mask_kinds = sorted({cfg.is_windowed(i) for i in range(cfg.layers)})
        self.zero = dev.tensor(np.float32(0))
        self.minus_inf = dev.tensor(np.float32(-np.inf))
        if cfg.window is not None:
            self.window_length = dev.tensor(np.int32(cfg.window))
        if self.ring is not None:  # the ring's slots and its length
            self.ring_slots = dev.tensor(np.arange(self.ring, dtype=np.int32).reshape(1, self.ring))
            self.ring_length = dev.tensor(np.int32(self.ring))
            self.no_position = dev.tensor(np.int32(-1))

    def _on(self, state: State, name: str) -> State:
        """`state`, a split over the workers one layer is split over, as the workers of weight
        `name`'s group hold it (a layer's "l{i}." prefix, the embedding, the head's)."""
        groups = self.layer_groups
        if groups is None:
            return state
        if name.startswith("l") and "." in name:
            group = groups.of_layer(int(name[1 : name.index(".")]), self.cfg.layers)
        else:
            group = groups.groups[0] if name == "embed" else groups.groups[-1]
        return widen(state, group, self.dev.n)

    def _placer(self, source: Source):
        def place(name: str, state, source_name: str = "") -> None:
            state = self._on(state, name)
            weight = source(source_name or name)
            if isinstance(weight, QuantizedWeight):
                self.formats[name] = weight.format
                # the table is (vocab, hidden) both as float32 and in the file
                table = (source_name or name) == "embed"
                weight, state = weight.placed(state, name, self.dev.n, rows_axis=0 if table else 1)
            self.w[name] = self.dev.tensor(weight, state, name=name)  # each worker gets its slice

        return place

    def _fused(self, source: Source, p: str, parts: tuple[tuple[str, tuple[int, ...]], ...], fused: str) -> Tensor:
        """Weights (hidden, cols) of one layer side by side as one weight `fused`, a segment each,
        each split by its own extents (`parts`: (name, extents) pairs): one product where there
        were several (w_gate | w_up; wq | wk | wv). Built per device from the parts (the whole
        never exists). Kept quantized (all parts in one format), it is the parts' interleaved
        row groups one after another, with the lanes that divide all of them, split on the
        groups alike."""
        weights = [source(p + name) for name, _ in parts]
        state = self._on(Split(1, tuple(extents for _, extents in parts)), p)
        extents_of = [(name, state.segments[j]) for j, (name, _) in enumerate(parts)]  # over every worker
        quantized = [isinstance(w, QuantizedWeight) for w in weights]
        if all(quantized) and len({w.format for w in weights}) == 1:
            self.formats[p + fused] = weights[0].format
            rows = [w.blocks.shape[0] for w in weights]
            lanes = lanes_for(
                [*rows, *(e for _, extents in extents_of for e in extents)], quant_format(weights[0].format).lanes
            )
            weights = [interleave(w.blocks, lanes) for w in weights]
            state = Split(0, tuple(tuple(e // lanes for e in extents) for _, extents in extents_of), state.on)
        elif any(quantized):
            names = ", ".join(p + name for name, _ in parts)
            raise ShapeError(f"{names} must all be kept quantized in one format, or none")
        axis = state.axis
        starts = np.cumsum([0, *(w.shape[axis] for w in weights)])

        def make(device, pieces):
            taken = []
            for piece in pieces:  # a piece lies within one part: the segments are the parts
                i = int(np.searchsorted(starts, piece.global_start, side="right")) - 1
                index = [slice(None)] * weights[i].ndim
                index[axis] = slice(piece.global_start - starts[i], piece.global_stop - starts[i])
                taken.append(weights[i][tuple(index)])
            if taken:
                return np.concatenate(taken, axis=axis)
            return np.zeros(local_shape(state, shape, self.dev.n, device), weights[0].dtype)

        shape = list(weights[0].shape)
        shape[axis] = int(starts[-1])
        return self.dev.from_generator(tuple(shape), weights[0].dtype, state, make, name=p + fused)

    def _mm(self, x: Tensor, name: str) -> Tensor:
        """x @ weight `name`, on its file's blocks when it is kept quantized."""
        return _product(x, self.w[name], self.formats.get(name), self.activations)

    def _zeros(self, shape, state, dtype=np.float32) -> Tensor:
        n = self.dev.n
        return self.dev.from_generator(
            shape, dtype, state, lambda d, pieces: np.zeros(local_shape(state, shape, n, d), dtype)
        )

    def _norm(self, x: Tensor, name: str) -> Tensor:
        return x.rms_norm(eps=self.cfg.eps) * self.w[name]

    def step(self, tokens, positions, last: Sequence[int] | Tensor | None = None, rows_from: int = 0) -> Tensor:
        """Logits (batch, tokens, vocab), split by vocabulary; caches written at `positions`.
        tokens, positions: (batch, tokens) host arrays, or fed tensors (see capture_decode);
        fewer rows than the caches' batch are its rows from `rows_from` on (by default its first).
        `last`: one token index per row; the logits are then (batch, 1, vocab), of those tokens
        only (a prefill needs no others: the head is a fifth of a SmolLM2 prompt's work). A fed
        tensor `last` holds those tokens' rows of the flattened (batch * tokens) instead."""
        dev = self.dev
        batch, t = tokens.shape
        if not 0 <= rows_from <= self.batch - batch:
            raise ShapeError(f"a step of {batch} rows from row {rows_from}: the caches hold {self.batch} rows")
        if self.ring is not None and t > self.ring - self.cfg.window:
            raise ShapeError(
                f"a step of {t} tokens: the windowed layers' rings of {self.ring} take at most "
                f"{self.ring - self.cfg.window} a step (prefill() takes a longer prompt by chunks)"
            )
        # host values travel with the run: no round trip of their own
        ids = tokens if isinstance(tokens, Tensor) else dev.feed(np.asarray(tokens, np.int32))
        pos = positions if isinstance(positions, Tensor) else dev.feed(np.asarray(positions, np.int32))
        if last is not None and not isinstance(last, Tensor):
            last = dev.feed(np.array([b * t + i for b, i in enumerate(last)], np.int32))
        x = self._layers(self._embed(ids), pos, self._masks(pos), rows_from=rows_from)
        return self._head(x, last)

    def _masks(self, pos: Tensor, fresh: bool = False) -> list[Tensor]:
        """The masks of `mask_kinds`, in their order (`_mask`)."""
        return [self._mask(pos, windowed, fresh) for windowed in self.mask_kinds]

    def _mask(self, pos: Tensor, windowed: bool, fresh: bool = False) -> Tensor:
        """The attention mask of tokens at `pos` (batch, tokens) over the cache's positions
        (_seeing), made once a step, so every layer reads the same one (the attention kernels
        find its used positions once a run). `fresh`: a slot's first chunk, which attends over
        its own new keys and values, not its row of the caches (copying that row out for every
        layer took a fifth of a short prompt's prefill on a server of 8 slots and 512
        positions, and grows with the context): over its own tokens' positions."""
        if fresh:
            return self._seeing(pos, pos, windowed)
        if windowed and self.ring is not None:
            return self._ring_mask(pos)
        return self._seeing(pos, self.positions_ctx, windowed)

    def _seeing(self, pos: Tensor, held: Tensor, windowed: bool) -> Tensor:
        """0 where a token at `pos` (batch, tokens) sees the position each key holds (`held`,
        (batch or 1, keys)): up to its own, and with `windowed` within the window; -inf
        elsewhere. (batch, 1, 1, tokens, keys), as the GQA layout's scores broadcast it, or
        (batch, tokens, keys) for gqa_attention (a cut KV group)."""
        batch, t = pos.shape
        rows, keys = held.shape
        if self.heads.shared:
            seeing, held = pos.reshape(batch, t, 1), held.reshape(rows, 1, keys)
        else:
            seeing, held = pos.reshape(batch, 1, 1, t, 1), held.reshape(rows, 1, 1, 1, keys)
        mask = where(held <= seeing, self.zero, self.minus_inf)
        if windowed:  # and only the last `window` positions (sliding-window attention)
            mask = where(held > seeing - self.window_length, mask, self.minus_inf)
        return mask

    def _ring_mask(self, pos: Tensor) -> Tensor:
        """`_mask` of a windowed layer whose cache is a ring (cache_lengths): slot j of a row
        holds the latest position written there, P - (P - j) % ring, P the row's last position
        in this step (positions rise along a row); a token at q sees the slots holding positions
        in (q - window, q], none before the row's first (a negative position: never written)."""
        batch, t = pos.shape
        last = pos[:, t - 1 :]  # (batch, 1)
        held = last - (last - self.ring_slots) % self.ring_length  # (batch, ring)
        mask = self._seeing(pos, held, True)
        held = held.reshape(batch, *[1] * (mask.ndim - 2), self.ring)  # as the mask broadcasts it
        return where(held > self.no_position, mask, self.minus_inf)

    def prefill(
        self, prompts: Sequence[Sequence[int]], start: int, pool: int, logits: bool = False, slot: int | None = None
    ) -> list[Tensor]:
        """Each prompt (one per batch row; rows past them are written with padding) written into
        the caches from position `start` on; returns the top `pool` (values, indices) of each
        prompt's next token, (rows, 1, pool), and with `logits` the whole (rows, 1, vocab)
        logits after them, all run. With `slot`: one prompt, a sequence in batch row `slot` (a
        server's slot) from position `start` (0: a new one), attending to that row's cache up
        to its own positions, the other rows left as they are: a long prompt can go in chunks,
        each a call of its own (the server interleaves them with its streams' decode steps).
        Several prompts with `slot`: new sequences (from position 0, each within a chunk) in
        rows slot, slot + 1, ...: the prompts that join a server together go in one step (one
        pass over the weights, as vLLM batches its prefills), each attending to its own tokens.

        Through a captured step per padded length: the prompts are padded to `padded_length`,
        so prompts of similar lengths replay one compiled program (no graph to build, plan or
        key on the coordinator) instead of planning each length anew. The padding writes the
        caches past each prompt, where nothing reads before a later step writes them: a query
        sees positions up to its own (the mask), and decoding writes a position before it
        reads it.

        Long prompts go in chunks of PREFILL_CHUNK tokens (as llama.cpp's micro-batches), each
        reading what the ones before it cached, while every prompt goes past the chunk: so the
        steps of any prompt length come from a few padded lengths (8 to 128), all planned
        once, and a step's buffers (its attention scores above all) stay the size of a chunk.
        The last step holds every prompt's last token."""
        rows_fed = self.batch if slot is None else len(prompts)
        longest = max((len(p) for p in prompts), default=0)
        if not 1 <= len(prompts) <= self.batch or not longest or start < 0 or start + longest > self.ctx:
            raise ShapeError(
                f"prefill: {len(prompts)} prompts of up to {longest} tokens from position {start}; give 1 to "
                f"{self.batch} prompts of 1 or more tokens within the caches' {self.ctx} positions"
            )
        if slot is not None and not (0 <= slot and slot + rows_fed <= self.batch):
            raise ShapeError(
                f"prefill of slot {slot}"
                + (f" and the {rows_fed - 1} after it" if rows_fed > 1 else "")
                + f": a slot is one of the rows 0..{self.batch - 1}"
            )
        if slot is not None and rows_fed > 1 and (start or longest > PREFILL_CHUNK):
            raise ShapeError(
                f"prefill of {rows_fed} slots from position {start}, up to {longest} tokens: several slots "
                f"take new prompts only (position 0), each within a chunk of {PREFILL_CHUNK} tokens"
            )
        shortest = min(len(p) for p in prompts)
        ahead = max(0, shortest - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # in whole chunks
        # only the last chunk runs the head. Where the layers are on groups, the chunks go in as
        # few chains as PREFILL_CHAIN_RUNS allows, so the groups work on successive chunks at
        # once (MetaDevice.chain); a row split's workers all-reduce every layer, so a chain a
        # chunk for them (nothing would overlap)
        pipelined = self.layer_groups is not None
        chunks = [([p[at : at + PREFILL_CHUNK] for p in prompts], at) for at in range(0, ahead, PREFILL_CHUNK)]
        chunks.append(([p[ahead:] for p in prompts], ahead))
        calls: list[tuple[Step, tuple]] = []
        starts: list[int] = []
        for k, (chunk, at) in enumerate(chunks):
            last = k == len(chunks) - 1
            runs = 1 + self.cfg.layers + (1 if last else 0)  # the embedding, the layers, the head
            if calls and (not pipelined or len(calls) + runs > PREFILL_CHAIN_RUNS):
                self.dev.chain(calls, keep=False, new_data=starts)  # the caches are written in place
                calls, starts = [], []
            starts.append(len(calls))
            calls += self._prefill_calls(chunk, start + at, pool, logits, slot, head=last, first=len(calls))
        # the candidates (and logits) come back with the chain: reading them sends nothing; the
        # residual between layers is freed after the layer that reads it
        return self.dev.chain(calls, read=range(3 if logits else 2), keep=False, new_data=starts)[-1]

    def prefill_reach(self, lengths: Sequence[int], start: int) -> int:
        """One past the last position `prefill` of prompts of these lengths from `start` writes
        in the caches: its chunks, the last one padded (padded_length)."""
        ahead = max(0, min(lengths) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
        return start + ahead + padded_length(max(lengths) - ahead, self.ctx - start - ahead)

    def kept_prefix(self, common: int, length: int, written: int) -> int:
        """How much of a row's cached prompt a new prompt of `length` tokens whose first
        `common` tokens it holds may keep: whole chunks of PREFILL_CHUNK, so the rest goes in
        the very chunks a whole prefill of it takes (the same steps on the same data, so the
        same bits: a step's rows do not depend on the other rows, but a row's arithmetic on the
        step's length, its attention's path above all); never its last token (whose logits
        choose the next); none where a windowed layer's ring was written over (reusable). The
        cached prompt must have gone in by the same chunks: from position 0, or from a kept
        prefix's end."""
        start = min(common, length - 1) // PREFILL_CHUNK * PREFILL_CHUNK
        return start if start > 0 and self.reusable(start, written) else 0

    def reusable(self, start: int, written: int) -> bool:
        """Whether a row whose caches were written up to position `written` (exclusive; padding
        and steps past a sequence's end included) may take new tokens from `start` on, keeping
        the positions before it, as a conversation's next turn does. Caches holding the context:
        always (a query sees positions up to its own, and a step writes its positions before it
        reads them). A windowed layer's ring holds each slot's latest position, and its mask
        takes a slot to hold the latest position up to the step's last (_ring_mask): positions
        the old sequence wrote past `start` are taken for older ones, and the ones a new token
        sees may have been written over. So the old sequence may have gone at most ring - window
        + 1 positions past `start`, or not have wrapped at all."""
        if self.ring is None:
            return True
        return written <= self.ring or written - start <= self.ring - self.cfg.window + 1

    def prefills_in_lanes(self, prompts: Sequence[Sequence[int]], start: int) -> bool:
        """Whether prefill_in_lanes takes these prompts: new ones (from position 0, each within a
        chunk), several, where the layers are on groups."""
        return (
            self.layer_groups is not None
            and start == 0
            and len(self.lanes(len(prompts))) > 1
            and max(len(p) for p in prompts) <= PREFILL_CHUNK
        )

    def prefill_in_lanes(self, prompts: Sequence[Sequence[int]], pool: int, first_row: int = 0, slots: bool = False):
        """New prompts (prefills_in_lanes) into the caches' rows `first_row`, ... in lanes
        (`lanes`): each lane's embedding, layers and head after the one before in one chain, the
        heads' candidates left on the head's group, so the groups work on successive lanes at
        once, as on a long prompt's chunks (one step of every prompt: each group waits for the
        one before). Each row's arithmetic is that of the step it replaces: `prefill`'s of
        every row (its keys and values written into the caches, attention reading them back),
        or with `slots` that of slots' first chunks (attention over their own keys and values,
        as a server admits prompts). Returns the top `pool` (values, indices) of each prompt's
        next token, read back: host arrays of (prompts, 1, pool)."""
        calls: list[tuple[Step, tuple]] = []
        starts, heads = [], []
        for lane in self.lanes(len(prompts)):
            starts.append(len(calls))
            rows, at = [prompts[b] for b in lane], first_row + lane.start
            where = (at, True) if slots else (None, (at, len(lane)))
            calls += self._prefill_calls(rows, 0, pool, False, where[0], True, len(calls), lane=where[1])
            heads.append(len(calls) - 1)
        results = self.dev.chain(
            calls,
            read=(0, 1),
            keep=False,
            new_data=starts,
            also_read=[Earlier(h, j) for h in heads[:-1] for j in (0, 1)],
        )
        return tuple(np.concatenate([results[h][j].numpy() for h in heads]) for j in (0, 1))

    def _prefill_calls(
        self,
        prompts: Sequence[Sequence[int]],
        start: int,
        pool: int,
        logits: bool,
        slot: int | None,
        head: bool,
        first: int,
        lane: tuple[int, int] | bool | None = None,
    ) -> list[tuple[Step, tuple]]:
        """The calls of a chain (MetaDevice.chain) prefilling one chunk of each prompt from
        position `start`: the embedding, each layer, and with `head` the head; `first`: the
        index in the chain of the first of them; `lane`: a lane's (prefill_in_lanes): True for
        slots', else (first row, rows) of the caches."""
        rows_fed = len(prompts) if slot is not None or lane else self.batch
        longest = max(len(p) for p in prompts)
        t = padded_length(longest, self.ctx - start)
        tokens = np.zeros((rows_fed, t), np.int32)
        rows = np.zeros(rows_fed, np.int32)  # each row's last token in the flattened (rows * t)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = prompt
            rows[b] = b * t + max(len(prompt), 1) - 1
        positions = np.tile(np.arange(start, start + t, dtype=np.int32), (rows_fed, 1))
        key = (t, pool, logits, 0 if slot is None else rows_fed, slot is not None and start == 0, lane or None)
        chain = self._prefills.pop(key, None) or self._prefill_chain(*key)
        self._keep_prefill(key, chain)
        dev = self.dev
        pos = dev.feed(positions)  # one fed tensor that every layer reads
        fed_slot = () if slot is None else (dev.feed(np.int32(slot)),)
        calls = [(chain.embed, (tokens, pos))]
        for i, layer in enumerate(chain.layers):
            weights, _ = self._layer_weights(i)
            x = Earlier(first + len(calls) - 1, 0)  # the last call's x: the embedding's, then each layer's
            mask = Earlier(first, 1 + self.mask_kinds.index(self.cfg.is_windowed(i)))
            calls.append((layer, (x, pos, mask, *weights.values(), self.k[i], self.v[i], *fed_slot)))
        if head:
            calls.append((chain.head, (Earlier(first + len(calls) - 1, 0), rows)))
        return calls

    def _prefill_chain(
        self, t: int, pool: int, logits: bool, slots: int, fresh: bool = False, lane: tuple[int, int] | None = None
    ) -> PrefillChain:
        """The steps of a prefill of `t` tokens a row, planned, compiled and loaded on the
        workers (not run): the embedding, one step per kind of layer (its weights' shapes,
        states and formats: every layer of SmolLM2 is one kind), the head. `slots`: 0 for every
        row of the caches, else the rows of that many slots from a fed one. `fresh`: slots'
        first chunks (from position 0), whose attention reads their own keys and values (_layer).
        `lane`: a lane's (prefill_in_lanes), its head's candidates left on the head's group; of
        slots, or (first row, rows) of the caches."""
        rows_from, rows = lane if isinstance(lane, tuple) else (0, 0)
        slotted, rows_fed = slots > 0, slots or rows or self.batch
        tokens = np.zeros((rows_fed, t), np.int32)
        positions = np.tile(np.arange(t, dtype=np.int32), (rows_fed, 1))
        dev = self.dev
        embed = dev.prepare(self._embed_graph(fresh), tokens, positions)
        plan = embed.compiled.plan
        # stand for any value
        x, *masks = (dev.placeholder(*embed.outs[j], plan.out_states[j]) for j in range(1 + len(self.mask_kinds)))
        slot = (np.int32(0),) if slotted else ()  # any row: it is fed
        kinds: dict[tuple, Step] = {}
        layers = []
        for i in range(self.cfg.layers):
            weights, formats = self._layer_weights(i)
            held = [*weights.values(), self.k[i], self.v[i]]
            windowed = self.cfg.is_windowed(i)
            kind = (tuple(formats.values()), x.state, windowed, *((a.shape, a.node.dtype, a.state) for a in held))
            if kind not in kinds:
                mask = masks[self.mask_kinds.index(windowed)]
                graph = self._layer_graph(formats, i, fresh, rows_from)
                kinds[kind] = dev.prepare(graph, x, positions, mask, *held, *slot)
            layers.append(kinds[kind])
            state = kinds[kind].compiled.plan.out_states[0]  # the residual's: Partial over 2 or more devices
            if state != x.state:
                x = dev.placeholder(x.shape, x.dtype, state)
        head = dev.prepare(self._head_graph(pool, logits, lane is not None), x, np.zeros(rows_fed, np.int32))
        return PrefillChain(embed, layers, head)

    def _embed_graph(self, fresh: bool = False):
        """(ids, positions) -> [x (rows, tokens, hidden), the attention masks]: a prompt
        attends to the positions up to its own in the cache (a slot's prompt: in its row; a
        slot's first chunk: among its own tokens, `fresh`)."""

        def graph(ids: Tensor, pos: Tensor) -> list[Tensor]:
            return [self._embed(ids), *self._masks(pos, fresh)]

        return graph

    def _layer_graph(self, formats: dict[str, str | None], layer: int, fresh: bool = False, rows_from: int = 0):
        """(x, positions, mask, *a layer's weights, cache K, cache V[, slot]) -> [x after the layer,
        the caches written in place], for a layer of the kind of layer `layer` (its rope, its
        window). The residual stays as the planner leaves it between layers (Partial over
        several devices: each adds its share, one all-reduce before each norm), the same sums in
        the same order as one program of every layer. `rows_from`: x's rows are the caches'
        from there on (a lane's: prefill_in_lanes)."""
        names = self._layer_names
        count = len(names)

        def graph(x: Tensor, pos: Tensor, mask: Tensor, *rest: Tensor) -> list[Tensor]:
            weights = dict(zip(names, rest[:count]))
            cache_k, cache_v, *slot = rest[count:]
            x, cache_k, cache_v = self._layer(
                weights, formats, x, pos, mask, cache_k, cache_v, *slot, layer=layer, fresh=fresh, rows_from=rows_from
            )
            return [x, cache_k, cache_v]

        return graph

    def _head_graph(self, pool: int, logits: bool, lane: bool = False):
        """(x, the rows of the last tokens) -> [the top `pool` (values, indices), with `logits`
        the logits]; with `lane` (prefill_in_lanes) the candidates stay on the head's group."""

        def graph(x: Tensor, rows: Tensor) -> list[Tensor]:
            out = self._head(x, rows)
            candidates = list(out.top_k(pool))
            return [*(candidates if lane else self._everywhere(candidates)), *([out] if logits else [])]

        return graph

    def _keep_prefill(self, key: tuple, chain: PrefillChain) -> None:
        self._prefills[key] = chain  # now the latest: past PREFILL_STEPS the oldest goes
        if len(self._prefills) > PREFILL_STEPS:
            self._prefills.pop(next(iter(self._prefills)))

    def warm_up(self, pool: int, lengths: Sequence[int] | None = None, slots: bool = False) -> int:
        """Plan, compile and load the prefill steps of prompts of `lengths` tokens (by default
        every padded length up to a chunk: any prompt's steps), for `pool` candidates (with
        `slots`: the steps of a prompt in a batch row fed to them, as a server admits one into
        any slot, from position 0 and from further on), without running them, as llama.cpp's
        warm-up run does at load: the first prompt then runs as fast as a later one. Returns
        how many prefill lengths were loaded."""
        lengths = range(1, PREFILL_CHUNK + 1) if lengths is None else lengths
        padded = sorted({padded_length(n, self.ctx) for n in lengths if 0 < n <= self.ctx})
        # a slot's prompt from position 0 (its first chunk), and from further on (a later chunk,
        # or the rest of a prompt whose beginning the slot's caches hold: prompt caching)
        kinds = (True, False) if slots else (False,)
        kept = padded[-(PREFILL_STEPS // len(kinds)) :]
        keys = [(t, pool, False, int(slots), fresh, None) for t in kept for fresh in kinds]
        loaded = 0
        for key in reversed(keys):  # the longest first: it sizes the arena the others bind to
            if key in self._prefills:
                continue
            self._keep_prefill(key, self._prefill_chain(*key))
            loaded += 1
        for key in keys:  # the longest (a long prompt's chunks) the last to go
            if key in self._prefills:
                self._prefills[key] = self._prefills.pop(key)
        return loaded

    def _prepared(self, graph, shape: tuple[int, int], positions: np.ndarray, *more: np.ndarray):
        """dev.prepare() of `graph` fed (tokens of `shape`, positions, *more): the caches'
        handles are put back, as nothing ran."""
        k, v = self.k, self.v
        try:
            return self.dev.prepare(graph, np.zeros(shape, np.int32), positions, *more)
        finally:
            self.k, self.v = k, v

    def _embed(self, ids: Tensor) -> Tensor:
        """(batch, tokens, hidden), Partial over the vocabulary split (times embed_scale)."""
        fmt = self.formats.get("embed")
        x = get_rows(self.w["embed"], ids) if fmt is None else qget_rows(self.w["embed"], ids, fmt)
        return x if self.cfg.embed_scale is None else x * float(np.float32(self.cfg.embed_scale))

    def _layers(
        self, x: Tensor, pos: Tensor, masks: list[Tensor], slot: Tensor | None = None, rows_from: int = 0
    ) -> Tensor:
        """Every layer over x (batch, tokens, hidden), writing the caches at `pos` (see _layer);
        `masks` those of `mask_kinds`."""
        new_k, new_v = [], []
        for i in range(self.cfg.layers):
            weights, formats = self._layer_weights(i)
            mask = masks[self.mask_kinds.index(self.cfg.is_windowed(i))]
            x, cache_k, cache_v = self._layer(
                weights, formats, x, pos, mask, self.k[i], self.v[i], slot, layer=i, rows_from=rows_from
            )
            new_k.append(cache_k)
            new_v.append(cache_v)
        self.k, self.v = new_k, new_v
        return x

    @property
    def _layer_names(self) -> tuple[str, ...]:
        """A layer's weights: LAYER_WEIGHTS, and the q, k, v biases of a model with them."""
        names = LAYER_WEIGHTS_FUSED if self.fuse_qkv else LAYER_WEIGHTS
        cfg = self.cfg
        return (
            names
            + (QKV_BIASES if cfg.qkv_bias else ())
            + (QK_NORMS if cfg.qk_norm else ())
            + (POST_NORMS if cfg.post_norms else ())
        )

    def _layer_weights(self, i: int) -> tuple[dict[str, Tensor], dict[str, str | None]]:
        """Layer i's weights and the format of each kept quantized (None: float), by name."""
        p, names = f"l{i}.", self._layer_names
        return {n: self.w[p + n] for n in names}, {n: self.formats.get(p + n) for n in names}

    def _layer(
        self,
        w: dict[str, Tensor],
        formats: dict[str, str | None],
        x: Tensor,
        pos: Tensor,
        mask: Tensor,
        cache_k: Tensor,
        cache_v: Tensor,
        slot: Tensor | None = None,
        layer: int = 0,
        fresh: bool = False,
        rows_from: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One layer over x (batch, tokens, hidden) with weights `w`, writing its caches at `pos`:
        (x after it, the caches written). Attention reads the caches (masked), or with `slot`,
        writes batch row `slot` only (with x of several rows, `fresh`: the rows from `slot` on)
        and reads that row (`fresh`, sequences' first chunks: the new keys and values
        themselves). Fewer rows than the caches hold are their rows from `rows_from` on (a
        server's busy slots, or a lane of them: decode_lanes): written and read there, the
        others left as they are, and nothing is computed for them. `layer`: whose rope (base,
        frequencies) it takes."""
        cfg, hd = self.cfg, self.cfg.head_dim
        groups = self.layer_groups
        if (
            groups is not None
            and layer > 0
            and groups.of_layer(layer, cfg.layers) != groups.of_layer(layer - 1, cfg.layers)
        ):
            # the first layer of a group takes the residual from the last: one hand-over, made
            # here, before its norm (the planner alone would hand over the norm's result too)
            x = x.redistribute(Mirrored(on=groups.of_layer(layer, cfg.layers)))
        batch, t = x.shape[:2]
        some_rows = slot is None and batch < self.batch
        at = {"batch_start": slot} if slot is not None else {"batch_start": rows_from} if some_rows else {}

        def mm(a: Tensor, name: str) -> Tensor:
            return _product(a, w[name], formats[name], self.activations)

        h = x.rms_norm(eps=cfg.eps) * w["attn_norm"]
        if "w_qkv" in w:  # three segments: q | k | v, each split by its heads
            qkv, qd, kd = mm(h, "w_qkv"), cfg.heads * hd, self.kv_heads * hd
            q, k, v = qkv[:, :, :qd], qkv[:, :, qd : qd + kd], qkv[:, :, qd + kd :]
        else:
            q, k, v = (mm(h, n) for n, _ in QKV)
        if cfg.qkv_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        base, freqs = cfg.rope_of(layer)
        rotate = (pos, base, cfg.rope_mode, freqs)
        q, k = q.reshape(batch, t, cfg.heads, hd), k.reshape(batch, t, self.kv_heads, hd)
        if cfg.qk_norm:  # each head's vector RMS-normed, before rope (llama.cpp's qwen3)
            q = q.rms_norm(eps=cfg.eps) * w["q_norm"]
            k = k.rms_norm(eps=cfg.eps) * w["k_norm"]
        q, k = q.rope(*rotate), k.rope(*rotate)
        v = v.reshape(batch, t, self.kv_heads, hd)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (b, kv, t, hd)
        rows = pos if cache_k.shape[2] == self.ctx else pos % self.ring_length  # a ring: the slots
        cache_k = cache_k.set_rows(rows, k, axis=2, **at)  # in place, (b, kv, ctx or ring, hd)
        cache_v = cache_v.set_rows(rows, v, axis=2, **at)  # in place, (b, kv, ctx or ring, hd)
        keys, values, seen = cache_k, cache_v, cache_k.shape[2]
        if slot is not None and fresh:  # a sequence's first chunk: its own keys and values (_mask's `fresh`)
            keys, values, seen = _as_cached(k, cache_k), _as_cached(v, cache_v), t
        elif slot is not None:  # the slot's row of each cache, up to this chunk's positions (the mask)
            keys, values = _row_of(cache_k, slot), _row_of(cache_v, slot)
        if some_rows:  # views of the rows in use: the workers copy nothing
            keys, values = cache_k[rows_from : rows_from + batch], cache_v[rows_from : rows_from + batch]
        if self.heads.shared:  # groups cut between devices: each query head reads its KV head by index
            if cfg.attn_softcap is not None:
                raise ShapeError(
                    "soft-capped attention scores need whole KV groups per device (HeadSplit.whole_groups)"
                )
            attn = q.gqa_attention(keys, values, mask, self.heads.kv_of_head, scale=cfg.scale)
            merged = attn.reshape(batch, t, cfg.heads * hd)
        else:
            qg = q.reshape(batch, t, cfg.kv_heads, cfg.group, hd).transpose(0, 2, 3, 1, 4)  # (b, kv, g, t, hd)
            keys = keys.reshape(batch, cfg.kv_heads, 1, seen, hd).transpose(0, 1, 2, 4, 3)  # a view
            scores = qg @ keys  # (b, kv, g, t, seen)
            if cfg.attn_softcap is None:
                scores = scores.softmax_masked(mask, scale=cfg.scale)
            else:  # as llama.cpp: scaled, capped, then the mask and the softmax
                cap = float(np.float32(cfg.attn_softcap))
                scores = ((scores * cfg.scale) * (1.0 / cap)).tanh() * cap
                scores = scores.softmax_masked(mask, scale=1.0)
            attn = scores @ values.reshape(batch, cfg.kv_heads, 1, seen, hd)  # (b, kv, g, t, hd)
            merged = attn.transpose(0, 3, 1, 2, 4).reshape(batch, t, cfg.heads * hd)
        out = mm(merged, "wo")
        x = x + (out.rms_norm(eps=cfg.eps) * w["attn_post_norm"] if cfg.post_norms else out)
        h = x.rms_norm(eps=cfg.eps) * w["ffn_norm"]
        gate_up = mm(h, "w_gate_up")  # two segments: gate | up, both split alike
        gate, up = gate_up[:, :, : cfg.ffn], gate_up[:, :, cfg.ffn :]
        out = mm((gate.gelu_f16() if cfg.gate == "gelu" else gate.silu()) * up, "w_down")
        x = x + (out.rms_norm(eps=cfg.eps) * w["ffn_post_norm"] if cfg.post_norms else out)
        return x, cache_k, cache_v

    def _head(self, x: Tensor, rows: Tensor | None) -> Tensor:
        """The logits of x (batch, tokens, hidden), split by vocabulary; with `rows` (fed), of
        those rows of the flattened (batch * tokens) only, one per batch row."""
        cfg = self.cfg
        batch, t = x.shape[:2]
        table = "head" if "head" in self.w else "embed"  # a tied head's table (on the head's group)
        embed_format = self.formats.get(table)
        if rows is not None:
            x = get_rows(x.reshape(batch * t, cfg.hidden), rows).reshape(batch, 1, cfg.hidden)
            t = 1
        x = self._norm(x, "norm")
        if cfg.tied and embed_format is not None:  # the table's rows are the head's outputs
            logits = qmatmul(x, self.w[table], embed_format, self.activations)
        elif cfg.tied:  # (vocab, hidden) @ (hidden, b*t), then transposed: logits split by vocabulary
            flat = x.reshape(batch * t, cfg.hidden)
            logits = (self.w[table] @ flat.T).T.reshape(batch, t, cfg.vocab)
        else:
            logits = self._mm(x, "output")
        if cfg.final_softcap is None:
            return logits
        cap = float(np.float32(cfg.final_softcap))
        return (logits * (1.0 / cap)).tanh() * cap  # as llama.cpp: scaled, tanh, scaled back

    def capture_decode(self, tokens: np.ndarray, positions: np.ndarray, build=None, rows_from: int = 0, lane=False):
        """Run one decode step (tokens, positions: (rows, 1), rows up to the caches' batch: its
        rows from `rows_from` on) and capture it: returns (step, its outputs). `step(tokens,
        positions)` replays it; outputs are [build's results, *caches], by default [next-token
        ids (rows, 1) int64, *caches]. `lane`: a step of one lane of a pipelined generation
        (`lanes`): where the layers are on groups its results stay on the head's group, whose
        first worker hands the chosen tokens to the others (workers/pipelined.py), instead of
        every worker receiving them inside the step."""
        graph = self._decode_graph(build, rows_from, lane)
        return self.dev.capture(graph, np.asarray(tokens, np.int32), np.asarray(positions, np.int32))

    def prepare_decode(self, rows: int, build=None, rows_from: int = 0, lane=False):
        """The step capture_decode() captures for `rows` rows, loaded but not run (warm_up)."""
        graph = self._decode_graph(build, rows_from, lane)
        return self._prepared(graph, (rows, 1), np.zeros((rows, 1), np.int32))

    def lanes(self, rows: int) -> list[range]:
        """The lanes a generation of `rows` rows decodes them in, each its own step: one lane a
        layer group (at most one a row), so each group works on one lane while the others work
        on theirs, as vLLM's and llama.cpp's pipeline parallelism keep every stage busy with
        micro-batches; one lane of every row where the layers are not on groups."""
        if self.layer_groups is None or rows < 2:
            return [range(rows)]
        count = min(len(self.layer_groups.groups), rows)
        base, extra = divmod(rows, count)  # the first lanes a row more where they do not divide
        starts = [k * base + min(k, extra) for k in range(count + 1)]
        return [range(a, b) for a, b in zip(starts, starts[1:])]

    @property
    def head_group(self) -> tuple[int, ...] | None:
        """The workers the head's results are on: the last layer's group; None: every worker."""
        if self.layer_groups is None:
            return None
        return self.layer_groups.of_layer(self.cfg.layers - 1, self.cfg.layers)

    def _decode_graph(self, build, rows_from: int = 0, lane: bool = False):
        build = build or (lambda logits: [logits.argmax()])

        def graph(t: Tensor, p: Tensor) -> list[Tensor]:
            results = build(self.step(t, p, rows_from=rows_from))
            return [*(results if lane else self._everywhere(results)), *self.caches()]

        return graph

    def _everywhere(self, results: Sequence[Tensor]) -> list[Tensor]:
        """A step's chosen-token results on every worker: the head's group hands them to the
        others where the layers are on groups (a few values a row, where the logits would be
        the vocabulary), so each worker drives its generation from the same values."""
        if self.layer_groups is None:
            return list(results)
        return [r.redistribute(MIRRORED) for r in results]

    def caches(self) -> list[Tensor]:
        """The written caches of the last step: run them with its outputs."""
        return [*self.k, *self.v]
