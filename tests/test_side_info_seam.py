"""Side information behind one seam: the codec kind, its decode plan, and nothing in between."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

import fedquant
from fedquant.codecs import get_codec
from fedquant.protocol import tensor_seed
from fedquant.records import RecordCodec
from fedquant.strategies import ClientAssignment, DecodedClient, DecodePlan, NestedDecodePlan, SideInfoPlan
from fedquant.strategies.decode_plan import default_plan
from fedquant.strategies.side_info import SideInformation

PACKAGE = Path(fedquant.__file__).resolve().parent
#: The seam: the codec kind and its quantizer (with kernels), the server's plans; codec.py keeps
#: ``Codec.decode(payload, seed, side_info=None)`` (public API), which the fuzzer calls.
SEAM = {
    "testing/fuzz_mutations.py",
    "testing/fuzzing.py",
    "codecs/side_info.py",
    "codecs/quantizers/dither.py",
    "codecs/kernels/dither.py",
    "codecs/codec.py",
    "strategies/side_info.py",
    "strategies/nested.py",
}


def test_side_info_is_named_only_in_its_seam():
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(?<![\w.])side_info\b", line) and rel not in SEAM:
                outside.append(f"{rel}:{number}: {line.strip()}")
    assert not outside, "\n".join(outside)


def test_the_codecs_name_no_server_module_by_string():
    # An upward edge no import shows: the codecs once named their decode plan as "module:Class".
    pattern = re.compile(r"[\"']fedquant\.(strategies|clients)[\w.]*:\w+[\"']")
    hits = [p.name for p in (PACKAGE / "codecs").rglob("*.py") if pattern.search(p.read_text())]
    assert not hits, hits


def test_side_information_sums_lazily_in_the_order_of_add():
    rng = torch.Generator().manual_seed(0)
    updates = [
        {"w": torch.randn(300, generator=rng) * 10 ** (i % 3), "b": torch.randn(4, generator=rng)} for i in range(7)
    ]
    side = SideInformation()
    for i, update in enumerate(updates):
        side.add(update)
        eager = updates[0]["w"].clone()
        for later in updates[1 : i + 1]:
            eager += later["w"]
        assert torch.equal(side.get("w", 300), eager / (i + 1))  # bit for bit the eager running sum
    assert side.replies == 7 and side.count("b") == 7 and side.count("x") == 0
    assert torch.equal(side.get("w", 5), torch.zeros(5))  # another size: no side information


def test_the_plan_of_the_kind_binds_side_information_to_its_tensors():
    codec = get_codec("ndqsg:rho=7")
    plan = default_plan(codec.spec, codec)
    assert type(plan) is NestedDecodePlan and isinstance(plan, SideInfoPlan)
    assert type(default_plan("dqsg", get_codec("dqsg"))) is DecodePlan
    generic = SideInfoPlan()
    assert generic.reply_codec(1, ClientAssignment(get_codec("dqsg")), 1) == RecordCodec(get_codec("dqsg"), 1)
    x = torch.linspace(-1, 1, 1000)
    mean = x + 0.001 * torch.cos(torch.arange(1000.0))
    generic.accepted(1, DecodedClient(1, ClientAssignment(get_codec("dqsg")), {"w": mean}, 0, 0))
    record = generic.reply_codec(1, ClientAssignment(codec), 1)
    payload = codec.encode(x, tensor_seed(5, "w"))
    wire = ArrayRecord({"w": Array(dtype="uint8", shape=(len(payload),), stype="fedquant.payload", data=payload)})
    decoded = record.decode(wire, 5, {"w": np.zeros(1000, np.float32)})
    expected = codec.decode(payload, tensor_seed(5, "w"), mean, shape=(1000,), dtype=torch.float32)
    assert torch.equal(decoded.updates["w"], expected)
    generic.round_metrics(1)
    assert generic.side_information(1).replies == 0  # the round's state is gone
