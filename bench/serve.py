"""`launch.py serve` under 1, 4 and 8 concurrent streaming clients: aggregate tokens/s and time
to first token, beside the prefill time of `launch.py generate` (LLM.generate) for the same prompt
on as many workers, in the same run.

    python bench/serve.py [--quick] [--json results/serve.json] [--workers 2] [--clients 1 4 8] [--soak 120]
                          [--join 2000] [--queued 56] [--turns 8] [--split layer]

Every client streams a greedy completion of a short prompt for a fixed number of tokens
(ignore_eos, as llama-server's benchmarks do). The server runs with as many slots as the most
clients. The client counts take turns, CLIENT_ROUNDS rounds (one with --quick): each count's
figures are its rounds' medians, and "x one stream" the median of its rounds' ratios to the
one-client round beside them (a single round of 8 streams is ~1 s: on a 2-core host, one slow
spell moved it between 2.3x and 3.3x). `--join N`: then four streams run while a prompt of N tokens joins; each stream's
longest gap between two tokens while it goes in (its prefill goes in chunks between their decode
steps: models/batching.py), beside their median gap between deliveries before it (the server
writes a stream's tokens a few at a time). `--queued N`: then as many streams as slots run while
N more requests arrive and wait for a slot; the running streams' longest gap between two tokens
over the next 3 s, beside their median gap between deliveries before. `--turns N`: then a chat of
N turns (each the conversation so far, the answer to the last turn and a new question), each
turn's time to first token with prompt caching (its slot's caches hold the conversation up to
the last answer: models/batching.py `_place`) and right after it the same messages with
`cache_prompt: false` (every token prefilled), and the tokens it found cached. Last, one stream's decode
rate (200 tokens, its first token's wait left out) beside `launch.py generate`'s on as many
workers of their own, in alternating rounds. `--split layer`: the server split by layers, and a
second one beside it with `--no-pipeline` (every stream in one step at a time, not in lanes
whose steps overlap: workers/pipelined.py); the client counts run against each in turn, the
rest against the first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, free_port, paired_ratio, table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# a prompt whose continuation starts with text: the model's first token after "Write a short story
# about ..." was <|im_end|>, which has no text, so the first chunk waited a decode step more and the
# time to first token was measured as the time to the second
PROMPT = "Once upon a time, a lighthouse keeper found a message in a bottle. It said"


def stream_once(url: str, tokens: int) -> dict:
    """One greedy stream's time to first token, tokens and wall time. The client is made before
    the clock starts: httpx's first request without one makes its TLS context (certificates
    loaded, 15-19 ms here, even for http), which a client that keeps its session, as any
    benchmark's does, pays once."""
    import httpx

    with httpx.Client(timeout=300) as session:
        return _timed_stream(session, url, stream_body(tokens))


def stream_body(tokens: int) -> dict:
    """A greedy stream of `tokens` tokens of PROMPT's continuation (no early end)."""
    return {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}


def _timed_stream(session, url: str, body: dict) -> dict:
    start, first, usage = time.perf_counter(), None, 0
    with session.stream("POST", url + "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None:
                first = time.perf_counter() - start
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
    return {"ttft_s": first, "tokens": usage, "wall_s": time.perf_counter() - start}


SOAK_PROMPTS = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(12)]


def complete(url: str, prompt: str, tokens: int, stream: bool) -> str:
    """A greedy completion's text, streamed (its pieces joined) or not."""
    import httpx

    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": stream}
    if not stream:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]
    pieces = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(pieces)


# a system prompt of ~200 tokens, as chat front-ends send with every turn (what is kept comes in
# whole chunks of 128 tokens: models/llama.py kept_prefix)
SYSTEM = (
    "You are a storyteller for a small coastal town's evening radio hour. Your listeners are of "
    "every age, so keep the stories gentle, vivid and easy to follow when heard aloud, without "
    "lists or headings. Each answer is a few sentences that carry the story forward from what "
    "was said before, keeping the names, places and details already given, and ending where a "
    "listener would want to hear more. Prefer the sea, the weather, the harbour and the people "
    "who work there; avoid anything frightening for a child, anything cruel, and anything that "
    "needs a picture to be understood. If a question asks about something the story has not "
    "told yet, invent it in keeping with the rest. Speak plainly, in the past tense, and never "
    "mention that you are a program or that this is a broadcast."
)
QUESTIONS = [
    "Tell me a short story about a lighthouse keeper.",
    "What did the keeper find in the bottle?",
    "Who had written the message, and why?",
    "How did the keeper answer it?",
    "What happened when the storm came?",
    "Describe the lighthouse at dawn after the storm.",
    "What did the keeper learn from all of it?",
    "Give the story a title and a last line.",
]


def conversation(url: str, turns: int, tokens: int = 32) -> dict:
    """A greedy chat of `turns` turns: each turn streamed with prompt caching, then the same
    messages with cache_prompt false; each one's time to its first text, its prompt's tokens and
    those found cached (usage.prompt_tokens_details)."""
    import httpx

    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    with httpx.Client(timeout=300) as session:
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            seen = {}
            for cache in (True, False):  # cached first: the slot then holds the conversation so far
                body = {
                    "messages": messages,
                    "max_tokens": tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "cache_prompt": cache,
                }
                start, first, text, usage = time.perf_counter(), None, [], {}
                with session.stream("POST", url + "/v1/chat/completions", json=body) as reply:
                    reply.raise_for_status()
                    for line in reply.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                        if piece and first is None:
                            first = time.perf_counter() - start
                        text.append(piece or "")
                        usage = chunk.get("usage") or usage
                seen[cache] = (first, "".join(text), usage)
            (ttft, answer, usage), (whole_ttft, whole_answer, _) = seen[True], seen[False]
            rows.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "ttft_cached_s": ttft,
                    "ttft_whole_s": whole_ttft,
                    "same_answer": answer == whole_answer,
                }
            )
            messages.append({"role": "assistant", "content": answer})
    return {"turns": turns, "tokens": tokens, "rows": rows}


def soak(url: str, seconds: float, clients: int, tokens: int = 16) -> dict:
    """`clients` clients sending greedy requests (streamed and not, in turn) for `seconds`, each
    answer compared with the one its prompt got alone: a lost request (an error) or another
    request's text (cross-talk) is counted."""
    expected = {p: complete(url, p, tokens, False) for p in SOAK_PROMPTS}  # alone, one at a time
    counts = {"requests": 0, "lost": 0, "wrong_text": 0}
    lock, end = threading.Lock(), time.monotonic() + seconds

    def client(k: int) -> None:
        i = k
        while time.monotonic() < end:
            prompt, i = SOAK_PROMPTS[i % len(SOAK_PROMPTS)], i + 1
            try:
                outcome = "requests" if complete(url, prompt, tokens, i % 2 == 0) == expected[prompt] else "wrong_text"
            except Exception:  # noqa: BLE001 - every failure is a lost request, counted
                outcome = "lost"
            with lock:
                counts[outcome] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)
    counts["requests"] += counts["lost"] + counts["wrong_text"]
    return {"seconds": seconds, "clients": clients, **counts}


def _running_streams(url: str, streams: int, tokens: int):
    """`streams` greedy streams started on threads, each token's arrival time recorded; returns
    (the arrival times per stream, an event that stops them, their threads) once each has 5."""
    import httpx

    arrivals: list[list[float]] = [[] for _ in range(streams)]
    done = threading.Event()

    def stream(k: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=stream_body(tokens), timeout=600) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals[k].append(time.perf_counter())
                if done.is_set():
                    break

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(len(a) for a in arrivals) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    return arrivals, done, threads


ONE_WRITE_S = 1e-3  # tokens arriving closer than this came in one write of the server's


def _gaps(arrivals: list[list[float]], start: float, end: float) -> tuple[float, float]:
    """(the longest gap between a stream's tokens arriving within (start, end], the median gap
    between its deliveries before start: the server writes the tokens that came since its last
    write together, at most 20 times a second, so a stream's tokens come a few at a time)."""
    during, before = [], []
    for times in arrivals:
        gaps = [(b - a, b) for a, b in zip(times, times[1:])]
        during += [gap for gap, at in gaps if start < at <= end]
        before += [gap for gap, at in gaps if at <= start and gap > ONE_WRITE_S]
    before.sort()
    return max(during, default=0.0), before[len(before) // 2] if before else 0.0


def join_stall(url: str, prompt_tokens: int, streams: int = 4, tokens: int = 2000) -> dict:
    """`streams` greedy streams, then a prompt of `prompt_tokens` token ids joining once each has
    5 tokens: each stream's longest gap between tokens from the join's submission to its answer."""
    import httpx

    arrivals, done, threads = _running_streams(url, streams, tokens)
    ids = [504 + i % 1000 for i in range(prompt_tokens)]  # any tokens of the vocabulary
    joined = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0}, timeout=600)
    answered = time.perf_counter()
    time.sleep(0.5)  # the streams' next tokens, past the answer
    done.set()
    for t in threads:
        t.join(600)
    reply.raise_for_status()
    longest, median = _gaps(arrivals, joined, answered + 0.5)
    return {
        "streams": streams,
        "prompt_tokens": prompt_tokens,
        "join_s": answered - joined,
        "max_gap_s": longest,
        "median_gap_before_s": median,
    }


def queue_stall(url: str, queued: int, streams: int, seconds: float = 3.0, tokens: int = 400) -> dict:
    """`streams` greedy streams fill every slot, then `queued` more requests arrive and wait for
    one (each a streamed request whose client keeps waiting): the running streams' longest gap
    between tokens over the next `seconds`, beside their median gap between deliveries before."""
    import httpx

    # the waiting clients' one connection pool, made before the clock: an httpx.stream of its
    # own per request made a client each (its TLS context from the CA bundle, ~25 ms of CPU), and
    # 56 of them at once on the server's two cores stalled the streams for up to 1.9 s: the
    # clients' cost on this machine, not the server's (a collection pass in the server took 1.4 s
    # of wall time then, 20 ms when quiet)
    pool = httpx.Client(timeout=seconds + 60, limits=httpx.Limits(max_connections=queued + 1))
    arrivals, done, threads = _running_streams(url, streams, tokens)
    gone = threading.Event()

    def waiting() -> None:
        try:
            with pool.stream("POST", url + "/v1/completions", json=stream_body(4)) as reply:
                for _ in reply.iter_lines():
                    if gone.is_set():
                        break
        except httpx.HTTPError:
            pass

    queue = [threading.Thread(target=waiting) for _ in range(queued)]
    arrived = time.perf_counter()
    for t in queue:
        t.start()
    time.sleep(seconds)
    done.set()
    gone.set()
    for t in threads + queue:
        t.join(600)
    pool.close()
    longest, median = _gaps(arrivals, arrived, arrived + seconds)
    figures = {"streams": streams, "queued": queued, "seconds": seconds}
    return figures | {"max_gap_s": longest, "median_gap_before_s": median}


CLIENT_ROUNDS = 3  # rounds of every client count (--quick: 1)


def concurrent_streams(url: str, n: int, tokens: int) -> dict:
    """`n` clients streaming at once, each over a session made before the clock: the wall time
    from the first request to the last stream's end, and each stream's figures."""
    import httpx

    results: list[dict] = []
    sessions = [httpx.Client(timeout=300) for _ in range(n)]  # made before the clock (stream_once)

    def client(session) -> None:
        results.append(_timed_stream(session, url, stream_body(tokens)))

    threads = [threading.Thread(target=client, args=(session,)) for session in sessions]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    for session in sessions:
        session.close()
    return {"wall_s": wall, "streams": results}


def client_row(n: int, rounds: list[dict], alone: list[dict] | None) -> dict:
    """A client count's row from its rounds: the median aggregate tokens/s and first-token
    waits, and against one client (`alone`, its rounds run beside these) the median of the
    rounds' ratios (paired_ratio)."""
    rates = [sum(r["tokens"] for r in one["streams"]) / one["wall_s"] for one in rounds]
    ttfts = sorted(r["ttft_s"] for one in rounds for r in one["streams"])
    row = {
        "clients": n,
        "rounds": len(rounds),
        "tokens": sum(r["tokens"] for r in rounds[0]["streams"]),
        "aggregate_tokens_per_s": float(np.median(rates)),
        "ttft_median_s": ttfts[len(ttfts) // 2],
        "ttft_max_s": ttfts[-1],
        "speedup_over_one": None,
    }
    if alone is not None:  # tokens/s ratios, as seconds a token: reference alone, ours n streams
        single = [sum(r["tokens"] for r in one["streams"]) / one["wall_s"] for one in alone]
        row["speedup_over_one"] = paired_ratio([1 / r for r in single], [1 / r for r in rates])
    return row


def _llm(workers: int, split: str = "row"):
    from meta import ClusterConfig, MetaDevice, ProcessCluster
    from models.generate import LLM
    from models.gguf_model import GGUFModel

    dev = MetaDevice(ProcessCluster(ClusterConfig(workers=workers)))
    return dev, LLM(dev, GGUFModel(), ctx=512, split=split)


def generate_prefill(workers: int, split: str = "row") -> float:
    """Prefill seconds of LLM.generate (what `launch.py generate` reports) for the prompt."""
    dev, llm = _llm(workers, split)
    with dev:
        llm.generate([PROMPT], max_new_tokens=2)  # the first prompt of a length also plans it
        return float(np.median([llm.generate([PROMPT], max_new_tokens=2)[0].prefill_s for _ in range(5)]))


def stream_against_generate(url: str, workers: int, tokens: int, rounds: int = 9, split: str = "row") -> dict:
    """One stream's decode rate (its tokens after the first, over the time after the first)
    and time to first token beside LLM.generate's decode rate (what `launch.py generate`
    reports: tokens after the first over its decode time) and prefill, on as many workers of
    their own, in alternating rounds; medians, and each ratio also the median of its rounds'
    (paired_ratio: a neighbour that slows one round slows its pair alike)."""
    import httpx

    served, generated, firsts, prefills = [], [], [], []
    dev, llm = _llm(workers, split)
    with dev, httpx.Client(timeout=300) as session:
        llm.generate([PROMPT], max_new_tokens=4, stop_at_eos=False)  # plans its steps
        for _ in range(rounds):
            r = _timed_stream(session, url, stream_body(tokens))
            served.append((r["tokens"] - 1) / (r["wall_s"] - r["ttft_s"]))
            firsts.append(r["ttft_s"])
            g = llm.generate([PROMPT], max_new_tokens=tokens, stop_at_eos=False)[0]
            generated.append((len(g.tokens) - 1) / g.decode_s)
            prefills.append(g.prefill_s)
    return {
        "tokens": tokens,
        "rounds": rounds,
        "served_tokens_per_s": float(np.median(served)),
        "generate_tokens_per_s": float(np.median(generated)),
        "served_ttft_s": float(np.median(firsts)),
        "generate_prefill_s": float(np.median(prefills)),
        "paired_ratio": paired_ratio([1 / g for g in generated], [1 / s for s in served]),  # served / generate
        "paired_ttft_ratio": paired_ratio(firsts, prefills),  # TTFT / prefill
    }


def _start_server(workers: int, slots: int, ctx: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`launch.py serve` on a free port, once it answers /health: (the process, its url)."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(ROOT / "launch.py"), "serve", "--workers", str(workers), "--port", str(port)]
    cmd += ["--max-slots", str(slots), "--ctx", str(ctx), *extra]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the server did not start: {server.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.2)


# --split layer: the server as it runs (its running streams in lanes, one a layer group, whose
# steps overlap: workers/pipelined.py), and beside it one with every stream in one step at a time
LAYER_SERVERS = {"lanes": ["--split", "layer"], "one step": ["--split", "layer", "--no-pipeline"]}


def run(
    quick: bool,
    workers: int,
    clients: list[int],
    soak_seconds: float = 0.0,
    join: int = 0,
    queued: int = 0,
    split: str = "row",
    turns: int = 0,
) -> dict:
    import httpx

    tokens = 24 if quick else 64
    slots = max(clients + [5 if join else 1])
    ctx = max(512, join + 256)
    variants = LAYER_SERVERS if split == "layer" else {"": []}
    servers = {}
    try:
        for name, extra in variants.items():
            servers[name] = _start_server(workers, slots, ctx, extra)
            stream_once(servers[name][1], 4)  # plans the prefill and decode steps
        url = next(iter(servers.values()))[1]
        rounds = 1 if quick else CLIENT_ROUNDS
        timed = {name: {n: [] for n in clients} for name in variants}
        for _ in range(rounds):  # the counts in turn, round after round: a slow spell hits them alike
            for n in clients:
                for name in variants:  # the servers in turn too: idle, one takes no core from the other
                    timed[name][n].append(concurrent_streams(servers[name][1], n, tokens))
        by_variant = {
            name: [client_row(n, done[n], done[clients[0]] if clients[0] == 1 else None) for n in clients]
            for name, done in timed.items()
        }
        rows = next(iter(by_variant.values()))
        soaked = soak(url, soak_seconds, max(clients)) if soak_seconds > 0 else None
        joined = join_stall(url, join) if join else None
        waited = queue_stall(url, queued, slots) if queued else None
        chatted = conversation(url, turns) if turns else None
        against = stream_against_generate(url, workers, tokens=48 if quick else 200, split=split)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        inside = [line for line in metrics.splitlines() if 'first_token_seconds{quantile="0.5"}' in line]
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(60)
    server_ttft = float(inside[0].split()[-1]) if inside else None  # submit to first token, in the server
    return {
        "workers": workers,
        "split": split,
        "rows": rows,
        "variants": by_variant if split == "layer" else {},
        "generate_prefill_s": generate_prefill(workers, split),
        "server_ttft_median_s": server_ttft,
        "soak": soaked,
        "join": joined,
        "queue": waited,
        "conversation": chatted,
        "one_stream": against,
    }


def _one_row(title: str, figures: dict, columns: dict[str, str]) -> None:
    """A table of one row: `columns` maps each figure's key to its column's name."""
    print(table(title, list(columns.values()), [[figures[key] for key in columns]]))


def show(results: dict) -> None:
    variants = results.get("variants") or {}
    if variants:
        lanes, one_step = variants["lanes"], variants["one step"]
        print(
            table(
                f"launch.py serve --split layer, {results['workers']} workers: running streams in lanes (one a "
                "group, steps overlapping) against every stream in one step at a time (--no-pipeline), "
                "servers and client counts in turn",
                ["clients", "lanes tok/s", "one step tok/s", "lanes / one step"],
                [
                    [
                        a["clients"],
                        a["aggregate_tokens_per_s"],
                        b["aggregate_tokens_per_s"],
                        a["aggregate_tokens_per_s"] / b["aggregate_tokens_per_s"],
                    ]
                    for a, b in zip(lanes, one_step)
                ],  # fmt: skip
            )
        )
    joined, soaked = results.get("join"), results.get("soak")
    if joined:
        title = f"a {joined['prompt_tokens']}-token prompt joining {joined['streams']} running streams"
        cols = {"join_s": "join answered s", "max_gap_s": "longest gap between a stream's tokens s"}
        _one_row(title, joined, cols | {"median_gap_before_s": "median delivery gap before s"})
    waited = results.get("queue")
    if waited:
        title = f"{waited['queued']} requests queued behind {waited['streams']} running streams (every slot busy)"
        cols = {"max_gap_s": f"longest gap between a stream's tokens over {waited['seconds']:.0f} s"}
        _one_row(title, waited, cols | {"median_gap_before_s": "median delivery gap before s"})
    chatted = results.get("conversation")
    if chatted:
        print(
            table(
                f"a chat of {chatted['turns']} turns ({chatted['tokens']} greedy tokens an answer): each turn's "
                "time to first token with prompt caching, then the same messages with cache_prompt false",
                ["turn", "prompt tokens", "cached", "TTFT cached ms", "TTFT whole ms", "whole / cached", "same text"],
                [
                    [
                        r["turn"],
                        r["prompt_tokens"],
                        r["cached_tokens"],
                        r["ttft_cached_s"] * 1e3,
                        r["ttft_whole_s"] * 1e3,
                        r["ttft_whole_s"] / r["ttft_cached_s"],
                        "yes" if r["same_answer"] else "NO",
                    ]
                    for r in chatted["rows"]
                ],
            )
        )
    if soaked:
        title = f"soak: {soaked['clients']} clients, {soaked['seconds']:.0f} s, answers against their prompt's alone"
        _one_row(title, soaked, {"requests": "requests", "lost": "lost", "wrong_text": "wrong text"})
    against = results.get("one_stream")
    if against:
        title = (
            f"one stream of {against['tokens']} tokens against launch.py generate's decode and prefill "
            f"(medians of {against.get('rounds', 3)} alternating rounds; paired: the median of the rounds' ratios)"
        )
        cols = {"served_tokens_per_s": "served tok/s", "generate_tokens_per_s": "generate tok/s"}
        figures = against | {"ratio": against["served_tokens_per_s"] / against["generate_tokens_per_s"]}
        cols |= {"ratio": "served / generate"}
        if against.get("paired_ratio") is not None:
            cols |= {"paired_ratio": "paired"}
        if "served_ttft_s" in against:
            figures |= {
                "ttft_ms": against["served_ttft_s"] * 1e3,
                "prefill_ms": against["generate_prefill_s"] * 1e3,
                "ttft_ratio": against["served_ttft_s"] / against["generate_prefill_s"],
            }
            cols |= {"ttft_ms": "TTFT ms", "prefill_ms": "generate prefill ms", "ttft_ratio": "TTFT / prefill"}
            if against.get("paired_ttft_ratio") is not None:
                cols |= {"paired_ttft_ratio": "paired"}
        _one_row(title, figures, cols)
    prefill = results["generate_prefill_s"]
    print(
        table(
            f"launch.py serve, {results['workers']} workers, greedy streams of one prompt, medians of "
            f"{results['rows'][0]['rounds'] if results['rows'] else 0} rounds "
            f"(launch.py generate prefills it in {prefill * 1e3:.0f} ms; the server's own median from request to "
            f"first token, every request: {(results.get('server_ttft_median_s') or 0) * 1e3:.0f} ms)",
            ["clients", "tokens", "aggregate tok/s", "x one stream", "TTFT median ms", "TTFT max ms", "TTFT/prefill"],
            [
                [
                    r["clients"],
                    r["tokens"],
                    r["aggregate_tokens_per_s"],
                    r["speedup_over_one"] or 0.0,
                    r["ttft_median_s"] * 1e3,
                    r["ttft_max_s"] * 1e3,
                    r["ttft_median_s"] / prefill,
                ]
                for r in results["rows"]
            ],
        )
    )


def main(argv: list[str] | None = None) -> int:
    def measure(args):
        return run(args.quick, args.workers, args.clients, args.soak, args.join, args.queued, args.split, args.turns)

    def options(ap) -> None:
        ap.add_argument("--workers", type=int, default=2)
        ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
        ap.add_argument(
            "--soak", type=float, default=0.0, help="then as many clients as the most for this many seconds"
        )
        ap.add_argument("--join", type=int, default=0, help="then a prompt of this many tokens joins 4 streams")
        ap.add_argument("--queued", type=int, default=0, help="then this many requests queue behind full slots")
        ap.add_argument("--turns", type=int, default=0, help="then a chat of this many turns, cached and not")
        ap.add_argument(
            "--split",
            choices=("row", "layer"),
            default="row",
            help="layer: the server split by layers, and beside it the same with --no-pipeline, clients in turn",
        )

    return cli(__doc__, "serve", measure, show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
