"""A round whose replies are folded into the mean as they arrive (``stream_replies_mb``): the
running mean against a slow, explicit weighted mean in any arrival order, what it refuses,
which rounds stream, and a streamed round through a grid that delivers one reply per pull,
checking that no reply keeps its arrays once taken and that the result is the held round's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Error, Message
from helpers import FakeGrid, make_strategy

from common.flower_compat import send_and_receive
from common.protocol import make_reply
from learning.params import RunningMean, num_bytes, weighted_mean
from strategies.base import PersonalizedStrategy, TrainRound
from strategies.baselines import FedAvg, Local
from strategies.fdse import FDSE
from strategies.fedbabu import FedBABU
from strategies.fedbasis import FedBasis
from strategies.fedora import FEDORA
from strategies.partialfed import PartialFedAdaptive, PartialFedFix
from strategies.replies import TrainReplies

CPU = torch.device("cpu")
REF = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32), "n": np.array(0, np.int64)}


def _slow_mean(clients: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """sum_k w_k a_k / sum_k w_k, one client and one element at a time, in float64."""
    out = {}
    for key in clients[0]:
        flat = np.zeros(clients[0][key].size)
        for client, w in zip(clients, weights, strict=True):
            values = client[key].astype(np.float64).ravel()
            for i in range(values.size):
                flat[i] += w * values[i]
        out[key] = (flat / sum(weights)).reshape(clients[0][key].shape)
    return out


def test_running_mean_equals_the_slow_mean_in_any_arrival_order() -> None:
    rng = np.random.default_rng(0)
    clients = [{"w": rng.normal(size=(4, 3)).astype(np.float32), "d": rng.normal(size=5),
                "n": np.array(rng.integers(0, 100), np.int64)} for _ in range(7)]
    weights = [float(w) for w in rng.integers(1, 50, size=7)]
    expected = _slow_mean(clients, weights)
    for order in (list(range(7)), list(range(6, -1, -1)), list(rng.permutation(7))):
        running = RunningMean(CPU)
        for i in order:
            running.add(clients[i], weights[i])
        out = running.result()
        assert {k: v.dtype for k, v in out.items()} == {"w": np.float32, "d": np.float64, "n": np.int64}
        np.testing.assert_allclose(out["w"], expected["w"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(out["d"], expected["d"], rtol=1e-12, atol=1e-14)
        assert out["n"] == np.rint(expected["n"])
        assert running.count == 7 and running.total == sum(weights)
    # and the client-order mean the held round takes agrees to float32 precision
    held = weighted_mean(clients, weights, device=CPU)
    np.testing.assert_allclose(out["w"], held["w"], rtol=1e-6, atol=1e-7)


def test_running_mean_names_what_does_not_fit() -> None:
    running = RunningMean(CPU)
    running.add({"w": np.ones(3, np.float32)}, 2.0)
    with pytest.raises(ValueError, match=r"\['v', 'w'\] differ from the first client's"):
        running.add({"v": np.ones(3, np.float32)}, 1.0)
    with pytest.raises(ValueError, match=r"'w' has shape \(4,\), the first client's \(3,\)"):
        running.add({"w": np.ones(4, np.float32)}, 1.0)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="finite and >= 0"):
            running.add({"w": np.ones(3, np.float32)}, bad)
    assert running.count == 1                     # nothing half-added
    np.testing.assert_array_equal(running.result()["w"], np.ones(3, np.float32))
    two = RunningMean(CPU)
    two.add({"a": np.ones(2, np.float32), "w": np.ones(3, np.float32)}, 1.0)
    with pytest.raises(ValueError, match="'w' has shape"):   # "a" fits, "w" does not: "a" is not added either
        two.add({"a": np.full(2, 5.0, np.float32), "w": np.ones(4, np.float32)}, 1.0)
    np.testing.assert_array_equal(two.result()["a"], np.ones(2, np.float32))
    with pytest.raises(ValueError, match="positive total weight"):
        RunningMean(CPU).result()


class TrickleGrid(FakeGrid):
    """A grid that answers like :class:`FakeGrid` but hands out one reply per pull (as a
    simulation's replies arrive while other clients still train), and records, at every pull,
    how many of the replies it handed out earlier still hold arrays."""

    def __init__(self, client_ids: list[str], handler: Callable[[str, Message], Message | None]) -> None:
        super().__init__(client_ids, handler)
        self.queue: list[Message] = []
        self.handed: list[Message] = []
        self.pulls = 0
        self.held_with_arrays: list[int] = []

    def push_messages(self, messages: list[Message]) -> list[str]:
        messages = list(messages)
        self.queue = list(self.send_and_receive(messages))
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: set[str]) -> list[Message]:
        self.pulls += 1
        self.held_with_arrays.append(sum(1 for m in self.handed if m.has_content() and m.content.array_records))
        if not self.queue:
            return []
        reply = self.queue.pop(0)
        assert reply.metadata.reply_to_message_id in message_ids
        self.handed.append(reply)
        return [reply]


SIZES = {"0": 10, "1": 30, "2": 60, "3": 20, "4": 5}
VALUES = {"0": 1.0, "1": 2.0, "2": 4.0, "3": float("nan")}


def _client(cid: str, msg: Message) -> Message:
    """Client 3 uploads NaN (rejected), client 4 fails; the others upload w = b = value."""
    if cid == "4":
        return Message(Error(code=0, reason="RuntimeError: injected fault"), reply_to=msg)
    v = VALUES[cid]
    arrays = {"w": np.full((4, 3), v, np.float32), "b": np.full(3, -v, np.float32), "n": np.array(3, np.int64)}
    return make_reply(msg, arrays, {"loss": v}, cid, SIZES[cid])


def _round(stream_replies_mb: float | None) -> tuple[PersonalizedStrategy, TrickleGrid, list[Message], object]:
    ids = list(SIZES)
    grid = TrickleGrid(ids, _client)
    st = make_strategy(FedAvg, dict(REF), ids, stream_replies_mb=stream_replies_mb)
    train = st.begin_train(1, {}, grid)
    messages = train.messages
    replies = send_and_receive(grid, messages, timeout=30.0, on_reply=train.replies.take)
    return st, grid, replies, st.aggregate_round(train)


@pytest.mark.usefixtures("flower_task")
def test_a_streamed_round_folds_each_reply_as_it_arrives_and_holds_none() -> None:
    st, grid, replies, result = _round(stream_replies_mb=0.0)
    # one reply per pull, and at every pull no reply handed out before still held its arrays
    assert grid.pulls >= len(SIZES) and len(replies) == len(SIZES)
    assert grid.held_with_arrays and max(grid.held_with_arrays) == 0
    assert all(not m.has_content() or not m.content.array_records for m in replies)
    # the mean over the valid replies only, weighted by size
    valid = ["0", "1", "2"]
    expected = _slow_mean([{"w": np.full((4, 3), VALUES[c]), "b": np.full(3, -VALUES[c])} for c in valid],
                          [SIZES[c] for c in valid])
    np.testing.assert_allclose(st.global_arrays["w"], expected["w"], rtol=1e-7)
    np.testing.assert_allclose(st.global_arrays["b"], expected["b"], rtol=1e-7)
    assert st.global_arrays["w"].dtype == np.float32 and st.global_arrays["n"].dtype == np.int64
    log = result.log
    assert log.replied == valid and "NaN" in log.rejected["3"] and "injected fault" in log.failed["4"]
    assert log.bytes_up == {c: num_bytes({k: v for k, v in REF.items()}) for c in valid}
    assert result.metrics["clients"] == 3.0
    # nothing of the round is kept on the strategy: the round lived in its TrainRound
    assert not [k for k, v in vars(st).items() if isinstance(v, (RunningMean, TrainRound, TrainReplies))]
    # the same round held (never streamed): the replies keep their arrays, same mean
    held, _, held_replies, held_result = _round(stream_replies_mb=None)
    assert sum(1 for m in held_replies if m.has_content() and m.content.array_records) == 4   # 3 valid + the rejected NaN one
    for key in REF:
        np.testing.assert_allclose(st.global_arrays[key], held.global_arrays[key], rtol=1e-6)
    assert held_result.log.replied == log.replied and held_result.metrics == result.metrics


@pytest.mark.usefixtures("flower_task")
def test_a_round_streams_past_its_limit_and_only_where_the_rule_is_a_mean() -> None:
    ids = list(SIZES)
    st = make_strategy(FedAvg, dict(REF), ids, stream_replies_mb=None)
    sent = st.begin_train(1, {}, FakeGrid(ids, _client)).sent
    expected_mb = len(ids) * num_bytes(REF) / 1e6
    for limit, streams in ((None, False), (0.0, True), (expected_mb / 2, True), (expected_mb * 2, False)):
        st.run = dataclasses.replace(st.run, stream_replies_mb=limit)
        assert st.streams_round(1, sent) is streams, limit
    for cls in (FedAvg, PartialFedFix, PartialFedAdaptive, FedBasis):   # FedAvg: six methods' server
        assert cls.mean_rule, cls.__name__
    for cls in (FDSE, FEDORA, FedBABU, Local):      # their rules need every update at once (or none)
        assert not cls.mean_rule, cls.__name__


@pytest.mark.usefixtures("flower_task")
def test_an_update_the_running_mean_refuses_is_rejected_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the fold refuse a validated update (the running mean's own checks), the round goes
    on: that client is logged as rejected, the mean is over the others, unchanged by it."""
    add = RunningMean.add

    def refuse_client_1(self: RunningMean, arrays: dict, weight: float) -> None:
        if float(np.asarray(arrays["w"]).flat[0]) == VALUES["1"]:
            raise ValueError("refused by the running mean")
        add(self, arrays, weight)

    monkeypatch.setattr(RunningMean, "add", refuse_client_1)
    st, _, _, result = _round(stream_replies_mb=0.0)
    log = result.log
    assert log.replied == ["0", "2"] and log.rejected["1"] == "refused by the running mean"
    assert "1" not in log.bytes_up and result.metrics["clients"] == 2.0
    expected = _slow_mean([{"w": np.full((4, 3), VALUES[c])} for c in ("0", "2")], [SIZES["0"], SIZES["2"]])
    np.testing.assert_allclose(st.global_arrays["w"], expected["w"], rtol=1e-7)
