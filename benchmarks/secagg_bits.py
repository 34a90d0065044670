"""Bits per parameter on the wire of a secure round, every protocol stage counted: ``python -m benchmarks.secagg_bits``.

Runs one round of 20 clients on the default model (the digits CNN of ``simulations/models.py``,
13,706 parameters; real updates: each client trains 1 epoch on its iid part of digits from the
same initial model) twice, side by side:

* fedquant's SecAgg+ over the summable codec (:mod:`fedquant.secagg`), at several quantizer
  bits, the grid sized from the true mean of the round (what the previous aggregate predicts),
  with and without 2 clients dropping after key sharing;
* Flower 1.42's legacy SecAgg+ (``SecAggPlusWorkflow`` + ``secaggplus_mod``, its own code and
  defaults: clip +-8, 2^22 levels, 2^32 modulus), driven through a legacy context and an
  in-process grid.

Every message of every stage is counted as its content serialized to Flower's protobuf
(``recorddict_to_proto(...).SerializeToString()``, what the transport carries besides the
envelope). ``up`` is client -> server, ``down`` is the protocol's server -> client traffic (keys,
forwarded shares, unmask lists; the model itself is excluded, as it travels without secure
aggregation too). Bits per parameter are per client: total bytes * 8 / (clients * parameters).
The relative error is ``||decoded mean - float mean||^2 / ||float mean||^2``.

Also runs the compressed configurations (``COMPRESSED_CNN``, ``COMPRESSED_LARGE``) on the CNN and
on an MLP of 1,059,850 parameters. Exits 1 when the compressed CNN round exceeds 4 uplink bits per
parameter, the compressed 1M round 2.5, the default 16, or any round wraps.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from fedquant.codecs.summable import WEIGHT_SCALE, decode_sum, encode_update, wrapped
from fedquant.metrics import message_bytes
from fedquant.secagg import LoopbackGrid, SecAggClient, SecAggConfig, SecAggServer, Segment, run_secure_sum
from fedquant.secagg.messages import RECORD, STAGES

TARGET_CNN_BITS = 4.0
TARGET_LARGE_BITS = 2.5
#: The compressed configurations: 1 quantizer bit, a SecAgg+ neighbourhood of 4, and a shared
#: random subset of the rotated coordinates (unbiased after rescaling; see docs/secure-aggregation.md).
COMPRESSED_CNN = SecAggConfig(bits=1, clip=10.0, neighbours=4, keep=0.35)
COMPRESSED_LARGE = SecAggConfig(bits=1, clip=10.0, neighbours=4, keep=0.25)
DEFAULT_BITS = SecAggConfig().bits
CLIENTS = 20
GRID_RECORD = "fedquant.secagg.grid"


def wire_bytes(content: RecordDict) -> int:
    """Bytes of a message's content as Flower serializes it."""
    return len(recorddict_to_proto(content).SerializeToString())


def client_updates(clients: int, seed: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The CNN's initial weights and each client's real update (flattened float32)."""
    from simulations.models import build_model

    torch.set_num_threads(1)
    return _trained_updates(build_model("cnn", (1, 8, 8), 10, seed=seed), clients, seed)


def _trained_updates(model: torch.nn.Module, clients: int, seed: int) -> tuple[dict[str, torch.Tensor], list]:
    """The model's initial weights and each client's update after one epoch on its digits part."""
    from simulations.data import load_partition
    from simulations.task import train

    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = []
    for p in range(clients):
        model.load_state_dict(start)
        train(model, load_partition("digits", p, clients, seed=seed), epochs=1, batch_size=16, lr=0.05, seed=seed + p)
        out.append(torch.cat([(v.detach() - start[k]).reshape(-1).float() for k, v in model.state_dict().items()]))
    return start, out


@dataclass
class Row:
    name: str
    up: dict[str, int]  # stage -> bytes, summed over clients
    down: dict[str, int]
    params: int
    clients: int
    error: float = float("nan")
    bits: int = 0
    wraps: int = 0
    message_up: dict[str, int] | None = None  # stage -> whole replies (fedquant.metrics.messages_bytes)

    def up_bits(self) -> float:
        return 8 * sum(self.up.values()) / (self.clients * self.params)

    def down_bits(self) -> float:
        return 8 * sum(self.down.values()) / (self.clients * self.params)


def fedquant_round(updates: list[torch.Tensor], config: SecAggConfig, dropouts: int, seed: int, name: str = "") -> Row:
    """One fedquant secure round; bytes per stage from the Messages, the decoded mean's error."""
    n, d = len(updates), updates[0].numel()
    mean = torch.stack(updates).mean(0)
    grid = config.scale_rule().grid(d, n, rotation_seed=seed, previous_mean=mean.numpy())
    nodes = [100 + i for i in range(n)]
    encoded = {}

    def encoder(i: int):
        def encode(content: RecordDict, spec: dict) -> dict:
            enc = encode_update(updates[i], grid, 7000 + i, rng=np.random.default_rng([seed, i]))
            encoded[nodes[i]] = enc
            return {"update": enc.values}

        return encode

    segments = [Segment("update", grid.sent_numel, grid.bits)]  # no weight: the server counts the inputs
    server = SecAggServer(config, nodes, segments, server_round=1)
    drop = {nodes[j]: "share-keys" for j in range(1, 1 + 5 * dropouts, 5)}
    clients = {nid: SecAggClient(nid) for nid in nodes}
    transport = LoopbackGrid(clients, {nid: encoder(i) for i, nid in enumerate(nodes)}, drop)
    grid_record = RecordDict({GRID_RECORD: ConfigRecord(grid.to_config("fedquant.secagg.grid."))})
    extra = lambda stage, node: grid_record if stage == "collect" else None  # noqa: E731
    result = run_secure_sum(server, transport.send_and_receive, extra)
    if result is None:
        raise RuntimeError(f"secure round failed: {server.failure}")
    up, down = defaultdict(int), defaultdict(int)
    for m in transport.replies:
        up[m.content.config_records[RECORD]["stage"]] += wire_bytes(m.content)
    for m in transport.requests:
        down[m.content.config_records[RECORD]["stage"]] += wire_bytes(m.content)
    whole = defaultdict(int)  # what the app's message-bytes-up counts: metadata and object headers too
    for m in transport.replies:
        whole[m.content.config_records[RECORD]["stage"]] += message_bytes(m)
    survivors = [nodes.index(s) for s in result.survivors]
    decoded = decode_sum(result.sums["update"], grid, [7000 + i for i in survivors], len(survivors) * WEIGHT_SCALE)
    true = torch.stack([updates[i] for i in survivors]).mean(0).double()
    error = float(((decoded.double() - true) ** 2).sum() / (true**2).sum())
    wraps = wrapped(sum(encoded[s].integers for s in result.survivors), grid.bits)
    name = name or f"fedquant q={config.bits}"
    name += f", {dropouts} drop" if dropouts else ""
    return Row(name, dict(up), dict(down), d, n, error, grid.bits, wraps, dict(whole))


class _LegacyGrid:
    """Runs Flower's ``secaggplus_mod`` per node in-process and counts every message's bytes."""

    def __init__(self, nodes: list[int], fit) -> None:
        from flwr.app import Context

        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                         for n in nodes}
        self.fit = fit
        self.up, self.down = defaultdict(int), defaultdict(int)

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.client.mod.secure_aggregation.secaggplus_mod import secaggplus_mod
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        replies = []
        for msg in messages:
            msg = copy.deepcopy(msg)  # a real transport gives each node its own copy; the mod edits it
            stage = msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            self.down[stage] += wire_bytes(msg.content) - self._model_bytes(msg.content)
            reply = secaggplus_mod(msg, self.contexts[msg.metadata.dst_node_id], self.fit)
            self.up[stage] += wire_bytes(reply.content)
            replies.append(reply)
        return replies

    @staticmethod
    def _model_bytes(content: RecordDict) -> int:
        if not content.array_records:
            return 0
        return wire_bytes(RecordDict(dict(content.array_records)))


def legacy_round(updates: list[torch.Tensor], start: dict[str, torch.Tensor]) -> Row:
    """One round of Flower's legacy SecAgg+ (its defaults) on the same model, bytes per stage."""
    from flwr.app import Context, Message
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import ServerConfig
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow

    n = len(updates)
    nodes = [100 + i for i in range(n)]
    shapes = [v.shape for v in start.values()]
    base = [v.numpy() for v in start.values()]

    def client_arrays(i: int) -> list[np.ndarray]:
        flat, out, pos = updates[i].numpy(), [], 0
        for b, shape in zip(base, shapes):
            size = int(np.prod(shape))
            out.append((b.reshape(-1) + flat[pos : pos + size]).reshape(shape).astype(np.float32))
            pos += size
        return out

    def fit(msg: Message, ctxt: Context) -> Message:
        i = nodes.index(ctxt.node_id)
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(client_arrays(i)), 100, {})
        return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)

    grid = _LegacyGrid(nodes, fit)
    manager = SimpleClientManager()
    for nid in nodes:
        manager.register(GridClientProxy(nid, grid, 1))
    strategy = FedAvg(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n, fraction_evaluate=0.0)
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            ServerConfig(num_rounds=1), strategy, manager)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({"current_round": 1})
    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(base), keep_input=True)
    SecAggPlusWorkflow(num_shares=n, reconstruction_threshold=0.6)(grid, context)
    aggregated = compat.arrayrecord_to_parameters(context.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
    from flwr.common import parameters_to_ndarrays

    got = np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(aggregated)]) - np.concatenate(
        [b.reshape(-1) for b in base])
    true = torch.stack(updates).mean(0).double().numpy()
    error = float(np.sum((got - true) ** 2) / np.sum(true**2))
    return Row("Flower legacy SecAgg+", dict(grid.up), dict(grid.down), updates[0].numel(), n, error, 64, 0)


def wrap_rates(updates: list[torch.Tensor], quantizer_bits: int, seed: int) -> list[tuple[int, float, float]]:
    """(bits, measured wrap fraction, sub-Gaussian bound per coordinate) for the rule's width and narrower."""
    import dataclasses

    from fedquant.codecs.summable import wrap_bound

    n, d = len(updates), updates[0].numel()
    mean = torch.stack(updates).mean(0).numpy()
    grid = SecAggConfig(bits=quantizer_bits, clip=10.0).scale_rule().grid(d, n, seed, mean)
    out = []
    for bits in range(grid.bits, grid.bits - 4, -1):
        small = dataclasses.replace(grid, bits=bits)
        total = sum(encode_update(u, small, 7000 + i).integers for i, u in enumerate(updates))
        out.append((bits, wrapped(total, bits) / grid.padded_numel, wrap_bound(bits, n, quantizer_bits, 0.0, 1)))
    return out


def format_table(rows: list[Row]) -> str:
    stages = ["advertise", "share-keys", "collect", "unmask"]
    legacy_names = {"advertise": "setup", "share-keys": "share_keys", "collect": "collect_masked_vectors",
                    "unmask": "unmask"}
    head = f"{'configuration':26s} {'b':>3s} " + " ".join(f"{s + ' up':>15s}" for s in stages)
    head += f" {'up bits/param':>14s} {'down bits/param':>16s} {'rel. error':>11s} {'wraps':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        legacy = r.name.startswith("Flower")
        per = [r.up.get(legacy_names[s] if legacy else s, 0) // r.clients for s in stages]
        lines.append(f"{r.name:26s} {r.bits:3d} " + " ".join(f"{p:13d} B" for p in per)
                     + f" {r.up_bits():14.2f} {r.down_bits():16.2f} {r.error:11.2e} {r.wraps:6d}")
    return "\n".join(lines)


def large_updates(clients: int, seed: int) -> list[torch.Tensor]:
    """Updates of a 1,059,850-parameter MLP (64 -> 1024 -> 960 -> 10 on digits' 8x8 inputs): each client
    trains one epoch on its digits part from the same initial model (real updates, as for the CNN)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 960), torch.nn.ReLU(), torch.nn.Linear(960, 10))  # fmt: skip
    for param in model.parameters():
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.03)
    return _trained_updates(model, clients, seed)[1]


def main(argv: list[str] | None = None) -> int:
    from tests.flower_fakes import set_task_identity

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bits", type=int, nargs="*", default=[1, 2, 3, 4, 6])
    parser.add_argument("--skip-legacy", action="store_true", help="leave out Flower's legacy SecAgg+ row")
    args = parser.parse_args(argv)
    logging.getLogger("fedquant.secagg").setLevel(logging.ERROR)
    set_task_identity()
    began = time.perf_counter()
    start, updates = client_updates(CLIENTS, args.seed)
    rows = [fedquant_round(updates, SecAggConfig(bits=q, clip=10.0), 0, args.seed) for q in args.bits]
    rows.append(fedquant_round(updates, SecAggConfig(bits=DEFAULT_BITS, clip=10.0), 2, args.seed))
    rows.append(fedquant_round(updates, COMPRESSED_CNN, 0, args.seed, "compressed (CNN)"))
    rows.append(fedquant_round(updates, COMPRESSED_CNN, 2, args.seed, "compressed (CNN)"))
    if not args.skip_legacy:
        rows.append(legacy_round(updates, start))
    print(f"secure round, {CLIENTS} clients, digits CNN ({updates[0].numel()} parameters), seed {args.seed} "
          f"({time.perf_counter() - began:.0f} s); bytes per client and stage as serialized Flower records")
    print(format_table(rows))
    big = large_updates(CLIENTS, args.seed)
    large = [fedquant_round(big, SecAggConfig(bits=DEFAULT_BITS, clip=10.0, neighbours=COMPRESSED_CNN.neighbours),
                            0, args.seed, "q=2, k=4 (1M MLP)"),
             fedquant_round(big, COMPRESSED_LARGE, 0, args.seed, "compressed (1M MLP)")]  # fmt: skip
    print(f"\nthe same round on an MLP of {big[0].numel():,} parameters (real updates of one epoch on digits)")
    print(format_table(large))
    default = next(r for r in rows if r.name == f"fedquant q={DEFAULT_BITS}")
    small, big_row = rows[-3 if not args.skip_legacy else -2], large[-1]
    print(f"default (q={DEFAULT_BITS}): {default.up_bits():.2f} uplink bits/param"
          + (f"; Flower legacy {rows[-1].up_bits():.2f}" if not args.skip_legacy else ""))
    print(f"compressed: CNN {small.up_bits():.2f} (target <= {TARGET_CNN_BITS:g}), "
          f"1M MLP {big_row.up_bits():.2f} (target <= {TARGET_LARGE_BITS:g}) uplink bits/param, every stage counted")
    for row in (rows[-3 if not args.skip_legacy else -2], rows[-2 if not args.skip_legacy else -1]):
        per = " ".join(f"{s} {row.message_up.get(s, 0) // row.clients} B" for s in STAGES)
        print(f"{row.name}: whole messages as the app's message-bytes-up counts them (metadata and headers too), "
              f"per client: {per}; {8 * sum(row.message_up.values()) / (row.clients * row.params):.2f} bits/param")
    print(f"wrap-around at q={DEFAULT_BITS} (this round's updates, grid from their mean, growth 2): bits, "
          "measured fraction of coordinates, bound per coordinate")
    for bits, rate, bound in wrap_rates(updates, DEFAULT_BITS, args.seed):
        print(f"  b={bits:2d}  measured {rate:.2e}  bound {bound:.2e}")
    checks = {
        "default within 16 bits/param": default.up_bits() <= 16.0,
        f"compressed CNN <= {TARGET_CNN_BITS:g}": small.up_bits() <= TARGET_CNN_BITS,
        f"compressed 1M MLP <= {TARGET_LARGE_BITS:g}": big_row.up_bits() <= TARGET_LARGE_BITS,
        "no wrap, finite errors": all(r.wraps == 0 and math.isfinite(r.error) for r in rows[:-1] + large),
    }
    for what, ok in checks.items():
        if not ok:
            print(f"MISS: {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
