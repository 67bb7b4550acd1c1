"""Runs you can watch: TensorBoard event files per run (read back with TensorBoard's own
reader) and the progress bar of ``pflower run``/``sweep``/``deploy``."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers import FakeGrid
from test_method_contract import Clients, _federate, _records, _run_config

from common.config import compose_run
from learning.datasets.federated import load_federated_data
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
              "privacy": {"epsilon": 4.5, "delta": 1e-5, "clipped": 2},
              "record_dp": {"epsilon_max": 3.0, "epsilon": {"0": 3.0, "1": 2.0}},
              "secure_aggregation": {"clients": 2, "mean_bound": 1e-6},
              "elapsed_s": 12.0}
    assert round_scalars(record, round_s=4.0) == {
        "train/loss": 0.5, "train/p_global/conv1": 0.25, "train/clients": 2.0,
        "communication/bytes_up": 150.0, "communication/bytes_down": 20.0,
        "clients/sampled": 2.0, "clients/failed": 1.0, "time/round_s": 4.0,
        "method/fedbasis/entropy": 1.25, "method/fedbasis/coefficients/0/conv1/0": 0.5,
        "method/fedbasis/coefficients/0/conv1/1": 0.5,
        "accuracy/mean": 0.75, "accuracy/worst": 0.5, "accuracy/std": 0.25,
        "accuracy/global/mean": 0.6, "accuracy/global/worst": 0.4, "accuracy/global/std": 0.2,
        "clients/accuracy/0": 1.0, "clients/accuracy/1": 0.5, "clients/eval_failed": 1.0,
        "privacy/epsilon": 4.5, "privacy/delta": 1e-5, "privacy/clipped": 2.0,
        "privacy/record/epsilon_max": 3.0, "privacy/record/epsilon/0": 3.0, "privacy/record/epsilon/1": 2.0,
        "secure_aggregation/clients": 2.0, "secure_aggregation/mean_bound": 1e-6}
    assert flatten_scalars({"a": [1, float("nan"), True, "x"]}, "m") == {"m/a/0": 1.0}


@pytest.mark.usefixtures("flower_task")
def test_a_run_writes_event_files_holding_its_metrics(tmp_path: Path) -> None:
    """PartialFed-Adaptive: its gate probabilities are method diagnostics among the tags."""
    run_config = _run_config("partialfed-adaptive", [], tmp_path, "tb", rounds=3)
    run = compose_run(run_config)
    cfg = run.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    strategy = build_strategy(cfg, data)
    recorder = RunRecorder(cfg, run.settings)
    run_federation(strategy, FakeGrid(data.client_ids, Clients(run_config, data.client_ids, 1)), run.settings, recorder)
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


# ---------------------------------------------------------------- what a run prints off a terminal
def test_the_round_line_names_the_round_its_accuracy_comes_from() -> None:
    """With ``eval_in_train`` round i's accuracy arrives with round i + 1's training: the line
    says so instead of printing placeholders."""
    from server.loop import round_line

    ev = {"accuracy_mean": 0.14172, "accuracy_min": 0.03704}
    assert round_line(1, 20, 16.34, 8, 8, None, 1) == (
        "[round 1/20] 16.3 s, 8/8 clients trained; accuracy: round 1's comes with round 2's training")
    assert round_line(2, 20, 0.61, 7, 8, (1, ev), 2) == (
        "[round 2/20] 0.6 s, 7/8 clients trained; accuracy of round 1: mean 0.1417, worst client 0.0370")
    assert round_line(20, 20, 1.0, 8, 8, (20, ev), None).endswith("; accuracy: mean 0.1417, worst client 0.0370")
    assert round_line(3, 20, 1.0, 8, 8, None, None).endswith("accuracy: not measured yet")


STREAM = ["Using SuperLink: pflower (127.0.0.1:1)\n",
          "\x1b[92mINFO \x1b[0m:      Starting Flower Simulation\n",
          "\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n",
          "\x1b[92mINFO \x1b[0m:      To change federation size, use the following command:\n",
          "\x1b[92mINFO \x1b[0m:      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>\n",
          "\x1b[92mINFO \x1b[0m:      configure_train: round 1, sampled 8 of 8 clients\n",
          "\x1b[92mINFO \x1b[0m:      [round 1/2] 9.0 s, 8/8 clients trained; accuracy: not measured yet\n",
          "\x1b[92mINFO \x1b[0m:      [round 1] evaluation (with round 2's training: 8, by evaluate message: 0)\n",
          "\x1b[93mWARNING \x1b[0m:   pflower: client 3 failed in round 2\n",
          "\x1b[92mINFO \x1b[0m:      [round 2/2] 1.0 s, 7/8 clients trained; accuracy: mean 0.5, worst client 0.1\n"]


def test_off_a_terminal_a_run_shows_its_round_lines_and_warnings_and_logs_everything(tmp_path: Path) -> None:
    from ops.progress import RunOutput

    screen = io.StringIO()
    with RunOutput(tmp_path / "run" / "run.log", None, stream=screen) as output:
        for line in STREAM:
            output(line)
    assert screen.getvalue().splitlines() == [
        "[round 1/2] 9.0 s, 8/8 clients trained; accuracy: not measured yet",
        "WARNING :   pflower: client 3 failed in round 2",
        "[round 2/2] 1.0 s, 7/8 clients trained; accuracy: mean 0.5, worst client 0.1"]
    logged = (tmp_path / "run" / "run.log").read_text().splitlines()
    assert len(logged) == len(STREAM) and "\x1b" not in "".join(logged)
    assert "WARNING :   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2." in logged
    with RunOutput(tmp_path / "run" / "run.log", None, stream=io.StringIO(), append=True) as output:
        output("INFO : a resumed attempt\n")
    assert (tmp_path / "run" / "run.log").read_text().splitlines()[-1] == "INFO : a resumed attempt"


def test_on_a_terminal_the_log_goes_above_the_bar_less_the_notices_that_do_not_apply(tmp_path: Path) -> None:
    from ops.progress import RunOutput

    class Bar:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def print(self, line: str) -> None:
            self.lines.append(line)

    bar = Bar()
    with RunOutput(tmp_path / "run.log", bar) as output:   # type: ignore[arg-type]
        for line in STREAM:
            output(line)
    assert bar.lines == [line for line in STREAM if "flwr 1.32" not in line and "federation" not in line]
    assert len(bar.lines) == len(STREAM) - 3


def test_rays_tip_is_filtered_by_a_warnings_filter_and_other_warnings_are_not(tmp_path: Path) -> None:
    """The environment of every Flower process pflower starts ignores Ray's FutureWarning tip
    (ray/_private/worker.py) and nothing else."""
    import subprocess

    from ops.deployment.launch import flower_env

    code = ("import warnings\n"
            "warnings.warn_explicit('Tip: In future versions of Ray, Ray will no longer override', "
            "FutureWarning, 'worker.py', 2051, module='ray._private.worker')\n"
            "warnings.warn_explicit('Tip: something else', FutureWarning, 'x.py', 1, module='other')\n"
            "warnings.warn_explicit('Another', FutureWarning, 'worker.py', 9, module='ray._private.worker')\n")
    env = flower_env(tmp_path / "home")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "override" not in out.stderr
    assert "Tip: something else" in out.stderr and "Another" in out.stderr


@pytest.mark.e2e
def test_pflower_run_off_a_terminal_prints_one_line_per_round_and_ctrl_c_says_how_to_resume(tmp_path: Path) -> None:
    """The README's first command (here 3 rounds) in a log file: one line per round, none of
    Flower's or Ray's notices that do not apply (they stay in the run folder's run.log), no
    lock or pid file left in the finished folder; typed again it says where the result is in
    a few seconds; a run interrupted with Ctrl-C prints its resume command."""
    import signal
    import subprocess

    from helpers import REPO, pflower_popen

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PFLOWER_PROGRESS", None)
    args = [sys.executable, "-m", "ops.cli", "run", "rounds=3", f"results_root={tmp_path}", "run_name=first"]
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout + out.stderr
    rounds = [line for line in text.splitlines() if line.startswith("[round ")]
    assert [line.split("]")[0] for line in rounds] == ["[round 1/3", "[round 2/3", "[round 3/3"], text
    for noise in ("Since flwr 1.32", "To change federation size", "FutureWarning", "configure_train"):
        assert noise not in text, text
    run = tmp_path / "first"
    logged = (run / "run.log").read_text()
    assert "Since flwr 1.32" in logged and "configure_train: round 3" in logged and "[round 3/3]" in logged
    assert not (run / ".lock").exists() and not (run / "pflower.pid").exists()
    t0 = time.monotonic()
    again = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and f"-> {run / 'summary.json'}; nothing started" in again.stdout, again.stdout
    assert time.monotonic() - t0 < 30

    log = tmp_path / "interrupted.txt"
    proc = pflower_popen(["run", "rounds=50", f"results_root={tmp_path}", "run_name=cut"], log)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None and not (tmp_path / "cut" / "checkpoint" / "server.npz").exists():
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"resume with: pflower run resume={tmp_path / 'cut'}" in log.read_text()
