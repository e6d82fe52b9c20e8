"""What the OpenAI-compatible server (models/openai_server.py) takes in a request, checked whole
before anything is queued: its limits, the fields it honours and those it refuses, each field
read and bounded (numbers as Python's integers and finite floats, text without lone surrogates,
stop strings, log-probabilities' counts), the error every refusal is (RequestError: an HTTP
status and OpenAI's error body), and the Job a completion request becomes.
"""

from __future__ import annotations

import math

from models.template_sandbox import variables_refusal

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
# and vLLM's top_k, min_p, repetition_penalty, ignore_eos and cache_prompt besides); `user` goes into the
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
    "chat_template_kwargs",
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


def template_variables(body: dict, chat: bool) -> dict:
    """A chat's `chat_template_kwargs` (vLLM's and llama-server's): more variables for the chat
    template (Qwen3's `enable_thinking`), an object of names to JSON values; none of the
    template's own (`messages`, `bos_token`, ...)."""
    given = body.get("chat_template_kwargs")
    if given is None:
        return {}
    param = "chat_template_kwargs"
    if not chat:
        raise RequestError(
            400, "'chat_template_kwargs' is a chat field: a completion's prompt has no template", param=param
        )
    why = variables_refusal(given)
    if why is not None:
        raise RequestError(400, f"'chat_template_kwargs' {why}", param=param)
    return given


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
    from models.requests import Sampling

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
    cache_prompt = body.get("cache_prompt", True)  # llama-server's extension: reuse a slot's cached prefix
    if not isinstance(cache_prompt, bool):
        raise RequestError(400, "'cache_prompt' must be true or false", param="cache_prompt")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise RequestError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if not isinstance(body.get("user", ""), str):
        raise RequestError(400, "'user' must be a string", param="user")
    return Job(
        tuple(prompt_ids),
        max_tokens,
        sampling,
        stop_strings(body),
        not ignore_eos,
        top_logprobs(body, chat),
        cache_prompt,
    )
