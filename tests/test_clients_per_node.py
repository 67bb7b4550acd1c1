"""Several clients per SuperNode in a simulation (``flwr run .`` on Flower's default
federation of 2 SuperNodes): every message names its client, a node serves the clients
``c mod N = p`` and refuses any other, and the results equal one node per client bit for
bit (the e2e check with real ``flwr run`` is in tests/test_run_command.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from helpers import FakeGrid, make_strategy, received
from test_method_contract import Clients, _records, _run_config

from client import app as client_app
from client.identity import client_id_of, serves, serves_several
from common.config import compose_run
from common.protocol import CONFIG_KEY, TARGET_CLIENT, make_reply, to_record
from learning.datasets.federated import load_federated_data
from server.app import build_strategy
from server.loop import run_federation
from server.results import RunRecorder
from strategies.addressing import place_clients
from strategies.base import PersonalizedStrategy

REF = {"w": np.zeros((3, 2), np.float32)}


class NodeClients(Clients):
    """The ClientApp on ``num_nodes`` simulated nodes: one Flower context per *node*, shared
    by every client the node serves, as Flower's simulation keeps it."""

    def __init__(self, run_config: dict[str, Any], client_ids: list[str], run_id: int, num_nodes: int) -> None:
        super().__init__(run_config, client_ids, run_id)
        self.contexts = {str(p): Context(run_id=run_id, node_id=p + 1,
                                         node_config={"partition-id": p, "num-partitions": num_nodes},
                                         state=RecordDict(), run_config=run_config)
                         for p in range(num_nodes)}
        self.num_nodes = num_nodes

    def __call__(self, cid: str, msg: Message) -> Message:
        node = str(int(cid) % self.num_nodes)
        context = self.contexts[node]
        if msg.metadata.message_type == MessageType.TRAIN:
            return client_app.train(msg, context)
        self.evaluate_messages += 1
        return client_app.evaluate(msg, context)


def _federate_on(run_config: dict[str, Any], run_id: int, num_nodes: int | None) -> PersonalizedStrategy:
    run = compose_run(run_config)
    cfg = run.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    strategy = build_strategy(cfg, data)
    if num_nodes is None:   # one node per client
        grid = FakeGrid(data.client_ids, Clients(run_config, data.client_ids, run_id),
                        num_partitions=len(data.client_ids))
    else:
        grid = FakeGrid([str(p) for p in range(num_nodes)],
                        NodeClients(run_config, data.client_ids, run_id, num_nodes), num_partitions=num_nodes)
    run_federation(strategy, grid, run.settings, RunRecorder(cfg, run.settings))
    if num_nodes is not None:   # a node's context is shared by its clients: no state cached in it
        assert all(not c.state.array_records for c in grid.handler.contexts.values())
    return strategy


@pytest.mark.usefixtures("flower_task")
@pytest.mark.parametrize("name", ["fedavg", "ditto", "fedbn", "fedbabu"])
def test_two_nodes_serve_eight_clients_bit_for_bit_like_eight_nodes(name: str, tmp_path: Path) -> None:
    # half the clients a round: clients not sampled keep their private state across rounds
    extra = ["dataset.clients_per_domain=2", "fraction_train=0.5"]
    apart = _federate_on(_run_config(name, extra, tmp_path, "eight", rounds=3), 1, None)
    shared = _federate_on(_run_config(name, extra, tmp_path, "two", rounds=3), 2, 2)
    last = _records(tmp_path / "two")[-1]
    assert len(shared.client_ids) == 8 and sorted(last["clients"], key=int) == shared.client_ids
    assert len(set(shared.directory.node_of.values())) == 2 and len(set(apart.directory.node_of.values())) == 8
    for a, b in zip(_records(tmp_path / "eight"), _records(tmp_path / "two"), strict=True):
        assert a["sampled"] == b["sampled"] and b["failed"] == {} and b["rejected"] == {}
        assert a["clients"] == b["clients"] and a["evaluate"] == b["evaluate"], f"round {a['round']}"
    for group, arrays in apart.state()[0].items():
        for k, v in arrays.items():
            np.testing.assert_array_equal(shared.state()[0][group][k], v, err_msg=f"{group}/{k}")
    # every client's private state went to its own folder, not its node's
    def states(run: str) -> dict[str, list[str]]:
        return {d.name: sorted(f.name for f in d.iterdir()) for d in (tmp_path / run / "client_state").iterdir()}
    assert states("two") == states("eight") and len(states("two")) >= 6   # the clients that trained


def test_place_clients_puts_client_c_on_partition_c_mod_n() -> None:
    own = {"0": 100, "1": 101, "2": 102}
    assert place_clients([str(i) for i in range(8)], own, 3) == {
        str(c): 100 + c % 3 for c in range(8)}
    # a node identified as the client itself wins; a deployment (no size) never shares
    assert place_clients(["0", "4", "x"], {"0": 7, "4": 9, "1": 8}, 3) == {"0": 7, "4": 9}
    assert place_clients([str(i) for i in range(5)], own, None) == own


def test_a_node_serves_its_partitions_clients_and_refuses_any_other() -> None:
    sim = {"partition-id": 1, "num-partitions": 3}
    assert [c for c in map(str, range(9)) if serves(sim, c)] == ["1", "4", "7"]
    assert serves_several(sim, 8) and not serves_several(sim, 3)
    named = {"client-id": "hospital-a", "partition-id": 0, "num-partitions": 1}
    assert serves(named, "hospital-a") and not serves(named, "0") and not serves_several(named, 8)
    context = Context(run_id=1, node_id=5, node_config=dict(sim), state=RecordDict(), run_config={})
    assert client_id_of(context) == "1" and client_id_of(context, {TARGET_CLIENT: "7"}) == "7"
    with pytest.raises(ValueError, match="this node is client 1 .partition of 3. and does not serve client 2"):
        client_id_of(context, {TARGET_CLIENT: "2"})


@pytest.mark.usefixtures("flower_task")
def test_the_clientapp_refuses_a_message_for_a_client_its_node_does_not_serve() -> None:
    msg = Message(RecordDict({"arrays": to_record(REF), CONFIG_KEY: ConfigRecord({TARGET_CLIENT: "3", "server-round": 1})}),
                  dst_node_id=5, message_type=MessageType.TRAIN)
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 8},
                      state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="does not serve client 3"):
        client_app.train(msg, context)


@pytest.mark.usefixtures("flower_task")
def test_a_reply_for_another_client_than_its_message_named_is_rejected() -> None:
    def wrong(cid: str, msg: Message) -> Message:
        return make_reply(msg, {"w": np.ones((3, 2), np.float32)}, {}, "2" if cid == "0" else cid, 1)

    st = make_strategy(PersonalizedStrategy, dict(REF), ["0", "1", "2", "3"])
    grid = FakeGrid(["0", "1"], wrong, num_partitions=2)
    train = st.begin_train(1, {}, grid)
    msgs = train.messages
    assert {str(m.content.config_records[CONFIG_KEY][TARGET_CLIENT]): m.metadata.dst_node_id for m in msgs} == {
        "0": grid.node_of["0"], "1": grid.node_of["1"], "2": grid.node_of["0"], "3": grid.node_of["1"]}
    result = st.aggregate_round(received(train, grid, 5))
    assert result.log.rejected == {"0": "the reply to client 0's message is for client 2"}
    assert sorted(result.log.replied) == ["1", "2", "3"]


@pytest.mark.usefixtures("flower_task")
def test_a_shared_model_is_packed_once_per_exchange_and_personal_payloads_apart() -> None:
    """Every client of a FedAvg round gets the same arrays: one packed record for all of them
    (1,000 clients held 1,000 copies of the model on the server); a client with its own arrays
    gets its own record, with its own values."""
    from common.protocol import ARRAYS_KEY, from_record

    st = make_strategy(PersonalizedStrategy, {"w": np.zeros((3, 2), np.float32), "b": np.ones(2, np.float32)},
                       [str(i) for i in range(6)])
    grid = FakeGrid([str(i) for i in range(6)], num_partitions=6)
    train = st.begin_train(1, {}, grid)
    msgs = train.messages
    records = [m.content.array_records[ARRAYS_KEY] for m in msgs]
    assert len(msgs) == 6 and all(r is records[0] for r in records)
    st.personal["3"] = {"w": np.full((3, 2), 7.0, np.float32)}
    train = st.begin_train(2, {}, grid)
    msgs = train.messages
    by_client = {str(m.content.config_records[CONFIG_KEY][TARGET_CLIENT]): m.content.array_records[ARRAYS_KEY]
                 for m in msgs}
    assert by_client["3"] is not by_client["0"] and by_client["0"] is by_client["5"]
    assert float(from_record(by_client["3"])["w"][0, 0]) == 7.0 and float(from_record(by_client["0"])["w"][0, 0]) == 0
    assert msgs[0].content.array_records[ARRAYS_KEY] is not records[0]   # a new exchange packs anew


# ---------------------------------------------------------------- placement, waiting, idle nodes
def _plain_strategy(n: int, **kw: object) -> PersonalizedStrategy:
    kw.setdefault("wait_for_clients", 120.0)
    return make_strategy(PersonalizedStrategy, dict(REF), [str(i) for i in range(n)], **kw)


def _train(st: PersonalizedStrategy, grid: FakeGrid, rnd: int = 1) -> list:
    return st.begin_train(rnd, {}, grid).messages


def test_two_supernodes_serve_eight_clients_at_once() -> None:
    st = _plain_strategy(8)
    grid = FakeGrid([str(i) for i in range(2)], num_partitions=2)   # flwr's default: 2 nodes
    t0 = time.monotonic()
    msgs = _train(st, grid)
    assert time.monotonic() - t0 < 5   # not after wait_for_clients (120 s)
    assert [grid.target_of(m) for m in msgs] == [str(i) for i in range(8)]
    assert [grid.client_of[m.metadata.dst_node_id] for m in msgs] == ["0", "1"] * 4


def test_extra_supernodes_stay_idle() -> None:
    st = _plain_strategy(8)
    grid = FakeGrid([str(i) for i in range(10)], num_partitions=10)
    msgs = _train(st, grid)
    addressed = sorted(grid.client_of[m.metadata.dst_node_id] for m in msgs)
    assert addressed == [str(i) for i in range(8)]


def test_a_client_that_disappears_is_waited_for_once_not_every_round() -> None:
    st = _plain_strategy(4, wait_for_clients=1.0)
    grid = FakeGrid([str(i) for i in range(4)],
                    lambda cid, msg: make_reply(msg, {"w": np.ones((3, 2), np.float32)}, {}, cid, 1))
    st.aggregate_round(received(st.begin_train(1, {}, grid), grid, 5))
    del grid.client_of[grid.node_of.pop("3")]            # its SuperNode dies
    t0 = time.monotonic()
    st.aggregate_round(received(st.begin_train(2, {}, grid), grid, 5))
    waited = time.monotonic() - t0
    t1 = time.monotonic()
    msgs = _train(st, grid, 3)
    assert 0.9 <= waited < 3 and time.monotonic() - t1 < 0.5
    assert sorted(grid.client_of[m.metadata.dst_node_id] for m in msgs) == ["0", "1", "2"]
