"""benchmarks.sub_bit_frontier: its settings are valid codec options, and the bound.

(The subsample's vNMSE formula is the codec's own now: tests/codecs/quantizers/test_ecdq.py.)
"""

from __future__ import annotations

import math

from benchmarks.sub_bit_frontier import RATES, SUBSAMPLE, shannon_unbiased
from fedquant.codecs import get_codec


def test_every_subsample_setting_is_a_codec_at_one_of_the_rates():
    for spec in SUBSAMPLE:
        quantizer = get_codec(spec).quantizer
        assert quantizer.bits in RATES and quantizer.keep is not None and quantizer.coded_bits <= 8, spec


def test_the_unbiased_bound_is_one_at_half_a_bit():
    assert math.isclose(shannon_unbiased(0.5), 1.0)
    assert shannon_unbiased(1.0) < shannon_unbiased(0.75) < shannon_unbiased(0.5)
