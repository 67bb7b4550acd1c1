"""``pflower compare`` puts runs in one row only when their composed configurations differ in
nothing but the seed and where the run goes, and labels each row by what sets it apart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import yaml

from common.config import ADDED_GROUPS
from ops.compare import compare_runs

REPO = Path(__file__).resolve().parent.parent


def _run(root: Path, name: str, seed: int, accs: list[float], lam: float | None, where: str = "results") -> Path:
    d = root / name
    d.mkdir()
    summary = {"strategy": "ditto", "dataset": "digits", "model": "mlp", "seed": seed,
               "accuracy_mean": float(np.mean(accs)), "accuracy_min": float(min(accs)),
               "clients": {str(i): {"accuracy": a} for i, a in enumerate(accs)}}
    (d / "summary.json").write_text(json.dumps(summary))
    config = {"run_name": name, "seed": seed, "results_root": where, "rounds": 5,
              "dataset": {"name": "digits", "root": f"/data/{where}"},
              "strategy": {"name": "ditto", **({"lam": lam} if lam is not None else {})}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    return d


def _row(table: str, label: str) -> list[str]:
    return next(line for line in table.splitlines() if line.startswith(f"| {label} |")).split(" | ")


def test_runs_that_differ_in_a_setting_are_rows_apart_and_labelled_by_it(tmp_path: Path) -> None:
    dirs = [_run(tmp_path, "a-s0", 0, [0.5, 0.7], 0.1), _run(tmp_path, "a-s1", 1, [0.6, 0.8], 0.1, where="other"),
            _run(tmp_path, "b-s0", 0, [0.2, 0.4], 0.01), _run(tmp_path, "c-s0", 0, [0.9, 0.9], None)]
    table = compare_runs(dirs)
    rows = [line for line in table.splitlines() if line.startswith("| ditto")]
    assert len(rows) == 3, table
    # results_root and dataset.root say where a run goes: seeds 0 and 1 at lambda 0.1 are one row
    lam_01 = _row(table, "ditto (strategy.lam=0.1)")
    assert lam_01[3] == "0,1" and lam_01[4] == f"{np.mean([0.6, 0.7]):.4f} ± {np.std([0.6, 0.7]):.4f}"
    assert _row(table, "ditto (strategy.lam=0.01)")[4] == "0.3000"
    assert _row(table, "ditto (strategy.lam=(unset))")[4] == "0.9000"


def test_a_second_run_of_a_seed_is_left_out_and_named(tmp_path: Path) -> None:
    dirs = [_run(tmp_path, "a-s0", 0, [0.5, 0.7], 0.1), _run(tmp_path, "a-s0-rerun", 0, [0.1, 0.1], 0.1)]
    table = compare_runs(dirs)
    assert _row(table, "ditto")[3] == "0" and _row(table, "ditto")[4] == "0.6000"
    assert "Left out of `ditto`: a-s0-rerun (acc mean 0.1000), a second run of seed 0; the row has a-s0." in table


def test_a_damaged_config_is_named_and_compare_exits_2(tmp_path: Path, capsys) -> None:
    from ops.compare import print_comparison

    run = _run(tmp_path, "a-s0", 0, [0.5], 0.1)
    (run / "config.yaml").write_text("strategy: [unclosed\n")
    assert print_comparison([run]) == 2
    assert f"{run / 'config.yaml'} is not a readable config" in capsys.readouterr().err


def test_runs_without_a_config_are_grouped_by_strategy_dataset_and_model(tmp_path: Path) -> None:
    dirs = [_run(tmp_path, "a-s0", 0, [0.5], 0.1), _run(tmp_path, "b-s1", 1, [0.7], 0.01)]
    for d in dirs:
        (d / "config.yaml").unlink()
    assert _row(compare_runs(dirs), "ditto")[3] == "0,1"


def test_the_printed_command_gives_the_fashion_mnist_rows_of_fedora_md() -> None:
    """docs/methods/fedora.md: each row of the Rotated Fashion-MNIST tables is a row of
    ``pflower compare docs/runs/fedora-rotated-fashion-mnist/*``, Ditto's lambdas apart."""
    page = (REPO / "docs/methods/fedora.md").read_text()
    assert "pflower compare docs/runs/fedora-rotated-fashion-mnist/*" in page
    page = page.split("### The paper's Rotated Fashion-MNIST")[1].split("\n### ")[0]   # its section
    table = compare_runs(sorted((REPO / "docs/runs/fedora-rotated-fashion-mnist").iterdir()))
    page_rows = {"fedavg": "| FedAvg | 0, 1, 2 |", "fedavg-ft": "| FedAvg+FT (5 epochs at 0.01) | 0, 1, 2 |",
                 "fedprox-ft": "| FedProx+FT (5 epochs at 0.01) | 0, 1, 2 |", "local": "| Local | 0, 1, 2 |",
                 "ditto (strategy.lam=0.1)": "| Ditto (lambda 0.1, its default) | 0, 1, 2 |",
                 "fedora": "| **FEDORA** | 0, 1, 2 |", "ditto (strategy.lam=0.01)": "| Ditto, lambda 0.01 (tuned) |"}
    for label, start in page_rows.items():
        row = _row(table, label)
        line = next(x for x in page.splitlines() if x.startswith(start))
        by_seed = row[8].split(", ")
        assert f"{row[4]} ({', '.join(by_seed)})" in line, (label, row[4], line)
        assert row[5] in line, (label, row[5], line)
    assert _row(table, "ditto (strategy.lam=1)")[3] == "0"
    assert re.search(r"Left out of `ditto \(strategy.lam=0.1\)`: \S+-s0-257f26f8", table)


def test_private_runs_are_rows_of_their_own_with_the_epsilon_they_spent(tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain", 0, [0.8, 0.9], 0.1)
    private = [_run(tmp_path, f"dp-s{s}", s, [0.3, 0.4], 0.1) for s in (0, 1)]
    for d in private:
        config = yaml.safe_load((d / "config.yaml").read_text())
        config["privacy"] = {**ADDED_GROUPS["privacy"], "dp": "central", "noise_multiplier": 0.3}
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        summary = json.loads((d / "summary.json").read_text())
        summary["privacy"] = {"dp": "central", "epsilon": 180.47998, "delta": 1e-5}
        (d / "summary.json").write_text(json.dumps(summary))
    table = compare_runs([plain, *private])
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    column = cells(table.splitlines()[0]).index("DP epsilon (delta)")
    rows = {cells(line)[0]: cells(line) for line in table.splitlines() if line.startswith("| ditto")}
    assert len(rows) == 2, table
    dp_row = next(r for label, r in rows.items() if "privacy.dp=central" in label)
    plain_row = next(r for label, r in rows.items() if "privacy.dp=central" not in label)
    assert dp_row[column] == "180.5 (1e-05)" and dp_row[3] == "0,1"
    assert plain_row[column] == "none"
    # a run from before the privacy group is the plain run's configuration: one row with it
    later = _run(tmp_path, "later", 1, [0.7, 0.8], 0.1)
    config = yaml.safe_load((later / "config.yaml").read_text())
    (later / "config.yaml").write_text(yaml.safe_dump({**config, "privacy": ADDED_GROUPS["privacy"]}))
    assert "| ditto (privacy.dp=none) | digits | mlp | 0,1 |" in \
        compare_runs([plain, later, *private])


def test_the_dp_column_names_record_level_dp_by_its_largest_client_epsilon() -> None:
    from ops.compare import privacy_text

    runs = [{"privacy": {"epsilon": 12.5, "delta": 1e-5}, "record_dp": {"epsilon_max": 3.25, "delta": 1e-5}},
            {"record_dp": {"epsilon_max": 4.0, "delta": 1e-5}}]
    assert privacy_text(runs) == "12.5 (1e-05), record 3.25 (1e-05), record 4 (1e-05)"
    assert privacy_text([{}]) == "none"
