"""Who this node is: its client id from the node config, and the reply to the server's
query. Light on purpose (no torch): a process that only answers the query never imports it
(``client/app.py``)."""

from __future__ import annotations

from flwr.app import Context, Message

from common.protocol import NUM_PARTITIONS, make_reply


def client_id_of(context: Context) -> str:
    """The stable id: ``client-id`` from node-config, else the simulation partition id."""
    node = context.node_config
    if "client-id" in node and str(node["client-id"]) != "":
        return str(node["client-id"])
    if "partition-id" in node:
        return str(int(node["partition-id"]))
    raise ValueError(
        "this SuperNode has neither 'partition-id' nor 'client-id' in its node config; start it "
        "with --node-config \"partition-id=0 num-partitions=N\""
    )


def identify(msg: Message, context: Context) -> Message:
    """Identify this node: the server asks before sampling, so that it can address every
    client by its stable id (and send it its personal arrays) from the first message on."""
    size = context.node_config.get("num-partitions")
    return make_reply(msg, {}, {} if size is None else {NUM_PARTITIONS: float(int(size))},
                      client_id_of(context), 0)
