"""FedProx+FT is FedProx's training plus FedAvg+FT's evaluation: the proximal term is in its
training and the fine-tuned accuracy in its evaluation (neither in the other two)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_method_contract import _federate, _run_config


def _last_round(tmp_path: Path, name: str) -> dict:
    _federate(_run_config(name, ["strategy.mu=0.1"] if "prox" in name else [], tmp_path, name, rounds=1), 1)
    return json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.usefixtures("flower_task")
def test_fedprox_ft_trains_proximally_and_fine_tunes_at_evaluation(tmp_path: Path) -> None:
    both, prox, ft = (_last_round(tmp_path, n) for n in ("fedprox-ft", "fedprox", "fedavg-ft"))
    assert both["train"]["proximal"] > 0 and prox["train"]["proximal"] > 0
    assert "proximal" not in ft["train"]
    for cid, m in both["clients"].items():
        assert 0.0 <= m["ft_accuracy"] <= 1.0 and "ft_accuracy" in ft["clients"][cid]
        assert "ft_accuracy" not in prox["clients"][cid]
