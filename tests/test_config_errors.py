"""Bad input fails before training: ``pflower run`` exits 2 with one clear message and
starts no Flower process (the launcher is replaced by one that fails the test)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError, compose_config, compose_run, group_options
from ops import cli
from ops.deployment import launch
from server.checkpoint import save_checkpoint
from server.loop import checkpoint_identity


@pytest.fixture(autouse=True)
def no_flower(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Flower process was started for invalid input")

    monkeypatch.setattr(launch, "simulation_superlink", forbidden)
    monkeypatch.setattr(launch, "flwr_run", forbidden)


def run(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    code = cli.main(["run", *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("override", "message"), [
    ("rounds=-1", "rounds must be >= 1, got -1"),
    ("dataset.root=/my/images", "dataset.root='/my/images' is not read by dataset 'digits-domains': its data "
                               "(digits) come with the packages; for your own image tree use dataset=imagefolder"),
    ("rounds=0", "rounds must be >= 1, got 0"),
    ("rounds=abc", "rounds must be an integer, got 'abc'"),
    ("fraction_train=0", "fraction_train must be in (0, 1], got 0.0"),
    ("fraction_train=1.5", "fraction_train must be in (0, 1], got 1.5"),
    ("fraction_train=-0.2", "fraction_train must be in (0, 1], got -0.2"),
    ("min_train_clients=0", "min_train_clients must be >= 1"),
    ("round_timeout=0", "round_timeout must be > 0"),
    ("checkpoint_every=-1", "checkpoint_every must be >= 0"),
    ("norm_bound=-1", "norm_bound must be >= 0"),
    ("train.lr=0", "train.lr must be > 0"),
    ("seed=1.5", "seed must be an integer, got 1.5"),
    ("deterministic=sometimes", "deterministic must be true or false, got 'sometimes'"),
    ("eval_in_train=1", "eval_in_train must be true or false, got 1"),
])
def test_invalid_values(capsys: pytest.CaptureFixture[str], tmp_path: Path, override: str, message: str) -> None:
    code, err = run(capsys, override, f"results_root={tmp_path}")
    assert code == 2
    assert message in err, err
    assert not (tmp_path / "fedavg-digits-domains-cnn-s0").exists()


def test_all_problems_in_one_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "rounds=-3", "fraction_train=2", "train.batch_size=0")
    assert code == 2
    assert err.count("\n  - ") == 3 and err.startswith("pflower: invalid configuration:")


@pytest.mark.parametrize("group", ["strategy", "dataset", "model"])
def test_unknown_names_list_the_valid_ones(capsys: pytest.CaptureFixture[str], group: str) -> None:
    code, err = run(capsys, f"{group}=nope")
    assert code == 2
    assert f"unknown {group} 'nope'; valid {group} names: " in err
    assert ", ".join(group_options(group)) in err


def test_missing_dataset_root(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run(capsys, "dataset=cifar10")
    assert code == 2 and "needs a data folder" in err and "dataset.root" in err
    code, err = run(capsys, "dataset=cifar10", f"dataset.root={tmp_path / 'absent'}")
    assert code == 2 and "does not exist" in err and "absent" in err


def test_the_styled_digit_experiments_name_the_command_that_makes_their_tree(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The styled-digit tables' experiments read a tree the user writes first; without it the
    run stops before Flower starts, naming the folder and the command that writes it, and the
    same experiment then runs on the tree that command writes."""
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, "experiment=styled-digits-baselines")
    assert code == 2
    assert "dataset.root 'data/styled-digits' does not exist" in err
    assert "python3 -m ops.styled_digits data/styled-digits" in err
    cfg = compose_config({}, ["experiment=styled-digits-personalised", "strategy=ditto"])
    assert (cfg.dataset.root, list(cfg.dataset.domains)) == ("data/styled-digits", ["ink", "neon", "noisy", "photo"])
    assert (cfg.model.name, cfg.model.width, cfg.train.batch_size, cfg.rounds) == ("alexnet-bn", 0.125, 50, 25)
    assert cfg.eval_bn_statistics == "recompute"


def test_not_key_value(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "fedbn")
    assert code == 2 and "is not KEY=VALUE" in err


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.lrr=0.1"], "unknown key train.lrr (did you mean train.lr?); valid train keys: amp, batch_size,"),
    (["+train.lrr=0.1"], "unknown key train.lrr (did you mean train.lr?); valid train keys: amp, batch_size,"),
    (["strategy=ditto", "strategy.lamm=0.5"], "unknown key strategy.lamm (did you mean strategy.lam?); "
                                              "valid strategy keys: lam, name, personal_epochs, weighted"),
    (["lr=0.1"], "unknown key lr (did you mean train.lr or finetune.lr or personalize.lr?); valid top-level keys:"),
    (["trian.lr=0.1"], "unknown key trian (did you mean train?); valid top-level keys:"),
    (["dataset.clients_per_domian=3"], "unknown key dataset.clients_per_domian (did you mean "
                                       "dataset.clients_per_domain?)"),
])
def test_a_mistyped_key_names_the_nearest_valid_one(capsys: pytest.CaptureFixture[str], overrides: list[str],
                                                     message: str) -> None:
    """Hydra alone answers `train.lrr=0.1` with advice to add the key (`+train.lrr`), which the
    typed groups then refuse; pflower names the key, the nearest valid one and the group's keys,
    from `pflower run`, `sweep`, `tune` and `deploy`, and from a Flower run config alike."""
    for command in (["run"], ["sweep"], ["tune", "--grid", "seed=0"], ["deploy"]):
        code = cli.main([*command, *overrides])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (command, err)
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config({"overrides": " ".join(overrides)})


# ---------------------------------------------------------------- resume
def _fake_run(root: Path, strategy: str = "fedbn", rnd: int = 2, seed: int = 0) -> Path:
    composed = compose_run({"strategy": strategy, "seed": str(seed)})
    run_dir = root / "old"
    save_checkpoint(run_dir, rnd, {"global": {"w": np.zeros(2, np.float32)}},
                    {**checkpoint_identity(composed.settings, 8), "strategy_state": {}})
    return run_dir


def test_resume_of_a_missing_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run(capsys, "strategy=fedbn", f"resume={tmp_path / 'nothing'}")
    assert code == 2 and "is not a run folder" in err


def test_resume_without_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    code, err = run(capsys, "strategy=fedbn", f"resume={tmp_path / 'old'}")
    assert code == 2 and "no checkpoint at" in err


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy=fedavg"], "strategy='fedbn', this run has strategy='fedavg'"),
    (["strategy=fedbn", "model=mlp"], "model='cnn', this run has model='mlp'"),
    (["strategy=fedbn", "seed=3"], "seed=0, this run has seed=3"),
    (["strategy=fedbn", "rounds=1"], "beyond rounds=1"),
    (["strategy=fedbn", "run_name=other"], "differs from the resumed run folder 'old'"),
])
def test_resume_from_another_configuration(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           overrides: list[str], message: str) -> None:
    run_dir = _fake_run(tmp_path)
    code, err = run(capsys, *overrides, f"resume={run_dir}")
    assert code == 2 and message in err, err


def test_resume_from_a_truncated_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run_dir = _fake_run(tmp_path)
    path = run_dir / "checkpoint" / "server.npz"
    path.write_bytes(path.read_bytes()[:100])
    code, err = run(capsys, "strategy=fedbn", f"resume={run_dir}")
    assert code == 2 and "corrupt" in err and "truncated" in err


def test_resume_uses_the_run_folder(tmp_path: Path) -> None:
    """resume=<dir> makes the run write into <dir>, whatever results_root says."""
    run_dir = _fake_run(tmp_path)
    cfg = compose_config({"strategy": "fedbn", "results-root": "/somewhere/else"}, [f"resume={run_dir}"])
    assert (cfg.run_name, cfg.results_root) == ("old", str(tmp_path.resolve()))
    with pytest.raises(ConfigError, match="leave run_name out when resuming"):
        compose_config({"strategy": "fedbn", "run-name": "x"}, [f"resume={run_dir}"])


def test_strategy_that_needs_its_own_model_gets_it_or_a_clear_error():
    from common.config import ConfigError, compose_config

    assert compose_config({"strategy": "fdse"}).model.name == "fdse-alexnet"
    assert compose_config({"strategy": "fdse", "model": "fdse-resnet18"}).model.name == "fdse-resnet18"
    with pytest.raises(ConfigError, match="strategy 'fdse' needs model fdse-alexnet or fdse-resnet18"):
        compose_config({"strategy": "fdse", "model": "cnn"})


def test_a_nodes_data_root_is_the_root_of_datasets_read_from_files_only() -> None:
    """A SuperNode's ``data-root`` (the Docker demo gives every node /data) is where a dataset
    read from files lies on that node; a dataset that comes with the packages ignores it,
    while a ``dataset.root`` the user sets on such a dataset is refused (test above)."""
    from types import SimpleNamespace

    from client.handlers import client_config

    def on_node(run_config: dict[str, str]) -> str:
        context = SimpleNamespace(run_config=run_config, node_config={"data-root": "/data"})
        return str(client_config(context).cfg.dataset.root)   # type: ignore[arg-type]

    assert on_node({}) == "" and on_node({"dataset": "mnist5k-rotated"}) == ""
    assert on_node({"dataset": "mnist"}) == "/data" and on_node({"dataset": "fashion-mnist"}) == "/data"
    assert compose_config({"dataset": "mnist"}, ["dataset.root=/mine"], node_root="/data").dataset.root == "/data"


def test_the_method_registry_is_the_yaml_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every YAML of conf/strategy/ is a method whose row names importable classes; the row is
    not an option (the composed config drops it, an override of it is refused); a YAML
    without a row, or with a mistyped key in it, fails with the file to fix."""
    import importlib

    from common import methods

    names = methods.method_names()
    assert names == group_options("strategy") and len(names) == 13
    for name in names:
        row = methods.method(name)
        for path in (row.server, row.client, row.options, *(v.server for _, v in row.variants)):
            module, attr = path.split(":")
            assert hasattr(importlib.import_module(module), attr), (name, path)
        assert methods.ROW_KEY not in compose_config({"strategy": name}).strategy
    with pytest.raises(ConfigError, match="not an option"):
        compose_config({"strategy": "fedavg"}, ["strategy._method_.server=x:Y"])
    with pytest.raises(ValueError, match="unknown strategy 'fedavgg'; valid: ditto, fdse"):
        methods.method("fedavgg")
    with pytest.raises(ValueError, match=r"'strategies.nope:X', named in a conf/strategy/\*.yaml _method_ row, "
                                         "cannot be imported"):
        methods.load_named("strategies.nope:X")

    monkeypatch.setattr(methods, "STRATEGY_DIR", tmp_path)
    methods._method_row.cache_clear()
    try:
        (tmp_path / "mine.yaml").write_text("name: mine\nweighted: true\n")
        with pytest.raises(ValueError, match=r"conf/strategy/mine.yaml has no _method_ block"):
            methods.method("mine")
        methods._method_row.cache_clear()
        (tmp_path / "mine.yaml").write_text("name: mine\n_method_:\n  server: a:B\n  client: c:D\n  role: all-shared\n")
        with pytest.raises(ValueError, match=r"mine.yaml: unknown key\(s\) \['role'\] in _method_"):
            methods.method("mine")
    finally:
        methods._method_row.cache_clear()
