"""Long runs finish: a resume needs only the run folder, a run whose processes die recovers by
itself to the same numbers, a paused simulation is not failed by Flower's heartbeat timeout,
and a deployment survives its SuperLink being killed and started again."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, pflower, pflower_popen

from common.config import ConfigError, compose_config, compose_run
from common.overrides import split_overrides
from ops.deployment.launch import cmdline, kill_tree, process_tree
from ops.recovery import RESUMABLE_KEYS, death_reason, expand_resume
from server.run_folder import (
    RECOVERIES_FILE,
    load_overrides,
    read_recoveries,
    record_recovery,
    save_overrides,
)


# ---------------------------------------------------------------- resume from the folder alone
def _saved_run(tmp_path: Path, overrides: list[str]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_overrides(run_dir, [*overrides, f"results_root={tmp_path}", "run_name=run"])
    return run_dir


def test_the_saved_overrides_leave_out_the_folder_keys(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, ["strategy=fedbn", "train.lr=0.02", "overwrite=true"])
    assert load_overrides(run_dir) == ["strategy=fedbn", "train.lr=0.02"]
    assert load_overrides(tmp_path) is None


def test_resume_composes_the_runs_own_configuration(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, ["strategy=fedbn", "seed=3", "train.lr=0.02", "dataset.dirichlet_alpha=0.5"])
    overrides = expand_resume([f"resume={run_dir}"])
    assert overrides == ["strategy=fedbn", "seed=3", "train.lr=0.02", "dataset.dirichlet_alpha=0.5",
                         f"resume={run_dir.resolve()}"]
    cfg = compose_config(*split_overrides(overrides))
    assert (cfg.strategy.name, cfg.seed, cfg.train.lr, cfg.dataset.dirichlet_alpha) == ("fedbn", 3, 0.02, 0.5)
    assert (cfg.run_name, cfg.results_root) == ("run", str(tmp_path.resolve()))


def test_resume_takes_more_rounds_and_repeated_overrides(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, ["strategy=fedbn", "rounds=4"])
    overrides = expand_resume([f"resume={run_dir}", "rounds=10", "round_timeout=30", "strategy=fedbn"])
    cfg = compose_config(*split_overrides(overrides))
    assert (cfg.rounds, cfg.round_timeout, cfg.strategy.name) == (10, 30.0, "fedbn")
    assert "rounds" in RESUMABLE_KEYS and "device" in RESUMABLE_KEYS


@pytest.mark.parametrize("change, key", [("strategy=fedavg", "strategy.name"), ("train.lr=0.1", "train.lr"),
                                         ("seed=1", "seed"), ("model=mlp", "model.name")])
def test_resume_refuses_a_change_that_alters_the_run_naming_the_key(tmp_path: Path, change: str, key: str) -> None:
    run_dir = _saved_run(tmp_path, ["strategy=fedbn", "train.lr=0.02"])
    with pytest.raises(ConfigError) as err:
        expand_resume([f"resume={run_dir}", change])
    text = str(err.value)
    assert f"{key}:" in text and "may not change on resume" in text
    assert f"pflower run resume={run_dir.resolve()}" in text


def test_resume_of_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a run folder"):
        expand_resume([f"resume={tmp_path / 'nope'}"])


def test_a_folder_without_saved_overrides_keeps_the_overrides_given(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    given = [f"resume={tmp_path / 'old'}", "strategy=fedbn"]
    assert expand_resume(given) == given


def test_pflower_run_resume_refuses_a_changed_key_before_starting_anything(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, ["strategy=fedbn"])
    proc = pflower("run", f"resume={run_dir}", "strategy=fedavg", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "strategy.name: the run has 'fedbn', this command gives 'fedavg'" in proc.stderr


def test_pflower_deploy_resume_takes_the_folders_configuration_too(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, ["experiment=deploy-3", "strategy=fedbn"])
    proc = pflower("deploy", "--mode", "insecure", f"resume={run_dir}", "strategy=fedavg", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "strategy.name: the run has 'fedbn', this command gives 'fedavg'" in proc.stderr
    assert f"pflower deploy resume={run_dir.resolve()}" in proc.stderr


# ---------------------------------------------------------------- recoveries in the folder
def test_recoveries_are_logged_and_counted_in_the_summary(tmp_path: Path) -> None:
    from server.results import RunRecorder

    run = compose_run({"results-root": str(tmp_path), "run-name": "r"}, ["rounds=1"])
    recorder = RunRecorder(run.cfg, run.settings)
    recorder.log_round({"round": 1, "evaluate": {"accuracy_mean": 0.5, "accuracy_min": 0.5, "accuracy_std": 0.0},
                        "clients": {"0": {"accuracy": 0.5}}})
    clean = recorder.finish({"0": {"num_train": 1}})
    assert clean["status"] == "completed" and clean["recoveries"] == 0
    record_recovery(recorder.dir, 1, "flwr exit code 1")
    recovered = recorder.finish({"0": {"num_train": 1}})
    recorder.close()
    assert recovered["recoveries"] == 1 and recovered["recovered_after_rounds"] == [1]
    assert recovered["status"] == "completed-recovered"
    assert read_recoveries(recorder.dir)[0]["reason"] == "flwr exit code 1"
    assert (recorder.dir / RECOVERIES_FILE).exists()


def test_death_reason_names_flowers_heartbeat_failure() -> None:
    text = death_reason(0, {"status": "finished:failed", "details": "No heartbeat received from the task"}, "")
    assert "flwr exit code 0" in text and "No heartbeat received from the task" in text
    assert "SuperLink unreachable" in death_reason(1, None, "")


def test_task_heartbeat_timeout_is_lengthened_and_node_liveness_is_not() -> None:
    """The patch changes the task TTL (2 x 30 s in Flower 1.39) and not how soon a
    SuperNode that stopped is taken for gone; run in a fresh process (it patches a module)."""
    code = ("from common.flower_compat import lengthen_task_heartbeat_ttl as f; assert f(600.0);"
            "from flwr.supercore.corestate import sql_corestate as s, in_memory_corestate as m;"
            "from flwr.server.superlink.linkstate import sql_linkstate as l;"
            "from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL as i;"
            "print(s.HEARTBEAT_PATIENCE * i, m.HEARTBEAT_PATIENCE * i, l.HEARTBEAT_PATIENCE * i)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["600", "600", "60"]


def test_the_simulation_watch_notices_a_simulation_that_exited(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from ops.deployment.launch import AppWatch

    script = tmp_path / "flwr-simulation"
    script.write_text("#!/bin/sh\nsleep 1\n")
    script.chmod(0o755)
    go = tmp_path / "go"   # the app starts after the watch did (one there before is another run's)
    link = subprocess.Popen(["/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; {script}; sleep 60"],
                            start_new_session=True)
    try:
        watch = AppWatch(SimpleNamespace(proc=link), "flwr-simulation", grace_s=0.5)
        go.touch()
        deadline = time.monotonic() + 10
        while not watch.seen and time.monotonic() < deadline:
            assert watch()
            time.sleep(0.1)
        assert watch.seen
        while watch() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "simulation process exited" in watch.reason
    finally:
        kill_tree(link.pid)
        link.wait()
    gone = AppWatch(SimpleNamespace(proc=link), "flwr-simulation")
    assert not gone() and gone.reason == "the SuperLink exited" and gone.link_gone and not gone.app_gone
    assert watch.app_gone and not watch.link_gone


def test_the_watch_takes_no_app_already_there_for_its_runs(tmp_path: Path) -> None:
    """A ServerApp already running when a run starts is the previous run's, still exiting:
    its end must not be taken for the new run's (which would stop and resume a healthy run)."""
    from types import SimpleNamespace

    from ops.deployment.launch import AppWatch

    script, done = tmp_path / "flwr-serverapp", tmp_path / "done"   # it exits once told to
    script.write_text(f"#!/bin/sh\nwhile [ ! -e {done} ]; do sleep 0.05; done\n")
    script.chmod(0o755)
    link = subprocess.Popen(["/bin/sh", "-c", f"{script}; sleep 60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not any("flwr-serverapp" in cmdline(p) for p in process_tree(link.pid)[1:]):
            assert time.monotonic() < deadline, "the stand-in ServerApp never started"
            time.sleep(0.05)
        watch = AppWatch(SimpleNamespace(proc=link), "flwr-serverapp", grace_s=0.2)
        assert watch.others
        done.touch()
        while any("flwr-serverapp" in cmdline(p) for p in process_tree(link.pid)[1:]):
            assert time.monotonic() < deadline, "the stand-in ServerApp did not exit"
            time.sleep(0.05)
        end = time.monotonic() + 1   # past the old app's exit and the grace
        while time.monotonic() < end:
            assert watch()
            time.sleep(0.1)
        assert not watch.seen and not watch.reason
    finally:
        kill_tree(link.pid)
        link.wait()


def test_process_helpers_need_no_ps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slim container images have no ``ps``: liveness and the process tree come from psutil."""
    from ops.deployment.launch import pid_alive

    monkeypatch.setenv("PATH", str(tmp_path))   # no ps (nor anything else) on PATH
    child = subprocess.Popen(["/bin/sleep", "30"], start_new_session=True)
    try:
        assert pid_alive(child.pid) and child.pid in process_tree(os.getpid())
        # Popen may return before the kernel shows the exec'd command line (it read '' on a
        # busy machine): wait for what is asserted, not for a fixed time
        deadline = time.monotonic() + 30
        while "sleep 30" not in cmdline(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "sleep 30" in cmdline(child.pid), cmdline(child.pid)
    finally:
        kill_tree(child.pid)
        child.wait()
    assert not pid_alive(child.pid)


# ---------------------------------------------------------------- end to end
def _rounds(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _wait_for_round(proc: subprocess.Popen, run_dir: Path, rnd: int, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["round"] >= rnd for r in _rounds(run_dir)):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"round {rnd} not reached"
        time.sleep(0.1)


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, rnd: int, log: Path, timeout: float = 600) -> None:
    """Until the server's checkpoint reaches round ``rnd`` (its metrics line comes first: a kill
    between the two would find the checkpoint a round earlier)."""
    from server.checkpoint import checkpoint_round

    deadline = time.monotonic() + timeout
    while (checkpoint_round(run_dir) or 0) < rnd:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of round {rnd}"
        time.sleep(0.1)


def _simulation_pid(proc: subprocess.Popen) -> int:
    pids = [p for p in process_tree(proc.pid) if "bin/flwr-simulation" in cmdline(p)]
    assert pids, "no flwr-simulation process under pflower"
    return pids[0]


def _numbers(run_dir: Path) -> tuple:
    s = json.loads((run_dir / "summary.json").read_text())
    return (s["accuracy_mean"], s["accuracy_min"], {c: v["accuracy"] for c, v in s["clients"].items()},
            [(r["round"], r.get("evaluate", {}).get("accuracy_mean")) for r in _rounds(run_dir)])


COMMON = ["strategy=fedbn", "rounds=5", "train.lr=0.03", "dataset.dirichlet_alpha=0.5"]


@pytest.mark.e2e
def test_a_simulation_that_dies_is_recovered_and_the_printed_resume_command_works(tmp_path: Path) -> None:
    """(a) uninterrupted reference; (b) its simulation process SIGKILLed at round 2: pflower
    resumes by itself and ends bit for bit where (a) ends, the recovery logged with the
    SuperLink's output kept; (c) the same with --max-recoveries 0: the run fails and prints
    its resume command, which, run verbatim, finishes the run to the same numbers."""
    ref = died = gaveup = resumed = None
    logs = {k: tmp_path / f"{k}.log" for k in ("ref", "died", "gaveup", "resumed")}
    try:
        ref = pflower_popen(["run", *COMMON, f"results_root={tmp_path}", "run_name=ref"], logs["ref"])
        _wait_for_round(ref, tmp_path / "ref", 1, logs["ref"])
        died = pflower_popen(["run", *COMMON, f"results_root={tmp_path}", "run_name=died"], logs["died"])
        _wait_for_checkpoint(died, tmp_path / "died", 2, logs["died"])
        os.kill(_simulation_pid(died), signal.SIGKILL)
        assert ref.wait(timeout=600) == 0, logs["ref"].read_text()[-3000:]
        assert died.wait(timeout=600) == 0, logs["died"].read_text()[-3000:]

        gaveup = pflower_popen(["run", *COMMON, f"results_root={tmp_path}", "run_name=gaveup",
                                "--max-recoveries", "0"], logs["gaveup"])
        _wait_for_checkpoint(gaveup, tmp_path / "gaveup", 2, logs["gaveup"])
        os.kill(_simulation_pid(gaveup), signal.SIGKILL)
        assert gaveup.wait(timeout=600) == 1, logs["gaveup"].read_text()[-3000:]
        text = logs["gaveup"].read_text()
        command = re.search(r"pflower: resume with: (pflower run .*)$", text, re.M)
        assert command, text[-3000:]
        argv = shlex.split(command.group(1))
        assert argv[:2] == ["pflower", "run"]
        resumed = pflower_popen(argv[1:], logs["resumed"])   # pflower_popen runs `python -m ops.cli`
        assert resumed.wait(timeout=600) == 0, logs["resumed"].read_text()[-3000:]
    finally:
        for proc in (ref, died, gaveup, resumed):
            if proc is not None:
                kill_tree(proc.pid)

    text = logs["died"].read_text()
    assert "pflower: the run died" in text and "recovering (1 of at most 3)" in text
    recoveries = read_recoveries(tmp_path / "died")
    assert len(recoveries) == 1 and recoveries[0]["after_round"] >= 2
    assert "simulation process exited" in recoveries[0]["reason"]
    kept = Path(recoveries[0]["evidence"])
    assert kept.parent == tmp_path / "died" / "failures" and (kept / "superlink.log").exists()
    summary = json.loads((tmp_path / "died" / "summary.json").read_text())
    assert summary["status"] == "completed-recovered" and summary["recoveries"] == 1
    assert _numbers(tmp_path / "died") == _numbers(tmp_path / "ref")

    assert "not recovering: automatic recovery is off (--max-recoveries 0)" in logs["gaveup"].read_text()
    assert "resuming" in logs["resumed"].read_text()
    assert json.loads((tmp_path / "gaveup" / "summary.json").read_text())["status"] == "completed"
    assert _numbers(tmp_path / "gaveup") == _numbers(tmp_path / "ref")
    assert not (tmp_path / "gaveup" / "FAILED").exists() or \
        (tmp_path / "gaveup" / "FAILED").stat().st_mtime < (tmp_path / "gaveup" / "summary.json").stat().st_mtime


@pytest.mark.e2e
def test_a_simulation_paused_longer_than_flowers_heartbeat_timeout_completes(tmp_path: Path) -> None:
    """Flower 1.39 fails a run whose simulation misses heartbeats for 60 s (a machine so
    loaded that the process is not scheduled, or a SuperLink that cannot answer). Pausing
    the simulation process for 75 s reproduced the deaths of long runs; with pflower's
    SuperLink the run carries on."""
    log = tmp_path / "log.txt"
    proc = pflower_popen(["run", "rounds=4", f"results_root={tmp_path}", "run_name=paused"], log)
    try:
        _wait_for_round(proc, tmp_path / "paused", 2, log)
        sim = _simulation_pid(proc)
        os.kill(sim, signal.SIGSTOP)
        time.sleep(75)
        os.kill(sim, signal.SIGCONT)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        kill_tree(proc.pid)
    summary = json.loads((tmp_path / "paused" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["recoveries"] == 0
    slow = [r for r in _rounds(tmp_path / "paused") if r["round"] >= 3]
    assert slow and max(r["elapsed_s"] for r in slow) - min(r["elapsed_s"] for r in _rounds(tmp_path / "paused")) > 70


def _deploy_ref_and_killed(tmp_path: Path, victims, kill_in: str = "killed"  # noqa: ANN001
                           ) -> tuple[str, Path, Path, dict[str, int]]:
    """``pflower deploy`` (insecure, 3 SuperNodes, FedBN, 4 rounds), two runs of the same
    configuration on one deployment: ``ref`` then ``killed``; the processes ``victims(work,
    results)`` names are SIGKILLed once round 2 of ``kill_in`` is recorded (``killed``: ``ref``
    is the uninterrupted twin). Returns the command's output, the results and work folders,
    and the pid killed."""
    import threading

    work, results = tmp_path / "work", tmp_path / "results"
    fast = ["wait_for_clients=120", "round_timeout=150", "eval_every=2"]
    cmd = [sys.executable, "-m", "ops.cli", "deploy", "--mode", "insecure", "--workdir", str(work),
           "--timeout", "900", "experiment=deploy-3", "strategy=fedbn", "rounds=4", "run_name=ref,killed",
           f"results_root={results}", *fast]
    killed: dict[str, int] = {}

    def kill_after_round_two() -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not any(r["round"] >= 2 for r in _rounds(results / kill_in)):
            time.sleep(0.1)
        for pid in victims(work, results):
            os.kill(pid, signal.SIGKILL)
            killed["pid"] = pid

    killer = threading.Thread(target=kill_after_round_two, daemon=True)
    killer.start()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    killer.join(timeout=5)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "pid" in killed, "nothing was killed"
    assert text.count("pflower deploy: done") == 2
    assert [r["round"] for r in _rounds(results / "killed")] == [1, 2, 3, 4]
    assert _numbers(results / "killed") == _numbers(results / "ref")
    # the SuperNodes were not restarted: one start each, their state under the results
    for i in range(3):
        assert (work / f"supernode-{i}.log").read_text().count("===== pflower: start #") == 1
        assert list((results / "supernode-state" / f"node-{i}" / "killed" / str(i)).glob("state-r*.npz"))
    return text, results, work, killed


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").glob("[0-9]*")]


@pytest.mark.e2e
@pytest.mark.parametrize("target", ["superlink", "serverapp"])
def test_a_deployment_whose_server_side_process_is_killed_resumes(tmp_path: Path, target: str) -> None:
    """The SuperLink (or the run's ServerApp) of ``killed`` is SIGKILLed after its round 2
    (:func:`_deploy_ref_and_killed`). The SuperLink is started again on its database and ports,
    the SuperNodes reconnect with their client state, the run resumes from its checkpoint and
    ends bit for bit where ``ref`` ended. A ServerApp killed is noticed 20 s later (the
    SuperLink would wait 10 minutes for its heartbeats): its run is stopped on the live
    SuperLink and resumed the same way."""
    def victims(work: Path, results: Path) -> list[int]:
        links = [p for p in _pids() if "ops.node.superlink" in cmdline(p) and str(work) in cmdline(p)]
        if target == "serverapp":
            return [p for link in links for p in process_tree(link)[1:] if "flwr-serverapp" in cmdline(p)]
        return links

    text, results, _, _ = _deploy_ref_and_killed(tmp_path, victims)
    if target == "superlink":
        assert "the SuperLink exited during the run" in text and "starting it again on its database" in text
        # the interrupted run, still "running" in the database, was stopped before the resume
        assert "stopped the runs the restarted SuperLink still counted as running" in text
    else:
        assert "the ServerApp process exited and the run had not ended 20 s later; stopped its run on the SuperLink" in text
        assert "starting it again" not in text
    recoveries = read_recoveries(results / "killed")
    assert len(recoveries) == 1 and recoveries[0]["after_round"] >= 2
    assert ("ServerApp process exited" if target == "serverapp" else "SuperLink exited") in recoveries[0]["reason"]
    summary = json.loads((results / "killed" / "summary.json").read_text())
    assert summary["status"] == "completed-recovered"


@pytest.mark.e2e
def test_a_deployment_whose_flwr_run_is_killed_is_followed_to_its_end(tmp_path: Path) -> None:
    """``flwr run --stream``, the process ``pflower deploy`` watches a run through, is SIGKILLed
    after round 2 of ``killed``. The run itself (SuperLink, ServerApp, SuperNodes) is healthy:
    ``pflower deploy`` asks the SuperLink, finds it running, follows it from its metrics to its
    end, and reports it done, with no resume and numbers equal to ``ref``'s (before, this cost
    a manual resume)."""
    def victims(work: Path, results: Path) -> list[int]:
        return [p for p in _pids() if "--stream" in cmdline(p) and 'run-name="killed"' in cmdline(p)
                and str(results) in cmdline(p)]

    text, results, _, killed = _deploy_ref_and_killed(tmp_path, victims)
    assert f"the log stream ended (flwr exit code {-signal.SIGKILL})" in text and "following it from its metrics" in text
    assert "pflower: the run is finished:completed" in text
    assert "resuming" not in text and not read_recoveries(results / "killed")
    summary = json.loads((results / "killed" / "summary.json").read_text())
    assert summary["status"] == "completed"


@pytest.mark.e2e
def test_a_deployment_whose_superexecs_are_killed_runs_its_next_run(tmp_path: Path) -> None:
    """Flower's SuperLink and each SuperNode start one ``flower-superexec``, which starts
    every ServerApp (ClientApp), and never start it again. The SuperLink's and SuperNode 1's
    are SIGKILLed after round 2 of ``ref``: ``ref`` goes on (the apps already started outlive
    it), and ``killed``, submitted next, needs a new ServerApp and new ClientApps of node 1.
    ``pflower-superlink`` and ``pflower-supernode`` start their SuperExec again
    (``ops/node/keepers.py``), so ``killed`` runs and ends equal to ``ref``; before, it waited,
    pending, with no end (the SuperLink's) and node 1 ran none of its messages."""
    def victims(work: Path, results: Path) -> list[int]:
        link = [p for p in _pids() if "ops.node.superlink" in cmdline(p) and str(work) in cmdline(p)]
        node = [p for p in _pids() if "supernode" in cmdline(p) and "state-dir" in cmdline(p)
                and str(results / "supernode-state" / "node-1") in cmdline(p)]
        return [c for owner in link + node for c in process_tree(owner)[1:] if "flower-superexec" in cmdline(c)]

    _, _, work, _ = _deploy_ref_and_killed(tmp_path, victims, kill_in="ref")
    restarted = "pflower: started Flower's SuperExec again"
    assert restarted in (work / "superlink" / "superlink.log").read_text()
    assert restarted in (work / "supernode-1.log").read_text()
