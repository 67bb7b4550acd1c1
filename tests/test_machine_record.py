"""What a run records of the machine its numbers came from, and what `pflower compare` shows of it.

Why it matters: the same code, seed and data give bit-identical runs on one machine, but the
instruction set torch's CPU kernels use (AVX512 or AVX2) changes the last bits of every
matmul, and 500 rounds turn that into a few test images (docs/reliability.md). A virtual
machine's CPU model often reads only "AMD EPYC", so the summary names the instruction set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_method_contract import _federate, _run_config

from ops.compare import compare_runs
from server.summary import machine_description


def test_the_summary_names_the_instruction_set_torch_used() -> None:
    machine = machine_description("cpu")
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability() != ""
    assert machine["gpu"] is None and machine["torch"] == torch.__version__


def test_compare_tells_runs_on_two_instruction_sets_apart(tmp_path: Path) -> None:
    def run(seed: int, machine: dict[str, object]) -> Path:
        d = tmp_path / f"local-s{seed}"
        d.mkdir()
        d.joinpath("summary.json").write_text(json.dumps({
            "strategy": "local", "dataset": "d", "model": "m", "seed": seed, "accuracy_mean": 0.5,
            "accuracy_min": 0.4, "clients": {"0": {"accuracy": 0.5}}, "machine": machine}))
        return d

    epyc = {"gpu": None, "cpu": "AMD EPYC", "torch": "2.14.1"}
    text = compare_runs([run(0, {**epyc, "cpu_capability": "AVX512"}), run(1, {**epyc, "cpu_capability": "AVX2"}),
                         run(2, epyc)])
    header, _, row = text.splitlines()[:3]
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")],
                     [c.strip() for c in row.strip("|").split("|")], strict=True))
    # a summary written before the instruction set was recorded shows the CPU model alone
    assert cells["machine"] == "AMD EPYC (AVX2), torch 2.14.1; AMD EPYC (AVX512), torch 2.14.1; AMD EPYC, torch 2.14.1"


@pytest.mark.usefixtures("flower_task")
def test_a_resume_on_another_instruction_set_says_so_and_one_on_the_same_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import server.loop
    from server.checkpoint import load_checkpoint

    here = machine_description("cpu")["cpu_capability"]
    _federate(_run_config("fedavg", [], tmp_path, "run", rounds=1), 1)
    _, _, meta = load_checkpoint(tmp_path / "run", {})
    assert meta["cpu_capability"] == here
    with caplog.at_level("WARNING"):
        _federate(_run_config("fedavg", [], tmp_path, "run", 2, resume=tmp_path / "run"), 2)
    assert "CPU kernels use" not in caplog.text

    monkeypatch.setattr(server.loop, "cpu_capability", lambda: "AVX2" if here != "AVX2" else "AVX512")
    with caplog.at_level("WARNING"):
        _federate(_run_config("fedavg", [], tmp_path, "run", 3, resume=tmp_path / "run"), 3)
    assert f"the checkpoint's machine used {here}" in caplog.text and "resuming" in caplog.text
    assert load_checkpoint(tmp_path / "run", {})[0] == 3
