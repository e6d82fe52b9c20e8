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
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_BODY_BYTES = 16 << 20  # a body larger is refused unread (413)
BODY_SECONDS = 30.0  # a body not all in within this is refused (408): a slow client holds no connection for ever
LARGE_BODY = 1 << 16  # a body at least this large is parsed on a thread
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of texts in one embeddings request
MOST_TOP_LOGPROBS = {True: 20, False: 5}  # OpenAI's limits: chat's top_logprobs, completions' logprobs
# prompts prepared at once (a chat template rendered, a text tokenized), each on a thread of the
# server's own (the GIL released while Rust tokenizes, the render in its sandbox process): more
# wait their turn, so a burst of long prompts or slow templates neither starves the threads that
# carry the running streams' events nor takes more cores than this
PREPARING_THREADS = 2
EVENT_POLL_SECONDS = 0.25  # how often a waiting request looks whether its client left
# the fields of OpenAI's chat/completions and completions requests this server honours (llama-server's
# and vLLM's top_k, min_p, repetition_penalty and ignore_eos besides); `user` goes into the
# access log, `parallel_tool_calls` has no tools to run in parallel; `n` only as 1 (job_from)
HONOURED = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "user",
    "parallel_tool_calls",
)
# the rest of OpenAI's fields, each with the values that ask for nothing: any other is refused
UNSUPPORTED = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_body(exc: RequestError) -> dict:
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": None}}


def number(body: dict, name: str, default, kind=float, low=None, high=None):
    """Field `name` of `body` as `kind`, within [low, high]; integers compared as Python's (a
    literal of 400 digits is out of range, not an overflow)."""
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"'{name}' must be a number, got {_shown(value)}", param=name)
    if kind is int and isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise RequestError(400, f"'{name}' must be a number, got {_shown(value)} (an integer)", param=name)
        value = int(value)
    if kind is float:
        if isinstance(value, int) and abs(value) > 2**1000:  # float() would overflow
            raise RequestError(400, f"'{name}' must lie in [{low}, {high}], got {_shown(value)}", param=name)
        value = float(value)
        if not math.isfinite(value):
            raise RequestError(400, f"'{name}' must lie in [{low}, {high}], got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(400, f"'{name}' must lie in [{low}, {high}], got {_shown(value)}", param=name)
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


def checked_text(text: str, param: str) -> str:
    if text.isascii():  # fast for the common case, and no copy
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"'{param}' holds a lone surrogate (not UTF-8 text)", param=param) from None
    return text


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise RequestError(
            400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters", param="stop"
        )
    return tuple(checked_text(s, "stop") for s in stop)


def refuse_unsupported(body: dict) -> None:
    for name, harmless in UNSUPPORTED.items():
        if body.get(name) not in harmless:
            raise RequestError(400, f"'{name}' is not supported by this server", param=name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError(
            400, "'response_format' is not supported by this server (only {'type': 'text'})", param="response_format"
        )


def usage_chunk_asked(body: dict, streamed: bool) -> bool:
    """Whether a stream ends with a chunk of no choices and the usage (`stream_options:
    {"include_usage": true}`, as OpenAI's)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not streamed:
        raise RequestError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(400, "'stream_options' takes {'include_usage': true or false}", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(400, "'stream_options.include_usage' must be true or false", param="stream_options")
    return include


def top_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives' log-probabilities a request asks for with each token's (None: no
    log-probabilities): chat's `logprobs` (true or false) and `top_logprobs`, completions'
    `logprobs` (a count)."""
    most = MOST_TOP_LOGPROBS[chat]
    if not chat:
        if body.get("top_logprobs") is not None:
            raise RequestError(
                400, "'top_logprobs' is a chat field; completions take 'logprobs': N", param="top_logprobs"
            )
        return None if body.get("logprobs") is None else number(body, "logprobs", 0, int, 0, most)
    asked = body.get("logprobs")
    if asked not in (None, True, False):
        raise RequestError(400, f"'logprobs' must be true or false, got {_shown(asked)}", param="logprobs")
    if not asked:
        if body.get("top_logprobs") not in (None, 0):
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return number(body, "top_logprobs", 0, int, 0, most)


def logprob_fields(tokenizer, tokens: list, chat: bool, offset: int = 0) -> dict:
    """The `logprobs` of a choice for these Token events: chat's {"content": [...]}, or
    completions' columns (text_offset counted from `offset` characters into the completion)."""

    def piece(token: int) -> str:
        return tokenizer.decode([token], continuation=True)  # a word's leading space kept

    if chat:

        def entry(token: int, logprob: float) -> dict:
            text = piece(token)
            # the token's own bytes: part of a UTF-8 character where its text shows U+FFFD
            return {"token": text, "logprob": logprob, "bytes": list(tokenizer.token_bytes(token))}

        return {"content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(*a) for a in t.top]} for t in tokens]}
    texts = [piece(t.token) for t in tokens]
    offsets = [offset + sum(len(x) for x in texts[:k]) for k in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{piece(a): lp for a, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }


def job_from(body: dict, prompt_ids: list[int], default_seed: int, room: int, chat: bool, vocab: int):
    """The batcher's Job for an OpenAI request body (completions or chat); `room`: the tokens the
    context leaves after the prompt."""
    from models.batching import Job
    from models.generate import Sampling

    if number(body, "n", 1, int) != 1:
        raise RequestError(400, "only n = 1 is supported", param="n")
    refuse_unsupported(body)
    sampling = Sampling(
        temperature=number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_k=number(body, "top_k", 0, int, 0, vocab),
        top_p=number(body, "top_p", 1.0, float, 0.0, 1.0),  # 0 keeps the most likely token alone
        seed=number(body, "seed", default_seed, int, 0, 2**63 - 1),
        min_p=number(body, "min_p", 0.0, float, 0.0, 0.99),  # vLLM's and llama-server's extension
        repeat_penalty=number(body, "repetition_penalty", 1.0, float, 0.01, 10.0),  # vLLM's name for it
    )
    # the newer name wins, as in OpenAI's API
    asked = body.get("max_completion_tokens")
    name = "max_completion_tokens" if asked is not None else "max_tokens"
    asked = body.get(name)
    if asked is None:
        max_tokens = room if chat else min(DEFAULT_MAX_TOKENS, room)
    else:
        max_tokens = number(body, name, None, int, 1)
        if max_tokens > room:
            raise RequestError(
                400,
                f"the context holds {len(prompt_ids) + room - 1} tokens; {len(prompt_ids)} in the prompt leave room "
                f"for {room}, but {name} is {_shown(max_tokens)}",
                param=name,
            )
    ignore_eos = body.get("ignore_eos", False)  # llama-server's extension: go on past end-of-generation
    if not isinstance(ignore_eos, bool):
        raise RequestError(400, "'ignore_eos' must be true or false", param="ignore_eos")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise RequestError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if not isinstance(body.get("user", ""), str):
        raise RequestError(400, "'user' must be a string", param="user")
    return Job(tuple(prompt_ids), max_tokens, sampling, stop_strings(body), not ignore_eos, top_logprobs(body, chat))


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
    from starlette.exceptions import HTTPException

    app = FastAPI(title="meta-tp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stopping = threading.Event()  # set when the server ends what still runs (cli/serve.py)
    if access_log is not None:
        app.add_middleware(AccessLog, write=access_log)
    started = time.time()

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

    def why_down() -> str:
        return (batcher.lost if batcher is not None else "") or health()

    def check_key(request: Request) -> None:
        if not api_key:
            return
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if not secrets.compare_digest(given, f"Bearer {api_key}".encode()):
            raise RequestError(401, "invalid API key: send 'Authorization: Bearer KEY'", "authentication_error")

    # a body longer than this holds more text than the context could (each token at most
    # longest_token_bytes bytes, each byte at most 6 characters of JSON, plus the other fields): it is
    # refused before it is parsed (parsing 10 MB holds the event loop for 100 ms)
    too_long = (
        MAX_BODY_BYTES
        if batcher is None
        else min(MAX_BODY_BYTES, 6 * batcher.ctx * batcher.model.longest_token_bytes + (64 << 10))
    )

    def body_too_large(size: int) -> RequestError:
        if size > MAX_BODY_BYTES:
            return RequestError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
        return RequestError(400, f"the prompt is longer than a context of {batcher.ctx} tokens could hold")

    async def read_body(request: Request) -> dict:
        check_key(request)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > too_long:
            raise body_too_large(int(declared))
        raw = bytearray()
        try:
            async with asyncio.timeout(body_seconds):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > too_long:
                        raise body_too_large(len(raw))
        except TimeoutError:  # a slow (or stalled) client: its connection goes back
            raise RequestError(408, f"the body did not arrive within {body_seconds:g} s") from None
        try:  # a large body is parsed off the event loop: /health answers meanwhile
            body = json.loads(bytes(raw)) if len(raw) < LARGE_BODY else await asyncio.to_thread(json.loads, bytes(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the body is not JSON: {_shown(str(exc))}") from None
        except RecursionError:
            raise RequestError(400, "the body is not JSON this server reads: nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        if body.get("model") not in (None, "", model_id):
            raise RequestError(
                404, f"the model '{_shown(body['model'])}' does not exist; this server has '{model_id}'", param="model"
            )
        if why_down():
            raise RequestError(503, f"the cluster cannot serve: {why_down()}", "server_error")
        return body

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
            raise RequestError(404, f"the model '{_shown(name)}' does not exist; this server has '{model_id}'")
        return model_card()

    if batcher is not None:
        _add_generation(app, batcher, model_id, chat_template, read_body)
    if embedder is not None:
        _add_embeddings(app, embedder, model_id, read_body, app.state.stopping)
    return app


def _add_generation(app, batcher, model_id: str, chat_template, read_body) -> None:
    """POST /v1/completions, POST /v1/chat/completions and GET /metrics over the batcher."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from models.batching import TOKEN_SECONDS, Finished, Token
    from models.generate import TextStream
    from split_state.errors import MetaError, WorkerLost

    tokenizer = batcher.tokenizer
    vocab = batcher.model.config.vocab
    longest = batcher.model.longest_token_bytes
    preparing = ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="prepare")

    async def prepared(work, *args):
        """`work(*args)` on the preparing threads, off the event loop (/health answers meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(preparing, work, *args)

    async def encode(text: str, param: str) -> list[int]:
        checked_text(text, param)
        if len(text) > batcher.ctx * longest:  # at least one byte a character: too long for any context
            raise RequestError(
                400, f"'{param}' is longer than a context of {batcher.ctx} tokens could hold", param=param
            )
        if len(text.encode("utf-8")) > batcher.ctx * longest:
            raise RequestError(
                400, f"'{param}' is longer than a context of {batcher.ctx} tokens could hold", param=param
            )
        return await prepared(tokenizer.encode, text)

    def submit(job):
        try:
            return batcher.submit(job)
        except WorkerLost as exc:
            raise RequestError(503, str(exc), "server_error") from None
        except MetaError as exc:
            raise RequestError(400, str(exc)) from None

    async def events(ticket, request: Request):
        """The ticket's events, waited for off the event loop; a client that left cancels it
        (its slot is free before the next token)."""
        silent, looked = 0.0, time.monotonic()
        while True:
            event = await asyncio.to_thread(ticket.next, EVENT_POLL_SECONDS)
            if time.monotonic() - looked >= EVENT_POLL_SECONDS:  # tokens or not, now and then
                looked = time.monotonic()
                if await request.is_disconnected():
                    ticket.cancel()
                    return
            if event is None:
                silent += EVENT_POLL_SECONDS
                if silent >= TOKEN_SECONDS:
                    ticket.cancel()
                    yield Finished("error", f"no token within {TOKEN_SECONDS:.0f} s")
                    return
                continue
            silent = 0.0
            yield event
            if isinstance(event, Finished):
                return

    async def respond(request: Request, body: dict, prompt_ids: list[int], chat: bool):
        room = batcher.ctx - len(prompt_ids) + 1  # the last token is never fed back
        param = "messages" if chat else "prompt"
        if not prompt_ids:
            raise RequestError(400, f"'{param}' holds no tokens (this model adds no BOS token to them)", param=param)
        if room < 1:
            raise RequestError(
                400,
                f"a prompt of {len(prompt_ids)} tokens does not fit the context of {batcher.ctx} tokens",
                param=param,
            )
        job = job_from(body, prompt_ids, secrets.randbelow(2**31), room, chat, vocab)
        streamed = body.get("stream", False)
        if not isinstance(streamed, bool):
            raise RequestError(400, "'stream' must be true or false", param="stream")
        usage_chunk = usage_chunk_asked(body, streamed)
        request.state.user = body.get("user") or ""
        ticket = submit(job)
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        text = TextStream(tokenizer, False, job.stop_strings)
        scored: list = []  # Token events whose log-probabilities are not yet sent
        sent_chars = [0]  # characters of completion text sent so far (completions' text_offset)

        def usage() -> dict:
            n = len(text.tokens)
            request.state.tokens = (len(prompt_ids), n)  # for the access log
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        def choice(piece: str, finish: str | None, whole: bool) -> dict:
            logprobs = None
            if job.top_logprobs is not None:
                logprobs = logprob_fields(tokenizer, scored, chat, sent_chars[0])
                scored.clear()
            sent_chars[0] += len(piece)
            if not chat:
                return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish}
            key = "message" if whole else "delta"
            content = {"role": "assistant", "content": piece} if whole else {"content": piece} if piece else {}
            return {"index": 0, key: content, "logprobs": logprobs, "finish_reason": finish}

        def envelope(choices: list, **extra) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": model_id, "choices": choices} | extra

        if not streamed:
            try:
                finished = None
                async for event in events(ticket, request):
                    if isinstance(event, Token):
                        text.push(event.token)
                        scored.append(event)
                    else:
                        finished = event
            finally:
                ticket.cancel()  # a client gone before the end frees the slot
            if finished is None:  # the client left: nobody to answer
                return JSONResponse({}, status_code=499)
            if finished.reason == "error":
                raise RequestError(503, f"generation failed: {finished.error}", "server_error")
            result = envelope([choice(text.final_text(), finished.reason, True)], usage=usage())
            return JSONResponse(result)

        async def sse():
            try:
                if chat:
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield f"data: {json.dumps(envelope([first]))}\n\n"
                async for event in events(ticket, request):
                    if isinstance(event, Token):
                        piece = text.push(event.token)
                        scored.append(event)
                        if piece:
                            yield f"data: {json.dumps(envelope([choice(piece, None, False)]))}\n\n"
                        continue
                    if event.reason == "error":
                        failed = RequestError(503, f"generation failed: {event.error}", "server_error")
                        yield f"data: {json.dumps(error_body(failed))}\n\n"
                        break  # then [DONE], as after any last event
                    rest = text.finish()
                    last = envelope([choice(rest, event.reason, False)], usage=usage())
                    yield f"data: {json.dumps(last)}\n\n"
                    if usage_chunk:
                        yield f"data: {json.dumps(envelope([], usage=usage()))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                ticket.cancel()  # the client left (or the stream ended): the slot is freed

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(400, f"token id {_shown(bad)} is not in the vocabulary [0, {vocab})", param="prompt")
            ids = prompt
        elif isinstance(prompt, str):
            ids = await encode(prompt, "prompt")
        else:
            raise RequestError(400, "'prompt' must be a string (or one string, or a list of token ids)", param="prompt")
        return await respond(request, body, ids, chat=False)

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
        for m in messages:
            checked_text(m["role"], "messages")
            checked_text(m["content"], "messages")
        if sum(len(m["content"].encode("utf-8")) for m in messages) > batcher.ctx * longest:
            raise RequestError(
                400, f"'messages' are longer than a context of {batcher.ctx} tokens could hold", param="messages"
            )
        if chat_template is None:
            raise RequestError(400, "this model has no chat template: use /v1/completions", param="messages")
        from models.errors import TemplateError

        try:
            turns = [{"role": m["role"], "content": m["content"]} for m in messages]
            text = await prepared(chat_template.render, turns)
        except TemplateError as exc:
            raise RequestError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        return await respond(request, body, await encode(text, "messages"), chat=True)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(batcher), media_type="text/plain; version=0.0.4")


def metrics_text(batcher) -> str:
    """Prometheus' text format: each metric with its HELP and TYPE."""
    c = batcher.counters
    ttft = sorted(c.first_token_seconds)
    plain = [  # (name, type, help, value)
        ("requests_total", "counter", "Requests submitted.", c.requests),
        ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", c.prompt_tokens),
        ("generated_tokens_total", "counter", "Tokens generated.", c.generated_tokens),
        ("active_slots", "gauge", "Slots decoding a request.", batcher.active()),
        ("slots", "gauge", "Slots in all.", len(batcher.slots)),
        ("queue_depth", "gauge", "Requests waiting for a slot.", len(batcher.waiting)),
        ("decode_steps_total", "counter", "Decode steps run.", c.decode_steps),
        ("decode_rows_total", "counter", "Rows the decode steps ran (busy slots and padding).", c.decode_rows),
        ("decode_seconds_total", "counter", "Seconds the decode steps took.", f"{c.decode_seconds:.6f}"),
    ]
    lines = []
    for name, kind, help_text, value in plain:
        lines += [f"# HELP meta_tp_{name} {help_text}", f"# TYPE meta_tp_{name} {kind}", f"meta_tp_{name} {value}"]
    name = "meta_tp_requests_finished_total"
    lines += [f"# HELP {name} Requests finished, by reason.", f"# TYPE {name} counter"]
    lines += [f'{name}{{reason="{r}"}} {n}' for r, n in sorted(c.finished.items())]
    name = "meta_tp_time_to_first_token_seconds"
    lines += [
        f"# HELP {name} Seconds to the first token (the last 1000 requests).",
        f"# TYPE {name} summary",
    ]
    lines += [f'{name}{{quantile="{q}"}} {ttft[int(q * (len(ttft) - 1))]:.6f}' for q in (0.5, 0.9, 0.99) if ttft]
    lines += [f"{name}_sum {sum(ttft):.6f}", f"{name}_count {len(ttft)}"]
    return "\n".join(lines) + "\n"


def _add_embeddings(app, embedder, model_id: str, read_body, stopping: threading.Event) -> None:
    """POST /v1/embeddings (OpenAI's): `input` a text or a list of texts, `encoding_format`
    float or base64 (float32 bytes), `dimensions` only the model's own; unit vectors, in order."""
    import base64

    from fastapi import Request

    from split_state.errors import MetaError

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await read_body(request)
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise RequestError(
                400, "'input' must be a non-empty text or a list of them (token ids: give the text)", param="input"
            )
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise RequestError(400, f"'input' holds {len(texts)} texts; at most {MAX_EMBEDDING_INPUTS}", param="input")
        for text in texts:
            checked_text(text, "input")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise RequestError(
                400, f"'encoding_format' is 'float' or 'base64', got {_shown(encoding)}", param="encoding_format"
            )
        if body.get("dimensions") is not None and number(body, "dimensions", None, int) != embedder.dims:
            raise RequestError(400, f"'dimensions': this model gives {embedder.dims} only", param="dimensions")
        if not isinstance(body.get("user", ""), str):
            raise RequestError(400, "'user' must be a string", param="user")
        request.state.user = body.get("user") or ""
        # computed on a thread, batch by batch: a client that leaves, or a server stopping (past
        # --grace), stops it before its next batch, so no abandoned request runs on
        gone = threading.Event()
        work = asyncio.ensure_future(
            asyncio.to_thread(embedder.embed, texts, lambda: gone.is_set() or stopping.is_set())
        )
        try:
            while not (await asyncio.wait({work}, timeout=EVENT_POLL_SECONDS))[0]:
                if await request.is_disconnected():
                    gone.set()
                    raise RequestError(499, "the client closed the connection")  # no one reads it
            result = work.result()
        except MetaError as exc:
            raise RequestError(503, f"embedding failed: {type(exc).__name__}: {exc}", "server_error") from None
        finally:
            gone.set()
        if result is None:  # stopped before its answer was wanted: the server is stopping
            raise RequestError(503, "the server is stopping", "server_error")
        vectors, used = result
        request.state.tokens = (used, 0)

        def shown(vector):
            if encoding == "base64":
                return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            return vector.astype(float).tolist()

        data = [{"object": "embedding", "index": i, "embedding": shown(v)} for i, v in enumerate(vectors)]
        return {
            "object": "list",
            "data": data,
            "model": model_id,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
