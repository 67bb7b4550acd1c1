"""Where a client message's time goes: the parts a ClientApp records (common/timing.py) and the
per-message summary the benchmark prints from them (bench/message_parts.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench.message_parts import markdown, read_lines, read_summary, server_parts, summarise
from common import timing


def test_parts_are_recorded_only_while_a_message_is_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with timing.part("train"):   # no message timed: nothing kept, nothing fails
        pass
    assert timing._parts is None

    monkeypatch.setenv("PFLOWER_TIMING", str(tmp_path))

    def work() -> str:
        with timing.part("train"):
            time.sleep(0.02)
        with timing.part("state save"):
            time.sleep(0.01)
        with timing.part("train"):   # a part met twice adds up
            time.sleep(0.02)
        timing.note(server_round=3)
        return "reply"

    reply, line = timing.timed_message(work, "train")
    assert reply == "reply" and timing._parts is None
    assert set(line["parts"]) == {"train", "state save"}
    assert line["parts"]["train"] >= 0.04 and line["parts"]["state save"] >= 0.01
    assert line["handler_s"] >= sum(line["parts"].values())
    assert line["server_round"] == 3 and line["end"] == pytest.approx(line["start"] + line["handler_s"])
    written = [json.loads(s) for s in (tmp_path / f"client-{os.getpid()}.jsonl").read_text().splitlines()]
    assert written == [line]


def test_a_failing_message_is_still_closed_and_an_unwritable_folder_only_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PFLOWER_TIMING", str(blocker / "timing"))

    def fails() -> None:
        with timing.part("train"):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        timing.timed_message(fails, "train")
    assert timing._parts is None   # the next message starts clean
    monkeypatch.setenv("PFLOWER_TIMING", str(tmp_path / "timing"))
    with pytest.raises(RuntimeError, match="boom"):
        timing.timed_message(fails, "train")
    (failed,) = read_lines(tmp_path / "timing")
    assert failed["error"] == "RuntimeError" and set(failed["parts"]) == {"train"}
    with pytest.raises(ValueError, match="run more rounds"):   # never summarised as a message
        summarise([{**failed, "server_round": r} for r in (2, 3)])
    monkeypatch.setenv("PFLOWER_TIMING", str(blocker / "timing"))
    _, line = timing.timed_message(lambda: None, "train")
    assert line["parts"] == {} and "cannot write to" in caplog.text
    monkeypatch.setenv("PFLOWER_TIMING", "1")   # 1: log only, no folder
    assert timing.timing_enabled() and timing.timing_folder() is None
    monkeypatch.setenv("PFLOWER_TIMING", "0")   # 0: off
    assert not timing.timing_enabled() and timing.timing_folder() is None


def _line(pid: int, rnd: int, start: float, handler: float, parts: dict[str, float]) -> dict:
    return {"type": "train", "pid": pid, "server_round": rnd, "start": start, "end": start + handler,
            "handler_s": handler, "parts": parts}


def test_summary_per_message_against_a_hand_computation(tmp_path: Path) -> None:
    # two workers; round 2: messages of 0.3 s and 0.2 s (+ 0.1 s on worker 1), next round at 1.0
    lines = [
        _line(1, 1, 0.0, 0.1, {"train": 0.1}),   # round 1: left out (start-up)
        _line(1, 2, 0.5, 0.3, {"train": 0.2, "state save": 0.05}),
        _line(2, 2, 0.6, 0.2, {"train": 0.15}),
        _line(1, 2, 0.8, 0.1, {"train": 0.1}),
        _line(2, 3, 1.0, 0.2, {"train": 0.2}),   # round 3: the end of round 2, not summarised itself
        {"type": "query", "pid": 1, "start": 0.0, "end": 0.0, "handler_s": 0.0, "parts": {}},
    ]
    s = summarise(lines)
    assert (s.rounds, s.messages, s.workers) == (1, 3, 2.0)
    assert s.parts_ms["train"] == pytest.approx(1e3 * (0.2 + 0.15 + 0.1) / 3)
    assert s.parts_ms["state save"] == pytest.approx(1e3 * 0.05 / 3)
    assert s.handler_ms == pytest.approx(1e3 * 0.6 / 3)
    # 2 workers x 0.5 s of round = 1.0 worker-seconds, 0.6 of them in handlers
    assert s.outside_ms == pytest.approx(1e3 * 0.4 / 3)
    assert s.between_rounds_ms == pytest.approx(1e3 * (1.0 - 0.9))
    assert s.round_s == pytest.approx(0.5)
    assert list(s.parts_ms) == ["train", "state save"]   # a training message's order
    table = markdown({"two workers": s})
    assert "| state save (not in the plain loop) | 16.7 |" in table
    assert "| **outside the handler**" in table and "| rounds / messages summarised | 1 / 3 |" in table

    folder = tmp_path / "timing"
    folder.mkdir()
    (folder / "client-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_lines(folder) == lines
    with pytest.raises(FileNotFoundError, match="PFLOWER_TIMING"):
        read_lines(tmp_path)
    with pytest.raises(ValueError, match="run more rounds"):
        summarise(lines[:2])

    server = [{"type": "round", "server_round": r, "handler_s": 0.5 * r, "parts": {"aggregate": 0.01 * r}}
              for r in (1, 2, 3, 4)]
    assert server_parts(server) == pytest.approx({"aggregate": 25.0, "round": 1250.0})   # rounds 2 and 3
    (folder / "server-9.jsonl").write_text("".join(json.dumps(x) + "\n" for x in server))
    both = read_summary(folder)
    assert both.server_ms == pytest.approx({"aggregate": 25.0, "round": 1250.0})
    assert "| server, ms a round | timing |" in markdown({"timing": both})
    assert "| **round** | 1250.0 |" in markdown({"timing": both})


@pytest.mark.usefixtures("flower_task")
def test_the_real_clientapp_times_every_part_of_a_training_message(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two FedAvg rounds through the real server loop and ClientApp (a fake grid joins them,
    as in the method contract), each message through ``timing_mod``: round 2's training
    messages (which carry round 1's evaluation) name every part, and the parts fit in the
    handler."""
    from flwr.app import Context, Message, MessageType, RecordDict
    from helpers import FakeGrid

    from bench.message_parts import PART_ORDER
    from client import app as client_app
    from common.config import compose_run
    from learning.datasets.federated import load_federated_data
    from server.app import build_strategy
    from server.loop import run_federation
    from server.results import RunRecorder

    folder = tmp_path / "timing"
    monkeypatch.setenv("PFLOWER_TIMING", str(folder))
    run_config = {"strategy": "fedavg", "rounds": "2", "results-root": str(tmp_path), "run-name": "timed",
                  "overrides": "dataset.clients_per_domain=1 fraction_train=1.0"}
    run = compose_run(run_config)
    cfg = run.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    contexts = {cid: Context(run_id=1, node_id=int(cid) + 1,
                             node_config={"partition-id": int(cid), "num-partitions": len(data.client_ids)},
                             state=RecordDict(), run_config=run_config) for cid in data.client_ids}

    def handler(cid: str, msg: Message) -> Message:
        call = client_app.train if msg.metadata.message_type == MessageType.TRAIN else client_app.evaluate
        return client_app.timing_mod(msg, contexts[cid], call)

    run_federation(build_strategy(cfg, data), FakeGrid(data.client_ids, handler), run.settings,
                   RunRecorder(cfg, run.settings, resume=False))
    lines = read_lines(folder)
    second = [x for x in lines if x["type"] == "train" and x["server_round"] == 2]
    assert sorted(x["client_id"] for x in second) == sorted(data.client_ids)
    for x in second:
        assert list(x["parts"]) == [p for p in PART_ORDER if p in x["parts"]]
        assert set(x["parts"]) == set(PART_ORDER)
        assert 0 < sum(x["parts"].values()) <= x["handler_s"]
    assert {x["type"] for x in lines} == {"train", "evaluate"}   # the final round's evaluation
    # the server's rounds, timed around the clients' messages (here in the same process)
    rounds = read_lines(folder, "server")
    assert [x["server_round"] for x in rounds] == [1, 2]
    assert set(rounds[0]["parts"]) == {"configure", "replies", "aggregate", "record", "checkpoint"}
    assert set(rounds[1]["parts"]) == {"configure", "replies", "aggregate", "evaluate", "record", "checkpoint"}
    for x in rounds:
        assert sum(x["parts"].values()) <= x["handler_s"]
        # the clients' handlers ran inside the wait for replies
        handlers = sum(m["handler_s"] for m in lines if m["type"] == "train" and m["server_round"] == x["server_round"])
        assert handlers <= x["parts"]["replies"]
