"""Rate/distortion table: bits per parameter next to the normalized error of every codec setting.

For each source (Gaussian, Laplace, and real model updates given with ``--update``) and each
setting, the script encodes a tensor of ``--size`` elements with several seeds and prints

* ``bits/param``: payload bytes (envelope included) x 8 / elements;
* ``nmse``: the normalized error ``E||Q(g) - g||^2 / ||g||^2`` (mean over the seeds);
* ``H bits``: for the scaled-grid codecs (QSGD, TernGrad) the empirical entropy of their symbols
  ``q + s`` per parameter plus the float32 scales, the floor any entropy coder of those symbols
  can reach; for scaled sign the entropy of the sign bits plus scales;
* ``bound``: for QSGD, the variance bound of its scaling relative to ``||g||^2``
  (``norm="l2"``: Lemma 3.1, ``sum_b min(d/s^2, sqrt(d)/s) ||g_b||^2``; ``norm="max"``:
  ``sum_b d m_b^2 / (4 s^2)``).

Settings are grouped by the number of quantization levels, so that QSGD sits next to the other
codecs with as many levels (ORQ, Linear, DQSG: see ``PEERS``). Every registered codec appears.

Checks (exit status 1 if one fails): QSGD's error is under its bound; fixed-width payloads are
exactly envelope + scales + packed symbols; entropy-coded payloads are within 5% (plus a small
constant) of the empirical entropy of their symbols.

The **frontier** section (``--only frontier``) answers "which unbiased setting gives the least
error per bit": for b = 0.5, 1, 2, 3, 4 bits per coordinate it measures every family's settings
(``FAMILY_SETTINGS``; codings fixed and entropy; without and with ``rht+``; EDEN and ECDQ always
rotate) on a d = 2^20 Gaussian vector, bits counted from payload bytes, and prints per family the
lowest vNMSE within ``b + 0.07`` bits, then per rate the best setting with EDEN's published vNMSE,
the ratio to the unbiased Shannon bound ``4^-R / (1 - 4^-R)`` at the rate ``R`` it sends, and the
best EDEN and ECDQ rows (and ECDQ's subsample, ``ecdq-keep``) beside it. The same follows on
Laplace and Student-t(3) vectors for EDEN and ECDQ. On each source the best EDEN and ECDQ settings
per rate are measured again over three seeds (codec seed and data draw), and each rate's best ECDQ
setting (on Gaussian data also the subsample's) is checked unbiased by averaging seeded decodes.
Targets (exit 1 on a miss), within b + 0.07 bits: at b = 1..4 ECDQ's mean + spread strictly
below EDEN's mean - spread on every source, and on Gaussian data ECDQ's vNMSE (mean + spread) <=
0.50, 0.100, 0.0238, 0.0059 (issue 20: 1.5x the bound). Below one bit:
:mod:`benchmarks.sub_bit_frontier`. The frontier follows on real client updates of the digits MLP
(:mod:`benchmarks.real_update_pairs`; no target).

Usage::

    python -m benchmarks.rate_distortion --only frontier  # the frontier and its targets (~15 min on 2 cores)
    python -m benchmarks.rate_distortion                 # 1M elements, 3 seeds
    python -m benchmarks.rate_distortion --quick         # 100k elements, 2 seeds
    python -m benchmarks.rate_distortion --codecs qsgd,terngrad --update update.pt
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from benchmarks.specs import Setting, all_specs, build, parse_codec_list, side_info_for
from fedquant.codecs import available_codecs
from fedquant.codecs.buckets import effective_bucket_size
from fedquant.codecs.quantizers.ecdq import E8_MIN_NUMEL
from fedquant.codecs.quantizers.grid import ScaledGridQuantizer
from fedquant.wire.bitpack import bit_width, packed_size
from fedquant.wire.payload import header_size

# Settings per group of equal level counts; {L} is the total number of levels (2s + 1 for QSGD).
# The peers' parameter names follow their codecs (ORQ/Linear: total levels; DQSG: levels per sign).
QSGD_LEVELS = (1, 2, 4, 8, 16)
PEERS = ["orq:levels={L}", "linear:levels={L}", "dqsg:levels={s}"]
TWO_LEVEL = ["signsgd", "bingrad-b", "bingrad-pb"]


def settings_by_group(only: list[str] | None) -> list[tuple[str, list[str]]]:
    """``(group title, specs)`` rows: baselines, two-level codecs, then QSGD and peers per level count."""
    groups: list[tuple[str, list[str]]] = [("baselines", ["fp32", "fp16"]), ("2 levels", list(TWO_LEVEL))]
    for s in QSGD_LEVELS:
        total = 2 * s + 1
        rows = [f"qsgd:levels={s}", f"qsgd:levels={s},norm=l2", f"qsgd:coding=elias,levels={s}"]
        rows.append(f"qsgd:coding=entropy,levels={s}")
        if s == 1:
            rows += ["terngrad", "terngrad:coding=entropy", "terngrad:bucket_size=0,clip=2.5"]
        rows += [p.format(L=total, s=s) for p in PEERS]
        groups.append((f"{total} levels (QSGD s={s})", rows))
    listed = {spec.split(":")[0] for _, rows in groups for spec in rows}
    extra = [s for s in all_specs() if s.split(":")[0] not in listed]
    if extra:
        groups.append(("other codecs (defaults)", extra))
    if only:
        groups = [(t, [s for s in rows if s in only or s.split(":")[0] in only]) for t, rows in groups]
        groups = [(t, rows) for t, rows in groups if rows]
        listed = {s for _, rows in groups for s in rows}
        asked = [s for s in only if ":" in s and s not in listed]
        if asked:
            groups.append(("requested", asked))
    return groups


def make_source(name: str, n: int, update: str | None, data_seed: int = 2024) -> torch.Tensor:
    gen = torch.Generator().manual_seed(data_seed)
    if name == "gaussian":
        return torch.randn(n, generator=gen)
    if name == "laplace":
        u = torch.rand(n, generator=gen, dtype=torch.float64) - 0.5
        return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()
    if name == "student-t3":  # Gaussian over the root of an independent chi-square(3) / 3
        z = torch.randn(n, generator=gen, dtype=torch.float64)
        chi2 = torch.randn(3, n, generator=gen, dtype=torch.float64).square().sum(0)
        return (z / (chi2 / 3).sqrt()).float()
    if name == "update":
        return load_update(update)
    raise ValueError(name)


def load_update(path: str | None) -> torch.Tensor:
    """A model update as one flat float32 tensor: a ``.npy`` array, or a ``torch.save``d tensor/dict."""
    if path is None:
        raise ValueError("no update file")
    if path.endswith(".npy"):
        return torch.from_numpy(np.load(path).astype(np.float32).reshape(-1))
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict):
        return torch.cat([v.float().reshape(-1) for v in obj.values() if torch.is_tensor(v) and v.is_floating_point()])
    return obj.float().reshape(-1)


def grid_symbols(codec, x: torch.Tensor, seed: int) -> tuple[np.ndarray, int, int] | None:
    """``(symbols, alphabet, buckets)`` of a scaled-grid codec for ``x`` and ``seed``; else None."""
    quantizer = getattr(codec, "quantizer", None)
    if not isinstance(quantizer, ScaledGridQuantizer):
        return None
    q = quantizer.quantize(x.reshape(-1).float().contiguous(), seed, None)
    return q.symbols, quantizer.num_symbols(), q.side[0].size


def entropy_bits(symbols: np.ndarray, alphabet: int) -> float:
    counts = np.bincount(symbols.astype(np.int64), minlength=alphabet).astype(np.float64)
    c = counts[counts > 0]
    return float(-(c * np.log2(c / c.sum())).sum())


def qsgd_bound(codec, x: torch.Tensor) -> float:
    """QSGD's variance bound relative to ``||x||^2`` (see the module docstring)."""
    s = codec.levels
    n = x.numel()
    d = effective_bucket_size(codec.bucket_size, n)
    v = torch.nn.functional.pad(x.double(), (0, (-n) % d)).view(-1, d)
    counts = torch.full((v.shape[0],), float(d), dtype=torch.float64)
    counts[-1] = n - (v.shape[0] - 1) * d
    if codec.norm == "l2":
        per = torch.minimum(counts / s**2, counts.sqrt() / s) * v.square().sum(1)
    else:
        per = counts * v.abs().amax(1).square() / (4 * s**2)
    return float(per.sum() / x.double().square().sum())


def measure(setting: Setting, x: torch.Tensor, seeds: list[int], failures: list[str], source: str) -> list[str]:
    codec = setting.codec
    n = x.numel()
    side = side_info_for(codec, x)
    errs, sizes = [], []
    for seed in seeds:
        payload = codec.encode(x, seed=seed)
        y = codec.decode(payload, seed=seed, side_info=side)
        errs.append(float((y.double() - x.double()).square().sum() / x.double().square().sum()))
        sizes.append(len(payload))
    bits = sizes[0] * 8 / n
    nmse = float(np.mean(errs))
    h_cell, bound_cell = "-", "-"
    where = f"{setting.spec} on {source}"
    sym = grid_symbols(codec, x, seeds[0])
    if sym is not None:
        symbols, alphabet, nb = sym
        h = entropy_bits(symbols, alphabet)
        h_cell = f"{(h + 32 * nb) / n:.3f}"
        env = header_size(1, codec.spec)
        coding = getattr(codec, "coding", "fixed")
        if coding == "fixed":
            exact = env + 4 * nb + packed_size(n, bit_width(alphabet))
            if sizes[0] != exact:
                failures.append(f"{where}: {sizes[0]} bytes, fixed width should give {exact}")
        elif coding == "entropy":
            coded = sizes[0] - env - 4 * nb
            if coded > 1.05 * h / 8 + 16 + 4 * alphabet:
                failures.append(f"{where}: entropy-coded symbols take {coded} bytes, entropy {h / 8:.0f}")
    elif setting.spec.startswith("signsgd"):
        neg = float((x < 0).double().mean())
        hb = 0.0 if neg in (0.0, 1.0) else -(neg * math.log2(neg) + (1 - neg) * math.log2(1 - neg))
        nb = -(-n // effective_bucket_size(codec.bucket_size, n))
        h_cell = f"{hb + 32 * nb / n:.3f}"
    if codec.name == "qsgd":
        bound = qsgd_bound(codec, x)
        bound_cell = f"{bound:.4g}"
        if nmse > bound:
            failures.append(f"{where}: nmse {nmse:.4g} above the bound {bound:.4g}")
    return [setting.spec, f"{bits:.3f}", f"{nmse:.4g}", h_cell, bound_cell]


def row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


# ---------------------------------------------------------------------------------------------- the frontier
#: Target rates (bits per coordinate) of the frontier, and the slack allowed over them for headers.
FRONTIER_BITS = (0.5, 1.0, 2.0, 3.0, 4.0)
HEADER_SLACK = 0.07
#: EDEN's published unbiased vNMSE at large d (Vargaftik et al., ICML 2022), printed beside.
EDEN_PUBLISHED = {1.0: 0.571, 2.0: 0.133, 3.0: 0.0358, 4.0: 0.0096}
#: Targets on Gaussian data (issue 20: 1.5x the unbiased Shannon bound 4^-b / (1 - 4^-b)).
GAUSSIAN_TARGETS = {1.0: 0.50, 2.0: 0.100, 3.0: 0.0238, 4.0: 0.0059}
#: Rates at which the best ECDQ setting must be strictly below the best EDEN setting, on every source.
BEAT_EDEN_BITS = (1.0, 2.0, 3.0, 4.0)
FRONTIER_SOURCES = ("gaussian", "laplace", "student-t3")
#: Settings tried per family row (codings and the rht+ rotation are added by ``frontier_groups``; the
#: codec is the spec's name). EDEN's b + 0.037 fills the slack: 0.031 bits of bfloat16 scales per 512
#: coordinates, and the envelope, leave 0.038 of the 0.07 (a seeded 3.7% of the coordinates get one
#: more bit). ECDQ's ``bits`` is its rate on Gaussian data (the payload adds about 0.005), so b + 0.06
#: fills the slack.
_ECDQ_BITS = [round(b + d, 3) for b in FRONTIER_BITS for d in (-0.2, -0.1, -0.05, -0.02, 0.0, 0.03, 0.05, 0.06, 0.063)]
FAMILY_SETTINGS: dict[str, list[str]] = {
    "qsgd": [f"qsgd:levels={s}" for s in (1, 2, 3, 4, 6, 8, 12, 16)],
    "terngrad": ["terngrad"],
    "dqsg": [f"dqsg:levels={m}" for m in (1, 2, 3, 4, 6, 8, 12, 16)],
    "orq": [f"orq:levels={k}" for k in (3, 4, 5, 8, 9, 16, 17)],
    "linear": [f"linear:levels={k}" for k in (3, 5, 9, 16, 17)],
    "eden": [f"eden:bits={b}" for b in (0.5, 0.537, 1, 1.037, 2, 2.037, 3, 3.037, 4, 4.037, 5)],
    "ecdq": [f"ecdq:bits={b}" for b in _ECDQ_BITS],
    "ecdq-z": [f"ecdq:bits={b},lattice=z" for b in _ECDQ_BITS],
    # Below one bit: a shared-seed subsample of 65% of the coordinates (the best fraction at 0.5 bits,
    # benchmarks.sub_bit_frontier), at b / 0.65 bits per kept coordinate.
    "ecdq-keep": [f"ecdq:bits={b},keep=0.65" for b in (0.45, 0.5, 0.53, 0.55, 0.56, 0.563)],
}
#: Rows measured on every source; the others only on Gaussian data.
EVERY_SOURCE = ("eden", "ecdq", "ecdq-z")
#: Rows whose best per rate is printed beside the best overall.
BESIDE = (*EVERY_SOURCE, "ecdq-keep")
#: Codecs that always rotate (their rht+ variant is the plain one).
ROTATING = ("eden", "ecdq")
FRONTIER_CODINGS = ("fixed", "entropy")
FRONTIER_SEEDS = (1, 2, 3)
#: Coordinates of the unbiasedness check: ECDQ's default lattice is E8 from there (Z below).
UNBIASED_SIZE = E8_MIN_NUMEL


def shannon_unbiased(bits: float) -> float:
    """Smallest vNMSE of an unbiased estimate at ``bits`` per coordinate of a Gaussian vector: 4^-b / (1 - 4^-b)."""
    return 4.0**-bits / (1.0 - 4.0**-bits)


def frontier_groups(rows: tuple[str, ...] | None = None) -> list[tuple[str, str, list[str]]]:
    """``(row, group, specs)``: each family row with each coding, without and with ``rht+`` (EDEN and ECDQ
    always rotate); ``rows`` limits the family rows."""
    from fedquant.codecs import codec_class

    groups = []
    for family, settings in FAMILY_SETTINGS.items():
        if rows is not None and family not in rows:
            continue
        name = settings[0].split(":")[0]
        codings = codec_class(name).params["coding"].choices
        for rotate in ("", "rht+"):
            if rotate and name in ROTATING:
                continue
            for coding in FRONTIER_CODINGS:
                if coding not in codings:
                    continue
                specs = []
                for spec in settings:
                    if name == "eden" and coding != "fixed" and not float(spec.split("=")[1]).is_integer():
                        continue  # EDEN's fractional rates are fixed-width only
                    specs.append(f"{rotate}{spec}{',' if ':' in spec else ':'}coding={coding}")
                groups.append((family, f"{rotate}{family} {coding}", specs))
    return groups


def measure_tensors(codec, xs: list[torch.Tensor], seed: int) -> tuple[float, float]:
    """``(bits per coordinate from payload bytes, vNMSE)`` over tensors ``xs``, each with its own seed."""
    nbytes = numel = 0
    err = energy = 0.0
    for i, x in enumerate(xs):
        payload = codec.encode(x, seed=seed + 1000 * i)
        y = codec.decode(payload, seed=seed + 1000 * i, side_info=side_info_for(codec, x), shape=x.shape)
        nbytes += len(payload)
        numel += x.numel()
        err += float((y.double() - x.double()).square().sum())
        energy += float(x.double().square().sum())
    return 8.0 * nbytes / numel, err / energy


def unbiased_by_averaging(codec, x: torch.Tensor, trials: int) -> tuple[bool, float, float]:
    """Average ``trials`` seeded decodes of ``x``.

    Unbiased if ``||mean - x||^2 <= 3 E||x_hat - x||^2 / T`` (the mean's own variance term).

    Returns ``(ok, ||mean - x||^2 / ||x||^2, the variance term / ||x||^2)``.
    """
    n = x.numel()
    total = torch.zeros(n, dtype=torch.float64)
    sq = 0.0
    for seed in range(trials):
        y = codec.decode(codec.encode(x, seed=seed), seed=seed, side_info=side_info_for(codec, x)).double()
        total += y
        sq += float((y - x.double()).square().sum())
    energy = float(x.double().square().sum())
    mean_err = float((total / trials - x.double()).square().sum()) / energy
    variance_term = sq / trials**2 / energy
    return mean_err <= 3 * variance_term, mean_err, variance_term


Best = dict[float, tuple[str, float, float]]


def frontier_table(
    xs: list[torch.Tensor], seed: int, title: str, rows: tuple[str, ...] | None = None
) -> tuple[Best, dict[str, Best]]:
    """Measure the frontier settings on ``xs`` and print the best unbiased one per group and rate.

    Returns the best overall per rate, ``{b: (spec, bits, vnmse)}``, and the same per family row.
    """
    groups = frontier_groups(rows)
    results: dict[str, tuple[float, float] | str] = {}
    for _, _, specs in groups:
        for spec in specs:
            setting = build(spec)
            if setting.codec is None:
                results[spec] = setting.reason
            elif not setting.codec.unbiased:
                results[spec] = "biased"
            else:
                results[spec] = measure_tensors(setting.codec, xs, seed)
    n = sum(x.numel() for x in xs)
    print(
        f"\n== frontier, {title}: {n:,} coordinates; best unbiased vNMSE @ bits/coordinate (payload bytes) "
        f"with bits <= b + {HEADER_SLACK}"
    )
    widths = [22] + [16] * len(FRONTIER_BITS)
    print(row(["family"] + [f"b = {b:g}" for b in FRONTIER_BITS], widths))
    best: Best = {}
    per_row: dict[str, Best] = {}
    for family, group, specs in groups:
        measured = {s: r for s, r in results.items() if s in specs and isinstance(r, tuple)}
        if not measured:
            reasons = {r for s, r in results.items() if s in specs}
            print(row([group, "; ".join(sorted(reasons))[:80]], [widths[0], 0]))
            continue
        cells = [group]
        for b in FRONTIER_BITS:
            fits = [(v, bits, s) for s, (bits, v) in measured.items() if bits <= b + HEADER_SLACK]
            if not fits:
                cells.append("-")
                continue
            v, bits, s = min(fits)
            cells.append(f"{v:.4g} @{bits:.3f}")
            for table in (best, per_row.setdefault(family, {})):
                if b not in table or v < table[b][2]:
                    table[b] = (s, bits, v)
        print(row(cells, widths))
    return best, per_row


def print_best(best: Best, beside: dict[str, Best] | None = None) -> None:
    """Per rate: the best setting, its ratio to EDEN's published figure and to the Shannon bound at the
    rate it sends, and the best of each row in ``beside`` (name -> best per rate)."""
    beside = beside or {}
    widths = [5, 44, 7, 9, 10, 9, 9, 9] + [30] * len(beside)
    head = ["b", "best unbiased setting", "bits", "vNMSE", "EDEN pub.", "x EDEN", "Shannon@bits", "x Shannon"]
    print(row(head + [f"best {name}" for name in beside], widths))
    for b in FRONTIER_BITS:
        if b not in best:
            print(row([f"{b:g}", "none within the rate"], [widths[0], 0]))
            continue
        spec, bits, v = best[b]
        pub = EDEN_PUBLISHED.get(b)
        bound = shannon_unbiased(bits)  # at the rate the setting sends, not the nominal b
        cells = [f"{b:g}", spec, f"{bits:.3f}", f"{v:.4g}", f"{pub:g}" if pub else "-"]
        cells += [f"{v / pub:.3f}" if pub else "-", f"{bound:.4g}", f"{v / bound:.2f}"]
        for rows in beside.values():
            cells.append(f"{rows[b][2]:.4g} @{rows[b][1]:.3f}" if b in rows else "-")
        print(row(cells, widths))


def seed_spread(spec: str, source: str, n: int) -> tuple[float, float, float]:
    """``(mean vNMSE, spread max - min, mean bits)`` of ``spec`` over ``FRONTIER_SEEDS`` (codec seed and
    data draw both change). The budget holds on the mean: the search picks settings on one seed, and an
    entropy-coded size moves by about 0.1 % between seeds, so a setting at the budget's edge may cross it
    by 0.001 bits on another."""
    codec = build(spec).codec
    points = [measure_tensors(codec, [make_source(source, n, None, data_seed=2024 + s)], s) for s in FRONTIER_SEEDS]
    errs = [v for _, v in points]
    return float(np.mean(errs)), max(errs) - min(errs), float(np.mean([bits for bits, _ in points]))


def real_updates(rounds: int, clients: int) -> list[torch.Tensor]:
    """Client updates of the digits MLP's hidden weight matrices (``benchmarks.real_update_pairs``)."""
    from benchmarks.real_update_pairs import collect_pairs

    by_round, _, _ = collect_pairs(rounds=rounds, clients=clients)
    return [x for pairs in by_round for x, _ in pairs]


def check_source(
    source: str, n: int, per_row: dict[str, Best], check_trials: int, failures: list[str]
) -> dict[float, dict[str, tuple[float, float, float]]]:
    """ECDQ against EDEN on one source, over ``FRONTIER_SEEDS``, and the Gaussian targets; then each rate's
    best ECDQ setting checked unbiased. Returns ``{b: {row: (mean vNMSE, spread, bits)}}``."""
    spreads: dict[float, dict[str, tuple[float, float, float]]] = {}
    print(f"\n-- {source}: ECDQ and EDEN over seeds {FRONTIER_SEEDS} (codec seed and data draw), mean and spread")
    widths = [5, 12, 44, 10, 10, 8]
    print(row(["b", "row", "setting", "vNMSE", "spread", "mean bits"], widths))
    for b in FRONTIER_BITS:
        for name in EVERY_SOURCE:
            if b not in per_row.get(name, {}):
                continue
            spec = per_row[name][b][0]
            mean, spread, bits = seed_spread(spec, source, n)
            spreads.setdefault(b, {})[name] = (mean, spread, bits)
            print(row([f"{b:g}", name, spec, f"{mean:.4g}", f"{spread:.2g}", f"{bits:.3f}"], widths))
    for b in BEAT_EDEN_BITS:
        got = spreads.get(b, {})
        if "ecdq" not in got or "eden" not in got:
            failures.append(f"{source}, b = {b:g}: no ECDQ or EDEN setting within {b + HEADER_SLACK:.2f} bits")
            continue
        (ecdq_mean, ecdq_spread, ecdq_bits), (eden_mean, eden_spread, _) = got["ecdq"], got["eden"]
        if not ecdq_mean + ecdq_spread < eden_mean - eden_spread:
            failures.append(f"{source}, b = {b:g}: ECDQ {ecdq_mean:.4g} is not below EDEN {eden_mean:.4g}")
        if ecdq_bits > b + HEADER_SLACK:
            failures.append(f"{source}, b = {b:g}: ECDQ took {ecdq_bits:.3f} bits on average over the seeds")
        target = GAUSSIAN_TARGETS.get(b)
        if source == "gaussian" and target is not None and ecdq_mean + ecdq_spread > target:
            failures.append(f"gaussian, b = {b:g}: ECDQ {ecdq_mean:.4g} (+{ecdq_spread:.2g}) above the target {target}")
    if check_trials:
        print(
            f"\n-- unbiasedness of each rate's best ECDQ setting on {source}: mean of {check_trials} seeded decodes "
            f"of {UNBIASED_SIZE:,} coordinates (pass: ||mean - x||^2 <= 3 x variance term)"
        )
        x = make_source(source, UNBIASED_SIZE, None, data_seed=77)
        checked = set()  # the subsample row's best below b + slack is often one spec for every b
        for b, name in [(b, name) for name in ("ecdq", "ecdq-keep") for b in FRONTIER_BITS]:
            if b not in per_row.get(name, {}) or per_row[name][b][0] in checked:
                continue
            spec = per_row[name][b][0]
            checked.add(spec)
            ok, mean_err, var = unbiased_by_averaging(build(spec).codec, x, check_trials)
            print(
                f"   b = {b:g}: {spec:44s} ||mean - x||^2/||x||^2 = {mean_err:.3g}, variance term {var:.3g}"
                f" {'ok' if ok else 'BIASED'}"
            )
            if not ok:
                failures.append(f"{spec} on {source}: the mean of {check_trials} decodes is off by {mean_err:.3g}")
    return spreads


def run_frontier(n: int, seed: int, check_trials: int, real: bool, failures: list[str]) -> None:
    """The frontier on Gaussian (every family), Laplace and Student-t(3) data (EDEN and ECDQ) with its
    targets, and every family on real model updates."""
    for source in FRONTIER_SOURCES:
        x = make_source(source, n, None)
        rows = None if source == "gaussian" else EVERY_SOURCE
        best, per_row = frontier_table([x], seed, f"{source} d = {n:,}", rows)
        print(
            f"\n-- best per rate on {source}; targets: ECDQ strictly below EDEN at b = 1..4"
            + (", and vNMSE <= 0.50 / 0.100 / 0.0238 / 0.0059" if source == "gaussian" else "")
            + f" with bits <= b + {HEADER_SLACK}"
        )
        print_best(best, {name: per_row[name] for name in BESIDE if name in per_row})
        check_source(source, n, per_row, check_trials, failures)
    if real:
        xs = real_updates(rounds=3, clients=6)
        best_real, per_row = frontier_table(xs, seed, f"real updates ({len(xs)} digits-MLP hidden-weight updates)")
        print("\n-- best per rate on real updates (no target; envelope ~60 bytes per 8192-element tensor)")
        print_best(best_real, {name: per_row[name] for name in BESIDE if name in per_row})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", help="comma-separated codec names or specs (default: all)")
    ap.add_argument("--size", type=int, default=1_000_000, help="elements per synthetic tensor")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--update", help="a real model update (.npy, or a torch.save'd tensor or state dict)")
    ap.add_argument("--quick", action="store_true", help="100k elements, 2 seeds; frontier on 2^16, 40 trials")
    ap.add_argument("--only", choices=("table", "frontier"), help="print one section (default both)")
    ap.add_argument("--frontier-size", type=int, default=1 << 20, help="Gaussian elements of the frontier")
    ap.add_argument("--no-real", action="store_true", help="skip the frontier on real model updates")
    args = ap.parse_args(argv)
    failures: list[str] = []
    if args.only != "table":
        size = 1 << 16 if args.quick else args.frontier_size
        run_frontier(size, seed=1, check_trials=40 if args.quick else 100, real=not args.no_real, failures=failures)
        if args.only == "frontier":
            return report(failures, "frontier targets met")
    n = 100_000 if args.quick else args.size
    seeds = list(range(1, (2 if args.quick else args.seeds) + 1))
    only = parse_codec_list(args.codecs)
    groups = settings_by_group(only)
    built = {spec: build(spec) for _, rows in groups for spec in rows}
    sources = ["gaussian", "laplace"] + (["update"] if args.update else [])
    widths = [36, 10, 10, 8, 10]
    print(f"rate/distortion: {len(seeds)} seeds; registered codecs: {', '.join(available_codecs())}")
    for source in sources:
        x = make_source(source, n, args.update)
        print(f"\n== {source}: {x.numel():,} elements")
        print(row(["setting", "bits/param", "nmse", "H bits", "bound"], widths))
        for title, rows in groups:
            print(f"-- {title}")
            for spec in rows:
                setting = built[spec]
                if setting.codec is None:
                    print(row([spec, setting.reason], [widths[0], 0]))
                    continue
                print(row(measure(setting, x, seeds, failures, source), widths))
    if not args.update:
        print("\n(real model updates in this table: pass --update FILE)")
    return report(
        failures, "all checks passed (QSGD under its bound, fixed-width sizes exact, entropy coding within 5%)"
    )


def report(failures: list[str], success: str) -> int:
    print()
    if failures:
        print("CHECKS FAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print(success)
    return 0


if __name__ == "__main__":
    sys.exit(main())
