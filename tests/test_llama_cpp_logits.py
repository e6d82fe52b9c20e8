"""Our llama decoder against llama.cpp's own logits, on the same files: synthetic llama files
(tests/llama_cpp_cases.py: tied and untied heads, GQA 2:1 and 4:1, plain multi-head, Llama 3.1's
rope frequency factors, linear rope scaling, Qwen2's biases and NeoX rope, a Llama 2-style file with
its SentencePiece vocabulary) made again
here from their recipes, and the logits llama.cpp gave on them (stored, with each file's
SHA-256, in tests/data/llama_cpp_logits.npz; llama.cpp itself is not needed to run this). The
NumPy reference decoder and the tensor-parallel one on 1 to 3 devices, fed llama.cpp's tokens,
give its logits at every position within 1e-4 (its float32 path; the issue's bound was 2e-3), Gemma's
within 3e-4 (tests/llama_cpp_cases.py says why)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meta import MetaDevice
from models.gguf_model import GGUFModel
from models.llama import ReferenceDecoder, TensorParallelLlama
from tests.llama_cpp_cases import CASES, DATA, sha256
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def stored():
    return dict(np.load(DATA))


@pytest.fixture(scope="module")
def files(tmp_path_factory, stored):
    """Each case's file made again; the same bytes as the file llama.cpp read."""
    folder = tmp_path_factory.mktemp("llama_cpp_cases")
    made = {}
    for case in CASES:
        path = case.write(folder)
        assert sha256(path) == str(stored[f"{case.name}/sha256"]), (
            f"{case.name}: the synthetic writer now makes another file than llama.cpp read; "
            "run python tests/llama_cpp_cases.py to store llama.cpp's logits for it"
        )
        made[case.name] = path
    return made


def weights_of(model: GGUFModel) -> dict[str, np.ndarray]:
    return {n: model.weight(n) for n in model.expected_shapes()}  # every weight the file's config implies


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_reference_decoder_gives_llama_cpps_logits(case, files, stored):
    tokens, expected = stored[f"{case.name}/tokens"], stored[f"{case.name}/logits"]
    model = GGUFModel(files[case.name])
    ref = ReferenceDecoder(model.config, weights_of(model), 64)
    got = ref.forward(tokens[None, :-1], np.arange(len(tokens) - 1)[None])[0]
    np.testing.assert_allclose(got, expected, atol=case.tolerance, rtol=0)
    assert list(np.argmax(got[len(case.prompt) - 1 :], -1)) == list(tokens[len(case.prompt) :])


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tensor_parallel_decoding_gives_llama_cpps_logits(case, n, files, stored):
    """The prompt in one step, then llama.cpp's tokens fed one at a time (decode steps)."""
    tokens, expected = stored[f"{case.name}/tokens"], stored[f"{case.name}/logits"]
    model = GGUFModel(Path(files[case.name]))
    prompt = len(case.prompt)
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        net = TensorParallelLlama(dev, model.config, model.weight, 64)
        logits = net.step(tokens[None, :prompt], np.arange(prompt)[None])
        dev.run(logits, *net.caches())
        got = list(logits.numpy()[0])
        for pos in range(prompt, len(tokens) - 1):
            step = net.step(tokens[None, pos : pos + 1], np.array([[pos]]))
            dev.run(step, *net.caches())
            got.append(step.numpy()[0, 0])
    finally:
        dev.close()
    np.testing.assert_allclose(np.stack(got), expected, atol=case.tolerance, rtol=0)
