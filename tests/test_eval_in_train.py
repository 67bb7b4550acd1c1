"""A round's evaluation carried by the next round's training messages (``eval_in_train``):
clients that did not train that round still get an evaluate message, and a run resumed from
a checkpoint taken while an evaluation was still to come ends where an uninterrupted run
ends. (That the numbers equal separate evaluate messages for every method is checked in
tests/test_method_contract.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flwr.app import MessageType
from helpers import FakeGrid
from test_method_contract import Clients, _federate, _records, _run_config

from common.config import compose_run
from learning.datasets.federated import load_federated_data
from server.app import build_strategy
from server.loop import run_federation
from server.results import RunRecorder


@pytest.mark.usefixtures("flower_task")
def test_clients_not_sampled_get_an_evaluate_message_and_the_numbers_are_the_same(tmp_path: Path) -> None:
    half = ["fraction_train=0.5", "dataset.clients_per_domain=2"]
    _, sep, _ = _federate(_run_config("fedavg", [*half, "eval_in_train=false"], tmp_path, "sep", rounds=3), 1)
    _, fused, _ = _federate(_run_config("fedavg", half, tmp_path, "fused", rounds=3), 2)
    f_rounds, s_rounds = _records(tmp_path / "fused"), _records(tmp_path / "sep")
    n = len(f_rounds[0]["clients"])
    assert n == 8 and all(len(r["sampled"]) == 4 for r in f_rounds)
    for f, s in zip(f_rounds, s_rounds, strict=True):
        assert f["clients"] == s["clients"] and f["sampled"] == s["sampled"]
    # separate: 8 per round; fused: rounds 1-2 only the 4 clients not sampled next round, round 3 all 8
    assert (sep.evaluate_messages, fused.evaluate_messages) == (3 * n, 4 + 4 + n)


class StopAtRound:
    """A grid that stops the server (as a crash would) when round ``at``'s training is sent."""

    def __init__(self, grid: FakeGrid, at: int) -> None:
        self.grid, self.at = grid, at

    def get_node_ids(self) -> list[int]:
        return self.grid.get_node_ids()

    def send_and_receive(self, messages: list[Any], timeout: float | None = None) -> list[Any]:
        if any(m.metadata.message_type == MessageType.TRAIN and
               int(m.content.config_records["config"]["server-round"]) == self.at for m in messages):
            raise KeyboardInterrupt("server stopped")
        return self.grid.send_and_receive(messages, timeout)


@pytest.mark.usefixtures("flower_task")
def test_a_run_resumed_before_an_evaluation_arrived_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    run_config = _run_config("fedbn", [], tmp_path, "stopped", rounds=3)
    run = compose_run(run_config)
    cfg = run.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    clients = Clients(run_config, data.client_ids, 1)
    recorder = RunRecorder(cfg, run.settings)
    with pytest.raises(KeyboardInterrupt):
        run_federation(build_strategy(cfg, data), StopAtRound(FakeGrid(data.client_ids, clients), 2), run.settings, recorder)
    recorder.close()
    assert "evaluate" not in _records(tmp_path / "stopped")[0]  # round 1's evaluation was still to come

    _federate(_run_config("fedbn", [], tmp_path, "stopped", 3, resume=tmp_path / "stopped"), 2)
    _federate(_run_config("fedbn", [], tmp_path, "straight", rounds=3), 3)
    resumed, straight = _records(tmp_path / "stopped"), _records(tmp_path / "straight")
    assert [r["round"] for r in resumed] == [1, 2, 3]
    for a, b in zip(resumed, straight, strict=True):
        assert a["clients"] == b["clients"], a["round"]
        assert a["train"] == b["train"]
