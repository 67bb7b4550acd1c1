"""Which node serves which client, and which client a reply answers for.

Flower addresses nodes; pflower's strategies address clients (partition ids, stable across
runs, restarts and resumes; node ids are random per run). :class:`ClientDirectory` learns
each node's client with one QUERY message, places the run's clients on the nodes
(:func:`place_clients`). An :class:`Exchange` (one round's training, or its evaluation: a
value the round owns) builds each message for the node serving its client and names the
client of every reply by the message it answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.flower_compat import is_deployment_grid, send_and_receive
from common.protocol import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    NUM_PARTITIONS,
    TARGET_CLIENT,
    client_sort_key,
    decode_client_id,
    to_record,
)
from learning.params import NDArrays
from strategies.replies import RoundFailedError

# After the first round, how long to wait for a client that has just disappeared (e.g. a
# SuperNode restarting) before going on without it; a client already missing in the
# previous round is not waited for again, so one dead SuperNode slows one round, not all.
# A SuperNode's restart (Python, torch and Flower imports, registration) takes ~8 s on an
# idle 2-CPU machine and several times that beside other work (docs/reliability.md): 15 s
# left a restarting node out of the next round there, which a user would rather wait for.
REJOIN_WAIT_S = 60.0


def place_clients(client_ids: Iterable[str], own: Mapping[str, int],
                  federation_size: int | None = None) -> dict[str, int]:
    """Which node serves each client: the node identified as that client, else (in a
    simulation of ``federation_size`` SuperNodes, fewer than the clients) the node of
    partition ``c mod federation_size``, the rule the ClientApp checks
    (``client/identity.py``). Clients with neither are left out (missing)."""
    placed: dict[str, int] = {}
    for cid in client_ids:
        if cid in own:
            placed[cid] = own[cid]
        elif federation_size and cid.isdigit() and str(int(cid) % federation_size) in own:
            placed[cid] = own[str(int(cid) % federation_size)]
    return placed


class ClientDirectory:
    """The run's clients and the nodes serving them.

    Parameters
    ----------
    client_ids : the clients the run expects.
    min_clients : fewer connected clients than this fail the round (``min_train_clients``).
    wait_for_clients : how long the first round waits for every expected client (seconds).
    query_timeout : how long to wait for identification replies (the round timeout); also
        every message's time to live, so that a message whose round gave up on it is never
        delivered late, and a reply that comes after the round is refused by the SuperLink
        instead of being stored where nobody pulls it (Flower's default TTL is 12 hours: in
        a simulation whose round timed out, the clients went on training and each late
        reply's arrays stayed in the server's memory).
    """

    def __init__(self, client_ids: Iterable[str], min_clients: int, wait_for_clients: float,
                 query_timeout: float) -> None:
        self.client_ids = list(client_ids)
        self.min_clients = int(min_clients)
        self.wait_for_clients = float(wait_for_clients)
        self.query_timeout = float(query_timeout)
        self.node_to_client: dict[int, str] = {}
        self.node_of: dict[str, int] = {}          # client id -> the node serving it (this round)
        self.federation_size: int | None = None    # num-partitions reported by simulated nodes
        self._missing: set[str] | None = None      # expected clients without a node, last call
        self._idle_logged: set[str] = set()
        self._placement_logged = False

    def waited_for(self, client_id: str) -> None:
        """``client_id``'s node was waited for in this round (and did not come back): the next
        :meth:`connected` goes on without waiting for it again."""
        self._missing = (self._missing or set()) | {client_id}

    def learn(self, nodes: Mapping[int, str]) -> None:
        """Nodes seen answering for a client (a fallback to the identification query)."""
        for node, cid in nodes.items():
            self.node_to_client.setdefault(node, cid)

    def identify(self, grid: Grid, nodes: Iterable[int], timeout: float | None = None) -> None:
        """Learn the stable client id of nodes not seen yet with one QUERY message each
        (bounded by the round timeout, or ``timeout``). Node ids are random per run and change when a
        SuperNode restarts or a run is resumed; without this, the first round (and the
        first round after a resume) could neither sample by client id nor send each client
        its personal arrays."""
        unknown = [n for n in nodes if n not in self.node_to_client]
        if not unknown:
            return
        wait = self.query_timeout if timeout is None else max(min(timeout, self.query_timeout), 1.0)
        messages = [Message(content=RecordDict({CONFIG_KEY: ConfigRecord({})}), message_type=MessageType.QUERY,
                            dst_node_id=n, ttl=wait) for n in unknown]
        for msg in send_and_receive(grid, messages, timeout=wait):
            if msg.has_error():
                log(WARNING, "node %s did not identify itself: %s", msg.metadata.src_node_id, msg.error.reason)
                continue
            rec = msg.content.metric_records.get(METRICS_KEY)
            metrics = dict(rec.items()) if rec else {}
            try:
                self.node_to_client[msg.metadata.src_node_id] = decode_client_id(metrics)
            except (KeyError, ValueError) as err:
                log(WARNING, "node %s sent an unusable identification: %s", msg.metadata.src_node_id, err)
            if NUM_PARTITIONS in metrics:
                self.federation_size = int(metrics[NUM_PARTITIONS])

    def nodes_by_client(self, grid: Grid, timeout: float | None = None) -> tuple[list[int], dict[str, int]]:
        """The connected nodes, and the node of each identified client among them, new nodes
        identified first (within ``timeout``, :meth:`identify`)."""
        nodes = list(grid.get_node_ids())
        self.identify(grid, nodes, timeout=timeout)
        own = {self.node_to_client[n]: n for n in nodes if n in self.node_to_client}
        return nodes, own

    def unidentified(self, nodes: list[int]) -> dict[str, int]:
        """The nodes of ``nodes`` that could not identify themselves, as ``{"node-<id>": id}``:
        they are addressed by node, and their failures recorded under that name."""
        return {f"node-{n}": n for n in nodes if n not in self.node_to_client}

    def connected(self, grid: Grid) -> list[str]:
        """The clients to address this round, ordered by client id (nodes that could not be
        identified last, as ``node-<id>``); ``node_of`` says which node serves each.

        Nodes are identified as they connect; the first call waits (up to
        ``wait_for_clients``) for every expected client, later calls only ``REJOIN_WAIT_S``
        for a client that has just disappeared. In a simulation with fewer SuperNodes than
        clients (Flower's default federation has 2) every node serves several clients
        (:func:`place_clients`); in a deployment a node is one client and a client without
        its node is missing. Nodes that serve none of the run's clients stay idle."""
        expected = set(self.client_ids)
        first = self._missing is None
        wait = self.wait_for_clients if first else min(self.wait_for_clients, REJOIN_WAIT_S)
        deadline = time.monotonic() + wait
        shared = not is_deployment_grid(grid)
        while True:
            nodes, own = self.nodes_by_client(grid)
            placed = place_clients(self.client_ids, own, self.federation_size if shared else None)
            missing = expected - set(placed)
            newly_missing = missing if first else missing - (self._missing or set())
            if not newly_missing or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if missing and missing != self._missing:
            log(WARNING, "clients without a connected node: %s", ", ".join(sorted(missing, key=client_sort_key)))
        self._missing = missing
        self._log_placement(placed, own)
        # held-out clients ("new-k") connected for personalisation, and nodes that could not
        # identify themselves (addressed by node, their failures recorded under that name)
        placed.update({c: n for c, n in own.items() if c.startswith("new-")})
        placed.update(self.unidentified(nodes))
        if len(placed) < self.min_clients:
            raise RoundFailedError(
                f"only {len(placed)} of {len(self.client_ids)} clients connected within "
                f"{wait:.0f}s (min_train_clients={self.min_clients}); missing: "
                f"{', '.join(sorted(missing, key=client_sort_key)) or '-'}; "
                "start more SuperNodes or lower min_train_clients"
            )
        self.node_of = placed
        return sorted(placed, key=lambda c: (c.startswith("node-"), client_sort_key(c)))

    def _log_placement(self, placed: Mapping[str, int], own: Mapping[str, int]) -> None:
        if len(set(placed.values())) < len(placed) and not self._placement_logged:
            log(INFO, "%d clients on %d SuperNodes: the node of partition p of %d serves the clients "
                "c with c mod %d = p", len(placed), len(set(placed.values())), self.federation_size,
                self.federation_size)
            self._placement_logged = True
        serving = set(placed.values())
        idle = {c for c, n in own.items() if n not in serving and not c.startswith("new-")}
        if idle - self._idle_logged:
            log(INFO, "idle SuperNodes (not clients of this dataset): %s", ", ".join(sorted(idle, key=client_sort_key)))
            self._idle_logged |= idle

    def exchange(self, message_type: str, earlier: Exchange | None = None) -> Exchange:
        """A new exchange of ``message_type`` messages to the clients placed by the last
        :meth:`connected`; ``earlier`` (the round's train exchange, for its evaluation) lends
        its messages of the other type, whose replies may carry the evaluation."""
        return Exchange(self, message_type, earlier)


class Exchange:
    """One exchange of messages: a round's training, or its evaluation. It builds each
    message for the node serving its client, packs each distinct payload once, and names the
    client of every reply by the message it answers; the round holds it from the first message
    out to the last reply in, and nothing of it outlives the round.

    Parameters
    ----------
    directory : the run's clients and nodes (``node_of`` as its last :meth:`ClientDirectory.connected` placed them).
    message_type : the type of this exchange's messages.
    earlier : an exchange whose messages of another type this one answers for too.
    """

    def __init__(self, directory: ClientDirectory, message_type: str, earlier: Exchange | None = None) -> None:
        self.directory = directory
        self.message_type = message_type
        self.window_s = min(directory.wait_for_clients, REJOIN_WAIT_S)   # Rejoin: how long a node may be away
        self.node_of = dict(directory.node_of)
        self.node_to_client = directory.node_to_client     # the directory's, learned as nodes answer
        self.query_timeout = directory.query_timeout
        self.addressed: list[tuple[Message, str]] = (      # messages out, with their client
            [(m, c) for m, c in earlier.addressed if m.metadata.message_type != message_type] if earlier else [])
        # one packed record per distinct payload (a shared global model is packed once, not once
        # per client): key = the payload's (name, id(array)) pairs; the entry keeps the arrays
        # alive so that no id is reused while the exchange lasts
        self._records: dict[tuple[tuple[str, int], ...], tuple[tuple[Any, ...], ArrayRecord]] = {}
        self._by_message_id: dict[str, str] = {}           # ``addressed`` by message id, once pushed
        self.sent_at = time.monotonic()

    def record_of(self, payload: NDArrays) -> ArrayRecord:
        """The payload as a packed record, packed once per exchange for every client that gets
        the same arrays (FedAvg's 1,000 clients share one 0.6 MB buffer instead of 1,000)."""
        key = tuple((name, id(array)) for name, array in payload.items())
        hit = self._records.get(key)
        if hit is None:
            hit = self._records[key] = (tuple(payload.values()), to_record(payload))
        return hit[1]

    def message(self, client_id: str, payload: NDArrays, config: Mapping[str, Any]) -> Message:
        """A message to the node serving ``client_id``, naming the client it is for."""
        if not client_id.startswith("node-"):
            config = {**config, TARGET_CLIENT: client_id}
        record = RecordDict({ARRAYS_KEY: self.record_of(payload), CONFIG_KEY: ConfigRecord(dict(config))})
        msg = Message(content=record, message_type=self.message_type, dst_node_id=self.node_of[client_id],
                      ttl=self.query_timeout)
        self.addressed.append((msg, client_id))
        return msg

    def sender_of(self, reply: Message) -> str:
        """The client a reply answers for (also an error reply, which names no client): by
        the message it replies to, else by the node it came from."""
        wanted = reply.metadata.reply_to_message_id
        if wanted and wanted not in self._by_message_id:   # ids are given when messages are pushed
            self._by_message_id = {m.metadata.message_id: c for m, c in self.addressed if m.metadata.message_id}
        node = reply.metadata.src_node_id
        return self._by_message_id.get(wanted) or self.node_to_client.get(node, f"node-{node}")

    def client_of(self, message: Message) -> str:
        """The client ``message`` was addressed to."""
        return next(c for m, c in self.addressed if m is message)

    def resend(self, grid: Grid, lost: list[Message], time_left: float) -> dict[str, Message]:
        """``flower_compat.Rejoin``: a new message, with the same content, for each client of
        ``lost`` (messages whose node was unavailable, or whose ClientApp crashed) whose node is
        connected now: the same node (come back, or alive all along), or the new node of a
        restarted SuperNode (identified as its client).
        Keyed by the lost message's id; the others are not back yet. The new message lives
        ``time_left`` (what is left of the round: a message the round gave up on is never
        delivered late), and identifying new nodes waits no longer."""
        nodes, own = self.directory.nodes_by_client(grid, timeout=time_left)
        own.update(self.directory.unidentified(nodes))
        again: dict[str, Message] = {}
        for msg in lost:
            client = self.client_of(msg)
            if client in own:
                new = Message(content=msg.content, message_type=msg.metadata.message_type,
                              dst_node_id=own[client], ttl=max(time_left, 1.0))
                self.addressed.append((new, client))
                self.directory.node_of[client] = own[client]
                log(INFO, "client %s's %s message is sent again, to node %s", client, msg.metadata.message_type,
                    own[client])
                again[msg.metadata.message_id] = new
        return again

    def give_up(self, lost: Message) -> None:
        """``flower_compat.Rejoin``: the client's node did not come back within ``window_s``;
        the next rounds do not wait for it again (:meth:`ClientDirectory.connected`)."""
        client = self.client_of(lost)
        log(WARNING, "client %s's node did not come back within %.0f s: it misses this %s", client,
            self.window_s, lost.metadata.message_type)
        self.directory.waited_for(client)

    def no_reply_reason(self) -> str:
        """Why a node sent nothing back: the round timed out, or (when the grid returned well
        before the timeout) the message never reached a live node."""
        waited = time.monotonic() - self.sent_at
        if waited < 0.9 * self.query_timeout:
            return (f"no reply after {waited:.0f}s: the node went offline or the message could "
                    f"not be delivered (the round timeout is {self.query_timeout:.0f}s)")
        return f"no reply within the round timeout ({self.query_timeout:.0f}s)"
