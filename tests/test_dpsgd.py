"""Record-level DP-SGD of a client's local training (``privacy.record_dp=dpsgd``, Opacus;
docs/privacy.md): one step's update against per-example gradients clipped by hand, the noise's
scale by a statistical test with a fixed seed, the epsilon against dp-accounting's own RDP
computation of the same schedule, the refusals, and a real run whose clients' epsilons grow
round by round in metrics.jsonl and summary.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from common.config import ConfigError, compose_config, compose_run, validate_config
from common.methods import method, method_names
from learning.dpsgd import DPSGDConfig, epsilon_of, model_problems
from learning.training import OptimConfig, train_epochs


def _data(n: int = 32, d: int = 20, classes: int = 10, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g) * 3, torch.randint(0, classes, (n,), generator=g))


def _clipped_mean_gradient(model: nn.Module, data: TensorDataset, clip: float) -> dict[str, torch.Tensor]:
    """The slow, obvious per-example clipping: one backward per example, each example's whole
    gradient scaled to norm <= clip, averaged over the batch."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for x, y in zip(*data.tensors, strict=True):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[None]), y[None]).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
        for n, g in grads.items():
            total[n] += g * min(1.0, clip / float(norm))
    return {n: t / len(data) for n, t in total.items()}


def test_one_step_is_the_mean_of_the_clipped_per_example_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Linear(20, 10)
    data = _data()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = _clipped_mean_gradient(model, data, clip=0.5)
    lr = 0.1
    metrics = train_epochs(model, data, OptimConfig(lr=lr, batch_size=len(data)), torch.device("cpu"),
                           dpsgd=DPSGDConfig(noise_multiplier=1e-9, max_grad_norm=0.5, delta=1e-5))
    assert metrics["dpsgd_steps"] == 1 and metrics["dpsgd_sample_rate"] == 1.0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] - lr * expected[n], atol=1e-6, rtol=1e-5)
    # and the clipping did something: the unclipped mean step is elsewhere
    unclipped = _clipped_mean_gradient(nn.Linear(20, 10).requires_grad_(), data, clip=1e9)
    assert any(not torch.allclose(expected[n], unclipped[n]) for n in expected)


def test_the_noise_has_std_noise_multiplier_times_clip_over_the_batch() -> None:
    torch.manual_seed(1)
    model = nn.Linear(40, 10)
    data = _data(n=16, d=40)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = _clipped_mean_gradient(model, data, clip=1.0)
    z, clip, lr = 2.0, 1.0, 1.0
    train_epochs(model, data, OptimConfig(lr=lr, batch_size=len(data)), torch.device("cpu"), seed=3,
                 dpsgd=DPSGDConfig(noise_multiplier=z, max_grad_norm=clip, delta=1e-5))
    # the update minus the clipped mean step is the noise, N(0, (z C / B)^2) per coordinate
    noise = torch.cat([((before[n] - lr * expected[n]) - p.detach()).ravel() for n, p in model.named_parameters()])
    std = float(noise.std()) * len(data) / lr
    # 410 draws: the sample std is within 10% of z C with probability > 0.99 (its relative sd is ~3.5%)
    assert abs(std - z * clip) < 0.1 * z * clip, std
    assert abs(float(noise.mean())) * len(data) < 0.2 * z * clip


@pytest.mark.parametrize(("z", "q", "steps"), [(1.0, 0.01, 1000), (0.8, 0.1, 50), (2.0, 1.0, 10)])
def test_epsilon_equals_dp_accountings_rdp_computation(z: float, q: float, steps: int) -> None:
    accountant = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)) if q < 1 else \
        dp_accounting.GaussianDpEvent(z)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    theirs = accountant.get_epsilon(1e-5)
    # two trainings of half the steps compose to the same
    ours = epsilon_of([(z, q, steps // 2), (z, q, steps - steps // 2)], 1e-5)
    assert ours == pytest.approx(theirs, rel=0.02)
    assert epsilon_of([], 1e-5) == 0.0


def test_a_batchnorm_model_is_what_opacus_refuses() -> None:
    assert model_problems(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), ) == []
    assert model_problems(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    with pytest.raises(ValueError, match="adds a loss term"):
        train_epochs(nn.Linear(20, 10), _data(), OptimConfig(lr=0.1, batch_size=8), torch.device("cpu"),
                     extra_loss=lambda m, x, y, logits: logits.sum() * 0,
                     dpsgd=DPSGDConfig(1.0, 1.0, 1e-5))


@pytest.mark.parametrize("name", [n for n in method_names() if method(n).no_record_dp])
def test_a_method_whose_training_is_not_one_per_example_loss_refuses_dpsgd(name: str) -> None:
    with pytest.raises(ConfigError, match=f"privacy.record_dp=dpsgd does not apply to {name}: "):
        validate_config(compose_config(overrides=[f"strategy={name}", "privacy.record_dp=dpsgd",
                                                  *([] if method(name).models else ["model=mlp"])]))


def test_a_model_opacus_cannot_train_and_mixed_precision_are_refused() -> None:
    with pytest.raises(ConfigError, match="Opacus cannot train model=cnn: BatchNorm cannot support"):
        validate_config(compose_config(overrides=["privacy.record_dp=dpsgd"]))
    with pytest.raises(ConfigError, match="without train.amp and train.compile"):
        validate_config(compose_config(overrides=["privacy.record_dp=dpsgd", "model=mlp", "train.amp=true"]))
    validate_config(compose_config(overrides=["privacy.record_dp=dpsgd", "model=mlp"]))


def _federate(root: Path, run: str, rounds: int, extra: str = "") -> tuple[Any, Any, Any]:
    """A run through the real loop and ClientApp over a fake grid (as the contract test)."""
    from flwr.app import Context, MessageType, RecordDict
    from helpers import FakeGrid

    from client import app as client_app
    from learning.datasets.federated import load_federated_data
    from server.app import build_strategy
    from server.loop import run_federation
    from server.results import RunRecorder

    run_config = {"strategy": "fedavg", "rounds": str(rounds), "results-root": str(root), "run-name": run,
                  "overrides": "model=mlp dataset.clients_per_domain=1 dataset.new_clients_per_domain=0 "
                               "fraction_train=1.0 privacy.record_dp=dpsgd privacy.record_noise_multiplier=1.1 "
                               + extra}
    composed = compose_run(run_config)
    cfg = composed.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    contexts = {c: Context(run_id=1, node_id=int(c) + 1, node_config={"partition-id": int(c), "num-partitions": 4},
                           state=RecordDict(), run_config=run_config) for c in data.client_ids}

    def handler(cid: str, msg: Any) -> Any:
        kind = client_app.train if msg.metadata.message_type == MessageType.TRAIN else client_app.evaluate
        return kind(msg, contexts[cid])

    strategy = build_strategy(cfg, data)
    run_federation(strategy, FakeGrid(data.client_ids, handler), composed.settings, RunRecorder(cfg, composed.settings))
    return strategy, cfg, data


@pytest.mark.usefixtures("flower_task")
def test_the_noise_is_secret_unless_a_noise_seed_fixes_it(tmp_path: Path) -> None:
    runs = {name: _federate(tmp_path, name, 1, extra)[0].global_arrays
            for name, extra in (("a", ""), ("b", ""), ("c", "privacy.noise_seed=5"), ("d", "privacy.noise_seed=5"))}
    assert any(not np.array_equal(runs["a"][k], runs["b"][k]) for k in runs["a"])   # the OS's randomness
    assert all(np.array_equal(runs["c"][k], runs["d"][k]) for k in runs["c"])       # reproducible


@pytest.mark.usefixtures("flower_task")
def test_each_clients_epsilon_grows_with_its_trainings_and_reaches_the_summary(tmp_path: Path) -> None:
    from server.app import record_dp_summary

    _, cfg, data = _federate(tmp_path, "run", 2)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, second = (r["record_dp"]["epsilon"] for r in rounds)
    assert sorted(first) == sorted(data.client_ids) and all(second[c] > first[c] > 0 for c in first)
    # each client's epsilon is its two trainings composed (its sampling rate and steps)
    for c in data.client_ids:
        n = data.clients[c].num_train
        q = min(1.0, int(cfg.train.batch_size) / n)
        steps = int(cfg.train.local_epochs) * int(np.ceil(n / int(cfg.train.batch_size)))
        ledger = (tmp_path / "run" / "client_state" / c / "dpsgd-ledger.jsonl").read_text().splitlines()
        assert [json.loads(e)["round"] for e in ledger] == [1, 2]
        assert second[c] == pytest.approx(epsilon_of([(1.1, q, json.loads(e)["steps"]) for e in ledger], 1e-5))
        assert abs(json.loads(ledger[0])["steps"] - steps) <= 1     # the last, partial batch dropped or not
    assert record_dp_summary(rounds)["epsilon_max"] == max(second.values())
