"""Several clients' messages in one (``common/bundles.py``): a simulated node that serves
several clients gets an exchange's messages in a few bundles, runs each client's message as
if it had come alone, and the server gets one reply per message, the reply it would have got
without bundles. Checked piece by piece against obvious computations, and end to end: a
federation whose messages travel in bundles ends bit for bit where one without them ends."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict
from helpers import BundlingGrid, FakeGrid
from test_clients_per_node import NodeClients
from test_method_contract import _records, _run_config

from client import app as client_app
from common.bundles import (
    BUNDLE_KEY,
    BUNDLES_PER_NODE,
    MAX_BUNDLE_BYTES,
    MAX_BUNDLE_CLIENTS,
    bundle,
    bundle_size,
    bundled_count,
    group_for_bundles,
    replies_of,
    run_bundle,
    send_and_receive,
)
from common.config import compose_run
from common.flower_compat import CLIENT_APP_RAISED_EXCEPTION
from common.protocol import ARRAYS_KEY, CONFIG_KEY, from_record, to_record
from learning.datasets.federated import load_federated_data
from ops.resources import simulated_nodes, simulation_config
from server.app import build_strategy
from server.loop import run_federation
from server.results import RunRecorder
from strategies.replies import short_reason

pytestmark = pytest.mark.usefixtures("flower_task")


def _message(i: int, node: int, kind: str = MessageType.TRAIN) -> Message:
    return Message(RecordDict({ARRAYS_KEY: to_record({"w": np.full((2, 3), float(i), np.float32)}),
                               CONFIG_KEY: ConfigRecord({"i": i})}), dst_node_id=node, message_type=kind)


def _echo(msg: Message, _: Context | None) -> Message:
    """A handler: replies with its input doubled and its index; message 3 raises, message 4
    answers with an error reply."""
    i = int(msg.content.config_records[CONFIG_KEY]["i"])  # type: ignore[call-overload]
    if i == 3:
        raise ValueError("client 3 fails")
    if i == 4:
        return Message(Error(code=7, reason="client 4 refuses"), reply_to=msg)
    w = from_record(msg.content.array_records[ARRAYS_KEY])["w"]
    return Message(RecordDict({ARRAYS_KEY: to_record({"w": 2 * w}), "metrics": ConfigRecord({"i": i})}), reply_to=msg)


@pytest.mark.parametrize("messages,nodes,largest", [(m, n, b) for m in (1, 2, 7, 8, 36, 100, 1000)
                                                     for n in (1, 2, 3, 8) for b in (0, 436_000, 20_000_000, 200_000_000)])
def test_bundles_are_even_few_and_bounded(messages: int, nodes: int, largest: int) -> None:
    """Spread over the nodes as the placement puts them (client c on node c mod N): every
    message in exactly one group of one node, groups of a node differ by one message at most,
    none above 10 clients or 64 MB, and no node gets more than two groups unless a bound
    forces more."""
    msgs = [_message(i, 100 + i % nodes) for i in range(messages)]
    groups = group_for_bundles(msgs, bundle_size(messages, nodes, largest))
    assert sorted(id(m) for g in groups for m in g) == sorted(id(m) for m in msgs)
    assert all(len({m.metadata.dst_node_id for m in g}) == 1 for g in groups)
    limit = min(MAX_BUNDLE_CLIENTS, max(1, MAX_BUNDLE_BYTES // max(largest, 1)))   # the documented bounds
    assert all(len(g) <= limit for g in groups)
    for node in range(nodes):
        sizes = [len(g) for g in groups if g[0].metadata.dst_node_id == 100 + node]
        mine = len(range(node, messages, nodes))
        assert sum(sizes) == mine and (not sizes or max(sizes) - min(sizes) <= 1)
        if messages <= nodes:    # one message a node: nothing to bundle
            assert sizes == [1] * mine
        else:                    # as few as the bounds allow, two a node when they allow it
            assert len(sizes) <= max(BUNDLES_PER_NODE, math.ceil(mine / limit))
            assert limit == 1 or mine <= BUNDLES_PER_NODE or max(sizes) >= 2


def test_the_paper_settings_bundles() -> None:
    """FEDORA's 36 clients on 2 nodes: 4 bundles of 9; the default 8 clients: 4 of 2; FedBasis'
    80 clients of 213 MB each: no bundles; 1,000 clients: bundles of 10."""
    assert bundle_size(36, 2, 436_000) == 9 and bundle_size(8, 2, 595_000) == 2
    assert bundle_size(80, 2, 213_000_000) == 1 and bundle_size(1000, 2, 436_000) == 10
    assert [len(g) for g in group_for_bundles([_message(i, 1) for i in range(18)], 8)] == [6, 6, 6]


def test_groups_keep_each_nodes_messages_in_order_and_never_mix_nodes_or_types() -> None:
    msgs = [_message(i, 10 + i % 3, MessageType.TRAIN if i < 11 else MessageType.EVALUATE) for i in range(14)]
    groups = group_for_bundles(msgs, 3)
    assert sorted(id(m) for g in groups for m in g) == sorted(id(m) for m in msgs)   # each message once
    for g in groups:
        assert 1 <= len(g) <= 3
        assert len({(m.metadata.dst_node_id, m.metadata.message_type) for m in g}) == 1
        positions = [msgs.index(m) for m in g]
        assert positions == sorted(positions)
    # node 10's train messages (0, 3, 6, 9): two groups of two, in order
    node10_train = [g for g in groups if g[0].metadata.dst_node_id == 10 and g[0].metadata.message_type == MessageType.TRAIN]
    assert [[msgs.index(m) for m in g] for g in node10_train] == [[0, 3], [6, 9]]


def test_a_bundles_replies_are_the_replies_its_messages_get_alone() -> None:
    group = [_message(i, 5) for i in range(6)]
    alone = {}
    for msg in group:
        msg.metadata.__dict__["_message_id"] = f"alone-{id(msg)}"
        try:
            alone[id(msg)] = _echo(msg, None)
        except ValueError as err:
            alone[id(msg)] = err
    one = bundle(group)
    assert bundled_count(one) == 6 and one.metadata.dst_node_id == 5
    assert one.content.array_records["2/" + ARRAYS_KEY] is group[2].content.array_records[ARRAYS_KEY]   # no copy
    one.metadata.__dict__["_message_id"] = "bundle"
    reply = run_bundle(one, None, _echo)   # type: ignore[arg-type]
    assert bundled_count(reply) == 6 and reply.metadata.reply_to_message_id == "bundle"
    replies = replies_of(reply, group)
    for msg, got in zip(group, replies, strict=True):
        want = alone[id(msg)]
        assert got.metadata.reply_to_message_id == msg.metadata.message_id != ""
        assert got.metadata.src_node_id == msg.metadata.dst_node_id
        if isinstance(want, ValueError):   # reported as Flower's engine reports an exception
            assert got.has_error() and got.error.code == 2 and short_reason(got.error.reason) == "client 3 fails"
        elif want.has_error():
            assert got.has_error() and (got.error.code, got.error.reason) == (7, "client 4 refuses")
        else:
            assert not got.has_error() and sorted(got.content.keys()) == sorted(want.content.keys())
            np.testing.assert_array_equal(from_record(got.content.array_records[ARRAYS_KEY])["w"],
                                          from_record(want.content.array_records[ARRAYS_KEY])["w"])
            assert dict(got.content.config_records["metrics"]) == dict(want.content.config_records["metrics"])


def test_a_bundle_expires_when_its_first_message_would_and_reports_errors_as_flower_does(caplog: pytest.LogCaptureFixture) -> None:
    from flwr.common.constant import ErrorCode

    group = [_message(i, 5) for i in range(3)]
    group[1].metadata.ttl = 30.0
    one = bundle(group)
    assert abs(one.metadata.created_at + one.metadata.ttl - (group[1].metadata.created_at + 30.0)) < 1e-6
    assert CLIENT_APP_RAISED_EXCEPTION == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    one.metadata.__dict__["_message_id"] = "bundle"
    failing = [_message(3, 5)]
    with caplog.at_level("ERROR"):
        reply = run_bundle(bundle(failing + group[:1]), None, _echo)   # type: ignore[arg-type]
    assert "client 3 fails" in caplog.text and "Traceback" in caplog.text   # the traceback is kept
    assert replies_of(reply, failing + group[:1])[0].has_error()


def test_an_error_reply_to_a_bundle_is_every_bundled_messages_error() -> None:
    group = [_message(i, 5) for i in range(3)]
    one = bundle(group)
    failed = Message(Error(code=0, reason="the actor died"), reply_to=one)
    replies = replies_of(failed, group)
    assert [r.metadata.reply_to_message_id for r in replies] == [m.metadata.message_id for m in group]
    assert all(r.has_error() and r.error.reason == "the actor died" for r in replies)


def test_a_message_that_is_no_bundle_goes_straight_through_and_the_mod_runs_first() -> None:
    msg = _message(0, 5)
    seen = []
    reply = run_bundle(msg, None, lambda m, c: seen.append(m) or _echo(m, c))   # type: ignore[arg-type, func-returns-value]
    assert seen == [msg] and BUNDLE_KEY not in reply.content.config_records
    assert client_app._mods()[0] is run_bundle   # the timing and fault mods see one client's message


def test_send_and_receive_bundles_a_nodes_messages_and_hands_on_one_reply_each() -> None:
    grid = BundlingGrid(["0", "1"], lambda cid, m: _echo(m, None), num_partitions=2)
    nodes = [grid.node_of["0"], grid.node_of["1"]]
    msgs = [_message(i, nodes[i % 2]) for i in range(10) if i not in (3, 4)]   # 8 messages
    got = send_and_receive(grid, msgs, timeout=5, on_reply=lambda m: m)
    assert len(grid.pushed) == 4 and all(bundled_count(b) == 2 for b in grid.pushed)
    assert sorted(r.metadata.reply_to_message_id for r in got) == sorted(m.metadata.message_id for m in msgs)
    by_id = {r.metadata.reply_to_message_id: r for r in got}
    for m in msgs:
        i = int(m.content.config_records[CONFIG_KEY]["i"])  # type: ignore[call-overload]
        np.testing.assert_array_equal(from_record(by_id[m.metadata.message_id].content.array_records[ARRAYS_KEY])["w"],
                                      np.full((2, 3), 2.0 * i, np.float32))
    # one message per node: nothing to bundle
    grid.pushed.clear()
    send_and_receive(grid, msgs[:2], timeout=5, on_reply=lambda m: m)
    assert len(grid.pushed) == 2 and not any(bundled_count(b) for b in grid.pushed)


@pytest.mark.parametrize("name", ["fedavg", "ditto"])
def test_a_federation_in_bundles_ends_bit_for_bit_where_one_node_per_client_ends(name: str, tmp_path: Path) -> None:
    extra = ["dataset.clients_per_domain=2", "fraction_train=0.75"]

    def federate(run: str, grid_of: type[FakeGrid], num_nodes: int | None, run_id: int) -> BundlingGrid | FakeGrid:
        run_config = _run_config(name, extra, tmp_path, run, rounds=3)
        composed = compose_run(run_config)
        cfg = composed.cfg
        data = load_federated_data(cfg.dataset, int(cfg.seed))
        nodes = num_nodes or len(data.client_ids)
        grid = grid_of([str(p) for p in range(nodes)], NodeClients(run_config, data.client_ids, run_id, nodes),
                       num_partitions=nodes)
        run_federation(build_strategy(cfg, data), grid, composed.settings, RunRecorder(cfg, composed.settings))
        return grid

    federate("apart", FakeGrid, None, 1)
    grid = federate("bundled", BundlingGrid, 2, 2)
    assert isinstance(grid, BundlingGrid) and max(bundled_count(m) for m in grid.pushed) >= 2   # bundles travelled
    apart, bundled = _records(tmp_path / "apart"), _records(tmp_path / "bundled")
    for a, b in zip(apart, bundled, strict=True):
        assert a["sampled"] == b["sampled"] and b["failed"] == {} and b["rejected"] == {}
        assert a["clients"] == b["clients"] and a["evaluate"] == b["evaluate"], f"round {a['round']}"


def test_a_simulation_gets_as_many_nodes_as_clients_run_at_once() -> None:
    assert simulated_nodes(36, 1, 0, cpus=2, gpus=0) == 2
    assert simulated_nodes(36, 2, 0, cpus=16, gpus=0) == 8
    assert simulated_nodes(36, 1, 0.25, cpus=16, gpus=1) == 4      # 4 clients share the GPU at once
    assert simulated_nodes(36, 1, 0.125, cpus=16, gpus=1) == 8
    assert simulated_nodes(36, 1, 1 / 3, cpus=16, gpus=1) == 3
    assert simulated_nodes(36, 1, 1 / 3, cpus=16, gpus=2) == 6
    assert simulated_nodes(36, 4, 0.125, cpus=16, gpus=1) == 4     # the CPUs bound it first
    assert simulated_nodes(3, 1, 0, cpus=16, gpus=0) == 3           # never more nodes than clients
    assert simulated_nodes(5, 4, 0, cpus=2, gpus=0) == 1
    assert "num-supernodes=2 " in simulation_config(36, 1, 0, None, 2)
    assert "num-supernodes=36 " in simulation_config(36, 1, 0, None)   # a Ray cluster: one node per client
