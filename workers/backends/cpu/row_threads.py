"""When a row-wise loop (a norm, rope, the gated FFN's activation, the activations' 8-bit
quantization) runs over the worker's threads: a prefill's rows (tokens) are independent, so its
loops' twins run the one-thread loop on each row over the threads (every row's bits the same
either way). A decode step's few rows stay on one thread, where a parallel launch costs more than
the work: in a 1.7B-shaped Q5_K prefill of 64 tokens on two threads these loops were a sixth of
the step, on one thread while the other waited."""

from __future__ import annotations

# values (rows x width) from which a loop's rows go over the threads: a prefill's 16 or more rows
# of 2,048 values, not a server's decode step of 8
PARALLEL_VALUES = 1 << 15


def over_threads(values: int, threads: int) -> bool:
    """Whether a row-wise loop over `values` values runs on `threads` threads, not one."""
    return threads > 1 and values >= PARALLEL_VALUES
