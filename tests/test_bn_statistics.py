"""``eval_bn_statistics=recompute``: the evaluated personal model's BN running statistics
recomputed on the client's own train split (precise BN), against a slow per-batch computation;
the default keeps the stored statistics; an evaluation never changes the client's state; a
FedBasis client is evaluated as the plain network its bases combine to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from client.baselines import DittoTrainer
from client.fedbasis import FedBasisTrainer
from client.trainer import ClientRound
from common.config import ConfigError, compose_config
from learning.data import load_federated_data
from learning.models import build_model
from learning.params import get_arrays, set_arrays
from learning.training import evaluate, recompute_bn_statistics

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


def _round(cfg, cid: str = "0") -> ClientRound:
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    return ClientRound(cfg=cfg, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=CPU, server_round=2)


@pytest.mark.parametrize("mode", ["stored", "recompute"])
def test_a_ditto_client_evaluates_its_personal_model_with_the_chosen_statistics(mode: str) -> None:
    cfg = compose_config({"strategy": "ditto"}, [f"eval_bn_statistics={mode}"])
    rnd = _round(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, rnd.input_shape, rnd.num_classes)
    payload = get_arrays(model)
    trainer = DittoTrainer(cfg)
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
    evaluated = trainer.evaluated_model(rnd, payload, bad)
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
    cfg = compose_config({"strategy": "fedbasis"}, ["eval_bn_statistics=recompute", "strategy.warm_fraction=0",
                                                    "strategy.num_bases=2", "strategy.coeff_epochs=1",
                                                    "strategy.basis_epochs=1"])
    rnd = _round(cfg)
    trainer = FedBasisTrainer(cfg)
    torch.manual_seed(0)
    payload = {k: v for k, v in get_arrays(trainer.new_model(rnd)).items() if k != "coeff_logits"}
    state = trainer.fit(rnd, payload, {}).state
    evaluated = trainer.evaluated_model(rnd, payload, state)
    assert type(evaluated).__name__ == type(trainer.new_model(rnd).template).__name__   # the plain network
    x = torch.stack([rnd.data.train[i][0] for i in range(len(rnd.data.train))])
    with torch.no_grad():
        conv = evaluated.features[0](x).numpy()
    mean, _ = _batch_average(conv, int(cfg.train.batch_size))
    np.testing.assert_allclose(evaluated.features[1].running_mean.numpy(), mean, rtol=1e-4, atol=1e-5)


def test_an_unknown_mode_is_named() -> None:
    with pytest.raises(ConfigError, match="eval_bn_statistics"):
        compose_config({}, ["eval_bn_statistics=fresh"])
