"""Fuzzing every codec's decoder with mutated payloads, in worker subprocesses (a crash fails the test).

The mutator (:mod:`fedquant.testing.fuzz_mutations`) and the harness (:mod:`fedquant.testing.fuzzing`)
are shared with ``python -m benchmarks.fuzz`` (100,000 cases and more); here a fixed-seed sample of every family runs in
two workers, and a self-test shows that the harness does report a crash, a hang and an Inf (both ``slow``: they start
worker processes; the mutator's tests stay in the fast lane).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedquant.errors import PayloadError
from fedquant.testing.fuzz_mutations import KINDS, bases, families, mutate
from fedquant.testing.fuzzing import FAILURES, canonical_specs, run_fuzz

CASES_PER_FAMILY = 60


def test_every_codec_and_coding_is_a_family():
    from fedquant.codecs import available_codecs, codec_class

    specs = families()
    for name in available_codecs():
        params = codec_class(name).params
        codings = params["coding"].choices if "coding" in params else ("fixed",)
        for coding in codings:
            assert any(s.split(":")[0] == name and (coding == "fixed" or f"coding={coding}" in s) for s in specs)


def test_mutations_mostly_pass_the_envelope_and_reach_the_body():
    """Most mutated payloads must get past the CRC and header checks, or the fuzzer tests little."""
    from fedquant.wire.payload import read_payload

    spec = "qsgd:coding=entropy"
    _, valid = bases(spec)
    all_specs = canonical_specs(families())
    rng = np.random.default_rng(5)
    kinds, parsed = [], 0
    for _ in range(400):
        kind, data = mutate(rng, spec, valid[int(rng.integers(len(valid)))], valid[0], all_specs)
        kinds.append(kind)
        try:
            read_payload(data)
            parsed += 1
        except PayloadError:
            pass
    assert set(kinds) == set(KINDS)
    assert parsed > 0.6 * len(kinds)


@pytest.mark.slow  # a fuzz campaign in worker processes: an integration test (CI runs it)
def test_no_payload_crashes_hangs_or_escapes_as_another_error():
    specs = families()
    report = run_fuzz(CASES_PER_FAMILY * len(specs), seed=1, workers=2, specs=specs, case_timeout=60.0)
    assert not report.worker_errors
    assert report.total == CASES_PER_FAMILY * len(specs)
    assert not report.failures, "\n".join(f"{o} {s} case {i}: {d}" for s, i, o, d in report.failures[:20])
    for spec in specs:
        # Every family's mutations get rejected, and its valid payloads decode: a family whose
        # bases all failed would mean a broken harness (which random mutations alone may not show).
        assert report.counts[spec]["payload-error"] > 0, (spec, dict(report.counts[spec]))
        codec, valid = bases(spec)
        decoded = [codec.decode(b.payload, b.seed, b.side_info, shape=b.shape, dtype=b.dtype) for b in valid]
        assert decoded and all(bool(torch.isfinite(y.float()).all()) for y in decoded), spec


@pytest.mark.slow  # a fuzz campaign in worker processes
def test_the_twins_survive_the_same_payloads(monkeypatch):
    """The NumPy and torch twins decode while numba's cache is cold (a fresh server's first
    minutes): the same mutated payloads against them, fewer per family."""
    from fedquant.jit.cache import MODE_ENV

    monkeypatch.setenv(MODE_ENV, "twin")  # the workers inherit it
    specs = families()
    report = run_fuzz(20 * len(specs), seed=2, workers=2, specs=specs, case_timeout=60.0)
    assert not report.worker_errors
    assert report.total == 20 * len(specs)
    assert not report.failures, "\n".join(f"{o} {s} case {i}: {d}" for s, i, o, d in report.failures[:20])


@pytest.mark.slow  # three worker starts and a 5 s hang timeout, by design
def test_harness_reports_crash_hang_and_nonfinite():
    spec = "fp32"  # no kernels to load: the three worker starts stay short
    inject = {"crash": [spec, 3], "hang": [spec, 7], "nonfinite": [spec, 0]}
    report = run_fuzz(12, seed=1, workers=1, specs=[spec], case_timeout=5.0, inject=inject)
    outcomes = {(i, o) for s, i, o, _ in report.failures}
    assert outcomes == {(3, "crash"), (7, "hang"), (0, "nonfinite")}, report.failures
    assert report.total == 12  # the cases after the crash and the hang still ran
    assert set(FAILURES) >= {o for _, o in outcomes}


def test_entropy_families_fuzz_the_multi_block_layouts_of_both_coders():
    """The mutations reach every part of the rANS section: two bases of each entropy family are laid
    out in several blocks (32 lanes of rans32, 8 lanes of rans64), and forged sections name both
    coders, several blocks and 32 lanes too."""
    from fedquant.testing.fuzz_mutations import _rans_bytes, forged_entropy
    from fedquant.wire.payload import read_payload

    def header(section: np.ndarray, count: int, k: int) -> tuple[int, int]:
        at = section.size - _rans_bytes(section, count, k)
        return int(section[at]), int(section[at + 1])

    for spec in ("qsgd:coding=entropy", "rht+qsgd:coding=entropy"):
        codec, valid = bases(spec)
        count = codec.wire_transforms[0].output_numel(5000) if codec.wire_transforms else 5000
        layouts = []
        for relaid in valid[-2:]:
            section = np.frombuffer(bytes(read_payload(relaid.payload).body)[relaid.offset :], np.uint8)
            layouts.append(header(section, count, codec.quantizer.num_symbols()))
        (flags32, lanes32), (flags64, lanes64) = layouts
        assert flags32 & 0x80 and flags32 & 0x20 and lanes32 == 5, spec  # several blocks of 32 rans32 lanes
        assert flags64 & 0x80 and not flags64 & 0x20 and lanes64 == 3, spec  # several blocks of 8 rans64 lanes
    rng = np.random.default_rng(3)
    multi = wide = narrow = 0
    for _ in range(300):
        section = np.frombuffer(forged_entropy(rng, 5000), np.uint8)
        try:
            flags, lanes = header(section, 5000, 2**16)
        except (PayloadError, IndexError):  # a table inconsistent with the count, or no header
            continue
        multi += bool(flags & 0x80)
        wide += bool(flags & 0x20) and lanes == 5
        narrow += not flags & 0x20
    assert multi > 30 and wide > 30 and narrow > 30


def test_the_twin_rans_decoder_keeps_a_forged_streams_tables_within_the_memory_bound(monkeypatch):
    # A forged 2 KB entropy section of 5,000 symbols names a model whose direct decode table has
    # 2**15 slots; the NumPy twin (what a server runs while numba's cache is cold) once held it,
    # and the stream's words, as lists of Python ints: 1.45 MB traced against a bound of 89 KB
    # plus the 1 MB slack. Found by `python -m benchmarks.fuzz` (case 1556 of dqsg:coding=entropy).
    from fedquant.jit import cache
    from fedquant.testing.fuzzing import replay

    monkeypatch.setenv(cache.MODE_ENV, "twin")
    monkeypatch.setattr(cache, "READY", False)  # once the kernels ran in this process, they would stay chosen
    assert replay("dqsg:coding=entropy", 1556) == ("payload-error", "")


@pytest.mark.parametrize("spec", ["eden:bits=2", "qsgd"])
def test_a_deferred_pass_that_disagrees_with_decode_is_a_failure(spec, monkeypatch):
    """The oracle of the server's deferred pass: it agrees on a valid payload, and each way of
    disagreeing (accepting what decode refused, refusing what it accepted, other values) is named."""
    from fedquant.codecs import get_codec
    from fedquant.testing import fuzzing

    assert "deferred-mismatch" in FAILURES
    codec = get_codec(spec)
    payload = codec.encode(torch.randn(3, 700, generator=torch.Generator().manual_seed(1)) * 0.01, seed=4)
    decoded = codec.decode(payload, seed=4, shape=(3, 700), dtype=torch.float32)
    assert fuzzing._deferred_disagrees(codec, payload, 4, (3, 700), decoded) is None
    assert "accepted" in fuzzing._deferred_disagrees(codec, payload, 4, (3, 700), None)
    wrong = decoded.clone()
    wrong[0, 0] += 1
    assert "differ" in fuzzing._deferred_disagrees(codec, payload, 4, (3, 700), wrong)
    kind = type(codec.decode_deferred(payload, 4, shape=(3, 700)))

    def refuse(*args):
        raise PayloadError("forged")

    monkeypatch.setattr(kind, "accumulate", refuse)
    assert "refused" in fuzzing._deferred_disagrees(codec, payload, 4, (3, 700), decoded)
    monkeypatch.setattr(kind, "accumulate", lambda *args: 1 // 0)
    assert "ZeroDivisionError" in fuzzing._deferred_disagrees(codec, payload, 4, (3, 700), decoded)
