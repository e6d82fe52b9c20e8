"""The next token chosen on the GPU: a decode step's candidates in, the chosen token out, written
where the next step reads it (the fed token ids and positions), so no host round trip feeds a
decode step. The host reads the chosen ids to report them (4 bytes a sequence) but writes nothing
back.

One thread block per sequence (`sample_next`). Its threads apply the repeat penalty to the
candidates the sequence's recent tokens name and rank the candidates again, as a stable sort by
value would (a candidate's rank: those better than it, and those equal before it); its first
thread then runs split_state/sampling.py's `pick` step by step in float64: top-k, temperature,
the softmax, top-p, min-p and the draw, each sum one addition after another as np.cumsum's. The
generator's state lives on the device too, as the uniforms it will draw: the host fills
`uniforms` (steps, sequences) from the generation's seeded generator before the first step, in
the order the host path draws them, and each launch reads its step's row, so the choices equal
the host path's (to the last bit of exp, which the device and NumPy may round apart: a draw
falling inside that rounding could differ, some 1e-16 of the time).

The recent tokens are a ring per sequence (`window` slots, -1 where empty, `cursor` the next slot
to write); a candidate of index -1 (padding) may match an empty slot, which changes nothing: its
value is -inf, and the penalty keeps -inf.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from split_state.sampling import TEMPERATURE_FLOOR, Rule, pick
from workers.backends.cuda.kernels.device import DeviceKernel

MAX_CANDIDATES = 512  # the candidates a sequence may bring (top_k.MAX_K)
THREADS = 256

SOURCE = (
    f"#define MAX_CANDIDATES {MAX_CANDIDATES}\n#define TEMPERATURE_FLOOR {TEMPERATURE_FLOOR!r}\n"
    + r"""
extern "C" __global__ void sample_next(const float* __restrict__ values, const long long* __restrict__ indices,
                                       int k, int top_k, double temperature, double top_p, double min_p,
                                       double penalty, int* __restrict__ recent, int window, int* __restrict__ cursor,
                                       const double* __restrict__ uniforms, int draw, int* __restrict__ tokens,
                                       int* __restrict__ positions, int* __restrict__ chosen) {
    __shared__ double given_v[MAX_CANDIDATES], sorted_v[MAX_CANDIDATES], probs[MAX_CANDIDATES];
    __shared__ long long given_i[MAX_CANDIDATES], sorted_i[MAX_CANDIDATES];
    const int row = blockIdx.x, tid = threadIdx.x, rows = gridDim.x;
    const bool penalize = penalty != 1.0 && window > 0;
    for (int j = tid; j < k; j += blockDim.x) {
        double v = (double)values[(long)row * k + j];
        const long long index = indices[(long)row * k + j];
        if (penalize) {
            bool seen = false;
            for (int w = 0; w < window; ++w) seen = seen || recent[(long)row * window + w] == index;
            if (seen) v = v > 0 ? v / penalty : v * penalty;
        }
        given_v[j] = v;
        given_i[j] = index;
    }
    __syncthreads();
    for (int j = tid; j < k; j += blockDim.x) {  /* the stable order by value, best first */
        int rank = 0;
        for (int o = 0; o < k; ++o) rank += given_v[o] > given_v[j] || (given_v[o] == given_v[j] && o < j);
        sorted_v[rank] = given_v[j];
        sorted_i[rank] = given_i[j];
    }
    __syncthreads();
    if (tid != 0) return;
    const int n = top_k > 0 && top_k < k ? top_k : k;
    int at = 0;
    if (temperature >= TEMPERATURE_FLOOR) {
        const double best = sorted_v[0] / temperature;
        double sum = 0.0;
        for (int j = 0; j < n; ++j) {
            probs[j] = exp(sorted_v[j] / temperature - best);
            sum += probs[j];
        }
        for (int j = 0; j < n; ++j) probs[j] /= sum;
        int used = n;
        if (top_p < 1.0) {  /* through the first candidate whose running sum reaches top_p */
            double running = 0.0;
            int cut = n;
            for (int j = 0; j < n; ++j) {
                running += probs[j];
                if (running >= top_p) {
                    cut = j + 1;
                    break;
                }
            }
            used = cut;
            sum = 0.0;
            for (int j = 0; j < used; ++j) sum += probs[j];
            for (int j = 0; j < used; ++j) probs[j] /= sum;
        }
        if (min_p > 0.0) {
            const double floor = min_p * probs[0];
            int kept = 0;
            while (kept < used && probs[kept] >= floor) ++kept;
            used = kept;
            sum = 0.0;
            for (int j = 0; j < used; ++j) sum += probs[j];
            for (int j = 0; j < used; ++j) probs[j] /= sum;
        }
        double running = 0.0;  /* the running sums, then each over the last: Generator.choice's cdf */
        for (int j = 0; j < used; ++j) {
            running += probs[j];
            probs[j] = running;
        }
        const double u = uniforms[(long)draw * rows + row];
        while (at < used - 1 && probs[at] / running <= u) ++at;
    }
    const int token = (int)sorted_i[at];
    chosen[row] = token;
    tokens[row] = token;
    positions[row] += 1;
    if (window > 0) {
        recent[(long)row * window + cursor[row]] = token;
        cursor[row] = (cursor[row] + 1) % window;
    }
}
"""
)


def _sample_next(values, indices, k, top_k, temperature, top_p, min_p, penalty, recent, window, cursor, *rest):
    """What sample_next computes: `pick` per sequence (one block each; the grid's size is the
    sequences', told by `chosen`), then the token written out and into the ring."""
    uniforms, draw, tokens, positions, chosen = rest
    k, window, draw = int(k), int(window), int(draw)
    rule = Rule(float(temperature), int(top_k), float(top_p), float(min_p), float(penalty), window)
    rows = chosen.size
    for row in range(rows):
        ring = recent[row * window : (row + 1) * window] if window else recent[:0]
        uniform = None if rule.greedy else float(uniforms[draw * rows + row])
        token = pick(values[row * k : (row + 1) * k], indices[row * k : (row + 1) * k], rule, uniform, ring)
        chosen[row] = tokens[row] = token
        positions[row] += 1
        if window:
            ring[cursor[row]] = token
            cursor[row] = (cursor[row] + 1) % window


DEVICE_KERNELS = (DeviceKernel("sample_next", SOURCE, _sample_next, (8, 10, 13, 14, 15)),)


class DeviceSampler:
    """A worker's decode loop's sampler on the device: `launch(step)` issues the choice of every
    sequence's token from the step's candidates, written into the fed tokens with the fed
    positions moved on (on the device), and the chosen ids' copy to the host; it returns a
    function that waits for that copy and gives the ids. Made only for
    arrays it `reads` (else the host path chooses): it draws the generation's uniforms from `rng`
    when made. Later steps' results are the same program's outputs: of the first's shapes and
    types. `read_later(array)`: a copy to the host issued behind the work before it, and a
    function waiting for it (the CUDA backend's)."""

    def __init__(self, xp, kernel, read_later, rule: Rule, rng, steps: int, recent, values, tokens, positions):
        self.kernel, self.read_later, self.rule = kernel, read_later, rule
        self.tokens, self.positions = tokens, positions
        rows, self.k = tokens.shape[0], values.shape[-1]  # values (batch, 1, k): a sequence's row k apart
        window = rule.penalized
        ring = np.full((rows, max(window, 1)), -1, np.int32)
        cursor = np.zeros(rows, np.int32)
        for row, seen in enumerate(recent):  # oldest first; the ring's next write replaces the oldest
            kept = list(seen)[-window:] if window else []
            ring[row, : len(kept)] = kept
            cursor[row] = len(kept) % window if window else 0
        # the draws the host path would make, in its order (step by step, sequence by sequence)
        draws = np.zeros(1) if rule.greedy else rng.random((steps, rows))
        self.ring, self.cursor, self.uniforms = (xp.asarray(a) for a in (ring, cursor, draws))
        self.chosen = xp.zeros(rows, xp.int32)
        self.rows = rows

    @staticmethod
    def reads(values, indices, tokens, positions) -> bool:
        """Whether the kernel reads these arrays: float32 values and int64 indices (batch, 1, k),
        at most MAX_CANDIDATES of them, int32 tokens and positions, each contiguous."""
        return (
            values.ndim == 3
            and 0 < values.shape[-1] <= MAX_CANDIDATES
            and values.shape == indices.shape
            and values.dtype == np.float32
            and indices.dtype == np.int64
            and tokens.dtype == np.int32
            and positions.dtype == np.int32
            and all(a.flags.c_contiguous for a in (values, indices, tokens, positions))
        )

    def launch(self, step: int, values, indices) -> Callable[[], list[int]]:
        """Issues the choice from this step's candidates (a run's results are fresh arrays each
        run: given each time, with the shapes the sampler was made for) and the chosen ids' copy
        to the host; gives the function that waits for them. The kernel writes one buffer of
        chosen ids at every step: its copy is issued on the kernel's stream, so the next step's
        kernel overwrites it only after the copy has read it."""
        rule = self.rule
        args = (
            values,
            indices,
            np.int32(self.k),
            np.int32(rule.top_k),
            np.float64(rule.temperature),
            np.float64(rule.top_p),
            np.float64(rule.min_p),
            np.float64(rule.repeat_penalty),
            self.ring,
            np.int32(rule.penalized),
            self.cursor,
            self.uniforms,
            np.int32(step),
            self.tokens,
            self.positions,
            self.chosen,
        )
        self.kernel((self.rows,), (THREADS,), args)
        landed = self.read_later(self.chosen)
        return lambda: [int(t) for t in landed()]
