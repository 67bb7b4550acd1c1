"""Several clients' messages in one: a simulated node that serves several clients gets their
messages of an exchange as one message (a *bundle*), runs each client's as the ClientApp
would, and answers with one reply that the server splits back into one reply per client.

Why: Flower's simulation engine pays a fixed cost per message whatever it carries (a Ray
actor call, the node's context out and back, the message (de)pickled twice): 10 ms of a
worker's time per message on a 2-core machine, 0.18 s of a 36-client round in which
the plain PyTorch loop spends 0.37 s in all (``python -m bench.handoff``, docs/benchmarks.md
(a)). Four bundles of nine clients cost 0.07 s. Nothing else changes: each client's message
is run by the same handler with the same content, its reply (or its error) is the reply the
strategy would have got, addressed to the message the strategy built for that client.

What does change: a bundle is delivered, run and answered as one. A round's timeout counts a
bundle's clients all or nothing, a client slower than the rest delays the others of its bundle,
and an actor that dies (out of memory, say) takes the whole bundle (a deployment's nodes serve
one client each and are never bundled). An exception in one client's handler is that client's
error reply, logged with its traceback; the others of its bundle still answer. Bundles are
therefore small: at most ``MAX_BUNDLE_CLIENTS`` clients and ``MAX_BUNDLE_BYTES`` of arrays (a
bundle's reply holds every client's upload at once; where one upload is that large, the fixed
cost per message no longer matters), split evenly.

The content travels as the bundled messages' records under ``"<i>/<key>"`` keys, in the
order the messages were given, with :data:`BUNDLE_KEY` saying how many; no array is copied.
"""

from __future__ import annotations

import copy
import math
import traceback
from collections.abc import Callable, Iterable, Sequence
from logging import ERROR
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.logger import log

from common import flower_compat
from common.flower_compat import (
    CLIENT_APP_RAISED_EXCEPTION,
    engine_error_reason,
    expires_at,
    give_message_id,
    is_simulation_grid,
)

BUNDLE_KEY = "pflower.bundle"    # config record of a bundle (and of its reply): {"size": n}
ERROR_KEY = "pflower.error"      # in a bundle's reply, one message's error: {"code", "reason"}
BUNDLES_PER_NODE = 2             # bundles per node and exchange: while one runs, the next is queued
MAX_BUNDLE_CLIENTS = 10          # a bundle answers when its last client is done (timeouts, see above)
MAX_BUNDLE_BYTES = 64 * 2**20    # arrays a bundle may carry, counted as its largest message's times its size


def message_bytes(msg: Message) -> int:
    """The bytes of a message's arrays."""
    return sum(len(array.data) for record in msg.content.array_records.values() for array in record.values())


def bundle_size(num_messages: int, num_nodes: int, largest_bytes: int = 0) -> int:
    """Clients per bundle at most: an exchange's messages over ``BUNDLES_PER_NODE`` bundles per
    node (rounded up), so that every simulated worker has a bundle to run and one queued; no
    more than ``MAX_BUNDLE_CLIENTS``, nor than ``MAX_BUNDLE_BYTES`` of messages of
    ``largest_bytes``."""
    if num_messages <= num_nodes:
        return 1
    by_count = math.ceil(num_messages / (BUNDLES_PER_NODE * max(num_nodes, 1)))
    by_bytes = MAX_BUNDLE_BYTES // max(largest_bytes, 1)
    return max(1, min(by_count, MAX_BUNDLE_CLIENTS, by_bytes))


def group_for_bundles(messages: Sequence[Message], size: int) -> list[list[Message]]:
    """The messages in groups with the same node and type, in the order given, each node's
    split into as few groups of at most ``size`` as it takes, of sizes that differ by one at
    most (a group of one is sent as it is)."""
    by_node: dict[tuple[int, str], list[Message]] = {}
    for msg in messages:
        by_node.setdefault((msg.metadata.dst_node_id, msg.metadata.message_type), []).append(msg)
    groups = []
    for group in by_node.values():
        parts = math.ceil(len(group) / max(size, 1))
        small, extra = divmod(len(group), parts)
        start = 0
        for i in range(parts):
            end = start + small + (i < extra)
            groups.append(group[start:end])
            start = end
    return groups


def _prefixed(index: int, key: str) -> str:
    return f"{index}/{key}"


def bundle(group: Sequence[Message]) -> Message:
    """One message carrying every message of ``group`` (same node, same type). Each bundled
    message gets a message id, as a grid gives a pushed message, so that its reply can name it."""
    content = RecordDict({BUNDLE_KEY: ConfigRecord({"size": len(group)})})
    for i, msg in enumerate(group):
        give_message_id(msg)
        for key, record in msg.content.items():
            content[_prefixed(i, key)] = record
    first = group[0].metadata
    one = Message(content=content, dst_node_id=first.dst_node_id, message_type=first.message_type,
                  ttl=1.0, group_id=first.group_id or None)   # ttl set below, from its creation time
    # expires when the first of its messages would have: their replies may live no longer
    one.metadata.ttl = max(min(expires_at(m) for m in group) - one.metadata.created_at, 1e-3)
    return one


def bundled_count(msg: Message) -> int:
    """How many messages ``msg`` carries when it is a bundle (or a bundle's reply), else 0."""
    if not msg.has_content():
        return 0
    record = msg.content.config_records.get(BUNDLE_KEY)
    return 0 if record is None else int(record["size"])   # type: ignore[call-overload]


def split_content(content: RecordDict, count: int) -> list[RecordDict]:
    """The ``count`` contents a bundle (or its reply) carries, in order; a bundle whose own size
    or keys say otherwise raises ValueError, naming what does not fit."""
    said = content.config_records.get(BUNDLE_KEY)
    if said is None or said.get("size") != count:
        raise ValueError(f"a bundle of {count} messages came back saying it carries "
                         f"{None if said is None else said.get('size')!r}")
    parts = [RecordDict() for _ in range(count)]
    for key, record in content.items():
        if key == BUNDLE_KEY:
            continue
        index, slash, name = key.partition("/")
        if not (slash and index.isdigit() and int(index) < count and name):
            raise ValueError(f"a bundle of {count} messages holds a record {key!r} of none of them")
        parts[int(index)][name] = record
    return parts


def replies_of(reply: Message, group: Sequence[Message]) -> list[Message]:
    """The replies to the messages of ``group`` that the reply to their bundle carries (an
    error reply to the bundle is every message's error)."""
    if reply.has_error():
        return [Message(reply.error, reply_to=msg) for msg in group]
    try:
        contents = split_content(reply.content, len(group))
    except ValueError as err:   # a reply that is not the bundle's: every message's error, said once
        log(ERROR, "refused the reply to a bundle: %s", err)
        return [Message(Error(code=0, reason=f"malformed bundle reply: {err}"), reply_to=msg) for msg in group]
    out = []
    for msg, content in zip(group, contents, strict=True):
        error = content.config_records.get(ERROR_KEY)
        if error is not None:
            code = error.get("code")
            out.append(Message(Error(code=code if isinstance(code, int) and not isinstance(code, bool) else 0,
                                     reason=str(error.get("reason"))), reply_to=msg))
        else:
            out.append(Message(content, reply_to=msg))
    return out


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
            log(ERROR, "a client of a bundle raised: %s\n%s", ex, traceback.format_exc())
            records = [(ERROR_KEY, ConfigRecord({"code": CLIENT_APP_RAISED_EXCEPTION,
                                                 "reason": engine_error_reason(ex)}))]
        for key, record in records:
            content[_prefixed(i, key)] = record
    return Message(content, reply_to=msg)


def send_and_receive(grid: Any, messages: Iterable[Message], timeout: float,
                     on_reply: Callable[[Message], Any] | None = None,
                     rejoin: flower_compat.Rejoin | None = None) -> list[Any]:
    """``flower_compat.send_and_receive`` (same contract: what ``on_reply`` returns of each
    reply that arrived in time, in arrival order; ``rejoin`` sends a message whose node was
    unavailable again), with several messages to one node of the simulation (or of a test grid
    that says ``bundles_messages``) sent as bundles, each of whose replies is handed on as one
    reply per message, as if the messages had travelled alone (a simulated node is never
    unavailable: bundles are not sent again)."""
    keep = on_reply if on_reply is not None else (lambda message: message)
    outgoing = list(messages)
    del messages
    bundled: list[tuple[Message, list[Message]]] = []
    if is_simulation_grid(grid) or getattr(grid, "bundles_messages", False):
        outgoing, bundled = _bundled(outgoing)
    if not bundled:
        return flower_compat.send_and_receive(grid, outgoing, timeout, on_reply, rejoin)
    groups: dict[str, list[Message]] | None = None   # a bundle's messages by the bundle's id (given when pushed)

    def unbundle(reply: Message) -> list[Any]:
        nonlocal groups
        if groups is None:
            groups = {one.metadata.message_id: group for one, group in bundled}
        group = groups.pop(reply.metadata.reply_to_message_id, None)
        return [keep(r) for r in (replies_of(reply, group) if group is not None else [reply])]

    return [kept for part in flower_compat.send_and_receive(grid, outgoing, timeout, unbundle) for kept in part]


def _bundled(messages: list[Message]) -> tuple[list[Message], list[tuple[Message, list[Message]]]]:
    """The messages to push, several messages to one node in one bundle, and each bundle's messages."""
    nodes = len({m.metadata.dst_node_id for m in messages})
    size = bundle_size(len(messages), nodes, max(map(message_bytes, messages)) if len(messages) > nodes else 0)
    if size <= 1:
        return messages, []
    outgoing: list[Message] = []
    bundled: list[tuple[Message, list[Message]]] = []
    for group in group_for_bundles(messages, size):
        if len(group) == 1:
            outgoing.append(group[0])
        else:
            outgoing.append(one := bundle(group))
            bundled.append((one, group))
    return outgoing, bundled
