"""`launch.py serve`: an OpenAI-compatible HTTP server over a tensor-parallel model, with
continuous batching (models/batching.py).

    python launch.py serve --workers 2 --port 8000 [--max-slots 8] [--ctx 2048] [--api-key KEY]

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(streaming with server-sent events ending in `data: [DONE]`, or not), GET /metrics (Prometheus
text). Errors are OpenAI's JSON bodies: 400 for a malformed request, 401 for a wrong key, 404 for
an unknown model, 503 once the cluster is lost. SIGTERM (or Ctrl-C) stops accepting, lets what
runs finish for the grace period, cancels the rest, stops the workers and exits 0.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request)
import argparse
import asyncio
import json
import math
import secrets
import signal
import sys
import time

from cli.display import widening_notice
from cli.options import add_cache_type_options, add_cluster_options, open_cluster

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_body(exc: RequestError) -> dict:
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": None}}


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        value = default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise RequestError(400, f"'{name}' must be a number, got {value!r}", param=name)
    value = kind(value)
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(400, f"'{name}' must lie in [{low}, {high}], got {value!r}", param=name)
    return value


def job_from(body: dict, prompt_ids: list[int], default_seed: int):
    """The batcher's Job for an OpenAI request body (completions or chat)."""
    from models.batching import Job
    from models.generate import Sampling

    if _number(body, "n", 1, int) != 1:
        raise RequestError(400, "only n = 1 is supported", param="n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    sampling = Sampling(
        temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_k=_number(body, "top_k", 0, int, 0),
        top_p=_number(body, "top_p", 1.0, float, 0.0, 1.0) or 1.0,
        seed=_number(body, "seed", default_seed, int, 0),
        min_p=_number(body, "min_p", 0.0, float, 0.0, 0.99),  # vLLM's and llama-server's extension
        repeat_penalty=_number(body, "repetition_penalty", 1.0, float, 0.01, 10.0),  # vLLM's name for it
    )
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": limit}, "max_tokens", DEFAULT_MAX_TOKENS, int, 1)
    ignore_eos = body.get("ignore_eos", False)  # llama-server's extension: go on past end-of-generation
    if not isinstance(ignore_eos, bool):
        raise RequestError(400, "'ignore_eos' must be true or false", param="ignore_eos")
    return Job(tuple(prompt_ids), max_tokens, sampling, tuple(stop), stop_at_eos=not ignore_eos)


def build_app(batcher, model_id: str, api_key: str = "", chat_template=None):
    """The FastAPI application over a started ContinuousBatcher."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from models.batching import Token
    from models.generate import TextStream
    from split_state.errors import MetaError, WorkerLost

    app = FastAPI(title="meta-tp", docs_url=None, redoc_url=None)
    tokenizer = batcher.tokenizer
    started = time.time()

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        return JSONResponse(error_body(exc), status_code=exc.status)

    def check_key(request: Request) -> None:
        if api_key and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}"):
            raise RequestError(401, "invalid API key: send 'Authorization: Bearer KEY'", "authentication_error")

    async def read_body(request: Request) -> dict:
        check_key(request)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        if body.get("model") not in (None, "", model_id):
            raise RequestError(
                404, f"the model '{body['model']}' does not exist; this server has '{model_id}'", param="model"
            )
        if batcher.lost:
            raise RequestError(503, f"the cluster is lost: {batcher.lost}", "server_error")
        return body

    def submit(job):
        try:
            return batcher.submit(job)
        except WorkerLost as exc:
            raise RequestError(503, str(exc), "server_error") from None
        except MetaError as exc:
            raise RequestError(400, str(exc)) from None

    async def events(ticket):
        """The ticket's events, waited for off the event loop."""
        stream = ticket.stream()
        while True:
            event = await asyncio.to_thread(next, stream, None)
            if event is None:
                return
            yield event

    async def respond(body: dict, prompt_ids: list[int], chat: bool):
        job = job_from(body, prompt_ids, secrets.randbelow(2**31))
        ticket = submit(job)
        streamed = bool(body.get("stream"))
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        text = TextStream(tokenizer, False, job.stop_strings)

        def usage() -> dict:
            n = len(text.tokens)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        def choice(piece: str, finish: str | None, whole: bool) -> dict:
            if not chat:
                return {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
            key = "message" if whole else "delta"
            content = {"role": "assistant", "content": piece} if whole else {"content": piece} if piece else {}
            return {"index": 0, key: content, "finish_reason": finish}

        def envelope(choices: list, **extra) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": model_id, "choices": choices} | extra

        if not streamed:
            try:
                finished = None
                async for event in events(ticket):
                    if isinstance(event, Token):
                        text.push(event.token)
                    else:
                        finished = event
            finally:
                ticket.cancel()  # a client gone before the end frees the slot
            if finished.reason == "error":
                raise RequestError(503, f"generation failed: {finished.error}", "server_error")
            result = envelope([choice(text.final_text(), finished.reason, True)], usage=usage())
            return JSONResponse(result)

        async def sse():
            try:
                if chat:
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield f"data: {json.dumps(envelope([first]))}\n\n"
                async for event in events(ticket):
                    if isinstance(event, Token):
                        piece = text.push(event.token)
                        if piece:
                            yield f"data: {json.dumps(envelope([choice(piece, None, False)]))}\n\n"
                        continue
                    if event.reason == "error":
                        failed = RequestError(503, f"generation failed: {event.error}", "server_error")
                        yield f"data: {json.dumps(error_body(failed))}\n\n"
                        return
                    rest = text.finish()
                    last = envelope([choice(rest, event.reason, False)], usage=usage())
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                ticket.cancel()  # the client left (or the stream ended): the slot is freed

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        if batcher.lost:
            return JSONResponse({"status": "error", "error": batcher.lost}, status_code=503)
        return {"status": "ok", "slots": len(batcher.slots), "active": batcher.active()}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": int(started), "owned_by": "meta-tp"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        elif isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            raise RequestError(400, "'prompt' must be a string (or one string, or a list of token ids)", param="prompt")
        return await respond(body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise RequestError(
                400,
                "'messages' must be a non-empty list of {role, content} objects with text content",
                param="messages",
            )
        if chat_template is None:
            raise RequestError(400, "this model has no chat template: use /v1/completions")
        from models.gguf_model import TemplateError

        try:
            text = chat_template.render([{"role": m["role"], "content": m["content"]} for m in messages])
        except TemplateError as exc:
            raise RequestError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        return await respond(body, tokenizer.encode(text), chat=True)

    @app.get("/metrics")
    async def metrics():
        c = batcher.counters
        ttft = sorted(c.first_token_seconds)
        lines = [
            "# TYPE meta_tp_requests_total counter",
            f"meta_tp_requests_total {c.requests}",
            "# TYPE meta_tp_requests_finished_total counter",
            *(f'meta_tp_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(c.finished.items())),
            "# TYPE meta_tp_prompt_tokens_total counter",
            f"meta_tp_prompt_tokens_total {c.prompt_tokens}",
            "# TYPE meta_tp_generated_tokens_total counter",
            f"meta_tp_generated_tokens_total {c.generated_tokens}",
            "# TYPE meta_tp_active_slots gauge",
            f"meta_tp_active_slots {batcher.active()}",
            "# TYPE meta_tp_slots gauge",
            f"meta_tp_slots {len(batcher.slots)}",
            "# TYPE meta_tp_queue_depth gauge",
            f"meta_tp_queue_depth {len(batcher.waiting)}",
            "# TYPE meta_tp_time_to_first_token_seconds summary",
            *(
                f'meta_tp_time_to_first_token_seconds{{quantile="{q}"}} {ttft[int(q * (len(ttft) - 1))]:.6f}'
                for q in (0.5, 0.9, 0.99)
                if ttft
            ),
            "# TYPE meta_tp_decode_steps_total counter",
            f"meta_tp_decode_steps_total {c.decode_steps}",
            "# TYPE meta_tp_decode_rows_total counter",
            f"meta_tp_decode_rows_total {c.decode_rows}",
            "# TYPE meta_tp_decode_seconds_total counter",
            f"meta_tp_decode_seconds_total {c.decode_seconds:.6f}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


def serve(args: argparse.Namespace) -> int:
    from models.batching import ContinuousBatcher
    from models.gguf_model import GGUFModel

    try:
        import uvicorn  # noqa: F401
        from fastapi import FastAPI  # noqa: F401
    except ImportError:
        print("error: serve needs FastAPI and uvicorn: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    import uvicorn

    model = GGUFModel(args.model or None)
    model.check()  # a file that cannot be served is refused before any worker starts
    model.tokenizer  # noqa: B018 - built now, for the same reason
    model_id = args.model_id or model.path.stem
    widening_notice(model, args.weights)
    with open_cluster(args) as dev:
        batcher = ContinuousBatcher(
            dev,
            model,
            slots=args.max_slots,
            ctx=args.ctx,
            weights=args.weights,
            cache_types=(args.cache_type_k, args.cache_type_v),
        )
        if not args.no_warmup:
            batcher.warm_up()
        batcher.start()
        try:
            app = build_app(batcher, model_id, args.api_key, model.chat_template)
            config = uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level="warning",
                timeout_graceful_shutdown=args.grace,
                lifespan="off",
            )
            server = uvicorn.Server(config)
            print(
                f"serving {model_id} on http://{args.host}:{args.port} ({dev.n} workers, {args.max_slots} slots)",
                file=sys.stderr,
                flush=True,
            )
            # uvicorn stops gracefully on SIGTERM / SIGINT, then raises the signal again for the
            # handler it found: a quiet one here, so the batcher and the workers are stopped below
            # and the exit is 0 (Python's own would end the process before that)
            quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                server.run()
            finally:
                for sig, handler in quiet.items():
                    signal.signal(sig, handler)
        finally:
            batcher.stop()
    return 0


def add(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("--model", default="", help="a llama-architecture .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model-id", default="", help="the model's name in the API (default: the file's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded together (default: %(default)s)")
    p.add_argument("--ctx", type=int, default=2048, help="KV cache length per slot (default: %(default)s)")
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip loading a lone request's prefill steps and the decode steps at start (the first requests plan them)",
    )
    p.add_argument("--api-key", default="", help="require 'Authorization: Bearer KEY' (default: none)")
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish after SIGTERM (default: %(default)s)",
    )
    p.add_argument(
        "--weights", choices=("native", "f32"), default="native", help="as for generate (default: %(default)s)"
    )
    add_cache_type_options(p)
    add_cluster_options(p)
    p.set_defaults(fn=serve)
