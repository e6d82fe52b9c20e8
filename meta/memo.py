"""Remembering what pure functions of an op's description say: a decoder's 30 layers ask the
coordinator the same questions (infer, the planner's choice), so each is worked out once."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


def frozen(value):
    """Parameters as a key: dicts sorted, sequences as tuples, and each plain value tagged with
    its type (1, 1.0 and True are equal keys otherwise, and would share a plan or a choice)."""
    if isinstance(value, dict):
        return tuple(sorted((k, frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return type(value).__name__, value


class Memo:
    """The values of a pure function by key, at most `limit` of them (all forgotten at once when
    full: the keys of one model's steps are a few dozen). A key that cannot be hashed (a
    parameter holding an array) is worked out afresh every time."""

    def __init__(self, limit: int):
        self.limit = limit
        self.known: dict[Hashable, Any] = {}

    def get(self, key: Hashable, work: Callable[[], Any]) -> Any:
        try:
            value = self.known.get(key)
        except TypeError:
            return work()
        if value is None:
            value = work()
            if len(self.known) >= self.limit:
                self.known.clear()
            self.known[key] = value
        return value
