"""The best round is chosen on validation accuracy: the mean over clients by default, or
weighted by each client's validation size (``best_round_by=weighted``, as flgo-based code such
as FDSE's selects); R-Acc/PTR can be read at each run's best-validation round (FEDORA's
authors)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_method_contract import _federate, _run_config

from common.config import ConfigError, compose_config, compose_run
from learning.datasets.federated import load_federated_data
from server.summary import build_summary
from strategies.replies import summarise_clients


def _slow_weighted(clients: dict[str, dict[str, float]]) -> float:
    num = sum(m["val_accuracy"] * m["num-val-examples"] for m in clients.values())
    return num / sum(m["num-val-examples"] for m in clients.values())


def test_weighted_validation_accuracy_is_the_pooled_validation_accuracy() -> None:
    clients = {"0": {"val_accuracy": 0.9, "num-val-examples": 10.0, "accuracy": 0.8},
               "1": {"val_accuracy": 0.5, "num-val-examples": 90.0, "accuracy": 0.4},
               "2": {"val_accuracy": 0.7, "num-val-examples": 25.0, "accuracy": 0.6}}
    out = summarise_clients(clients)
    assert out["val_accuracy_weighted"] == pytest.approx((9 + 45 + 17.5) / 125)
    assert out["val_accuracy_mean"] == pytest.approx(0.7)
    assert "num-val-examples_mean" not in out  # a size, not a metric to average


def _round(rnd: int, vals: dict[str, tuple[float, float]], sizes: dict[str, int]) -> dict:
    """vals: client -> (test accuracy, validation accuracy)."""
    clients = {c: {"accuracy": a, "val_accuracy": v, "num-val-examples": float(sizes[c])}
               for c, (a, v) in vals.items()}
    return {"round": rnd, "clients": clients, "evaluate": summarise_clients(clients)}


def test_best_round_follows_the_configured_validation_average() -> None:
    sizes = {"0": 10, "1": 90}
    # round 1: mean val 0.75 (weighted 0.54); round 2: mean val 0.65 (weighted 0.695)
    rounds = [_round(1, {"0": (0.95, 0.95), "1": (0.5, 0.55)}, sizes),
              _round(2, {"0": (0.55, 0.6), "1": (0.7, 0.7)}, sizes),
              _round(3, {"0": (0.5, 0.5), "1": (0.5, 0.5)}, sizes)]
    info = {c: {"num_train": 5} for c in sizes}
    by_mean = build_summary(compose_run({}).settings, rounds, info, "completed")
    by_weight = build_summary(compose_run({"overrides": "best_round_by=weighted"}).settings, rounds, info, "completed")
    assert (by_mean["best_round"], by_mean["best_round_by"]) == (1, "val_accuracy_mean")
    assert (by_weight["best_round"], by_weight["best_round_by"]) == (2, "val_accuracy_weighted")
    assert by_weight["best_val_accuracy"] == pytest.approx((0.6 * 10 + 0.7 * 90) / 100)
    assert by_mean["best_clients"] == {"0": 0.95, "1": 0.5}
    assert by_weight["best_clients"] == {"0": 0.55, "1": 0.7}
    assert by_weight["accuracy_mean"] == 0.5  # the final round is still reported


def test_an_unknown_best_round_rule_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="best_round_by must be mean .* or weighted"):
        compose_config({"overrides": "best_round_by=median"})


def test_compare_reads_r_acc_and_ptr_at_the_best_validation_round(tmp_path: Path) -> None:
    from ops.compare import compare_runs

    def run(name: str, strategy: str, final: list[float], best: list[float]) -> Path:
        d = tmp_path / name
        d.mkdir()
        d.joinpath("summary.json").write_text(json.dumps({
            "strategy": strategy, "dataset": "x", "model": "mlp", "seed": 0,
            "accuracy_mean": float(np.mean(final)), "accuracy_min": min(final),
            "best_accuracy_mean": float(np.mean(best)),
            "clients": {str(i): {"accuracy": a} for i, a in enumerate(final)},
            "best_clients": {str(i): a for i, a in enumerate(best)}}))
        return d

    table = compare_runs([run("l", "local", [0.5, 0.5], [0.6, 0.4]),
                          run("f", "fedora", [0.6, 0.4], [0.6, 0.8])])
    header, _, *rows = table.splitlines()
    assert "R-Acc @ best val" in header and "PTR @ best val" in header
    fedora = next(r for r in rows if r.startswith("| fedora")).split(" | ")
    # final: (0.2 - 0.2) / 2 = 0, PTR 1/2; best: (0 + 1.0) / 2 = 0.5, PTR 1/2
    assert fedora[-4:] == ["0.0000", "0.5000", "0.5000", "0.5000 |"]


@pytest.mark.usefixtures("flower_task")
def test_a_run_reports_validation_sizes_and_picks_the_round_by_weighted_accuracy(tmp_path: Path) -> None:
    _, _, composed = _federate(_run_config("fedavg", ["best_round_by=weighted"], tmp_path, "w", rounds=2), 1)
    cfg = composed.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    rounds = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    for r in rounds:
        for cid, m in r["clients"].items():
            assert m["num-val-examples"] == len(data.clients[cid].val)
        assert r["evaluate"]["val_accuracy_weighted"] == pytest.approx(_slow_weighted(r["clients"]))
    summary = build_summary(composed.settings, rounds, {c: {"num_train": 1} for c in data.client_ids}, "completed")
    best = max(rounds, key=lambda r: _slow_weighted(r["clients"]))
    assert summary["best_round"] == best["round"] and summary["best_round_by"] == "val_accuracy_weighted"
    assert summary["best_clients"] == {c: m["accuracy"] for c, m in best["clients"].items()}


def test_compare_reads_the_best_round_from_metrics_when_the_summary_predates_it(tmp_path: Path) -> None:
    from ops.compare import client_accuracies

    d = tmp_path / "old"
    d.mkdir()
    d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"round": 1, "clients": {"0": {"accuracy": 0.3}, "1": {"accuracy": 0.4}}},
        {"round": 2, "clients": {"0": {"accuracy": 0.9}, "1": {"accuracy": 0.6}}},
        {"round": 3, "clients": {"0": {"accuracy": 0.5}, "1": {"accuracy": 0.5}}}]))
    old = {"_dir": str(d), "best_round": 2, "clients": {"0": {"accuracy": 0.5}, "1": {"accuracy": 0.5}}}
    assert client_accuracies(old, "best") == {"0": 0.9, "1": 0.6}
    assert client_accuracies(old, "final") == {"0": 0.5, "1": 0.5}
    assert client_accuracies({"_dir": str(tmp_path / "gone"), "best_round": 2, "clients": {}}, "best") == {}
