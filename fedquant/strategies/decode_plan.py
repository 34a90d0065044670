"""The decode hook: per-client codec assignment, decode order and decoder side information.

Most codecs decode each reply on its own. Codecs with ``needs_side_info`` (NDQSG) decode a
client's payload against the server's current estimate of the update, which is built from the
updates decoded before it in the same round. :class:`QuantizedStrategy` asks a
:class:`DecodePlan` three things each round:

1. ``assign(server_round, node_ids, codec)`` in ``configure_train``: which codec each sampled
   client uses and which extra ``fedquant.*`` config entries it gets (e.g. a group role);
2. ``decode_order(node_ids, assignments)`` in ``aggregate_train``: in which order to decode the
   replies that arrived (given in arrival order);
3. ``side_information()``: a fresh per-round :class:`SideInformation` that gives the side
   information for a tensor before each decode and learns each accepted reply's decoded updates.

And, in ``aggregate_train``, three optional callbacks (the default plan does nothing in them):

4. ``admit(server_round, node_id, assignment, side)`` before each decode: a reason to drop the
   reply without decoding it (counted in ``rejected-replies`` and logged), or None;
5. ``accepted(server_round, reply)`` after each accepted reply, with a :class:`DecodedClient`
   (node, assignment, decoded updates, bytes): a plan can learn from the round (statistics for
   the next round's parameters, per-group rates);
6. ``round_metrics(server_round)`` once the round is decoded: extra entries for the round's
   train MetricRecord.

The default plan gives every client the strategy's codec, decodes in arrival order and offers the
running mean of the updates decoded so far (zeros before the first) to every codec that needs
side information. A two-group scheme (NDQSG's Algorithm 2: group P1 with DQSG first, then group
P2 with nested quantization decoded against the running mean) only overrides ``assign`` (codec
and role per client, with a lower ``rank`` for P1) and keeps the rest.

A codec names its own default plan, so the strategy holds no codec names: the codec's
``decode_plan`` attribute (its quantizer's) is ``"module:Class"`` or None. Without a
``decode_plan`` argument, :class:`~fedquant.strategies.QuantizedStrategy` builds
:func:`default_plan`, which imports that class and calls ``Class.from_spec(spec, seed=seed)``.
What a plan class must offer to be named by a codec:

* be a subclass of :class:`DecodePlan`;
* a classmethod ``from_spec(spec: str, seed: int = 0) -> DecodePlan``. ``spec`` is the codec
  spec string the user passed to the strategy (the codec's canonical ``spec`` when given a codec
  instance), so a plan can tell the parameters the user fixed from the defaults (NDQSG's plan
  adapts ``rho`` unless the string names it); ``seed`` is the strategy's base seed. The
  inherited :meth:`DecodePlan.from_spec` returns ``cls()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fedquant.codecs import Codec

ConfigValue = int | float | str | bool | bytes


@dataclass(frozen=True)
class ClientAssignment:
    """What one sampled client does this round.

    Attributes
    ----------
    codec : Codec
        The codec the client encodes with and the server decodes with.
    config : Mapping[str, ConfigValue]
        Extra ConfigRecord entries for this client (keys should start with ``fedquant.``).
    rank : int
        Decode order: replies with a lower rank are decoded first; equal ranks keep arrival order.
    tensor_codecs : Mapping[str, Codec]
        Per-tensor overrides of ``codec`` by tensor name (sent as ``fedquant.tensor-codecs``; e.g.
        NDQSG's ``rho`` per tensor). Tensors not named use ``codec``.
    """

    codec: Codec
    config: Mapping[str, ConfigValue] = field(default_factory=dict)
    rank: int = 0
    tensor_codecs: Mapping[str, Codec] = field(default_factory=dict)

    def codec_for(self, name: str) -> Codec:
        """The codec of tensor ``name``: its override, else ``codec``."""
        return self.tensor_codecs.get(name, self.codec)

    @property
    def needs_side_info(self) -> bool:
        """Whether any of the client's tensors is decoded against side information."""
        return self.codec.needs_side_info or any(c.needs_side_info for c in self.tensor_codecs.values())


@dataclass(frozen=True)
class DecodedClient:
    """One accepted reply, as a plan's ``accepted`` callback sees it.

    Attributes
    ----------
    node_id : int
        The replying node.
    assignment : ClientAssignment
        What the node was assigned this round.
    updates : Mapping[str, torch.Tensor]
        The decoded updates of its encoded tensors (float32, the shapes sent; do not modify).
    reply_bytes : int
        Bytes of the reply's ArrayRecords (as counted in ``uplink-bytes``).
    num_params : int
        Parameters in the model sent to the node (as counted for ``bits-per-param``).
    """

    node_id: int
    assignment: ClientAssignment
    updates: Mapping[str, torch.Tensor]
    reply_bytes: int
    num_params: int


class SideInformation:
    """Running mean, per tensor name, of the updates decoded so far in a round.

    ``get`` returns the mean of the updates ``add``-ed so far, or zeros before the first one.
    Only accepted replies are added (the strategy adds a reply's updates once all of its tensors
    decoded), so a rejected reply never influences the side information of later ones.
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] = {}
        self._count: dict[str, int] = {}
        self.replies = 0  # accepted replies added so far

    def get(self, name: str, numel: int) -> torch.Tensor:
        """Flat float32 side information for tensor ``name`` with ``numel`` elements."""
        total = self._sum.get(name)
        if total is None or total.numel() != numel:
            return torch.zeros(numel, dtype=torch.float32)
        return total / self._count[name]

    def add(self, updates: Mapping[str, torch.Tensor]) -> None:
        """Add one accepted reply's decoded updates (any shape; flattened, float32)."""
        self.replies += 1
        for name, update in updates.items():
            flat = update.detach().reshape(-1).to(torch.float32)
            if name in self._sum and self._sum[name].numel() == flat.numel():
                self._sum[name] += flat
                self._count[name] += 1
            else:
                self._sum[name] = flat.clone()
                self._count[name] = 1

    def count(self, name: str) -> int:
        """How many updates of tensor ``name`` the mean holds."""
        return self._count.get(name, 0)


class DecodePlan:
    """Default plan: one codec for everyone, arrival order, running-mean side information.

    Subclass and override ``assign`` (and, if needed, ``decode_order`` or ``side_information``)
    to give clients different codecs or roles.
    """

    def assign(self, server_round: int, node_ids: Sequence[int], codec: Codec) -> dict[int, ClientAssignment]:
        """Assign a codec (and extra config entries) to each sampled node.

        Parameters
        ----------
        server_round : int
            The round being configured.
        node_ids : sequence of int
            The nodes the inner strategy sampled, in the order of its messages.
        codec : Codec
            The strategy's codec.

        Returns
        -------
        dict of int to ClientAssignment
            One assignment per node id in ``node_ids``.
        """
        return {node_id: ClientAssignment(codec) for node_id in node_ids}

    def decode_order(self, node_ids: Sequence[int], assignments: Mapping[int, ClientAssignment]) -> list[int]:
        """Order in which replies are decoded: by ``rank``, then arrival order (a stable sort).

        Parameters
        ----------
        node_ids : sequence of int
            Nodes whose replies arrived, in arrival order (only nodes that were assigned).
        assignments : mapping of int to ClientAssignment
            This round's assignments.
        """
        return sorted(node_ids, key=lambda node_id: assignments[node_id].rank)

    def side_information(self) -> SideInformation:
        """A fresh side-information accumulator for one round."""
        return SideInformation()

    def admit(self, server_round: int, node_id: int, assignment: ClientAssignment, side: SideInformation) -> str | None:
        """Before decoding a reply: None to decode it, or a sentence saying why it is dropped.

        Parameters
        ----------
        server_round : int
            The round being aggregated.
        node_id : int
            The replying node.
        assignment : ClientAssignment
            Its assignment.
        side : SideInformation
            The round's side information so far (what the reply would be decoded against).
        """
        return None

    def accepted(self, server_round: int, reply: DecodedClient) -> None:
        """Called after each accepted reply, in decode order (after it joined the side information)."""

    def round_metrics(self, server_round: int) -> dict[str, int | float]:
        """Extra entries for the round's train MetricRecord, once every reply was decoded."""
        return {}

    @classmethod
    def from_spec(cls, spec: str, seed: int = 0) -> DecodePlan:
        """The plan for a strategy whose codec names this class (see the module notes).

        Parameters
        ----------
        spec : str
            The codec spec as the user gave it (a codec instance's canonical ``spec``).
        seed : int
            The strategy's base seed.
        """
        return cls()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def plan_class(path: str) -> type[DecodePlan]:
    """The DecodePlan subclass named by a codec's ``decode_plan`` (``"module:Class"``).

    Raises
    ------
    ValueError
        If the path does not name a DecodePlan subclass.
    """
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"decode plan {path!r} cannot be loaded: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, DecodePlan)):
        raise ValueError(f"decode plan {path!r} is not a DecodePlan subclass")
    return cls


def names_plan(codec: Codec, cls: type[DecodePlan]) -> bool:
    """Whether ``codec``'s default plan is ``cls`` or a base of it (a plan's check of its codec)."""
    path = codec.decode_plan
    return path is not None and issubclass(cls, plan_class(path))


def default_plan(spec: str, codec: Codec, seed: int = 0) -> DecodePlan:
    """The plan ``codec`` names (``Class.from_spec(spec, seed=seed)``), or :class:`DecodePlan`.

    Parameters
    ----------
    spec : str
        The codec spec as the user gave it (``codec.spec`` for a codec instance).
    codec : Codec
        The strategy's codec, built from ``spec``.
    seed : int
        The strategy's base seed.
    """
    path = codec.decode_plan
    return DecodePlan() if path is None else plan_class(path).from_spec(spec, seed=seed)
