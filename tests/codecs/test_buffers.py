"""Decoder output memory reused from one round to the next (:mod:`fedquant.codecs.buffers`)."""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs import get_codec
from fedquant.codecs.buffers import MIN_POOLED_BYTES, BufferPool, output_array

N = MIN_POOLED_BYTES // 4 + 100  # float32 elements: pooled


def _address(array: np.ndarray | torch.Tensor) -> int:
    return array.data_ptr() if isinstance(array, torch.Tensor) else array.__array_interface__["data"][0]


def test_outside_a_lending_every_array_is_new():
    pool = BufferPool()
    first = output_array(N)
    assert first.shape == (N,) and first.dtype == np.float32
    kept = [output_array(N) for _ in range(3)]
    assert len({_address(a) for a in kept}) == 3
    assert pool.held_bytes == 0
    with pool.lending():
        inside = output_array(N, np.float64)
    assert inside.dtype == np.float64 and pool.held_bytes == N * 8
    outside = output_array(N, np.float64)
    assert pool.held_bytes == N * 8 and _address(outside) != _address(inside)


def test_memory_nothing_refers_to_is_lent_again_after_the_round():
    pool = BufferPool()
    with pool.lending():
        a, b = output_array(N), output_array(N)
    addresses = {_address(a), _address(b)}
    a[...] = 1.0
    del a, b
    with pool.lending():
        again = [output_array(N), output_array(N)]
    assert {_address(x) for x in again} == addresses
    assert pool.held_bytes == 2 * N * 4


def test_memory_still_referred_to_is_never_lent_again():
    """A tensor over the array, a slice of it and the array itself each keep it out of the pool."""
    pool = BufferPool()
    for keep in (torch.from_numpy, lambda a: a[10:20], lambda a: a.reshape(-1)[::2], lambda a: a):
        with pool.lending():
            array = output_array(N)
        array[...] = 7.0
        kept = keep(array)
        address = _address(array)
        del array
        with pool.lending():
            other = output_array(N)
        assert _address(other) != address
        assert float(kept[0]) == 7.0  # untouched by the new lending
        other[...] = -1.0
        assert float(kept[0]) == 7.0
        del kept, other


def test_the_pool_holds_at_most_what_the_last_round_took():
    pool = BufferPool()
    with pool.lending():
        arrays = [output_array(N) for _ in range(4)]
    del arrays
    with pool.lending():
        one = output_array(N)  # the three not taken are let go at the next reclaim
    del one
    pool.reclaim()
    assert pool.held_bytes == N * 4
    pool.reclaim()  # nothing taken since: nothing held
    assert pool.held_bytes == 0


def test_sizes_must_match_and_small_arrays_are_not_pooled():
    pool = BufferPool()
    with pool.lending():
        small = output_array(16)
        big = output_array(N)
    address = _address(big)
    del small, big
    assert pool.held_bytes == N * 4
    with pool.lending():
        other = output_array(N + 1)  # another size: new memory
        same = output_array(N)
    assert _address(other) != address and _address(same) == address


def test_decoders_write_into_lent_memory_and_give_the_same_values():
    codec = get_codec("eden:bits=2")
    x = torch.randn(3 * N, generator=torch.Generator().manual_seed(0))
    payload = codec.encode(x, seed=4)
    fresh = codec.decode(payload, seed=4)
    pool = BufferPool()
    with pool.lending():
        first = codec.decode(payload, seed=4)
    address = _address(first)
    assert torch.equal(first, fresh)
    del first
    with pool.lending():
        second = codec.decode(payload, seed=4)
    assert _address(second) == address and torch.equal(second, fresh)


def test_a_released_pool_holds_nothing_and_lends_new_memory():
    pool = BufferPool()
    with pool.lending():
        first = output_array(N)
    assert pool.held_bytes == N * 4
    del first
    pool.release()
    assert pool.held_bytes == 0
    with pool.lending():
        again = output_array(N)
    assert pool.held_bytes == N * 4 and again.shape == (N,)
