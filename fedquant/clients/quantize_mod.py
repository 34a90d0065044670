"""``quantize_mod``: the client half of fedquant, a Flower Mod."""

from __future__ import annotations

import time
from functools import lru_cache
from logging import ERROR

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.supercore import log

from fedquant.clients.downlink import DownlinkError, decode_train_message
from fedquant.clients.secure import is_secure, secure_step
from fedquant.clients.state import FiniteState, store_state
from fedquant.codecs import Codec, get_codec
from fedquant.codecs.threads import kernel_threads
from fedquant.protocol import (
    CLIENT_METRICRECORD_NAME,
    KEY_CODEC,
    METRIC_CLIENT_ENCODE_SECONDS,
    METRIC_CLIENT_MSE,
    METRIC_CLIENT_STATE_RESETS,
    METRIC_DOWNLINK_REFERENCE,
)
from fedquant.records import EncodedRecord, RecordCodec, RecordError

MOD_NAME = "quantize_mod"


class _Refused(Exception):
    """A precondition of the mod failed; the reply is an error with this reason."""


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


def quantize_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Client-side quantization modifier: sends encoded updates instead of trained arrays.

    Use with :class:`fedquant.strategies.QuantizedStrategy` on the server
    (``ClientApp(mods=[quantize_mod])``). It acts on TRAIN messages whose ConfigRecord holds
    ``fedquant.codec`` and leaves every other message alone, so one ClientApp serves plain and
    wrapped strategies.

    After the ClientApp trained, the record codec the config names
    (:class:`~fedquant.records.RecordCodec`: ``fedquant.codec``, ``fedquant.min-numel``,
    ``fedquant.tensor-codecs``) replaces each float tensor of at least ``min-numel`` elements
    by the payload of its update ``trained - received`` (float32) at seed
    ``derive_seed(fedquant.seed, tensor_name)``; smaller and non-float tensors go as they are.
    The reply's MetricRecord gains ``fedquant.quantization-mse`` (mean squared error of the
    decoded update over all encoded elements; not for codecs that need decoder side
    information, or when the server sets ``fedquant.client-mse`` to False) and
    ``fedquant.encode-seconds``. A codec that keeps client state (``ef+...``: error feedback)
    keeps it per tensor in ``context.state`` (:mod:`fedquant.clients.state`); its MSE is that
    of the codec on what it encoded (``update + residual``). A stored residual that is not
    finite is dropped (the tensor starts afresh) and counted in ``fedquant.state-resets``.
    Updates are encoded on the client's GPU when it has one (:func:`encode_device`).

    When the server compresses the model it sends (``QuantizedStrategy(downlink_codec=...)``),
    the mod first rebuilds the dense model (:mod:`fedquant.clients.downlink`), so the ClientApp
    trains on float arrays and the update is computed against that model; the reply reports the
    id of the model the client now holds (``fedquant.downlink-reference``).

    A TRAIN message holding the ``fedquant.secagg`` ConfigRecord is one stage of a secure round
    (``QuantizedStrategy(secure_aggregation=...)``): the mod answers it with the client's
    protocol state machine, kept in ``context.state``, and calls the ClientApp only at the
    collect stage, whose reply carries the masked update alone (:mod:`fedquant.clients.secure`).

    Notes
    -----
    Put it last among mods that change the trained arrays (e.g. after a clipping mod), since it
    turns them into payloads. The reply must carry exactly one ArrayRecord with the keys of the
    one received; otherwise the mod answers with an error reply, as Flower's DP mods do.
    """
    if is_secure(msg):  # a SecAgg+ stage: only collect trains (see fedquant.clients.secure)
        return secure_step(msg, ctxt, call_next)
    config = _fedquant_config(msg)
    if config is None:
        return call_next(msg, ctxt)
    try:
        codec, seed, measure = _read_config(msg, config)
        held_reference = _decode_downlink(msg, config, ctxt)
        # Array objects are immutable in practice (their data is bytes): keep references, not copies.
        received = dict(_single_record(msg, "train message")[1].items())
        reply = call_next(msg, ctxt)
        if reply.has_error():
            return reply
        start = time.perf_counter()
        state = FiniteState(ctxt.state)
        record_name, encoded = _encode_reply(reply, received, codec, seed, measure, ctxt, state)
    except _Refused as err:
        return _error(msg, f"{MOD_NAME}{err}")
    reply.content[record_name] = encoded.arrays
    _add_metrics(reply, encoded, time.perf_counter() - start, held_reference, state.resets)
    return reply


def _fedquant_config(msg: Message) -> ConfigRecord | None:
    """The gate: the ConfigRecord of a TRAIN message that asks for fedquant, else None."""
    if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:  # "train" or "train.<action>"
        return None
    for record in msg.content.config_records.values():
        if KEY_CODEC in record:
            return record
    return None


def _single_record(msg: Message, what: str) -> tuple[str, ArrayRecord]:
    records = msg.content.array_records
    if len(records) != 1:
        raise _Refused(f" expects exactly one ArrayRecord in the {what}, found {len(records)}")
    return next(iter(records.items()))


def _read_config(msg: Message, config: ConfigRecord) -> tuple[RecordCodec, int, bool]:
    _single_record(msg, "train message")
    try:
        return RecordCodec.from_config(config, _codec)
    except (KeyError, ValueError, TypeError) as err:
        raise _Refused(f": bad fedquant config: {err}") from err


def _decode_downlink(msg: Message, config: ConfigRecord, ctxt: Context) -> int | None:
    """A compressed model (the server's ``downlink_codec``) becomes float arrays before training."""
    try:
        return decode_train_message(msg, config, ctxt.state, _codec)
    except DownlinkError as err:
        raise _Refused(f": {err}") from err


def _encode_reply(
    reply: Message,
    received: dict[str, Array],
    codec: RecordCodec,
    seed: int,
    measure: bool,
    ctxt: Context,
    state: FiniteState,
) -> tuple[str, EncodedRecord]:
    record_name, trained = _single_record(reply, "reply")
    if list(trained.keys()) != list(received.keys()):
        raise _Refused(" expects the reply's ArrayRecord to keep the keys of the one received")
    with kernel_threads():  # as many kernel threads as this client's torch uses
        try:
            encoded = codec.encode(
                trained,
                seed,
                received,
                state=state,
                measure=measure,
                device=encode_device(),
            )
        except RecordError as err:
            raise _Refused(f": {err}") from err
    store_state(ctxt.state, encoded.state)
    return record_name, encoded


def _add_metrics(
    reply: Message, encoded: EncodedRecord, seconds: float, held_reference: int | None, resets: int
) -> None:
    metrics = next(iter(reply.content.metric_records.values()), None)
    if metrics is None:
        metrics = MetricRecord()
        reply.content[CLIENT_METRICRECORD_NAME] = metrics
    if encoded.measured_numel:
        metrics[METRIC_CLIENT_MSE] = encoded.squared_error / encoded.measured_numel
    metrics[METRIC_CLIENT_ENCODE_SECONDS] = seconds
    if resets:
        metrics[METRIC_CLIENT_STATE_RESETS] = resets
    if held_reference is not None:
        metrics[METRIC_DOWNLINK_REFERENCE] = held_reference


def _error(msg: Message, reason: str) -> Message:
    log(ERROR, reason)
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)
