"""Client half of downlink compression: rebuild the model a train message encodes.

``quantize_mod`` calls :func:`decode_train_message` before the ClientApp runs, so the ClientApp
sees float arrays as usual. The rebuilt model and its id are kept in ``context.state``: the next
train message may be a difference to it (keys in :mod:`fedquant.protocol`).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedquant.codecs import Codec, get_codec
from fedquant.protocol import (
    KEY_DOWNLINK_BASE,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_REFERENCE,
    KEY_DOWNLINK_SEED,
    NO_REFERENCE,
    STATE_HELD_KEY,
    STATE_MODEL_KEY,
)
from fedquant.records import RecordCodec, RecordError


class DownlinkError(ValueError):
    """A compressed train message that cannot be rebuilt (e.g. a difference to a model not held)."""


def held_reference(state: RecordDict) -> int:
    """Id of the model this client holds, ``NO_REFERENCE`` when it holds none."""
    held = state.config_records.get(STATE_HELD_KEY)
    return int(held["reference"]) if held is not None and "reference" in held else NO_REFERENCE


def decode_train_message(
    msg: Message, config: ConfigRecord, state: RecordDict, get: Callable[[str], Codec] = get_codec
) -> int | None:
    """Replace a compressed train message's ArrayRecord by the dense model it encodes, in place.

    Parameters
    ----------
    msg : Message
        A train message with exactly one ArrayRecord.
    config : ConfigRecord
        Its fedquant ConfigRecord.
    state : RecordDict
        The client's ``context.state`` (holds the reference model between rounds).
    get : callable
        Builds a codec from its spec (a caching ``get_codec``).

    Returns
    -------
    int or None
        Id of the model now held (to report in the reply); None when the message is not
        compressed.

    Raises
    ------
    DownlinkError
        When the message is a difference to a model this client does not hold, or does not decode.
    """
    if KEY_DOWNLINK_CODEC not in config:
        return None
    try:
        codec = RecordCodec(get(str(config[KEY_DOWNLINK_CODEC])))
        seed = int(config[KEY_DOWNLINK_SEED])
        base_id = int(config[KEY_DOWNLINK_BASE])
        new_id = int(config[KEY_DOWNLINK_REFERENCE])
    except (KeyError, ValueError, TypeError) as err:
        raise DownlinkError(f"bad downlink config: {err}") from err
    base = None
    if base_id != NO_REFERENCE:
        if held_reference(state) != base_id or STATE_MODEL_KEY not in state.array_records:
            raise DownlinkError(f"the message is a difference to model {base_id}, which this client does not hold")
        base = state.array_records[STATE_MODEL_KEY]
    record_name, wire = next(iter(msg.content.array_records.items()))
    try:
        model = codec.decode(wire, seed, base).arrays
    except RecordError as err:
        raise DownlinkError(f"downlink tensor {err}") from err
    msg.content[record_name] = model
    state[STATE_MODEL_KEY] = ArrayRecord(dict(model.items()))
    state[STATE_HELD_KEY] = ConfigRecord({"reference": new_id})
    return new_id
