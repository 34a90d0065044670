"""QSGD (Alistarh et al., NeurIPS 2017): unbiased stochastic rounding to ``s`` levels per sign.

Each bucket ``v`` of ``bucket_size`` elements is sent as one float32 scale ``m`` (``max |v_i|``
with ``norm="max"``, the paper's practical variant, or ``||v||_2`` with ``norm="l2"``, the
quantizer ``Q_s`` of the theory) and one signed level ``q_i`` in ``{-s..s}`` per element, drawn
so that ``E[q_i m / s] = v_i``: with ``a = |v_i| s / m``, ``|q_i|`` is ``floor(a) + 1`` with
probability ``a - floor(a)`` and ``floor(a)`` otherwise.

Error: ``E||Q(v) - v||^2 = (m / s)^2 sum_i p_i (1 - p_i)``, which for ``norm="l2"`` is at most
``min(d / s^2, sqrt(d) / s) ||v||^2`` (Lemma 3.1).

Defaults: ``levels=16`` (what the paper's arithmetic calls "4-bit": ``sqrt(512) / 2**4``),
``bucket_size=512`` and ``norm="max"`` (the setting of the paper's experiments),
``coding="fixed"``. The index stream is coded as

* ``"fixed"``: ``q + s`` at ``bit_width(2s + 1)`` bits (s=1: 2 bits, s=7: 4, s=16: 6, s=127: 8);
* ``"elias"``: the paper's Code_s (Elias-coded gaps between nonzeros, sign, Elias level) or its
  dense variant Code'_s, whichever is shorter for this tensor (one byte says which);
* ``"entropy"``: a static entropy coder over the ``2s + 1`` symbols.

Scales are float32 in every case. ``bucket_size=0`` quantizes the whole tensor as one bucket.
"""

from __future__ import annotations

from fedquant.codecs.grid import ScaledGridCodec
from fedquant.codecs.index_coding import coder_available
from fedquant.codecs.params import Param


class QSGDCodec(ScaledGridCodec):
    """QSGD's quantizer Q_s with bucketing, max or L2 scaling and fixed/Elias/entropy coding."""

    name = "qsgd"
    params = {
        "levels": Param(int, 16, "s: nonzero magnitude levels per sign", minimum=1, maximum=32767),
        "bucket_size": Param(int, 512, "elements per bucket with its own scale; 0 = whole tensor", minimum=0),
        "norm": Param(str, "max", "bucket scale: max |v| (practice) or the L2 norm (theory)", choices=("max", "l2")),
        "coding": Param(
            str,
            "fixed",
            "index stream: fixed width, Elias Code_s, or entropy coded",
            choices=("fixed", "elias", "entropy"),
        ),
    }
    unbiased = True
    paper = "Alistarh et al. 2017, QSGD"
    wire = "float32 scale per bucket + signed level per element (fixed width, Elias Code_s or entropy coded)"

    def _validate(self) -> None:
        if not coder_available(self.coding):
            raise ValueError(f"qsgd: coding '{self.coding}' is not available in this installation")

    def _grid(self) -> tuple[int, str]:
        return self.levels, self.norm
