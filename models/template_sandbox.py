"""Chat templates rendered in a child process under a time and a memory limit.

A model file's chat template is Jinja code, and untrusted: Jinja's immutable sandbox stops it
reaching Python's internals, but nothing in Jinja bounds what it may compute. Nested
`range(99999)` loops, `(n + 9) ** (10 ** 9)` or `lipsum(n=2000000)` run for minutes; `'x' *
2000000000` takes gigabytes. So templates render in one long-lived child interpreter (`python
-I -c`, importing nothing of this project: only jinja2) whose address space is capped at
MEMORY_LIMIT above what it started with, and each render has TIME_LIMIT seconds: past it the
child is killed (and started again for the next render), and the render is a one-line
TemplateError. A render costs one round trip of a JSON line each way.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

TIME_LIMIT = 2.0  # seconds one render may take
# what a template is given by the renderer itself: a caller's variables may not replace them
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"})
MEMORY_LIMIT = 512 << 20  # bytes a child may add to its address space beyond its start

# The child: reads one JSON request a line, renders it in Jinja's immutable sandbox, and answers
# one JSON line: {"text": ...} or {"error": "unsafe" | "template" | "limit", "message": ...}.
CHILD = r"""
import json, resource, sys
def _vm():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()
limit = _vm() + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
def raise_exception(message):
    raise ValueError(f"the template refused the messages: {message}")
def strftime_now(form):  # Llama 3.1's and 3.2's templates date their system message
    import datetime
    return datetime.datetime.now().strftime(str(form))
env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now
for line in sys.stdin:
    try:
        req = json.loads(line)
        text = env.from_string(req["source"]).render(
            **req.get("variables", {}),
            messages=req["messages"],
            add_generation_prompt=req["add_generation_prompt"],
            bos_token=req.get("bos_token", ""),
            eos_token=req.get("eos_token", ""),
        )
        reply = {"text": text}
    except jinja2.exceptions.SecurityError as exc:
        reply = {"error": "unsafe", "message": str(exc)}
    except MemoryError:
        reply = {"error": "limit", "message": "it needed more than its memory limit"}
    except RecursionError:
        reply = {"error": "limit", "message": "it recursed too deeply"}
    except Exception as exc:
        reply = {"error": "template", "message": f"{type(exc).__name__}: {exc}"}
    try:
        out = json.dumps(reply)
    except MemoryError:
        out = json.dumps({"error": "limit", "message": "its text is larger than its memory limit"})
    sys.stdout.write(out + "\n")
    sys.stdout.flush()
"""


def variables_refusal(given) -> str | None:
    """Why `given` cannot be a template's further variables (an object of names, none of those
    the renderer gives it: RESERVED), or None."""
    if not isinstance(given, dict) or not all(isinstance(k, str) and k.isidentifier() for k in given):
        return "must be an object whose keys are variable names"
    taken = sorted(RESERVED & set(given))
    return f"cannot set the template's own {', '.join(taken)}" if taken else None


class RenderFailed(Exception):
    """A render the child refused or could not finish: `kind` is "unsafe", "template" or "limit"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TemplateRenderer:
    """The child process and the requests to it, one at a time (a lock: a server renders from
    several threads)."""

    def __init__(self, time_limit: float = TIME_LIMIT, memory_limit: int = MEMORY_LIMIT):
        self.time_limit, self.memory_limit = time_limit, memory_limit
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def render(
        self,
        source: str,
        messages: list[dict],
        add_generation_prompt: bool,
        bos_token: str = "",
        eos_token: str = "",
        variables: dict | None = None,
    ) -> str:
        """The template's text for `messages`, its `bos_token` and `eos_token` variables those texts;
        `variables`: more of them (a chat's chat_template_kwargs: Qwen3's enable_thinking), none
        of those names (RESERVED)."""
        variables = dict(variables or {})
        why = variables_refusal(variables)
        if why is not None:
            raise RenderFailed("template", f"the variables given {why}")
        request = json.dumps(
            {
                "source": source,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": bos_token,
                "eos_token": eos_token,
                "variables": variables,
            }
        )
        with self._lock:
            child = self._started()
            try:
                child.stdin.write((request + "\n").encode())
                child.stdin.flush()
                line = self._read_line(child, time.monotonic() + self.time_limit)
            except (BrokenPipeError, OSError, TimeoutError) as exc:
                self._stop()
                if isinstance(exc, TimeoutError):
                    raise RenderFailed("limit", f"it ran longer than {self.time_limit:g} s") from None
                raise RenderFailed("limit", "its renderer died (past its memory limit?)") from None
        reply = json.loads(line)
        if "error" in reply:
            raise RenderFailed(reply["error"], reply["message"])
        return reply["text"]

    def _started(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen(
                [sys.executable, "-I", "-c", CHILD, str(self.memory_limit)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        return self._child

    def _read_line(self, child: subprocess.Popen, deadline: float) -> bytes:
        fd, got = child.stdout.fileno(), bytearray()
        while not got.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise OSError("the renderer exited")
            got += chunk
        return bytes(got)

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None

    def close(self) -> None:
        with self._lock:
            self._stop()


_shared: TemplateRenderer | None = None
_shared_lock = threading.Lock()


def renderer() -> TemplateRenderer:
    """The process's renderer, started at its first render."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TemplateRenderer()
            atexit.register(_shared.close)  # the child would end at its stdin's EOF anyway; now, not later
        return _shared
