"""FDSE glue: strategy aggregation, client trainer, unseen adaptation, configs, one e2e run.

The math itself (min-norm QP incl. KKT, consensus, attention) is tested against slow
computations in tests/test_fdse_math.py; here the *strategy* is checked against slow,
obvious per-tensor computations, and the client against the FDSE privacy rule.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch
from helpers import pflower

from client.fdse import FDSETrainer, adapt_unseen, personal_init
from client.round import ClientRound
from client.trainer import MODEL_PREFIX
from common.config import ComposedRun, compose_config, compose_run
from learning.datasets.federated import load_federated_data
from learning.fdse_model import keys_by_class, parameter_classes, shared_bn_stats
from learning.models import build_model
from learning.params import get_arrays, num_bytes
from strategies import fdse as fdse_strategy
from strategies import fdse_math
from strategies.base import ClientUpdate, TrainRound
from strategies.fdse import FDSE

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def setup():
    run = compose_run({"experiment": "fdse-digits"}, ["rounds=2"])
    data = load_federated_data(run.cfg.dataset, int(run.cfg.seed))
    return run, data


def make_strategy(cfg, data, client_ids=None) -> FDSE:
    torch.manual_seed(int(cfg.seed))
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    return helpers.make_strategy(FDSE, get_arrays(model), client_ids or data.client_ids,
                                 options=dict(cfg.strategy), model=model, data=data)


def client_round(run: ComposedRun, data, cid: str, rnd: int) -> ClientRound:
    return ClientRound(settings=run.settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=torch.device("cpu"), server_round=rnd)


@pytest.fixture(scope="module")
def two_rounds(setup):
    """Real FDSETrainer.fit calls of clients 0, 1, 2: round 1 all three, round 2 only 0, 1."""
    run, data = setup
    cfg = run.cfg
    strat = make_strategy(cfg, data, ["0", "1", "2"])
    trainer = FDSETrainer(cfg, run.settings)
    states: dict[str, dict] = {c: {} for c in ("0", "1", "2")}
    log: dict = {"payloads": {}, "results": {}, "personal_after": {}}
    for rnd, clients in ((1, ["0", "1", "2"]), (2, ["0", "1"])):
        updates, sent = [], {}
        for node, cid in enumerate(clients):
            payload = strat.payload_for(cid)
            sent[cid] = payload
            res = trainer.fit(client_round(run, data, cid, rnd), payload, states[cid])
            states[cid] = res.state
            log["payloads"][(rnd, cid)] = payload
            log["results"][(rnd, cid)] = res
            updates.append(ClientUpdate(cid, node, res.upload, res.num_examples, res.metrics))
        strat.aggregate_updates(TrainRound.handed(rnd, sent), updates)
        log["personal_after"][rnd] = {c: {k: v.copy() for k, v in p.items()}
                                      for c, p in strat.personal.items()}
    return strat, trainer, states, log


# ------------------------------------------------------------------ pure functions
def test_pure_functions_exposed_in_strategies_fdse():
    for name in ("min_norm_weights", "consensus_update", "attention_mix"):
        assert getattr(fdse_strategy, name) is getattr(fdse_math, name)
    rng = np.random.default_rng(0)
    d = rng.normal(size=(2, 5))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    w = fdse_strategy.min_norm_weights(d)
    # K = 2 by a fine grid over the simplex (slow, obvious)
    grid = np.linspace(0, 1, 100001)
    vals = [np.sum((a * d[0] + (1 - a) * d[1]) ** 2) for a in grid[::100]]
    assert np.sum((w @ d) ** 2) <= min(vals) + 1e-9


# ------------------------------------------------------------------ strategy vs slow
def _slow_consensus(deltas: list[np.ndarray]) -> np.ndarray:
    """K = 2: closed-form min-norm point on the segment, then scale by the mean norm."""
    n = [np.linalg.norm(x) for x in deltas]
    d1, d2 = deltas[0].ravel() / n[0], deltas[1].ravel() / n[1]
    a = float(np.clip(d2 @ (d2 - d1) / np.sum((d1 - d2) ** 2), 0.0, 1.0))
    return (np.mean(n) * (a * d1 + (1 - a) * d2)).reshape(deltas[0].shape)


def _slow_attention(rows: list[np.ndarray], tau: float) -> list[np.ndarray]:
    out = []
    for pi in rows:
        logits = [float(pi.ravel() @ pj.ravel()) / (np.linalg.norm(pi) * np.linalg.norm(pj)) / tau
                  for pj in rows]
        e = np.exp(np.array(logits) - max(logits))
        w = e / e.sum()
        out.append(sum(wj * pj for wj, pj in zip(w, rows, strict=True)))
    return out


def test_aggregate_matches_slow_computation(setup):
    run, data = setup
    cfg = run.cfg
    strat = make_strategy(cfg, data, ["0", "1"])
    groups = strat.groups
    old = {k: v.copy() for k, v in strat.global_arrays.items()}
    rng = np.random.default_rng(1)
    uploads = []
    for _ in range(2):
        up = {}
        for k in groups["consensus"] + groups["bn_stats"] + groups["personal"]:
            up[k] = (old[k] + rng.normal(scale=0.1, size=old[k].shape)).astype(old[k].dtype)
        for k in groups["counters"]:
            up[k] = np.asarray(rng.integers(0, 10), dtype=old[k].dtype)
        uploads.append(up)
    updates = [ClientUpdate(str(i), i, up, 10 * (i + 1), {}) for i, up in enumerate(uploads)]
    strat.aggregate_updates(TrainRound.handed(1), updates)
    for k in groups["consensus"]:
        deltas = [up[k].astype(np.float64) - old[k].astype(np.float64) for up in uploads]
        np.testing.assert_allclose(strat.global_arrays[k], old[k] + _slow_consensus(deltas),
                                   rtol=1e-5, atol=1e-6, err_msg=k)
    for k in groups["bn_stats"]:  # plain (unweighted) mean, not sample-weighted
        np.testing.assert_allclose(strat.global_arrays[k], (uploads[0][k] + uploads[1][k]) / 2, rtol=1e-6)
    for k in groups["personal"]:
        slow = _slow_attention([up[k].astype(np.float64) for up in uploads], strat.tau)
        for i in range(2):
            np.testing.assert_allclose(strat.personal[str(i)][k], slow[i], rtol=1e-5, atol=1e-6)
            assert strat.personal[str(i)][k].dtype == old[k].dtype
        assert not np.allclose(strat.personal["0"][k], strat.personal["1"][k])  # own mix each
    assert not any(k in strat.global_arrays for k in groups["local"])


def test_consensus_update_never_conflicts_with_a_client(setup):
    """MGDA property: the aggregated update has a non-negative inner product with every
    client's update (paper, below Eq. 8)."""
    run, data = setup
    cfg = run.cfg
    strat = make_strategy(cfg, data, ["0", "1", "2"])
    old = {k: v.copy() for k, v in strat.global_arrays.items()}
    rng = np.random.default_rng(2)
    uploads = [{k: (old[k] + rng.normal(scale=0.1, size=old[k].shape)).astype(old[k].dtype)
                if np.issubdtype(old[k].dtype, np.floating) else old[k] for k in old} for _ in range(3)]
    strat.aggregate_updates(TrainRound.handed(1), [ClientUpdate(str(i), i, u, 1, {}) for i, u in enumerate(uploads)])
    for k in strat.groups["consensus"]:
        step = strat.global_arrays[k].astype(np.float64) - old[k]
        for u in uploads:
            delta = u[k].astype(np.float64) - old[k]
            # >= 0 up to the float32 rounding of the stored global tensor
            assert float(np.sum(step * delta)) >= -1e-4 * np.linalg.norm(step) * np.linalg.norm(delta), k


# ------------------------------------------------------------------ client privacy
def test_local_statistics_never_leave_the_client(setup, two_rounds):
    run, data = setup
    strat, trainer, states, log = two_rounds
    local = set(strat.groups["local"])
    assert local and all(".dse_bn.running_" in k or ".dse_bn.num_batches" in k for k in local)
    for (rnd, cid), res in log["results"].items():
        assert not local & set(res.upload), f"round {rnd} client {cid} uploaded local statistics"
        assert set(res.upload) == set(strat.global_arrays), "upload = every shared + personal tensor"
        assert not local & set(log["payloads"][(rnd, cid)]), "the server sent local statistics"
        for k in local:                              # ... but the client keeps them
            assert MODEL_PREFIX + k in res.state
    # they were really trained (not the BN initialisation) and are reloaded next round
    k = next(x for x in local if x.endswith("running_mean"))
    stored = states["0"][MODEL_PREFIX + k]
    assert np.abs(stored).max() > 0
    model = trainer.load_model(client_round(run, data, "0", 3), strat.payload_for("0"), states["0"])
    np.testing.assert_array_equal(get_arrays(model, [k])[k], stored)
    # and the server refuses an upload that carries them
    bad = {**log["results"][(1, "0")].upload, k: stored}
    assert "local-only" in strat.check_upload(bad)


def test_absent_client_keeps_its_personal_state(two_rounds):
    strat, _, _, log = two_rounds
    after1, after2 = log["personal_after"][1], log["personal_after"][2]
    assert set(after1) == {"0", "1", "2"}
    for k, v in after1["2"].items():           # client 2 skipped round 2: unchanged, bit for bit
        np.testing.assert_array_equal(after2["2"][k], v)
    changed = [k for k in after1["0"] if not np.array_equal(after1["0"][k], after2["0"][k])]
    assert changed, "clients of round 2 must receive a new personal mix"
    # checkpoint round trip keeps per-client state keyed by the stable id
    groups, meta = strat.state()
    fresh = helpers.make_strategy(FDSE, strat.reference, ["0", "1", "2"], options=dataclasses.asdict(strat.options), model=strat.model)
    fresh.load_state(groups, meta)
    for cid in ("0", "1", "2"):
        for k, v in strat.personal[cid].items():
            np.testing.assert_array_equal(fresh.personal[cid][k], v)


def test_consistency_loss_active_from_round_two(two_rounds):
    _, _, _, log = two_rounds
    assert log["results"][(1, "0")].metrics["consistency"] == 0.0
    assert log["results"][(2, "0")].metrics["consistency"] > 0.0


def test_fdse_needs_an_fdse_model(setup):
    run, data = setup
    cfg = run.cfg
    plain = build_model(compose_config({}, ["model=alexnet-bn"]).model, data.input_shape, data.num_classes)
    with pytest.raises(ValueError, match="fdse-alexnet"):
        helpers.make_strategy(FDSE, get_arrays(plain), ["0"], options=dict(cfg.strategy), model=plain)


# ------------------------------------------------------------------ unseen domains
def test_adapt_unseen_trains_only_personal_modules(setup, two_rounds):
    run, data = setup
    cfg = run.cfg
    strat = two_rounds[0]
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    pkeys = strat.groups["personal"]
    groups, _ = strat.state()
    arrays = {**groups["global"], **personal_init(groups, pkeys, "mean")}
    np.testing.assert_allclose(arrays[pkeys[0]], np.mean([strat.personal[c][pkeys[0]] for c in "012"], axis=0),
                               rtol=1e-6)
    from learning.params import set_arrays

    set_arrays(model, arrays)
    before = get_arrays(model)
    res = adapt_unseen(model, shared_bn_stats(groups["global"]), data.new_clients["new-1"],
                       torch.device("cpu"), beta=0.001, epochs=2, lr=0.05)
    after = get_arrays(model)
    classes = parameter_classes(model)
    for k, cls in classes.items():
        if cls == "shared":   # DFE, BN_DFE (incl. its global statistics) and head are frozen
            np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    assert any(not np.array_equal(after[k], before[k]) for k in pkeys)
    assert {"acc_init", "acc_before", "acc_after"} <= set(res)
    assert all(0.0 <= res[k] <= 1.0 for k in ("acc_init", "acc_before", "acc_after"))
    assert np.isfinite(res["consistency_first"]) and np.isfinite(res["consistency_last"])


def test_the_adapt_mode_of_personalize_is_the_trainers_algorithm_3(setup, two_rounds):
    """``pflower personalize --adapt`` drives ``FDSETrainer.adapt_new_client``: the final
    shared tensors, the mean of the clients' personal tensors, then :func:`adapt_unseen` with
    ``strategy.adapt_*`` unless given; other methods refuse the mode."""
    from client.trainer import ClientTrainer
    from learning.params import set_arrays

    run, data = setup
    cfg = run.cfg
    strat, trainer = two_rounds[0], two_rounds[1]
    groups, _ = strat.state()
    rnd = ClientRound(settings=run.settings, client_id="new-1", data=data.new_clients["new-1"], num_classes=data.num_classes,
                      input_shape=data.input_shape, device=torch.device("cpu"), server_round=3)
    got = trainer.adapt_new_client(rnd, groups, {"init": "mean", "epochs": 1, "lr": None, "adapt_on": None})
    torch.manual_seed(int(cfg.seed))
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    set_arrays(model, {**groups["global"], **personal_init(groups, strat.groups["personal"], "mean")})
    o = trainer.options
    want = adapt_unseen(model, shared_bn_stats(groups["global"]), data.new_clients["new-1"], torch.device("cpu"),
                        beta=o.beta, form=o.consistency_form, epochs=1, lr=o.adapt_lr,
                        batch_size=int(cfg.train.batch_size), clip=float(cfg.train.clip), adapt_on=o.adapt_on,
                        seed=int(cfg.seed))
    assert got == want
    with pytest.raises(ValueError, match="no label-free adaptation"):
        ClientTrainer.adapt_new_client(trainer, rnd, groups, {})


# ------------------------------------------------------------------ models, configs, bytes
def test_paper_model_size_and_upload_ratio(setup):
    """Paper Table 4: FDSE AlexNet has 0.65e7 parameters, half of AlexNet-BN (1.30e7)."""
    from learning.fdse_model import FDSEAlexNet

    m = FDSEAlexNet(10, 3, input_size=224)
    n = sum(p.numel() for p in m.parameters())
    convs = [(3, 64, 11), (64, 192, 5), (192, 384, 3), (384, 256, 3), (256, 256, 3)]
    plain = sum(i * o * k * k + o + 2 * o for i, o, k in convs) \
        + (9216 * 1024 + 1024 + 2048) + (1024 * 1024 + 1024 + 2048) + (1024 * 10 + 10)
    assert abs(n / 0.65e7 - 1) < 0.01 and abs(plain / 1.30e7 - 1) < 0.01
    # the digits pairing used for the measurement: fdse-digits vs alexnet-bn width 0.125
    run, data = setup
    cfg = run.cfg
    strat = make_strategy(cfg, data)
    base = build_model(compose_config({}, ["model=alexnet-bn", "model.width=0.125"]).model,
                       data.input_shape, data.num_classes)
    ratio = strat.summary_extras()["fdse_upload_bytes_per_client"] / num_bytes(get_arrays(base))
    assert 0.45 < ratio < 0.6


def test_fdse_resnet18_builds_with_three_classes(setup):
    _, data = setup
    model = build_model(compose_config({}, ["model=fdse-resnet18"]).model, (3, 16, 16), 10)
    kb = keys_by_class(model)
    assert kb["shared"] and kb["personal"] and kb["local"]
    assert all(k.startswith("head.") or "dfe" in k for k in kb["shared"] if not k.startswith("body.fc"))
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


@pytest.mark.parametrize("exp,lam,tau,beta,lr,epochs", [
    ("fdse-office-caltech10", 0.05, 0.5, 0.05, 0.1, 1),
    ("fdse-pacs", 0.5, 0.5, 0.001, 0.05, 5),
    ("fdse-domainnet", 0.1, 0.5, 0.001, 0.1, 5),
])
def test_table1_experiments_compose(exp, lam, tau, beta, lr, epochs, tmp_path):
    cfg = compose_config({"experiment": exp}, [f"dataset.root={tmp_path}"])
    assert (cfg.strategy.name, cfg.model.name, cfg.rounds) == ("fdse", "fdse-alexnet", 500)
    assert (cfg.strategy.lam, cfg.strategy.tau, cfg.strategy.beta) == (lam, tau, beta)
    assert (cfg.train.lr, cfg.train.local_epochs, cfg.train.batch_size) == (lr, epochs, 50)
    # the authors' optimiser and code forms (their FLGo configs), not the paper's text
    assert (cfg.train.weight_decay, cfg.train.clip, cfg.train.lr_decay) == (1e-3, 10.0, 0.9998)
    assert cfg.train.momentum == 0.0
    assert cfg.strategy.consistency_form == "code"
    assert (cfg.model.dse_activation, cfg.model.out_bias, cfg.model.conv_padding) == ("none", True, None)
    assert cfg.dataset.clients_per_domain == 1 and cfg.fraction_train == 1.0
    model = build_model(cfg.model, (3, 256, 256), 10)
    assert model.stem == "paper"
    # the authors' padding 0 on conv3-5 at paper size; 1 with the small stem (8 px digits)
    paddings = {n: m.padding for n, m in model.named_modules() if n.endswith("dfe_conv") and n[-10] in "345"}
    assert paddings == {f"features.conv{i}.dfe_conv": (0, 0) for i in (3, 4, 5)}
    small = build_model(cfg.model, (1, 8, 8), 10)
    assert small.stem == "small" and small.features.conv3.dfe_conv.padding == (1, 1)
    assert small(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_digits_experiment_composes(setup):
    run, data = setup
    cfg = run.cfg
    assert cfg.strategy.name == "fdse" and cfg.dataset.clients_per_domain == 1
    assert len(data.clients) == 4 and len(data.new_clients) == 4
    assert sorted(c.domain for c in data.new_clients.values()) == sorted(cfg.dataset.domains)


# ------------------------------------------------------------------ end to end
@pytest.mark.e2e
def test_pflower_run_fdse_end_to_end(tmp_path):
    """One short simulation, then the offline unseen-domain adaptation on its checkpoint."""
    proc = pflower("run", "strategy=fdse", "model=fdse-alexnet", "experiment=fdse-digits", "rounds=2",
                   "run_name=e2e", f"results_root={tmp_path}", timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "e2e"
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_min"] <= summary["accuracy_mean"] <= 1.0
    rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    up = rounds[-1]["communication"]["bytes_up"]
    assert set(up) == {"0", "1", "2", "3"}
    assert len(set(up.values())) == 1 and summary.get("fdse_upload_bytes_per_client") in set(up.values())
    from server.checkpoint import load_checkpoint

    _, groups, _ = load_checkpoint(run, {"strategy": "fdse"})
    assert {f"personal/{c}" for c in "0123"} <= set(groups)
    proc = pflower("adapt", str(run), "--epochs", "1", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((run / "unseen_adaptation.json").read_text())
    assert set(res["clients"]) == {"new-0", "new-1", "new-2", "new-3"}


def test_evaluation_tests_the_model_right_after_local_training(setup, two_rounds):
    """``evaluate=trained`` (default, the authors' protocol): the personalised accuracy is
    that of the client's model as it left local training, whatever the server sends;
    ``evaluate=aggregated`` tests what the server sends."""
    from learning.training import evaluate as evaluate_model

    run, data = setup
    strat, trainer, states, log = two_rounds
    rnd = client_round(run, data, "0", 2)
    res = log["results"][(2, "0")]
    for k, v in res.upload.items():   # the kept model is the one that was trained and uploaded
        np.testing.assert_array_equal(states["0"][FDSETrainer.TRAINED + k], v)
    now = trainer.evaluate(rnd, strat.payload_for("0"), states["0"])
    older = trainer.evaluate(rnd, log["payloads"][(1, "0")], states["0"])
    assert now["accuracy"] == older["accuracy"] and now["loss"] == older["loss"]
    trained = trainer.own_model(rnd, {}, states["0"], FDSETrainer.TRAINED)
    assert now["accuracy"] == evaluate_model(trained, data.client("0").test, torch.device("cpu"))["accuracy"]
    aggregated_run = compose_run({"experiment": "fdse-digits"}, ["rounds=2", "strategy.evaluate=aggregated"])
    aggregated = FDSETrainer(aggregated_run.cfg, aggregated_run.settings)
    sent = aggregated.evaluate(rnd, strat.payload_for("0"), states["0"])
    first = aggregated.evaluate(rnd, log["payloads"][(1, "0")], states["0"])
    assert (sent["loss"], sent["accuracy"]) != (first["loss"], first["accuracy"])
