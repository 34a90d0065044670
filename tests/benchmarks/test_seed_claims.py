"""benchmarks.seed_claims: its table round-trips, and a claim that held before and fails now is a regression."""

from __future__ import annotations

from benchmarks.seed_claims import NOT_REPRODUCED, REPRODUCED, Claim, markdown, previous_verdicts, regressions


def _rows(verdict_of_second: str) -> list[Claim]:
    return [
        Claim("QSGD", "4-bit trains to fp32 accuracy", "digits", "0.93 ± 0.01", REPRODUCED),
        Claim("ORQ", "ORQ-5 has less variance", "gradients", "0.25 ± 0.05", verdict_of_second),
        Claim("NDQSG", "fewer bits at DQSG's error", "gradients", "+0 %", f"{NOT_REPRODUCED}: nests no tensor"),
    ]


def test_a_claim_reproduced_before_and_not_now_is_a_regression(tmp_path):
    path = tmp_path / "seed-claims.md"
    path.write_text(markdown(_rows(REPRODUCED), "python -m benchmarks.seed_claims", 60.0, [0, 1, 2]))
    before = previous_verdicts(path)
    assert before["ORQ: ORQ-5 has less variance"] == REPRODUCED and len(before) == 3
    assert regressions(before, _rows(REPRODUCED)) == []
    lost = regressions(before, _rows(f"{NOT_REPRODUCED}: ORQ not lowest in every seed"))
    assert lost == ["ORQ: ORQ-5 has less variance"]


def test_no_previous_table_means_no_regression(tmp_path):
    assert previous_verdicts(tmp_path / "absent.md") == {}
    assert regressions({}, _rows(NOT_REPRODUCED)) == []


def test_the_nested_round_measures_the_spread_in_fine_steps():
    """Identical gradients spread only by P1's averaged DQSG noise; independent ones by about a step or more."""
    import numpy as np
    import torch

    from benchmarks.seed_claims import _nested_round
    from fedquant.codecs import get_codec

    dqsg = get_codec("dqsg", levels=3, bucket_size=512)
    same = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    alike = _nested_round(1, [{"w": same.clone()} for _ in range(10)], ["w"], dqsg, np.random.default_rng(0), 0)
    apart = _nested_round(
        1,
        [{"w": torch.randn(4096, generator=torch.Generator().manual_seed(p))} for p in range(10)],
        ["w"],
        dqsg,
        np.random.default_rng(0),
        0,
    )
    # P1's mean of 5 DQSG decodings: error variance (1/12) / 5 steps^2 for the first P2, less after
    assert 0.03 < alike.measured < 0.2
    assert apart.measured > 0.8
    assert len(alike.p2) == 5 and set(alike.p2[0]) == {"w"}
