"""The synthetic-model tool (models/synthetic.py, `launch.py synthetic`): files gguf's own reader
reads back with the recipe's shapes and types, weights of a sane spread, the same bytes from the
same recipe, a vocabulary that tokenizes as its source's, one-line refusals before a byte is
written, and every weight type and GQA ratio decoding on 1-3 devices as the NumPy reference does
on gguf's own dequantization of the same file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meta import MetaDevice
from models import synthetic
from models.gguf_model import GGUFModel
from models.llama import ReferenceDecoder, TensorParallelLlama
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
gguf = pytest.importorskip("gguf")

# whole blocks of 256 for the K-quants, two KV heads of 64
SMALL = synthetic.Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=96, context=64)
LAYER = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
OURS = dict(zip(LAYER, ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")))


def gguf_weights(path: Path) -> dict[str, np.ndarray]:
    """The file's weights as models.llama names them, read and dequantized by gguf alone."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"l{parts[1]}.{OURS[parts[2]]}"
        else:
            name = {"token_embd": "embed", "output_norm": "norm", "output": "output"}[parts[0]]
        out[name] = np.ascontiguousarray(values.T) if values.ndim == 2 and name != "embed" else values
    return out


def test_gguf_reads_back_the_recipes_shapes_types_and_metadata(tmp_path):
    recipe = synthetic.Recipe(SMALL, weights="q4_k", embedding="q6_k", output="q8_0", seed=3)
    written = synthetic.write(tmp_path / "m.gguf", recipe)
    reader = gguf.GGUFReader(str(written.path))
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    assert field("general.architecture") == "llama"
    assert (field("llama.block_count"), field("llama.embedding_length"), field("llama.feed_forward_length")) == (
        2,
        256,
        512,
    )
    assert (field("llama.attention.head_count"), field("llama.attention.head_count_kv")) == (4, 2)
    assert len(field("tokenizer.ggml.tokens")) == 96
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "Q6_K" and types["output.weight"] == "Q8_0"
    assert types["blk.1.ffn_down.weight"] == "Q4_K" and types["blk.0.attn_norm.weight"] == "F32"
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml order
    assert shapes["blk.0.attn_k.weight"] == (256, 128) and shapes["blk.0.ffn_down.weight"] == (512, 256)
    assert len(reader.tensors) == 3 + 2 * 9


@pytest.mark.parametrize("kind", synthetic.WEIGHT_TYPES)
def test_every_type_dequantizes_to_values_of_the_intended_spread(tmp_path, kind):
    """A matrix (out, in) holds values of spread about 1/sqrt(in), centred: a decode on it neither
    overflows nor repeats one token (checked on gguf's dequantization, not ours)."""
    path = synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(SMALL, weights=kind)).path
    w = gguf_weights(path)["l0.w_up"]  # (in 256, out 512)
    assert np.isfinite(w).all()
    spread = float(np.std(w)) * np.sqrt(256)
    assert 0.7 < spread < 1.4, spread
    assert abs(float(np.mean(w))) * np.sqrt(256) < 0.15


def test_the_same_recipe_writes_the_same_bytes_and_another_seed_others(tmp_path):
    recipe = synthetic.Recipe(SMALL, weights="q5_1")
    a = synthetic.write(tmp_path / "a.gguf", recipe).path.read_bytes()
    b = synthetic.write(tmp_path / "b.gguf", recipe).path.read_bytes()
    c = synthetic.write(tmp_path / "c.gguf", synthetic.Recipe(SMALL, weights="q5_1", seed=1)).path.read_bytes()
    assert a == b
    assert len(a) == len(c) and a != c


def test_a_copied_vocabulary_tokenizes_as_its_source(tmp_path, model):
    shape = synthetic.Shape(layers=1, hidden=64, ffn=128, heads=2, kv_heads=1, context=64)
    path = synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape), model.path).path
    copy = GGUFModel(path)
    copy.check()
    text = "The capital of France is <|im_start|>user 2024"
    assert copy.tokenizer.encode(text) == model.tokenizer.encode(text)
    assert copy.config.vocab == model.config.vocab and copy.eos == model.eos
    assert copy.chat_template.source == model.chat_template.source


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(shape=synthetic.Shape(layers=1, hidden=96, ffn=96, heads=2, kv_heads=1, vocab=8), weights="q4_k"), "256"),
        (dict(weights="q9_9"), "q9_9"),
    ],
)
def test_a_recipe_that_cannot_be_written_is_refused_in_one_line_before_any_byte(tmp_path, change, says):
    target = tmp_path / "m.gguf"
    with pytest.raises(synthetic.SyntheticError) as caught:
        synthetic.write(target, synthetic.Recipe(**{"shape": SMALL, **change}))
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert not target.exists()


@pytest.mark.parametrize(
    "sizes",
    [dict(hidden=30, heads=2, kv_heads=1), dict(hidden=64, heads=4, kv_heads=3), dict(hidden=18, heads=6, kv_heads=3)],
)
def test_a_shape_that_cannot_be_a_llama_is_refused(sizes):
    with pytest.raises(synthetic.SyntheticError):
        synthetic.Shape(layers=1, ffn=64, **sizes)


def test_a_vocabulary_size_other_than_the_sources_is_refused(tmp_path, model):
    shape = synthetic.Shape(layers=1, hidden=64, ffn=128, heads=2, kv_heads=1, vocab=1000)
    with pytest.raises(synthetic.SyntheticError, match="49152"):
        synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape), model.path)


def decode_logits(net_or_ref, steps: int) -> np.ndarray:
    """Logits of a 5-token prompt's last position, then of `steps` decode steps fed fixed tokens
    (a tiny random model's greedy choice soon repeats one token: fixed ones vary what is read)."""
    prompt = np.array([[5, 17, 3, 60, 41]])
    fed = [7, 88, 23, 50, 2, 71, 30, 9][:steps]
    if isinstance(net_or_ref, ReferenceDecoder):
        forward = lambda ids, pos: net_or_ref.forward(ids, pos)[0, -1]  # noqa: E731
    else:

        def forward(ids, pos):
            logits = net_or_ref.step(ids, pos)
            net_or_ref.dev.run(logits, *net_or_ref.caches())
            return logits.numpy()[0, -1]

    out = [forward(prompt, np.arange(5)[None])]
    for pos, token in enumerate(fed, start=5):
        out.append(forward(np.array([[token]]), np.array([[pos]])))
    return np.stack(out)


@pytest.mark.parametrize(
    "kind, kv_heads, n",
    [(k, 2, 2) for k in synthetic.WEIGHT_TYPES] + [("q4_1", 1, 3), ("q8_0", 4, 3), ("q6_k", 1, 1)],
)
def test_every_type_and_gqa_ratio_decodes_as_the_reference_on_gguf_dequantization(tmp_path, kind, kv_heads, n):
    """Kept in their blocks (native) on n simulated devices, each weight type gives the logits and
    the argmax of the float32 NumPy reference over gguf's dequantization of the same file."""
    # heads of 128: two devices' shares of the attention output's inputs are whole K-quant blocks
    shape = synthetic.Shape(layers=2, hidden=512, ffn=512, heads=4, kv_heads=kv_heads, vocab=96, context=64)
    path = synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape, weights=kind, output="q8_0")).path
    model = GGUFModel(path)
    model.check()
    expected = decode_logits(ReferenceDecoder(model.config, gguf_weights(path), 32), 6)
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        got = decode_logits(TensorParallelLlama(dev, model.config, model.native, 32), 6)
    finally:
        dev.close()
    np.testing.assert_allclose(got, expected, atol=2e-3, rtol=0)
    assert list(np.argmax(got, -1)) == list(np.argmax(expected, -1))


def test_the_command_writes_a_file_generate_reads_and_refuses_a_bad_shape_in_one_line(tmp_path):
    target = tmp_path / "m.gguf"
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, str(ROOT / "launch.py"), "synthetic", *a], capture_output=True, text=True, timeout=120
    )
    done = run(str(target), "--layers", "1", "--vocabulary", "none", "--vocab", "64", "--weights", "q8_0")
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and GGUFModel(target).config.layers == 1
    qwen = tmp_path / "q.gguf"
    flags = ("--architecture", "qwen2", "--rope-factors", "--rope-scale", "2", "--vocabulary", "none", "--vocab", "64")
    done = run(str(qwen), "--layers", "1", *flags)
    assert done.returncode == 0, done.stderr
    cfg = GGUFModel(qwen).config  # tiny: head size 16; the factors run 1 to 8, each then halved
    assert cfg.qkv_bias and cfg.rope_mode == "neox" and "qwen2" in done.stdout
    np.testing.assert_allclose(cfg.rope_freqs, 0.5 / np.geomspace(1, 8, 8), rtol=1e-6)
    refused = run(str(tmp_path / "bad.gguf"), "--hidden", "100", "--heads", "2", "--kv-heads", "2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "whole q8_0 blocks" in refused.stderr
    assert not (tmp_path / "bad.gguf").exists()


@pytest.mark.parametrize("devname,kv_heads", [("cuda1", 2), ("cuda2", 2), ("cuda2", 1)])
@pytest.mark.parametrize("kind", ["q4_1", "q6_k"])
def test_native_weights_on_the_cuda_backend_decode_as_the_reference_with_products_in_graphs(
    tmp_path, kind, devname, kv_heads, request
):
    from workers.backends.cuda import cublas as _cublas

    """Quantized weights on CUDA workers (the stand-in, which runs each kernel of our own as its
    NumPy twin): a decode step's products are workers/backends/cuda/kernels/qgemv.py's kernels, replayed in
    device graphs (no step refused: none reads on the host), logits those of the reference; with
    q4_1, q | k | v one weight (fuse_qkv), as `generate` places such a file. One KV head on two
    workers: the query heads split 2 | 2, the KV head's quantized K and V columns on both."""
    shape = synthetic.Shape(layers=2, hidden=512, ffn=512, heads=4, kv_heads=kv_heads, vocab=96, context=64)
    path = synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape, weights=kind)).path
    model = GGUFModel(path)
    expected = decode_logits(ReferenceDecoder(model.config, gguf_weights(path), 32), 6)
    dev = request.getfixturevalue(devname)
    net = TensorParallelLlama(dev, model.config, model.native, 32, fuse_qkv=kind == "q4_1")
    assert net.heads.shared == (kv_heads % dev.n != 0)
    before = {rank: stats["graphs"]["replays"] for rank, stats in dev.stats().items()}
    got = decode_logits(net, 6)
    np.testing.assert_allclose(got, expected, atol=2e-3, rtol=0)
    for rank, stats in dev.stats().items():
        graphs = stats["graphs"]
        assert graphs["replays"] > before[rank] and not graphs["refused"], (rank, graphs)
        # the GPU holds the weights in their blocks (the file's bytes / N), the caches, the
        # arena, the graphs' pools, cuBLAS's workspace and a few MiB of kernels' buffers: a
        # dequantized copy of the layers' weights (12 MiB of float32 here) would not fit the slack
        held, stored = stats["device_memory"]["pool_used"], stats["used"] + stats["arena"]
        fixed = stats["graphs"]["pool_bytes"] + _cublas.WORKSPACE_BYTES
        assert stored <= held <= stored + fixed + (4 << 20), (held, stored, fixed)


def _mapped_resident(path: Path) -> int:
    """Bytes of `path`'s mapping resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_weights_handed_out_one_by_one_do_not_stay_resident(tmp_path):
    """The coordinator reads each weight once, to place it: the file's pages of the weights before
    the last two go back as the next is asked for, so the mapping's resident bytes stay near the
    largest weights', not the file's (a 1.7B Q4_1 file held 1.15 GB in the coordinator)."""
    shape = synthetic.Shape(layers=8, hidden=512, ffn=1024, heads=4, kv_heads=2, vocab=512)
    path = synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape, weights="q8_0")).path
    model = GGUFModel(path)
    names = ["embed", "norm"] + [
        f"l{i}.{k}" for i in range(8) for k in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up")
    ]
    largest = 3 * max(t.nbytes for t in model.tensors.values())
    most = 0
    for name in names:
        weight = model.native(name)
        _ = int(np.asarray(getattr(weight, "blocks", weight)).view(np.uint8).sum())  # every page read
        most = max(most, _mapped_resident(path))
    assert path.stat().st_size > 5 * largest
    assert most <= largest + (1 << 16), (most, largest)
    model.release_pages()
    assert _mapped_resident(path) < 1 << 16


def test_a_byte_level_vocabulary_made_here_tokenizes_any_text_and_back(tmp_path):
    """Where no model's vocabulary is at hand (a GPU machine without the packaged SmolLM2), the
    tool makes a byte-level BPE one: every token the join of two earlier ones, GPT-2's byte
    alphabet first, <|endoftext|> last as the end of generation."""
    shape = synthetic.Shape(layers=1, hidden=64, ffn=128, heads=2, kv_heads=1, vocab=3000)
    model = GGUFModel(synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape), synthetic.BYTES).path)
    model.check()
    tokens = model.vocabulary
    assert len(tokens) == 3000 and len(set(tokens)) == 3000
    merges = model.meta("tokenizer.ggml.merges")
    assert all(
        a + b in tokens[: tokens.index(a + b)] or tokens.index(a + b) > 255 for a, b in (m.split() for m in merges)
    )
    for text in ("The capital of France is", "naïve café, 2024 — 100%!", "\n\t  x"):
        ids = model.tokenizer.encode(text)
        assert all(0 <= i < 3000 for i in ids) and model.tokenizer.decode(ids) == text
    assert len(model.tokenizer.encode("the the the the")) < len("the the the the")  # merges apply
    assert model.end_of_generation == {2999} and tokens[2999] == "<|endoftext|>"


def test_the_command_makes_a_vocabulary_where_no_model_is_installed(tmp_path, monkeypatch):
    import argparse

    from cli import synthetic as command

    monkeypatch.setattr(synthetic, "default_vocabulary", lambda: None)
    args = argparse.Namespace(
        out=str(tmp_path / "m.gguf"), shape="tiny", layers=1, hidden=None, ffn=None, heads=None, kv_heads=None,
        vocab=1000, context=None, head_size=None, weights="q8_0", embedding="q8_0", output=None, seed=0, vocabulary="",
        architecture="llama", rope_factors=False, rope_scale=1.0, window=None, window_pattern=None,
    )  # fmt: skip
    assert command.make(args) == 0
    assert (
        GGUFModel(tmp_path / "m.gguf").tokenizer.decode(GGUFModel(tmp_path / "m.gguf").tokenizer.encode("hi")) == "hi"
    )


@pytest.mark.parametrize("types, fits", [(("f32", "f16"), True), (("f16", "f32"), True), (("f32", "f32"), False)])
def test_the_memory_check_sizes_each_cache_by_its_own_type(tmp_path, types, fits):
    """Keys and values sized apart (-ctk / -ctv): a budget between one float32 and one float16
    cache beside two float32 ones admits the first two and refuses the last, worked out by hand."""
    import types as namespaces

    from models.gguf_model import ModelError
    from models.loading import check_fits

    shape = synthetic.Shape(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=300)
    model = GGUFModel(synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape, weights="f32"), None).path)
    ctx, weights = 512, model.resident_bytes("f32")
    per_position = 2 * 16  # 2 KV heads of 16 values, on 1 worker
    mixed = 2 * ctx * per_position * (4 + 2)  # 2 layers: float32 keys and float16 values (or the reverse)
    both = 2 * ctx * per_position * (4 + 4)
    budget = weights + (mixed + both) // 2
    dev = namespaces.SimpleNamespace(n=1, stats=lambda: {0: {"budget": budget}})
    if fits:
        check_fits(dev, model, "f32", ctx, 1, types)
    else:
        with pytest.raises(ModelError, match="cannot fit"):
            check_fits(dev, model, "f32", ctx, 1, types)


def test_a_prompt_the_caches_already_hold_is_prefilled_from_its_last_token(tmp_path):
    """Conversation reuse never covers the whole prompt: its last token is prefilled again (its
    logits choose the first new token), so asking the same prompt twice gives the same greedy
    tokens, and each time the same as a model with nothing cached."""
    from models.generate import LLM

    shape = synthetic.Shape(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=2000)
    model = GGUFModel(synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape), synthetic.BYTES).path)
    dev = MetaDevice(SimulatedCluster(2))
    try:
        fresh = LLM(dev, model, ctx=64, weights="f32").generate(["the tea is hot"], 6)[0].tokens
        llm = LLM(dev, model, ctx=64, weights="f32")
        runs = [llm.generate(["the tea is hot"], 6, reuse_prefix=True)[0].tokens for _ in range(3)]
    finally:
        dev.close()
    assert runs == [fresh] * 3


def test_the_ffn_splits_on_the_largest_block_of_a_mixed_format_files_down_weights(tmp_path):
    """A file mixing formats by layer (as llama.cpp's Q4_K_M does): layer 0's w_down in Q8_0
    blocks (32 values), layer 1's in Q4_K (256). On 3 devices an FFN of 512 splits on 256-value
    blocks (256 + 256 + 0); on 32-value ones (192 + 160 + 160) the Q4_K weight would be cut inside
    its blocks. Decoding gives the reference's logits over gguf's dequantization of both files."""
    shape = synthetic.Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=300, context=64)
    q8 = synthetic.write(tmp_path / "q8.gguf", synthetic.Recipe(shape, weights="q8_0", embedding="f32")).path
    q4k = synthetic.write(tmp_path / "q4k.gguf", synthetic.Recipe(shape, weights="q4_k", embedding="f32", seed=1)).path
    first, second = GGUFModel(q8), GGUFModel(q4k)

    def source(name):
        return (second if name == "l1.w_down" else first).native(name)

    weights = gguf_weights(q8) | {"l1.w_down": gguf_weights(q4k)["l1.w_down"]}
    expected = decode_logits(ReferenceDecoder(first.config, weights, 32), 4)
    dev = MetaDevice(SimulatedCluster(3), check_mirrored=True)
    try:
        net = TensorParallelLlama(dev, first.config, source, 32)
        assert net.ffn_extents == (256, 256, 0)
        got = decode_logits(net, 4)
    finally:
        dev.close()
    np.testing.assert_allclose(got, expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen3", "phi3"])
def test_the_newer_families_decode_alike_native_and_float(tmp_path, architecture):
    """Qwen3's q and k norms with heads of 64 where hidden / heads is 32; Phi-3's q | k | v and
    gate | up each one tensor (its rows cut into the parts on placement, a view of the file's
    blocks); their matrices kept in Q8_0 on two workers: greedy text equal to the float32
    path's (which tests/test_llama_cpp_logits.py holds to llama.cpp's logits), with exact and
    8-bit activations."""
    head = 64 if architecture == "qwen3" else None
    shape = synthetic.Shape(layers=2, hidden=256, ffn=512, heads=8, kv_heads=2, context=128, head_size=head)
    recipe = synthetic.Recipe(shape, weights="q8_0", embedding="q8_0", seed=2, architecture=architecture)
    path = synthetic.write(tmp_path / "m.gguf", recipe, synthetic.default_vocabulary() or synthetic.BYTES).path
    cfg = GGUFModel(path).config
    assert (cfg.head_dim, cfg.qk_norm, cfg.rope_mode) == (head or 32, architecture == "qwen3", "neox")

    _decode_alike(path, 12)


def _decode_alike(path, tokens: int) -> None:
    """`launch.py generate` on two workers: the file's native weights with exact and 8-bit
    activations give the float32 weights' text."""

    def text(*flags: str) -> str:
        args = ("generate", "-m", str(path), "Once upon a time", "-n", str(tokens), "-c", "64", "--workers", "2")
        done = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), *args, *flags], capture_output=True, timeout=240
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return done.stdout.decode()

    float32 = text("--weights", "f32")
    assert float32.strip() and text("--activations", "f32") == float32 == text("--activations", "q8")


@pytest.mark.parametrize(
    ("architecture", "weights", "embedding"),
    [("gemma2", "q8_0", "q8_0"), ("gemma3", "q8_0", "q8_0"), ("gemma3", "q4_k", "q6_k")],
)
def test_gemma_decodes_alike_native_and_float_past_its_window(tmp_path, architecture, weights, embedding):
    """Gemma 2 and 3 (embedding scale, post-norms, the float16-table GELU, heads of 64 where
    hidden / heads is 32, a window of 8 on every other layer; Gemma 3's q/k norms and rope base
    of its own there, Gemma 2's soft caps), matrices in Q8_0, or in Q4_K with a Q6_K embedding
    and head (the main parts of the Q4_K_M files people download), on two workers: 24 greedy
    tokens after the prompt, well past the window, equal to the float32 path's (which
    tests/test_llama_cpp_logits.py holds to llama.cpp's logits), with exact and 8-bit
    activations; prefill by chunks and decode both go through the two masks."""
    shape = synthetic.Shape(layers=2, hidden=256, ffn=512, heads=8, kv_heads=2, context=128, head_size=64)
    recipe = synthetic.Recipe(
        shape, weights=weights, embedding=embedding, seed=3, architecture=architecture, window=8, window_pattern=2
    )
    path = synthetic.write(tmp_path / "m.gguf", recipe, synthetic.default_vocabulary() or synthetic.BYTES).path
    cfg = GGUFModel(path).config
    assert (cfg.head_dim, cfg.window, cfg.windowed, cfg.gate, cfg.post_norms) == (64, 8, (True, False), "gelu", True)
    assert (cfg.qk_norm, cfg.attn_softcap, cfg.final_softcap) == (
        (False, 50.0, 30.0) if architecture == "gemma2" else (True, None, None)
    )
    _decode_alike(path, 24)


def test_the_memory_check_of_layer_groups_counts_each_groups_layers_and_a_tied_heads_copy(tmp_path):
    """With layers split over groups, the group that needs the most decides: here two groups of
    one worker, the first holding layer 0 and the embedding, the last layer 1, the final norm and
    the tied head's own copy of the embedding, each its layer's caches; worked out by hand from
    the file's tensors (every one float32 with --weights f32)."""
    import types as namespaces

    from models.gguf_model import ModelError
    from models.llama import LayerGroups
    from models.loading import check_fits

    shape = synthetic.Shape(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=300)
    model = GGUFModel(synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape, weights="f32"), None).path)
    assert model.config.tied
    sizes = {name: 4 * int(np.prod(t.shape)) for name, t in model.tensors.items()}
    embed = sizes["token_embd.weight"]
    layer1 = sum(size for name, size in sizes.items() if name.startswith("blk.1."))
    rest = sum(size for name, size in sizes.items() if not name.startswith("blk.")) - embed
    ctx = 512
    kv = ctx * 2 * (4 + 4) * 16  # one layer: 2 KV heads of 16 values, float32 keys and values
    last = layer1 + rest + embed + kv  # more than the first group's: layer 0 (the same), the table
    groups = LayerGroups.even(2, 2)

    def fits(budget):
        dev = namespaces.SimpleNamespace(n=2, stats=lambda: {0: {"budget": budget}, 1: {"budget": budget}})
        check_fits(dev, model, "f32", ctx, 1, ("f32", "f32"), groups)

    fits(last)
    with pytest.raises(ModelError, match="a worker of a layer group needs at least"):
        fits(last - 1)


@pytest.mark.parametrize("kind", ["q4_1", "q6_k", "bf16"])
def test_a_matrix_drawn_alone_is_a_synthetic_files_matrix(kind):
    """models.synthetic.matrix (bench/qgemv.py's weights): the stored bytes of a (rows, cols)
    matrix in the type, which gguf's dequantization reads as values of spread ~1/sqrt(cols), the
    files' own (finite: the bench's sums are compared)."""
    import gguf

    rows, cols = 64, 2048
    stored = synthetic.matrix(np.random.default_rng(0), (rows, cols), kind)
    values = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind.upper()]).reshape(rows, cols)
    assert np.isfinite(values).all()
    assert 0.5 < float(values.std()) * np.sqrt(cols) < 2.0


def test_a_generation_that_fails_midway_leaves_no_stale_prefix_to_reuse(tmp_path, monkeypatch):
    """A call interrupted in its stream callback (Ctrl-C in a chat loop) has written its prompt
    into row 0's caches from where it parted from the cached turn (chunks of 8 here): the next
    turn, which goes on from the turn before, must not take those positions for the cached
    turn's. Its tokens and logits are a fresh model's."""
    import models.llama as llama
    from models.generate import LLM

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 8)

    shape = synthetic.Shape(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=2000)
    model = GGUFModel(synthetic.write(tmp_path / "m.gguf", synthetic.Recipe(shape), synthetic.BYTES).path)
    first, then = "the tea is hot and the cup is blue", "the tea is hot and the cup is blue, so drink it"

    def interrupt(row: int, token: int) -> None:
        raise KeyboardInterrupt

    dev = MetaDevice(SimulatedCluster(2))
    try:
        llm = LLM(dev, model, ctx=64, weights="f32")
        llm.generate([first], 4, reuse_prefix=True, stop_at_eos=False)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["the tea is cold"], 4, reuse_prefix=True, on_token=interrupt, stop_at_eos=False)
        got = llm.generate([then], 6, reuse_prefix=True, keep_logits=True, stop_at_eos=False)[0].tokens
        fresh = LLM(dev, model, ctx=64, weights="f32")
        expected = fresh.generate([then], 6, keep_logits=True, stop_at_eos=False)[0].tokens
    finally:
        dev.close()
    np.testing.assert_array_equal(llm.last_logits, fresh.last_logits)
    assert got == expected
