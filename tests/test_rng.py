import subprocess
import sys

import pytest
import torch

from fedquant.rng import derive_seed, rotation_negative, rotation_negative_reference, uniform, uniform_reference


def test_uniform_matches_pure_python_reference():
    assert uniform(1234, 50).tolist() == uniform_reference(1234, 50)
    assert uniform(2**62 + 7, 20, offset=1000).tolist() == uniform_reference(2**62 + 7, 20, offset=1000)


def test_offset_selects_a_slice_of_the_stream():
    full = uniform(5, 1000)
    assert torch.equal(uniform(5, 300, offset=700), full[700:])


def test_uniform_moments_and_range():
    u = uniform(42, 1_000_000).double()
    assert 0.0 <= u.min() and u.max() < 1.0
    # mean of U[0,1) has sd 1/sqrt(12 n) ~ 2.9e-4; 6 sd bound
    assert abs(u.mean().item() - 0.5) < 6 * (1 / 12) ** 0.5 / 1000
    assert abs(u.var().item() - 1 / 12) < 1e-3
    # lag-1 correlation of independent draws has sd 1/sqrt(n) = 1e-3
    c = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(c) < 6e-3


@pytest.mark.parametrize("offset, n", [(0, 64), (0, 200), (3, 61), (63, 2), (100, 1000), (5, 0), (2**33 + 17, 130)])
def test_rotation_signs_match_pure_python_reference(offset, n):
    """Bit ``p mod 64`` of the hash of word ``p // 64``, any start and length (the spans of a kernel)."""
    negative = rotation_negative(2**62 + 7, n, offset=offset)
    assert negative.dtype == torch.bool and negative.tolist() == rotation_negative_reference(2**62 + 7, n, offset)
    assert torch.equal(negative, rotation_negative(2**62 + 7, offset + n)[offset:]) if offset < 10_000 else True


def test_rotation_signs_are_fair_and_uncorrelated():
    s = rotation_negative(42, 1 << 20).double()
    n = s.numel()
    # a fair coin's mean has sd 1/(2 sqrt(n)) ~ 4.9e-4: 6 sd
    assert abs(s.mean().item() - 0.5) < 6 * 0.5 / n**0.5
    # neighbours within a word, and bit j of consecutive words: correlation sd 1/sqrt(n) ~ 1e-3
    for lag in (1, 63, 64):
        c = torch.corrcoef(torch.stack([s[:-lag], s[lag:]]))[0, 1].item()
        assert abs(c) < 6 / n**0.5, lag


def test_different_seeds_give_different_streams():
    assert not torch.equal(uniform(1, 100), uniform(2, 100))


def test_stream_is_identical_in_another_process():
    code = "from fedquant.rng import uniform; print(uniform(987654321, 64, offset=3).tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == uniform(987654321, 64, offset=3).tolist()  # our own output, a list of floats


def test_derive_seed_is_deterministic_and_separates_paths():
    a = derive_seed(7, 1, 2)
    assert a == derive_seed(7, 1, 2)
    assert 0 <= a < 2**63
    others = {
        derive_seed(7, 2, 1),
        derive_seed(7, 1, 3),
        derive_seed(8, 1, 2),
        derive_seed(7, 1, "2"),
        derive_seed(7, 12),
    }
    assert a not in others and len(others) == 5


def test_derive_seed_rejects_bad_keys():
    with pytest.raises(TypeError):
        derive_seed(1, 2.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_is_bit_identical():
    assert torch.equal(uniform(11, 10_000, device="cuda").cpu(), uniform(11, 10_000))
    assert torch.equal(
        rotation_negative(11, 10_000, offset=5, device="cuda").cpu(), rotation_negative(11, 10_000, offset=5)
    )
