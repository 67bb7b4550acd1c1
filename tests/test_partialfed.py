"""PartialFed: Fix rules (which key comes from where, against explicit lists), the adaptive
gates (composition, straight-through gradients, alternating updates), units, schedules,
and one end-to-end run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import model_config, pflower
from torch import nn

from client.partialfed import (
    LOGITS_STATE,
    PartialFedAdaptiveTrainer,
    PartialFedFixTrainer,
    train_gated,
)
from client.round import ClientRound
from client.trainer import MODEL_PREFIX, LocalRound
from common.config import ComposedRun, compose_run
from learning.datasets.federated import load_federated_data
from learning.models import build_model
from learning.params import get_arrays
from learning.training import OptimConfig
from learning.units import model_units, unit_of
from strategies.partialfed_math import (
    FIX_RULES,
    anneal_tau,
    compose_weights,
    gumbel_gates,
    merge_by_unit,
)

CNN_S1 = ["features.0.weight", "features.0.bias", "features.1.weight", "features.1.bias",
          "features.1.running_mean", "features.1.running_var", "features.1.num_batches_tracked"]
CNN_S2 = ["features.3.weight", "features.3.bias", "features.4.weight", "features.4.bias",
          "features.4.running_mean", "features.4.running_var", "features.4.num_batches_tracked"]
CNN_S3 = ["fc.1.weight", "fc.1.bias"]
CNN_FC = ["head.weight", "head.bias"]
CNN_BN = [k for k in CNN_S1 + CNN_S2 if k.startswith(("features.1.", "features.4."))]
CNN_ALL = CNN_S1 + CNN_S2 + CNN_S3 + CNN_FC

# the keys each rule must take from the global model (small CNN: 3 stages + fc)
CNN_EXPECTED: dict[str, list[str] | None] = {
    "all": CNN_ALL,
    "no-bn": [k for k in CNN_ALL if k not in CNN_BN],
    "no-fc": CNN_S1 + CNN_S2 + CNN_S3,
    "no-bn-fc": [k for k in CNN_S1 + CNN_S2 + CNN_S3 if k not in CNN_BN],
    "s1": CNN_S1,
    "s1-s2": CNN_S1 + CNN_S2,
    "s1-s3": CNN_S1 + CNN_S2 + CNN_S3,
    "s1-s4": None,          # the small CNN has no stage 4: a clear error
    "fc": CNN_FC,
    "s4-fc": None,
    "s3-fc": CNN_S3 + CNN_FC,
    "s2-fc": CNN_S2 + CNN_S3 + CNN_FC,
    "ABCD": None,           # no residual blocks
    "abcd": None,
}
# ResNet-18: key prefixes taken from global
STEM = ["body.conv1.", "body.bn1."]
RESNET_EXPECTED = {
    "ABCD": STEM + ["body.layer1.0.", "body.layer2.0.", "body.layer3.0.", "body.layer4.0.", "head."],
    "abcd": STEM + ["body.layer1.1.", "body.layer2.1.", "body.layer3.1.", "body.layer4.1.", "head."],
    "s1-s4": STEM + ["body.layer1.", "body.layer2.", "body.layer3.", "body.layer4."],
    "s4-fc": ["body.layer4.", "head."],
    "s1": STEM + ["body.layer1."],
}


def _run(strategy: str, *overrides: str) -> ComposedRun:
    return compose_run({"strategy": strategy}, ["dataset.clients_per_domain=1", *overrides])


def _cfg(strategy: str, *overrides: str):
    return _run(strategy, *overrides).cfg


@pytest.fixture(scope="module")
def data():
    return load_federated_data(_cfg("partialfed-fix").dataset, 0)


def _rnd(run: ComposedRun, data, cid="0", server_round=1, input_shape=None) -> ClientRound:
    return ClientRound(settings=run.settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=input_shape or data.input_shape, device=torch.device("cpu"),
                       server_round=server_round)


def _marked(model: nn.Module, value: int) -> dict[str, np.ndarray]:
    return {k: np.full(v.shape, value, dtype=v.cpu().numpy().dtype) for k, v in model.state_dict().items()}


def _from_global(trainer, rnd) -> set[str]:
    """Start a round from payload = all 1s and own state = all 2s; keys that are 1 came from global."""
    template = trainer.new_model(rnd)
    work = LocalRound(rnd, _marked(template, 1), {MODEL_PREFIX + k: v for k, v in _marked(template, 2).items()}, {})
    model = trainer.start_model(work)
    got = get_arrays(model)
    assert all(np.all((v == 1) | (v == 2)) for v in got.values())
    return {k for k, v in got.items() if np.all(v == 1)}


@pytest.mark.parametrize("rule", FIX_RULES)
def test_fix_rule_loads_exactly_the_listed_keys_on_the_small_cnn(rule, data):
    run = _run("partialfed-fix", f"strategy.rule={rule}")
    trainer = PartialFedFixTrainer(run.cfg, run.settings)
    expected = CNN_EXPECTED[rule]
    if expected is None:
        with pytest.raises(ValueError, match="lacks"):
            _from_global(trainer, _rnd(run, data))
        return
    assert _from_global(trainer, _rnd(run, data)) == set(expected)


@pytest.mark.parametrize("rule", sorted(RESNET_EXPECTED))
def test_fix_rule_on_resnet18_blocks_and_stages(rule, data):
    run = _run("partialfed-fix", f"strategy.rule={rule}", "model=resnet18")
    trainer = PartialFedFixTrainer(run.cfg, run.settings)
    rnd = _rnd(run, data, input_shape=(3, 16, 16))
    keys = trainer.new_model(rnd).state_dict().keys()
    expected = {k for k in keys if k.startswith(tuple(RESNET_EXPECTED[rule]))}
    assert _from_global(trainer, rnd) == expected


def test_fix_first_round_without_state_starts_from_the_payload(data):
    run = _run("partialfed-fix", "strategy.rule=no-bn-fc")
    trainer = PartialFedFixTrainer(run.cfg, run.settings)
    rnd = _rnd(run, data)
    model = trainer.start_model(LocalRound(rnd, _marked(trainer.new_model(rnd), 1), {}, {}))
    assert all(np.all(v == 1) for v in get_arrays(model).values())


def test_units_partition_and_resnet_letters():
    cnn = build_model(model_config("cnn"), (1, 8, 8), 10)
    assert model_units(cnn, "stage") == {"s1": CNN_S1, "s2": CNN_S2, "s3": CNN_S3, "fc": CNN_FC}
    res = build_model(model_config("resnet18"), (3, 16, 16), 10)
    blocks = model_units(res, "block")
    assert list(blocks) == ["stem", "A", "a", "B", "b", "C", "c", "D", "d", "fc"]
    assert all(k.startswith("body.layer3.1.") for k in blocks["c"])
    for gran in ("stage", "block", "layer"):
        owner = unit_of(model_units(res, gran))
        assert sorted(owner) == sorted(res.state_dict())


# ---------------------------------------------------------------- adaptive
def _two_copies(seed_local: int = 0, seed_global: int = 1):
    torch.manual_seed(seed_local)
    local = build_model(model_config("cnn"), (1, 8, 8), 10)
    torch.manual_seed(seed_global)
    glob = build_model(model_config("cnn"), (1, 8, 8), 10)
    units = model_units(local, "stage")
    names = list(units)
    return local, glob, names, {k: names.index(u) for k, u in unit_of(units).items()}


def test_composition_takes_global_where_the_gate_is_one_and_local_where_zero():
    local, glob, names, index = _two_copies()
    gates = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])   # s1 global, s2 local, ...
    g = {**dict(glob.named_parameters()), **dict(glob.named_buffers())}
    lo = {**dict(local.named_parameters()), **dict(local.named_buffers())}
    out = compose_weights(gates, index, g, lo)
    for k, v in out.items():
        src = g if names[index[k]] in ("s1", "s3") else lo
        assert torch.equal(v, src[k]), k
        if not src[k].requires_grad:        # buffers are the chosen copy itself (BN updates it)
            assert v is src[k]


def test_straight_through_gradients_reach_the_logits_and_the_chosen_copy_only():
    local, glob, names, index = _two_copies()
    logits = torch.tensor([[0.3, -0.2], [0.0, 0.1], [-0.4, 0.2], [0.1, 0.0]], requires_grad=True)
    gates = gumbel_gates(logits, tau=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(gates.detach().sum(1), torch.ones(4))
    assert set(gates.detach().flatten().tolist()) <= {0.0, 1.0}              # hard forward value
    tensors = compose_weights(gates, index, {**dict(glob.named_parameters()), **dict(glob.named_buffers())},
                              {**dict(local.named_parameters()), **dict(local.named_buffers())})
    x, y = torch.randn(6, 1, 8, 8), torch.arange(6)
    local.eval()
    loss = nn.functional.cross_entropy(torch.func.functional_call(local, tensors, (x,)), y)
    loss.backward()
    assert logits.grad is not None and torch.all(torch.isfinite(logits.grad))
    assert torch.all(logits.grad.abs().sum(1) > 0)                            # every unit's logits
    for k, p in glob.named_parameters():
        chose_global = bool(gates[index[k], 1] > 0.5)
        assert (p.grad is not None and p.grad.abs().sum() > 0) == chose_global, k


def test_logits_change_only_on_strategy_batches_and_weights_only_on_model_batches(data):
    local, glob, names, index = _two_copies()
    logits = torch.zeros(len(names), 2, requires_grad=True)
    snaps = []

    def params() -> dict[str, torch.Tensor]:
        return {f"{tag}{k}": p.detach().clone() for tag, m in (("l:", local), ("g:", glob))
                for k, p in m.named_parameters()}

    before = [params(), logits.detach().clone()]

    def after(step: int, model_step: bool) -> None:
        snaps.append((step, model_step, params(), logits.detach().clone()))

    opt = OptimConfig(lr=0.1, batch_size=8, momentum=0.9, weight_decay=5e-4, epochs=1)
    train_gated(local, glob, logits, index, data.client("0").train, opt, torch.device("cpu"), tau=1.0,
                model_batches=2, strategy_batches=1, gate_lr=0.5, seed=0, after_step=after)
    assert [m for _, m, _, _ in snaps[:6]] == [True, True, False, True, True, False]
    prev_p, prev_l = before
    strategy_moved = 0
    for _, model_step, p, lg in snaps:
        weights_moved = any(not torch.equal(p[k], prev_p[k]) for k in p)
        logits_moved = not torch.equal(lg, prev_l)
        if model_step:
            assert weights_moved and not logits_moved
        else:
            assert not weights_moved
            strategy_moved += logits_moved
        prev_p, prev_l = p, lg
    assert strategy_moved >= 1


def test_logits_and_weights_step_with_one_optimiser(data, monkeypatch):
    """Alg. 2 has one optimiser: the logits' steps use the model's kind and momentum at the
    step size eta (gate_lr), without weight decay; checked on the optimisers train_gated makes
    and on the logits' second step, which carries the first one's momentum."""
    import client.partialfed as pf

    made = []
    real = pf.make_optimizer

    def spy(params, opt):
        optimiser = real(params, opt)
        made.append(optimiser)
        return optimiser

    monkeypatch.setattr(pf, "make_optimizer", spy)
    local, glob, names, index = _two_copies()
    logits = torch.zeros(len(names), 2, requires_grad=True)
    opt = OptimConfig(lr=0.1, batch_size=8, momentum=0.9, weight_decay=5e-4, epochs=1)
    train_gated(local, glob, logits, index, data.client("0").train, opt, torch.device("cpu"), tau=1.0,
                model_batches=1, strategy_batches=1, gate_lr=0.3, seed=0)
    model_opt, gate_opt = made
    assert type(model_opt) is type(gate_opt) is torch.optim.SGD
    group = gate_opt.param_groups[0]
    assert group["params"][0] is logits
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.3, 0.9, 0.0)
    assert model_opt.param_groups[0]["momentum"] == 0.9
    assert "momentum_buffer" in gate_opt.state[logits]           # the logits did step with momentum


def test_unchosen_copy_never_moves(data):
    """Logits strongly favouring local (and a cold temperature): the global copy gets no
    update at all, not even from weight decay or momentum."""
    local, glob, names, index = _two_copies()
    g0 = {k: p.detach().clone() for k, p in glob.named_parameters()}
    logits = torch.tensor([[20.0, -20.0]] * len(names), requires_grad=True)
    opt = OptimConfig(lr=0.1, batch_size=8, momentum=0.9, weight_decay=5e-4, epochs=1)
    train_gated(local, glob, logits, index, data.client("0").train, opt, torch.device("cpu"), tau=0.1,
                model_batches=1, strategy_batches=1, gate_lr=0.1, seed=0)
    assert all(torch.equal(p, g0[k]) for k, p in glob.named_parameters())


def test_anneal_and_merge_against_slow_computations():
    assert anneal_tau(1, 20, 5.0, 0.1) == pytest.approx(5.0)
    assert anneal_tau(20, 20, 5.0, 0.1) == pytest.approx(0.1)
    taus = [anneal_tau(r, 20, 5.0, 0.1) for r in range(1, 21)]
    assert all(a > b for a, b in zip(taus, taus[1:], strict=False))
    assert anneal_tau(11, 21, 5.0, 1.0, "linear") == pytest.approx(3.0)
    g = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(5)}
    lo = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(9)}
    p = torch.tensor([0.25])
    soft = merge_by_unit(p, {"w": 0, "n": 0}, g, lo, "soft")
    assert torch.allclose(soft["w"], torch.tensor([0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6]))
    assert int(soft["n"]) == 9                                      # counters: the likelier copy
    hard = merge_by_unit(torch.tensor([0.75]), {"w": 0, "n": 0}, g, lo, "hard")
    assert torch.equal(hard["w"], g["w"]) and int(hard["n"]) == 5


def test_adaptive_round_keeps_logits_and_reports_gates(data):
    run = _run("partialfed-adaptive", "strategy.gate_lr=1.0", "rounds=3")
    trainer = PartialFedAdaptiveTrainer(run.cfg, run.settings)
    rnd = _rnd(run, data, server_round=1)
    payload = get_arrays(trainer.new_model(rnd))
    first = trainer.fit(rnd, payload, {})
    assert first.state[LOGITS_STATE].shape == (4, 2)
    assert set(k for k in first.metrics if k.startswith("p_global/")) == {f"p_global/{u}" for u in ("s1", "s2", "s3", "fc")}
    assert first.metrics["tau"] == pytest.approx(5.0)
    second = trainer.fit(_rnd(run, data, server_round=2), first.upload, first.state)
    # round 2 starts from round 1's logits (the probabilities continue, not reset to 0.5)
    p1 = torch.softmax(torch.tensor(first.state[LOGITS_STATE]), -1)[:, 1]
    assert not torch.allclose(p1, torch.full((4,), 0.5))
    assert second.metrics["tau"] < first.metrics["tau"]
    with pytest.raises(ValueError, match="granularity"):
        trainer.initial_logits({LOGITS_STATE: np.zeros((3, 2), np.float32)}, ["s1", "s2", "s3", "fc"])


def test_bad_rule_and_options_fail_before_training():
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="strategy.rule must be one of"):
        _cfg("partialfed-fix", "strategy.rule=s9")
    with pytest.raises(ConfigError, match="granularity"):
        _cfg("partialfed-adaptive", "strategy.granularity=pixel")


@pytest.mark.e2e
def test_pflower_run_partialfed_adaptive_end_to_end(tmp_path):
    proc = pflower("run", "strategy=partialfed-adaptive", "rounds=2", "dataset.clients_per_domain=1",
                   "run_name=pf", f"results_root={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "pf"
    summary = json.loads((run / "summary.json").read_text())
    gates = summary["partialfed_p_global"]
    assert sorted(gates) == ["0", "1", "2", "3"] and all(set(g) == {"s1", "s2", "s3", "fc"} for g in gates.values())
    rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r["partialfed"]["p_global"]) for r in rounds] == [["0", "1", "2", "3"]] * 2
    assert (run / "gates.png").stat().st_size > 0
