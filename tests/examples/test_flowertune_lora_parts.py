"""The LoRA example's data split and its FlowerTune-style byte count (fast: no model is built)."""

from __future__ import annotations

import re
from pydoc_data.topics import topics

import numpy as np
import pytest
from flowertune_lora.dataset import (
    ByteTokenizer,
    client_text,
    client_topics,
    finetuning_topics,
    pretraining_text,
    validation_text,
    windows,
)
from flowertune_lora.local_grid import InProcessGrid
from flowertune_lora.traffic import CountingGrid
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tests.examples.conftest import EXAMPLE


@pytest.mark.parametrize("clients", [2, 4, 7])
def test_clients_get_disjoint_held_out_topics_and_never_the_validation_text(clients):
    owned = [client_topics(p, clients) for p in range(clients)]
    flat = [name for names in owned for name in names]
    assert sorted(flat) == sorted(finetuning_topics())  # each held-out topic dealt exactly once
    assert all(owned)
    held_out = {topics[name] for name in finetuning_topics()}
    assert not held_out & set(pretraining_text())
    assert len(held_out) + len(pretraining_text()) == len(set(topics.values()))  # every distinct text used once
    for p in range(clients):
        for train, name in zip(client_text(p, clients), owned[p]):
            assert topics[name].startswith(train) and len(train) < len(topics[name])
    # validation is the tail of each held-out topic: exactly what the clients' text leaves out
    pairs = [(train, name) for p in range(clients) for train, name in zip(client_text(p, clients), owned[p])]
    tails = {topics[name][len(train) :] for train, name in pairs}
    assert tails == set(validation_text())


def test_bad_partitions_and_windows_are_refused():
    with pytest.raises(ValueError, match="partition-id"):
        client_topics(4, 4)
    with pytest.raises(ValueError, match="fine-tuning topics"):
        client_topics(0, len(finetuning_topics()) + 1)
    with pytest.raises(ValueError, match="no window"):
        windows(["ab"], ByteTokenizer().encode, 8)


def test_byte_windows_cover_the_text_in_order():
    data = windows(["héllo world"], ByteTokenizer().encode, 3)
    ids = [256, *"héllo world".encode()]
    assert data.shape == (len(ids) // 4, 4)
    assert data.flatten().tolist() == ids[: data.numel()]


def test_counting_grid_counts_array_records_both_ways_as_flowertune_does():
    echo = ClientApp()

    @echo.train()
    def _train(msg, context):
        half = {k: Array(v.numpy()[: len(v.numpy()) // 2]) for k, v in msg.content["arrays"].items()}
        return Message(RecordDict({"arrays": ArrayRecord(half), "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)  # fmt: skip

    grid = CountingGrid(InProcessGrid(echo, 2, run_config={}))
    sent = ArrayRecord({"lora_A.weight": Array(np.ones(1000, dtype=np.float32))})
    messages = [Message(RecordDict({"arrays": sent}), dst_node_id=node, message_type="train")
                for node in grid.get_node_ids()]  # fmt: skip
    replies = list(grid.send_and_receive(messages))
    up = sum(r.content["arrays"].count_bytes() for r in replies)
    assert grid.train_bytes() == [(2 * sent.count_bytes(), up)]
    assert 2 * 2000 < up < sent.count_bytes() * 2  # half the floats each, plus headers and keys

    broken = ClientApp()

    @broken.train()
    def _fail(msg, context):
        raise RuntimeError("client crashed")

    grid = CountingGrid(InProcessGrid(broken, 1, run_config={}))
    [reply] = grid.send_and_receive([Message(RecordDict({"arrays": sent}), dst_node_id=101, message_type="train")])
    assert reply.has_error() and grid.train_bytes() == [(sent.count_bytes(), 0)]


def test_the_readme_diff_is_the_two_lines_the_apps_have():
    diff = re.search(r"```diff\n(.*?)```", (EXAMPLE / "README.md").read_text(), flags=re.S).group(1)
    sources = {name: (EXAMPLE / "flowertune_lora" / name).read_text() for name in ("server_app.py", "client_app.py")}
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-")]
    assert len(added) == len(removed) == 2
    code = "\n".join(sources.values()).splitlines()
    assert all(line in code for line in added)  # the fedquant lines, verbatim
    assert not any(line in code for line in removed)  # the plain Flower lines they replace
