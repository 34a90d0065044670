"""NDQSG's two-group scheme (Abdi & Fekri 2019, Algorithm 2) as a side-information decode plan.

Each round the sampled clients split into group P1, which sends DQSG, and group P2, which sends
NDQSG (only the fine bin's position inside its coarse bin, ``log2(rho)`` bits instead of
``log2(2M+1)``). P1 is decoded first; each P2 reply is decoded against the running mean of the
updates accepted before it (:class:`~fedquant.strategies.side_info.SideInfoPlan`). ``rho`` is
chosen per tensor from the spread of the previous round's P1 updates
(:mod:`fedquant.strategies.nested_rules`); a tensor where nesting saves nothing goes as DQSG.
When no P1 reply decodes, P2 replies are dropped: without side information a nested payload
decodes to an error the size of the update. The rules, the metrics this plan adds (``ndqsg-*``,
``bits-per-param-p1/p2``) and measurements on real updates: ``docs/ndqsg.md``.

Usage: an ``ndqsg`` codec gets this plan by default (``rho`` adapts unless the spec names it)::

    QuantizedStrategy(FedAvg(), codec="ndqsg:levels=3,coding=entropy")
    QuantizedStrategy(FedAvg(), codec="ndqsg:levels=3",
                      decode_plan=NestedDecodePlan(p1_fraction=0.25, rho=None, alpha="auto"))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.supercore import log

from fedquant.codecs import Codec, get_codec
from fedquant.codecs.params import parse_pipeline
from fedquant.codecs.quantizers.dither import DQSGQuantizer, NDQSGQuantizer
from fedquant.protocol import DEFAULT_MIN_NUMEL, KEY_ROLE
from fedquant.rng import derive_seed
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient, default_plan_for
from fedquant.strategies.nested_rules import (
    AUTHORS_RHO,
    MAX_RHO,
    RULES,
    SpreadEstimate,
    choose_parameters,
    estimate_spread,
    nesting_saves_bits,
)
from fedquant.strategies.side_info import SideInfoPlan, needs_side_info

ROLE_P1 = "p1"
ROLE_P2 = "p2"

METRIC_RHO = "ndqsg-rho"
METRIC_RHO_MIN = "ndqsg-rho-min"
METRIC_RHO_MAX = "ndqsg-rho-max"
METRIC_ALPHA = "ndqsg-alpha"
METRIC_RHO_RULE = "ndqsg-rho-rule"
METRIC_SPREAD = "ndqsg-spread"
METRIC_NESTED_TENSORS = "ndqsg-nested-tensors"
METRIC_P1_DECODED = "ndqsg-p1-decoded"
METRIC_P1_FAILED = "ndqsg-p1-failed"
METRIC_P2_DROPPED = "ndqsg-p2-dropped"
METRIC_P2_NESTED = "ndqsg-p2-nested"
METRIC_BITS_P1 = "bits-per-param-p1"
METRIC_BITS_P2 = "bits-per-param-p2"

RULE_FIXED, RULE_INITIAL, RULE_ESTIMATED = 0, 1, 2
RULE_NAMES = {RULE_FIXED: "fixed", RULE_INITIAL: "initial default", RULE_ESTIMATED: "estimated spread per tensor"}

LOG_PREFIX = "NestedDecodePlan"


@dataclass
class _RoundState:
    rho: int
    alpha: float
    rule: int
    p1_nodes: int
    levels: int
    bucket_size: int
    tensor_rho: dict[str, int] = field(default_factory=dict)
    nested_tensors: int = 0
    p1_updates: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    p1_decoded: int = 0
    p2_dropped: int = 0
    p2_nested: bool = True
    group_bytes: dict[str, int] = field(default_factory=lambda: {ROLE_P1: 0, ROLE_P2: 0})
    group_params: dict[str, int] = field(default_factory=lambda: {ROLE_P1: 0, ROLE_P2: 0})


def _role(assignment: ClientAssignment) -> str | None:
    return assignment.config.get(KEY_ROLE)  # type: ignore[return-value]


@default_plan_for(NDQSGQuantizer)
class NestedDecodePlan(SideInfoPlan):
    """Two groups per round: P1 sends DQSG, P2 sends NDQSG decoded against the running mean.

    Parameters
    ----------
    p1_fraction : float
        Fraction of the sampled clients in P1, in (0, 1]; ``round(p1_fraction * n)`` clients, at
        least ``min_p1`` (P1 provides the side information). Default 0.5 (the authors' ratio).
    rho : int, optional
        Fixed odd ``rho >= 3`` for every P2 tensor. None (default): chosen per tensor each round
        from the spread of the previous round's decoded P1 updates of that tensor (see the module
        docstring); ``initial_rho`` for tensors without an estimate.
    alpha : float or "auto"
        P2's shrinkage in (0, 1]. Default 1.0: conditionally unbiased, the same error variance
        as DQSG. ``"auto"`` uses :func:`~fedquant.strategies.nested_rules.optimal_alpha`
        on each tensor's estimated spread (1.0 without one); it lowers the MSE but biases each P2
        update towards the mean, and collapses towards 0 (P2 contributing nothing of its own)
        when the spread is small.
    initial_rho : int, optional
        ``rho`` of tensors without an estimate; default ``2M + 1`` with ``M`` the codec's
        ``levels``, which sends them as DQSG (no saving, no wrap-around risk).
    max_excess : float
        Largest expected share of MSE added by wrap-arounds, default 0.01.
    seed : int
        Base seed of the group split (``derive_seed(seed, round, "ndqsg-groups")``); the split
        depends only on it, the round and the set of sampled node ids.
    min_numel : int
        Tensors with fewer elements get no ``rho`` of their own (default 1024): they neither set
        nor share another tensor's ``rho`` and go with ``initial_rho``.
    min_p1 : int
        Fewest P1 clients when the round has that many (default 3). P1's updates become the side
        information every P2 reply is decoded against, and P1's norms are judged by P1's own vote
        (with the previous round's admitted norms): with 2 members one attacker is half the vote
        and gets any update admitted. 3 is the smallest group a single attacker cannot outvote.
    rule : {"variance", "rate"}
        How each tensor's ``rho`` is chosen (:func:`~fedquant.strategies.nested_rules.choose_parameters`):
        ``"variance"`` (default) keeps DQSG's error (wraps add at most ``max_excess``);
        ``"rate"`` picks the ``rho`` that saves the most bits against DQSG at the same error, wraps
        included, among those whose wraps add at most ``max_excess``.
    """

    def __init__(
        self,
        p1_fraction: float = 0.5,
        rho: int | None = None,
        alpha: float | str = 1.0,
        initial_rho: int | None = None,
        max_excess: float = 0.01,
        seed: int = 0,
        min_numel: int = DEFAULT_MIN_NUMEL,
        rule: str = "variance",
        min_p1: int = 3,
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
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
            raise ValueError(f"min_numel must be a positive int, got {min_numel!r}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if isinstance(min_p1, bool) or not isinstance(min_p1, int) or min_p1 < 1:
            raise ValueError(f"min_p1 must be a positive int, got {min_p1!r}")
        super().__init__()
        self.p1_fraction = float(p1_fraction)
        self.rho = rho
        self.alpha = alpha if alpha == "auto" else float(alpha)
        self.initial_rho = initial_rho
        self.max_excess = float(max_excess)
        self.seed = seed
        self.min_numel = min_numel
        self.rule = rule
        self.min_p1 = min_p1
        self.estimates: dict[str, SpreadEstimate] = {}  # per tensor, from the latest P1 updates of it
        self._rounds: dict[int, _RoundState] = {}

    @classmethod
    def from_spec(cls, spec: str, seed: int = 0) -> NestedDecodePlan:
        """The plan for an ``ndqsg`` spec: ``rho`` fixed only if the spec names it, ``alpha`` from the spec."""
        _, params = parse_pipeline(spec)[-1]
        codec = get_codec(spec)
        if not isinstance(codec.quantizer, NDQSGQuantizer):
            raise ValueError(f"NestedDecodePlan needs an ndqsg codec spec, got {spec!r}")
        return cls(rho=codec.rho if "rho" in params else None, alpha=codec.alpha, seed=seed)

    @classmethod
    def authors(cls, seed: int = 0) -> NestedDecodePlan:
        """The authors' setting: ``rho = 3`` for every tensor, ``alpha = 1``, half the clients in P1.

        Use it with ``ndqsg:levels=3`` for their ``(M, rho) = (3, 3)``; it always nests, whatever
        the spread (wraps included).
        """
        return cls(p1_fraction=0.5, rho=AUTHORS_RHO, alpha=1.0, seed=seed)

    @property
    def spread(self) -> float | None:
        """The largest estimated ``sigma_z / Delta1`` over tensors (without margin), or None."""
        return max((e.spread for e in self.estimates.values()), default=None)

    def __repr__(self) -> str:
        rho = self.rho if self.rho is not None else f"per tensor by {self.rule}"
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
        n1 = min(len(nodes), max(self.min_p1, round(self.p1_fraction * len(nodes))))
        order = np.random.default_rng(derive_seed(self.seed, server_round, "ndqsg-groups")).permutation(len(nodes))
        p1 = [nodes[i] for i in sorted(order[:n1])]
        chosen = set(p1)
        return p1, [n for n in nodes if n not in chosen]

    def parameters(self, levels: int) -> tuple[int, float, int]:
        """``(rho, alpha, rule)`` of the tensors without their own estimate (all of them with a fixed ``rho``)."""
        _, alpha = choose_parameters(None, self.alpha)
        if self.rho is not None:
            return self.rho, alpha, RULE_FIXED
        return (self.initial_rho or 2 * levels + 1), alpha, RULE_INITIAL

    def tensor_parameters(self, levels: int | None = None, coding: str = "fixed") -> dict[str, tuple[int, float]]:
        """``{tensor: (rho, alpha)}`` for the tensors with their own estimate (empty with a fixed ``rho``).

        ``levels`` and ``coding`` (the codec's) are needed by the ``"rate"`` rule.
        """
        if self.rho is not None:
            return {}
        out = {}
        for name, estimate in self.estimates.items():
            rho, alpha = choose_parameters(
                estimate, self.alpha, self.max_excess, MAX_RHO, self.rule, levels, coding
            )  # fmt: skip
            out[name] = (rho, alpha)
        return out

    def learn(
        self, p1_updates: Mapping[str, Sequence[torch.Tensor]], levels: int, bucket_size: int
    ) -> dict[str, SpreadEstimate]:
        """Update the per-tensor estimates from one round's decoded P1 updates.

        Tensors with fewer than ``min_numel`` elements or fewer than 2 updates are skipped; a
        tensor without a new estimate keeps its previous one. Returns this round's new estimates.
        """
        new = {}
        for name, updates in p1_updates.items():
            if not updates or updates[0].numel() < self.min_numel:
                continue
            estimate = estimate_spread(list(updates), levels, bucket_size, dqsg_levels=levels)
            if estimate is not None:
                new[name] = estimate
        self.estimates.update(new)
        return new

    def assign(self, server_round: int, node_ids: Sequence[int], codec: Codec) -> dict[int, ClientAssignment]:
        """P1 gets ``dqsg`` (rank 0, role ``p1``), P2 ``ndqsg`` per tensor (rank 1, ``p2``).

        P2's default codec serves tensors without their own estimate; each tensor with one gets
        ``ndqsg`` at its own ``rho``/``alpha`` as a per-tensor codec. When an adaptive ``rho``
        comes out at ``2M + 1`` or more, nesting cannot save anything (the coset index needs at
        least DQSG's index width and only adds wrap-around risk): that tensor goes as DQSG,
        decoded without side information.
        """
        if not isinstance(codec.quantizer, NDQSGQuantizer):
            raise ValueError(f"{LOG_PREFIX} needs the strategy's codec to be ndqsg, got {codec.spec!r}")
        levels = codec.levels
        p1, p2 = self.groups(server_round, node_ids)
        shared = {"levels": levels, "bucket_size": codec.bucket_size, "coding": codec.coding}
        dqsg = codec.with_quantizer(DQSGQuantizer(**shared))  # the codec's transforms stay in front of both groups
        rho, alpha, rule = self.parameters(levels)

        def p2_codec(rho: int, alpha: float) -> Codec:
            nested = self.rho is not None or nesting_saves_bits(rho, levels)
            return codec.with_quantizer(NDQSGQuantizer(rho=rho, alpha=alpha, **shared)) if nested else dqsg

        default = p2_codec(rho, alpha)
        chosen = self.tensor_parameters(levels, codec.coding)
        per_tensor = {name: p2_codec(r, a) for name, (r, a) in sorted(chosen.items())}
        overrides = {name: c for name, c in per_tensor.items() if c != default}
        state = _RoundState(rho, alpha, RULE_ESTIMATED if chosen else rule, len(p1), levels, codec.bucket_size)
        state.tensor_rho = {name: r for name, (r, _) in chosen.items()}
        state.nested_tensors = sum(c.needs_side_info for c in per_tensor.values())
        state.p2_nested = default.needs_side_info or state.nested_tensors > 0
        self._rounds[server_round] = state
        log(
            INFO,
            "%s: round %s: %d clients P1 (%s), %d P2 (%s, %d tensors nested at their own rho %s); rho from %s",
            LOG_PREFIX, server_round, len(p1), dqsg.spec, len(p2), default.spec, state.nested_tensors,
            state.tensor_rho or "-", RULE_NAMES[state.rule],
        )  # fmt: skip
        out = {n: ClientAssignment(dqsg, {KEY_ROLE: ROLE_P1}, rank=0) for n in p1}
        out.update({n: ClientAssignment(default, {KEY_ROLE: ROLE_P2}, rank=1, tensor_codecs=overrides) for n in p2})
        return out

    # ------------------------------------------------------------------ aggregate_train
    def admit(self, server_round: int, node_id: int, assignment: ClientAssignment) -> str | None:
        """Drop a nested (P2) reply when nothing was decoded before it (see the module's fallback note)."""
        if not needs_side_info(assignment.record_codec(1)) or self.side_information(server_round).replies > 0:
            return None
        state = self._rounds.get(server_round)
        if state is not None:
            state.p2_dropped += 1
        return (
            "no P1 reply was decoded this round, so there is no side information to decode its nested "
            "payload against (NDQSG fallback: P2 replies are dropped)"
        )

    def accepted(self, server_round: int, reply: DecodedClient) -> None:
        """Count the group's bytes; keep P1's decoded updates for the next round's spread estimates.

        With a default codec that nests (a fixed ``rho``), ``ndqsg-nested-tensors`` counts the
        tensors a P2 reply really sent nested (before, only tensors with their own ``rho`` were
        counted, so a fixed-``rho`` run reported 0 and was called a DQSG run).
        """
        super().accepted(server_round, reply)
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
        elif reply.assignment.codec.needs_side_info:  # a nesting default (fixed rho): count every nested tensor
            nested = sum(reply.assignment.codec_for(name).needs_side_info for name in reply.updates)
            state.nested_tensors = max(state.nested_tensors, nested)

    def round_metrics(self, server_round: int) -> dict[str, int | float]:
        """The round's NDQSG metrics; updates the spread estimates from this round's P1 updates."""
        super().round_metrics(server_round)
        state = self._rounds.pop(server_round, None)
        if state is None:
            return {}
        for old in [r for r in self._rounds if r < server_round]:  # rounds configured but never aggregated
            del self._rounds[old]
        metrics: dict[str, int | float] = {
            METRIC_RHO: state.rho,
            METRIC_ALPHA: state.alpha,
            METRIC_RHO_RULE: state.rule,
            METRIC_NESTED_TENSORS: state.nested_tensors,
            METRIC_P1_DECODED: state.p1_decoded,
            METRIC_P1_FAILED: int(state.p1_nodes > 0 and state.p1_decoded == 0),
            METRIC_P2_DROPPED: state.p2_dropped,
            METRIC_P2_NESTED: int(state.p2_nested),
        }
        if state.tensor_rho:
            metrics[METRIC_RHO_MIN] = min(state.tensor_rho.values())
            metrics[METRIC_RHO_MAX] = max(state.tensor_rho.values())
        for role, key in ((ROLE_P1, METRIC_BITS_P1), (ROLE_P2, METRIC_BITS_P2)):
            params = state.group_params[role]
            metrics[key] = 8.0 * state.group_bytes[role] / params if params else 0.0
        new = self.learn(state.p1_updates, state.levels, state.bucket_size)
        if new:
            metrics[METRIC_SPREAD] = max(e.spread for e in new.values())
        if metrics[METRIC_P1_FAILED]:
            log(
                WARNING,
                "%s: round %s: no P1 reply decoded; dropped %d P2 replies (no side information)",
                LOG_PREFIX, server_round, state.p2_dropped,
            )  # fmt: skip
        return metrics
