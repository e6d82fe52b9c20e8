"""`launch.py serve` under 1, 4 and 8 concurrent streaming clients: aggregate tokens/s and time
to first token, beside the prefill time of `launch.py generate` (LLM.generate) for the same prompt
on as many workers, in the same run.

    python bench/serve.py [--quick] [--json results/serve.json] [--workers 2] [--clients 1 4 8]

Every client streams a greedy completion of a short prompt for a fixed number of tokens
(ignore_eos, as llama-server's benchmarks do). The server runs with as many slots as the most
clients.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cli, table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_once(url: str, tokens: int) -> dict:
    import httpx

    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    start, first, usage = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None:
                first = time.perf_counter() - start
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
    return {"ttft_s": first, "tokens": usage, "wall_s": time.perf_counter() - start}


def generate_prefill(workers: int) -> float:
    """Prefill seconds of LLM.generate (what `launch.py generate` reports) for the prompt."""
    from meta import ClusterConfig, MetaDevice, ProcessCluster
    from models.generate import LLM
    from models.gguf_model import GGUFModel

    with MetaDevice(ProcessCluster(ClusterConfig(workers=workers))) as dev:
        llm = LLM(dev, GGUFModel(), ctx=512)
        llm.generate([PROMPT], max_new_tokens=2)  # the first prompt of a length also plans it
        return min(llm.generate([PROMPT], max_new_tokens=2)[0].prefill_s for _ in range(3))


def run(quick: bool, workers: int, clients: list[int]) -> dict:
    import httpx

    tokens = 24 if quick else 64
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(ROOT / "launch.py"), "serve", "--workers", str(workers), "--port", str(port)]
    cmd += ["--max-slots", str(max(clients)), "--ctx", "512"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = []
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {server.stderr.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        stream_once(url, 4)  # plans the prefill and decode steps
        for n in clients:
            results: list[dict] = []

            def client(results=results) -> None:
                results.append(stream_once(url, tokens))

            threads = [threading.Thread(target=client) for _ in range(n)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            wall = time.perf_counter() - start
            ttft = sorted(r["ttft_s"] for r in results)
            rows.append(
                {
                    "clients": n,
                    "tokens": sum(r["tokens"] for r in results),
                    "aggregate_tokens_per_s": sum(r["tokens"] for r in results) / wall,
                    "ttft_median_s": ttft[len(ttft) // 2],
                    "ttft_max_s": ttft[-1],
                }
            )
    finally:
        server.terminate()
        server.wait(60)
    one = rows[0]["aggregate_tokens_per_s"] if rows and rows[0]["clients"] == 1 else None
    for row in rows:
        row["speedup_over_one"] = row["aggregate_tokens_per_s"] / one if one else None
    return {"workers": workers, "rows": rows, "generate_prefill_s": generate_prefill(workers)}


def show(results: dict) -> None:
    prefill = results["generate_prefill_s"]
    print(
        table(
            f"launch.py serve, {results['workers']} workers, greedy streams of one prompt "
            f"(launch.py generate prefills it in {prefill * 1e3:.0f} ms)",
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
        return run(args.quick, args.workers, args.clients)

    def options(ap) -> None:
        ap.add_argument("--workers", type=int, default=2)
        ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])

    return cli(__doc__, "serve", measure, show, argv, options)


if __name__ == "__main__":
    sys.exit(main())
