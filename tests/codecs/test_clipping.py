import torch

from fedquant.codecs import get_codec
from fedquant.codecs.clipping import clip_sigma


def test_clips_at_c_standard_deviations():
    x = torch.tensor([-10.0, -1.0, 0.0, 1.0, 10.0])
    bound = 1.0 * x.std(correction=0).item()
    y = clip_sigma(x, 1.0)
    assert torch.allclose(y, x.clamp(-bound, bound))
    assert y.abs().max().item() < 10.0


def test_no_clip_factor_and_degenerate_tensors_are_left_alone():
    x = torch.tensor([3.0, -2.0])
    assert clip_sigma(x, None) is x and clip_sigma(x, 0) is x
    single = torch.tensor([5.0])
    assert torch.equal(clip_sigma(single, 2.5), single)
    constant = torch.full((100,), -0.75)
    assert torch.equal(clip_sigma(constant, 2.5), constant)


def test_clipped_codecs_keep_constant_and_single_element_tensors():
    for spec in ("terngrad:clip=2.5", "orq:clip=2.5", "bingrad-b:clip=2.5"):
        codec = get_codec(spec)
        for x in (torch.tensor([0.5]), torch.full((700,), 0.5)):
            y = codec.decode(codec.encode(x, seed=1), seed=1)
            assert torch.allclose(y, x), spec
