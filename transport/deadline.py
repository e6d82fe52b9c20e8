"""Deadlines and liveness: every wait in the runtime is bounded by one of these."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class Deadline:
    """A point in monotonic time; `None` seconds would mean forever, which we never allow."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.at = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self) -> int:
        return int(self.remaining() * 1000)

    def expired(self) -> bool:
        return time.monotonic() >= self.at


@dataclass
class Liveness:
    """When each peer was last heard from; a peer silent for `window` seconds is lost."""

    window: float
    last_seen: dict[int, float] = field(default_factory=dict)

    def heard(self, peer: int) -> None:
        self.last_seen[peer] = time.monotonic()

    def silent_for(self, peer: int) -> float:
        return time.monotonic() - self.last_seen.get(peer, time.monotonic())

    def lost(self) -> list[int]:
        now = time.monotonic()
        return [p for p, t in self.last_seen.items() if now - t > self.window]
