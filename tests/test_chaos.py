"""The chaos run at its CI size (``bench/chaos.py``): a seeded schedule of SIGKILL and
SIGSTOP/SIGCONT to random processes of a simulation and of a loopback deployment, and every
run ends complete with the numbers of its fault-free twin (or a client's failure that the
round records), through pflower's own recovery or the resume command it printed. The long
run's figures are in docs/reliability.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chaos


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["sim", "deploy"])
def test_random_kills_and_pauses_lose_no_run_and_change_no_number(mode: str, tmp_path: Path) -> None:
    code = chaos.main(["--methods", "fedavg", "--modes", mode, "--rounds", "15", "--faults", "5",
                       "--gap", "0.5,4", "--seed", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "chaos.json").read_text())
    (run,) = report["runs"]
    assert code == 0 and run["completed"] and run["outcome"] in ("identical", "explained"), run
    assert len(report["faults"]) >= 1 and all(f["signal"] in ("SIGKILL", "SIGSTOP") for f in report["faults"])
    for attempt in run.get("failed_markers", []):
        # an attempt that ended early either said how to go on, or was pflower itself killed
        assert attempt["FAILED"] or attempt["resume_printed"] or attempt["exit"] == -9, attempt
