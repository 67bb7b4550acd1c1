"""Runs you can watch: TensorBoard event files per run (read back with TensorBoard's own
reader) and the progress bar of ``pflower run``/``sweep``/``deploy``."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from helpers import FakeGrid
from test_method_contract import Clients, _federate, _records, _run_config

from common.config import compose_config
from learning.data import load_federated_data
from ops.progress import PhaseProgress, RunProgress, progress_wanted, rounds_seen
from server.app import build_strategy, client_info
from server.loop import run_federation
from server.results import RunRecorder
from server.tensorboard import TB_DIR, flatten_scalars, round_scalars

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _events(run_dir: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(str(run_dir / TB_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def _scalar(acc: event_accumulator.EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_round_scalars_name_every_number_of_a_round_record() -> None:
    record = {"round": 3, "train": {"train_loss": 0.5, "p_global/conv1": 0.25, "clients": 2.0},
              "communication": {"bytes_up": {"0": 100, "1": 50}, "bytes_down": {"0": 10, "1": 10}},
              "sampled": ["0", "1"], "failed": {}, "rejected": {"1": "NaN"},
              "evaluate": {"accuracy_mean": 0.75, "accuracy_min": 0.5, "accuracy_std": 0.25,
                           "global_accuracy_mean": 0.6, "global_accuracy_min": 0.4, "global_accuracy_std": 0.2},
              "clients": {"0": {"accuracy": 1.0}, "1": {"accuracy": 0.5}}, "eval_failed": {"2": "gone"},
              "fedbasis": {"phase": "bases", "entropy": 1.25, "coefficients": {"0": {"conv1": [0.5, 0.5]}}},
              "elapsed_s": 12.0}
    assert round_scalars(record, round_s=4.0) == {
        "train/loss": 0.5, "train/p_global/conv1": 0.25, "train/clients": 2.0,
        "communication/bytes_up": 150.0, "communication/bytes_down": 20.0,
        "clients/sampled": 2.0, "clients/failed": 1.0, "time/round_s": 4.0,
        "method/fedbasis/entropy": 1.25, "method/fedbasis/coefficients/0/conv1/0": 0.5,
        "method/fedbasis/coefficients/0/conv1/1": 0.5,
        "accuracy/mean": 0.75, "accuracy/worst": 0.5, "accuracy/std": 0.25,
        "accuracy/global/mean": 0.6, "accuracy/global/worst": 0.4, "accuracy/global/std": 0.2,
        "clients/accuracy/0": 1.0, "clients/accuracy/1": 0.5, "clients/eval_failed": 1.0}
    assert flatten_scalars({"a": [1, float("nan"), True, "x"]}, "m") == {"m/a/0": 1.0}


@pytest.mark.usefixtures("flower_task")
def test_a_run_writes_event_files_holding_its_metrics(tmp_path: Path) -> None:
    """PartialFed-Adaptive: its gate probabilities are method diagnostics among the tags."""
    run_config = _run_config("partialfed-adaptive", [], tmp_path, "tb", rounds=3)
    cfg = compose_config(run_config)
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    strategy = build_strategy(cfg, data)
    recorder = RunRecorder(cfg)
    run_federation(strategy, FakeGrid(data.client_ids, Clients(run_config, data.client_ids, 1)), cfg, recorder)
    recorder.finish(client_info(data), strategy.summary_extras())
    recorder.close()
    rounds = _records(tmp_path / "tb")
    acc = _events(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    gates = sorted(t for t in tags if t.startswith("train/p_global/"))
    assert gates and {"accuracy/mean", "accuracy/worst", "train/loss", "communication/bytes_up",
                      "communication/bytes_down", "time/round_s", "final/accuracy_mean"} <= tags
    for r in rounds:   # every value as metrics.jsonl holds it (float32 in the event file)
        ev, step = r["evaluate"], r["round"]
        assert _scalar(acc, "accuracy/mean")[step] == pytest.approx(ev["accuracy_mean"], abs=1e-6)
        assert _scalar(acc, "accuracy/worst")[step] == pytest.approx(ev["accuracy_min"], abs=1e-6)
        assert _scalar(acc, "train/loss")[step] == pytest.approx(r["train"]["train_loss"], rel=1e-6)
        assert _scalar(acc, gates[0])[step] == pytest.approx(r["train"][gates[0][len("train/"):]], rel=1e-6)
        assert _scalar(acc, "communication/bytes_up")[step] == sum(r["communication"]["bytes_up"].values())
        for cid, m in r["clients"].items():
            assert _scalar(acc, f"clients/accuracy/{cid}")[step] == pytest.approx(m["accuracy"], abs=1e-6)
    assert sorted(_scalar(acc, "time/round_s")) == [1, 2, 3]
    summary = json.loads((tmp_path / "tb" / "summary.json").read_text())
    assert _scalar(acc, "final/accuracy_mean")[3] == pytest.approx(summary["accuracy_mean"], abs=1e-6)
    hparams = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams
    assert b"partialfed-adaptive" in hparams["_hparams_/session_start_info"]
    assert "config/text_summary" in acc.Tags()["tensors"]


@pytest.mark.usefixtures("flower_task")
def test_tensorboard_false_writes_no_events(tmp_path: Path) -> None:
    _federate(_run_config("fedavg", ["tensorboard=false"], tmp_path, "off", rounds=1), run_id=1)
    assert (tmp_path / "off" / "metrics.jsonl").exists() and not (tmp_path / "off" / TB_DIR).exists()


def test_rounds_seen_reads_the_last_evaluated_round(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert rounds_seen(metrics).done == 0
    lines = [{"round": 1, "evaluate": {"accuracy_mean": 0.5, "accuracy_min": 0.25}},
             {"round": 2}]   # round 2's evaluation comes with round 3's training
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"round": 3, "tra')
    seen = rounds_seen(metrics)
    assert (seen.done, seen.mean, seen.worst) == (2, 0.5, 0.25)


def test_the_bar_shows_rounds_and_accuracy_and_prints_the_log_above(tmp_path: Path) -> None:
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"round": 4, "evaluate": {"accuracy_mean": 0.8125, "accuracy_min": 0.5}}) + "\n")
    with RunProgress(tmp_path, 10, "fedavg demo", console=console) as bar:
        bar.print("\x1b[92mINFO \x1b[0m: [round 4/10] a log line\n")
        bar.update()
        task = bar.progress.tasks[0]
        assert (task.completed, task.total) == (4, 10)
    text = out.getvalue()
    assert "INFO : [round 4/10] a log line" in text
    assert "4/10" in text and "accuracy mean 0.8125 worst 0.5000" in text and "fedavg demo" in text


def test_the_bar_is_on_for_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    class Stream(io.StringIO):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.delenv("PFLOWER_PROGRESS", raising=False)
    assert progress_wanted(Stream(True)) and not progress_wanted(Stream(False))
    monkeypatch.setenv("PFLOWER_PROGRESS", "0")
    assert not progress_wanted(Stream(True))


@pytest.mark.e2e
def test_pflower_run_in_a_terminal_draws_the_bar_below_the_log(tmp_path: Path) -> None:
    """The real path: ``pflower run`` on a pseudo-terminal pipes flwr's stream through the
    bar; the log lines and the bar's final state are on the terminal."""
    import pty
    import subprocess

    from helpers import REPO

    leader, follower = pty.openpty()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    env.pop("PFLOWER_PROGRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "run", "rounds=2", f"results_root={tmp_path}",
                             "run_name=tty"], cwd=REPO, env=env, stdout=follower, stderr=follower,
                            stdin=subprocess.DEVNULL)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:   # the terminal closed: every process that held it exited
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=600) == 0
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    assert "[round 2/2]" in text and "2/2" in text and "accuracy mean" in text
    summary = json.loads((tmp_path / "tty" / "summary.json").read_text())
    assert f"worst {summary['accuracy_min']:.4f}" in text


def test_a_phase_outside_the_rounds_reports_every_ten_seconds_with_the_time_left() -> None:
    """Off a terminal, a long phase (FedBasis' new-client fits) prints what it is doing, i of N
    and the time left at most every 10 s, and always its last step: never silent for minutes."""
    out, now = io.StringIO(), [0.0]
    progress = PhaseProgress("personalising new clients", 6, every_s=10.0, enabled=False, stream=out)
    progress._clock = lambda: now[0]
    progress._start = progress._last = 0.0
    for i in range(6):
        now[0] += 4.0                                   # 4 s a fit
        progress.step(f"fit {i + 1}")
    progress.close()
    assert out.getvalue().splitlines() == [
        "pflower: personalising new clients: 3/6 (fit 3), about 12 s left",   # 12 s: first line after >= 10 s
        "pflower: personalising new clients: 6/6 (fit 6)",                    # 24 s: 12 s later, and the end
    ]
