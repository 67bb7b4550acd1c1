"""``pflower sweep --jobs N``: a grid's runs N at a time, each its own ``pflower run`` process.

The scheduler is tested with a stand-in for ``pflower run`` (a small Python process that
sleeps, then writes the run folder's ``summary.json``, or exits 1), so that what is checked
is the scheduling itself: never more than N at once, every run done, each outcome mapped as
the sequential sweep maps it, finished runs reused, a run named twice run once, and an
interrupted sweep stopping the runs it started. The real thing (two Flower simulations side by
side) is the e2e test at the end.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import pflower

import ops.cli as cli
import ops.compare as compare
import ops.sweep as sweep
from ops.resources import simulation_config
from ops.running import RunOptions

FAKE_RUN = r"""
import json, os, sys, time
folder, log, seconds, code = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
summary = sys.argv[5] if len(sys.argv) > 5 else "{}"
with open(log, "a") as f: f.write(json.dumps({"folder": folder, "start": time.time(), "pid": os.getpid()}) + "\n")
time.sleep(seconds)
if code == 0:
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, "summary.json"), "w").write(summary)
with open(log, "a") as f: f.write(json.dumps({"folder": folder, "end": time.time()}) + "\n")
sys.exit(code)
"""


def _options() -> RunOptions:
    return RunOptions(num_cpus=1.0, num_gpus=None, max_recoveries=0, ray_address=None)


@pytest.fixture
def fake_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``pflower run`` replaced by FAKE_RUN: seed 13 fails (exit 1), seed 14 is partial (exit 4)."""
    script, log = tmp_path / "fake_run.py", tmp_path / "events.jsonl"
    script.write_text(FAKE_RUN)

    def command(combo: list[str], options: RunOptions) -> list[str]:
        folder, _ = sweep.run_folder(combo)
        seed = next(int(c.split("=")[1]) for c in combo if c.startswith("seed="))
        code = {13: 1, 14: sweep.EXIT_PARTIAL}.get(seed, 0)
        return [sys.executable, str(script), str(folder), str(log), "0.6", str(code)]

    monkeypatch.setattr(sweep, "run_command", command)
    return log


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _most_at_once(events: list[dict]) -> int:
    edges = sorted([(e["start"], 1) for e in events if "start" in e] + [(e["end"], -1) for e in events if "end" in e])
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def test_runs_n_at_a_time_and_maps_every_outcome_as_the_sequential_sweep(fake_runs: Path, tmp_path: Path) -> None:
    root = tmp_path / "results"
    grid = sweep.expand_grid([f"results_root={root}", "strategy=fedavg", "seed=0,1,13,14,2"])
    done_before = sweep.run_folder(grid[4])[0]          # seed 2 finished earlier: reused, not run
    done_before.mkdir(parents=True)
    (done_before / "summary.json").write_text("{}")

    outcomes = sweep.run_in_parallel(grid + [grid[0]], _options(), jobs=2, poll_s=0.05)

    folders = [sweep.run_folder(c)[0] for c in grid]
    assert outcomes == [(folders[0], False), (folders[1], False), (None, False), (folders[3], True),
                        (folders[4], False), (folders[0], False)]
    events = _events(fake_runs)
    started = [e["folder"] for e in events if "start" in e]
    assert sorted(started) == sorted(str(f) for f in folders[:4])   # each once; the done one never
    assert _most_at_once(events) == 2                              # two at a time, never three
    assert all((root / ".sweep-logs" / f"{f.name}.log").exists() for f in folders[:4])


def test_one_job_at_a_time_never_overlaps(fake_runs: Path, tmp_path: Path) -> None:
    grid = sweep.expand_grid([f"results_root={tmp_path / 'r'}", "strategy=fedavg", "seed=0,1,2"])
    outcomes = sweep.run_in_parallel(grid, _options(), jobs=1, poll_s=0.05)
    assert all(folder is not None for folder, _ in outcomes)
    assert _most_at_once(_events(fake_runs)) == 1


def test_an_interrupted_sweep_stops_the_runs_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "forever.py"
    pids = tmp_path / "pids"
    script.write_text("import os, sys, time\nopen(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\ntime.sleep(600)\n")
    monkeypatch.setattr(sweep, "run_command", lambda combo, args: [sys.executable, str(script), str(pids)])
    grid = sweep.expand_grid([f"results_root={tmp_path / 'r'}", "strategy=fedavg", "seed=0,1,2"])

    def interrupt_soon() -> None:
        for _ in range(200):
            if pids.exists() and len(pids.read_text().split()) == 2:
                break
            time.sleep(0.05)
        import _thread
        _thread.interrupt_main()

    threading.Thread(target=interrupt_soon, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        sweep.run_in_parallel(grid, _options(), jobs=2, poll_s=0.05)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2                        # the third never started
    for pid in started:
        with pytest.raises(ProcessLookupError):      # stopped and reaped, not left running
            os.kill(pid, 0)


def test_the_command_of_each_run_carries_the_sweeps_options() -> None:
    cmd = sweep.run_command(["strategy=fedbn", "seed=1"],
                          RunOptions(num_cpus=4.0, num_gpus=0.25, max_recoveries=2, ray_address="10.0.0.1:6379"))
    assert cmd[1:] == ["-m", "ops.cli", "run", "strategy=fedbn", "seed=1", "--num-cpus", "4",
                       "--max-recoveries", "2", "--num-gpus", "0.25", "--ray-address", "10.0.0.1:6379"]


def set_ray_address(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", value)


# "local" is what an earlier `pflower run` in the same process leaves in RAY_ADDRESS
# (use_ray_cluster): a private instance, not a cluster
@pytest.mark.parametrize("ray_env", [None, "local"])
def test_each_run_of_a_parallel_sweep_gets_an_equal_share_of_the_cpus(
        ray_env: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``pflower run`` starts its own Ray instance, which takes the whole machine unless
    told otherwise: 6 runs on 16 cores must each get 2 CPUs (``--cpus 2``), not 16 each. A run
    on a Ray cluster (``--ray-address``) is the cluster's to place, and gets no share."""

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    set_ray_address(monkeypatch, ray_env)
    seen: list[list[str]] = []
    real_command = sweep.run_command

    def command(combo: list[str], options: RunOptions) -> list[str]:
        seen.append(real_command(combo, options))
        return [sys.executable, "-c", "pass"]

    monkeypatch.setattr(sweep, "run_command", command)
    grid = sweep.expand_grid([f"results_root={tmp_path / 'r'}", "strategy=fedavg", "seed=0,1,2,3,4,5"])
    sweep.run_in_parallel(grid, _options(), jobs=6, poll_s=0.01)
    assert len(seen) == 6
    assert all(cmd[cmd.index("--cpus") + 1] == "2" for cmd in seen), seen
    seen.clear()
    sweep.run_in_parallel(grid, _options(), jobs=3, poll_s=0.01)
    assert all(cmd[cmd.index("--cpus") + 1] == "5" for cmd in seen), seen     # 16 // 3
    seen.clear()
    cluster = RunOptions(num_cpus=1.0, num_gpus=None, max_recoveries=0, ray_address="10.0.0.1:6379")
    sweep.run_in_parallel(grid, cluster, jobs=6, poll_s=0.01)
    assert seen and all("--cpus" not in cmd for cmd in seen)


AFFINITY_RUN = r"""
import json, os, sys, time
log, seconds = sys.argv[1], float(sys.argv[2])
with open(log, "a") as f: f.write(json.dumps({"start": time.time(), "cores": sorted(os.sched_getaffinity(0))}) + "\n")
time.sleep(seconds)
with open(log, "a") as f: f.write(json.dumps({"end": time.time()}) + "\n")
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning runs to cores of their own needs Linux and 2 or more usable cores")
def test_each_run_of_a_parallel_sweep_runs_on_cores_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--jobs 2`` on this machine's cores: two runs at once, each pinned to its own half (what
    the run starts, its ServerApp, SuperLink and Ray, inherits the pinning), and a third run gets
    the cores of the run that ended. On a Ray cluster nothing is pinned."""
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    script, log = tmp_path / "affinity.py", tmp_path / "events.jsonl"
    script.write_text(AFFINITY_RUN)
    durations = iter(["0.6", "1.2", "0.3"])
    monkeypatch.setattr(sweep, "run_command", lambda combo, options: [sys.executable, str(script), str(log),
                                                                      next(durations)])
    set_ray_address(monkeypatch, None)
    grid = sweep.expand_grid([f"results_root={tmp_path / 'r'}", "strategy=fedavg", "seed=0,1,2"])
    sweep.run_in_parallel(grid, _options(), jobs=2, poll_s=0.02)
    seen = [e["cores"] for e in _events(log) if "start" in e]
    assert seen == [cores[:half], cores[half:2 * half], cores[:half]], seen   # the third: the first's cores
    log.unlink()
    durations = iter(["0.1"] * 3)
    cluster = RunOptions(num_cpus=1.0, num_gpus=None, max_recoveries=0, ray_address="10.0.0.1:6379")
    sweep.run_in_parallel(grid, cluster, jobs=2, poll_s=0.02)
    assert [e["cores"] for e in _events(log) if "start" in e] == [cores] * 3


def test_core_groups_split_the_usable_cores_evenly_and_in_order() -> None:
    from ops.resources import core_groups

    assert core_groups(list(range(16)), 7) == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13)]
    assert core_groups([0, 2, 4, 6, 8], 2) == [(0, 2), (4, 6)]      # an affinity with gaps, as a cpuset gives
    assert core_groups(list(range(16)), 3) == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14)]
    assert core_groups([0, 1], 3) is None                           # fewer cores than runs: shared, unpinned


@pytest.mark.parametrize("ray_env", [None, "local"])
def test_a_parallel_sweep_whose_clients_cannot_fit_in_a_runs_share_is_refused(
        ray_env: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--jobs 6 --num-cpus 4`` on 16 cores: a run's share is 2 CPUs, a client asks for 4, so no
    client could start. Refused before anything starts, naming both ways out."""

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    set_ray_address(monkeypatch, ray_env)
    for command in ("sweep", "tune"):
        with pytest.raises(SystemExit) as stop:
            cli.main([command, f"results_root={tmp_path}", "strategy=fedavg", "seed=0,1",
                      "--jobs", "6", "--num-cpus", "4"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "--jobs 6 gives each run 2 of this machine's 16 CPUs" in err, err
        assert "--num-cpus 2 or less, or fewer --jobs" in err, err
    assert not any(tmp_path.iterdir())   # nothing started


def test_a_runs_cpu_share_reaches_flowers_ray_instance() -> None:
    """``--cpus N`` becomes Flower's ``init-args-num-cpus`` (Ray's ``num_cpus``), as Flower itself
    parses a ``--federation-config``; without it the run's Ray takes the whole machine."""
    from flwr.common.config import parse_config_args
    from flwr.supercore.utils import simulation_config_from_json

    def parsed(text: str) -> object:
        values = parse_config_args([text])
        return simulation_config_from_json({k.replace("-", "_"): v for k, v in values.items()})

    shared = parsed(simulation_config(18, 1.0, 0.0, 2))
    assert (shared.num_supernodes, shared.client_resources_num_cpus, shared.init_args_num_cpus) == (18, 1, 2)
    whole = parsed(simulation_config(18, 1.0, 0.25, None))
    assert not whole.HasField("init_args_num_cpus") and whole.client_resources_num_gpus == 0.25


@pytest.mark.e2e
def test_pflower_sweep_with_two_jobs_runs_two_simulations_side_by_side(tmp_path: Path) -> None:
    out = pflower("sweep", "strategy=fedavg", "seed=0,1", "rounds=1", f"results_root={tmp_path}",
                  "--jobs", "2", "--out", str(tmp_path / "table.md"), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    summaries = sorted((json.loads((run / "summary.json").read_text()) for run in runs), key=lambda s: s["seed"])
    assert [(s["status"], s["seed"], s["rounds"]) for s in summaries] == [("completed", 0, 1), ("completed", 1, 1)]
    for summary in summaries:
        assert 0.0 <= summary["accuracy_mean"] <= 1.0
    logs = sorted(p.name for p in (tmp_path / ".sweep-logs").iterdir())
    assert logs == sorted(f"{run.name}.log" for run in runs)
    table = (tmp_path / "table.md").read_text()
    assert "| fedavg |" in table and "| 0,1 |" in table, table     # both seeds in one row
    lines = [line for line in out.stdout.splitlines() if line.startswith("pflower sweep: [")]
    assert [("started" in line) for line in lines] == [True, True, False, False], lines   # both began before either ended


def test_tune_with_jobs_runs_every_grid_side_by_side_then_every_seed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``pflower tune --jobs 2``: both methods' grids are one batch and their seeds a second, so a
    seed run starts only once every grid run has ended (the choice needs them all)."""
    script, log = tmp_path / "fake_run.py", tmp_path / "events.jsonl"
    script.write_text(FAKE_RUN)

    def command(combo: list[str], options: RunOptions) -> list[str]:
        values = dict(c.split("=", 1) for c in combo)
        val = 0.9 - abs(float(values["train.lr"]) - (0.05 if values["strategy"] == "fedavg" else 0.1))
        summary = json.dumps({"best_val_accuracy": val, "accuracy_mean": 0.5})
        return [sys.executable, str(script), str(sweep.run_folder(combo)[0]), str(log), "0.3", "0", summary]

    monkeypatch.setattr(sweep, "run_command", command)
    monkeypatch.setattr(compare, "print_comparison", lambda *args: 0)
    root = tmp_path / "r"
    assert cli.main(["tune", f"results_root={root}", "strategy=fedavg,fedbn", "--grid", "train.lr=0.01,0.05,0.1",
                     "--seeds", "0,1", "--tune-seed", "5", "--jobs", "2"]) == 0
    events = _events(log)
    assert _most_at_once(events) == 2
    starts = {e["folder"]: e["start"] for e in events if "start" in e}
    ends = {e["folder"]: e["end"] for e in events if "end" in e}
    grid = [f for f in starts if f.endswith("-s5") or "-s5-" in f]
    seeds = [f for f in starts if f not in grid]
    assert len(grid) == 6 and len(seeds) == 4                     # 3 lrs x 2 methods; 2 seeds x 2 methods
    assert min(starts[f] for f in seeds) >= max(ends[f] for f in grid)
    chosen = {c["strategy"]: c["chosen"] for c in json.loads((root / "tuning.json").read_text())}
    assert chosen == {"fedavg": ["train.lr=0.05"], "fedbn": ["train.lr=0.1"]}


def test_ctrl_c_during_a_run_stops_the_whole_sweep_and_tune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted run (exit 130: its Flower processes stopped) ends the sweep or tune, which
    used to go on with the next configuration."""
    started: list[list[str]] = []

    def interrupted_second(overrides: list[str], options: RunOptions) -> int:
        started.append(list(overrides))
        if len(started) == 2:
            return sweep.EXIT_INTERRUPTED                              # the second is Ctrl-C'd
        folder, _ = sweep.run_folder(list(overrides))                  # the first ends (partly)
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"best_val_accuracy": 0.5}))
        return sweep.EXIT_PARTIAL

    monkeypatch.setattr(sweep, "run_configuration", interrupted_second)
    monkeypatch.setattr(compare, "print_comparison", lambda *args: 0)
    grid = [f"results_root={tmp_path / 's'}", "strategy=fedavg", "seed=0,1,2"]
    assert cli.main(["sweep", *grid]) == sweep.EXIT_INTERRUPTED
    assert len(started) == 2                                   # seed 2 never started
    started.clear()
    assert cli.main(["tune", f"results_root={tmp_path / 't'}", "strategy=fedavg", "--grid", "train.lr=0.01,0.05,0.1",
                     "--seeds", "0"]) == sweep.EXIT_INTERRUPTED
    assert len(started) == 2


def test_a_sweep_run_again_goes_on_with_its_unfinished_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After Ctrl-C (or a killed machine) the same sweep reuses the finished runs, resumes the one
    that stopped after a round from its checkpoint, and starts afresh the one that stopped before
    computing anything; the folder of a run with results but no checkpoint is left to
    ``pflower run`` (which refuses to overwrite it). It used to refuse every unfinished folder."""
    import numpy as np

    from server.checkpoint import save_checkpoint

    grid = sweep.expand_grid([f"results_root={tmp_path}", "strategy=fedavg", "seed=0,1,2,3"])
    folders = [sweep.run_folder(c)[0] for c in grid]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("seed: 0\n")
        (folder / "overrides.json").write_text("{}")
    (folders[0] / "summary.json").write_text(json.dumps({"accuracy_mean": 0.9}))      # finished
    save_checkpoint(folders[1], 3, {"global": {"w": np.zeros(2, np.float32)}}, {"strategy": "fedavg"})
    (folders[3] / "metrics.jsonl").write_text("{}\n")                                # results, no checkpoint
    ran: list[list[str]] = []

    def fake_run(overrides: list[str], options: RunOptions) -> int:
        ran.append(list(overrides))
        return 0

    monkeypatch.setattr(sweep, "run_configuration", fake_run)
    monkeypatch.setattr(compare, "print_comparison", lambda *args: 0)
    assert cli.main(["sweep", *grid[0][:1], "strategy=fedavg", "seed=0,1,2,3"]) == 0
    assert ran == [[f"resume={folders[1]}"], [*grid[2], "overwrite=true"], grid[3]]
    assert sweep.continue_unfinished(grid[1], tmp_path / "never-ran") == grid[1]
    assert sweep.continue_unfinished([*grid[1], "overwrite=true"], folders[1]) == [*grid[1], "overwrite=true"]
    started: list[list[str]] = []

    def command(combo: list[str], options: RunOptions) -> list[str]:
        started.append(combo)
        return [sys.executable, "-c", "pass"]

    monkeypatch.setattr(sweep, "run_command", command)
    sweep.run_in_parallel(grid, _options(), jobs=2, poll_s=0.05)                         # --jobs: the same
    assert sorted(map(str, started)) == sorted(map(str, ran))


@pytest.mark.parametrize("command", ["sweep", "tune"])
def test_jobs_below_one_is_refused_before_anything_runs(command: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, f"results_root={tmp_path}", "strategy=fedavg", "--jobs", "0"])
    assert exit_.value.code == 2
    assert "--jobs 0: give the number of runs at once, 1 or more" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
