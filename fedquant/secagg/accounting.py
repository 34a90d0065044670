"""(epsilon, delta) of distributed discrete Gaussian noise, per round and over rounds.

Each of the ``n`` surviving clients adds ``N_Z(0, sigma^2)`` noise per coordinate to its integer
vector, so the secure sum carries the sum of their noises. Kairouz, Liu and Steinke (ICML 2021,
"The Distributed Discrete Gaussian Mechanism", Theorem 1) bound its Renyi divergence for an
integer input change of L2 norm at most ``Delta`` in ``d`` coordinates by ``alpha * eps^2 / 2``:

    eps = min( sqrt(Delta^2 / (n sigma^2) + tau d / 2),  Delta / (sqrt(n) sigma) + tau sqrt(d) ),
    tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)),

that is ``rho = eps^2 / 2`` zero-concentrated DP. fedquant accounts with the noise of the
*other* survivors only (``n - 1``: removing a client removes its noise too) and the sensitivity
of :meth:`~fedquant.codecs.summable.grid.SumGrid.l2_sensitivity`. Rounds compose in Google's
``dp-accounting`` (``ZCDpEvent`` in its RDP accountant, the library Flower's own
``RdpAccountant`` wraps), which also converts to ``(epsilon, delta)``. No amplification by
sampling is claimed: it does not follow from a zCDP bound alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fedquant.codecs.summable.grid import SumGrid


def ddg_rho(l2_sensitivity: float, variance: float, num_noisy: int, dim: int) -> float:
    """zCDP ``rho`` of the sum of ``num_noisy`` discrete Gaussians of parameter ``variance``."""
    if num_noisy < 1 or variance <= 0:
        return math.inf
    tau = 10.0 * sum(math.exp(-2.0 * math.pi**2 * variance * k / (k + 1)) for k in range(1, num_noisy))
    first = math.sqrt(l2_sensitivity**2 / (num_noisy * variance) + tau * dim / 2.0)
    second = l2_sensitivity / (math.sqrt(num_noisy) * math.sqrt(variance)) + tau * math.sqrt(dim)
    return min(first, second) ** 2 / 2.0


def _accountant():
    try:
        from dp_accounting import dp_event
        from dp_accounting.rdp import RdpAccountant
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError('distributed DP accounting needs dp-accounting: pip install "fedquant[dp]"') from err
    return dp_event, RdpAccountant()


@dataclass
class PrivacyLedger:
    """The privacy spent by a run's secure rounds.

    Parameters
    ----------
    delta : float
        The delta the epsilons are reported at.
    """

    delta: float
    rounds: list[float] = field(default_factory=list)  # rho per round

    def __post_init__(self) -> None:
        self._event, self._backend = _accountant()

    def record(self, grid: SumGrid, survivors: int) -> float:
        """Add one round (its grid and how many inputs were summed); returns the round's rho."""
        rho = ddg_rho(grid.l2_sensitivity(), grid.noise_variance, survivors - 1, grid.sent_numel)
        self.rounds.append(rho)
        if math.isfinite(rho):
            self._backend.compose(self._event.ZCDpEvent(rho))
        return rho

    def epsilon(self) -> float:
        """Cumulative epsilon at ``delta`` (inf once a round had no noise)."""
        if not self.rounds:
            return 0.0
        if not all(math.isfinite(r) for r in self.rounds):
            return math.inf
        return float(self._backend.get_epsilon(self.delta))

    def round_epsilon(self, rho: float) -> float:
        """Epsilon at ``delta`` of one round of zCDP ``rho`` on its own."""
        if not math.isfinite(rho):
            return math.inf
        event, backend = _accountant()
        backend.compose(event.ZCDpEvent(rho))
        return float(backend.get_epsilon(self.delta))
