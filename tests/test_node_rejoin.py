"""A message whose node was unavailable (the SuperLink's ``NODE_UNAVAILABLE`` error: a SuperNode
restarting, or the SuperLink paused so that it missed the node's heartbeats) is sent again to
the client's node once it is back, so that the round ends as the undisturbed round does; a node
that stays away fails its client for the round once, and the next round does not wait for it
again; a message whose ClientApp crashed on a live node is sent again once
(``common/flower_compat.py: send_and_receive``, ``strategies/addressing.py: Exchange``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import Error, Message, RecordDict
from helpers import FakeGrid, make_strategy

from common import flower_compat
from common.flower_compat import (
    CLIENT_APP_CRASHED,
    NODE_UNAVAILABLE,
    client_app_crashed,
    may_send_again,
    node_unavailable,
    send_and_receive,
)
from common.protocol import make_reply
from strategies.baselines import FedAvg

REF = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
SIZES = {"0": 10, "1": 30, "2": 60}
REASON = "Error: Node Unavailable - The destination node failed to report a heartbeat"


def _client(cid: str, msg: Message) -> Message:
    """Each client uploads the server's arrays plus its own value (w = b = 1, 2, 3)."""
    v = float(cid) + 1.0
    return make_reply(msg, {"w": np.full((4, 3), v, np.float32), "b": np.full(3, -v, np.float32)},
                      {"loss": v}, cid, SIZES[cid])


class RestartingGrid(FakeGrid):
    """A deployment's grid, pushed and pulled, in which client ``lost``'s node goes away when its
    first message arrives (the SuperLink answers that message with ``NODE_UNAVAILABLE``) and,
    after the server has looked for the nodes ``away_looks`` times, comes back as a new node (a
    restarted insecure SuperNode gets a new node id); ``None`` = it never comes back."""

    def __init__(self, client_ids: list[str], lost: str, away_looks: int | None) -> None:
        super().__init__(client_ids, _client)
        self.lost, self.away_looks = lost, away_looks
        self.old_node = self.node_of[lost]
        self.looks = 0
        self.replies: dict[str, Message] = {}
        self.delivered: list[tuple[int, str]] = []   # (node, message type) of what reached a node

    def get_node_ids(self) -> list[int]:
        if self.old_node not in self.client_of:   # away
            self.looks += 1
            if self.away_looks is not None and self.looks == self.away_looks:   # the restarted node registers
                new_node = self.old_node + 1
                self.node_of[self.lost] = new_node
                self.client_of[new_node] = self.lost
        return list(self.client_of)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            node = msg.metadata.dst_node_id
            if node == self.old_node and node in self.client_of and msg.metadata.message_type != "query":
                del self.client_of[node]   # the node dies with this message
                reply = Message(Error(code=NODE_UNAVAILABLE, reason=REASON), reply_to=msg)
            elif node in self.client_of:
                self.delivered.append((node, msg.metadata.message_type))
                reply = self.answer(msg)
            else:
                reply = Message(Error(code=NODE_UNAVAILABLE, reason=REASON), reply_to=msg)
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def _round(grid: FakeGrid, wait_for_clients: float = 30.0, timeout: float = 60.0) -> tuple[FedAvg, object]:
    strategy = make_strategy(FedAvg, dict(REF), list(SIZES), wait_for_clients=wait_for_clients)
    train = strategy.begin_train(1, {}, grid)
    send_and_receive(grid, train.messages, timeout=timeout, on_reply=train.replies.take, rejoin=train.exchange)
    return strategy, strategy.aggregate_round(train)


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flower_compat, "REPLY_POLL_S", 0.001)
    monkeypatch.setattr(flower_compat, "RESEND_POLL_S", 0.0)


@pytest.mark.usefixtures("flower_task")
def test_a_message_whose_node_restarts_is_sent_again_and_the_round_is_the_undisturbed_one() -> None:
    twin_strategy, twin = _round(FakeGrid(list(SIZES), _client))
    grid = RestartingGrid(list(SIZES), lost="1", away_looks=3)
    strategy, result = _round(grid)
    assert result.log.failed == {} and sorted(result.log.replied) == ["0", "1", "2"], result.log.failed
    assert (grid.old_node + 1, "train") in grid.delivered       # client 1's message went to its new node
    assert strategy.directory.node_of["1"] == grid.old_node + 1
    for key in REF:
        np.testing.assert_array_equal(strategy.global_arrays[key], twin_strategy.global_arrays[key])
    # the mean of the three uploads, written out: (10*1 + 30*2 + 60*3) / 100 = 2.5
    np.testing.assert_allclose(strategy.global_arrays["w"], np.full((4, 3), 2.5, np.float32))
    assert result.metrics == twin.metrics


@pytest.mark.usefixtures("flower_task")
def test_a_node_that_stays_away_fails_its_client_once_and_is_not_waited_for_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    grid = RestartingGrid(list(SIZES), lost="1", away_looks=None)
    strategy, result = _round(grid, wait_for_clients=0.05)    # the window: min(wait_for_clients, 60 s)
    assert list(result.log.failed) == ["1"] and "Node Unavailable" in result.log.failed["1"], result.log.failed
    np.testing.assert_allclose(strategy.global_arrays["w"], np.full((4, 3), (10 * 1 + 60 * 3) / 70, np.float32))
    slept: list[float] = []
    monkeypatch.setattr("strategies.addressing.time.sleep", slept.append)
    assert strategy.directory.connected(grid) == ["0", "2"]
    assert slept == []     # waited for within the round: the next round goes on without it


def test_only_an_unavailable_node_or_a_crashed_clientapp_is_sent_again() -> None:
    def error(code: int) -> Message:
        return Message(Error(code=code, reason="x"), reply_to=Message(
            content=RecordDict(), dst_node_id=1, message_type="train"))

    assert node_unavailable(error(NODE_UNAVAILABLE)) and not client_app_crashed(error(NODE_UNAVAILABLE))
    assert client_app_crashed(error(CLIENT_APP_CRASHED)) and not node_unavailable(error(CLIENT_APP_CRASHED))
    for code in (0, 2, 3, 4):   # a ClientApp that raised, a message or reply that expired, unknown
        assert not node_unavailable(error(code)) and not may_send_again(error(code), 0), code
    assert may_send_again(error(NODE_UNAVAILABLE), 5)            # a node may go away again and again
    assert may_send_again(error(CLIENT_APP_CRASHED), 0)          # a crash is sent again once
    assert not may_send_again(error(CLIENT_APP_CRASHED), 1)      # a second crash is the ClientApp's own


class CrashingGrid(FakeGrid):
    """A deployment's grid in which client ``crashed``'s ClientApp dies on its first
    ``crashes`` messages (its SuperNode answers each ``CLIENT_APP_CRASHED``) while its node
    stays connected; later messages are answered."""

    def __init__(self, client_ids: list[str], crashed: str, crashes: int) -> None:
        super().__init__(client_ids, _client)
        self.crashed, self.crashes_left = crashed, crashes
        self.replies: dict[str, Message] = {}
        self.sent_to_crashed = 0

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            if msg.metadata.dst_node_id == self.node_of[self.crashed]:
                self.sent_to_crashed += 1
                if self.crashes_left:
                    self.crashes_left -= 1
                    self.replies[msg.metadata.message_id] = Message(
                        Error(code=CLIENT_APP_CRASHED, reason="ClientApp stopped responding."), reply_to=msg)
                    ids.append(msg.metadata.message_id)
                    continue
            self.replies[msg.metadata.message_id] = self.answer(msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


@pytest.mark.usefixtures("flower_task")
def test_a_message_whose_clientapp_crashed_is_sent_again_once_to_the_same_node() -> None:
    twin_strategy, twin = _round(FakeGrid(list(SIZES), _client))
    grid = CrashingGrid(list(SIZES), crashed="1", crashes=1)
    strategy, result = _round(grid)
    assert result.log.failed == {} and grid.sent_to_crashed == 2, result.log.failed
    for key in REF:
        np.testing.assert_array_equal(strategy.global_arrays[key], twin_strategy.global_arrays[key])
    assert result.metrics == twin.metrics


@pytest.mark.usefixtures("flower_task")
def test_a_clientapp_that_crashes_again_fails_its_client_after_one_resend() -> None:
    grid = CrashingGrid(list(SIZES), crashed="1", crashes=5)
    strategy, result = _round(grid)
    assert list(result.log.failed) == ["1"] and "stopped responding" in result.log.failed["1"], result.log.failed
    assert grid.sent_to_crashed == 2
    np.testing.assert_allclose(strategy.global_arrays["w"], np.full((4, 3), (10 * 1 + 60 * 3) / 70, np.float32))


@pytest.mark.usefixtures("flower_task")
def test_a_node_away_when_the_round_ends_is_given_up_and_not_waited_for_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The window (30 s) is longer than what is left of the round (0.3 s): the round's end gives
    the node up, so the evaluation's and next round's ``connected()`` do not wait for it."""
    grid = RestartingGrid(list(SIZES), lost="1", away_looks=None)
    strategy, result = _round(grid, wait_for_clients=30.0, timeout=0.3)
    assert list(result.log.failed) == ["1"], result.log.failed
    slept: list[float] = []
    monkeypatch.setattr("strategies.addressing.time.sleep", slept.append)
    assert strategy.directory.connected(grid) == ["0", "2"] and slept == []


@pytest.mark.usefixtures("flower_task")
def test_a_resent_message_lives_only_as_long_as_the_round() -> None:
    grid = RestartingGrid(list(SIZES), lost="1", away_looks=3)
    strategy = make_strategy(FedAvg, dict(REF), list(SIZES), wait_for_clients=30.0, round_timeout=600.0)
    train = strategy.begin_train(1, {}, grid)
    send_and_receive(grid, train.messages, timeout=20.0, on_reply=train.replies.take, rejoin=train.exchange)
    resent = [m for m, c in train.exchange.addressed if c == "1"][-1]
    assert resent.metadata.dst_node_id == grid.old_node + 1
    assert resent.metadata.ttl <= 20.0     # not the round timeout's 600 s from the time it was sent


class RefusingGrid(RestartingGrid):
    """Pushes nothing (Flower's HttpGrid returns no ids when the SuperLink answers HTTP 413)."""

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        list(messages)
        return []


@pytest.mark.usefixtures("flower_task")
def test_a_grid_that_returns_no_ids_fails_the_clients_without_crashing_the_round() -> None:
    grid = RefusingGrid(list(SIZES), lost="1", away_looks=None)
    strategy = make_strategy(FedAvg, dict(REF), list(SIZES), min_train_clients=0)
    train = strategy.begin_train(1, {}, grid)
    assert send_and_receive(grid, train.messages, timeout=1.0, on_reply=train.replies.take,
                            rejoin=train.exchange) == []


@pytest.mark.usefixtures("flower_task")
def test_a_crashed_message_of_an_unidentified_node_is_sent_again_to_that_node() -> None:
    grid = CrashingGrid(list(SIZES), crashed="1", crashes=1)
    strategy = make_strategy(FedAvg, dict(REF), list(SIZES), wait_for_clients=30.0)
    node = grid.node_of["1"]
    train = strategy.begin_train(1, {}, grid)
    strategy.directory.node_to_client.pop(node)        # its identification is lost
    lost = next(m for m, c in train.exchange.addressed if c == "1")
    grid.push_messages([lost])                          # (its id; the grid answers CLIENT_APP_CRASHED)
    train.exchange.addressed = [(m, f"node-{node}" if m is lost else c) for m, c in train.exchange.addressed]
    strategy.directory.identify = lambda grid, nodes, timeout=None: None   # and it answers no query
    again = train.exchange.resend(grid, [lost], 10.0)
    assert lost.metadata.message_id and list(again) == [lost.metadata.message_id]
    assert again[lost.metadata.message_id].metadata.dst_node_id == node
    assert train.exchange.client_of(again[lost.metadata.message_id]) == f"node-{node}"


@pytest.mark.usefixtures("flower_task")
def test_a_client_without_a_node_at_an_evaluation_is_recorded_with_the_reason() -> None:
    """Client 1's node goes away for good in round 1: the round's evaluation names it, and the
    run's coverage says how it was lost (its train failure) rather than only that its node was
    gone at the end."""
    from server.summary import client_coverage
    from strategies.replies import NO_NODE_AT_EVALUATION

    grid = RestartingGrid(list(SIZES), lost="1", away_looks=None)
    strategy, result = _round(grid, wait_for_clients=0.05)
    evaluate = strategy.begin_evaluate(1, {}, grid)
    assert evaluate.unreachable == ["1"] and "1" not in evaluate.asked
    evaluation = strategy.evaluation_of(evaluate, send_and_receive(grid, evaluate.messages, timeout=10.0))
    assert sorted(evaluation.per_client) == ["0", "2"] and evaluation.failed == {"1": NO_NODE_AT_EVALUATION}
    rounds = [{"round": 1, "failed": result.log.failed, "rejected": {}}]
    last = {"clients": evaluation.per_client, "eval_failed": evaluation.failed}
    coverage = client_coverage(rounds, last, {c: {} for c in SIZES})
    assert coverage["clients_missing"] == {"1": f"round 1: {result.log.failed['1']}"}
    alone = client_coverage([], last, {c: {} for c in SIZES})   # no earlier failure: the evaluation's reason
    assert alone["clients_missing"] == {"1": f"final evaluation: {NO_NODE_AT_EVALUATION}"}
