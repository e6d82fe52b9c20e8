"""`launch.py serve` on loopback, spoken to with the real openai client and raw HTTP: greedy
tokens equal to the NumPy reference, concurrent requests each getting the tokens they get alone,
streaming equal to non-streaming, OpenAI error bodies, a client leaving mid-stream freeing its
slot, and SIGTERM leaving nothing behind. One server for the module (its start is the slow part);
the SIGTERM test is the last and stops it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from models.llama import ReferenceDecoder  # noqa: E402

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
SLOTS, CTX = 3, 96
PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


@pytest.fixture(scope="module")
def server(model):
    port = _free_port()
    cmd = [sys.executable, str(ROOT / "launch.py"), "serve", "--workers", "2", "--port", str(port)]
    cmd += ["--max-slots", str(SLOTS), "--ctx", str(CTX), "--api-key", KEY, "--grace", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not come up within 90 s")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _reference_tokens(model, prompt_ids: list[int], steps: int) -> list[int]:
    names = ["embed", "norm"] + [
        f"l{i}.{k}"
        for i in range(model.config.layers)
        for k in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    ]
    ref = ReferenceDecoder(model.config, {n: model.weight(n) for n in names}, len(prompt_ids) + steps)
    logits = ref.forward(np.array([prompt_ids]), np.arange(len(prompt_ids))[None])[0, -1]
    tokens = [int(np.argmax(logits))]
    for pos in range(len(prompt_ids), len(prompt_ids) + steps - 1):
        tokens.append(int(np.argmax(ref.forward(np.array([[tokens[-1]]]), np.array([[pos]]))[0, -1])))
    return tokens


def test_a_greedy_completion_is_the_references_text(server, client, model):
    ids = model.tokenizer.encode(PROMPTS[0])
    out = client.completions.create(model="", prompt=ids, max_tokens=6, temperature=0)
    expected = model.tokenizer.decode(_reference_tokens(model, ids, 6))
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 6)


def test_a_request_past_the_context_ends_there_and_the_server_goes_on(server, client, model):
    """max_tokens beyond what the context holds: the completion ends with "length" when its next
    token has no cache position left (CTX - prompt + 1 tokens: the last is never fed back), and
    the next request is served as usual."""
    ids = model.tokenizer.encode(PROMPTS[2])
    out = client.completions.create(
        model="", prompt=ids, max_tokens=4 * CTX, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), CTX - len(ids) + 1)
    again = client.completions.create(model="", prompt=ids, max_tokens=3, temperature=0)
    assert again.usage.completion_tokens == 3 and out.choices[0].text.startswith(again.choices[0].text)


def _metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=5).text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))


def test_a_request_alone_decodes_its_row_only(server, client):
    """One request costs steps of one row, not of every slot (SLOTS rows)."""
    url = server[1]
    steps, rows = _metric(url, "meta_tp_decode_steps_total"), _metric(url, "meta_tp_decode_rows_total")
    client.completions.create(model="", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    steps = _metric(url, "meta_tp_decode_steps_total") - steps
    assert steps == 5  # the first token comes with the prompt
    assert _metric(url, "meta_tp_decode_rows_total") - rows == steps


def test_concurrent_requests_each_get_the_tokens_they_get_alone(server, client):
    def ask(prompt: str) -> str:
        return client.completions.create(model="", prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    alone = [ask(p) for p in PROMPTS]
    together: dict[int, str] = {}
    streams: dict[int, str] = {}

    def stream(i: int) -> None:  # a streamed request joins the batch beside the others
        parts = client.completions.create(model="", prompt=PROMPTS[i], max_tokens=8, temperature=0, stream=True)
        streams[i] = "".join(c.choices[0].text for c in parts)

    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(PROMPTS[i]))) for i in range(3)]
    threads += [threading.Thread(target=stream, args=(i,)) for i in range(2)]  # 5 requests, 3 slots: a queue
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together[i] for i in range(3)] == alone
    assert [streams[i] for i in range(2)] == alone[:2]


def test_chat_streamed_and_not_give_the_same_message(server, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="", messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(model="", messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_sampled_request_is_reproducible_by_its_seed(server, client):
    def ask() -> str:
        out = client.completions.create(model="", prompt=PROMPTS[1], max_tokens=8, temperature=0.9, seed=7)
        return out.choices[0].text

    assert ask() == ask()


@pytest.mark.parametrize(
    "headers, body, status, kind, says",
    [
        ({"Authorization": "Bearer wrong"}, {"prompt": "x"}, 401, "authentication_error", "invalid API key"),
        ({}, b"{not json", 400, "invalid_request_error", "not JSON"),
        ({}, {"prompt": "x", "n": 2}, 400, "invalid_request_error", "n = 1"),
        ({}, {"prompt": "x " * 200}, 400, "invalid_request_error", "does not fit the context"),
        ({}, {"prompt": "x", "model": "gpt-9"}, 404, "invalid_request_error", "does not exist"),
        ({}, {"prompt": "x", "temperature": "hot"}, 400, "invalid_request_error", "'temperature'"),
        ({}, {"prompt": 5}, 400, "invalid_request_error", "'prompt'"),
        ({}, {"prompt": "x", "temperature": True}, 400, "invalid_request_error", "'temperature' must be a number"),
        ({}, {"prompt": "x", "temperature": float("nan")}, 400, "invalid_request_error", "'temperature' must lie in"),
        ({}, {"prompt": "x", "top_p": float("inf")}, 400, "invalid_request_error", "'top_p' must lie in"),
        ({}, {"prompt": "x", "top_p": 1.5}, 400, "invalid_request_error", "'top_p' must lie in [0.0, 1.0]"),
        ({}, {"prompt": "x", "top_k": 2.5}, 400, "invalid_request_error", "'top_k' must be a number, got 2.5"),
        ({}, {"prompt": "x", "max_tokens": 0}, 400, "invalid_request_error", "'max_tokens' must lie in"),
        ({}, {"prompt": "x", "stop": [""]}, 400, "invalid_request_error", "'stop' must be a non-empty string"),
        ({}, {"prompt": "x", "ignore_eos": "yes"}, 400, "invalid_request_error", "'ignore_eos' must be true or false"),
    ],
)
def test_bad_requests_get_openai_error_bodies(server, headers, body, status, kind, says):
    headers = {"Authorization": f"Bearer {KEY}"} | headers
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(server[1] + "/v1/completions", content=content, headers=headers, timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["type"] == kind and says in error["message"]


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    url, headers = server[1], {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": PROMPTS[2], "max_tokens": 80, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=30) as reply:
        lines = reply.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
        assert httpx.get(url + "/health", timeout=5).json()["active"] == 1
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health", timeout=5).json()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health", timeout=5).json()["active"] == 0
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert 'meta_tp_requests_finished_total{reason="cancelled"} 1' in metrics


def test_sigterm_exits_0_leaving_no_worker_or_shared_memory(server):
    proc, url = server
    workers = _children(proc.pid)
    assert len(workers) == 2
    before = {f for f in os.listdir("/dev/shm") if f.startswith("meta-tp-")}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stderr.read()
    deadline = time.monotonic() + 5
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(workers) == [], "orphaned workers"
    left = {f for f in os.listdir("/dev/shm") if f.startswith("meta-tp-")}
    assert not left & before, f"shared memory left behind: {sorted(left & before)}"
