"""The ``pflower run`` command: run folders that are never silently reused, runs that say
when clients are missing, errors before any Flower process starts, options anywhere,
temporary folders removed, plots, ``compare`` against Local across models, and the same
run through Flower's own ``flwr run .``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.config import compose_config, compose_run
from ops.styled_digits import make_styled_digits
from server.plots import accuracy_lines
from server.results import RunRecorder
from server.run_folder import RunFolderError, RunFolderLock, lock_is_held
from server.summary import build_summary

REF = {"w": np.zeros((3, 2), np.float32)}


@pytest.fixture(autouse=True)
def _in_a_flower_task(flower_task: None) -> None:
    """Some tests here build Messages."""


def _cli(*args: str) -> tuple[int, str]:
    """``pflower`` as a user runs it (the paths tested here start no Flower process)."""
    out = subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True,
                         timeout=300)
    return out.returncode, out.stdout + out.stderr


# ---------------------------------------------------------------- run names and folders
def test_default_run_name_includes_the_experiment_and_what_else_differs() -> None:
    base = compose_config({}).run_name
    assert base == "fedavg-digits-domains-cnn-s0"
    assert compose_config({"experiment": "deploy-3"}).run_name.startswith("deploy-3-fedavg-")
    five, lr = compose_config({"rounds": "5"}).run_name, compose_config({}, ["train.lr=0.01"]).run_name
    assert len({base, five, lr}) == 3 and five.startswith(base + "-")
    # the same overrides always give the same name (server, clients and CLI agree)
    assert compose_config({}, ["train.lr=0.01"]).run_name == lr
    # where results go and the seed's own suffix do not add a hash
    assert compose_config({"results-root": "/tmp/elsewhere", "seed": "2"}).run_name == \
        "fedavg-digits-domains-cnn-s2"
    # a group's choice is in the name, but each of its keys changes the run and the name
    assert compose_config({}, ["strategy=fedbn"]).run_name == "fedbn-digits-domains-cnn-s0"
    keys = [compose_config({}, [o]).run_name for o in
            ("strategy.weighted=false", "dataset.val_fraction=0.2", "model.width=16")]
    assert len({base, *keys}) == 4 and all(k.startswith(base + "-") for k in keys)


def _recorder(tmp_path: Path, resume: bool = False, overwrite: bool = False) -> RunRecorder:
    # overwrite changes neither the run's name nor its folder (run-name "r" in tmp_path)
    run = compose_run({"results-root": str(tmp_path), "run-name": "r"}, ["overwrite=true"] if overwrite else [])
    return RunRecorder(run.cfg, run.settings, resume=resume)


def test_an_existing_run_folder_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    first = _recorder(tmp_path)
    first.log_round({"round": 1})
    (tmp_path / "r" / "client_state" / "0").mkdir(parents=True)
    first.close()
    with pytest.raises(RunFolderError, match=r"already holds a run .*resume=.*overwrite=true"):
        _recorder(tmp_path)
    assert (tmp_path / "r" / "metrics.jsonl").read_text().count("\n") == 1   # nothing lost
    _recorder(tmp_path, resume=True).close()   # resume may reuse it
    _recorder(tmp_path, overwrite=True).close()   # overwrite replaces it ...
    assert not (tmp_path / "r" / "client_state").exists()   # ... with no stale state


def test_a_second_live_run_on_the_same_folder_is_refused(tmp_path: Path) -> None:
    live = _recorder(tmp_path)
    assert lock_is_held(tmp_path / "r")
    with pytest.raises(RunFolderError, match="being written by another live run"):
        _recorder(tmp_path, overwrite=True)
    live.close()
    assert not lock_is_held(tmp_path / "r")
    RunFolderLock(tmp_path / "r").acquire().release()


def test_pflower_run_refuses_a_folder_holding_an_unfinished_run_before_starting_anything(tmp_path: Path) -> None:
    (tmp_path / "fedavg-digits-domains-cnn-s0").mkdir()
    (tmp_path / "fedavg-digits-domains-cnn-s0" / "metrics.jsonl").write_text("{}\n")
    t0 = time.monotonic()
    code, out = _cli("run", f"results_root={tmp_path}")
    assert code == 2, out
    assert "already holds a run" in out and "resume=" in out and "overwrite=true" in out and "SuperLink" not in out
    assert time.monotonic() - t0 < 60


def test_running_a_finished_configuration_again_says_where_its_result_is(tmp_path: Path) -> None:
    """The README's first command, typed twice: the second says the run is done and where its
    summary is, exit 0, nothing started; `resume=` of the finished folder says the same. A
    summary of fewer rounds (the same run asked to go on longer) is not "finished"."""
    run = tmp_path / "fedavg-digits-domains-cnn-s0"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"rounds": 20, "status": "completed", "accuracy_mean": 0.9123,
                                                  "accuracy_min": 0.8}))
    for args in ([f"results_root={tmp_path}"], [f"resume={run}"]):
        code, out = _cli("run", *args)
        assert code == 0, out
        assert f"{run} already holds this run, finished (completed): accuracy mean 0.9123 min 0.8000" in out
        assert f"-> {run / 'summary.json'}; nothing started" in out and "SuperLink" not in out
    from server.run_folder import finished_summary
    assert finished_summary(run, compose_run({"rounds": "20"}).settings.run) is not None
    assert finished_summary(run, compose_run({}, ["rounds=20", "overwrite=true"]).settings.run) is None
    (run / "summary.json").write_text(json.dumps({"rounds": 10, "accuracy_mean": 0.5, "accuracy_min": 0.5}))
    assert finished_summary(run, compose_run({"rounds": "20"}).settings.run) is None


# ---------------------------------------------------------------- lost clients
def _round(rnd: int, clients: dict[str, float], **extra: object) -> dict:
    accs = list(clients.values())
    return {"round": rnd, "clients": {c: {"accuracy": a, "val_accuracy": a} for c, a in clients.items()},
            "evaluate": {"accuracy_mean": float(np.mean(accs)), "accuracy_min": min(accs),
                         "accuracy_std": float(np.std(accs)), "val_accuracy_mean": float(np.mean(accs))},
            **extra}


def test_a_summary_over_fewer_clients_says_which_are_missing_and_why() -> None:
    run = compose_run({})
    info = {str(i): {"num_train": 10} for i in range(4)}
    rounds = [_round(1, {"0": 0.5, "1": 0.6, "2": 0.7, "3": 0.8}),
              _round(2, {"0": 0.5, "1": 0.6, "2": 0.7}, failed={"3": "client error: state is corrupted"},
                     eval_failed={"3": "client error: state is corrupted"})]
    s = build_summary(run.settings, rounds, info, "completed")
    assert s["status"] == "partial"
    assert (s["clients_expected"], s["clients_reported"]) == (4, 3)
    assert s["clients_missing"] == {"3": "final evaluation: client error: state is corrupted"}
    assert s["client_failures"] == {"3": 1}
    full = build_summary(run.settings, rounds[:1], info, "completed")
    assert full["status"] == "completed" and full["clients_missing"] == {}


def test_the_cli_last_line_says_a_run_is_partial(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from ops.running import EXIT_PARTIAL, report_done

    s = {"accuracy_mean": 0.5, "accuracy_min": 0.4, "accuracy_std": 0.1, "clients_expected": 8,
         "clients_reported": 7, "clients_missing": {"3": "no reply to the final evaluation"}}
    assert report_done(s, tmp_path / "summary.json") == EXIT_PARTIAL
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "PARTIAL: only 7 of 8 clients reported" in err and "3: no reply" in err
    assert report_done({**s, "clients_missing": {}}, tmp_path / "summary.json") == 0


# ---------------------------------------------------------------- errors before Flower starts
@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_styled_digits(tmp_path_factory.mktemp("trees") / "my-digits", per_domain=60)


def _copy(tree: Path, tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / "my-digits"
    shutil.copytree(tree, root)
    return root


def test_the_generic_imagefolder_dataset_discovers_domains_classes_and_its_name(tree: Path) -> None:
    from learning.datasets.federated import load_federated_data

    cfg = compose_config({"dataset": "imagefolder"}, [f"dataset.root={tree}", "dataset.image_size=28"])
    assert cfg.dataset.name == "my-digits" and cfg.run_name.startswith("fedavg-my-digits-cnn-s0-")  # + image_size
    assert compose_config({"dataset": "imagefolder"}, [f"dataset.root={tree}"]).run_name == "fedavg-my-digits-cnn-s0"
    assert list(cfg.dataset.domains) == ["ink", "neon", "noisy", "photo"]
    data = load_federated_data(cfg.dataset, 0)
    assert data.num_classes == 10 and data.input_shape == (3, 28, 28)
    assert {c.domain for c in data.clients.values()} == {"ink", "neon", "noisy", "photo"}
    # the named presets are thin: PACS is the image-folder dataset with its domains
    pacs = compose_config({"dataset": "pacs"}, [f"dataset.root={tree}"]).dataset
    assert pacs.source == "imagefolder" and pacs.name == "pacs" and "sketch" in pacs.domains


@pytest.mark.parametrize("problem", ["wrong-domain", "empty-class", "nested", "unreadable", "too-few",
                                     "empty-domain"])
def test_every_layout_problem_is_found_before_flower_starts(problem: str, tree: Path, tmp_path: Path) -> None:
    root = _copy(tree, tmp_path)
    extra: list[str] = []
    if problem == "wrong-domain":
        extra, expect = ["dataset.domains=[ink,sketch]"], "domain folders ['sketch'] are missing"
    elif problem == "empty-class":
        (root / "ink" / "zebra").mkdir()
        expect = f"class folder {root / 'ink' / 'zebra'} has no images"
    elif problem == "nested":
        (root / "neon" / "3" / "more").mkdir()
        Image.new("RGB", (28, 28)).save(root / "neon" / "3" / "more" / "x.png")
        expect = f"{root / 'neon' / '3' / 'more'} is a folder inside the class folder"
    elif problem == "unreadable":
        (root / "photo" / "7" / "broken.png").write_bytes(b"not a png")
        expect = f"{root / 'photo' / '7' / 'broken.png'} is not a readable image"
    elif problem == "too-few":
        extra, expect = ["dataset.clients_per_domain=30"], "domain 'ink': 60 samples cannot give 30 clients"
    else:
        (root / "sketch").mkdir()
        expect = f"domain folder {root / 'sketch'} has no class folders"
    code, out = _cli("run", "dataset=imagefolder", f"dataset.root={root}", f"results_root={tmp_path}", *extra)
    assert code == 2, out
    assert expect in out, out
    assert "SuperLink" not in out and not (tmp_path / "fedavg-my-digits-cnn-s0").exists()


def test_a_torchvision_root_with_garbage_and_a_missing_root_fail_with_exit_2(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
                 "test_batch", "batches.meta"):
        (folder / name).write_bytes(b"garbage")
    code, out = _cli("run", "dataset=cifar10", f"dataset.root={tmp_path}", f"results_root={tmp_path}")
    assert code == 2 and "could not read cifar10" in out, out
    code, out = _cli("run", "dataset=pacs", f"results_root={tmp_path}")
    assert code == 2 and "pflower run dataset=pacs dataset.root=/path" in out, out


# ---------------------------------------------------------------- command line
def test_options_may_come_anywhere_and_help_lists_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    import ops.cli as cli
    import ops.running

    seen = {}
    monkeypatch.setattr(ops.running, "cmd_run", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(["run", "strategy=fdse", "--num-gpus", "0.25", "rounds=5"]) == 0
    assert seen["args"].overrides == ["strategy=fdse", "rounds=5"] and seen["args"].num_gpus == 0.25
    with pytest.raises(SystemExit):
        cli.main(["run", "strategy=fdse", "--no-such-option"])
    code, out = _cli("run", "--help")
    assert code == 0
    for name in ("fedbasis", "partialfed-adaptive", "imagefolder", "digits-domains", "fdse-alexnet",
                 "overwrite=true", "train.", "privacy."):
        assert name in out


# ---------------------------------------------------------------- start-up and temp folders
def test_a_superlink_that_fails_to_start_is_retried_once_then_named(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    from ops.deployment.launch import LaunchError, SuperLink

    counter = tmp_path / "starts"
    script = ("import pathlib, socket, sys, time\n"
              "p = pathlib.Path(sys.argv[2]); n = int(p.read_text()) + 1 if p.exists() else 1\n"
              "p.write_text(str(n))\n"
              "if n == 1 or sys.argv[3] == 'always':\n"
              "    print('SuperLink says: out of memory', flush=True); sys.exit(1)\n"
              "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(60)\n")

    def fake(mode: str):
        return lambda self: [sys.executable, "-c", script, str(self.http_port), str(counter), mode]

    monkeypatch.setattr(SuperLink, "command", fake("once"))
    link = SuperLink(workdir=tmp_path / "a")
    first_port = link.http_port
    link.start(timeout=20)
    assert counter.read_text() == "2" and link.http_port != first_port   # retried on fresh ports
    link.stop()
    counter.unlink()
    monkeypatch.setattr(SuperLink, "command", fake("always"))
    with pytest.raises(LaunchError) as err:
        SuperLink(workdir=tmp_path / "b").start(timeout=20)
    text = str(err.value)
    assert "attempt 1" in text and "attempt 2" in text and "exited with code 1" in text
    assert "SuperLink says: out of memory" in text and "failed twice" in text


def test_a_superlink_interrupted_while_it_starts_is_stopped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ctrl-C (or the SIGTERM of a `timeout`) while the SuperLink starts: it runs in a session
    of its own and ``with SuperLink()`` never reached its exit, so ``start`` stops it (one was
    found still running after `timeout` stopped eight runs that were starting)."""
    from ops.deployment import launch

    monkeypatch.setattr(launch.SuperLink, "command", lambda self: [sys.executable, "-c", "import time; time.sleep(60)"])

    def interrupted(*_args: object, **_kw: object) -> None:
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(launch, "wait_for_port", interrupted)
    link = launch.SuperLink(workdir=tmp_path / "link")
    with pytest.raises(KeyboardInterrupt):
        with link:
            pytest.fail("the body never runs")
    assert link.proc is not None and link.proc.poll() is not None   # stopped (stop waits), not left running


def test_temporary_folders_are_removed_keys_first_or_kept_when_asked(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    from ops.deployment import launch

    monkeypatch.setattr(launch.SuperLink, "start", lambda self, **kw: self)
    monkeypatch.setattr(launch.SuperLink, "stop", lambda self: None)
    with launch.simulation_superlink() as (link, home):
        (link.workdir / "ca.key").write_text("secret")
        work = link.workdir
    assert not work.exists()
    with launch.simulation_superlink(keep_in=tmp_path / "kept") as (link, home):
        (link.workdir / "superlink.log").write_text("log")
        work = link.workdir
    assert not work.exists() and (tmp_path / "kept" / "superlink.log").read_text() == "log"
    assert (tmp_path / "kept" / "flwr-home" / "config.toml").exists()


# ---------------------------------------------------------------- plots and compare
def test_accuracy_plot_draws_one_line_when_personalised_is_the_global_model() -> None:
    same = [{"evaluate": {"accuracy_mean": 0.5, "accuracy_min": 0.4, "global_accuracy_mean": 0.5,
                          "global_accuracy_min": 0.4}}]
    assert accuracy_lines(same) == [("accuracy", "personalised = global model")]
    differ = [{"evaluate": {**same[0]["evaluate"], "accuracy_mean": 0.6}}]
    assert [k for k, _ in accuracy_lines(differ)] == ["accuracy", "global_accuracy"]
    assert accuracy_lines([{"evaluate": {"accuracy_mean": 0.5, "accuracy_min": 0.4}}]) == \
        [("accuracy", "personalised")]


def test_compare_measures_r_acc_against_local_with_another_model(tmp_path: Path) -> None:
    from ops.compare import compare_runs

    def run(name: str, strategy: str, model: str, accs: list[float]) -> Path:
        d = tmp_path / name
        d.mkdir()
        s = {"strategy": strategy, "dataset": "digits-domains", "model": model, "seed": 0,
             "accuracy_mean": float(np.mean(accs)), "accuracy_min": min(accs), "best_accuracy_mean": 0.0,
             "clients": {str(i): {"accuracy": a} for i, a in enumerate(accs)}}
        (d / "summary.json").write_text(json.dumps(s))
        return d

    local = run("local", "local", "cnn", [0.5, 0.8])
    fdse = run("fdse", "fdse", "fdse-alexnet", [0.6, 0.6])
    table = compare_runs([local, fdse])
    row = next(line for line in table.splitlines() if line.startswith("| fdse"))
    # R-Acc = mean((0.6-0.5)/0.5, (0.6-0.8)/0.8) = mean(0.2, -0.25) = -0.025; PTR = 1/2
    assert row.split("|")[-3].strip() == "-0.0250" and row.split("|")[-2].strip() == "0.5000"
    # the columns are explained under the table (a sweep prints this table)
    assert table.splitlines()[-1].startswith("R-Acc: mean over clients of (acc - acc of that client's Local run)")
    assert "PTR: share of clients whose accuracy beats their Local run's" in table
    assert "R-Acc:" not in compare_runs([fdse])   # no Local run, no such columns, no legend


# ---------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_pflower_run_survives_a_dropped_log_stream(tmp_path: Path) -> None:
    """Cut the log stream (kill ``flwr run --stream``) at round 2 while the SuperLink goes
    on: pflower follows the run to its end instead of stopping a healthy run."""
    from helpers import pflower_popen

    from ops.deployment.launch import cmdline as _cmdline
    from ops.deployment.launch import process_tree

    log = tmp_path / "log.txt"
    proc = pflower_popen(["run", "rounds=6", f"results_root={tmp_path}", "run_name=cut"], log)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None and \
                (not metrics.exists() or metrics.read_text().count("\n") < 2):
            time.sleep(0.2)
        streams = [p for p in process_tree(proc.pid)
                   if " run " in _cmdline(p) and "--stream" in _cmdline(p) and "flwr" in _cmdline(p)]
        assert streams, log.read_text()[-3000:]
        for pid in streams:
            import os
            import signal

            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "the log stream ended" in text and "following it" in text
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["rounds"] == 6 and summary["status"] == "completed"


@pytest.mark.e2e
def test_flwr_run_dot_runs_the_default_experiment_on_flowers_default_federation(tmp_path: Path) -> None:
    """What every Flower user types first: ``flwr run . --stream`` on Flower's default
    federation (2 SuperNodes) runs the default experiment with all 8 clients, and gives the
    numbers of the same run on 8 SuperNodes, bit for bit. Typed again it reuses the finished
    run, as ``pflower run`` does; into a folder holding another run it fails in one line."""
    import os

    from helpers import REPO

    from ops.deployment.launch import cmdline as _cmdline
    from ops.deployment.launch import kill_tree

    home = tmp_path / "flwr-home"
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "OMP_NUM_THREADS": "1"}
    flwr = str(Path(sys.executable).parent / "flwr")

    def submit(name: str, *federation: str, rounds: int = 3) -> str:
        out = subprocess.run([flwr, "run", ".", "--stream", "--run-config",
                              f"rounds={rounds} run-name='{name}' results-root='{tmp_path}'", *federation],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        return out.stdout + out.stderr

    def flwr_run(name: str, *federation: str) -> dict:
        text = submit(name, *federation)
        summary = tmp_path / name / "summary.json"
        assert summary.exists(), text[-3000:]
        return json.loads(summary.read_text())

    def status_of(text: str) -> str:
        """The status on the SuperLink of the run whose submission printed ``text``."""
        import re

        run_id = re.search(r"Successfully started run (\d+)", text)
        assert run_id, text[-3000:]
        out = subprocess.run([flwr, "ls", "--format", "json"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120)
        return next(str(r["status"]) for r in json.loads(out.stdout)["runs"] if str(r["run-id"]) == run_id.group(1))

    try:
        two = flwr_run("two")
        eight = flwr_run("eight", "--federation-config", "num-supernodes=8")
        # the same run again: pflower's reuse rule (nothing run, the run completes)
        written = (tmp_path / "two" / "summary.json").stat().st_mtime_ns
        again = submit("two")
        assert f"{tmp_path / 'two'} already holds this run, finished" in again, again[-3000:]
        assert "overrides='overwrite=true'" in again and "Traceback" not in again
        assert (tmp_path / "two" / "summary.json").stat().st_mtime_ns == written
        assert status_of(again) == "finished:completed"
        # another configuration into that folder: one line in --run-config syntax, the run FAILED
        clash = submit("two", rounds=4)
        assert f"{tmp_path / 'two'} already holds a run" in clash and "--run-config \"run-name=" in clash, clash[-3000:]
        assert "Traceback" not in clash and "raised an exception" not in clash, clash[-3000:]
        assert status_of(clash) == "finished:failed"
    finally:   # the detached local SuperLink flwr started for this FLWR_HOME
        for pid in [int(p.name) for p in Path("/proc").glob("[0-9]*") if str(home) in _cmdline(int(p.name))]:
            kill_tree(pid)
    assert two["status"] == "completed" and two["clients_reported"] == 8 and two["rounds"] == 3
    numbers = [k for k, v in eight.items() if k.startswith("accuracy") and isinstance(v, float)]
    assert len(numbers) >= 4 and {k: two[k] for k in numbers} == {k: eight[k] for k in numbers}
    assert two["clients"] == eight["clients"] and two["best_clients"] == eight["best_clients"]


def test_summary_reports_the_pooled_all_accuracy_beside_the_mean() -> None:
    run = compose_run({})
    info = {str(i): {"num_train": 10} for i in range(3)}
    rnd = _round(1, {"0": 1.0, "1": 0.5, "2": 0.0})
    for cid, n in (("0", 10), ("1", 30), ("2", 60)):
        rnd["clients"][cid]["num-examples"] = float(n)
    s = build_summary(run.settings, [rnd], info, "completed")
    # (1.0 * 10 + 0.5 * 30 + 0 * 60) / 100 = 0.25, while the mean over clients is 0.5
    assert s["accuracy_all"] == pytest.approx(0.25) and s["accuracy_mean"] == pytest.approx(0.5)


def test_remove_private_files_deletes_the_keys_and_the_folder(tmp_path: Path) -> None:
    from ops.deployment.launch import remove_private_files

    work = tmp_path / "pflower-deploy-x"
    (work / "certs").mkdir(parents=True)
    for name in ("ca.key", "ca.crt", "server.key", "supernode-0.key", "supernode-0.pub"):
        (work / "certs" / name).write_text(name)
    (work / "supernode-0.log").write_text("log")
    remove_private_files(work)
    assert not work.exists()
    remove_private_files(work)   # an absent folder is fine


def test_adapt_is_a_mode_of_personalize_and_keeps_its_old_name(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from ops import cli

    for argv in (["personalize", "--adapt", str(tmp_path)], ["adapt", str(tmp_path)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "pflower personalize --adapt" in err and "has no config.yaml" in err


def test_the_help_names_every_command_and_tells_the_two_cpu_options_apart() -> None:
    code, out = _cli("--help")
    assert code == 0 and all(f"pflower {c} " in out for c in ("run", "compare", "sweep", "tune", "data", "deploy"))
    code, out = _cli("sweep", "--help")
    assert code == 0 and "--out OUT" in out and "Markdown table" in out and "comparison plot" in out
    assert "CPUs per simulated client" in " ".join(out.split())
    code, out = _cli("run", "--help")
    text = " ".join(out.split())
    assert "--num-cpus is per client" in text and "--cpus is the whole run's share" in text


def test_a_refusal_under_flwr_run_is_one_line_in_run_config_syntax(tmp_path: Path) -> None:
    """Under ``flwr run .`` the ServerApp's refusals reach Flower's "raised an exception" log:
    the record becomes the refusal's message, without traceback, and names the fixes in
    ``--run-config`` syntax; any other exception keeps its traceback."""
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    from common.flower_compat import log_refusals_as_one_line
    from server.app import RunRefused
    from server.run_folder import RunFolderError, check_run_folder, run_config_hint

    run = tmp_path / "x"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunFolderError) as refused:
        check_run_folder(run, resume=False, overwrite=False)
    hint = run_config_hint(refused.value)
    assert hint == (f"{run} already holds a run (metrics.jsonl); write elsewhere with --run-config "
                    f"\"run-name='<new name>'\", resume it with --run-config \"overrides='resume={run}'\", "
                    "or replace it with --run-config \"overrides='overwrite=true'\"")

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(logging.Formatter("%(message)s").format(record))

    keep = Keep()
    FLOWER_LOGGER.addHandler(keep)
    log_refusals_as_one_line(RunRefused)
    try:
        for exc in (RunRefused(f"pflower: {hint}"), ValueError("a bug")):
            try:
                raise exc
            except Exception as ex:
                FLOWER_LOGGER.log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=ex)
    finally:
        FLOWER_LOGGER.removeHandler(keep)
    assert keep.records[0] == f"pflower: {hint}"
    assert keep.records[1].startswith("ServerApp raised an exception\nTraceback") and "ValueError: a bug" in keep.records[1]
