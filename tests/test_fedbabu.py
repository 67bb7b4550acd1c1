"""FedBABU: head init, body-only averaging, fixed head through training, the fine-tuning
protocol, FedProx+BABU, the lr step schedule and the paper's experiment configs.

The federated test drives the FedBABU strategy and client trainers directly (no Flower
runtime) on a 3-client digits shard split; ``test_end_to_end_pflower_run`` (marked slow)
runs one real ``pflower run``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import pflower

from client.baselines import FedProxTrainer
from client.fedbabu import HEAD_PREFIX, FedBABUTrainer, FedProxBABUTrainer, HeadMissingError
from client.handlers import trainer_class
from client.round import ClientRound
from client.trainer import ClientTrainer, step_lr_scale, unprefixed
from common.config import ComposedRun, compose_config, compose_run
from learning.datasets.federated import load_federated_data
from learning.params import num_bytes
from server.app import build_strategy
from server.summary import build_summary
from strategies.base import ClientUpdate, TrainRound
from strategies.fedbabu import FedBABU
from strategies.fedbabu_math import (
    HEAD_DIGEST_KEY,
    average_body,
    head_digest,
    init_head,
    split_head,
)

HEAD_KEYS = ["head.weight", "head.bias"]


# ----------------------------------------------------------------- pure functions
def test_init_head_orthogonal_deterministic_and_default_keeps_input():
    rng = np.random.default_rng(0)
    head = {"head.weight": rng.normal(size=(10, 128)).astype(np.float32),
            "head.bias": rng.normal(size=10).astype(np.float32)}
    a = init_head(head, seed=3)
    b = init_head(head, seed=3)
    c = init_head(head, seed=4)
    w = a["head.weight"].astype(np.float64)
    assert a["head.weight"].dtype == np.float32 and a["head.weight"].shape == (10, 128)
    np.testing.assert_allclose(w @ w.T, np.eye(10), atol=1e-5)  # C <= d: orthonormal rows
    assert np.all(a["head.bias"] == 0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["head.weight"], c["head.weight"])
    tall = init_head({"head.weight": np.zeros((20, 8), np.float32)}, seed=1)["head.weight"]
    np.testing.assert_allclose(tall.T.astype(np.float64) @ tall, np.eye(8), atol=1e-5)  # C > d
    d = init_head(head, seed=3, mode="default")
    assert all(np.array_equal(d[k], head[k]) for k in head)
    with pytest.raises(ValueError, match="head_init"):
        init_head(head, seed=0, mode="xavier")


def _slow_weighted_mean(uploads, weights, keys):
    out = {}
    for k in keys:
        acc = np.zeros(np.shape(uploads[0][k]), dtype=np.float64)
        for u, w in zip(uploads, weights, strict=True):
            acc += w * np.asarray(u[k], dtype=np.float64)
        out[k] = acc / sum(weights)
    return out


def test_average_body_against_a_loop_and_ignores_head():
    rng = np.random.default_rng(1)
    uploads = []
    for i in range(4):
        uploads.append({
            "features.0.weight": rng.normal(size=(3, 2)).astype(np.float32),
            "features.1.running_mean": rng.normal(size=3).astype(np.float32),
            "features.1.num_batches_tracked": np.array(10 * (i + 1), dtype=np.int64),
            "head.weight": rng.normal(size=(2, 3)).astype(np.float32),
        })
    weights = [5.0, 1.0, 2.0, 7.0]
    got = average_body(uploads, weights, HEAD_KEYS)
    assert set(got) == {"features.0.weight", "features.1.running_mean", "features.1.num_batches_tracked"}
    ref = _slow_weighted_mean(uploads, weights, ["features.0.weight", "features.1.running_mean",
                                                 "features.1.num_batches_tracked"])
    np.testing.assert_allclose(got["features.0.weight"], ref["features.0.weight"], rtol=1e-6)
    np.testing.assert_allclose(got["features.1.running_mean"], ref["features.1.running_mean"], rtol=1e-6)
    assert got["features.1.num_batches_tracked"] == round(ref["features.1.num_batches_tracked"])
    assert got["features.0.weight"].dtype == np.float32
    plain = average_body(uploads, [1.0] * 4, HEAD_KEYS)
    np.testing.assert_allclose(plain["features.0.weight"],
                               sum(u["features.0.weight"].astype(np.float64) for u in uploads) / 4,
                               rtol=1e-6)
    with pytest.raises(ValueError, match="same body"):
        average_body([uploads[0], {"features.0.weight": uploads[1]["features.0.weight"]}], [1, 1], HEAD_KEYS)


def test_head_digest_detects_any_change():
    head = {"head.weight": np.ones((2, 3), np.float32), "head.bias": np.zeros(2, np.float32)}
    changed = {**head, "head.bias": np.array([0.0, np.float32(1e-30)], np.float32)}
    assert head_digest(head) == head_digest({k: v.copy() for k, v in head.items()})
    assert head_digest(head) != head_digest(changed)


@pytest.mark.parametrize("rounds", [1, 2, 3, 7, 10, 32, 80, 320])
def test_step_lr_scale_matches_the_authors_loop(rounds):
    """The authors' main_fed.py: lr used in round iter, then `if iter+1 in [R//2, 3R//4]: lr*=0.1`."""
    lr, used = 1.0, []
    for it in range(rounds):
        used.append(lr)
        if (it + 1) in [rounds // 2, (rounds * 3) // 4]:
            lr *= 0.1
    ours = [step_lr_scale(r, rounds, [0.5, 0.75], 0.1) for r in range(1, rounds + 1)]
    np.testing.assert_allclose(ours, used, rtol=1e-12)
    with pytest.raises(ValueError, match="lr_milestones"):
        step_lr_scale(1, rounds, [160], 0.1)


# ----------------------------------------------------------------- federated drive
@pytest.fixture(scope="module")
def setup():
    run = compose_run(
        {"strategy": "fedbabu", "dataset": "digits-shards", "rounds": "3"},
        ["dataset.clients_per_domain=3", "train.weight_decay=5e-4", "train.momentum=0.9",
         "finetune.epochs=1", "finetune.curve=true", "finetune.curve_epochs=[0,1,2]",
         # the paper's text (the defaults are the authors' code: see the test after the drive)
         "strategy.weighted=true", "strategy.head_init=orthogonal"],
    )
    data = load_federated_data(run.cfg.dataset, int(run.cfg.seed))
    return run, data


def _rnd(run: ComposedRun, data, cid, server_round, config):
    return ClientRound(settings=run.settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=torch.device("cpu"),
                       server_round=server_round, message_config=dict(config))


def test_three_rounds_head_bitwise_fixed_body_changes(setup):
    run, data = setup
    cfg = run.cfg
    assert float(cfg.train.weight_decay) > 0 and float(cfg.train.momentum) > 0
    assert data.client_ids == ["0", "1", "2"]
    strategy = build_strategy(cfg, data)
    trainer = FedBABUTrainer(cfg, run.settings)
    head0 = {k: v.copy() for k, v in strategy.head.items()}
    assert sorted(head0) == sorted(HEAD_KEYS)
    w = head0["head.weight"].astype(np.float64)
    np.testing.assert_allclose(w @ w.T, np.eye(w.shape[0]), atol=1e-5)  # orthogonal (the paper's option)
    body0, _ = split_head(strategy.global_arrays, strategy.head_keys)
    full_bytes = num_bytes(strategy.global_arrays)
    states: dict[str, dict] = {c: {} for c in data.client_ids}
    for r in (1, 2, 3):
        updates = []
        for i, cid in enumerate(data.client_ids):
            payload = strategy.payload_for(cid)
            # the head travels only until the client has stored it
            assert (set(HEAD_KEYS) <= set(payload)) == (r == 1)
            rnd = _rnd(run, data, cid, r, strategy.train_config)
            res = trainer.fit(rnd, payload, states[cid])
            states[cid] = res.state
            stored = unprefixed(res.state, HEAD_PREFIX)
            for k in HEAD_KEYS:  # client copy bitwise identical to the server's initial head
                assert np.array_equal(stored[k], head0[k]) and stored[k].dtype == head0[k].dtype
            assert not set(res.upload) & set(HEAD_KEYS)
            assert num_bytes(res.upload) == full_bytes - num_bytes(head0)  # FedAvg uploads full_bytes
            updates.append(ClientUpdate(cid, i, res.upload, res.num_examples, dict(res.metrics)))
        before, _ = split_head(strategy.global_arrays, strategy.head_keys)
        strategy.aggregate_updates(TrainRound.handed(r), updates)
        # server: head bitwise unchanged; body = sample-weighted mean computed independently
        for k in HEAD_KEYS:
            assert np.array_equal(strategy.global_arrays[k], head0[k])
        keys = [k for k in before if np.issubdtype(before[k].dtype, np.floating)]
        ref = _slow_weighted_mean([u.arrays for u in updates], [u.num_examples for u in updates], keys)
        for k in keys:
            np.testing.assert_allclose(strategy.global_arrays[k], ref[k], rtol=1e-5, atol=1e-7)
    body3, _ = split_head(strategy.global_arrays, strategy.head_keys)
    changed = [k for k in body0 if np.issubdtype(body0[k].dtype, np.floating)
               and not np.array_equal(body0[k], body3[k])]
    assert len(changed) >= len([k for k in body0 if k.endswith("weight")]) - 1  # the body trained
    assert strategy.head_acked == {"0", "1", "2"}
    # Control: with the same settings a FedAvg client does move the head (so the check above can fail).
    fedavg = compose_run({"strategy": "fedavg", "dataset": "digits-shards", "rounds": "3"},
                         ["dataset.clients_per_domain=3", "train.weight_decay=5e-4",
                          "train.momentum=0.9"])
    fedavg_res = ClientTrainer(fedavg.cfg, fedavg.settings).fit(_rnd(fedavg, data, "0", 1, {}), strategy.payload_for(None), {})
    assert not np.array_equal(fedavg_res.upload["head.weight"], head0["head.weight"])

    # Evaluation: initial (global) accuracy = curve at 0 epochs; accuracy = after fine-tuning.
    final = {**strategy.train_config, "final": True}
    out = trainer.evaluate(_rnd(run, data, "0", 3, final), strategy.payload_for("0"), states["0"])
    assert {"ft_acc_e0", "ft_acc_e1", "ft_acc_e2", "global_accuracy", "ft_accuracy"} <= set(out)
    assert out["ft_acc_e0"] == out["global_accuracy"]
    assert out["accuracy"] == out["ft_accuracy"] == out["ft_acc_e1"]
    assert out["ft_accuracy"] > out["global_accuracy"]  # fine-tuning the random head helps

    # A client whose state was lost fails with a clear error and is sent the head again.
    with pytest.raises(HeadMissingError, match="no stored head"):
        trainer.fit(_rnd(run, data, "1", 4, strategy.train_config), strategy.payload_for("1"), {})
    strategy._forget_failed(["1"])
    assert set(HEAD_KEYS) <= set(strategy.payload_for("1"))
    bad = {**states["2"], HEAD_PREFIX + "head.bias": np.ones_like(head0["head.bias"])}
    with pytest.raises(HeadMissingError, match="does not match"):
        trainer.fit(_rnd(run, data, "2", 4, strategy.train_config), strategy.payload_for("2"), bad)
    assert strategy.train_config[HEAD_DIGEST_KEY] == head_digest(head0)


def test_defaults_are_the_authors_code_plain_mean_and_default_head_init(setup):
    """The authors' federated code: PyTorch's nn.Linear head init and a plain mean of the
    bodies, whatever the client sizes (the paper's text, weighted and orthogonal, is the option)."""
    run, data = setup
    cfg2 = compose_config({"strategy": "fedbabu", "dataset": "digits-shards", "rounds": "3"},
                          ["dataset.clients_per_domain=3"])
    assert (cfg2.strategy.weighted, cfg2.strategy.head_init) == (False, "default")
    strategy = build_strategy(cfg2, data)
    torch.manual_seed(int(cfg2.seed))
    from learning.models import build_model
    model = build_model(cfg2.model, data.input_shape, data.num_classes)
    assert np.array_equal(strategy.head["head.weight"], model.head.weight.detach().numpy())
    rng = np.random.default_rng(0)
    body, _ = split_head(strategy.global_arrays, strategy.head_keys)
    ups = [ClientUpdate(str(i), i, {k: (v + rng.normal(size=v.shape)).astype(v.dtype)
                                    if np.issubdtype(v.dtype, np.floating) else v
                                    for k, v in body.items()}, n, {})
           for i, n in enumerate([1, 100, 1000])]
    strategy.aggregate_updates(TrainRound.handed(1), ups)
    k = "features.0.weight"
    np.testing.assert_allclose(strategy.global_arrays[k],
                               sum(u.arrays[k].astype(np.float64) for u in ups) / 3, rtol=1e-5)


def test_fedprox_body_only_freezes_head(setup):
    run, data = setup
    run2 = compose_run({"strategy": "fedprox", "dataset": "digits-shards", "rounds": "3"},
                       ["dataset.clients_per_domain=3", "strategy.body_only=true", "strategy.mu=0.1"])
    cfg2 = run2.cfg
    strategy = build_strategy(cfg2, data)
    assert type(strategy) is FedBABU and strategy.name == "fedprox", "body_only must select FedBABU's server rule"
    assert strategy.head_init == "orthogonal"
    payload = strategy.payload_for("0")
    trainer = trainer_class(run2.settings.method)(cfg2, run2.settings)
    assert isinstance(trainer, FedProxBABUTrainer) and trainer.finetunes
    res = trainer.fit(_rnd(run2, data, "0", 1, {}), payload, {})
    assert not set(res.upload) & set(HEAD_KEYS)
    assert not np.array_equal(res.upload["features.0.weight"], payload["features.0.weight"])
    for k in HEAD_KEYS:  # the head is FedBABU's fixed head and stays bitwise fixed
        np.testing.assert_array_equal(res.state["head/" + k], strategy.head[k])
    plain = compose_run({"strategy": "fedprox"})
    assert trainer_class(plain.settings.method) is FedProxTrainer
    assert not FedProxTrainer(plain.cfg, plain.settings).finetunes


# ----------------------------------------------------------------- results + configs
def test_summary_finetune_curve_is_numerically_ordered(tmp_path):
    run = compose_run({"strategy": "fedbabu", "results-root": str(tmp_path)})
    ev = {"accuracy_mean": 0.9, "accuracy_min": 0.8, "accuracy_std": 0.1, "val_accuracy_mean": 0.9}
    for e, a in [(10, 0.95), (0, 0.3), (2, 0.8), (1, 0.7), (5, 0.9)]:
        ev.update({f"ft_acc_e{e}_mean": a, f"ft_acc_e{e}_min": a, f"ft_acc_e{e}_std": 0.0})
    rounds = [{"round": 1, "evaluate": ev, "clients": {"0": {"accuracy": 0.9}}}]
    summary = build_summary(run.settings, rounds, {"0": {"num_train": 5}}, "completed")
    assert list(summary["finetune_curve"]) == ["0", "1", "2", "5", "10"]
    assert summary["finetune_curve"]["10"] == 0.95


@pytest.mark.parametrize("tau,rounds", [(1, 320), (4, 80), (10, 32)])
def test_paper_experiment_configs_compose(tau, rounds, tmp_path):
    # each file with its defaults (f=0.1, s=10) and with the other corner of Table 4 overridden
    for strategy, f, s in (("fedavg-ft", "0.1", "10"), ("fedbabu", "1.0", "100")):
        cfg = compose_config({"experiment": f"fedbabu-cifar100-tau{tau}", "strategy": strategy},
                             [f"dataset.root={tmp_path}"]
                             + ([] if s == "10" else [f"fraction_train={f}", f"dataset.shards_per_client={s}"]))
        assert cfg.strategy.name == strategy
        assert int(cfg.rounds) * int(cfg.train.local_epochs) == 320 and int(cfg.rounds) == rounds
        assert cfg.dataset.name == "cifar100" and cfg.model.name == "mobilenet"
        assert int(cfg.dataset.clients_per_domain) == 100 and cfg.dataset.partition == "shard"
        assert int(cfg.dataset.shards_per_client) == int(s) and float(cfg.fraction_train) == float(f)
        assert cfg.train.lr == 0.1 and cfg.train.lr_schedule == "step"
        assert list(cfg.train.lr_milestones) == [0.5, 0.75]
        assert cfg.finetune.epochs == 5 and cfg.finetune.lr == 1e-3 and cfg.finetune.batch_size == 50


def test_table5_and_digits_experiment_configs_compose(tmp_path):
    t5 = compose_config({"experiment": "fedbabu-cifar100-table5", "strategy": "fedbabu"},
                        [f"dataset.root={tmp_path}"])
    assert t5.finetune.curve and list(t5.finetune.curve_epochs) == [0, 1, 2, 3, 4, 5, 10]
    assert int(t5.train.local_epochs) == 10 and float(t5.fraction_train) == 0.1
    digits = compose_config({"experiment": "fedbabu-digits", "strategy": "fedbabu"})
    assert digits.dataset.name == "digits-shards" and digits.finetune.curve


# ----------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_end_to_end_pflower_run(tmp_path):
    root = tmp_path / "runs"
    proc = pflower("run", "strategy=fedbabu", "dataset=digits-shards", "rounds=2", "run_name=babu-e2e",
                   f"results_root={root}", "dataset.clients_per_domain=3", "finetune.epochs=1",
                   "finetune.curve=true", "finetune.curve_epochs=[0,1,2]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = root / "babu-e2e"
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["finetune_curve"]) == ["0", "1", "2"]
    assert (run / "finetune_curve.png").exists()
    assert summary["ft_accuracy_mean"] == summary["accuracy_mean"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    up = [lines[i]["communication"]["bytes_up"] for i in (0, 1)]
    down = [lines[i]["communication"]["bytes_down"] for i in (0, 1)]
    assert all(v == summary["body_bytes"] for u in up for v in u.values())
    assert all(v == summary["body_bytes"] + summary["head_bytes"] for v in down[0].values())
    assert all(v == summary["body_bytes"] for v in down[1].values())  # head sent once


# ---------------------------------------------------------------- the authors' settings (issue 13)
def test_fedbabu_models_normalise_with_batch_statistics():
    """cnn4 and mobilenet default to BN without running statistics (track_running_stats=False,
    as the authors): no running_mean/var in the state, and eval mode uses the batch's
    statistics (a batch scaled by 2 gives the same output: each BN divides the scale out)."""
    from common.config import compose_config
    from learning.models import build_model

    for name in ("cnn4", "mobilenet"):
        cfg = compose_config({"model": name})
        model = build_model(cfg.model, (3, 32, 32), 10).eval()
        assert not any("running" in k or "num_batches" in k for k in model.state_dict()), name
        x = torch.randn(8, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(model(x), model(2.0 * x), atol=1e-3, rtol=1e-3)
    with_stats = build_model(compose_config({"model": "cnn4"}, ["model.bn_running_stats=true"]).model,
                             (3, 32, 32), 10)
    assert any("running_mean" in k for k in with_stats.state_dict())


def test_orthogonal_head_gain_option():
    from strategies.fedbabu_math import init_head

    head = {"head.weight": np.zeros((10, 64), np.float32), "head.bias": np.ones(10, np.float32)}
    one = init_head(head, seed=3)["head.weight"]
    two = init_head(head, seed=3, gain=2 ** 0.5)["head.weight"]
    np.testing.assert_allclose(one @ one.T, np.eye(10), atol=1e-5)      # orthonormal rows
    np.testing.assert_allclose(two, one * 2 ** 0.5, rtol=1e-5)           # same draw, scaled


def test_cifar_configs_use_the_authors_training_settings():
    from common.config import compose_config

    for tau in ("tau1", "tau4", "tau10"):
        cfg = compose_config({"experiment": f"fedbabu-cifar100-{tau}"}, ["dataset.root=/tmp"])
        assert cfg.train.weight_decay == 0.0 and cfg.dataset.augment == "crop-flip"


def test_crop_flip_augmentation_crops_and_flips_the_image():
    from torch.utils.data import TensorDataset

    from learning.datasets.sources import CropFlip

    img = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(1, 3, 8, 8) + 1
    aug = CropFlip(TensorDataset(img, torch.tensor([7])), pad=2)
    torch.manual_seed(0)
    seen = set()
    for _ in range(60):
        x, y = aug[0]
        assert x.shape == (3, 8, 8) and int(y) == 7
        # every output is a shifted (and possibly mirrored) window of the zero-padded image
        padded = torch.nn.functional.pad(img[0], (2, 2, 2, 2))
        found = [(t, c, f) for t in range(5) for c in range(5) for f in (False, True)
                 if torch.equal(x, torch.flip(padded[:, t:t + 8, c:c + 8], [-1]) if f
                                else padded[:, t:t + 8, c:c + 8])]
        assert found
        seen.add(found[0])
    assert len(seen) > 10 and {f for _, _, f in seen} == {False, True}
