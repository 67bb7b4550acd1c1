"""Aggregation math of the baselines against slow, obvious computations."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_strategy

from learning.params import weighted_mean
from strategies.base import ClientUpdate, TrainRound
from strategies.baselines import FedAvg, Local


def _slow_weighted_mean(arrays_list, weights, key):
    total = 0.0
    acc = np.zeros_like(np.asarray(arrays_list[0][key], dtype=np.float64))
    for arrays, w in zip(arrays_list, weights, strict=True):
        for idx in np.ndindex(acc.shape):
            acc[idx] += w * float(arrays[key][idx])
        total += w
    return acc / total


def _random_clients(k=4, seed=0):
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32),
             "bn.num_batches_tracked": np.array(rng.integers(0, 100), dtype=np.int64)} for _ in range(k)]


def test_weighted_mean_matches_slow_loop():
    clients = _random_clients()
    weights = [10, 1, 5, 84]
    out = weighted_mean(clients, weights)
    for key in ("w", "b"):
        np.testing.assert_allclose(out[key], _slow_weighted_mean(clients, weights, key), rtol=1e-6, atol=1e-7)
        assert out[key].dtype == np.float32
    assert out["bn.num_batches_tracked"].dtype == np.int64
    assert int(out["bn.num_batches_tracked"]) == int(round(_slow_weighted_mean(clients, weights, "bn.num_batches_tracked")))


def test_weighted_mean_rejects_bad_weights():
    with pytest.raises(ValueError, match="non-negative"):
        weighted_mean(_random_clients(2), [0, 0])
    with pytest.raises(ValueError, match="at least one"):
        weighted_mean([], [])


def _strategy(cls, clients, weighted=True):
    initial = {k: np.zeros_like(v) for k, v in clients[0].items()}
    return make_strategy(cls, initial, [str(i) for i in range(len(clients))],
                         options={"name": "local" if cls is Local else "fedavg", "weighted": weighted})


@pytest.mark.parametrize("weighted", [True, False])
def test_fedavg_strategy_aggregates_like_the_slow_mean(weighted):
    clients = _random_clients(5, seed=1)
    sizes = [3, 30, 7, 1, 12]
    strat = _strategy(FedAvg, clients, weighted)
    updates = [ClientUpdate(str(i), i, c, n, {}) for i, (c, n) in enumerate(zip(clients, sizes, strict=True))]
    strat.aggregate_updates(TrainRound.handed(1), updates)
    weights = sizes if weighted else [1] * 5
    for key in ("w", "b"):
        # float32 inputs are averaged in float32 (one in-place pass): a few float32 ulps
        np.testing.assert_allclose(strat.global_arrays[key], _slow_weighted_mean(clients, weights, key),
                                   rtol=1e-6, atol=1e-7)


def test_fedavg_only_touches_uploaded_keys():
    """FedBN-style partial uploads: keys nobody uploaded keep their global value."""
    clients = _random_clients(3)
    strat = _strategy(FedAvg, clients)
    strat.global_arrays["b"] = np.full(5, 7.0, dtype=np.float32)
    partial = [{"w": c["w"]} for c in clients]
    strat.aggregate_updates(TrainRound.handed(1), [ClientUpdate(str(i), i, p, 1, {}) for i, p in enumerate(partial)])
    np.testing.assert_array_equal(strat.global_arrays["b"], np.full(5, 7.0, dtype=np.float32))
    np.testing.assert_allclose(strat.global_arrays["w"], np.mean([c["w"] for c in clients], axis=0), rtol=1e-6)


def test_local_strategy_never_changes_the_global_model():
    clients = _random_clients(3)
    strat = _strategy(Local, clients)
    before = {k: v.copy() for k, v in strat.global_arrays.items()}
    strat.aggregate_updates(TrainRound.handed(1), [ClientUpdate(str(i), i, c, 5, {}) for i, c in enumerate(clients)])
    for k in before:
        np.testing.assert_array_equal(strat.global_arrays[k], before[k])


def test_payload_overlays_personal_arrays():
    clients = _random_clients(2)
    strat = _strategy(FedAvg, clients)
    strat.personal["1"] = {"b": np.ones(5, dtype=np.float32)}
    assert np.all(strat.payload_for("1")["b"] == 1) and np.all(strat.payload_for("0")["b"] == 0)
    assert np.all(strat.payload_for(None)["b"] == 0)


# ---------------------------------------------------------------- Flower's interface
def _client(cid: str, msg):
    """Train: upload w = b = client id; evaluate: accuracy = client id / 10."""
    from flwr.app import MessageType

    from common.protocol import make_reply

    v = float(cid)
    if msg.metadata.message_type == MessageType.EVALUATE:
        return make_reply(msg, {}, {"accuracy": v / 10, "loss": 1.0 - v / 10}, cid, 5)
    return make_reply(msg, {"w": np.full((3, 5), v, np.float32), "b": np.full(5, -v, np.float32)}, {"loss": v}, cid,
                      1 + int(cid))


@pytest.mark.usefixtures("flower_task")
def test_flowers_configure_and_aggregate_calls_equal_the_explicit_round() -> None:
    """``configure_train``/``aggregate_train`` and ``configure_evaluate``/``aggregate_evaluate``
    (what Flower's ``Strategy.start`` calls) give what ``begin_train``/``aggregate_round`` and
    ``begin_evaluate``/``evaluation_of`` give, and a Flower ``aggregate_*`` with no round begun
    is refused, naming it."""
    from flwr.app import ArrayRecord, ConfigRecord
    from helpers import FakeGrid, received

    from common.protocol import from_record

    ids = ["0", "1", "2", "3"]
    ref = {"w": np.zeros((3, 5), np.float32), "b": np.zeros(5, np.float32)}
    flowers, ours = make_strategy(FedAvg, dict(ref), ids), make_strategy(FedAvg, dict(ref), ids)
    flower_grid, our_grid = FakeGrid(ids, _client), FakeGrid(ids, _client)

    messages = list(flowers.configure_train(1, ArrayRecord(), ConfigRecord({}), flower_grid))
    arrays, metrics = flowers.aggregate_train(1, flower_grid.send_and_receive(messages, timeout=5))
    result = ours.aggregate_round(received(ours.begin_train(1, {}, our_grid), our_grid))
    expected = [{"w": np.full((3, 5), float(c)), "b": np.full(5, -float(c))} for c in ids]
    weights = [1 + int(c) for c in ids]
    for key in ("w", "b"):
        np.testing.assert_allclose(from_record(arrays)[key], _slow_weighted_mean(expected, weights, key), rtol=1e-6)
        np.testing.assert_array_equal(from_record(arrays)[key], ours.global_arrays[key])
    assert dict(metrics.items()) == result.metrics

    messages = list(flowers.configure_evaluate(1, ArrayRecord(), ConfigRecord({}), flower_grid))
    summary = flowers.aggregate_evaluate(1, flower_grid.send_and_receive(messages, timeout=5))
    evaluate = ours.begin_evaluate(1, {}, our_grid)
    evaluation = ours.evaluation_of(evaluate, our_grid.send_and_receive(evaluate.messages, timeout=5))
    assert len(messages) == 4 and evaluate.asked == ids
    assert dict(summary.items()) == evaluation.summary()
    assert summary["accuracy_mean"] == pytest.approx(np.mean([0.0, 0.1, 0.2, 0.3]))

    with pytest.raises(RuntimeError, match="aggregate_train of round 2 without its configure_train"):
        flowers.aggregate_train(2, [])
    with pytest.raises(RuntimeError, match="aggregate_evaluate of round 1 without its configure_evaluate"):
        flowers.aggregate_evaluate(1, [])
