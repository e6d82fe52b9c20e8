"""What every public method of a MetaDevice shares: one call at a time (`serialized`), and the
clock that says where the coordinator's time went (`Clock`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass


def serialized(method):
    """One call at a time per MetaDevice: threads that share one take turns (the workers serve
    one request at a time, and plans, ids and feeds are the device's own state)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            if self._depth:  # a call inside another: the outer one is timing
                return method(self, *args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._depth -= 1
                self.clock.inside_s += time.perf_counter() - start

    return locked


@dataclass
class Clock:
    """Where the coordinator's time went since `reset`: inside the device's methods, and of
    that, waiting for the workers' replies (round trips); the rest is its own work (graphs,
    plans, messages). Benchmarks read it to account for a step's wall time."""

    inside_s: float = 0.0
    round_trip_s: float = 0.0

    @property
    def coordinator_s(self) -> float:
        return self.inside_s - self.round_trip_s

    def reset(self) -> None:
        self.inside_s = self.round_trip_s = 0.0
