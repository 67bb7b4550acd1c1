"""GPU by default: simulated clients get a GPU share when CUDA is present (Ray hides the
GPU from actors that reserve none), and ``device=cuda`` that cannot work is refused early."""

from __future__ import annotations

import pytest
import torch
from helpers import pflower

from common.config import ConfigError, compose_run
from ops.resources import ACTORS_PER_GPU, gpu_share, resolve_gpu_share


@pytest.mark.parametrize(("clients", "gpus", "cpus", "per_client", "expected"), [
    (8, 0, 16, 1.0, 0.0),        # no GPU: nothing to share
    (8, 1, 16, 1.0, 1 / 8),      # 8 clients fit at once on 16 cores: an eighth each
    (3, 1, 16, 1.0, 1 / 3),      # only 3 clients: a third each
    (8, 1, 2, 1.0, 1 / 2),       # 2 cores run 2 clients at once: half a GPU each
    (100, 1, 64, 1.0, 1 / ACTORS_PER_GPU),   # never more than ACTORS_PER_GPU per GPU
    (18, 2, 16, 1.0, 1 / 8),     # 16 at once over 2 GPUs
])
def test_gpu_share(clients, gpus, cpus, per_client, expected):
    assert gpu_share(clients, gpus, cpus, per_client) == pytest.approx(expected)


def _pretend_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_cuda_machine_gives_clients_a_share_unless_told(monkeypatch):
    cfg = compose_run({}, []).settings.run.device
    _pretend_gpus(monkeypatch, 1)
    assert resolve_gpu_share(cfg, 8, None, 1.0) > 0
    assert resolve_gpu_share(cfg, 8, 0.0, 1.0) == 0.0        # --num-gpus 0: CPU on purpose
    assert resolve_gpu_share(cfg, 8, 0.5, 1.0) == 0.5
    cuda = compose_run({}, ["device=cuda"]).settings.run.device
    with pytest.raises(ConfigError, match="--num-gpus 0"):
        resolve_gpu_share(cuda, 8, 0.0, 1.0)
    _pretend_gpus(monkeypatch, 0)
    assert resolve_gpu_share(cfg, 8, None, 1.0) == 0.0
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_gpu_share(cuda, 8, None, 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_pflower_run_device_cuda_without_a_gpu_stops_before_starting(tmp_path):
    out = pflower("run", "device=cuda", "rounds=1", f"results_root={tmp_path}", timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no CUDA GPU" in out.stderr and "device=auto" in out.stderr
    assert not any(tmp_path.iterdir())   # nothing started, no run folder


def test_client_resources_beyond_the_machine_are_refused_by_name(monkeypatch):
    """A client asking for more CPUs or GPUs than the machine has never starts (Flower's Ray
    engine would build an empty actor pool and the run die after start-up)."""
    import os

    from ops.resources import check_client_resources

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    _pretend_gpus(monkeypatch, 1)
    check_client_resources(16.0, 1.0, "local")          # the whole machine per client: fine
    check_client_resources(4.0, 0.25, "local")
    with pytest.raises(ConfigError, match=r"--num-cpus 17 per client, but this machine has 16 CPUs.*--num-cpus 16"):
        check_client_resources(17.0, 0.0, "local")
    with pytest.raises(ConfigError, match=r"--num-gpus 2 per client, but this machine has 1 GPU"):
        check_client_resources(1.0, 2.0, "local")
    with pytest.raises(ConfigError, match="positive CPU share"):
        check_client_resources(0.0, 0.0, "local")
    check_client_resources(64.0, 4.0, "10.0.0.1:6379")  # a Ray cluster may have more: its own check
    # a run given a share of the machine (``--cpus``, as a parallel sweep does) is checked against it
    check_client_resources(2.0, 0.0, "local", ray_cpus=2)
    with pytest.raises(ConfigError, match=r"--num-cpus 4 per client, but this run may use 2 CPUs \(--cpus 2\).*"
                                          r"--num-cpus 2 or less"):
        check_client_resources(4.0, 0.0, "local", ray_cpus=2)
    with pytest.raises(ConfigError, match=r"--cpus 0: a run needs at least one CPU"):
        check_client_resources(1.0, 0.0, "local", ray_cpus=0)
    # Flower's client-resources-num-cpus is an integer: a fraction failed after the SuperLink started
    for address in ("local", "10.0.0.1:6379"):
        with pytest.raises(ConfigError, match=r"--num-cpus 0.5: Flower takes a whole number of CPUs.*--num-cpus 1"):
            check_client_resources(0.5, 0.0, address)


def test_pflower_run_with_more_cpus_per_client_than_the_machine_stops_before_starting(tmp_path):
    import os

    too_many = (os.cpu_count() or 1) + 1
    out = pflower("run", "rounds=1", f"results_root={tmp_path}", "--num-cpus", str(too_many), timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"--num-cpus {too_many} per client" in out.stderr
    assert not any(tmp_path.iterdir())   # nothing started, no run folder
    out = pflower("run", "rounds=1", f"results_root={tmp_path}", "--num-cpus", "0.5", timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--num-cpus 0.5: Flower takes a whole number of CPUs" in out.stderr
    assert not any(tmp_path.iterdir())
