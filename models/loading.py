"""A model placed on a MetaDevice and what fits it: the weights kept in the file's blocks or
widened (WEIGHTS, fuses_qkv, place_model), a prompt as the model reads it (a text, or chat
messages rendered by its template: prompt_text), and the checks that refuse in one line a
prompt, a context or cache types that do not fit (check_*).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from meta.cluster import host_of_each
from meta.device import MetaDevice
from models.errors import ModelError
from models.gguf_model import GGUFModel
from models.llama import CACHE_TYPES, LayerGroups, TensorParallelLlama, cache_lengths, qkv_fusable
from split_state.ops import ACTIVATIONS
from transport.environment import INTEGER_DECODE_ENV, POOL_SPIN_ENV

Prompt = str | Sequence[Mapping[str, str]]  # text, or a conversation: [{"role": ..., "content": ...}]


def messages_of(prompt: Prompt, system: str = "") -> list[dict]:
    """A prompt as chat messages: text is one user turn; `system` goes first unless the
    conversation has its own system message."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
        for m in messages:
            if set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
                raise ModelError(f"a chat message is a {{'role': str, 'content': str}} mapping; got {m!r}")
    if system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def prompt_text(
    model: GGUFModel, prompt: Prompt, chat: bool, system: str = "", variables: Mapping[str, object] | None = None
) -> str:
    """The text the model reads for `prompt`: text as given, or (with `chat`, and always for a
    list of messages) the conversation in the file's chat template, rendered in a sandbox (an
    unsafe or broken template is a TemplateError naming the file); `variables`: more of the
    template's (chat_template_kwargs: Qwen3's enable_thinking)."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = prompt[exc.start : exc.end].encode("utf-8", "surrogateescape")
            raise ModelError(f"the prompt is not UTF-8 text: byte(s) {bad!r} at character {exc.start}") from None
        if not chat:
            return prompt
    template = model.chat_template
    if template is None:
        raise ModelError(f"{model.path.name} has no chat template; drop --chat (and --system, --interactive)")
    return template.render(messages_of(prompt, system), variables=dict(variables or {}))


def check_text_fits(text: str, ctx: int, model: GGUFModel, what: str = "the prompt") -> str:
    """`text`, refused before it is tokenized where it is longer than any `ctx` tokens of the
    model could be (tokenizing megabytes costs seconds and gigabytes, to then say it does not fit)."""
    most = ctx * model.longest_token_bytes
    if len(text) > most or len(text.encode("utf-8", "surrogatepass")) > most:
        raise ModelError(f"{what} is longer than a context of {ctx} tokens could hold ({most} bytes at most)")
    return text


def check_context(ctx: int, model_ctx: int) -> None:
    if not 0 < ctx <= model_ctx:
        raise ModelError(f"--ctx {ctx}: give 1 to the model's context length, {model_ctx}")


def check_lengths(lengths: Sequence[int], max_new_tokens: int, ctx: int, model_ctx: int) -> None:
    """Prompts of these token counts, and `max_new_tokens` more each, fit in `ctx`."""
    if min(lengths) == 0:
        raise ModelError("an empty prompt: give at least one token of text")
    if max_new_tokens < 0:
        raise ModelError(f"--max-new-tokens {max_new_tokens}: give 0 or more")
    if max(lengths) + max_new_tokens > ctx:
        raise ModelError(
            f"a prompt of {max(lengths)} tokens plus {max_new_tokens} new ones exceeds the context of "
            f"{ctx} tokens; raise --ctx (up to {model_ctx}) or shorten the prompt"
        )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def check_fits(
    dev: MetaDevice,
    model: GGUFModel,
    weights: str,
    ctx: int,
    batch: int,
    cache_types: tuple[str, str] = ("f32", "f32"),
    groups: LayerGroups | None = None,
) -> None:
    """Refuse, before any weight moves, a model that cannot fit the workers' memory budgets:
    each worker holds at least its share of the weights (1/N of them) and the KV cache of its
    whole KV heads (the worker with the most: ceil(kv heads / N)) at `ctx` positions (a windowed
    layer's: its ring, models.llama.cache_lengths). With layer `groups`, the workers of a group
    share its layers' weights and caches (ceil(kv heads / group size) each), the first group's
    the embedding table besides and the last group's the head (a tied head's own copy of the
    table) and the rest; the group that needs the most decides. A model that passes may still
    run short by the uneven part of the split, the worker's programs and its working memory:
    that is the workers' OutOfMemory, as before."""
    cfg, n = model.config, dev.n
    position = sum(np.dtype(CACHE_TYPES[c]).itemsize for c in cache_types) * cfg.head_dim  # a key and a value
    lengths = cache_lengths(cfg, ctx)  # windowed layers: rings
    if groups is None:
        share = model.resident_bytes(weights) / n
        kv = sum(lengths) * batch * -(-cfg.kv_heads // n) * position
    else:
        size, last, embed = groups.size, len(groups.groups) - 1, model.held_bytes("embed", weights)
        layers = [model.layer_bytes(i, weights) for i in range(cfg.layers)]
        share = kv = 0
        for g, group in enumerate(groups.groups):
            held = [i for i in range(cfg.layers) if groups.of_layer(i, cfg.layers) == group]
            its = sum(layers[i] for i in held) + (embed if g == 0 else 0)
            its += head_bytes(model, weights) if g == last else 0
            its_kv = sum(lengths[i] for i in held) * batch * -(-cfg.kv_heads // size) * position
            if its / size + its_kv > share + kv:
                share, kv = its / size, its_kv
    budget = min(info["budget"] for info in dev.stats().values())
    if share + kv > budget:
        mib = 1 << 20
        raise ModelError(
            f"{model.path.name} cannot fit: "
            + (f"each of {n} workers" if groups is None else "a worker of a layer group")
            + f" needs at least {share / mib:.0f} MiB of {weights} weights"
            + f" and {kv / mib:.0f} MiB of KV cache at --ctx {ctx}"
            + (f" for {batch} sequences" if batch > 1 else "")
            + f", over its {budget / mib:.0f} MiB budget; use more workers"
            + (", --weights native" if weights != "native" else "")
            + " or a smaller --ctx"
        )


def head_bytes(model: GGUFModel, weights: str) -> int:
    """What the last layer group holds besides its layers: the head (a tied one's own copy of the
    embedding table) and the final norm."""
    layers = sum(model.layer_bytes(i, weights) for i in range(model.config.layers))
    embed = model.held_bytes("embed", weights)
    return model.resident_bytes(weights) - layers - embed + (embed if model.config.tied else 0)


AUTO_CACHE = "auto"  # the default cache type: float16 on llama.cpp's arithmetic, else float32 (cache_types_for)


def cache_types_for(cache_types: Sequence[str], activations: str, weights: str = "native") -> tuple[str, ...]:
    """The caches' element types with AUTO_CACHE resolved: float16 where the products are
    llama.cpp's (the file's blocks, 8-bit activations), as llama.cpp's caches are (its arithmetic
    all through, and half the cache a decode step reads: the 1.7B-shaped Q4_0 file on two threads
    decoded 8-12 % faster after 32-token prompts, more at long contexts); float32 on the float32
    paths (--weights f32 or --activations f32: logits equal to the float32 reference's)."""
    auto = "f16" if activations == "q8" and weights == "native" else "f32"
    return tuple(auto if kind == AUTO_CACHE else kind for kind in cache_types)


def check_cache_types(cache_types: Sequence[str]) -> None:
    for flag, kind in zip(("--cache-type-k", "--cache-type-v"), cache_types):
        if kind not in CACHE_TYPES:
            raise ModelError(f"{flag} {kind!r}: one of {', '.join((AUTO_CACHE, *CACHE_TYPES))}")


WEIGHTS = ("native", "f32")  # kept in the file's blocks where the workers compute on them; all float32


def fuses_qkv(model: GGUFModel, weights: str) -> bool:
    """Whether the model's q, k and v weights become one (TensorParallelLlama's fuse_qkv): where
    every layer's are of one kind as `weights` keeps them (a Q4_K_M file's V is often Q6_K where
    its Q and K are Q4_K: then they stay three)."""
    return qkv_fusable(lambda name: model.kept_format(name, weights), model.config)


def decode_pool_env(model: GGUFModel, weights: str, activations: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What the workers' environment says of their decode (transport/environment.py): that every
    product of a decode step is an integer product (`weights` native, `activations` q8, every
    matrix of the file in a block format: no BLAS takes turns with the loops), so that a worker
    of two or more threads keeps its loops' threads spinning through the step's gaps
    (workers/binding.py), unless `environ` (the user's) sets its own spin; else nothing.
    Generate, serve and the benchmarks start their workers with it (ClusterConfig.env)."""
    integer = weights == "native" and activations == "q8" and model.all_blocked()
    if integer and POOL_SPIN_ENV not in environ:
        return {INTEGER_DECODE_ENV: "1"}
    return {}


SPLITS = ("row", "layer")  # llama.cpp's -sm: every layer over every worker; layers over groups of them


def layer_groups_for(dev: MetaDevice, split: str = "row", groups: int = 0) -> LayerGroups | None:
    """The layer groups of `--split` and `--layer-groups`: None for "row"; for "layer", `groups`
    groups of consecutive workers where given, else one group a host where the workers are on
    several hosts (each layer split over its host's workers: tensor parallel inside a host, one
    hand-over between hosts), else one worker a group (llama.cpp's -sm layer)."""
    if split not in SPLITS:
        raise ModelError(f"--split {split!r}: one of {', '.join(SPLITS)}")
    if split == "row":
        if groups:
            raise ModelError("--layer-groups goes with --split layer")
        return None
    n = dev.n
    if groups:
        if groups < 1 or n % groups:
            raise ModelError(f"--layer-groups {groups}: a count that divides the {n} workers into groups of one size")
        return LayerGroups.even(n, groups)
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(host_of_each(dev.cluster.devices)):
        by_host.setdefault(host, []).append(rank)
    if len(by_host) == 1:
        return LayerGroups.even(n, n)
    if len({len(ranks) for ranks in by_host.values()}) > 1:
        counts = ", ".join(f"{host or 'this host'}: {len(r)}" for host, r in by_host.items())
        raise ModelError(
            f"--split layer puts a host's workers in one group, and groups are of one size ({counts}): "
            f"give --layer-groups"
        )
    return LayerGroups(tuple(tuple(ranks) for ranks in sorted(by_host.values())))


def place_model(
    dev: MetaDevice,
    model: GGUFModel,
    ctx: int,
    batch: int,
    weights: str = "native",
    cache_types: Sequence[str] = (AUTO_CACHE, AUTO_CACHE),
    progress=None,
    activations: str = "q8",
    split: str = "row",
    layer_groups: int = 0,
) -> TensorParallelLlama:
    """The model's weights and caches (`batch` rows of `ctx` positions) placed on the workers,
    after every check that can refuse it first (context, weights, cache types, the workers'
    memory); the coordinator's copy of the file then goes. The one loader of LLM and the
    server's ContinuousBatcher. `cache_types` (K, V): CACHE_TYPES's names or AUTO_CACHE.
    `split`, `layer_groups`: every layer over every worker ("row"), or consecutive layers over
    groups of them ("layer": layer_groups_for)."""
    check_context(ctx, model.context_length)
    groups = layer_groups_for(dev, split, layer_groups)
    if groups is not None:  # as many layers a group as evens out their work, the head's included
        work = [model.layer_elements(i) for i in range(model.config.layers)]
        groups = groups.balanced(work, model.head_elements())
    if weights not in WEIGHTS:
        raise ModelError(f"--weights {weights!r}: one of {', '.join(WEIGHTS)}")
    if activations not in ACTIVATIONS:
        raise ModelError(f"--activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
    cache_types = cache_types_for(cache_types, activations, weights)
    check_cache_types(cache_types)
    check_fits(dev, model, weights, ctx, batch, tuple(cache_types), groups)
    source = model.native if weights == "native" else model.weight
    fuse = fuses_qkv(model, weights)
    net = TensorParallelLlama(
        dev,
        model.config,
        source,
        ctx,
        batch,
        progress=progress,
        cache_types=tuple(cache_types),
        fuse_qkv=fuse,
        activations=activations,
        layer_groups=groups,
    )
    model.release_pages()  # the workers hold the weights: the coordinator's copy of the file goes
    return net
