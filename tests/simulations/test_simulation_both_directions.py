"""Downlink compression and the upload deadline through ``flwr.simulation.run_simulation`` (Ray backend).

One simulation (one Ray start) runs four federations of the digits app on the same virtual clients:

1. a wrapper whose clients skip rounds (fraction 0.5): each client's rebuilt model must be the very
   model the server rebuilt for it (same digest), whatever reference it held;
2. and 3. the app with a dense and with a ``qsgd:levels=16`` downlink, every client every round:
   ``downlink-bytes`` must equal what a counting mod (placed before ``quantize_mod``) measured, be
   >= 4x below dense from round 2 on, and the two runs must reach the same accuracy within 1 point;
4. the app with ``upload-deadline-seconds`` on a lognormal uplink profile: every round's slowest
   sampled client meets the deadline.

The clients report what they measured in their ``client-info`` ConfigRecord.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedquant.clients import quantize_mod
from fedquant.codecs import get_codec
from fedquant.protocol import KEY_DOWNLINK_BASE, NO_REFERENCE
from fedquant.records import RecordCodec
from fedquant.strategies import QuantizedStrategy
from simulations import client_app as sim_client
from simulations.data import load_test_set
from simulations.links import parse_uplink
from simulations.models import build_model
from simulations.server_app import SeededFedAvg, run_server
from simulations.settings import CLIENT_INFO_KEY, SimSettings
from tests.flower_fakes import raw_array_bytes, wait_for_nodes

pytestmark = pytest.mark.slow

NUM_NODES = 6
CODEC = "qsgd:levels=16"
UPLINK = "lognormal:median=1,sigma=1"
DEADLINE = 0.3
COARSEST = "qsgd:levels=1"


def _digest(record: ArrayRecord) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, array in record.items():
        h.update(name.encode() + array.numpy().tobytes())
    return h.hexdigest()


def _client_info(reply: Message) -> ConfigRecord | None:
    if reply.has_error():
        return None
    return reply.content.config_records.get(CLIENT_INFO_KEY)


def counting_mod(msg: Message, ctxt: Context, call_next):
    """Before ``quantize_mod``: the bytes the train message carries, as it arrives."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    counted = raw_array_bytes(msg)
    config = next(iter(msg.content.config_records.values()))
    base = int(config.get(KEY_DOWNLINK_BASE, NO_REFERENCE))
    reply = call_next(msg, ctxt)
    info = _client_info(reply)
    if info is not None:
        info["counted-downlink-bytes"] = counted
        info["downlink-base"] = base
    return reply


def seen_mod(msg: Message, ctxt: Context, call_next):
    """After ``quantize_mod``: what the ClientApp trains on (dtypes and a digest of the values)."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    record = next(iter(msg.content.array_records.values()))
    floats = all(a.stype == "numpy.ndarray" and a.dtype == "float32" for a in record.values())
    digest = _digest(record)
    reply = call_next(msg, ctxt)
    info = _client_info(reply)
    if info is not None:
        info["trained-on-floats"] = floats
        info["model-digest"] = digest
    return reply


client_app = ClientApp(mods=[counting_mod, quantize_mod, seen_mod])
client_app.train()(sim_client.train_fn)
client_app.query()(sim_client.query_fn)


class DigestStrategy(QuantizedStrategy):
    """Records the digest of the model the server rebuilt for each client, and what each client reported."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server_digests: dict[tuple[int, int], str] = {}
        self.client_reports: dict[tuple[int, int], dict] = {}

    def configure_train(self, server_round, arrays, config, grid):
        messages = super().configure_train(server_round, arrays, config, grid)
        for node_id, model in self._rounds.peek("train", server_round).sent.items():
            self.server_digests[server_round, node_id] = _digest(model)
        return messages

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        for reply in replies:
            info = _client_info(reply)
            if info is not None:
                self.client_reports[server_round, reply.metadata.src_node_id] = dict(info)
        return super().aggregate_train(server_round, replies)


RESULTS: dict = {}


def _make_server_app(out_dir: str) -> ServerApp:
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context) -> None:
        wait_for_nodes(grid, NUM_NODES)
        settings = SimSettings(codec=CODEC, local_epochs=1, out_dir=out_dir)
        test = load_test_set(settings.dataset)
        model = build_model(settings.model, test.input_shape, test.num_classes, seed=settings.seed)
        strategy = DigestStrategy(
            SeededFedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=1, seed=1),
            codec=CODEC,
            seed=1,
            min_numel=settings.min_numel,
            downlink_codec=CODEC,
            downlink_references=6,
        )
        strategy.start(
            grid, ArrayRecord(model.state_dict()), num_rounds=5, train_config=ConfigRecord(settings.as_config())
        )
        RESULTS["skips"] = strategy
        common = {"rounds": 5, "fraction-train": 1.0, "local-epochs": 3}
        for name, downlink in (("dense", "none"), ("qsgd", CODEC)):
            config = settings.replace(run_name=name).as_config()
            RESULTS[name] = run_server(grid, {**config, **common, "downlink-codec": downlink})
        config = settings.replace(run_name="deadline").as_config()
        extra = {"rounds": 3, "fraction-train": 0.5, "uplink": UPLINK, "upload-deadline-seconds": DEADLINE}
        RESULTS["deadline"] = run_server(grid, {**config, **extra})
        RESULTS["model"] = ArrayRecord(model.state_dict())

    return server_app


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from flwr.simulation import run_simulation

    RESULTS.clear()
    run_simulation(
        _make_server_app(str(tmp_path_factory.mktemp("both"))),
        client_app,
        num_supernodes=NUM_NODES,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    assert "deadline" in RESULTS, "the ServerApp did not finish"
    return RESULTS


def test_clients_that_skip_rounds_rebuild_the_servers_model(results):
    strategy = results["skips"]
    reports = strategy.client_reports
    assert len(reports) == 5 * NUM_NODES // 2
    for key, report in reports.items():
        assert report["model-digest"] == strategy.server_digests[key], key
        assert report["trained-on-floats"] is True
    # Some client came back after skipping a round and was sent a difference to the model it held.
    returning = [
        (r, n) for (r, n), rep in reports.items() if (r - 1, n) not in reports and rep["downlink-base"] != NO_REFERENCE
    ]
    assert returning, "no client returned from a skipped round with a kept reference"
    assert any(rep["downlink-base"] == NO_REFERENCE for (r, _), rep in reports.items() if r > 1)


def test_downlink_bytes_are_counted_and_4x_below_dense(results):
    dense, qsgd = results["dense"], results["qsgd"]
    for history in (dense, qsgd):
        for server_round in range(1, 6):
            row = history.rounds[server_round]
            counted = [c["counted-downlink-bytes"] for c in history.clients if c["round"] == server_round]
            assert len(counted) == NUM_NODES
            assert row["downlink-bytes"] == sum(counted)
            assert all(c["trained-on-floats"] for c in history.clients)
    for server_round in range(2, 6):
        row = qsgd.rounds[server_round]
        assert row["downlink-bytes"] * 4 <= row["downlink-bytes-dense"]
        assert row["downlink-bytes-dense"] == dense.rounds[server_round]["downlink-bytes"]
    assert qsgd.rounds[1]["downlink-compression-ratio"] == pytest.approx(2.0, rel=0.1)  # fp16 full models


def test_compressed_downlink_converges_like_dense(results):
    dense, qsgd = results["dense"].final["accuracy"], results["qsgd"].final["accuracy"]
    assert dense > 0.9
    assert abs(qsgd - dense) <= 0.01


def test_every_round_meets_the_upload_deadline(results):
    history = results["deadline"]
    profile = parse_uplink(UPLINK, seed=0)
    coarsest = RecordCodec(get_codec(COARSEST), min_numel=1).predict_bytes(results["model"])
    slowest = min(profile.mbps(p) for p in range(NUM_NODES)) * 1e6 / 8
    assert coarsest / slowest <= DEADLINE, "the coarsest setting cannot meet this deadline: change the test"
    chosen_spread = []
    for row in history.rounds[1:]:
        assert row["deadline-met-fraction"] == 1.0
        assert 0 < row["simulated-upload-seconds"] <= DEADLINE
        chosen_spread.append(row["chosen-setting-max"] - row["chosen-setting-min"])
    assert max(chosen_spread) > 0  # clients on different links got different settings
    uploads = [c for c in history.clients if "partition-id" in c]
    assert np.unique([c["partition-id"] for c in uploads]).size > 1
