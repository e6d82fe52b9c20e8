"""Serving one request: decode strictly, handle, and always answer (an Error reply on failure)."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

from split_state.errors import ProtocolError
from transport.protocol import DEFAULT_LIMITS, Error, Limits, Message, decode, encode, error_from, request_id


def respond(frames: Sequence[Any], handler: Callable[[Message], Message], limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    """Reply frames for request `frames`. A malformed request gets a ProtocolError reply; an
    exception in the handler gets an Error reply with its traceback. Never raises for bad input."""
    try:
        message, rid = decode(frames, limits)
    except ProtocolError as exc:
        return encode(Error("ProtocolError", str(exc)), request_id(frames))
    try:
        reply = handler(message)
    except Exception as exc:  # the worker must survive any failing op; the caller gets the story
        reply = error_from(exc, traceback.format_exc())
    try:
        return encode(reply, rid, limits)
    except Exception as exc:  # e.g. a result in a dtype the wire does not carry
        return encode(error_from(exc, traceback.format_exc()), rid, limits)
