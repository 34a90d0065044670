"""How many threads the codecs' CPU kernels (numba) may use.

numba sizes its thread pool by the machine's cores, whatever the process was given. A simulated
client (Ray sets its ``OMP_NUM_THREADS``, hence torch's thread count, to its ``num-cpus``) that
runs parallel kernels on every core oversubscribes them, and numba's OpenMP workers spin while
they wait: on a busy 2-core machine a 100k-element encode took 20-50x longer with 2 threads
than with 1. The client mod therefore runs the kernels on as many threads as torch uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numba
import torch


@contextmanager
def _torch_threads_kept() -> Iterator[None]:
    """Undo what starting numba's threading layer does to torch.

    numba's first thread call (get or set) starts its OpenMP layer, which resets the process's
    OpenMP thread count, torch's intra-op threads, to every core: a client given one CPU would
    train on all of them after its first encode.
    """
    torch_threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def current_kernel_threads() -> int:
    """How many threads the calling thread's kernels may use now."""
    with _torch_threads_kept():
        return numba.get_num_threads()


def set_kernel_threads(n: int) -> int:
    """Let the calling thread's kernels use at most ``n`` threads (at least 1); returns the count set."""
    count = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    with _torch_threads_kept():
        numba.set_num_threads(count)
    return count


@contextmanager
def kernel_threads(n: int | None = None) -> Iterator[int]:
    """Within the block, kernels use at most ``n`` threads (default: torch's intra-op thread count).

    >>> with kernel_threads():          # e.g. inside a client that was given one CPU
    ...     payload = codec.encode(update, seed)
    """
    wanted = torch.get_num_threads() if n is None else n
    with _torch_threads_kept():
        previous = numba.get_num_threads()
    try:
        yield set_kernel_threads(wanted)
    finally:
        set_kernel_threads(previous)
