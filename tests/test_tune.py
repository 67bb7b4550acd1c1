"""``pflower tune``: each method's grid at one seed, the best on validation accuracy (never
test accuracy), then the seeds at the chosen values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import pflower

from common.config import ConfigError
from ops.running import RunOptions
from ops.tune import GridAxis, grid_for, select_best, tune, tuning_table


def test_grid_axes_parse_and_apply_to_their_strategy() -> None:
    lr = GridAxis.parse("train.lr=0.01,0.1")
    mu = GridAxis.parse("fedprox:strategy.mu=0.01,1")
    assert (lr.key, lr.values, lr.strategy) == ("train.lr", ("0.01", "0.1"), None)
    assert (mu.key, mu.strategy) == ("strategy.mu", "fedprox")
    assert grid_for("fedavg", [lr, mu]) == [["train.lr=0.01"], ["train.lr=0.1"]]
    assert grid_for("fedprox", [lr, mu]) == [["train.lr=0.01", "strategy.mu=0.01"], ["train.lr=0.01", "strategy.mu=1"],
                                             ["train.lr=0.1", "strategy.mu=0.01"], ["train.lr=0.1", "strategy.mu=1"]]
    assert grid_for("fedavg", []) == [[]]
    for bad in ("train.lr", "train.lr=", "=0.1"):
        with pytest.raises(ConfigError, match=r"\[STRATEGY:\]KEY=V1,V2"):
            GridAxis.parse(bad)


def test_the_best_validation_accuracy_wins_and_a_tie_goes_to_the_first() -> None:
    assert select_best([(["a"], 0.5), (["b"], 0.7), (["c"], 0.6)]) == (["b"], 0.7)
    assert select_best([(["a"], 0.7), (["b"], 0.7)]) == (["a"], 0.7)
    with pytest.raises(ValueError, match="every run of the grid failed"):
        select_best([])


class FakeRuns:
    """Stands in for ``run_or_reuse``: writes a summary whose validation accuracy peaks at
    lr 0.05 (fedavg) or 0.01 (fedbn) while test accuracy peaks elsewhere."""

    def __init__(self, root: Path) -> None:
        self.root, self.calls = root, []

    def __call__(self, combo: list[str], options: RunOptions, who: str) -> tuple[Path | None, bool]:
        self.calls.append(combo)
        values = dict(o.split("=", 1) for o in combo)
        lr, strategy = float(values["train.lr"]), values["strategy"]
        best = 0.05 if strategy == "fedavg" else 0.01
        folder = self.root / "-".join(o.replace("=", "_") for o in combo)
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"best_val_accuracy": 0.9 - abs(lr - best),
                                                         "accuracy_mean": lr}))
        return folder, False

    def all(self, combos: list[list[str]], options: RunOptions, who: str) -> list[tuple[Path | None, bool]]:
        """As ``ops/sweep.py``'s ``run_all`` one at a time (a batch of ``run_or_reuse`` calls)."""
        return [self(c, options, who) for c in combos]


def test_each_strategy_is_tuned_on_validation_then_run_at_its_choice_for_every_seed(tmp_path: Path) -> None:
    runs = FakeRuns(tmp_path)
    choices, seed_runs, failures = tune(["strategy=fedavg,fedbn", "rounds=2"], [GridAxis.parse("train.lr=0.01,0.05,0.1")],
                                        [0, 1, 2], 7, RunOptions(), runs.all)
    assert failures == 0
    assert [c["chosen"] for c in choices] == [["train.lr=0.05"], ["train.lr=0.01"]]   # not the test optimum 0.1
    assert all(c[-1] == "seed=7" for c in runs.calls[:6])        # first every grid run, at the tuning seed
    assert runs.calls[6:9] == [["strategy=fedavg", "rounds=2", "train.lr=0.05", f"seed={s}"] for s in (0, 1, 2)]
    assert runs.calls[9:] == [["strategy=fedbn", "rounds=2", "train.lr=0.01", f"seed={s}"] for s in (0, 1, 2)]
    assert len(seed_runs) == 6
    table = tuning_table(choices)
    assert "train.lr=0.05" in table and "(seed 7)" in table and "0.9000" in table


def test_seeds_come_from_the_option_and_validation_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--seeds"):
        tune(["strategy=fedavg", "seed=0"], [], [0], 0, RunOptions(), FakeRuns(tmp_path).all)

    def no_validation(combos: list[list[str]], options: RunOptions, who: str) -> list[tuple[Path | None, bool]]:
        folder = tmp_path / "noval"
        folder.mkdir(exist_ok=True)
        (folder / "summary.json").write_text(json.dumps({"accuracy_mean": 0.5}))
        return [(folder, False) for _ in combos]

    with pytest.raises(ConfigError, match="dataset.val_fraction > 0"):
        tune(["strategy=fedavg"], [GridAxis.parse("train.lr=0.1")], [0], 0, RunOptions(), no_validation)


def test_a_method_whose_grid_all_failed_is_skipped_and_the_others_go_on(tmp_path: Path) -> None:
    runs = FakeRuns(tmp_path)

    def fedbn_fails(combos: list[list[str]], options: RunOptions, who: str) -> list[tuple[Path | None, bool]]:
        return [(None, False) if "strategy=fedbn" in c else runs(c, options, who) for c in combos]

    choices, seed_runs, failures = tune(["strategy=fedbn,fedavg"], [GridAxis.parse("train.lr=0.01,0.05")], [0, 1], 7,
                                        RunOptions(), fedbn_fails)
    assert [c["strategy"] for c in choices] == ["fedavg"]
    assert failures == 2                                          # fedbn's two grid runs
    assert [r.name for r in seed_runs] == ["strategy_fedavg-train.lr_0.05-seed_0", "strategy_fedavg-train.lr_0.05-seed_1"]
    assert not any("strategy=fedbn" in c for c in runs.calls)


@pytest.mark.e2e
def test_pflower_tune_runs_the_grid_and_the_seeds(tmp_path: Path) -> None:
    out = pflower("tune", "strategy=fedavg", "rounds=1", "dataset.clients_per_domain=1", f"results_root={tmp_path}",
                  "--grid", "train.lr=0.01,0.1", "--seeds", "0,1", "--tune-seed", "0", "--out",
                  str(tmp_path / "table.md"), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    choices = json.loads((tmp_path / "tuning.json").read_text())
    assert len(choices) == 1 and len(choices[0]["grid"]) == 2
    scores = {tuple(g["overrides"]): g["val_accuracy"] for g in choices[0]["grid"]}
    assert choices[0]["val_accuracy"] == max(scores.values())
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 3     # two grid runs at seed 0 (one reused for seed 0), one more seed
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("Tuned on validation accuracy:") and choices[0]["chosen"][0] in table
