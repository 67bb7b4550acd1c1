"""Several clients' messages in one: a simulated node that serves several clients gets their
messages of an exchange as one message (a *bundle*), runs each client's as the ClientApp
would, and answers with one reply that the server splits back into one reply per client.

Why: Flower's simulation engine pays a fixed cost per message whatever it carries (a Ray
actor call, the node's context out and back, the message (de)pickled twice): 10 ms of a
worker's time per message on the 2-core CI machine, 0.18 s of a 36-client round in which
the plain PyTorch loop spends 0.37 s in all (``python -m bench.handoff``, docs/benchmarks.md
(a)). Four bundles of nine clients cost 0.07 s. Nothing else changes: each client's message
is run by the same handler with the same content, its reply (or its error) is the reply the
strategy would have got, addressed to the message the strategy built for that client.

What does change: a bundle is delivered, run and answered as one, so a round's timeout
drops a bundle's clients together, and a client slower than the rest delays the others of
its bundle (a deployment's nodes serve one client each and are never bundled). An exception
in one client's handler is that client's error reply; the others of its bundle still answer.

The content travels as the bundled messages' records under ``"<i>/<key>"`` keys, in the
order the messages were given, with :data:`BUNDLE_KEY` saying how many; no array is copied.
"""

from __future__ import annotations

import copy
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.client_app import ClientAppException
from flwr.common.constant import ErrorCode

BUNDLE_KEY = "pflower.bundle"    # config record of a bundle (and of its reply): {"size": n}
ERROR_KEY = "pflower.error"      # in a bundle's reply, one message's error: {"code", "reason"}
BUNDLES_PER_NODE = 2             # bundles per node and exchange: while one runs, the next is queued


def bundle_size(num_messages: int, num_nodes: int) -> int:
    """Clients per bundle: an exchange's messages over ``BUNDLES_PER_NODE`` bundles per node
    (rounded up), so that every simulated worker has a bundle to run and one queued."""
    if num_messages <= num_nodes:
        return 1
    return max(1, math.ceil(num_messages / (BUNDLES_PER_NODE * max(num_nodes, 1))))


def group_for_bundles(messages: Sequence[Message], size: int) -> list[list[Message]]:
    """The messages in groups of at most ``size`` with the same node and type, in the order
    given (a group of one is sent as it is)."""
    by_node: dict[tuple[int, str], list[Message]] = {}
    for msg in messages:
        by_node.setdefault((msg.metadata.dst_node_id, msg.metadata.message_type), []).append(msg)
    return [group[i:i + size] for group in by_node.values() for i in range(0, len(group), max(size, 1))]


def _prefixed(index: int, key: str) -> str:
    return f"{index}/{key}"


def bundle(group: Sequence[Message]) -> Message:
    """One message carrying every message of ``group`` (same node, same type). Each bundled
    message gets a message id, as a grid gives a pushed message, so that its reply can name it."""
    content = RecordDict({BUNDLE_KEY: ConfigRecord({"size": len(group)})})
    for i, msg in enumerate(group):
        msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        for key, record in msg.content.items():
            content[_prefixed(i, key)] = record
    first = group[0].metadata
    return Message(content=content, dst_node_id=first.dst_node_id, message_type=first.message_type,
                   ttl=min(m.metadata.ttl for m in group), group_id=first.group_id or None)


def bundled_count(msg: Message) -> int:
    """How many messages ``msg`` carries when it is a bundle (or a bundle's reply), else 0."""
    if not msg.has_content():
        return 0
    record = msg.content.config_records.get(BUNDLE_KEY)
    return 0 if record is None else int(record["size"])   # type: ignore[call-overload]


def split_content(content: RecordDict, count: int) -> list[RecordDict]:
    """The ``count`` contents a bundle (or its reply) carries, in order."""
    parts = [RecordDict() for _ in range(count)]
    for key, record in content.items():
        if key == BUNDLE_KEY:
            continue
        index, _, name = key.partition("/")
        parts[int(index)][name] = record
    return parts


def replies_of(reply: Message, group: Sequence[Message]) -> list[Message]:
    """The replies to the messages of ``group`` that the reply to their bundle carries (an
    error reply to the bundle is every message's error)."""
    if reply.has_error():
        return [Message(reply.error, reply_to=msg) for msg in group]
    out = []
    for msg, content in zip(group, split_content(reply.content, len(group)), strict=True):
        error = content.config_records.get(ERROR_KEY)
        if error is not None:
            out.append(Message(Error(code=int(error["code"]), reason=str(error["reason"])), reply_to=msg))  # type: ignore[call-overload]
        else:
            out.append(Message(content, reply_to=msg))
    return out


def engine_reason(ex: Exception) -> str:
    """An exception's error reason as Flower's simulation words it (its Ray actor wraps the
    ClientApp's exception in ``ClientAppException``, ``flwr/simulation/ray_transport/ray_actor.py``,
    and ``flwr/server/superlink/fleet/vce/vce_api.py`` writes its type and text)."""
    wrapped = ClientAppException(str(ex))
    return str(type(wrapped)) + ":<'" + str(wrapped) + "'>"


def run_bundle(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: a bundle's messages run one after the other through ``call_next`` (the
    rest of the ClientApp), each as if it had come alone; their replies go back as one. Any
    other message goes straight through."""
    count = bundled_count(msg)
    if count == 0:
        return call_next(msg, context)
    content = RecordDict({BUNDLE_KEY: ConfigRecord({"size": count})})
    for i, part in enumerate(split_content(msg.content, count)):
        one = Message(metadata=copy.copy(msg.metadata), content=part)
        try:
            reply = call_next(one, context)
            records: Any = reply.content.items() if not reply.has_error() else \
                [(ERROR_KEY, ConfigRecord({"code": int(reply.error.code), "reason": str(reply.error.reason)}))]
        except Exception as ex:   # for this message only, in the words of Flower's simulation
            records = [(ERROR_KEY, ConfigRecord({"code": ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                                 "reason": engine_reason(ex)}))]
        for key, record in records:
            content[_prefixed(i, key)] = record
        del one
    return Message(content, reply_to=msg)
