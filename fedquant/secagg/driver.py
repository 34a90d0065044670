"""Running the protocol over Flower Messages: the server's loop and the client's handler.

:func:`run_secure_sum` drives a :class:`~fedquant.secagg.server.SecAggServer` through its stages
with any ``send_and_receive(messages) -> replies`` (a Flower ``Grid``'s method, or the in-process
:class:`LoopbackGrid`). It checks each reply's envelope before the server sees its content: a
reply from a node that was not asked, a second reply from one node, a reply to another message
(replayed), or an error reply count as that node dropping out, logged with its node id.
:func:`handle_message` is the client's side: one request Message in, one reply Message out (an
error reply when the request breaks the protocol).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping

from flwr.app import Error, Message, RecordDict
from flwr.app.message_type import MessageType

from fedquant.secagg.client import Encoder, SecAggClient
from fedquant.secagg.messages import ORDER, RECORD, ProtocolError
from fedquant.secagg.server import SecAggServer, SecureSum

log = logging.getLogger("fedquant.secagg")
SendAndReceive = Callable[[list[Message]], Iterable[Message]]
#: ``extra(stage, node) -> RecordDict`` whose records are added to that node's request (the
#: collect stage carries the model and the round's grid this way).
Extra = Callable[[str, int], RecordDict | None]
ERROR_CODE_PROTOCOL = 1901


def stage_messages(server: SecAggServer, extra: Extra | None = None) -> dict[int, Message]:
    """One TRAIN Message per active node for the server's current stage."""
    out = {}
    for node, content in server.requests().items():
        more = extra(server.stage, node) if extra is not None else None
        if more is not None:
            for name, record in more.items():
                content[name] = record
        out[node] = Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                            group_id=f"secagg-{server.server_round}")
    return out


def sort_replies(sent: Mapping[int, Message], replies: Iterable[Message], server_round: int) -> dict[int, RecordDict]:
    """The contents of the replies whose envelope checks out, by node (see the module doc)."""
    seen: dict[int, list[Message]] = {}
    for reply in replies:
        seen.setdefault(reply.metadata.src_node_id, []).append(reply)
    contents = {}
    for node, got in seen.items():
        request = sent.get(node)
        if request is None:
            log.warning("secagg round %d: reply from node %d, which was not asked", server_round, node)
        elif len(got) > 1:
            log.warning("secagg round %d: node %d replied %d times; all dropped", server_round, node, len(got))
        elif request.metadata.message_id and got[0].metadata.reply_to_message_id != request.metadata.message_id:
            log.warning("secagg round %d: node %d replied to another message (replayed)", server_round, node)
        elif got[0].has_error():
            log.warning("secagg round %d: node %d sent an error: %s", server_round, node, got[0].error.reason)
        else:
            contents[node] = got[0].content
    return contents


def run_secure_sum(
    server: SecAggServer, send_and_receive: SendAndReceive, extra: Extra | None = None
) -> SecureSum | None:
    """Run every stage; the secure sum, or ``None`` when the round failed (``server.failure``)."""
    while not server.done:
        sent = stage_messages(server, extra)
        replies = list(send_and_receive(list(sent.values())))
        server.receive(sort_replies(sent, replies, server.server_round))
    return server.result


def handle_message(client: SecAggClient, message: Message, encode: Encoder | None = None) -> Message:
    """The client's reply to one protocol message (an error reply if it breaks the protocol)."""
    try:
        return Message(client.handle(message.content, encode), reply_to=message)
    except ProtocolError as err:
        log.warning("secagg node %d refused a request: %s", client.node_id, err)
        return Message(Error(code=ERROR_CODE_PROTOCOL, reason=f"secagg: {err}"), reply_to=message)


class LoopbackGrid:
    """An in-process transport between one server and client state machines (tests, benchmarks).

    Parameters
    ----------
    clients : dict of int to SecAggClient
    encoders : dict of int to Encoder
        What each client sums at the collect stage.
    drop_after : dict of int to str, optional
        Node -> the last stage it answers; it sends nothing from the next stage on.
    tamper : callable, optional
        ``tamper(stage, node, reply) -> reply or None``, applied to every reply (to forge bad ones).
    """

    def __init__(
        self,
        clients: dict[int, SecAggClient],
        encoders: Mapping[int, Encoder],
        drop_after: Mapping[int, str] | None = None,
        tamper: Callable[[str, int, Message], Message | None] | None = None,
    ) -> None:
        self.clients = clients
        self.encoders = encoders
        self.drop_after = dict(drop_after or {})
        self.tamper = tamper
        self.requests: list[Message] = []
        self.replies: list[Message] = []  # everything the server received

    def send_and_receive(self, messages: list[Message]) -> list[Message]:
        out = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # what the SuperLink assigns
            self.requests.append(message)
            node = message.metadata.dst_node_id
            stage = message.content.config_records[RECORD]["stage"]
            last = self.drop_after.get(node)
            if last is not None and ORDER.index(stage) > ORDER.index(last):
                continue
            reply = handle_message(self.clients[node], message, self.encoders.get(node))
            if self.tamper is not None:
                reply = self.tamper(stage, node, reply)
                if reply is None:
                    continue
            out.append(reply)
        self.replies.extend(out)
        return out
