"""Every pflower strategy is a Flower ``Strategy``: a Flower user's own ServerApp
(tests/apps/flower_start_app.py) drives it with Flower's own ``Strategy.start`` and pflower's
ClientApp, with no pflower round loop, and gets the method; where the two loops agree
(FedAvg: no fine-tuning at the final evaluation) the numbers equal ``pflower run``'s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.methods import method_names
from common.overrides import split_overrides, to_toml_run_config
from ops.deployment.launch import APP_DIR, flwr_run, simulation_superlink

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
NUM_CLIENTS = 8   # the default dataset (digits-domains)
FEDERATION = f"num-supernodes={NUM_CLIENTS} client-resources-num-cpus=1 client-resources-num-gpus=0"


def _user_project(tmp_path: Path) -> Path:
    """A Flower app of the user's: pflower's packages, and their own ServerApp as ``start_app``."""
    project = tmp_path / "my-flower-app"
    for package in ("client", "common", "learning", "ops", "server", "strategies", "conf"):
        shutil.copytree(REPO / package, project / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "tests" / "apps" / "flower_start_app.py", project / "start_app.py")
    text = (REPO / "pyproject.toml").read_text()
    assert 'serverapp = "server.app:app"' in text and "fab-include = [" in text
    text = text.replace('serverapp = "server.app:app"', 'serverapp = "start_app:app"')
    (project / "pyproject.toml").write_text(text.replace("fab-include = [", 'fab-include = ["start_app.py", ', 1))
    return project


def _submit(app: Path, flwr_home: Path, overrides: list[str]) -> None:
    code = flwr_run(app, flwr_home, to_toml_run_config(*split_overrides(overrides)), FEDERATION, timeout=600)
    assert code == 0, f"flwr run {' '.join(overrides)} exited {code}"


def test_every_method_runs_under_flowers_own_strategy_start(tmp_path: Path) -> None:
    project = _user_project(tmp_path)
    results = tmp_path / "results"
    common = ["rounds=2", "seed=0", f"results_root={results}", f"data_cache={tmp_path / 'cache'}"]
    with simulation_superlink() as (_, flwr_home):
        for name in method_names():
            _submit(project, flwr_home, [f"strategy={name}", f"run_name=start-{name}", *common])
        _submit(APP_DIR, flwr_home, ["strategy=fedavg", "run_name=pflower-fedavg", *common])

    for name in method_names():
        out = results / f"start-{name}" / "flower_start.json"
        assert out.exists(), f"{name}: Flower's start wrote nothing"
        result = json.loads(out.read_text())
        assert sorted(result["evaluate"], key=int) == ["1", "2"], name
        for server_round, summary in result["evaluate"].items():
            assert summary["clients"] == NUM_CLIENTS, (name, server_round, summary)
            assert 0.0 <= summary["accuracy_min"] <= summary["accuracy_mean"] <= 1.0
        assert sorted(result["train"], key=int) == ["1", "2"], name
        assert result["arrays"], f"{name}: start returned no global arrays"

    ours = [json.loads(line) for line in (results / "pflower-fedavg" / "metrics.jsonl").read_text().splitlines()]
    flowers = json.loads((results / "start-fedavg" / "flower_start.json").read_text())["evaluate"]
    for record in ours:
        mine = record["evaluate"]
        theirs = flowers[str(record["round"])]
        for key in ("accuracy_mean", "accuracy_min", "loss_mean"):
            assert theirs[key] == mine[key], (record["round"], key, theirs[key], mine[key])
