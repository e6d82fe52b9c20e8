"""A generation the workers drive (MetaDevice.generate): one Generate message per worker runs a
captured decode step up to N times, the workers feeding back the tokens they choose
(workers/generation.py); the coordinator shows each step's tokens as they come, from the token
board (transport/board.py) or Tokens messages, and cancels when told to."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from meta.serialized import serialized
from meta.steps import Step, slot_pairs
from split_state import errors
from split_state.errors import ShapeError
from split_state.states import holders
from transport import protocol as p
from transport.board import TokenBoard
from transport.board import supported as board_supported
from transport.replies import Watch


class Generating:
    """MetaDevice's worker-driven generation (a part of it, as Placement and Capturing are)."""

    @serialized
    def generate(
        self,
        step: Step,
        tokens: np.ndarray,
        positions: np.ndarray,
        steps: int,
        sampling: p.GenerateSettings,
        on_tokens: Callable[[int, list[int]], bool],
        every_step: bool = False,
        on_logprobs: Callable[[int, np.ndarray], None] | None = None,
        on_report: Callable[[], None] | None = None,
        lanes: Sequence[tuple[Step, np.ndarray, np.ndarray]] = (),
    ) -> dict:
        """Run captured decode `step` up to `steps` times on the workers, which feed each step's
        chosen tokens back themselves (transport.protocol.Generate): the step's feeds are
        (tokens, positions), its first two outputs the candidates (values, indices) of
        Tensor.top_k. `on_tokens(step, tokens)` gets each step's tokens as they come (read
        from the token board every `sampling.report_s` seconds, or from Tokens messages that
        gather steps for that long: workers/generation.py); False cancels after the step under
        way (as Ctrl-C does), and the steps reported with it are not shown, unless
        `every_step`: then every step the workers ran is shown, those after the refusal too (a
        caller that goes on from where the workers stopped needs every token they fed back).
        With `sampling.logprobs`, the step's third output is each row's probability mass (the
        sum of exp(logit - best)) and `on_logprobs(step, rows)` gets each step's
        log-probabilities (transport.protocol.Tokens.logprobs, one row per sequence) just before
        its tokens. `on_report()` is called once the steps of each report are all shown (a
        caller that hands tokens to readers wakes them once a report, not once a step).
        `lanes`: a pipelined generation (workers/pipelined.py): further (step, tokens,
        positions), each a captured step over the rows after the ones before (lane 0 this
        call's own, over the sequences the others leave), its candidates on the head's group,
        whose first worker chooses and reports (models.llama.TensorParallelLlama.lanes).
        Returns the choosing worker's account (steps run, cancelled, times; with
        `sampling.own`, each sequence's generator state at the end)."""
        calls = [(step, tokens, positions), *lanes]
        if any(len(s.specs) != 2 or None in s.feed_slots for s, _, _ in calls):
            raise ShapeError("generate: the captured step must read two feeds, tokens and positions")
        if sampling.logprobs and (any(len(s.roots) < 3 for s, _, _ in calls) or on_logprobs is None):
            raise ShapeError(
                "generate: log-probabilities need a step whose third output is each row's mass, and on_logprobs"
            )
        laned = sum(t.shape[0] for _, t, _ in lanes)  # the sequences of the lanes after the first
        if len(sampling.done) - laned < 1:
            raise ShapeError(f"generate: lanes of {laned} rows after the first, for {len(sampling.done)} sequences")
        reporter = _reporter([s for s, _, _ in calls], self.n) if lanes else 0
        bounds = [self._bind(s, (t, q)) for s, t, q in calls]
        bound = bounds[0]
        inputs, out_ids = bound.inputs, bound.out_ids
        fed = {t: a for b in bounds for t, a in {**b.fed, **b.sent}.items()}
        fresh = [t for b in bounds for t in (*b.fed, *b.fresh)]
        run = self.ledger.reserve_runs(steps * len(calls) + 1)  # one run id per step and lane, none reused
        feeds, data = p.pack_arrays(fed)
        token_id, position_id = (inputs[slot] for slot in step.feed_slots)
        further = [
            [s.compiled.program, *(b.inputs[slot] for slot in s.feed_slots), *b.out_ids[:2]]
            + [b.out_ids[2] if sampling.logprobs else -1, t.shape[0]]
            for (s, t, _), b in zip(lanes, bounds[1:])
        ]
        # the board carries token ids only: log-probabilities come in Tokens messages
        board = None if sampling.logprobs else token_board(len(sampling.done), steps)
        if board is not None:
            sampling = dataclasses.replace(sampling, board=str(board.path))
        shown = Shown(on_tokens, every_step, on_logprobs, on_report)
        message = p.Generate(
            step.compiled.program,
            run,
            steps,
            slot_pairs(range(len(inputs)), inputs),
            slot_pairs(step.compiled.plan.outputs, out_ids),
            token_id,
            position_id,
            out_ids[0],
            out_ids[1],
            sampling,
            feeds,
            data,
            out_ids[2] if sampling.logprobs else -1,
            further,
            [slot_pairs(range(len(b.inputs)), b.inputs) for b in bounds[1:]],
            [slot_pairs(s.compiled.plan.outputs, b.out_ids) for (s, _, _), b in zip(lanes, bounds[1:])],
            reporter,
        )
        watch = None
        if board is not None:
            every_ms = int(1000 * sampling.report_s)
            watch = Watch(every_ms, lambda show: shown.steps(*board.take(), show=show), board.cancel)
        try:
            replies = self._call(
                {d: message for d in range(self.n)},
                lambda rank, m: shown.steps(m.step, m.tokens, logprobs=m.logprobs) is not False,
                watch,
            )
            if board is not None:  # what rank 0 published after the last look: before its reply
                shown.steps(*board.take())
        finally:
            self.ledger.release(fresh)  # freed with the next message that runs
            if board is not None:
                board.close()
        return dict(replies[reporter].info)


def _reporter(steps: Sequence[Step], n: int) -> int:
    """The worker that chooses a pipelined generation's tokens: the first holding every lane's
    candidates (the head's group)."""
    held = {holders(s.compiled.plan.out_states[0], n) for s in steps}
    if len(held) != 1:
        raise ShapeError(f"generate: the lanes' candidates are on different workers: {sorted(held)}")
    return min(held.pop())


class Shown:
    """The steps of a generation as `on_tokens` sees them: each once and in order, whichever
    way it came (rank 0 sends the first in a Tokens message and puts it on the token board
    too), none after a refusal unless `every_step`."""

    def __init__(
        self,
        on_tokens: Callable[[int, list[int]], bool],
        every_step: bool = False,
        on_logprobs: Callable[[int, np.ndarray], None] | None = None,
        on_report: Callable[[], None] | None = None,
    ):
        self.on_tokens, self.every_step, self.on_logprobs = on_tokens, every_step, on_logprobs
        self.on_report = on_report
        self.next = 0  # the first step not shown yet
        self.refused = False

    def steps(
        self, first: int, tokens: Sequence[Sequence[int]], show: bool = True, logprobs: np.ndarray | None = None
    ) -> bool | None:
        """None: nothing new; False: refused (now or before). `logprobs`: the steps' rows of
        log-probabilities, where the generation reports them."""
        if not tokens:
            return None
        if logprobs is not None and len(logprobs) and len(logprobs) != len(tokens):
            raise errors.ProtocolError(
                f"worker 0 reported {len(tokens)} steps with {len(logprobs)} of log-probabilities"
            )
        shown = False
        for k, chosen in enumerate(tokens, first):
            if (not show or self.refused) and not self.every_step:
                break
            if k >= self.next:  # else shown already, from the other way
                self.next, shown = k + 1, True
                if self.on_logprobs is not None and logprobs is not None and len(logprobs):
                    self.on_logprobs(k, logprobs[k - first])
                self.refused = not self.on_tokens(k, list(chosen)) or self.refused
        if shown and self.on_report is not None:
            self.on_report()
        return not self.refused


def token_board(per_step: int, steps: int) -> TokenBoard | None:
    """A board for rank 0's tokens (transport/board.py), or None where shared memory cannot
    carry them: rank 0 then sends Tokens messages only."""
    if not board_supported() or per_step < 1 or steps < 1:
        return None
    try:
        return TokenBoard.create(per_step, steps)
    except errors.TransportError:
        return None
