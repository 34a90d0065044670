"""NDQSG's two-group scheme (Abdi & Fekri 2019, Algorithm 2) as a :class:`DecodePlan`.

Each round the sampled clients are split into group P1, which sends DQSG (dithered
quantization at ``levels = M``), and group P2, which sends NDQSG (nested dithered quantization:
only the fine bin's position inside its coarse bin, ``log2(rho)`` bits instead of
``log2(2M+1)``). The server decodes P1 first; each P2 reply is then decoded against the running
mean of every update decoded before it in the round (P1's mean for the first, as the authors'
``AggregationNode`` does), which resolves the nested ambiguity.

``rho`` must reach the clients in ``configure_train``, before the round's replies exist. It is
chosen from the spread ``sigma_z / Delta1`` of the previous round's decoded P1 updates
(:func:`~fedquant.codecs.nested_params.spread_in_steps`, times a 1.1 margin since it came out
5-8 % low in a synthetic check) so that wrap-arounds add at most ``max_excess`` (1 %) to the
MSE, by two criteria, the larger ``rho`` wins:

* Gaussian ``z``: :func:`~fedquant.codecs.nested_params.choose_rho_for_variance` on the spread
  (not §5.5's fixed ``k = 3`` margin, which lets the MSE grow by up to ~45 % when ``sigma_z``
  nears ``Delta1``);
* the empirical tail: real client updates are heavy-tailed (on the digits MLP of
  ``benchmarks/real_update_pairs.py`` wraps were 10^3-10^4 times more frequent than the
  Gaussian model predicts at the same spread), so the plan also keeps a histogram of P1's
  leave-one-out differences in fine steps (:func:`empirical_rho`) and requires the wrap excess
  computed from it to stay under the same bound. These differences include the P1 client's own
  quantization noise, so on Gaussian spreads this criterion asks for the same ``rho`` or one odd
  step more.

What to expect: the bits saved depend on the spread. On synthetic ``y + z`` updates with
``sigma_z`` well under ``Delta1`` the plan settles on ``rho = 3`` (2-bit indices against DQSG's
3 at ``M = 3``) at DQSG's error. On real client updates of a small MLP (digits, 10 clients,
``python -m benchmarks.nested_rate_distortion --real``) the spread was 0.3-0.7 fine steps at
``M = 3`` with heavy tails, and keeping DQSG's error needed ``rho`` 7-23: as many or more bits
than DQSG (``ndqsg-rho`` and ``bits-per-param-p1/-p2`` in the metrics show it per round).

Usage: pass an ``ndqsg`` codec to :class:`~fedquant.strategies.QuantizedStrategy` and this plan
is used by default (``rho`` adapts unless the spec names it; ``alpha`` comes from the spec)::

    QuantizedStrategy(FedAvg(), codec="ndqsg:levels=3")
    QuantizedStrategy(FedAvg(), codec="ndqsg:levels=3",
                      decode_plan=NestedDecodePlan(p1_fraction=0.25, rho=None, alpha="auto"))

Metrics added to each round's train MetricRecord (all numbers):

=========================  ============================================================
``ndqsg-rho``              the P2 clients' ``rho`` this round
``ndqsg-alpha``            their ``alpha``
``ndqsg-rho-rule``         how ``rho`` was chosen: 0 fixed by the user, 1 the initial
                           default (no estimate yet), 2 from the estimated spread
``ndqsg-spread``           ``sigma_z / Delta1`` estimated from this round's decoded P1
                           updates (used for the next round; absent with < 2 of them)
``ndqsg-p1-decoded``       P1 replies decoded
``ndqsg-p1-failed``        1 when P1 clients were sampled but none was decoded, else 0
``ndqsg-p2-dropped``       P2 replies dropped because nothing had been decoded before them
``ndqsg-p2-nested``        1 when P2 sent nested indices, 0 when the adaptive ``rho`` reached
                           ``2M + 1`` and P2 sent DQSG instead (nesting would save nothing)
``bits-per-param-p1``      ``8 * bytes / parameters`` over the accepted replies of P1
``bits-per-param-p2``      the same for P2 (0.0 for a group without accepted replies)
=========================  ============================================================

Fallback when no P1 reply is decoded (all failed, were rejected or did not arrive): P2
replies are dropped, counted in ``rejected-replies`` and ``ndqsg-p2-dropped``, logged, and
``ndqsg-p1-failed`` is 1. A nested payload only says where each value sits inside its coarse
cell; without an estimate of the update from this round the decoder would pick the cell of
zeros (or of an older mean, taken at another model), and every coordinate further than
``Delta2 / 2`` from it would come back off by a multiple of ``Delta2``: an error of the size of
the update itself, silently added to the model. Dropping them is the one safe choice; the
round then aggregates what decoded (nothing, so the inner strategy keeps the current model,
as for any round without a surviving reply). When some P1 replies decode, P2 is decoded
against their mean as usual.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.supercore import log

from fedquant.codecs import Codec, get_codec
from fedquant.codecs.nested_params import (
    choose_rho_for_variance,
    leave_one_out_steps,
    optimal_alpha,
    spread_in_steps,
)
from fedquant.codecs.params import parse_spec
from fedquant.codecs.quantizers.dither import MAX_RHO
from fedquant.rng import derive_seed
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient, DecodePlan, SideInformation
from fedquant.strategies.protocol import KEY_ROLE

ROLE_P1 = "p1"
ROLE_P2 = "p2"

METRIC_RHO = "ndqsg-rho"
METRIC_ALPHA = "ndqsg-alpha"
METRIC_RHO_RULE = "ndqsg-rho-rule"
METRIC_SPREAD = "ndqsg-spread"
METRIC_P1_DECODED = "ndqsg-p1-decoded"
METRIC_P1_FAILED = "ndqsg-p1-failed"
METRIC_P2_DROPPED = "ndqsg-p2-dropped"
METRIC_P2_NESTED = "ndqsg-p2-nested"
METRIC_BITS_P1 = "bits-per-param-p1"
METRIC_BITS_P2 = "bits-per-param-p2"

RULE_FIXED, RULE_INITIAL, RULE_ESTIMATED = 0, 1, 2
RULE_NAMES = {RULE_FIXED: "fixed", RULE_INITIAL: "initial default", RULE_ESTIMATED: "estimated spread"}

# Histogram of |z| / Delta1 for the empirical wrap criterion: bins of 1/64 fine step up to 256
# steps (larger values land in the last bin, which only makes rho larger).
TAIL_BIN = 1.0 / 64
TAIL_MAX = 256.0

# spread_in_steps came out 5-8 % below the nested clients' real spread in a synthetic check
# (decoded maxima, hence steps, are a little larger than the raw ones).
SPREAD_MARGIN = 1.1
LOG_PREFIX = "NestedDecodePlan"


@dataclass
class _RoundState:
    rho: int
    alpha: float
    rule: int
    p1_nodes: int
    levels: int
    bucket_size: int
    p1_updates: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    p1_decoded: int = 0
    p2_dropped: int = 0
    p2_nested: bool = True
    group_bytes: dict[str, int] = field(default_factory=lambda: {ROLE_P1: 0, ROLE_P2: 0})
    group_params: dict[str, int] = field(default_factory=lambda: {ROLE_P1: 0, ROLE_P2: 0})


def _role(assignment: ClientAssignment) -> str | None:
    return assignment.config.get(KEY_ROLE)  # type: ignore[return-value]


class NestedDecodePlan(DecodePlan):
    """Two groups per round: P1 sends DQSG, P2 sends NDQSG decoded against the running mean.

    Parameters
    ----------
    p1_fraction : float
        Fraction of the sampled clients in P1, in (0, 1]; ``round(p1_fraction * n)`` clients, at
        least one (P1 provides the side information). Default 0.5 (the authors' ratio).
    rho : int, optional
        Fixed odd ``rho >= 3`` for P2. None (default): chosen each round from the spread of the
        previous round's decoded P1 updates (see the module docstring), ``initial_rho`` until
        an estimate exists (round 1, or while fewer than 2 P1 updates were ever decoded).
    alpha : float or "auto"
        P2's shrinkage in (0, 1]. Default 1.0: conditionally unbiased, the same error variance
        as DQSG. ``"auto"`` uses :func:`~fedquant.codecs.nested_params.optimal_alpha` on the
        estimated spread (1.0 until there is one); it lowers the MSE but biases each P2
        update towards the mean, and collapses towards 0 (P2 contributing nothing of its own)
        when the spread is small.
    initial_rho : int, optional
        ``rho`` before any estimate; default ``2M + 1`` with ``M`` the codec's ``levels``: the
        coarse cell then spans ``(2M+1) Delta1 = 2 kappa + Delta1``, so decoding is correct while
        side information and update differ by less than the client's bucket maximum ``kappa``,
        and the fixed-width payload is as large as DQSG's (no saving). Not risk-free: on the
        digits MLP of ``benchmarks/real_update_pairs.py`` (M = 3) 1e-5 (IID) to 1e-3 (label
        skew) of the coordinates wrapped in round 1, adding 0.2 % and 7.6 % to the MSE.
    max_excess : float
        Largest expected share of MSE added by wrap-arounds (``choose_rho_for_variance``),
        default 0.01.
    seed : int
        Base seed of the group split (``derive_seed(seed, round, "ndqsg-groups")``); the split
        depends only on it, the round and the set of sampled node ids.
    """

    def __init__(
        self,
        p1_fraction: float = 0.5,
        rho: int | None = None,
        alpha: float | str = 1.0,
        initial_rho: int | None = None,
        max_excess: float = 0.01,
        seed: int = 0,
    ) -> None:
        if not (isinstance(p1_fraction, (int, float)) and 0 < p1_fraction <= 1):
            raise ValueError(f"p1_fraction must be in (0, 1], got {p1_fraction!r}")
        for name, value in (("rho", rho), ("initial_rho", initial_rho)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 3 or value % 2 == 0 or value > MAX_RHO
            ):
                raise ValueError(f"{name} must be an odd int in [3, {MAX_RHO}] or None, got {value!r}")
        if alpha != "auto" and not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha <= 1):
            raise ValueError(f"alpha must be in (0, 1] or 'auto', got {alpha!r}")
        if not (isinstance(max_excess, (int, float)) and max_excess > 0):
            raise ValueError(f"max_excess must be > 0, got {max_excess!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.p1_fraction = float(p1_fraction)
        self.rho = rho
        self.alpha = alpha if alpha == "auto" else float(alpha)
        self.initial_rho = initial_rho
        self.max_excess = float(max_excess)
        self.seed = seed
        self.spread: float | None = None  # latest sigma_z / Delta1 estimate from P1 (without margin)
        self.tail: np.ndarray | None = None  # histogram of |z| / Delta1 behind it (see learn)
        self._rounds: dict[int, _RoundState] = {}

    @classmethod
    def from_spec(cls, spec: str, seed: int = 0) -> NestedDecodePlan:
        """The plan for an ``ndqsg`` spec: ``rho`` fixed only if the spec names it, ``alpha`` from the spec."""
        name, params = parse_spec(spec)
        codec = get_codec(spec)
        if codec.name != "ndqsg":
            raise ValueError(f"NestedDecodePlan needs an ndqsg codec spec, got {spec!r}")
        return cls(rho=codec.rho if "rho" in params else None, alpha=codec.alpha, seed=seed)

    def __repr__(self) -> str:
        rho = self.rho if self.rho is not None else "adaptive"
        return f"NestedDecodePlan(p1_fraction={self.p1_fraction}, rho={rho}, alpha={self.alpha})"

    # ------------------------------------------------------------------ configure_train
    def groups(self, server_round: int, node_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The round's P1 and P2 node ids (deterministic in seed, round and the order of ``node_ids``).

        Taken in the inner strategy's order, not sorted by node id: node ids are random in every
        simulation, while a strategy that samples by a stable key (the simulation app's
        partition order) then gives the same groups in every run.
        """
        nodes = list(node_ids)
        if not nodes:
            return [], []
        n1 = min(len(nodes), max(1, round(self.p1_fraction * len(nodes))))
        order = np.random.default_rng(derive_seed(self.seed, server_round, "ndqsg-groups")).permutation(len(nodes))
        p1 = [nodes[i] for i in sorted(order[:n1])]
        chosen = set(p1)
        return p1, [n for n in nodes if n not in chosen]

    def parameters(self, levels: int) -> tuple[int, float, int]:
        """``(rho, alpha, rule)`` for the next round, from the fixed values or the latest estimate."""
        spread = None if self.spread is None else SPREAD_MARGIN * self.spread
        if self.alpha == "auto":
            alpha = optimal_alpha(spread, 1.0) if spread is not None else 1.0
        else:
            alpha = self.alpha
        alpha = round(alpha, 6)  # the spec carries it as text: client and server must agree exactly
        if self.rho is not None:
            return self.rho, alpha, RULE_FIXED
        if spread is None:
            return (self.initial_rho or 2 * levels + 1), alpha, RULE_INITIAL
        rho = choose_rho_for_variance(spread, 1.0, alpha, self.max_excess, MAX_RHO)
        if self.tail is not None:
            rho = max(rho, empirical_rho(self.tail, spread, alpha, self.max_excess))
        return rho, alpha, RULE_ESTIMATED

    def learn(self, p1_updates: Mapping[str, Sequence[torch.Tensor]], levels: int, bucket_size: int) -> float | None:
        """Update the spread estimate (and tail histogram) from one round's decoded P1 updates, per tensor.

        Keeps the previous estimate when no tensor has at least 2 updates. Returns the new
        spread ``sigma_z / Delta1`` (the largest over tensors: one ``rho`` serves them all), or None.
        """
        spreads, tail = [], np.zeros(int(TAIL_MAX / TAIL_BIN), dtype=np.int64)
        for updates in p1_updates.values():
            if len(updates) < 2 or updates[0].numel() == 0:
                continue
            d = bucket_size or updates[0].numel()
            spread = spread_in_steps(list(updates), levels, d, dqsg_levels=levels)
            ratios = _loo_ratios(updates, levels, d)
            if not math.isfinite(spread) or ratios.size == 0:
                continue
            spreads.append(spread)
            tail += np.bincount(np.minimum(ratios / TAIL_BIN, tail.size - 1).astype(np.int64), minlength=tail.size)
        if not spreads:
            return None
        self.spread, self.tail = max(spreads), tail
        return self.spread

    def assign(self, server_round: int, node_ids: Sequence[int], codec: Codec) -> dict[int, ClientAssignment]:
        """P1 gets ``dqsg`` (rank 0, role ``p1``), P2 ``ndqsg`` with the round's ``rho``/``alpha`` (rank 1, ``p2``).

        When ``rho`` is not fixed by the user and comes out at ``2M + 1`` or more, nesting cannot
        save anything: the coset index needs at least DQSG's index width (for ``|q1| <= M`` it *is*
        the DQSG index) and only adds wrap-around risk. P2 then sends DQSG too (decoded without side
        information) and ``ndqsg-p2-nested`` is 0 for the round.
        """
        if codec.name != "ndqsg":
            raise ValueError(f"{LOG_PREFIX} needs the strategy's codec to be ndqsg, got {codec.spec!r}")
        p1, p2 = self.groups(server_round, node_ids)
        rho, alpha, rule = self.parameters(codec.levels)
        shared = {"levels": codec.levels, "bucket_size": codec.bucket_size, "coding": codec.coding}
        dqsg = get_codec("dqsg", **shared)
        nested = rule == RULE_FIXED or rho < 2 * codec.levels + 1
        ndqsg = get_codec("ndqsg", rho=rho, alpha=alpha, **shared) if nested else dqsg
        state = _RoundState(rho, alpha, rule, len(p1), codec.levels, codec.bucket_size, p2_nested=nested)
        self._rounds[server_round] = state
        spread = "none yet" if self.spread is None else f"{self.spread:.3g} (x{SPREAD_MARGIN} margin)"
        log(
            INFO,
            "%s: round %s: %d clients P1 (%s), %d P2 (%s); rho from %s, spread %s",
            LOG_PREFIX, server_round, len(p1), dqsg.spec, len(p2), ndqsg.spec, RULE_NAMES[rule], spread,
        )  # fmt: skip
        out = {n: ClientAssignment(dqsg, {KEY_ROLE: ROLE_P1}, rank=0) for n in p1}
        out.update({n: ClientAssignment(ndqsg, {KEY_ROLE: ROLE_P2}, rank=1) for n in p2})
        return out

    # ------------------------------------------------------------------ aggregate_train
    def admit(self, server_round: int, node_id: int, assignment: ClientAssignment, side: SideInformation) -> str | None:
        """Drop a nested (P2) reply when nothing was decoded before it (see the module's fallback note)."""
        if not assignment.codec.needs_side_info or side.replies > 0:
            return None
        state = self._rounds.get(server_round)
        if state is not None:
            state.p2_dropped += 1
        return (
            "no P1 reply was decoded this round, so there is no side information to decode its nested "
            "payload against (NDQSG fallback: P2 replies are dropped)"
        )

    def accepted(self, server_round: int, reply: DecodedClient) -> None:
        """Count the group's bytes; keep P1's decoded updates for the next round's spread estimate."""
        state = self._rounds.get(server_round)
        role = _role(reply.assignment)
        if state is None or role not in (ROLE_P1, ROLE_P2):
            return
        state.group_bytes[role] += reply.reply_bytes
        state.group_params[role] += reply.num_params
        if role == ROLE_P1:
            state.p1_decoded += 1
            for name, update in reply.updates.items():
                state.p1_updates.setdefault(name, []).append(update)

    def round_metrics(self, server_round: int) -> dict[str, int | float]:
        """The round's NDQSG metrics; updates the spread estimate from this round's P1 updates."""
        state = self._rounds.pop(server_round, None)
        if state is None:
            return {}
        for old in [r for r in self._rounds if r < server_round]:  # rounds configured but never aggregated
            del self._rounds[old]
        metrics: dict[str, int | float] = {
            METRIC_RHO: state.rho,
            METRIC_ALPHA: state.alpha,
            METRIC_RHO_RULE: state.rule,
            METRIC_P1_DECODED: state.p1_decoded,
            METRIC_P1_FAILED: int(state.p1_nodes > 0 and state.p1_decoded == 0),
            METRIC_P2_DROPPED: state.p2_dropped,
            METRIC_P2_NESTED: int(state.p2_nested),
        }
        for role, key in ((ROLE_P1, METRIC_BITS_P1), (ROLE_P2, METRIC_BITS_P2)):
            params = state.group_params[role]
            metrics[key] = 8.0 * state.group_bytes[role] / params if params else 0.0
        spread = self.learn(state.p1_updates, state.levels, state.bucket_size)
        if spread is not None:
            metrics[METRIC_SPREAD] = spread
        if metrics[METRIC_P1_FAILED]:
            log(
                WARNING,
                "%s: round %s: no P1 reply decoded; dropped %d P2 replies (no side information)",
                LOG_PREFIX, server_round, state.p2_dropped,
            )  # fmt: skip
        return metrics


def _loo_ratios(updates: Sequence[torch.Tensor], levels: int, bucket_size: int) -> np.ndarray:
    """``|g_p - mean of the others| / Delta1`` per coordinate (as ``spread_in_steps`` forms them), flat."""
    return leave_one_out_steps(updates, levels, bucket_size).abs().numpy()


def empirical_rho(
    tail: np.ndarray, spread: float, alpha: float = 1.0, max_excess: float = 0.01, scale: float = 1.0
) -> int:
    """Smallest odd ``rho >= 3`` whose wrap excess, from a histogram of ``|z| / Delta1``, is within bound.

    For a coordinate with ``|z| = r Delta1`` the decoder wraps with probability
    ``clip(alpha r + 1/2 - rho/2, 0, 1)`` (the fine rounding error is uniform on ``[-1/2, 1/2]``)
    and then errs by about ``alpha rho Delta1``. The rule keeps the mean of
    ``P(wrap) (alpha rho)**2`` over the histogram (bins of ``TAIL_BIN`` from 0, counts) under
    ``max_excess`` times the MSE without wrap, ``(1 - alpha**2)**2 spread**2 + alpha**2 / 12``.
    ``scale`` multiplies every ``r`` (the plan's safety margin; ``spread`` should include it).

    Returns
    -------
    int
        Odd ``rho``; at most the first odd value beyond every non-empty bin (where no wrap is left).
    """
    total = int(tail.sum())
    if total == 0:
        return 3
    centers = (np.arange(tail.size) + 0.5) * TAIL_BIN * scale
    weights = tail / total
    bound = max_excess * ((1 - alpha**2) ** 2 * spread**2 + alpha**2 / 12)
    largest = float(centers[np.nonzero(tail)[0][-1]])
    last = min(MAX_RHO, 2 * math.ceil(alpha * largest + 1) + 1)
    for rho in range(3, last + 1, 2):
        wrap = np.clip(alpha * centers + 0.5 - rho / 2, 0.0, 1.0)
        if float(weights @ wrap) * (alpha * rho) ** 2 <= bound:
            return rho
    return last
