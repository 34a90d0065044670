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
