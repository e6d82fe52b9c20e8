"""SmolLM2-135M from its GGUF file: tokenizer anchors, the NumPy reference decoder, tensor-parallel
logits and greedy tokens equal to it, the generate command, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meta import MetaDevice
from models.gguf_model import GGUFModel, ModelError
from models.llama import HeadSplit, ReferenceDecoder, TensorParallelLlama
from split_state import Collective
from workers.simulator import SimulatedCluster

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # as the model's own tokenizer encodes it
STEPS = 16
CTX = 64


@pytest.fixture(scope="module")
def weights(model):
    names = ["embed", "norm"] + [
        f"l{i}.{k}"
        for i in range(model.config.layers)
        for k in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    ]
    return {name: model.weight(name) for name in names}


@pytest.fixture(scope="module")
def reference_run(model, weights):
    """Greedy decoding by the NumPy reference: logits of the prompt's last position, then of each
    of STEPS decode steps, and the tokens chosen."""
    ref = ReferenceDecoder(model.config, weights, CTX)
    logits = [ref.forward(np.array([PROMPT_IDS]), np.arange(len(PROMPT_IDS))[None])[0, -1]]
    tokens = [int(np.argmax(logits[-1]))]
    for pos in range(len(PROMPT_IDS), len(PROMPT_IDS) + STEPS):
        logits.append(ref.forward(np.array([[tokens[-1]]]), np.array([[pos]]))[0, -1])
        tokens.append(int(np.argmax(logits[-1])))
    return np.stack(logits), tokens


def test_tokenizer_matches_the_anchors(model):
    tok = model.tokenizer
    assert tok.encode(PROMPT) == PROMPT_IDS
    assert tok.decode(PROMPT_IDS) == PROMPT
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]  # control tokens are single
    assert tok.encode("2024") == [34, 32, 34, 36]  # SmolLM splits digits one by one
    assert model.chat_template.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_reference_continues_with_paris(model, reference_run):
    _, tokens = reference_run
    assert model.tokenizer.decode(tokens[:2]) == " Paris."


def check_tensor_parallel(dev: MetaDevice, model, weights, reference_run, heads: HeadSplit | None = None) -> None:
    expected_logits, expected_tokens = reference_run
    net = TensorParallelLlama(dev, model.config, weights.__getitem__, CTX, heads=heads)
    logits = net.step(np.array([PROMPT_IDS]), np.arange(len(PROMPT_IDS))[None])
    last = logits[:, len(PROMPT_IDS) - 1 :]
    dev.run(last, *net.caches())
    got_logits, got_tokens = [last.numpy()[0, 0]], []
    for pos in range(len(PROMPT_IDS), len(PROMPT_IDS) + STEPS):
        got_tokens.append(int(np.argmax(got_logits[-1])))
        step = net.step(np.array([[got_tokens[-1]]]), np.array([[pos]]))
        dev.run(step, *net.caches())
        got_logits.append(step.numpy()[0, 0])
        if dev.n > 1:  # two per layer, plus the lookup in the vocabulary-split embedding table
            assert dev.last_plan.collectives() == [Collective.ALL_REDUCE] * (2 * model.config.layers + 1)
    got_tokens.append(int(np.argmax(got_logits[-1])))
    assert np.max(np.abs(np.stack(got_logits) - expected_logits)) < 1e-4
    assert got_tokens == expected_tokens


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_tensor_parallel_equals_the_reference_on_simulated_devices(model, weights, reference_run, n):
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        check_tensor_parallel(dev, model, weights, reference_run)
    finally:
        dev.close()


@pytest.mark.parametrize("n", [2, 4])
def test_whole_kv_groups_equal_the_reference_too(model, weights, reference_run, n):
    """The split workers leave for SmolLM2's 3 KV heads on 2 or 4 devices is by query heads
    (HeadSplit.even_queries, above); the whole groups it replaced (and a caller may still ask
    for) give the reference's logits and tokens too."""
    dev = MetaDevice(SimulatedCluster(n), check_mirrored=True)
    try:
        check_tensor_parallel(dev, model, weights, reference_run, HeadSplit.whole_groups(model.config, n))
    finally:
        dev.close()


@pytest.mark.parametrize("devname", ["procs2", "procs3", "cuda2", "cuda_nccl2"])
def test_tensor_parallel_equals_the_reference_on_worker_processes(model, weights, reference_run, devname, request):
    check_tensor_parallel(request.getfixturevalue(devname), model, weights, reference_run)


@pytest.mark.parametrize("devname", ["cuda1", "cuda2"])
def test_a_long_prompt_in_two_chunks_on_the_cuda_backend_equals_the_reference(model, weights, devname, request):
    """Prompts past a decode step's few tokens take the CUDA backend's tiled prompt attention
    (workers/backends/cuda/kernels/prefill_attend.py; on the stand-in, its twins): 19 tokens (two tiles of
    queries) over their own keys, then 11 more over the cache. On one worker the decoder's layout,
    on two the gqa_attention op's (SmolLM2's 3 KV heads shared between the devices). Every
    position's logits against the NumPy reference."""
    ids = model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome. " * 3)[:30]
    assert len(ids) == 30
    ref = ReferenceDecoder(model.config, weights, CTX)
    dev = request.getfixturevalue(devname)
    net = TensorParallelLlama(dev, model.config, weights.__getitem__, CTX)
    for start, stop in ((0, 19), (19, 30)):
        chunk, positions = np.array([ids[start:stop]]), np.arange(start, stop)[None]
        want = ref.forward(chunk, positions)
        logits = net.step(chunk, positions)
        dev.run(logits, *net.caches())
        assert np.max(np.abs(logits.numpy() - want)) < 1e-4, (start, stop)


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_command_streams_writes_json_and_logits(model, reference_run, tmp_path):
    expected_logits, expected_tokens = reference_run
    out = run_generate(
        PROMPT,
        "--max-new-tokens",
        "4",
        "--ctx",
        "64",
        "--json",
        str(tmp_path / "g.json"),
        "--logits-out",
        str(tmp_path / "l.npy"),
        "--weights",
        "f32",  # the float32 path's logits equal the reference's; native's are tested below
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(" Paris.") and "tokens/s" in out.stderr
    result = json.loads((tmp_path / "g.json").read_text())
    assert result[0]["prompt_tokens"] == PROMPT_IDS and result[0]["tokens"] == expected_tokens[:4]
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (1, model.config.vocab) and logits.dtype == np.float32
    assert np.max(np.abs(logits[0] - expected_logits[0])) < 1e-4


def test_prompts_of_different_lengths_decode_together(model):
    """Each prompt at its own position: the batch gives what each prompt gives alone."""
    from models.generate import LLM

    dev = MetaDevice(SimulatedCluster(2))
    try:
        prompts = [PROMPT, "Water boils at a temperature of"]
        together = LLM(dev, model, ctx=48, batch=2).generate(prompts, max_new_tokens=5)
        alone = [LLM(dev, model, ctx=48).generate([p], max_new_tokens=5)[0] for p in prompts]
    finally:
        dev.close()
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    assert together[0].text.startswith(" Paris.")


def test_bad_input_says_what_and_how_to_fix(model, tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported"):
        GGUFModel(path)
    with pytest.raises(ModelError, match="no such model file"):
        GGUFModel(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        GGUFModel(tmp_path / "junk.gguf")
    out = run_generate(PROMPT * 20, "--ctx", "32", "--max-new-tokens", "2")
    assert out.returncode == 2 and "exceeds the context of 32 tokens; raise --ctx" in out.stderr


def test_the_config_read_from_the_file_is_smollm2_135m(model):
    """Against the published configuration of SmolLM2-135M-Instruct (its config.json), not the
    reader's own output: a reader ignoring the file's rope base or eps would pass every test that
    compares our decoder with a reference reading the same config."""
    cfg = model.config
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab) == (576, 30, 9, 3, 1536, 49152)
    assert cfg.rope_base == 100000.0 and cfg.eps == pytest.approx(1e-5) and cfg.tied
    assert cfg.head_dim == 64 and cfg.group == 3 and model.context_length == 8192


def test_a_chat_answer_ends_at_the_end_of_its_turn_without_control_tokens(model, tmp_path):
    assert model.end_of_generation == {0, 2}  # <|endoftext|> and <|im_end|> (the file's EOS)
    # the exact products' answer: with 8-bit activations (the default) two workers answer as
    # llama.cpp does on this file ("L'Étoile, la Cité, ..."), one worker "The capital ..."
    chat = ("What is the capital of France?", "--chat", "--activations", "f32")
    out = run_generate(*chat, "--json", str(tmp_path / "a.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    (answer,) = json.loads((tmp_path / "a.json").read_text())
    assert out.stdout.strip() == answer["text"] == "The capital of France is Paris."
    assert answer["finish_reason"] == "stop" and answer["tokens"][-1] == 2 and len(answer["tokens"]) < 32
    assert answer["sampling"] == {
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "seed": 0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "repeat_last_n": 64,
    }
    out = run_generate(
        *chat,
        "--ignore-eos",
        "--special",
        "--max-new-tokens",
        "12",
        "--json",
        str(tmp_path / "b.json"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (longer,) = json.loads((tmp_path / "b.json").read_text())
    assert longer["finish_reason"] == "length" and len(longer["tokens"]) == 12
    assert longer["text"].startswith("The capital of France is Paris.<|im_end|>")


def test_a_stop_string_ends_the_text_before_it_and_the_stream_never_shows_it(model, tmp_path, capsys):
    out = run_generate(PROMPT, "--stop", ".", "--stop", "never seen", "--json", str(tmp_path / "s.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = json.loads((tmp_path / "s.json").read_text())
    assert out.stdout == " Paris\n" and result["text"] == " Paris" and result["finish_reason"] == "stop"
    assert len(result["tokens"]) == 2  # " Paris", "." : stopped at once, not at --max-new-tokens

    from cli.generate import _Stream

    class Letters:  # token i is the i-th letter of `text`: decoding is joining
        def __init__(self, text: str = "ab\nUser:xy"):
            self.text = text

        def decode(self, ids, skip_special=False, continuation=False):
            return "".join(self.text[i] for i in ids)

    stream = _Stream(Letters(), stop=["\nUser:"])
    for token in range(len("ab\nUser:xy")):
        stream(0, token)
    assert capsys.readouterr().out == "ab"  # "\nUs..." held back as it came, never shown
    stream = _Stream(Letters(), stop=["\nUser:"])
    for token in range(4):  # "ab\nU": the generation ends there
        stream(0, token)
    assert capsys.readouterr().out == "ab" and stream.finish("ab\nU") == "\nU"  # the rest, once final
    # "ab\n\n" ends with two beginnings of the stop string, "\n" and "\n\n": the longer is held
    stream = _Stream(Letters("ab\n\nUser:xy"), stop=["\n\nUser:"])
    for token in range(len("ab\n\nUser:xy")):
        stream(0, token)
    assert capsys.readouterr().out == "ab"


@pytest.mark.parametrize("workers, threads", [(2, 1), (3, 1), (1, 2)])
def test_native_weights_give_the_float32_paths_tokens(model, monkeypatch, workers, threads):
    """SmolLM2's Q4_1 layers and Q8_0 embedding kept in their blocks on 1-3 workers, their numba
    loops (products, decode attention) on 1 or 2 threads: the same greedy tokens as the float32
    weights of the same file, logits within 2e-3."""
    from models.generate import LLM
    from workers.backends.cpu import numba_cpu

    monkeypatch.setattr(numba_cpu, "_THREADS", [threads])  # the simulated workers' threads read it
    dev = MetaDevice(SimulatedCluster(workers))
    try:
        runs = {}
        for weights in ("f32", "native"):
            llm = LLM(dev, model, ctx=64, weights=weights, activations="f32")
            runs[weights] = (llm.generate([PROMPT], max_new_tokens=16, keep_logits=True)[0], llm.last_logits)
            # every matrix in its blocks: the embedding, and a layer's q | k | v, wo, gate | up, down
            assert llm.net.fuse_qkv and len(llm.net.formats) == (0 if weights == "f32" else 1 + 30 * 4)
    finally:
        dev.close()
    assert runs["native"][0].tokens == runs["f32"][0].tokens
    np.testing.assert_allclose(runs["native"][1], runs["f32"][1], atol=2e-3, rtol=0)


@pytest.mark.parametrize("workers", [1, 2])
def test_8_bit_activations_move_the_logits_no_more_than_llama_cpps_do(model, workers):
    """The default products (8-bit activations) on SmolLM2's Q4_1 and Q8_0 blocks, against the
    exact products on the same blocks: the prompt's logits within the distance llama.cpp's own
    8-bit products keep from the exact ones on this file (bench/activations.py, 2026-11-29: 0.15
    to 0.42 RMS over six prompts, at most 0.087 of the logits' RMS: the bound 0.09), and the same
    greedy tokens."""
    from models.generate import LLM

    dev = MetaDevice(SimulatedCluster(workers))
    try:
        runs = {}
        for activations in ("f32", "q8"):
            llm = LLM(dev, model, ctx=64, activations=activations)
            runs[activations] = (llm.generate([PROMPT], max_new_tokens=3, keep_logits=True)[0], llm.last_logits)
    finally:
        dev.close()
    exact, moved = runs["f32"][1], runs["q8"][1]
    distance = np.sqrt(np.mean((moved - exact) ** 2))
    assert 0 < distance < 0.09 * np.sqrt(np.mean(exact**2))
    assert runs["q8"][0].tokens == runs["f32"][0].tokens


def test_a_warmed_up_model_plans_nothing_for_its_first_prompt_and_gives_the_reference_tokens(model, reference_run):
    """LLM.warm_up loads the prefill steps of every prompt length up to the context and the
    greedy decode step (9 in a 64-position context); the first generation after it plans
    nothing and gives the NumPy reference's tokens."""
    from models.generate import LLM

    dev = MetaDevice(SimulatedCluster(2))
    try:
        llm = LLM(dev, model, ctx=CTX, weights="f32")
        assert llm.warm_up() == 9  # prompts padded to 8, 16, ..., 64 tokens, and decoding
        plans = len(dev.plans)
        (got,) = llm.generate([PROMPT], STEPS + 1, stop_at_eos=False)
        assert len(dev.plans) == plans
    finally:
        dev.close()
    assert got.tokens == reference_run[1]


def test_a_warmed_up_batcher_plans_nothing_for_a_lone_request_and_gives_the_reference_tokens(model, reference_run):
    """ContinuousBatcher.warm_up loads the slots' prefill steps (a 64-position context: 8, 16,
    ..., 64 tokens, from position 0 and from further on) and the decode steps of 1, 2 and 3 rows
    (3 slots), each of POOL candidates and of one (a batch of greedy jobs); a lone greedy
    request after it plans nothing and gets the NumPy reference's tokens, a sampled one (another
    pool, the same prompt: its last token prefilled again over its cached beginning) plans
    nothing either, and three requests at once (slots 0, 1 and 2: the slot is
    fed to the same steps) each get the reference's tokens, planning at most one prefill step
    of several slots' prompts (those the loop found waiting together: timing decides)."""
    from models.batching import ContinuousBatcher, Finished, Job, Token
    from models.requests import Sampling

    dev = MetaDevice(SimulatedCluster(2))
    try:
        batcher = ContinuousBatcher(dev, model, slots=3, ctx=CTX, weights="f32")
        assert batcher.warm_up() == 2 * 8 + 2 * 3
        plans = len(dev.plans)
        batcher.start()
        try:
            events = {}
            for sampling in (Sampling(), Sampling(temperature=0.8, top_k=5, seed=3)):
                job = Job(tuple(PROMPT_IDS), STEPS + 1, sampling, stop_at_eos=False)
                events[sampling.temperature] = list(batcher.submit(job).stream())
            assert len(dev.plans) == plans
            chains = set(batcher.net._prefills)
            greedy = Job(tuple(PROMPT_IDS), STEPS + 1, Sampling(), stop_at_eos=False)
            tickets = [batcher.submit(greedy) for _ in range(3)]
            together = [[e.token for e in t.stream() if isinstance(e, Token)] for t in tickets]
            with pytest.raises(RuntimeError, match="before start"):
                batcher.warm_up()
        finally:
            batcher.stop()
        # none, or one step of the 2 or 3 slots' prompts the loop found waiting together: its
        # embedding, one layer and its head planned, nothing else
        new = set(batcher.net._prefills) - chains
        assert len(new) <= 1 and all(key[3] in (2, 3) for key in new), new
        assert len(dev.plans) == plans + 3 * len(new)
    finally:
        dev.close()
    greedy = events[0.0]
    assert [e.token for e in greedy if isinstance(e, Token)] == reference_run[1]
    assert together == [reference_run[1]] * 3
    assert greedy[-1] == Finished("length") and events[0.8][-1] == Finished("length")


def test_a_repeat_penalty_gives_the_tokens_of_the_reference_with_the_penalty_by_hand(model, weights, reference_run):
    """Greedy with llama.cpp's repeat penalty over the last 8 tokens (the prompt's included), the
    workers choosing the later tokens themselves: equal to the NumPy reference's whole logits,
    penalised here by hand."""
    from models.generate import LLM
    from models.requests import Sampling

    penalty, window, steps = 1.8, 8, 14
    ref = ReferenceDecoder(model.config, weights, CTX)
    seq = list(PROMPT_IDS)
    logits = ref.forward(np.array([seq]), np.arange(len(seq))[None])[0, -1]
    expected = []
    for _ in range(steps):
        penalised = logits.astype(np.float64)
        for token in set(seq[-window:]):
            penalised[token] = penalised[token] / penalty if penalised[token] > 0 else penalised[token] * penalty
        expected.append(int(np.argmax(penalised)))
        seq.append(expected[-1])
        logits = ref.forward(np.array([[seq[-1]]]), np.array([[len(seq) - 1]]))[0, -1]
    assert expected != reference_run[1][:steps]  # the penalty changes the text
    dev = MetaDevice(SimulatedCluster(2))
    try:
        llm = LLM(dev, model, ctx=CTX)
        sampling = Sampling(repeat_penalty=penalty, repeat_last_n=window)
        (got,) = llm.generate([PROMPT], steps, sampling, stop_at_eos=False)
    finally:
        dev.close()
    assert got.tokens == expected


def test_a_conversation_goes_on_from_its_cached_turns_and_equals_a_fresh_run(model, monkeypatch):
    """The chat API takes messages; a second turn (chunks of 16 here) keeps the whole chunks of
    the first turn's prompt and prefills the rest (the rest of that prompt, its answer, what is
    new) by the chunks a whole prefill takes: the logits a fresh model gives for the whole
    conversation, bit for bit, and so its tokens."""
    import models.llama as llama
    from models.generate import LLM

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 16)
    dev = MetaDevice(SimulatedCluster(2))
    try:
        llm = LLM(dev, model, ctx=160, activations="f32")  # the exact products' answers
        conversation = [{"role": "user", "content": "What is the capital of France?"}]
        first = llm.chat(conversation, 24, system="Answer in one sentence.")
        assert first.finish_reason == "stop" and "Paris" in first.text
        conversation += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And of Italy?"},
        ]
        whole = llm.prompt_ids(conversation, True, "Answer in one sentence.")
        cached = list(llm._cached)
        prefilled, prefill = [], llm._prefill
        llm._prefill = lambda prompts, *rest: prefilled.append(len(prompts[0])) or prefill(prompts, *rest)
        second = llm.chat(conversation, 24, system="Answer in one sentence.", keep_logits=True)
        again = LLM(dev, model, ctx=160, activations="f32")
        fresh = again.chat(conversation, 24, system="Answer in one sentence.", keep_logits=True)
    finally:
        dev.close()
    kept = len(first.prompt_tokens) // 16 * 16
    assert cached == first.prompt_tokens and whole[: len(cached)] == cached and kept > 0  # the first prompt ...
    assert prefilled == [len(whole) - kept]  # ... but its last partial chunk is not prefilled again
    assert second.prompt_tokens == whole and second.tokens == fresh.tokens
    np.testing.assert_array_equal(llm.last_logits, again.last_logits)
    assert "Rome" in second.text


def test_llama_cli_flags_and_json_lines(model, reference_run):
    expected_tokens = reference_run[1]
    out = run_generate("-p", PROMPT, "-n", "4", "-c", "64", "--temp", "0", "--json", "-")
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = out.stdout.splitlines()  # JSON lines only: no plain text mixed in
    result = json.loads(line)
    assert result["prompt_tokens"] == PROMPT_IDS and result["tokens"] == expected_tokens[:4]


def test_several_prompts_print_plain_text_each_and_a_file_prompt_reads_stdin(model):
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "generate", PROMPT, "-f", "-", "-n", "3", "-c", "64"],
        input="Water boils at a temperature of",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = out.stdout.split("\n\n\n")  # each text ends its line, a blank line between them
    assert first == " Paris.\n" or first.startswith(" Paris.")
    assert "'" not in second and "->" not in second  # plain text, not a repr
    assert "2 prompt(s)" in out.stderr


def test_an_interactive_conversation_streams_each_reply_until_exit(model):
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "generate", "-i", "-sys", "Answer in one sentence.", "-c", "256"],
        input="What is the capital of France?\nAnd of Italy?\n/exit\nnever read\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    replies = out.stdout.splitlines()
    assert len(replies) == 2 and "Paris" in replies[0] and "Rome" in replies[1], out.stdout
    assert "<|im_end|>" not in out.stdout and "<|im_start|>" not in out.stdout


def test_a_message_read_goes_on_past_lines_ending_in_a_backslash(monkeypatch):
    import io

    from cli.generate import read_message

    monkeypatch.setattr(sys, "stdin", io.StringIO("one\\\ntwo\nthree\n\nlast"))
    assert [read_message(False) for _ in range(5)] == ["one\ntwo", "three", "", "last", None]


def test_a_model_that_cannot_fit_says_so_before_any_weight_moves(model, fresh_cluster):
    """The budget check of LLM against figures taken with gguf's own reader: float32 weights
    (every element, 4 bytes) over 2 workers plus a worker's KV cache of 2 of SmolLM2's 3 KV heads
    do not fit 200 MiB; the file's own blocks do, and load."""
    from gguf import GGUFReader

    from models.generate import LLM

    f32 = sum(int(t.n_elements) for t in GGUFReader(model.path).tensors) * 4
    kv = 2 * 30 * 2 * 256 * 64 * 4  # K and V, 30 layers, 2 KV heads, 256 positions, 64 values, float32
    dev = MetaDevice(fresh_cluster(2, memory_budget=200 << 20))
    try:
        wanted = (
            f"cannot fit: each of 2 workers needs at least {f32 / 2 / 2**20:.0f} MiB of f32 weights and "
            f"{kv / 2**20:.0f} MiB of KV cache at --ctx 256, over its 200 MiB budget; use more workers, "
            "--weights native or a smaller --ctx"
        )
        with pytest.raises(ModelError, match=wanted.replace("-", r"\-")):
            LLM(dev, model, ctx=256, weights="f32")
        halved = f"{kv / 2 / 2**20:.0f} MiB of KV cache at --ctx 256"  # float16 keys and values: 2 bytes each
        with pytest.raises(ModelError, match=halved):
            LLM(dev, model, ctx=256, weights="f32", cache_types=("f16", "f16"))
        with pytest.raises(ModelError, match="--cache-type-v 'q8_0': one of auto, f32, f16"):
            LLM(dev, model, ctx=256, cache_types=("f16", "q8_0"))
        assert [info["used"] for info in dev.stats().values()] == [0, 0]  # no weight was placed
        llm = LLM(dev, model, ctx=256, weights="native")
        assert "Paris" in llm.generate(["The capital of France is"], max_new_tokens=4)[0].text
    finally:
        dev.close()


@pytest.mark.parametrize(
    "weights, activations, asked, kept",
    [
        ("native", "q8", ("auto", "auto"), ("float16", "float16")),  # llama.cpp's arithmetic, its caches
        ("native", "f32", ("auto", "auto"), ("float32", "float32")),  # the exact paths: float32
        ("f32", "q8", ("auto", "auto"), ("float32", "float32")),
        ("native", "q8", ("f32", "f16"), ("float32", "float16")),  # as asked
    ],
)
def test_the_default_caches_are_llama_cpps_float16_on_its_arithmetic_and_float32_on_the_exact_paths(
    sim, model, weights, activations, asked, kept
):
    from models.generate import LLM

    llm = LLM(sim(1), model, ctx=16, weights=weights, activations=activations, cache_types=asked)
    assert (str(llm.net.k[0].dtype), str(llm.net.v[0].dtype)) == kept
    import inspect

    from models.batching import ContinuousBatcher

    for made_by in (LLM, ContinuousBatcher):  # the API and generate, serve: auto unless told
        assert inspect.signature(made_by).parameters["cache_types"].default == ("auto", "auto")


def test_a_first_run_that_compiles_the_loops_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """numba's cache read from its index files (beside the sources, or NUMBA_CACHE_DIR): empty,
    `generate` says the loops compile once (and warms its steps up first, so the prefill figure
    leaves that out); filled, or on a GPU, nothing is said."""
    import importlib.util
    import io
    import types

    from cli.generate import first_compile_notice
    from workers.backends.cpu import numba_cpu

    if not numba_cpu.AVAILABLE:
        pytest.skip("without numba nothing compiles")
    source = tmp_path / "pkg" / "numba_loops.py"
    source.parent.mkdir()
    source.write_text("")
    spec = importlib.util.spec_from_file_location("workers.backends.cpu.numba_loops", source)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert not numba_cpu.compiled_here()
    cpu = types.SimpleNamespace(cluster=types.SimpleNamespace(config=types.SimpleNamespace(backend="cpu")))
    said = io.StringIO()
    assert first_compile_notice(cpu, said) and said.getvalue().count("\n") == 1
    assert "compiling the CPU loops once" in said.getvalue()
    cuda = types.SimpleNamespace(cluster=types.SimpleNamespace(config=types.SimpleNamespace(backend="cuda")))
    assert not first_compile_notice(cuda, io.StringIO())
    beside = source.parent / "__pycache__"
    beside.mkdir()
    for stem in ("numba_loops.rope_rows-33", "int8_products.k_rows-189"):
        (beside / f"{stem}.py311.nbi").write_bytes(b"")
    assert numba_cpu.compiled_here()
    cache = tmp_path / "cache" / "any"
    cache.mkdir(parents=True)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    assert not numba_cpu.compiled_here()  # numba reads NUMBA_CACHE_DIR alone, and it is empty
    (cache / "numba_loops.rope_rows-33.py311.nbi").write_bytes(b"")
    assert not numba_cpu.compiled_here()  # the integer products' loops are not cached yet
    (cache / "int8_products.k_rows-189.py311.nbi").write_bytes(b"")
    assert numba_cpu.compiled_here()
    said = io.StringIO()
    assert not first_compile_notice(cpu, said) and said.getvalue() == ""


def test_a_servers_new_prompt_and_llms_prefill_give_the_same_logits_bit_for_bit(model):
    """The SmolLM2 file as a user runs it (8-bit activations, float16 caches): a server slot's
    first chunk attends over its prompt's own keys and values (n: the padded prompt), LLM's
    prefill over the caches' first positions (n: rounded up to the kernels' bucket, 32). Their
    softmax sums run over different lengths whose extra terms are exact zeros; summed in an
    order that depended on the length, the two ways' logits were up to 1.04 apart after a
    49-token prompt; and a prompt of 16 or fewer key rows took another BLAS kernel for its
    scores than for the cache's 32. With float32 caches (--cache-type-k f32) a prompt's own keys
    of up to 8 tokens went through BLAS where the cache's went through the attention loop (the
    loop wanted contiguous rows), and 9-16 took BLAS's kernel for 16 rows. Now equal bit for bit,
    so `serve` and `generate` continue a prompt alike."""
    from bench.hosts import PROMPT
    from models.loading import AUTO_CACHE, place_model
    from workers.simulator import SimulatedCluster

    text = model.tokenizer.encode(PROMPT + " " + PROMPT)
    lengths = (5, 9, 17, 40, 49, 77)  # padded to 8, 16, 24, 40, 56, 80
    for caches, tried in (((AUTO_CACHE, AUTO_CACHE), lengths), (("f32", "f32"), lengths[:3])):
        for length in tried:
            prompt = text[:length]
            got = []
            for slot in (None, 0):
                dev = MetaDevice(SimulatedCluster(1))
                try:
                    net = place_model(dev, model, 128, 1, cache_types=caches)
                    got.append(net.prefill([prompt], 0, 8, logits=True, slot=slot)[2].numpy()[0, 0])
                finally:
                    dev.close()
            np.testing.assert_array_equal(got[0], got[1], err_msg=f"a {length}-token prompt, {caches} caches")
