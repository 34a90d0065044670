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

Usage::

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


def make_source(name: str, n: int, update: str | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2024)
    if name == "gaussian":
        return torch.randn(n, generator=gen)
    if name == "laplace":
        u = torch.rand(n, generator=gen, dtype=torch.float64) - 0.5
        return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", help="comma-separated codec names or specs (default: all)")
    ap.add_argument("--size", type=int, default=1_000_000, help="elements per synthetic tensor")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--update", help="a real model update (.npy, or a torch.save'd tensor or state dict)")
    ap.add_argument("--quick", action="store_true", help="100k elements, 2 seeds")
    args = ap.parse_args(argv)
    n = 100_000 if args.quick else args.size
    seeds = list(range(1, (2 if args.quick else args.seeds) + 1))
    only = parse_codec_list(args.codecs)
    groups = settings_by_group(only)
    built = {spec: build(spec) for _, rows in groups for spec in rows}
    sources = ["gaussian", "laplace"] + (["update"] if args.update else [])
    widths = [36, 10, 10, 8, 10]
    failures: list[str] = []
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
        print("\n(real model updates: pass --update FILE)")
    print()
    if failures:
        print("CHECKS FAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print("all checks passed (QSGD under its bound, fixed-width sizes exact, entropy coding within 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
