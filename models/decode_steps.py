"""The decode steps of a generation, one a lane: loaded at warm-up or captured at their first
run, replayed after. One home for LLM's (models/generate.py) and the server's
(models/batching.py), which ask for the same steps by the same rows.

A step is known by the rows it runs (a lane's, or every batch row's where there is one lane),
whether it is one lane of several (its results then stay on the head's group, which hands the
chosen tokens to the others: TensorParallelLlama.capture_decode's `lane`) and the caller's
`kind` (what its candidates are: their pool, and the server's row sums)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from models.llama import TensorParallelLlama


class DecodeSteps:
    def __init__(self, net: TensorParallelLlama):
        self.net = net
        self._steps: dict[tuple, Any] = {}

    def __iter__(self):
        """The steps there are, each as (first row, rows, one lane of several, kind)."""
        return iter(list(self._steps))

    @staticmethod
    def _key(lane: range, lanes: int, kind: Hashable) -> tuple:
        return (lane.start, len(lane), lanes > 1, kind)

    def get(self, lane: range, lanes: int, kind: Hashable):
        """The step of `lane`, one of `lanes`, or None where it is neither loaded nor captured."""
        return self._steps.get(self._key(lane, lanes, kind))

    def prepare(self, lane: range, lanes: int, kind: Hashable, build: Callable) -> bool:
        """Load the step without running it (a warm-up) unless it is; whether it was loaded now."""
        key = self._key(lane, lanes, kind)
        if key in self._steps:
            return False
        self._steps[key] = self.net.prepare_decode(len(lane), build, rows_from=lane.start, lane=lanes > 1)
        return True

    def run(self, lane: range, lanes: int, kind: Hashable, build: Callable, tokens, positions, read=None) -> list:
        """The step on `tokens` and `positions` ((rows, 1) each), replayed, or captured now where
        it is not yet: its outputs (build's results, then the caches'). `read`: the outputs a
        replay brings back (all where None); a capture brings back every one."""
        key = self._key(lane, lanes, kind)
        step = self._steps.get(key)
        if step is None:
            self._steps[key], outputs = self.net.capture_decode(
                tokens, positions, build=build, rows_from=lane.start, lane=lanes > 1
            )
            return outputs
        return step(tokens, positions) if read is None else step(tokens, positions, read=read)
