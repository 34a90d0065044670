"""The server side of the side-information seam: who decodes a nested payload against what.

A codec of the side-information kind (:class:`~fedquant.codecs.side_info.SideInfoCodec`, NDQSG)
is decoded against the server's running estimate of the update: the mean of the updates of the
replies accepted before it in the same round. :class:`SideInfoPlan`, the default plan of every
such codec, owns that estimate (one :class:`SideInformation` per round, fed by ``accepted``) and
hands the strategy a record codec whose side-information tensors decode with it
(:meth:`SideInfoPlan.reply_codec`), so the strategy, the reply decoder and the record codec never
see side information. NDQSG's two-group scheme is a subclass
(:class:`~fedquant.strategies.nested.NestedDecodePlan`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fedquant.codecs import Codec
from fedquant.codecs.side_info import SideInfoQuantizer
from fedquant.records import RecordCodec
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient, DecodePlan, default_plan_for


class SideInformation:
    """Running mean, per tensor name, of the updates of a round's accepted replies.

    ``get`` returns the mean of the updates ``add``-ed so far, or zeros before the first one.
    Only accepted replies are added, so a rejected reply never influences the side information of
    later ones. Adding keeps a reference; the sums are taken (in the order of ``add``) when a
    mean is first asked for, so a round that decodes nothing against it costs nothing.
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] = {}
        self._count: dict[str, int] = {}
        self._pending: list[Mapping[str, torch.Tensor]] = []
        self.replies = 0  # accepted replies added so far

    def get(self, name: str, numel: int) -> torch.Tensor:
        """Flat float32 side information for tensor ``name`` with ``numel`` elements."""
        self._fold()
        total = self._sum.get(name)
        if total is None or total.numel() != numel:
            return torch.zeros(numel, dtype=torch.float32)
        return total / self._count[name]

    def add(self, updates: Mapping[str, torch.Tensor]) -> None:
        """Add one accepted reply's decoded updates (any shape; flattened, float32)."""
        self.replies += 1
        self._pending.append(updates)

    def count(self, name: str) -> int:
        """How many updates of tensor ``name`` the mean holds."""
        self._fold()
        return self._count.get(name, 0)

    def _fold(self) -> None:
        for updates in self._pending:
            for name, update in updates.items():
                flat = update.detach().reshape(-1).to(torch.float32)
                if name in self._sum and self._sum[name].numel() == flat.numel():
                    self._sum[name] += flat
                    self._count[name] += 1
                else:
                    self._sum[name] = flat.clone()
                    self._count[name] = 1
        self._pending.clear()


def needs_side_info(record: RecordCodec) -> bool:
    """Whether any tensor of a record codec decodes against side information."""
    return any(codec.needs_side_info for codec in record.codecs())


@dataclass(frozen=True)
class _AgainstSideInfo:
    """A side-information codec bound to one tensor's running mean: it decodes from the payload alone."""

    codec: Codec
    name: str
    side: SideInformation

    def decode(self, payload: bytes, seed: int, *, shape: Sequence[int] | None = None, **kwargs) -> torch.Tensor:
        if shape is None:
            raise ValueError(f"{self.codec.name}: decoding against side information needs the tensor's shape")
        side_info = self.side.get(self.name, math.prod(shape))
        return self.codec.decode(payload, seed, side_info, shape=shape, **kwargs)


@dataclass(frozen=True)
class SideInfoRecordCodec(RecordCodec):
    """A record codec whose side-information tensors decode against ``side``."""

    side: SideInformation = field(default_factory=SideInformation)

    def codec_for(self, name: str) -> Codec:
        codec = super().codec_for(name)
        return _AgainstSideInfo(codec, name, self.side) if codec.needs_side_info else codec  # type: ignore[return-value]


@default_plan_for(SideInfoQuantizer)
class SideInfoPlan(DecodePlan):
    """Default plan of side-information codecs: one codec for everyone, each reply decoded against
    the running mean of the replies accepted before it (zeros before the first).

    Subclasses that override ``accepted`` or ``round_metrics`` call ``super()`` first.
    """

    def __init__(self) -> None:
        self._sides: dict[int, SideInformation] = {}

    def side_information(self, server_round: int) -> SideInformation:
        """The round's side information so far (what the next reply is decoded against)."""
        return self._sides.setdefault(server_round, SideInformation())

    def reply_codec(self, server_round: int, assignment: ClientAssignment, min_numel: int) -> RecordCodec:
        record = super().reply_codec(server_round, assignment, min_numel)
        if not needs_side_info(record):
            return record
        side = self.side_information(server_round)
        return SideInfoRecordCodec(record.codec, record.min_numel, record.tensor_codecs, side)

    def accepted(self, server_round: int, reply: DecodedClient) -> None:
        """The reply's decoded updates join the round's side information."""
        self.side_information(server_round).add(reply.updates)

    def round_metrics(self, server_round: int) -> dict[str, int | float]:
        """Drops the round's side information (and that of rounds never aggregated)."""
        for old in [r for r in self._sides if r <= server_round]:
            del self._sides[old]
        return {}
