"""The endpoint logic of the OpenAI-compatible server (models/openai_server.py holds the routes):
completions and chat completions over a ContinuousBatcher (CompletionServing), embeddings over
an Embedder (EmbeddingServing), and the Prometheus text of /metrics. Requests are checked by
models/openai_protocol.py before anything here queues them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import JSONResponse, StreamingResponse

from models import batching
from models.batching import Finished, Token
from models.errors import TemplateError
from models.openai_protocol import (
    EVENT_POLL_SECONDS,
    MAX_EMBEDDING_INPUTS,
    PREPARING_THREADS,
    RequestError,
    _shown,
    checked_text,
    error_body,
    job_from,
    logprob_fields,
    number,
    template_variables,
    usage_chunk_asked,
)
from models.requests import TextStream
from split_state.errors import MetaError, WorkerLost


class CompletionServing:
    """POST /v1/completions and /v1/chat/completions: a prompt (text, token ids or chat turns
    rendered by the model's template) made into token ids off the event loop, checked, queued on
    the batcher, and its events answered whole or streamed as server-sent events."""

    def __init__(self, batcher, model_id: str, chat_template):
        self.batcher, self.model_id, self.chat_template = batcher, model_id, chat_template
        self.tokenizer = batcher.tokenizer
        self.vocab = batcher.model.config.vocab
        self.longest = batcher.model.longest_token_bytes
        self.preparing = ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="prepare")

    async def _prepared(self, work, *args):
        """`work(*args)` on the preparing threads, off the event loop (/health answers meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.preparing, work, *args)

    def _too_long(self, param: str, what: str = "is") -> RequestError:
        return RequestError(
            400, f"'{param}' {what} longer than a context of {self.batcher.ctx} tokens could hold", param=param
        )

    async def _encode(self, text: str, param: str) -> list[int]:
        checked_text(text, param)
        most = self.batcher.ctx * self.longest
        # at least one byte a character: a text of more characters is too long before it is encoded
        if len(text) > most or len(text.encode("utf-8")) > most:
            raise self._too_long(param)
        return await self._prepared(self.tokenizer.encode, text)

    def _submit(self, job):
        try:
            return self.batcher.submit(job)
        except WorkerLost as exc:
            raise RequestError(503, str(exc), "server_error") from None
        except MetaError as exc:
            raise RequestError(400, str(exc)) from None

    async def completion(self, request, body: dict):
        template_variables(body, chat=False)  # refused: a completion has no template
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise RequestError(
                    400, f"token id {_shown(bad)} is not in the vocabulary [0, {self.vocab})", param="prompt"
                )
            ids = prompt
        elif isinstance(prompt, str):
            ids = await self._encode(prompt, "prompt")
        else:
            raise RequestError(400, "'prompt' must be a string (or one string, or a list of token ids)", param="prompt")
        return await self._respond(request, body, ids, chat=False)

    async def chat(self, request, body: dict):
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
        if sum(len(m["content"].encode("utf-8")) for m in messages) > self.batcher.ctx * self.longest:
            raise self._too_long("messages", "are")
        if self.chat_template is None:
            raise RequestError(400, "this model has no chat template: use /v1/completions", param="messages")
        try:
            turns = [{"role": m["role"], "content": m["content"]} for m in messages]
            text = await self._prepared(self.chat_template.render, turns, True, template_variables(body, chat=True))
        except TemplateError as exc:
            raise RequestError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        return await self._respond(request, body, await self._encode(text, "messages"), chat=True)

    async def _respond(self, request, body: dict, prompt_ids: list[int], chat: bool):
        ctx = self.batcher.ctx
        room = ctx - len(prompt_ids) + 1  # the last token is never fed back
        param = "messages" if chat else "prompt"
        if not prompt_ids:
            raise RequestError(400, f"'{param}' holds no tokens (this model adds no BOS token to them)", param=param)
        if room < 1:
            raise RequestError(
                400, f"a prompt of {len(prompt_ids)} tokens does not fit the context of {ctx} tokens", param=param
            )
        job = job_from(body, prompt_ids, secrets.randbelow(2**31), room, chat, self.vocab)
        streamed = body.get("stream", False)
        if not isinstance(streamed, bool):
            raise RequestError(400, "'stream' must be true or false", param="stream")
        usage_chunk = usage_chunk_asked(body, streamed)
        request.state.user = body.get("user") or ""
        ticket = self._submit(job)
        reply = _Reply(self, request, ticket, len(prompt_ids), chat, streamed)
        if not streamed:
            return await self._whole(reply, ticket, request)
        return StreamingResponse(self._stream(reply, ticket, request, usage_chunk), media_type="text/event-stream")

    async def _whole(self, reply: _Reply, ticket, request):
        """The answer in one JSON body once the request is finished."""
        try:
            finished = None
            async for event in self._events(ticket, request):
                if isinstance(event, Token):
                    reply.text.push(event.token)
                    reply.scored.append(event)
                else:
                    finished = event
        finally:
            ticket.cancel()  # a client gone before the end frees the slot
        if finished is None:  # the client left: nobody to answer
            return JSONResponse({}, status_code=499)
        if finished.reason == "error":
            raise RequestError(503, f"generation failed: {finished.error}", "server_error")
        return JSONResponse(
            reply.envelope([reply.choice(reply.text.final_text(), finished.reason, True)], usage=reply.usage())
        )

    async def _stream(self, reply: _Reply, ticket, request, usage_chunk: bool):
        """Server-sent events: a chunk per piece of text, the last with the finish reason (and
        usage), then `data: [DONE]`. The events of tokens that came together (the workers report
        a few steps at a time) go out in one write: a write per token woke the client and this
        loop once a token each, and on a host whose cores the workers fill every wake-up
        preempts one of them (its peers then wait for it at the next all-reduce)."""
        lines: list[str] = []

        def event_line(payload: dict) -> None:
            lines.append(f"data: {json.dumps(payload)}\n\n")

        def ready() -> str:
            out = "".join(lines)
            lines.clear()
            return out

        try:
            if reply.chat:
                event_line(
                    reply.envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
                )
                yield ready()  # at once, as OpenAI's
            async for event in self._events(ticket, request):
                if isinstance(event, Token):
                    piece = reply.text.push(event.token)
                    reply.scored.append(event)
                    if piece:
                        event_line(reply.envelope([reply.choice(piece, None, False)]))
                    if lines and not ticket.events.qsize():  # nothing more has come: send what is ready
                        yield ready()
                    continue
                if event.reason == "error":
                    failed = RequestError(503, f"generation failed: {event.error}", "server_error")
                    event_line(error_body(failed))
                    break  # then [DONE], as after any last event
                rest = reply.text.finish()
                event_line(reply.envelope([reply.choice(rest, event.reason, False)], usage=reply.usage()))
                if usage_chunk:
                    event_line(reply.envelope([], usage=reply.usage()))
            yield ready() + "data: [DONE]\n\n"
        finally:
            ticket.cancel()  # the client left (or the stream ended): the slot is freed

    async def _events(self, ticket, request):
        """The ticket's events as the batcher puts them (it wakes this loop: no thread waits for
        them); a client that left cancels it (its slot is free before the next token)."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        # one wake-up on its way at a time: the events of a report's steps come together, and a
        # wake-up each (a write to the loop's pipe, a pass of the loop) took the workers' cores
        woken = [False]

        def wake() -> None:  # on the batcher's thread
            if woken[0]:
                return  # this loop looks at the queue after that wake-up: it sees this event too
            woken[0] = True
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop closed: nobody reads this ticket
                pass

        ticket.listen(wake)
        silent, looked = 0.0, time.monotonic()
        try:
            while True:
                woken[0] = False  # before looking: an event put after the look wakes the wait
                ready.clear()
                event = ticket.next(0)
                if event is None:
                    try:
                        # a deadline on this task, not wait_for's task of its own every wait
                        async with asyncio.timeout(EVENT_POLL_SECONDS):
                            await ready.wait()
                        event = ticket.next(0)
                    except TimeoutError:
                        pass
                if time.monotonic() - looked >= EVENT_POLL_SECONDS:  # tokens or not, now and then
                    looked = time.monotonic()
                    if await request.is_disconnected():
                        ticket.cancel()
                        return
                if event is None:
                    silent += EVENT_POLL_SECONDS
                    if silent >= batching.TOKEN_SECONDS:  # (read here: a test shortens it)
                        ticket.cancel()
                        yield Finished("error", f"no token within {batching.TOKEN_SECONDS:.0f} s")
                        return
                    continue
                silent = 0.0
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            ticket.listen(None)


class _Reply:
    """One request's answer as it is made: its text so far, the tokens whose log-probabilities
    are not yet sent, and OpenAI's envelope and choice objects."""

    def __init__(self, serving: CompletionServing, request, ticket, prompt_tokens: int, chat: bool, streamed: bool):
        self.serving, self.request, self.ticket, self.job = serving, request, ticket, ticket.job
        self.prompt_tokens, self.chat = prompt_tokens, chat
        self.kind = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
        self.rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.text = TextStream(serving.tokenizer, False, self.job.stop_strings)
        self.scored: list = []  # Token events whose log-probabilities are not yet sent
        self.sent_chars = 0  # characters of completion text sent so far (completions' text_offset)

    def usage(self) -> dict:
        n, prompt = len(self.text.tokens), self.prompt_tokens
        self.request.state.tokens = (prompt, n)  # for the access log
        return {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "total_tokens": prompt + n,
            # of the prompt's tokens, those its slot's caches held (OpenAI's prompt caching field)
            "prompt_tokens_details": {"cached_tokens": self.ticket.cached_tokens},
        }

    def choice(self, piece: str, finish: str | None, whole: bool) -> dict:
        logprobs = None
        if self.job.top_logprobs is not None:
            logprobs = logprob_fields(self.serving.tokenizer, self.scored, self.chat, self.sent_chars)
            self.scored.clear()
        self.sent_chars += len(piece)
        if not self.chat:
            return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish}
        key = "message" if whole else "delta"
        content = {"role": "assistant", "content": piece} if whole else {"content": piece} if piece else {}
        return {"index": 0, key: content, "logprobs": logprobs, "finish_reason": finish}

    def envelope(self, choices: list, **extra) -> dict:
        model = self.serving.model_id
        return {
            "id": self.rid,
            "object": self.kind,
            "created": self.created,
            "model": model,
            "choices": choices,
        } | extra


def metrics_text(batcher) -> str:
    """Prometheus' text format: each metric with its HELP and TYPE."""
    c = batcher.counters
    ttft = sorted(c.first_token_seconds)
    plain = [  # (name, type, help, value)
        ("requests_total", "counter", "Requests submitted.", c.requests),
        ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", c.prompt_tokens),
        ("cached_prompt_tokens_total", "counter", "Prompt tokens found in a slot's caches.", c.cached_prompt_tokens),
        ("prefill_steps_total", "counter", "Prefill steps run (one can take several prompts).", c.prefill_steps),
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


class EmbeddingServing:
    """POST /v1/embeddings (OpenAI's): `input` a text or a list of texts, `encoding_format`
    float or base64 (float32 bytes), `dimensions` only the model's own; unit vectors, in order."""

    def __init__(self, embedder, model_id: str, stopping: threading.Event):
        self.embedder, self.model_id, self.stopping = embedder, model_id, stopping

    async def embeddings(self, request, body: dict):
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
        if body.get("dimensions") is not None and number(body, "dimensions", None, int) != self.embedder.dims:
            raise RequestError(400, f"'dimensions': this model gives {self.embedder.dims} only", param="dimensions")
        if not isinstance(body.get("user", ""), str):
            raise RequestError(400, "'user' must be a string", param="user")
        request.state.user = body.get("user") or ""
        # computed on a thread, batch by batch: a client that leaves, or a server stopping (past
        # --grace), stops it before its next batch, so no abandoned request runs on
        gone = threading.Event()
        work = asyncio.ensure_future(
            asyncio.to_thread(self.embedder.embed, texts, lambda: gone.is_set() or self.stopping.is_set())
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
            "model": self.model_id,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
