"""The README's main job, end to end: `pflower run` through `flwr run` on a private SuperLink."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from helpers import pflower


@pytest.mark.e2e
def test_pflower_run_writes_results_and_leaves_no_process(tmp_path):
    proc = pflower("run", "strategy=fedavg-ft", "rounds=2", "run_name=e2e", f"results_root={tmp_path}",
                    "finetune.epochs=1", "finetune.curve=true", "finetune.curve_epochs=[0,1,2]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "e2e"
    summary = json.loads((run / "summary.json").read_text())
    for key in ("strategy", "dataset", "rounds", "accuracy_mean", "accuracy_min", "accuracy_std", "clients"):
        assert key in summary
    assert summary["strategy"] == "fedavg-ft" and summary["rounds"] == 2
    assert set(summary["clients"]) == {str(i) for i in range(8)}
    for c in summary["clients"].values():
        assert 0.0 <= c["accuracy"] <= 1.0 and c["num_train"] > 0
    accs = [c["accuracy"] for c in summary["clients"].values()]
    assert summary["accuracy_mean"] == pytest.approx(sum(accs) / len(accs))
    assert summary["accuracy_min"] == pytest.approx(min(accs))
    assert set(summary["finetune_curve"]) == {"0", "1", "2"}
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]
    assert all(len(x["clients"]) == 8 for x in lines), "every round must evaluate every client"
    assert all(sum(x["communication"]["bytes_up"].values()) > 0 for x in lines)
    for name in ("config.yaml", "accuracy.png", "clients.png", "finetune_curve.png"):
        assert (run / name).exists(), name
    assert "strategy:" in (run / "config.yaml").read_text()
    # every process the command started is gone
    workdir = re.search(r"work dir (\S+)\)", proc.stdout).group(1)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert workdir not in ps, "a Flower process of this run is still running"
    # compare turns the run folder into a table
    cmp = pflower("compare", str(run), "--out", str(tmp_path / "t.md"), "--plot", str(tmp_path / "t.png"))
    assert cmp.returncode == 0 and "| fedavg-ft | digits-domains |" in cmp.stdout
    assert (tmp_path / "t.png").exists()


def test_unknown_names_fail_before_anything_starts(tmp_path):
    proc = pflower("run", "strategy=fedsgd", f"results_root={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert "unknown strategy 'fedsgd'" in proc.stderr and "fedavg" in proc.stderr
    assert "SuperLink" not in proc.stdout
    proc = pflower("run", "dataset=pacs", f"results_root={tmp_path}", timeout=120)
    assert proc.returncode == 2 and "dataset.root" in proc.stderr
