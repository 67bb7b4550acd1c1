"""Who this node is and which clients it serves: its client id from the node config, the
reply to the server's query, and the check that a message is for a client of this node.
Light on purpose (no torch): a process that only answers the query never imports it
(``client/app.py``)."""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import Context, Message

from common.protocol import NUM_PARTITIONS, TARGET_CLIENT, make_reply


def node_client_id(node_config: Mapping[str, object]) -> str:
    """The node's own id: ``client-id`` from node-config, else the partition id."""
    if "client-id" in node_config and str(node_config["client-id"]) != "":
        return str(node_config["client-id"])
    if "partition-id" in node_config:
        return str(int(node_config["partition-id"]))   # type: ignore[call-overload]
    raise ValueError(
        "this SuperNode has neither 'partition-id' nor 'client-id' in its node config; start it "
        "with --node-config \"partition-id=0 num-partitions=N\""
    )


def _partitions(node_config: Mapping[str, object]) -> int | None:
    """``N`` for a node that is a partition of ``N`` (no ``client-id``), else None."""
    if str(node_config.get("client-id", "")) != "" or "num-partitions" not in node_config:
        return None
    return int(node_config["num-partitions"])   # type: ignore[call-overload]


def serves(node_config: Mapping[str, object], client_id: str) -> bool:
    """Whether this node serves ``client_id``: its own id, or, for a node that is partition
    ``p`` of ``N`` (no ``client-id``), every client ``c`` with ``c mod N = p``. That is how a
    simulation with fewer SuperNodes than clients places them (``place_clients`` in
    ``strategies/base.py``); a deployment's nodes have ``N`` >= the number of clients, so
    each serves its own client alone."""
    own = node_client_id(node_config)
    if client_id == own:
        return True
    size = _partitions(node_config)
    return bool(size) and client_id.isdigit() and int(client_id) % size == int(own)   # type: ignore[operator]


def serves_several(node_config: Mapping[str, object], num_clients: int) -> bool:
    """Whether this node serves more than one of ``num_clients`` clients (see :func:`serves`)."""
    size = _partitions(node_config)
    return size is not None and size < num_clients


def client_id_of(context: Context, config: Mapping[str, object] | None = None) -> str:
    """The client a message is for: the one the server names in its config
    (``TARGET_CLIENT``), checked against what this node serves; else the node's own."""
    target = None if config is None else config.get(TARGET_CLIENT)
    if target is None:
        return node_client_id(context.node_config)
    if not serves(context.node_config, str(target)):
        size = context.node_config.get("num-partitions")
        raise ValueError(
            f"this node is client {node_client_id(context.node_config)}"
            + (f" (partition of {size})" if size is not None else "")
            + f" and does not serve client {target}; the message was sent to the wrong node "
            "(a deployment's node serves its own client only)")
    return str(target)


def identify(msg: Message, context: Context) -> Message:
    """Identify this node: the server asks before sampling, so that it can address every
    client by its stable id (and send it its personal arrays) from the first message on."""
    size = context.node_config.get("num-partitions")
    return make_reply(msg, {}, {} if size is None else {NUM_PARTITIONS: float(int(size))},
                      node_client_id(context.node_config), 0)
