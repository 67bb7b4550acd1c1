"""Shared test helpers: small configs, the ``pflower`` command runner, a fake Flower grid.

Markers: ``e2e`` = end-to-end runs of real processes (``pflower run``/``deploy``, Flower's
simulation); ``docker`` = the Docker demo (tests/test_docker.py). CI runs the fast lane
(``-m "not e2e and not docker"``) first, then the e2e lane, then the Docker lane.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from flwr.app import Error, Message, MessageType
from flwr.supercore.task_identity import TaskIdentity

from client.identity import serves
from common.protocol import CONFIG_KEY, NUM_PARTITIONS, TARGET_CLIENT, make_reply

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the per-client data cache (learning/data_cache.py) of this test session, not the user's
os.environ.setdefault("PFLOWER_DATA_CACHE", tempfile.mkdtemp(prefix="pflower-test-data-cache-"))

REPO = Path(__file__).resolve().parent.parent


def pflower(*args: str, timeout: float = 600, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the ``pflower`` command (``python -m ops.cli``) to completion, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)


def pflower_popen(args: list[str], log: Path) -> subprocess.Popen:
    """Start ``pflower`` in its own session (so a test can signal its whole tree), output to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "ops.cli", *args], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture
def flower_task() -> None:
    """Messages can only be created inside a Flower task; pretend to be one."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0


class FakeGrid:
    """A Grid whose nodes answer through ``handler(client_id, message) -> Message | None``
    (None = no reply); QUERY messages are answered with the node's client id, as the
    ClientApp does. Node ids are arbitrary per instance, as in Flower; pushed messages get
    an id, as Flower's grids give them. With ``num_partitions`` the nodes are simulated
    partitions: a node serves every client the message names that it serves
    (``client/identity.py``) and answers any other with an error, as the ClientApp does."""

    def __init__(self, client_ids: list[str],
                 handler: Callable[[str, Message], Message | None] | None = None,
                 node_base: int = 1000, num_partitions: int | None = None) -> None:
        self.num_partitions = num_partitions   # what simulated nodes report when identified
        self.node_of = {cid: node_base + 7 * i + 3 for i, cid in enumerate(reversed(client_ids))}
        self.client_of = {n: c for c, n in self.node_of.items()}
        self.handler = handler
        self.timeouts: list[float | None] = []
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.client_of)

    def node_config(self, node_id: int) -> dict[str, object]:
        cid = self.client_of[node_id]
        if self.num_partitions is not None and cid.isdigit():
            return {"partition-id": int(cid), "num-partitions": self.num_partitions}
        return {"client-id": cid}

    def target_of(self, msg: Message) -> str:
        """The client a message is for (what the ClientApp's handler sees)."""
        config = msg.content.config_records.get(CONFIG_KEY)
        return str(config[TARGET_CLIENT]) if config is not None and TARGET_CLIENT in config \
            else self.client_of[msg.metadata.dst_node_id]

    def send_and_receive(self, messages: list[Message], timeout: float | None = None) -> list[Message]:
        self.timeouts.append(timeout)
        out = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.sent.append(msg)
            cid = self.client_of[msg.metadata.dst_node_id]
            if msg.metadata.message_type == MessageType.QUERY:
                size = {} if self.num_partitions is None else {NUM_PARTITIONS: float(self.num_partitions)}
                out.append(make_reply(msg, {}, size, cid, 0))
                continue
            target = self.target_of(msg)
            if not serves(self.node_config(msg.metadata.dst_node_id), target):
                out.append(Message(Error(code=0, reason=f"node {cid} does not serve client {target}"),
                                   reply_to=msg))
                continue
            reply = self.handler(target, msg) if self.handler is not None else None
            if reply is not None:
                out.append(reply)
        return out


@pytest.fixture
def digits_cfg():
    from learning.config import compose_config

    return compose_config({}, ["rounds=2"])
