"""Which BN statistics a personal model is tested with: by default its own, recomputed on the
client's train split (precise BN, against a slow per-batch computation), with the stored ones
measured beside; the server's model of FedAvg as the server holds it; an evaluation never
changes the client's state; a FedBasis client is evaluated as the plain network its bases
combine to; each protocol's numbers and best round in the summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from client.baselines import DittoTrainer, LocalTrainer
from client.fedbasis import FedBasisTrainer
from client.fedora import FEDORATrainer
from client.handlers import trainer_class
from client.round import ClientRound
from client.trainer import ClientTrainer
from common.config import ComposedRun, ConfigError, compose_config, compose_run
from learning.datasets.federated import load_federated_data
from learning.models import build_model
from learning.params import get_arrays, set_arrays
from learning.training import evaluate, recompute_bn_statistics
from server.summary import build_summary

CPU = torch.device("cpu")


def _batch_average(features: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The mean over batches (each weighing the same) of each channel's batch mean and unbiased
    batch variance: what BN's cumulative running statistics hold after one pass."""
    means, variances = [], []
    for start in range(0, len(features), batch_size):
        batch = features[start:start + batch_size].astype(np.float64)
        per_channel = batch.transpose(1, 0, *range(2, batch.ndim)).reshape(batch.shape[1], -1)
        means.append(per_channel.mean(axis=1))
        variances.append(per_channel.var(axis=1, ddof=1))
    return np.mean(means, axis=0), np.mean(variances, axis=0)


def test_recompute_leaves_out_a_last_batch_of_one() -> None:
    """Nine samples in batches of 4: the last batch (one sample) has no variance and a
    BatchNorm1d refuses it in train mode; the statistics are those of the first two batches.
    A model with BatchNorm2d only keeps it (three batches)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    x = torch.randn(9, 3) * 2 + 1
    recompute_bn_statistics(model, TensorDataset(x, torch.zeros(9, dtype=torch.long)), batch_size=4, device=CPU)
    with torch.no_grad():
        hidden = model[0](x[:8]).numpy()
    mean, var = _batch_average(hidden, 4)
    np.testing.assert_allclose(model[1].running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model[1].running_var.numpy(), var, rtol=1e-5, atol=1e-6)
    assert int(model[1].num_batches_tracked) == 2
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    recompute_bn_statistics(conv, TensorDataset(torch.randn(9, 1, 5, 5), torch.zeros(9, dtype=torch.long)),
                            batch_size=4, device=CPU)
    assert int(conv[1].num_batches_tracked) == 3


def test_recompute_equals_the_per_batch_average_and_leaves_the_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=0.3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    x = torch.randn(10, 2, 6, 6) * 3 + 1
    data = TensorDataset(x, torch.zeros(10, dtype=torch.long))
    for bn in (model[1], model[5]):
        bn.running_mean.fill_(7.0)                       # statistics that are not these data's
        bn.running_var.fill_(0.01)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    recompute_bn_statistics(model, data, batch_size=4, device=CPU)     # batches of 4, 4, 2
    assert not model.training and model[1].momentum == 0.3 and model[5].momentum == 0.1
    with torch.no_grad():
        conv = model[0](x).numpy()
    mean, var = _batch_average(conv, 4)
    np.testing.assert_allclose(model[1].running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model[1].running_var.numpy(), var, rtol=1e-5, atol=1e-6)
    assert int(model[1].num_batches_tracked) == 3
    # the second layer's input normalises each batch by its own statistics (train mode)
    parts = [model[4](model[3](model[2](torch.nn.functional.batch_norm(
        model[0](x[s:s + 4]), None, None, model[1].weight, model[1].bias, training=True)))).detach().numpy()
        for s in (0, 4, 8)]
    hidden = np.concatenate(parts)
    mean, var = _batch_average(hidden, 4)
    np.testing.assert_allclose(model[5].running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model[5].running_var.numpy(), var, rtol=1e-5, atol=1e-6)
    for k, v in weights.items():
        assert torch.equal(model.state_dict()[k], v), k


def _round(run: ComposedRun, cid: str = "0") -> ClientRound:
    data = load_federated_data(run.cfg.dataset, int(run.cfg.seed))
    return ClientRound(settings=run.settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=CPU, server_round=2)


@pytest.mark.parametrize("mode", ["stored", "recompute"])
def test_a_ditto_client_evaluates_its_personal_model_with_the_chosen_statistics(mode: str) -> None:
    run = compose_run({"strategy": "ditto"}, [f"eval_bn_statistics={mode}"])
    cfg = run.cfg
    rnd = _round(run)
    torch.manual_seed(0)
    model = build_model(cfg.model, rnd.input_shape, rnd.num_classes)
    payload = get_arrays(model)
    trainer = DittoTrainer(cfg, run.settings)
    state = trainer.fit(rnd, payload, {}).state
    bad = {k: (np.full_like(v, 5.0) if k.endswith("running_mean") else v) for k, v in state.items()}
    before = {k: v.copy() for k, v in bad.items()}
    out = trainer.evaluate(rnd, payload, bad)
    for k, v in before.items():                          # an evaluation never changes the state
        np.testing.assert_array_equal(bad[k], v, err_msg=k)
    personal = build_model(cfg.model, rnd.input_shape, rnd.num_classes)
    set_arrays(personal, {k[len("personal/"):]: v for k, v in bad.items() if k.startswith("personal/")})
    if mode == "stored":
        expected = evaluate(personal, rnd.data.test, CPU, class_weights=rnd.data.class_weights)["accuracy"]
        assert out["accuracy"] == expected
        return
    # recompute: the first BN layer holds the per-batch average of the first conv's outputs on
    # this client's train split, and the accuracy is that model's
    evaluated = trainer.with_own_bn_statistics(trainer.personal_model(rnd, payload, bad), rnd)
    x = torch.stack([rnd.data.train[i][0] for i in range(len(rnd.data.train))])
    with torch.no_grad():
        conv = personal.features[0](x).numpy()
    mean, var = _batch_average(conv, int(cfg.train.batch_size))
    np.testing.assert_allclose(evaluated.features[1].running_mean.numpy(), mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(evaluated.features[1].running_var.numpy(), var, rtol=1e-4, atol=1e-5)
    assert out["accuracy"] == evaluate(evaluated, rnd.data.test, CPU, class_weights=rnd.data.class_weights)["accuracy"]
    stored = evaluate(personal, rnd.data.test, CPU)["accuracy"]
    assert out["accuracy"] > stored                   # running means of 5 everywhere broke the stored model


def test_a_fedbasis_client_is_evaluated_as_its_combined_network() -> None:
    run = compose_run({"strategy": "fedbasis"}, ["eval_bn_statistics=recompute", "strategy.warm_fraction=0",
                                                 "strategy.num_bases=2", "strategy.coeff_epochs=1",
                                                 "strategy.basis_epochs=1"])
    cfg = run.cfg
    rnd = _round(run)
    trainer = FedBasisTrainer(cfg, run.settings)
    torch.manual_seed(0)
    payload = {k: v for k, v in get_arrays(trainer.new_model(rnd)).items() if k != "coeff_logits"}
    state = trainer.fit(rnd, payload, {}).state
    evaluated = trainer.with_own_bn_statistics(trainer.personal_model(rnd, payload, state), rnd)
    assert type(evaluated).__name__ == type(trainer.new_model(rnd).template).__name__   # the plain network
    x = torch.stack([rnd.data.train[i][0] for i in range(len(rnd.data.train))])
    with torch.no_grad():
        conv = evaluated.features[0](x).numpy()
    mean, _ = _batch_average(conv, int(cfg.train.batch_size))
    np.testing.assert_allclose(evaluated.features[1].running_mean.numpy(), mean, rtol=1e-4, atol=1e-5)


def test_an_unknown_mode_is_named() -> None:
    with pytest.raises(ConfigError, match="eval_bn_statistics"):
        compose_config({}, ["eval_bn_statistics=fresh"])


def test_by_default_a_fedora_client_holding_another_clients_statistics_is_tested_with_its_own() -> None:
    """FEDORA's theta_k here carries BN running statistics of another client's data (as
    propagation can leave them): the default tests it with statistics recomputed on its own
    train split, and reports the stored ones beside (``stored_bn_*``)."""
    run = compose_run({"strategy": "fedora"}, [])
    cfg = run.cfg
    rnd, other = _round(run, "0"), _round(run, "5")       # client 5: another domain of digits-domains
    assert rnd.data.domain != other.data.domain
    torch.manual_seed(0)
    payload = get_arrays(build_model(cfg.model, rnd.input_shape, rnd.num_classes))
    trainer = FEDORATrainer(cfg, run.settings)
    mine, theirs = trainer.fit(rnd, payload, {}).state, trainer.fit(other, payload, {}).state
    state = {k: (theirs[k] if "running_" in k else v) for k, v in mine.items()}   # its weights, their statistics
    out = trainer.evaluate(rnd, payload, state)
    model = trainer.personal_model(rnd, payload, state)
    weights = rnd.data.class_weights
    stored = evaluate(model, rnd.data.test, CPU, class_weights=weights)["accuracy"]
    own_model = recompute_bn_statistics(model, rnd.data.train, int(cfg.train.batch_size), CPU)
    own = evaluate(own_model, rnd.data.test, CPU, class_weights=weights)["accuracy"]
    x = torch.stack([rnd.data.train[i][0] for i in range(len(rnd.data.train))])
    with torch.no_grad():
        conv = own_model.features[0](x).numpy()
    mean, _ = _batch_average(conv, int(cfg.train.batch_size))      # its own data's statistics
    np.testing.assert_allclose(own_model.features[1].running_mean.numpy(), mean, rtol=1e-4, atol=1e-5)
    assert not np.allclose(state["model/features.1.running_mean"], mean, atol=1e-3)
    assert out["accuracy"] == out["own_bn_accuracy"] == own
    assert out["stored_bn_accuracy"] == stored
    assert own != stored


def test_the_global_model_of_fedavg_is_tested_as_the_server_holds_it() -> None:
    run = compose_run({}, [])                                        # FedAvg, the default cnn with BN
    cfg = run.cfg
    rnd = _round(run)
    torch.manual_seed(0)
    model = build_model(cfg.model, rnd.input_shape, rnd.num_classes)
    payload = get_arrays(model)
    out = ClientTrainer(cfg, run.settings).evaluate(rnd, payload, {})
    assert out["accuracy"] == evaluate(model, rnd.data.test, CPU, class_weights=rnd.data.class_weights)["accuracy"]
    assert not any(k.startswith(("own_bn_", "stored_bn_")) for k in out)


@pytest.mark.parametrize(("strategy", "passes"), [("fedavg", 2), ("fedprox", 2), ("ditto", 4)])
def test_a_personal_model_that_is_the_global_one_is_tested_once(strategy: str, passes: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """FedAvg's and FedProx's personalised model is the global model as sent: its numbers are
    the global reference's, from one test and one validation pass (two passes, not four);
    Ditto's (its own model) is another model, tested apart (here with its stored statistics)."""
    import client.round as round_module  # every test/validation pass of a trainer runs there

    run = compose_run({"strategy": strategy}, ["eval_bn_statistics=stored", "eval_bn_compare=false"])
    cfg = run.cfg
    rnd = _round(run)
    torch.manual_seed(0)
    model = build_model(cfg.model, rnd.input_shape, rnd.num_classes)
    payload = get_arrays(model)
    trainer = trainer_class(run.settings.method)(cfg, run.settings)
    assert isinstance(trainer, DittoTrainer if strategy == "ditto" else ClientTrainer)
    state = trainer.fit(rnd, payload, {}).state
    calls: list[int] = []
    real = round_module.evaluate
    monkeypatch.setattr(round_module, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = trainer.evaluate(rnd, payload, state)
    assert len(calls) == passes
    glob = {k: evaluate(model, split, CPU, class_weights=rnd.data.class_weights)[m]
            for k, split, m in (("accuracy", rnd.data.test, "accuracy"), ("loss", rnd.data.test, "loss"),
                                ("val_accuracy", rnd.data.val, "accuracy"), ("val_loss", rnd.data.val, "loss"))}
    assert {k: out[f"global_{k}"] for k in glob} == glob   # the global reference, computed here apart
    if passes == 2:
        assert {k: out[k] for k in glob} == glob
    else:
        assert {k: out[k] for k in glob} != glob


@pytest.mark.parametrize(("mode", "compare", "expected"), [
    ("recompute", True, ("own", "stored")), ("stored", True, ("stored", "own")), ("stored", False, ("stored",)),
])
def test_the_protocols_measured(mode: str, compare: bool, expected: tuple[str, ...]) -> None:
    run = compose_run({"strategy": "local"}, [f"eval_bn_statistics={mode}", f"eval_bn_compare={compare}"])
    rnd = _round(run)
    trainer = LocalTrainer(run.cfg, run.settings)
    assert trainer.bn_protocols(trainer.new_model(rnd)) == expected
    mlp = compose_run({"strategy": "local"}, ["model=mlp"])
    assert LocalTrainer(mlp.cfg, mlp.settings).bn_protocols(
        build_model(mlp.cfg.model, rnd.input_shape, rnd.num_classes)) == ()


def test_the_summary_names_its_protocol_and_each_protocols_best_round() -> None:
    """Each protocol's best round is the one with its own highest validation accuracy."""
    run = compose_run({"strategy": "ditto"}, [])

    def ev(rnd: int, own: tuple[float, float], stored: tuple[float, float]) -> dict:
        clients = {"0": {"accuracy": own[0], "val_accuracy": own[1], "own_bn_accuracy": own[0],
                         "own_bn_val_accuracy": own[1], "stored_bn_accuracy": stored[0],
                         "stored_bn_val_accuracy": stored[1]}}
        summary = {f"{k}_{s}": v for k, v in clients["0"].items() for s in ("mean", "min", "std")}
        return {"round": rnd, "evaluate": summary, "clients": clients}

    rounds = [ev(1, (0.5, 0.9), (0.2, 0.1)), ev(2, (0.6, 0.5), (0.3, 0.8)), ev(3, (0.7, 0.6), (0.25, 0.3))]
    summary = build_summary(run.settings, rounds, {"0": {"num_train": 10}}, "completed")
    assert summary["bn_statistics"] == "own"
    own, stored = summary["bn_protocols"]["own"], summary["bn_protocols"]["stored"]
    assert (own["accuracy_mean"], own["best_round"], own["best_accuracy_mean"]) == (0.7, 1, 0.5)
    assert (stored["accuracy_mean"], stored["best_round"], stored["best_accuracy_mean"]) == (0.25, 2, 0.3)
    assert summary["best_round"] == own["best_round"] and summary["accuracy_mean"] == own["accuracy_mean"]
    fedavg = build_summary(compose_run({}, []).settings, [{"round": 1, "evaluate": {
        "accuracy_mean": 0.5, "accuracy_min": 0.5, "accuracy_std": 0.0}, "clients": {"0": {"accuracy": 0.5}}}],
        {"0": {}}, "completed")
    assert fedavg["bn_statistics"].startswith("as held") and "bn_protocols" not in fedavg


def test_fdse_trains_with_its_authors_optimiser_unless_told_otherwise() -> None:
    """FLGo's SGD (momentum 0, weight decay 1e-3, clip 10, lr x 0.9998 a round) is FDSE's
    default on any dataset; an experiment's train block and the command line still win; the
    other methods keep the run's defaults."""
    fdse, fedavg = compose_config({"strategy": "fdse"}, []), compose_config({}, [])
    assert (fdse.train.momentum, fdse.train.weight_decay, fdse.train.clip, fdse.train.lr_decay) == (0.0, 1e-3, 10.0, 0.9998)
    assert (fedavg.train.momentum, fedavg.train.lr_decay) == (0.9, 1.0)
    assert compose_config({"strategy": "fdse"}, ["train.momentum=0.5"]).train.momentum == 0.5
    digits = compose_config({}, ["experiment=fdse-digits"])
    assert digits.train.momentum == 0.0 and digits.eval_bn_statistics == "stored"
    assert compose_config({}, ["experiment=fdse-digits-sources", "strategy=fedbn"]).eval_bn_statistics == "stored"


def test_compare_prints_each_protocols_numbers_by_seed_and_machine(tmp_path: Path) -> None:
    """`pflower compare` shows both protocols side by side (final mean, worst client, the
    accuracy at each protocol's own best round), every seed's headline and the machine."""
    from ops.compare import compare_runs

    def run(seed: int, own: tuple[float, float, float], stored: tuple[float, float, float]) -> Path:
        d = tmp_path / f"fedbn-s{seed}"
        d.mkdir()
        protocols = {p: dict(zip(("accuracy_mean", "accuracy_min", "best_accuracy_mean"), v, strict=True))
                     for p, v in (("own", own), ("stored", stored))}
        d.joinpath("summary.json").write_text(json.dumps({
            "strategy": "fedbn", "dataset": "d", "model": "m", "seed": seed, "accuracy_mean": own[0],
            "accuracy_min": own[1], "clients": {"0": {"accuracy": own[0]}}, "bn_statistics": "own",
            "bn_protocols": protocols, "machine": {"gpu": None, "cpu": "Xeon", "torch": "2.14.1"}}))
        return d

    text = compare_runs([run(0, (0.9, 0.8, 0.85), (0.5, 0.2, 0.6)), run(1, (0.7, 0.6, 0.75), (0.3, 0.1, 0.4))])
    header, _, row = text.splitlines()
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")], strict=True))
    assert cells["acc mean (own BN)"] == "0.8000 ± 0.1000" and cells["acc min (stored BN)"] == "0.1500 ± 0.0500"
    assert cells["acc @ best val round (own BN)"] == "0.8000 ± 0.0500"
    assert cells["acc @ best val round (stored BN)"] == "0.5000 ± 0.1000"
    assert cells["acc mean by seed"] == "0.9000, 0.7000" and cells["machine"] == "Xeon, torch 2.14.1"
    assert cells["BN stats"] == "own"
