"""The OpenAI-compatible HTTP application over a ContinuousBatcher (models/batching.py); the
command that serves it is cli/serve.py.

Endpoints: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST
/v1/chat/completions (streaming with server-sent events ending in `data: [DONE]`, or not), GET
/metrics (Prometheus text); or, started with an embedding model (MiniLM), POST /v1/embeddings
in place of the three last.

Every request is checked whole before it is queued, so no request can take the server down:
numbers with Python's integers (no overflow) and finite floats within their ranges, token ids
within the vocabulary, text without lone surrogates, at most 4 stop strings of bounded length,
a body of at most MAX_BODY_BYTES, a prompt no longer in bytes than the context could hold
(before it is tokenized, which then runs off the event loop), max_tokens within what the context
leaves (chat's default: all of it; completions': 16, as OpenAI's, or less where less is left),
log-probabilities as OpenAI's API gives them (chat: `logprobs: true` and `top_logprobs` up to
20; completions: `logprobs` up to 5): the model's own distribution over the whole vocabulary (its
logits before temperature and penalties, as vLLM's default), and the fields this server does not
implement (tools, penalties, ...) refused rather than ignored. Every error is OpenAI's JSON
body: 400 malformed, 401 wrong key, 404 unknown model or path, 405 wrong method, 408 a body not
all in within --read-timeout (a stalled client's connection goes back; a late head closes it:
cli/http_connections.py), 413 too large, 503 once the cluster cannot serve, 500 (never seen in the
tests) for a fault of ours. A client that leaves frees its slot within a token, streamed or not.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request)
import asyncio
import json
import secrets
import threading
import time

from models.openai_protocol import BODY_SECONDS, LARGE_BODY, MAX_BODY_BYTES, RequestError, _shown, error_body


class AccessLog:
    """ASGI middleware: one line per request once its answer is all sent (a stream's at its
    end), through `write`: client, method and path, status, prompt + completion tokens, ms, and
    the request's `user` where it gave one. (Pure ASGI rather than Starlette's BaseHTTPMiddleware,
    which would stand between a streaming handler and its client's disconnect.)"""

    def __init__(self, app, write):
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            state = scope.get("state") or {}  # what the handlers put in request.state
            client = scope.get("client") or ("-", 0)
            # the path as the client sent it, percent-escapes kept: decoded, a %0A would start a
            # forged line of this log
            path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
            path = path.decode("ascii", "backslashreplace")
            if not path.isprintable():
                path = path.encode("unicode_escape").decode("ascii")
            line = f'{client[0]} "{scope["method"]} {path}" {status[0] or "-"}'
            if "tokens" in state:
                line += " {}+{} tokens".format(*state["tokens"])
            line += f" {1e3 * (time.perf_counter() - start):.0f} ms"
            if state.get("user"):
                line += f" user={state['user']!r}"
            self.write(line)


def build_app(
    batcher,
    model_id: str,
    api_key: str = "",
    chat_template=None,
    health=lambda: "",
    body_seconds: float = BODY_SECONDS,
    access_log=None,
    embedder=None,
):
    """The FastAPI application over a started ContinuousBatcher (completions and chat), or over
    an `embedder` (embeddings: models/minilm.py Embedder) with `batcher` None; `health()` says
    why the cluster cannot serve ("" while it can), asked without a call to the workers; a
    request body must be all in within `body_seconds` of its headers; `access_log(line)`, where
    given, gets a line per request (AccessLog)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="meta-tp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stopping = threading.Event()  # set when the server ends what still runs (cli/serve.py)
    if access_log is not None:
        app.add_middleware(AccessLog, write=access_log)
    started = time.time()

    _add_error_handlers(app)
    gate = _Gate(batcher, model_id, api_key, health, body_seconds)
    why_down, check_key, read_body = gate.why_down, gate.check_key, gate.read_body

    @app.get("/health")
    async def health_check():
        why = why_down()
        if why:
            return JSONResponse({"status": "error", "error": why}, status_code=503)
        if batcher is None:
            return {"status": "ok"}
        return {"status": "ok", "slots": len(batcher.slots), "active": batcher.active()}

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": int(started), "owned_by": "meta-tp"}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        check_key(request)
        if name != model_id:
            raise RequestError(404, f"the model {_shown(name)} does not exist; this server has '{model_id}'")
        return model_card()

    if batcher is not None:
        _add_generation(app, batcher, model_id, chat_template, read_body)
    if embedder is not None:
        _add_embeddings(app, embedder, model_id, read_body, app.state.stopping)
    return app


def _add_error_handlers(app) -> None:
    """Every error an OpenAI body: ours (RequestError), Starlette's (404, 405) and, for a fault of
    ours, a 500 that names only the exception's type."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        return JSONResponse(error_body(exc), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(RequestError(exc.status_code, str(exc.detail), kind)), exc.status_code)

    @app.exception_handler(Exception)
    async def fault(request: Request, exc: Exception):
        failed = RequestError(500, f"internal error: {type(exc).__name__}", "server_error")
        return JSONResponse(error_body(failed), status_code=500)


class _Gate:
    """What every request passes before an endpoint sees it: the API key, a body of bounded size
    all in within its deadline and parsed as a JSON object naming this model, and a cluster
    that can serve."""

    def __init__(self, batcher, model_id: str, api_key: str, health, body_seconds: float):
        self.batcher, self.model_id, self.api_key = batcher, model_id, api_key
        self.health, self.body_seconds = health, body_seconds
        # a body longer than this holds more text than the context could (each token at most
        # longest_token_bytes bytes, each byte at most 6 characters of JSON, plus the other
        # fields): it is refused before it is parsed (parsing 10 MB holds the event loop 100 ms)
        self.too_long = (
            MAX_BODY_BYTES
            if batcher is None
            else min(MAX_BODY_BYTES, 6 * batcher.ctx * batcher.model.longest_token_bytes + (64 << 10))
        )

    def why_down(self) -> str:
        return (self.batcher.lost if self.batcher is not None else "") or self.health()

    def check_key(self, request) -> None:
        if not self.api_key:
            return
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise RequestError(401, "invalid API key: send 'Authorization: Bearer KEY'", "authentication_error")

    def _too_large(self, size: int) -> RequestError:
        if size > MAX_BODY_BYTES:
            return RequestError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
        return RequestError(400, f"the prompt is longer than a context of {self.batcher.ctx} tokens could hold")

    async def read_body(self, request) -> dict:
        self.check_key(request)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.too_long:
            raise self._too_large(int(declared))
        raw = bytearray()
        try:
            async with asyncio.timeout(self.body_seconds):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > self.too_long:
                        raise self._too_large(len(raw))
        except TimeoutError:  # a slow (or stalled) client: its connection goes back
            raise RequestError(408, f"the body did not arrive within {self.body_seconds:g} s") from None
        try:  # a large body is parsed off the event loop: /health answers meanwhile
            body = json.loads(bytes(raw)) if len(raw) < LARGE_BODY else await asyncio.to_thread(json.loads, bytes(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the body is not JSON: {_shown(str(exc))}") from None
        except RecursionError:
            raise RequestError(400, "the body is not JSON this server reads: nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        if body.get("model") not in (None, "", self.model_id):
            shown = _shown(body["model"])
            raise RequestError(
                404, f"the model {shown} does not exist; this server has '{self.model_id}'", param="model"
            )
        why = self.why_down()
        if why:
            raise RequestError(503, f"the cluster cannot serve: {why}", "server_error")
        return body


def _add_generation(app, batcher, model_id: str, chat_template, read_body) -> None:
    """POST /v1/completions, POST /v1/chat/completions and GET /metrics over the batcher."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    from models.openai_serving import CompletionServing, metrics_text

    serving = CompletionServing(batcher, model_id, chat_template)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completion(request, await read_body(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(request, await read_body(request))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(batcher), media_type="text/plain; version=0.0.4")


def _add_embeddings(app, embedder, model_id: str, read_body, stopping: threading.Event) -> None:
    """POST /v1/embeddings over the embedder (models/openai_serving.py EmbeddingServing)."""
    from fastapi import Request

    from models.openai_serving import EmbeddingServing

    serving = EmbeddingServing(embedder, model_id, stopping)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await serving.embeddings(request, await read_body(request))
