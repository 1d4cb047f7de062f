"""Timing of MLX calls as a decode step makes them: the one clock of `cartridge bench` and of the backend
proofs (`backends.proof`), kept below both so that neither imports the other."""

import statistics
import time

import mlx.core as mx

from .backends import device


def timeit(fn, repeats=20, warmup=3, inner=None, chain=None):
    """Median seconds per call of `fn`.

    Without `chain`, each round queues `inner` independent calls (10 on a GPU, 1 on CPU) and times their
    evaluation. With `chain` (an array), the calls are fn(chain), fn(result), ...: each depends on the
    one before, as the layers of a decode step do (independent calls can run concurrently on a GPU,
    which flatters small kernels). On CPU a chained round is `inner` calls (default 1). On a GPU each
    round times a chain of `inner` calls (default 50) and one of 5 x `inner`, and takes the difference
    per call: the cost of one more call in a long chain. MLX's CUDA backend encodes a chain into CUDA
    graphs of up to 100 operations on Hopper (20 on most other GPUs; mlx/backend/cuda/device.cpp,
    get_graph_limits) and launches each graph while it encodes the next, as in a decode loop; a short
    chain evaluated at once would instead pay the host's encoding and the device's time one after the
    other. So the chained GPU time is max(host encoding, device time) per call, the device's when the
    kernel is the slower part.

    Args:
        fn: a callable of no argument (without `chain`) or of one array (with it) returning MLX arrays.
        repeats (int): timed rounds; the median is returned. warmup (int): untimed rounds first.
        inner (int | None): calls per round (the defaults above). chain (mx.array | None): the first input.

    Returns:
        float: seconds per call (median over the rounds).
    """
    gpu_chain = chain is not None and device() != "cpu"
    inner = inner or (50 if gpu_chain else 10 if device() != "cpu" else 1)

    def queue(n):
        if chain is None:
            return [fn() for _ in range(n)]
        x = chain
        for _ in range(n):
            x = fn(x)
        return [x]

    def seconds(n):
        outs = queue(n)
        t = time.perf_counter()
        mx.eval(outs)
        return time.perf_counter() - t

    for _ in range(warmup):
        mx.eval(queue(inner))
        if gpu_chain:
            mx.eval(queue(5 * inner))
    times = []
    for _ in range(repeats):
        if gpu_chain:
            times.append((seconds(5 * inner) - seconds(inner)) / (4 * inner))
        else:
            times.append(seconds(inner) / inner)
    return statistics.median(times)
