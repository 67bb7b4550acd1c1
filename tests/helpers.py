"""Test helpers (importable as ``from helpers import ...``): the ``pflower`` command runner, a
fake Flower grid, and strategies built with test-sized run settings."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Error, Message, MessageType

from client.identity import serves
from common.methods import resolve_method
from common.protocol import CONFIG_KEY, NUM_PARTITIONS, TARGET_CLIENT, make_reply
from learning.params import NDArrays
from strategies.base import PersonalizedStrategy, RunSettings, TrainRound

REPO = Path(__file__).resolve().parent.parent

# the settings under which a method whose YAML row allows DP and secure aggregation has a mean
# rule (its options' not_private() is empty): FedBasis without the warm-up that seeds its bases
# from the clients' own models
PRIVATE_FORM: dict[str, list[str]] = {"fedbasis": ["strategy.warm_fraction=0"]}


def pflower(*args: str, timeout: float = 600, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the ``pflower`` command (``python -m ops.cli``) to completion, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)


def pflower_popen(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``pflower`` in its own session (so a test can signal its whole tree), output to
    ``log``; ``env`` is added to the environment (e.g. ``PFLOWER_FAULTS``, client/faults.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "ops.cli", *args], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


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
            reply = self.answer(msg)
            if reply is not None:
                out.append(reply)
        return out

    def answer(self, msg: Message) -> Message | None:
        """What the node ``msg`` is for answers (None = no reply)."""
        cid = self.client_of[msg.metadata.dst_node_id]
        if msg.metadata.message_type == MessageType.QUERY:
            size = {} if self.num_partitions is None else {NUM_PARTITIONS: float(self.num_partitions)}
            return make_reply(msg, {}, size, cid, 0)
        target = self.target_of(msg)
        if not serves(self.node_config(msg.metadata.dst_node_id), target):
            return Message(Error(code=0, reason=f"node {cid} does not serve client {target}"), reply_to=msg)
        return self.handler(target, msg) if self.handler is not None else None


class BundlingGrid(FakeGrid):
    """A :class:`FakeGrid` that pushes and pulls as the simulation's grid does and, like it,
    gets several messages to one node as bundles (``common/bundles.py``), which its nodes run
    through the ClientApp's bundle mod. ``pushed`` keeps what actually travelled."""

    bundles_messages = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: list[Message] = []
        self._replies: dict[str, Message] = {}

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        from common.bundles import run_bundle

        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.pushed.append(msg)
            reply = run_bundle(msg, None, lambda m, _: self.answer(m))   # type: ignore[arg-type, return-value]
            if reply is not None:
                self._replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]


def received(train: TrainRound, grid: FakeGrid, timeout: float = 5.0) -> TrainRound:
    """``train`` once its messages went through ``grid`` and every reply was taken."""
    train.take_all(grid.send_and_receive(train.messages, timeout=timeout))
    return train


def short_run(**overrides: Any) -> RunSettings:
    """Run settings for a strategy built in a test: few rounds, short waits, no run folder."""
    values: dict[str, Any] = dict(seed=0, rounds=2, fraction_train=1.0, min_train_clients=2,
                                  wait_for_clients=1.0, round_timeout=60.0, norm_bound=0.0)
    return RunSettings(**{**values, **overrides})


def make_strategy(cls: type[PersonalizedStrategy], initial_arrays: NDArrays, client_ids: list[str],
                  options: Mapping[str, Any] | None = None, model: Any = None, data: Any = None,
                  **run: Any) -> PersonalizedStrategy:
    """``cls`` around ``initial_arrays`` with :func:`short_run` (``run`` overrides them);
    ``options`` (a ``cfg.strategy`` mapping, resolved here as composition resolves it) default
    to FedAvg's (sample-weighted means)."""
    return cls(initial_arrays=initial_arrays, client_ids=client_ids, run=short_run(**run),
               method=resolve_method(options or {"name": "fedavg", "weighted": True}), model=model, data=data)


def model_config(name: str, **overrides: Any) -> dict[str, Any]:
    """``conf/model/<name>.yaml`` (every key, as a run composes it) with ``overrides``."""
    from omegaconf import OmegaConf

    path = REPO / "conf" / "model" / f"{name}.yaml"
    return {**OmegaConf.to_container(OmegaConf.load(path)), **overrides}  # type: ignore[dict-item]
