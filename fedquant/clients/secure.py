"""The client's part of a secure round: ``quantize_mod`` routes every SecAgg+ message here.

The protocol state lives in ``Context.state`` between the stages (:data:`~fedquant.secagg.wiring.STATE_KEY`).
Only the *collect* request reaches the ClientApp: it trains on the model and config it carries,
and the update ``trained - received`` (every float tensor, sorted by name: nothing travels
unmasked) is encoded on the round's grid (:func:`~fedquant.codecs.summable.encode_update`) and
masked. The reply holds the protocol record and the masked input only: the ClientApp's metrics
(and any other record) would be one client's data in the clear, so none are sent.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedquant.codecs.summable import SumGrid, encode_update
from fedquant.secagg.client import SecAggClient
from fedquant.secagg.driver import ERROR_CODE_PROTOCOL, handle_message
from fedquant.secagg.messages import RECORD, ProtocolError
from fedquant.secagg.wiring import (
    GRID_PREFIX,
    GRID_RECORD,
    KEY_DITHER_SEED,
    KEY_MAX_EXAMPLES,
    STATE_KEY,
    UPDATE_SEGMENT,
    flat_update,
    float_layout,
)

WEIGHT_KEY = "num-examples"
#: Node-config keys of signed rounds (``SecAggConfig(signed=True)``): a file holding this node's
#: Ed25519 identity key (64 hex digits), and a file of ``node_id public-key-hex`` lines for the
#: nodes it may meet, distributed by a channel the server does not control.
IDENTITY_FILE = "secagg-identity-file"
DIRECTORY_FILE = "secagg-directory-file"


def is_secure(msg: Message) -> bool:
    """Whether ``msg`` is a TRAIN message of the secure protocol."""
    return msg.metadata.message_type.split(".")[0] == MessageType.TRAIN and RECORD in msg.content.config_records


def new_client(ctxt: Context) -> SecAggClient:
    """A fresh protocol client; with the node-config keys :data:`IDENTITY_FILE` and :data:`DIRECTORY_FILE`,
    one of signed rounds (its Ed25519 identity key, and its peers' public keys by node id).

    Raises
    ------
    ProtocolError
        If only one of the two is set, or a file cannot be read or parsed.
    """
    identity_path, directory_path = ctxt.node_config.get(IDENTITY_FILE), ctxt.node_config.get(DIRECTORY_FILE)
    if not identity_path and not directory_path:
        return SecAggClient(ctxt.node_id)
    if not (isinstance(identity_path, str) and isinstance(directory_path, str) and identity_path and directory_path):
        raise ProtocolError(f"signed rounds need both node-config keys {IDENTITY_FILE} and {DIRECTORY_FILE}")
    try:
        identity = bytes.fromhex(Path(identity_path).read_text().strip())
        directory = {}
        for line in Path(directory_path).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                node, key = line.split()
                directory[int(node)] = bytes.fromhex(key)
        return SecAggClient.with_identity(ctxt.node_id, identity, directory)
    except (OSError, ValueError) as err:
        raise ProtocolError(f"cannot load the secagg identity or directory: {err}") from None


def secure_step(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Answer one protocol message; at collect, train with ``call_next`` and send the masked update."""
    stored = ctxt.state.config_records.get(STATE_KEY)
    try:
        client = SecAggClient.from_state(stored) if stored is not None else None
    except TypeError:  # a state this version did not write: start afresh
        client = None
    if client is None or client.node_id != ctxt.node_id:
        try:
            client = new_client(ctxt)
        except ProtocolError as err:
            return Message(Error(code=ERROR_CODE_PROTOCOL, reason=f"secagg: {err}"), reply_to=msg)

    def encode(content: RecordDict, spec: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
        return _train_and_encode(msg, content, spec, ctxt, call_next)

    reply = handle_message(client, msg, encode)
    ctxt.state[STATE_KEY] = client.state()
    return reply


def _train_and_encode(
    msg: Message, content: RecordDict, spec: dict[str, tuple[int, int]], ctxt: Context, call_next: ClientAppCallable
) -> dict[str, np.ndarray]:
    grid_config = content.config_records.get(GRID_RECORD)
    if grid_config is None:
        raise ProtocolError(f"collect: no '{GRID_RECORD}' ConfigRecord")
    try:
        grid = SumGrid.from_config(grid_config, GRID_PREFIX)
    except ValueError as err:
        raise ProtocolError(f"collect: bad grid: {err}") from None
    dither_seed, max_examples = grid_config.get(KEY_DITHER_SEED), grid_config.get(KEY_MAX_EXAMPLES, 0)
    if isinstance(dither_seed, bool) or not isinstance(dither_seed, int):
        raise ProtocolError(f"collect: '{KEY_DITHER_SEED}' must be an int")
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 0:
        raise ProtocolError(f"collect: '{KEY_MAX_EXAMPLES}' must be an int >= 0")
    theirs = [name for name in spec if name == "update" or name.startswith("update-v")]
    if theirs and theirs != [UPDATE_SEGMENT]:
        raise ProtocolError(
            f"collect: the server sums segment '{theirs[0]}', this client '{UPDATE_SEGMENT}': they rotate "
            "the update with the random signs of different payload formats (upgrade both to one fedquant)"
        )
    if spec != {UPDATE_SEGMENT: (grid.sent_numel, grid.bits)}:
        raise ProtocolError(f"collect: segments {spec} do not match the round's grid")
    if len(content.array_records) != 1:
        raise ProtocolError(f"collect: expects exactly one ArrayRecord (the model), found {len(content.array_records)}")
    received_record = next(iter(content.array_records.values()))
    layout = float_layout(received_record)
    if sum(n for _, n in layout) != grid.numel:
        raise ProtocolError(f"collect: the model's float tensors hold {sum(n for _, n in layout)} elements, "
                            f"the grid {grid.numel}")  # fmt: skip
    # The ClientApp sees a plain train message: the model and the inner strategy's config.
    msg.content = RecordDict({k: v for k, v in content.items() if k not in (RECORD, GRID_RECORD)})
    try:
        reply = call_next(msg, ctxt)
    finally:
        msg.content = content  # the request is the caller's; leave it as it came
    if reply.has_error():
        raise ProtocolError(f"collect: the ClientApp failed: {reply.error.reason}")
    if len(reply.content.array_records) != 1:
        raise ProtocolError("collect: the ClientApp's reply must hold exactly one ArrayRecord")
    trained_record = next(iter(reply.content.array_records.values()))
    if list(trained_record.keys()) != list(received_record.keys()) or float_layout(trained_record) != layout:
        raise ProtocolError("collect: the trained arrays differ from the received ones in names or shapes")
    received = {name: received_record[name].numpy() for name, _ in layout}
    trained = {name: trained_record[name].numpy() for name, _ in layout}
    update = flat_update(trained, received, layout)
    if not np.isfinite(update).all():
        raise ProtocolError("collect: the trained model is not finite")
    weight = 1.0
    if max_examples > 0:
        examples = _num_examples(reply)
        weight = min(examples, float(max_examples)) / max_examples
    encoded = encode_update(torch.from_numpy(update), grid, dither_seed, weight=weight)
    return {UPDATE_SEGMENT: encoded.values}


def _num_examples(reply: Message) -> float:
    for record in reply.content.metric_records.values():
        value = record.get(WEIGHT_KEY)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value)
    raise ProtocolError(f"collect: the ClientApp's reply has no positive '{WEIGHT_KEY}' to weigh by")


__all__ = ["DIRECTORY_FILE", "IDENTITY_FILE", "is_secure", "new_client", "secure_step"]
