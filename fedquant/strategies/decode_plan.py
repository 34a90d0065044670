"""The decode hook: per-client codec assignment and decode order, asked by ``QuantizedStrategy``.

Each round the strategy asks a :class:`DecodePlan`:

1. ``assign(server_round, node_ids, codec)`` in ``configure_train``: which codec each sampled
   client uses and which extra ``fedquant.*`` config entries it gets (e.g. a group role);
2. ``decode_order(node_ids, assignments)`` in ``aggregate_train``: in which order to decode the
   replies that arrived (given in arrival order);
3. ``reply_codec(server_round, assignment, min_numel)`` before each decode: the record codec the
   reply is decoded with (default: the assignment's);
4. ``admit(server_round, node_id, assignment)`` before each decode: a reason to drop the reply
   without decoding it (counted in ``rejected-replies`` and logged), or None;
5. ``accepted(server_round, reply)`` after each accepted reply, with a :class:`DecodedClient`
   (node, assignment, decoded updates, bytes): a plan can learn from the round;
6. ``round_metrics(server_round)`` once the round is decoded: extra entries for the round's
   train MetricRecord.

The default plan gives every client the strategy's codec and decodes in arrival order. A codec
whose decoder needs side information gets the plan of its kind
(:mod:`fedquant.strategies.side_info`; NDQSG's two groups: :mod:`fedquant.strategies.nested`):
a plan class declares which quantizers it is the default of with :func:`default_plan_for`, and
:func:`default_plan` looks the codec's quantizer up, so neither the strategy nor the codec names
the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fedquant.codecs import Codec, Quantizer
from fedquant.records import RecordCodec

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

    def record_codec(self, min_numel: int) -> RecordCodec:
        """The record codec of this assignment under the strategy's ``min_numel``."""
        return RecordCodec(self.codec, min_numel, self.tensor_codecs)


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


class DecodePlan:
    """Default plan: one codec for everyone, arrival order, each reply decoded on its own.

    Subclass and override ``assign`` (and, if needed, the other hooks) to give clients different
    codecs or roles.
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

    def reply_codec(self, server_round: int, assignment: ClientAssignment, min_numel: int) -> RecordCodec:
        """The record codec a reply of ``assignment`` is decoded with (default: the assignment's)."""
        return assignment.record_codec(min_numel)

    def admit(self, server_round: int, node_id: int, assignment: ClientAssignment) -> str | None:
        """Before decoding a reply: None to decode it, or a sentence saying why it is dropped."""
        return None

    def accepted(self, server_round: int, reply: DecodedClient) -> None:
        """Called after each accepted reply, in decode order."""

    def round_metrics(self, server_round: int) -> dict[str, int | float]:
        """Extra entries for the round's train MetricRecord, once every reply was decoded."""
        return {}

    @classmethod
    def from_spec(cls, spec: str, seed: int = 0) -> DecodePlan:
        """The plan for a strategy whose codec has this class as its default plan.

        Parameters
        ----------
        spec : str
            The codec spec as the user gave it (a codec instance's canonical ``spec``), so a
            plan can tell the parameters the user fixed from the defaults.
        seed : int
            The strategy's base seed.
        """
        return cls()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_DEFAULT_PLANS: dict[type[Quantizer], type[DecodePlan]] = {}


def default_plan_for(*quantizers: type[Quantizer]) -> Callable[[type[DecodePlan]], type[DecodePlan]]:
    """Class decorator: the plan becomes the default of codecs whose quantizer is (a subclass of) one of these."""

    def register(plan: type[DecodePlan]) -> type[DecodePlan]:
        if not (isinstance(plan, type) and issubclass(plan, DecodePlan)):
            raise TypeError(f"{plan!r} is not a DecodePlan subclass")
        for quantizer in quantizers:
            _DEFAULT_PLANS[quantizer] = plan
        return plan

    return register


def default_plan(spec: str, codec: Codec, seed: int = 0) -> DecodePlan:
    """The default plan of ``codec``'s quantizer (nearest registered base class), else :class:`DecodePlan`.

    Parameters
    ----------
    spec : str
        The codec spec as the user gave it (``codec.spec`` for a codec instance).
    codec : Codec
        The strategy's codec, built from ``spec``.
    seed : int
        The strategy's base seed.
    """
    for cls in type(codec.quantizer).__mro__:
        if cls in _DEFAULT_PLANS:
            return _DEFAULT_PLANS[cls].from_spec(spec, seed=seed)
    return DecodePlan()
