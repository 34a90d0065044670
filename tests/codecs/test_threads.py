import numba
import torch

from fedquant.codecs.threads import kernel_threads, set_kernel_threads


def test_kernel_threads_follow_torch_and_are_restored():
    before = numba.get_num_threads()
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with kernel_threads() as count:
            assert count == 1 and numba.get_num_threads() == 1
        assert numba.get_num_threads() == before
        with kernel_threads(10_000) as count:  # never more than numba's pool
            assert count == numba.config.NUMBA_NUM_THREADS
        assert set_kernel_threads(0) == 1
    finally:
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(before)


def test_kernels_leave_the_clients_torch_threads_alone(monkeypatch):
    """numba's first thread call starts its OpenMP layer, which resets torch's thread count to every core.

    Whether that happens at a given call depends on the process's history (it did in a fresh
    simulated client), so the layer's start is reproduced here: the first numba thread call
    sets torch's threads to 2. The client's own count (1) must come back.
    """
    started = []
    real_get, real_set = numba.get_num_threads, numba.set_num_threads

    def launching(real):
        def call(*args):
            if not started:
                started.append(True)
                torch.set_num_threads(2)
            return real(*args)

        return call

    monkeypatch.setattr(numba, "get_num_threads", launching(real_get))
    monkeypatch.setattr(numba, "set_num_threads", launching(real_set))
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with kernel_threads() as count:
            assert started and count == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(torch_threads)
