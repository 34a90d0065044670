"""``quantize_mod``: the client half of fedquant, a Flower Mod."""

from __future__ import annotations

import time
from functools import lru_cache
from logging import ERROR

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.supercore import log

from fedquant.clients.downlink import decode_train_message
from fedquant.clients.state import load_state, store_state
from fedquant.codecs import Codec, get_codec
from fedquant.codecs.threads import kernel_threads
from fedquant.codecs.transforms.error_feedback import ErrorFeedback
from fedquant.downlink_wire import METRIC_DOWNLINK_REFERENCE, DownlinkError
from fedquant.protocol import (
    CLIENT_METRICRECORD_NAME,
    KEY_CLIENT_MSE,
    KEY_CODEC,
    KEY_MIN_NUMEL,
    KEY_SEED,
    KEY_TENSOR_CODECS,
    METRIC_CLIENT_ENCODE_SECONDS,
    METRIC_CLIENT_MSE,
    METRIC_CLIENT_STATE_RESETS,
    is_encoded,
    parse_tensor_codecs,
    payload_array,
    tensor_seed,
)

MOD_NAME = "quantize_mod"


@lru_cache(maxsize=64)
def _codec(spec: str) -> Codec:
    return get_codec(spec)


def encode_device() -> torch.device:
    """Where the mod encodes: the client's GPU when it has one, else the CPU.

    In a simulation, Ray makes a GPU visible only to clients given a GPU share
    (``client-resources-num-gpus > 0``); those train on it, and their updates are encoded there
    too. The payload bytes do not depend on the device.
    """
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _fedquant_config(msg: Message) -> ConfigRecord | None:
    for record in msg.content.config_records.values():
        if KEY_CODEC in record:
            return record
    return None


def quantize_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Client-side quantization modifier: sends encoded updates instead of trained arrays.

    Use with :class:`fedquant.strategies.QuantizedStrategy` on the server
    (``ClientApp(mods=[quantize_mod])``). It acts on TRAIN messages whose ConfigRecord holds
    ``fedquant.codec`` and leaves every other message alone, so one ClientApp serves plain and
    wrapped strategies.

    After the ClientApp trained, each float tensor with at least ``fedquant.min-numel``
    elements is replaced by the payload of its update ``trained - received`` (float32), encoded
    with seed ``derive_seed(fedquant.seed, tensor_name)`` by the codec ``fedquant.codec``, or the
    one ``fedquant.tensor-codecs`` names for that tensor; smaller and non-float tensors go as
    they are. The reply's MetricRecord gains ``fedquant.quantization-mse`` (mean squared error of
    the decoded update over all encoded elements; not for codecs that need decoder side
    information, or when the server sets ``fedquant.client-mse`` to False) and
    ``fedquant.encode-seconds``. With a codec that keeps client state (``ef+...``: error
    feedback) each tensor's state is kept in ``context.state`` (:mod:`fedquant.clients.state`)
    and the MSE is that of the codec on ``update + residual`` (the new residual), not against
    the update alone; a stored residual that is not finite is dropped (the tensor starts afresh)
    and counted in ``fedquant.state-resets``. Updates are encoded on the client's GPU when it has one
    (:func:`encode_device`).

    When the server compresses the model it sends (``QuantizedStrategy(downlink_codec=...)``),
    the mod first rebuilds the dense model (:mod:`fedquant.clients.downlink`), so the ClientApp
    trains on float arrays and the update is computed against that model; the reply reports the
    id of the model the client now holds (``fedquant.downlink-reference``).

    Notes
    -----
    Put it last among mods that change the trained arrays (e.g. after a clipping mod), since it
    turns them into payloads. The reply must carry exactly one ArrayRecord with the keys of the
    one received; otherwise the mod answers with an error reply, as Flower's DP mods do.
    """
    if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:  # "train" or "train.<action>"
        return call_next(msg, ctxt)
    config = _fedquant_config(msg)
    if config is None:
        return call_next(msg, ctxt)
    if len(msg.content.array_records) != 1:
        found = len(msg.content.array_records)
        return _error(msg, f"{MOD_NAME} expects exactly one ArrayRecord in the train message, found {found}")
    try:
        codec = _codec(str(config[KEY_CODEC]))
        client_seed = int(config[KEY_SEED])
        min_numel = int(config[KEY_MIN_NUMEL])
        measure_mse = bool(config.get(KEY_CLIENT_MSE, True))
        tensor_codecs = {
            name: _codec(spec) for name, spec in parse_tensor_codecs(config.get(KEY_TENSOR_CODECS, "{}")).items()
        }
    except (KeyError, ValueError, TypeError) as err:
        return _error(msg, f"{MOD_NAME}: bad fedquant config: {err}")
    try:  # a compressed model (server's downlink_codec) becomes float arrays before training
        held_reference = decode_train_message(msg, config, ctxt.state)
    except DownlinkError as err:
        return _error(msg, f"{MOD_NAME}: {err}")
    # Array objects are immutable in practice (their data is bytes): keep references, not copies.
    received = dict(next(iter(msg.content.array_records.values())).items())

    reply = call_next(msg, ctxt)
    if reply.has_error():
        return reply
    if len(reply.content.array_records) != 1:
        found = len(reply.content.array_records)
        return _error(msg, f"{MOD_NAME} expects exactly one ArrayRecord in the reply, found {found}")
    record_name, trained = next(iter(reply.content.array_records.items()))
    if list(trained.keys()) != list(received.keys()):
        return _error(msg, f"{MOD_NAME} expects the reply's ArrayRecord to keep the keys of the one received")

    start = time.perf_counter()
    device = encode_device()
    out: dict[str, Array] = {}
    new_state: dict[str, dict[str, torch.Tensor]] = {}
    sq_error, encoded_numel, state_resets = 0.0, 0, 0
    with kernel_threads():  # as many kernel threads as this client's torch uses
        for name, sent in received.items():
            numel = int(np.prod(sent.shape, dtype=np.int64))
            if not is_encoded(sent.dtype, numel, min_numel):
                out[name] = trained[name]
                continue
            new = trained[name].numpy()
            old = sent.numpy()
            if new.shape != old.shape:
                return _error(msg, f"{MOD_NAME}: '{name}' came back as {list(new.shape)}, received {list(old.shape)}")
            # np.asarray: a 0-d difference is a NumPy scalar, which torch.from_numpy refuses.
            update = torch.from_numpy(np.asarray(new.astype(np.float32) - old.astype(np.float32))).to(device)
            seed = tensor_seed(client_seed, name)
            tensor_codec = tensor_codecs.get(name, codec)
            residual = None
            if tensor_codec.stateful:
                transforms = [t.name for t in tensor_codec.stateful_transforms]
                previous = load_state(ctxt.state, name, old.shape, transforms)
                if not all(bool(torch.isfinite(v).all()) for v in previous.values()):
                    previous, state_resets = {}, state_resets + 1  # a NaN/Inf residual never recovers: start afresh
                payload, new_state[name] = tensor_codec.encode_stateful(update, seed, previous)
                residual = new_state[name].get(ErrorFeedback.name)
            else:
                payload = tensor_codec.encode(update, seed)
            if measure_mse and residual is not None:
                # The new residual is exactly the codec's error on what it encoded (update + old residual).
                sq_error += float(torch.sum(residual.double() ** 2))
                encoded_numel += numel
            elif measure_mse and not tensor_codec.needs_side_info:
                decoded = tensor_codec.decode(payload, seed, shape=old.shape, dtype=torch.float32, device=device)
                sq_error += float(torch.sum((decoded - update).double() ** 2))
                encoded_numel += numel
            out[name] = payload_array(payload)
    store_state(ctxt.state, new_state)
    reply.content[record_name] = ArrayRecord(out)

    metrics = next(iter(reply.content.metric_records.values()), None)
    if metrics is None:
        metrics = MetricRecord()
        reply.content[CLIENT_METRICRECORD_NAME] = metrics
    if encoded_numel:
        metrics[METRIC_CLIENT_MSE] = sq_error / encoded_numel
    metrics[METRIC_CLIENT_ENCODE_SECONDS] = time.perf_counter() - start
    if state_resets:
        metrics[METRIC_CLIENT_STATE_RESETS] = state_resets
    if held_reference is not None:
        metrics[METRIC_DOWNLINK_REFERENCE] = held_reference
    return reply


def _error(msg: Message, reason: str) -> Message:
    log(ERROR, reason)
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)
