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


def _rounds(tmp_path: Path, name: str, every: int) -> list[dict]:
    run = f"{name}-every{every}"
    _federate(_run_config(name, [f"finetune.every={every}", "eval_every=1"], tmp_path, run, rounds=3), 1)
    return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("flower_task")
@pytest.mark.parametrize("name", ["fedavg-ft", "fedbabu"])
def test_fine_tuning_only_at_the_final_evaluation_gives_the_same_final_result(tmp_path: Path, name: str) -> None:
    """Fine-tuning evaluates, it never trains the federation: fine-tuning at every round or
    only at the last gives bit-identical final numbers, and the rounds that did not
    fine-tune are flagged and never chosen as the best round."""
    from server.summary import best_round_candidates

    every, final = _rounds(tmp_path, name, 1), _rounds(tmp_path, name, 0)
    assert every[-1]["clients"] == final[-1]["clients"]
    assert [r["evaluate"]["finetuned_mean"] for r in final] == [0.0, 0.0, 1.0]
    assert [r["evaluate"]["finetuned_mean"] for r in every] == [1.0, 1.0, 1.0]
    assert "ft_accuracy_mean" not in final[0]["evaluate"] and "ft_accuracy_mean" in final[-1]["evaluate"]
    assert [r["round"] for r in best_round_candidates(final)] == [3]
    assert [r["round"] for r in best_round_candidates(every)] == [1, 2, 3]
