"""Secure rounds end to end in process: the real ``QuantizedStrategy(secure_aggregation=...)`` and
the real ``quantize_mod`` over an in-process Grid (no Ray), with dropouts and forged replies.

The expected model is rebuilt from what the clients really encoded (their integer vectors,
recorded by wrapping ``encode_update``), so "the model is received + the decoded mean" is checked
exactly, not within a tolerance.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp.strategy import FedAvg

import fedquant.clients.secure as client_secure
from fedquant.clients import quantize_mod
from fedquant.codecs.summable import WEIGHT_SCALE, SumGrid, decode_sum
from fedquant.metrics import HistoryRecorder, message_bytes
from fedquant.secagg import SecAggConfig
from fedquant.secagg.messages import MASKED_RECORD, ORDER, RECORD, STAGES
from fedquant.secagg.wiring import GRID_PREFIX, GRID_RECORD, KEY_DITHER_SEED, UPDATE_SEGMENT, add_flat, float_layout
from fedquant.strategies import QuantizedStrategy
from fedquant.testing.secagg_fuzz import mutate
from tests.flower_fakes import InProcessGrid, global_loss, initial_arrays, make_client_app

NUM_NODES = 6
CONFIG = SecAggConfig(clip=10.0)  # threshold 0.6 of 6 holders: 4


class SecureGrid(InProcessGrid):
    """InProcessGrid that assigns message ids (as the SuperLink does), drops nodes after a stage,
    forges replies per stage, and keeps everything the server received."""

    def __init__(self, num_nodes=NUM_NODES, drop_after=None, tamper=None) -> None:
        super().__init__(make_client_app([quantize_mod]), num_nodes)
        self.drop_after = dict(drop_after or {})
        self.forge = tamper
        self.received: list[tuple[str, Message]] = []  # (stage, reply) of every protocol reply

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        kept = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            record = message.content.config_records.get(RECORD)
            stage = record["stage"] if record is not None else None
            last = self.drop_after.get(message.metadata.dst_node_id)
            if stage is not None and last is not None and ORDER.index(stage) > ORDER.index(last):
                continue
            kept.append((stage, message))
        replies = super().send_and_receive([m for _, m in kept], timeout=timeout)
        out = []
        for (stage, message), reply in zip(kept, replies):
            if stage is not None and self.forge is not None:
                reply = self.forge(stage, message, reply)
                if reply is None:
                    continue
            if stage is not None:
                self.received.append((stage, reply))
            out.append(reply)
        return out


@pytest.fixture
def encodings(monkeypatch):
    """Every client's EncodedUpdate, keyed by its dither seed (the real function, recorded)."""
    seen = {}
    real = client_secure.encode_update

    def recording(update, grid, dither_seed, **kw):
        seen[dither_seed] = enc = real(update, grid, dither_seed, **kw)
        return enc

    monkeypatch.setattr(client_secure, "encode_update", recording)
    return seen


def _strategy(config=CONFIG, **kw) -> QuantizedStrategy:
    return QuantizedStrategy(FedAvg(min_available_nodes=NUM_NODES), "fp32", seed=5, secure_aggregation=config, **kw)


def _collect_requests(grid: SecureGrid) -> list[Message]:
    return [m for m in grid.sent if RECORD in m.content.config_records and GRID_RECORD in m.content.config_records]


def _expected_model(grid: SecureGrid, encodings, model: ArrayRecord, survivors: list[int]) -> dict[str, np.ndarray]:
    """received + decode(sum of the survivors' integer vectors mod 2^b) / survivors (what the server must produce:
    one group, the denominator the number of inputs, whatever weight a client claims)."""
    requests = {m.metadata.dst_node_id: m for m in _collect_requests(grid)}
    sum_grid = SumGrid.from_config(requests[survivors[0]].content.config_records[GRID_RECORD], GRID_PREFIX)
    seeds = [requests[n].content.config_records[GRID_RECORD][KEY_DITHER_SEED] for n in survivors]
    total = sum(encodings[s].integers for s in seeds) % sum_grid.modulus
    summed = decode_sum(total.astype(np.uint32), sum_grid, seeds, WEIGHT_SCALE).numpy().astype(np.float64)
    mean = (summed / len(survivors)).astype(np.float32)
    received = {name: a.numpy() for name, a in model.items()}
    return add_flat(received, mean, float_layout(model))


def _survivors(grid: SecureGrid) -> list[int]:
    return sorted(r.metadata.src_node_id for s, r in grid.received if s == "collect" and not r.has_error())


def test_secure_round_gives_received_plus_the_exact_decoded_mean(encodings):
    grid = SecureGrid()
    strategy = _strategy()
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-failed"] == 0 and metrics["secagg-survivors"] == NUM_NODES
    expected = _expected_model(grid, encodings, initial_arrays(), _survivors(grid))
    for name, array in result.arrays.items():
        np.testing.assert_array_equal(array.numpy(), expected[name])
    assert len(encodings) == NUM_NODES  # every client encoded once, at collect


def test_secure_rounds_train_the_model():
    grid = SecureGrid()
    result = _strategy().start(grid=grid, initial_arrays=initial_arrays(), num_rounds=4)
    assert global_loss(result.arrays, NUM_NODES) < 0.8 * global_loss(initial_arrays(), NUM_NODES)
    assert all(result.train_metrics_clientapp[r]["secagg-failed"] == 0 for r in range(1, 5))


def test_two_clients_dropping_after_share_keys_still_complete(encodings):
    grid = SecureGrid(drop_after={102: "share-keys", 105: "share-keys"})
    result = _strategy().start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-failed"] == 0
    assert metrics["secagg-survivors"] == 4 and metrics["secagg-dropped"] == 2
    assert metrics["secagg-dropped-after-sharing"] == 2
    assert _survivors(grid) == [101, 103, 104, 106]
    expected = _expected_model(grid, encodings, initial_arrays(), _survivors(grid))
    for name, array in result.arrays.items():
        np.testing.assert_array_equal(array.numpy(), expected[name])


def test_below_the_threshold_the_round_fails_cleanly_and_keeps_the_model():
    grid = SecureGrid(drop_after={102: "share-keys", 104: "share-keys", 105: "share-keys"})
    strategy = _strategy()
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    for r in (1, 2):
        assert result.train_metrics_clientapp[r]["secagg-failed"] == 1
        assert result.train_metrics_clientapp[r]["secagg-survivors"] == 0
    assert "fewer than the threshold" in strategy.secure_failures[1]
    assert len(result.arrays) == 0  # no round returned arrays: Flower kept the initial model
    round_two = [m for m in _collect_requests(grid) if m.metadata.group_id == "secagg-2"]
    assert round_two
    for message in round_two:  # and round 2 trained from it
        for name, array in initial_arrays().items():
            np.testing.assert_array_equal(message.content.array_records["arrays"][name].numpy(), array.numpy())


def test_a_server_of_another_payload_format_is_refused_by_every_client(monkeypatch):
    """The update segment's name carries the payload format, whose rotation signs the grid's
    encoding uses: clients of another format refuse it at collect (a round that fails loudly and
    keeps the model), instead of summing differently rotated updates into a wrong one."""
    import fedquant.strategies.stages.secure as secure_stage

    monkeypatch.setattr(secure_stage, "UPDATE_SEGMENT", "update-v4")  # a server of format 4
    grid = SecureGrid()
    strategy = _strategy()
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    assert result.train_metrics_clientapp[1]["secagg-failed"] == 1
    errors = [r.error.reason for stage, r in grid.received if stage == "collect" and r.has_error()]
    assert len(errors) == NUM_NODES
    assert all("'update-v4'" in e and f"'{UPDATE_SEGMENT}'" in e and "payload formats" in e for e in errors)
    assert len(result.arrays) == 0  # Flower kept the initial model


def test_a_failed_round_before_collect_sends_no_train_message():
    grid = SecureGrid(drop_after={n: "advertise" for n in (101, 102, 103)})
    strategy = _strategy()
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    assert result.train_metrics_clientapp[1]["secagg-failed"] == 1
    assert not _collect_requests(grid)
    assert "share-keys" in strategy.secure_failures[1]


def _evil_encoder(monkeypatch, strategy, node, **changes):
    """Node ``node`` ignores the clip: it encodes 1e4 times its update on a grid without the clip."""
    real = client_secure.encode_update
    evil_seed = strategy.client_seed(1, node)

    def encode(update, grid, dither_seed, **kw):
        if dither_seed != evil_seed:
            return real(update, grid, dither_seed, **kw)
        enc = real(update * changes.get("scale", 1.0), dataclasses.replace(grid, clip=1e30), dither_seed, **kw)
        return dataclasses.replace(enc, weight_units=changes.get("units", enc.weight_units))

    monkeypatch.setattr(client_secure, "encode_update", encode)


def test_a_client_ignoring_the_clip_is_caught_by_the_aggregate_norm_check(monkeypatch):
    strategy = _strategy()
    _evil_encoder(monkeypatch, strategy, 103, scale=1e4)
    result = strategy.start(grid=SecureGrid(), initial_arrays=initial_arrays(), num_rounds=1)
    assert result.train_metrics_clientapp[1]["secagg-failed"] == 1
    assert "no group's secure sum is within what clipped clients can send" in strategy.secure_failures[1]
    assert len(result.arrays) == 0  # the round returned no arrays: the model is kept


def test_honest_rounds_pass_the_aggregate_norm_check_with_a_tight_clip():
    # Clip below the honest updates' norms: every client clips, and the decoded mean stays
    # within clip + the error bound (the check cannot reject honest rounds).
    strategy = _strategy(SecAggConfig(clip=0.05))
    result = strategy.start(grid=SecureGrid(), initial_arrays=initial_arrays(), num_rounds=3)
    for r in (1, 2, 3):
        metrics = result.train_metrics_clientapp[r]
        assert metrics["secagg-failed"] == 0
        assert metrics["secagg-aggregate-norm"] <= 0.05 * 1.05


def _forge_weight_total(units: int):
    """The issue's attack: node 104 adds to its masked input a 32-bit weight segment chosen so that the
    round's weight total is ``units`` (masks are additive, so it shifts its masked value by the difference).
    Where the server sums a weight segment, the forged total divides the mean."""
    from flwr.app import Array

    from fedquant.wire.bitpack import pack_bits, unpack_bits

    def forge(stage, request, reply):
        if stage != "collect" or request.metadata.dst_node_id != 104 or reply.has_error():
            return reply
        record = reply.content.array_records[MASKED_RECORD]
        honest_others = (NUM_NODES - 1) * WEIGHT_SCALE
        if "weight" in record:  # shift the masked weight from its own units to the forged ones
            masked = int(unpack_bits(np.frombuffer(record["weight"].data, np.uint8), 32, 1)[0])
            value = (masked - WEIGHT_SCALE + units - honest_others) % (1 << 32)
        else:  # no weight segment to shift: send one anyway
            value = (units - honest_others) % (1 << 32)
        data = pack_bits(np.array([value], np.uint32), 32).tobytes()
        record["weight"] = Array(dtype="uint8", shape=(len(data),), stype=record[UPDATE_SEGMENT].stype, data=data)
        return reply

    return forge


@pytest.mark.parametrize("units", [1, WEIGHT_SCALE], ids=["one-unit", "one-client"])
def test_a_forged_weight_total_cannot_move_the_model(units, encodings):
    """The denominator is the number of inputs, which the server counts: a client that forges a weight
    is dropped (its reply holds a segment nobody asked for) and the model is the others' exact mean."""
    grid = SecureGrid(tamper=_forge_weight_total(units))
    strategy = _strategy()
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-failed"] == 0 and metrics["secagg-survivors"] == NUM_NODES - 1
    assert metrics["secagg-weight-total"] == NUM_NODES - 1
    survivors = [n for n in _survivors(grid) if n != 104]
    expected = _expected_model(grid, encodings, initial_arrays(), survivors)
    for name, array in result.arrays.items():
        np.testing.assert_array_equal(array.numpy(), expected[name])
    assert metrics["secagg-aggregate-norm"] <= CONFIG.clip


def _wire(message: Message) -> int:
    return len(recorddict_to_proto(message.content).SerializeToString())


def test_history_metrics_count_every_stage_from_real_message_bytes(tmp_path):
    grid = SecureGrid(drop_after={106: "share-keys"})
    recorder = HistoryRecorder(tmp_path)
    strategy = _strategy(recorder=recorder)
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    numel = sum(n for _, n in float_layout(initial_arrays()))
    round_two = [(s, r) for s, r in grid.received[len(grid.received) // 2 :]]
    for r in (1, 2):
        metrics = result.train_metrics_clientapp[r]
        assert metrics["secagg-survivors"] == 5 and metrics["secagg-dropped"] == 1
        assert metrics["uplink-bytes"] == sum(metrics[f"secagg-uplink-bytes-{s}"] for s in STAGES)
        assert metrics["bits-per-param"] == pytest.approx(8 * metrics["uplink-bytes"] / (NUM_NODES * numel))
        assert metrics["secagg-bits"] >= CONFIG.bits + 3
    for stage in STAGES:  # every reply of round 2, counted here from its serialized bytes
        want = sum(_wire(m) for s, m in round_two if s == stage and not m.has_error())
        assert result.train_metrics_clientapp[2][f"secagg-uplink-bytes-{stage}"] == want > 0
        whole = sum(message_bytes(m) for s, m in round_two if s == stage)  # metadata and headers too
        assert result.train_metrics_clientapp[2][f"secagg-message-bytes-up-{stage}"] == whole > want
    m2 = result.train_metrics_clientapp[2]
    assert m2["cumulative-uplink-bytes"] == result.train_metrics_clientapp[1]["uplink-bytes"] + m2["uplink-bytes"]
    assert m2["secagg-downlink-bytes"] == sum(m2[f"secagg-downlink-bytes-{s}"] for s in STAGES) > 0
    assert strategy.cumulative_uplink_bytes == m2["cumulative-uplink-bytes"]
    rows = recorder.rows
    assert [row["train/secagg-uplink-bytes-collect"] for row in rows] == [
        result.train_metrics_clientapp[r]["secagg-uplink-bytes-collect"] for r in (1, 2)
    ]


def test_the_server_receives_only_masked_inputs_at_collect():
    grid = SecureGrid()
    _strategy().start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    collect = [r for s, r in grid.received if s == "collect"]
    assert len(collect) == NUM_NODES
    for reply in collect:
        assert set(reply.content.keys()) == {RECORD, MASKED_RECORD}  # no metrics, no arrays, no client info
        assert set(reply.content.array_records[MASKED_RECORD].keys()) == {UPDATE_SEGMENT}  # no weight segment
    assert all(not r.content.metric_records for _, r in grid.received if not r.has_error())


def test_only_collect_reaches_the_train_function_and_it_sees_a_plain_train_message():
    from flwr.clientapp import ClientApp

    from tests import flower_fakes

    seen = []

    def train(msg, context):
        seen.append(sorted(msg.content.keys()))
        return flower_fakes.train(msg, context)

    app = ClientApp(mods=[quantize_mod])
    app.train()(train)
    app.evaluate()(flower_fakes.evaluate)
    grid = SecureGrid()
    grid.app = app
    _strategy().start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    assert seen == [["arrays", "config"]] * NUM_NODES  # once per client, no protocol record in it
    assert len([s for s, _ in grid.received]) == 4 * NUM_NODES


def _replay(state):
    """Forge: at the chosen stage, the victim answers with its reply of the previous stage."""

    def forge(stage, request, reply):
        node = request.metadata.dst_node_id
        if node == state["victim"] and not reply.has_error():
            if stage == state["stage"] and state.get("previous") is not None:
                return state["previous"]
            state["previous"] = reply
        return reply

    return forge


@pytest.mark.parametrize("stage", ["share-keys", "collect", "unmask"])
def test_a_replayed_reply_is_a_dropout(stage):
    state = {"victim": 103, "stage": stage}
    grid = SecureGrid(tamper=_replay(state))
    strategy = _strategy()
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-failed"] == 0
    if stage == "unmask":  # its input is already summed; its shares are not needed
        assert metrics["secagg-survivors"] == NUM_NODES
    else:
        assert metrics["secagg-survivors"] == NUM_NODES - 1


FUZZ_CASES = 36


def test_fuzzed_replies_through_the_stage_never_crash_hang_or_move_the_model_silently():
    """Each case mutates one reply of one node at one stage with secagg_fuzz's mutators."""
    outcomes = {"completed": 0, "failed": 0}
    baseline = initial_arrays()
    for case in range(FUZZ_CASES):
        rng = np.random.default_rng([19, case])
        stage = STAGES[case % len(STAGES)]
        victim = 101 + int(rng.integers(NUM_NODES))

        def forge(s, request, reply, stage=stage, victim=victim, rng=rng):
            if s != stage or request.metadata.dst_node_id != victim or reply.has_error():
                return reply
            _, content, _ = mutate(rng, reply.content)
            return Message(content, reply_to=request)

        strategy = _strategy()
        start = time.perf_counter()
        result = strategy.start(grid=SecureGrid(tamper=forge), initial_arrays=baseline, num_rounds=1)
        assert time.perf_counter() - start < 30, f"case {case} ({stage}) was slow"
        metrics = result.train_metrics_clientapp[1]
        if metrics["secagg-failed"]:
            outcomes["failed"] += 1
            assert len(result.arrays) == 0, f"case {case} ({stage}): a failed round returned arrays"
        else:
            outcomes["completed"] += 1
            assert metrics["secagg-survivors"] >= 4
            assert metrics["secagg-aggregate-norm"] <= CONFIG.clip * 1.5
            assert np.isfinite(result.arrays["fc.weight"].numpy()).all()
    assert outcomes["completed"] > FUZZ_CASES // 2  # one bad node in six is outvoted or dropped


def test_wrong_length_masked_input_is_a_dropout():
    def forge(stage, request, reply):
        if stage == "collect" and request.metadata.dst_node_id == 101:
            content = reply.content
            arr = content.array_records[MASKED_RECORD][UPDATE_SEGMENT]
            from flwr.app import Array

            content.array_records[MASKED_RECORD][UPDATE_SEGMENT] = Array(
                dtype="uint8", shape=(len(arr.data) - 1,), stype=arr.stype, data=arr.data[:-1]
            )
        return reply

    result = _strategy().start(grid=SecureGrid(tamper=forge), initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-failed"] == 0 and metrics["secagg-survivors"] == NUM_NODES - 1
    assert metrics["secagg-dropped-after-sharing"] == 1


def test_secure_aggregation_refuses_downlink_compression_and_budgets():
    with pytest.raises(ValueError, match="downlink_codec"):
        _strategy(downlink_codec="qsgd:levels=16")
    with pytest.raises(ValueError, match="upload budget"):
        _strategy(uplink_bytes_budget=10_000)
    with pytest.raises(ValueError, match="SecAggConfig"):
        QuantizedStrategy(FedAvg(), "fp32", secure_aggregation={"bits": 2})


def test_weighted_clients_are_divided_by_the_number_of_inputs(encodings):
    """max_examples scales each update by min(examples, max) / max on the client; the server divides
    by the inputs it counted (the fixed-denominator estimator), never by a weight a client reports."""
    cfg = SecAggConfig(clip=10.0, max_examples=200)  # 96 examples each: weight 0.48
    grid = SecureGrid()
    result = _strategy(cfg).start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-failed"] == 0 and metrics["secagg-weight-total"] == NUM_NODES
    assert {e.weight_units for e in encodings.values()} == {round(96 / 200 * WEIGHT_SCALE)}
    expected = _expected_model(grid, encodings, initial_arrays(), _survivors(grid))
    for name, array in result.arrays.items():
        np.testing.assert_array_equal(array.numpy(), expected[name])


def test_distributed_dp_adds_the_noise_it_accounts_for(monkeypatch):
    # Each client adds discrete Gaussian noise to its integers; the server's mean error is the
    # rounding plus the n clients' noise, E||err||^2 = error_scale^2, and its spread is that of a
    # sum of ~independent squares: Var = 2 sum_k d_k (step_k^2 per_unit)^2 (Gaussian kurtosis).
    from fedquant.strategies.secure_round import error_scale

    config = dataclasses.replace(CONFIG, noise_multiplier=1.0)
    seen = {}
    real = client_secure.encode_update

    def recording(update, grid, dither_seed, **kw):
        encoded = real(update, grid, dither_seed, **kw)
        seen[dither_seed] = (encoded, update.detach().reshape(-1).double().numpy())
        return encoded

    monkeypatch.setattr(client_secure, "encode_update", recording)
    grid = SecureGrid()
    result = _strategy(config).start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    assert result.train_metrics_clientapp[1]["secagg-survivors"] == NUM_NODES
    request = _collect_requests(grid)[0].content.config_records[GRID_RECORD]
    sum_grid = SumGrid.from_config(request, GRID_PREFIX)
    assert sum_grid.noise_variance > 0
    units = sum(e.weight_units for e, _ in seen.values())
    true = sum((e.weight_units / units) * u * min(1.0, config.clip / e.norm) for e, u in seen.values())
    decoded = np.concatenate([(result.arrays[n].numpy() - a.numpy()).reshape(-1) for n, a in initial_arrays().items()])
    err2 = float(np.sum((decoded - true) ** 2))
    expected = error_scale(sum_grid, NUM_NODES, units / WEIGHT_SCALE) ** 2
    noiseless = error_scale(dataclasses.replace(sum_grid, noise_variance=0.0), NUM_NODES, units / WEIGHT_SCALE) ** 2
    assert expected > 10 * noiseless  # the check below sees the noise, not the rounding
    steps = np.asarray(sum_grid.steps, dtype=np.float64)
    per_unit = expected / float(np.sum(sum_grid.real_elements_per_block() * steps**2))
    sd = np.sqrt(2 * np.sum(sum_grid.real_elements_per_block() * (steps**2 * per_unit) ** 2))
    assert abs(err2 - expected) < 6 * sd, (err2, expected, sd)


def test_dp_epsilon_grows_with_every_round_and_is_reported_with_delta():
    config = dataclasses.replace(CONFIG, noise_multiplier=1.0)
    result = _strategy(config).start(grid=SecureGrid(), initial_arrays=initial_arrays(), num_rounds=3)
    metrics = [result.train_metrics_clientapp[r] for r in (1, 2, 3)]
    eps = [m["dp-epsilon"] for m in metrics]
    assert 0 < eps[0] < eps[1] < eps[2] < float("inf")
    assert all(m["dp-delta"] == config.delta and 0 < m["dp-round-epsilon"] <= m["dp-epsilon"] for m in metrics)
    assert all(m["secagg-failed"] == 0 for m in metrics)


# ------------------------------------------------------------------ groups: clip cheats and denial of service
def _cheat(monkeypatch, strategy, node, make):
    """Node ``node`` encodes ``make(update)`` on a grid without the clip (it skips clipping)."""
    real = client_secure.encode_update
    cheat_seed = strategy.client_seed(1, node)

    def encode(update, grid, dither_seed, **kw):
        if dither_seed != cheat_seed:
            return real(update, grid, dither_seed, **kw)
        return real(make(update), dataclasses.replace(grid, clip=1e30), dither_seed, **kw)

    monkeypatch.setattr(client_secure, "encode_update", encode)


def _group_of(grid: SecureGrid, node: int) -> list[int]:
    advertise = [m for m in grid.sent if m.metadata.dst_node_id == node
                 and m.content.config_records.get(RECORD, {}).get("stage") == "advertise"]  # fmt: skip
    return list(advertise[0].content.config_records[RECORD]["holders"])


def _random_direction(update, norm):
    direction = np.random.default_rng(3).standard_normal(update.numel())
    return update.new_tensor(direction / np.linalg.norm(direction) * norm).reshape(update.shape)


def test_a_client_skipping_the_clip_loses_only_its_group_and_is_named(monkeypatch, encodings, caplog):
    """The issue's attack: one client adds a vector that moves the mean by the clip (norm n * C) in a
    random direction. With two groups its group's sum is out of reach of clipped clients: left out and
    its members logged; the model is the other group's exact mean (the cheat moves it by nothing)."""
    config = dataclasses.replace(CONFIG, groups=2)
    strategy = _strategy(config)
    _cheat(monkeypatch, strategy, 104, lambda u: _random_direction(u, NUM_NODES * config.clip))
    grid = SecureGrid()
    with caplog.at_level("WARNING"):
        result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    group = _group_of(grid, 104)
    assert len(group) == 3 and metrics["secagg-groups"] == 2
    assert metrics["secagg-failed"] == 0 and metrics["secagg-refused-groups"] == 1
    assert metrics["secagg-survivors"] == 3 and metrics["secagg-refused-inputs"] == 3
    assert f"nodes {group}" in caplog.text and "ignored the clip" in caplog.text
    others = [n for n in _survivors(grid) if n not in group]
    expected = _expected_model(grid, encodings, initial_arrays(), others)
    for name, array in result.arrays.items():
        np.testing.assert_array_equal(array.numpy(), expected[name])


@pytest.mark.parametrize("groups", [1, 2])
def test_extreme_masked_values_from_one_client_deny_at_most_its_group(groups, caplog):
    """One client sends uniform random values (the worst a masked vector can hold): one group refuses
    the round and keeps the model; with two groups the other group's mean goes through."""

    def forge(stage, request, reply):
        if stage == "collect" and request.metadata.dst_node_id == 102 and not reply.has_error():
            from flwr.app import Array

            record = reply.content.array_records[MASKED_RECORD]
            data = np.random.default_rng(1).bytes(len(record[UPDATE_SEGMENT].data))
            sgrid = SumGrid.from_config(request.content.config_records[GRID_RECORD], GRID_PREFIX)
            from fedquant.wire.bitpack import pack_bits, unpack_bits

            values = unpack_bits(np.frombuffer(data, np.uint8), sgrid.bits, sgrid.padded_numel)
            packed = pack_bits(values, sgrid.bits).tobytes()  # canonical, so only the values are extreme
            record[UPDATE_SEGMENT] = Array(dtype="uint8", shape=(len(packed),), stype=record[UPDATE_SEGMENT].stype,
                                           data=packed)  # fmt: skip
        return reply

    strategy = _strategy(dataclasses.replace(CONFIG, groups=groups))
    result = strategy.start(grid=SecureGrid(tamper=forge), initial_arrays=initial_arrays(), num_rounds=1)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-refused-groups"] == 1
    if groups == 1:
        assert metrics["secagg-failed"] == 1 and len(result.arrays) == 0  # refused, model kept
    else:
        assert metrics["secagg-failed"] == 0 and metrics["secagg-survivors"] == 3
        assert metrics["secagg-aggregate-norm"] <= CONFIG.clip


def test_groups_size_the_modulus_for_the_group_and_keep_exact_sums(encodings):
    grid = SecureGrid()
    one = _strategy().start(grid=SecureGrid(), initial_arrays=initial_arrays(), num_rounds=1)
    two = _strategy(dataclasses.replace(CONFIG, groups=2)).start(grid=grid, initial_arrays=initial_arrays(),
                                                                 num_rounds=1)  # fmt: skip
    m1, m2 = one.train_metrics_clientapp[1], two.train_metrics_clientapp[1]
    assert m2["secagg-failed"] == 0 and m2["secagg-groups"] == 2 and m2["secagg-survivors"] == NUM_NODES
    assert m2["secagg-bits"] == m1["secagg-bits"] - 1  # sums of 3 need ceil(log2 3) = 2 bits, of 6 need 3
    groups = {tuple(_group_of(grid, n)) for n in range(101, 101 + NUM_NODES)}
    assert sorted(len(g) for g in groups) == [3, 3] and sorted(n for g in groups for n in g) == list(range(101, 107))


def test_a_shared_subset_of_coordinates_gives_the_exact_rescaled_mean_at_fewer_bits(encodings):
    grid = SecureGrid()
    full = _strategy().start(grid=SecureGrid(), initial_arrays=initial_arrays(), num_rounds=1)
    result = _strategy(dataclasses.replace(CONFIG, keep=0.25)).start(grid=grid, initial_arrays=initial_arrays(),
                                                                     num_rounds=1)  # fmt: skip
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg-failed"] == 0
    expected = _expected_model(grid, encodings, initial_arrays(), _survivors(grid))
    for name, array in result.arrays.items():
        np.testing.assert_array_equal(array.numpy(), expected[name])
    full_collect = full.train_metrics_clientapp[1]["secagg-uplink-bytes-collect"]
    assert metrics["secagg-uplink-bytes-collect"] < 0.4 * full_collect


# ------------------------------------------------------------------ signed rounds through the mod
def _give_identities(grid: SecureGrid, tmp_path, skip=()) -> None:
    from fedquant.clients.secure import DIRECTORY_FILE, IDENTITY_FILE
    from fedquant.secagg.crypto import identity_public

    keys = {node: bytes([node % 256]) * 32 for node in grid.contexts}
    directory = tmp_path / "directory.txt"
    directory.write_text("".join(f"{n} {identity_public(k).hex()}\n" for n, k in keys.items()))
    for node, context in grid.contexts.items():
        if node in skip:
            continue
        (tmp_path / f"{node}.key").write_text(keys[node].hex())
        context.node_config[IDENTITY_FILE] = str(tmp_path / f"{node}.key")
        context.node_config[DIRECTORY_FILE] = str(directory)


def test_signed_rounds_through_the_mod_give_the_exact_mean(tmp_path, encodings):
    grid = SecureGrid(drop_after={105: "collect"})  # its input arrives, then it misses consistency
    _give_identities(grid, tmp_path)
    result = _strategy(dataclasses.replace(CONFIG, signed=True)).start(grid=grid, initial_arrays=initial_arrays(),
                                                                       num_rounds=2)  # fmt: skip
    for r in (1, 2):
        metrics = result.train_metrics_clientapp[r]
        assert metrics["secagg-failed"] == 0 and metrics["secagg-survivors"] == NUM_NODES
        consistency = [m for s, m in grid.received if s == "consistency" and not m.has_error()]
        assert len(consistency) == 2 * (NUM_NODES - 1) and metrics["secagg-uplink-bytes-consistency"] > 0
    assert {s for s, _ in grid.received} == {"advertise", "share-keys", "collect", "consistency", "unmask"}


def test_a_node_without_an_identity_refuses_a_signed_round(tmp_path):
    grid = SecureGrid()
    _give_identities(grid, tmp_path, skip={103})
    strategy = _strategy(dataclasses.replace(CONFIG, signed=True))
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    assert result.train_metrics_clientapp[1]["secagg-survivors"] == NUM_NODES - 1
    errors = [r.error.reason for s, r in grid.received if s == "advertise" and r.has_error()]
    assert len(errors) == 1 and "no identity key" in errors[0]
