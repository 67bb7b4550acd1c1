"""FEDORA glue: the client trainer (selective lambda, penalty, basis upload, privacy of
the reply), the server strategy (graph, propagation, checkpoint state, files), the
imbalanced data option, the experiment configs, and one short end-to-end run.

The math itself (propagate vs the iterative form, subspace_similarity vs independent
principal angles, selective_lambda) is tested in tests/test_fedora_math.py.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FakeGrid, make_strategy, pflower

import strategies.fedora_math as fm
from client.fedora import BASIS_STATE, FEDORATrainer
from client.round import ClientRound
from client.trainer import MODEL_PREFIX
from common.config import ComposedRun, compose_config, compose_run
from learning.datasets.config import num_clients
from learning.datasets.federated import build_federated_data, load_federated_data
from learning.datasets.sources import DatasetError
from learning.models import build_model
from learning.params import get_arrays
from learning.training import OptimConfig, train_epochs
from strategies.base import ClientUpdate, RunSettings, TrainRound
from strategies.fedora import FEDORA
from strategies.fedora_math import BASIS_ARRAY, BASIS_RECORD, NEED_BASIS_KEY

REPO = Path(__file__).resolve().parent.parent
# These tests were written for the paper's text; the default is the authors' code forms
# (test_defaults_are_the_authors_code_forms), so they name the paper's forms explicitly.
PAPER_FORMS = {"similarity": "paper", "basis_labels": False, "lambda_form": "paper", "penalty": "loss",
               "lambda_max": "auto"}
PAPER = [f"strategy.{k}={str(v).lower()}" for k, v in PAPER_FORMS.items()]
BASE = ["strategy=fedora", "dataset=digits-rotated", "model=mlp", *PAPER]


def _run(*extra: str, root: Path | None = None) -> ComposedRun:
    ov = [*BASE, "train.local_epochs=1", *extra]
    if root is not None:
        ov += [f"results_root={root}", "run_name=t"]
    return compose_run({}, ov)


def _round(run: ComposedRun, cid: str = "0", server_round: int = 1, need: str = "") -> ClientRound:
    data = load_federated_data(run.cfg.dataset, int(run.cfg.seed))
    return ClientRound(settings=run.settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=torch.device("cpu"),
                       server_round=server_round, message_config={NEED_BASIS_KEY: need})


def _model(cfg, seed: int):
    torch.manual_seed(seed)
    return build_model(cfg.model, (1, 8, 8), 10)


def _stack(ds) -> tuple[np.ndarray, np.ndarray]:
    xs = torch.stack([ds[i][0] for i in range(len(ds))])
    ys = np.array([int(ds[i][1]) for i in range(len(ds))])
    return xs.reshape(len(xs), -1).numpy().astype(np.float64), ys


def _val_loss(model, ds) -> float:
    """Mean cross-entropy over the split, written out by hand."""
    model.eval()
    with torch.no_grad():
        total = 0.0
        for i in range(len(ds)):
            x, y = ds[i]
            logits = model(x.unsqueeze(0))[0]
            total += float(torch.logsumexp(logits, 0) - logits[int(y)])
    return total / len(ds)


def test_issue_api_exposed_in_strategies_fedora():
    import strategies.fedora as sf

    rng = np.random.default_rng(0)
    theta, w = rng.standard_normal((4, 3)), rng.uniform(0.1, 1, (4, 4))
    np.testing.assert_allclose(sf.propagate(theta, w, 4.0), fm.propagate(theta, w, 4.0))
    bases = [np.linalg.qr(rng.standard_normal((6, 2)))[0] for _ in range(3)]
    np.testing.assert_allclose(sf.subspace_similarity(bases), fm.subspace_similarity(bases))


# ------------------------------------------------------------------ client trainer
@pytest.mark.parametrize("form", ["paper", "code"])
@pytest.mark.parametrize("propagated_better", [True, False])
def test_trainer_lambda_follows_selective_rule(monkeypatch, form, propagated_better):
    run = _run(f"strategy.lambda_form={form}", "strategy.penalty=loss")   # the penalty inside the loss
    cfg = run.cfg
    rnd = _round(run)
    weak, strong = _model(cfg, 1), _model(cfg, 2)
    train_epochs(strong, rnd.data.train, OptimConfig(lr=0.05, momentum=0.9, weight_decay=5e-4, epochs=5, batch_size=16),
                 torch.device("cpu"), seed=0)
    own, hat = (weak, strong) if propagated_better else (strong, weak)
    state = {MODEL_PREFIX + k: v for k, v in get_arrays(own).items()}
    payload = get_arrays(hat)

    diff = _val_loss(own, rnd.data.val) - _val_loss(hat, rnd.data.val)
    assert (diff > 0) == propagated_better
    if form == "paper":
        want = max(1e-8, diff)
    else:
        want = 0.0 if diff < 0 else math.exp(diff / 2)

    seen = {}
    import client.trainer as cf  # the round's train step calls train_epochs from here

    real = cf.train_epochs

    def spy(model, ds, opt, device, seed=0, trainable=None, extra_loss=None, optimizer=None,
            after_step=None, dpsgd=None):
        # the penalty the trainer will minimise, evaluated on theta_k before training
        seen["extra"] = None if extra_loss is None else float(
            extra_loss(model, None, None, torch.zeros(1)).detach())
        seen["start"] = get_arrays(model)
        return real(model, ds, opt, device, seed=seed, trainable=trainable,
                    extra_loss=extra_loss, optimizer=optimizer, after_step=after_step, dpsgd=dpsgd)

    monkeypatch.setattr(cf, "train_epochs", spy)
    result = FEDORATrainer(cfg, run.settings).fit(rnd, payload, state)
    lam = result.metrics["lambda"]
    assert lam == pytest.approx(want, rel=1e-5, abs=1e-9)
    assert result.metrics["val_loss_own"] - result.metrics["val_loss_propagated"] == \
        pytest.approx(diff, rel=1e-5)
    # training starts from theta_k (the private state), not from the payload
    for k, v in get_arrays(own).items():
        np.testing.assert_array_equal(seen["start"][k], v)
    # the penalty is lambda * ||theta_k - theta_hat_k||^2
    sq = sum(float(np.sum((get_arrays(own)[k].astype(np.float64) - payload[k]) ** 2))
             for k in payload)
    if want == 0.0:
        assert seen["extra"] is None
    else:
        assert seen["extra"] == pytest.approx(want * sq, rel=1e-4)
    # theta_k is the durable state and the upload
    for k, v in result.upload.items():
        np.testing.assert_array_equal(result.state[MODEL_PREFIX + k], v)


def test_penalty_pulls_towards_propagated_parameters():
    """With a large lambda (eps floor = 50) theta_k ends much closer to theta_hat_k."""
    dist = {}
    for eps in (1e-8, 50.0):
        run = _run(f"strategy.eps={eps}", "train.lr=0.005", "train.momentum=0",
                   "train.local_epochs=3")
        cfg = run.cfg
        rnd = _round(run)
        own, hat = _model(cfg, 1), _model(cfg, 3)
        state = {MODEL_PREFIX + k: v for k, v in get_arrays(own).items()}
        payload = get_arrays(hat)
        up = FEDORATrainer(cfg, run.settings).fit(rnd, payload, state).upload
        dist[eps] = math.sqrt(sum(float(np.sum((up[k] - payload[k]) ** 2)) for k in payload))
    start = math.sqrt(sum(float(np.sum((get_arrays(_model(cfg, 1))[k] - payload[k]) ** 2))
                          for k in payload))
    assert dist[50.0] < 0.2 * start
    assert dist[1e-8] > 0.8 * start


def test_first_round_without_state_starts_from_payload_and_basis_cached():
    run = _run()
    cfg = run.cfg
    rnd = _round(run, "3", need="1,3,5")
    init = get_arrays(_model(cfg, 0))
    result = FEDORATrainer(cfg, run.settings).fit(rnd, init, {})
    assert result.metrics["lambda"] == pytest.approx(1e-8)  # theta_k == theta_hat_k
    assert set(result.extra) == {BASIS_RECORD}
    u = result.extra[BASIS_RECORD][BASIS_ARRAY]
    np.testing.assert_array_equal(result.state[BASIS_STATE], u)
    # not asked -> no basis in the reply; the cached basis is reused
    rnd2 = _round(run, "3", server_round=2, need="1,5")
    result2 = FEDORATrainer(cfg, run.settings).fit(rnd2, result.upload, result.state)
    assert result2.extra == {}
    np.testing.assert_array_equal(result2.state[BASIS_STATE], u)


def _message(content, node: int = 7):
    from flwr.app import Message, Metadata

    md = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=node,
                  reply_to_message_id="", group_id="", created_at=time.time(), ttl=600.0,
                  message_type="train")
    return Message(content=content, metadata=md)


def test_client_app_reply_carries_no_raw_samples(tmp_path):
    """The real ClientApp reply: model arrays + the d x p basis + scalar metrics, nothing
    else; the basis is the top right singular vector of the client's inputs."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from client.app import train
    from common.protocol import (
        ARRAYS_KEY,
        CONFIG_KEY,
        METRICS_KEY,
        PACKED_ARRAY,
        PACKED_INDEX,
        from_record,
        pack_arrays,
        to_record,
    )

    run_config = {"strategy": "fedora", "dataset": "digits-rotated", "model": "mlp",
                  "results-root": str(tmp_path), "run-name": "t", "seed": 0,
                  "overrides": " ".join(["train.local_epochs=1", *PAPER])}
    cfg = compose_config(run_config)
    model = build_model(cfg.model, (1, 8, 8), 10)
    init = get_arrays(model)
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 2, "num-partitions": 12},
                      state=RecordDict(), run_config=run_config)
    replies = []
    for rnd, need in ((1, ",".join(str(i) for i in range(12))), (2, "")):
        content = RecordDict({ARRAYS_KEY: to_record(init), CONFIG_KEY: ConfigRecord(
            {"server-round": rnd, "run-name": "t", NEED_BASIS_KEY: need})})
        replies.append(train(_message(content), context).content)

    data = load_federated_data(cfg.dataset, 0).client("2")
    x, _ = _stack(data.train)
    x = x * 0.5 + 0.5   # basis_inputs=unit: the images in [0, 1], as the authors' code
    first, second = replies
    assert set(first.array_records) == {ARRAYS_KEY, BASIS_RECORD}
    assert set(second.array_records) == {ARRAYS_KEY}          # sent once
    assert set(first.config_records) == set() and set(first.metric_records) == {METRICS_KEY}
    arrays = from_record(first.array_records[ARRAYS_KEY])
    assert {k: a.shape for k, a in arrays.items()} == {k: a.shape for k, a in init.items()}
    basis = from_record(first.array_records[BASIS_RECORD])
    assert set(basis) == {BASIS_ARRAY} and basis[BASIS_ARRAY].shape == (64, 1)
    # nothing else travels: the model's arrays are exactly the packed bytes (plus their
    # index), the basis record is d * p floats
    model_record = first.array_records[ARRAYS_KEY]
    assert set(model_record) == {PACKED_ARRAY, PACKED_INDEX}
    np.testing.assert_array_equal(model_record[PACKED_ARRAY].numpy(), pack_arrays(arrays)[0])
    assert sum(a.size for a in basis.values()) == 64
    # the basis is the top right singular vector of X (computed independently here) ...
    v = np.linalg.svd(x, full_matrices=False)[2][0]
    assert abs(float(basis[BASIS_ARRAY][:, 0] @ v)) == pytest.approx(1.0, abs=1e-5)
    # ... and not any one training sample
    u = basis[BASIS_ARRAY][:, 0]
    cos = np.abs(x @ u) / np.linalg.norm(x, axis=1)
    assert cos.max() < 0.999
    for key in first.metric_records[METRICS_KEY]:
        assert isinstance(first.metric_records[METRICS_KEY][key], (int, float))


# ------------------------------------------------------------------ server strategy
def _strategy(num: int, tmp_path: Path | None = None, **options):
    opts = {**dict(compose_config({"strategy": "fedora"}).strategy), **PAPER_FORMS, "top_k": None, **options}
    init = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32),
            "n": np.array(0, np.int64)}
    return make_strategy(FEDORA, init, [str(i) for i in range(num)], options=opts, min_train_clients=1,
                         run_dir=tmp_path / "run" if tmp_path is not None else None)


def _update(cid: str, rng, basis: np.ndarray | None) -> ClientUpdate:
    arrays = {"w": rng.standard_normal((3, 2)).astype(np.float32),
              "b": rng.standard_normal(3).astype(np.float32), "n": np.array(int(cid), np.int64)}
    extra = {BASIS_RECORD: {BASIS_ARRAY: basis}} if basis is not None else {}
    return ClientUpdate(cid, int(cid), arrays, 10, {"lambda": 0.5}, extra)


def test_strategy_waits_for_all_bases_then_propagates(tmp_path):
    num = 5
    rng = np.random.default_rng(0)
    bases = [np.linalg.qr(rng.standard_normal((6, 1)))[0] for _ in range(num)]
    s = _strategy(num, tmp_path)
    assert s.missing_bases() == [str(i) for i in range(num)]
    first = [_update(str(i), rng, bases[i]) for i in range(3)]
    notes = s.aggregate_updates(TrainRound.handed(1), first)["fedora"]
    # clients 3, 4 not seen yet: no graph, every replier gets its own parameters back
    assert s.w is None and s.missing_bases() == ["3", "4"]
    assert notes["propagated"] is False and notes["missing_bases"] == ["3", "4"]
    for u in first:
        for k in u.arrays:
            np.testing.assert_array_equal(s.payload_for(u.client_id)[k], u.arrays[k])
    assert not (tmp_path / "run" / "similarity.npy").exists()

    second = [_update(str(i), rng, bases[i]) for i in (3, 4)] + [_update("0", rng, None)]
    notes = s.aggregate_updates(TrainRound.handed(2), second)["fedora"]
    np.testing.assert_allclose(s.w, fm.subspace_similarity(bases))
    latest = {u.client_id: u.arrays for u in first}
    latest.update({u.client_id: u.arrays for u in second})
    for key in ("w", "b"):
        theta = np.stack([latest[str(i)][key].reshape(-1) for i in range(num)]).astype(np.float64)
        want = fm.propagate(theta, s.w, 4.0)
        for i in range(num):
            got = s.payload_for(str(i))[key]
            assert got.dtype == np.float32
            np.testing.assert_allclose(got.reshape(-1), want[i], rtol=1e-5, atol=1e-6)
    for i in range(num):  # integer buffers are not propagated
        assert int(s.payload_for(str(i))["n"]) == i
    run = tmp_path / "run"
    np.testing.assert_allclose(np.load(run / "similarity.npy"), s.w)
    report = json.loads((run / "similarity.json").read_text())
    assert report["clients"] == [str(i) for i in range(num)]
    np.testing.assert_allclose(report["cosine_sum"], fm.subspace_similarity(bases, self_loops=True))
    assert (run / "similarity.png").stat().st_size > 1000
    assert notes["propagated"] is True and notes["bases_known"] == num
    assert s.summary_extras()["fedora"]["graph_built"] is True


def test_strategy_code_form_and_bad_basis():
    num = 4
    rng = np.random.default_rng(1)
    bases = [np.linalg.qr(rng.standard_normal((6, 1)))[0] for _ in range(num)]
    s = _strategy(num, similarity="code")
    bad = _update("3", rng, np.ones((6, 1)))  # not orthonormal
    notes = s.aggregate_updates(TrainRound.handed(1), [_update(str(i), rng, bases[i]) for i in range(3)] + [bad])
    assert s.w is None and s.missing_bases() == ["3"]
    assert "3" in notes["fedora"]["basis_rejected"]
    wrong_dim = _update("3", rng, np.linalg.qr(rng.standard_normal((7, 1)))[0])
    notes = s.aggregate_updates(TrainRound.handed(2), [wrong_dim])
    assert "rows" in notes["fedora"]["basis_rejected"]["3"]
    notes = s.aggregate_updates(TrainRound.handed(3), [_update("3", rng, bases[3])])
    assert "basis_rejected" not in notes["fedora"]   # a round's notes are that round's only
    np.testing.assert_allclose(s.w, fm.subspace_similarity(bases, form="code"))
    assert np.all((s.w > 0).sum(axis=1) == 2)  # the code's top-2 graph


def test_begin_train_asks_only_for_missing_bases(flower_task):
    rng = np.random.default_rng(2)
    s = _strategy(3)
    grid = FakeGrid(["0", "1", "2"])
    msgs = s.begin_train(1, {}, grid).messages
    assert {m.content.config_records["config"][NEED_BASIS_KEY] for m in msgs} == {"0,1,2"}
    s.aggregate_updates(TrainRound.handed(1), [_update("1", rng, np.eye(6)[:, :1])])
    msgs = s.begin_train(2, {}, grid).messages
    assert {m.content.config_records["config"][NEED_BASIS_KEY] for m in msgs} == {"0,2"}


def test_strategy_state_roundtrips_through_a_checkpoint(tmp_path):
    from server.checkpoint import load_checkpoint, save_checkpoint

    num = 4
    rng = np.random.default_rng(3)
    s = _strategy(num)
    s.aggregate_updates(TrainRound.handed(1), [_update(str(i), rng, np.linalg.qr(rng.standard_normal((6, 1)))[0])
                            for i in range(num)])
    groups, meta = s.state()
    save_checkpoint(tmp_path, 1, groups, {"x": 1})
    _, groups, _ = load_checkpoint(tmp_path, {"x": 1})
    r = _strategy(num)
    r.load_state(groups, meta)
    np.testing.assert_array_equal(r.w, s.w)
    np.testing.assert_array_equal(r.cosine_sum, s.cosine_sum)
    assert set(r.bases) == set(s.bases) and r.missing_bases() == []
    for cid in s.theta:
        for k in s.theta[cid]:
            np.testing.assert_array_equal(r.theta[cid][k], s.theta[cid][k])
            np.testing.assert_array_equal(r.personal[cid][k], s.personal[cid][k])
    # after resume, the next round propagates with the restored graph
    ups = [_update(str(i), rng, None) for i in range(num)]
    r.aggregate_updates(TrainRound.handed(2), ups)
    s.aggregate_updates(TrainRound.handed(2), ups)
    for cid in s.personal:
        np.testing.assert_allclose(r.personal[cid]["w"], s.personal[cid]["w"])


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="alpha"):
        _strategy(3, alpha=0)
    with pytest.raises(ValueError, match="similarity"):
        _strategy(3, similarity="cosine")
    with pytest.raises(ValueError, match="lambda_form"):
        _strategy(3, lambda_form="exp")


def test_in_process_federation_digits_rotated(tmp_path):
    """Real trainers + strategy for 3 rounds (no Flower): graph after round 1, every
    client gets its own theta_hat, lambda is recorded, accuracy improves."""
    run = _run(root=tmp_path)
    cfg = run.cfg
    data = load_federated_data(cfg.dataset, 0)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    s = FEDORA(initial_arrays=get_arrays(model), client_ids=data.client_ids,
               run=RunSettings.from_run_keys(run.settings.run, 1), method=run.settings.method, model=model, data=data)
    trainer = FEDORATrainer(cfg, run.settings)
    states: dict[str, dict] = {c: {} for c in data.client_ids}
    accs = []
    for rnd_no in (1, 2, 3):
        need = ",".join(s.missing_bases())
        updates = []
        for cid in data.client_ids:
            rnd = _round(run, cid, rnd_no, need)
            res = trainer.fit(rnd, s.payload_for(cid), states[cid])
            states[cid] = res.state
            updates.append(ClientUpdate(cid, int(cid), res.upload, res.num_examples, res.metrics,
                                        res.extra))
        notes = s.aggregate_updates(TrainRound.handed(rnd_no), updates)
        assert s.w is not None
        accs.append(np.mean([trainer.evaluate(_round(run, c, rnd_no), s.payload_for(c),
                                              states[c])["accuracy"] for c in data.client_ids]))
        assert set(notes["fedora"]["lambda"]) == set(data.client_ids)
    assert s.w.shape == (12, 12)
    key = next(iter(s.reference))
    hats = [s.payload_for(c)[key] for c in data.client_ids]
    assert not np.allclose(hats[0], hats[5])
    assert accs[-1] > accs[0]
    assert (tmp_path / "t" / "similarity.png").exists()


# ------------------------------------------------------------------ data and configs
def test_imbalanced_option_uncapped():
    cfg = compose_config({}, BASE)
    plain = dict(cfg.dataset)
    bal = build_federated_data(plain, 0)
    imb = build_federated_data({**plain, "imbalanced_client": 6, "imbalance_factor": 8}, 0)
    for cid in bal.client_ids:
        b, i = bal.clients[cid], imb.clients[cid]
        want = len(b.train) if cid == "6" else max(1, len(b.train) // 8)
        assert len(i.train) == want
        assert len(i.val) == len(b.val) and len(i.test) == len(b.test)
        assert set(i.train_ids) <= set(b.train_ids)
    assert len(imb.clients["6"].train) >= 7 * len(imb.clients["0"].train)


def test_imbalanced_option_capped_and_errors():
    cfg = compose_config({}, BASE)
    plain = {**dict(cfg.dataset), "samples_per_client": 40}
    bal = build_federated_data(plain, 0)
    imb = build_federated_data({**plain, "imbalanced_client": 2, "imbalance_factor": 3}, 0)
    full = build_federated_data({**plain, "samples_per_client": 0}, 0).clients["2"]
    sizes = {c: len(s.train) + len(s.val) + len(s.test) for c, s in imb.clients.items()}
    assert sizes["2"] == min(120, len(full.train) + len(full.val) + len(full.test)) > 100
    assert all(v == 40 for c, v in sizes.items() if c != "2")
    assert all(len(b.train) + len(b.val) + len(b.test) == 40 for b in bal.clients.values())
    for bad in ({"imbalanced_client": 12}, {"imbalanced_client": -2},
                {"imbalanced_client": 0, "imbalance_factor": 0}):
        with pytest.raises(DatasetError, match="imbalance"):
            build_federated_data({**plain, **bad}, 0)


@pytest.mark.parametrize("exp, dataset, clients, model", [
    ("fedora-rotated-mnist", "rotated-mnist", 36, "mlp"),
    ("fedora-rotated-fashion-mnist", "rotated-fashion-mnist", 36, "mlp"),
    ("fedora-rotated-mnist-imbalanced", "rotated-mnist", 36, "mlp"),
    ("fedora-cifar10", "cifar10", 10, "cnn"),
    ("fedora-digits-rotated", "digits-rotated", 12, "mlp"),
    ("fedora-digits-rotated-imbalanced", "digits-rotated", 12, "mlp"),
])
def test_experiment_configs_compose(tmp_path, exp, dataset, clients, model):
    # an existing folder (composition only, no loading); the bundled digits read none
    root = "dataset.root=" if dataset.startswith("digits") else f"dataset.root={tmp_path}"
    cfg = compose_config({}, [f"experiment={exp}", root])
    assert cfg.strategy.name == "fedora" and cfg.dataset.name == dataset
    assert cfg.model.name == model and num_clients(cfg.dataset) == clients
    t = cfg.train
    assert (t.lr, t.momentum, t.local_epochs, t.batch_size) == (5e-3, 0.9, 5, 64)
    if dataset.startswith("rotated"):
        n, v, te = cfg.dataset.samples_per_client, cfg.dataset.val_fraction, cfg.dataset.test_fraction
        assert round(n * (1 - v - te)) == 128 and round(n * v) == 64
        assert list(cfg.model.hidden) == [128, 128]
        angles = [int(d.split("-")[1]) for d in cfg.dataset.domains]
        assert angles == list(range(0, 360, 10))
    if exp.endswith("imbalanced"):
        assert cfg.dataset.imbalanced_client >= 0 and cfg.dataset.imbalance_factor > 1
    # the baselines run on the same setting
    other = compose_config({}, [f"experiment={exp}", root, "strategy=local"])
    assert other.strategy.name == "local" and other.train.lr == 5e-3


# ------------------------------------------------------------------ end to end
@pytest.mark.e2e
def test_pflower_run_fedora_end_to_end(tmp_path):
    proc = pflower("run", "strategy=fedora", "dataset=digits-rotated", "model=mlp", "rounds=2",
                   f"results_root={tmp_path}", "run_name=e2e", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "e2e"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "fedora" and len(summary["clients"]) == 12
    assert summary["fedora"]["graph_built"] is True
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["fedora"]["propagated"] for r in rounds] == [True, True]
    # the basis travelled once: round 2 uploads are exactly the model (smaller than round 1);
    # by default (the authors' code) it spans the 64 inputs and the 10 one-hot labels, float64
    up1, up2 = (sum(r["communication"]["bytes_up"].values()) for r in rounds)
    assert up1 - up2 == 12 * (64 + 10) * 8
    assert np.load(run / "similarity.npy").shape == (12, 12)
    assert (run / "similarity.png").exists()


def test_compare_r_acc_and_ptr_against_local(tmp_path):
    """R-Acc = mean_k (acc_k - acc_k^local) / acc_k^local, PTR = share of clients > Local."""
    from ops.compare import compare_runs, relative_to_local

    def run(name, strategy, seed, accs):
        d = tmp_path / name
        d.mkdir()
        summary = {"strategy": strategy, "dataset": "digits-rotated", "model": "mlp", "seed": seed,
                   "accuracy_mean": float(np.mean(accs)), "accuracy_min": float(min(accs)),
                   "best_accuracy_mean": float(np.mean(accs)),
                   "clients": {str(i): {"accuracy": a} for i, a in enumerate(accs)}}
        (d / "summary.json").write_text(json.dumps(summary))
        return d

    dirs = [run("l0", "local", 0, [0.5, 0.8, 0.4]), run("f0", "fedora", 0, [0.6, 0.8, 0.3]),
            run("l1", "local", 1, [0.5, 0.5, 0.5]), run("f1", "fedora", 1, [0.55, 0.6, 0.5])]
    r_acc, ptr = relative_to_local(
        {**json.loads((dirs[1] / "summary.json").read_text()), "_dir": "f0"},
        {**json.loads((dirs[0] / "summary.json").read_text()), "_dir": "l0"})
    assert r_acc == pytest.approx((0.2 + 0.0 - 0.25) / 3)
    assert ptr == pytest.approx(1 / 3)  # ties do not count as positive transfer
    table = compare_runs(dirs)
    row = next(line for line in table.splitlines() if line.startswith("| fedora"))
    want_r = np.mean([(0.2 + 0.0 - 0.25) / 3, (0.1 + 0.2 + 0.0) / 3])
    want_p = np.mean([1 / 3, 2 / 3])
    assert f"{want_r:.4f} ±" in row and f"{want_p:.4f} ±" in row
    local_row = next(line for line in table.splitlines() if line.startswith("| local"))
    assert "0.0000 ± 0.0000" in local_row


def _fit_distance(*overrides: str):
    """One FEDORA client fit from theta_k (seed 1) towards theta_hat_k (seed 3): the result,
    ||theta_k after - theta_hat_k|| and ||theta_k before - theta_hat_k|| (float64)."""
    run = _run(*overrides)
    own, hat = get_arrays(_model(run.cfg, 1)), get_arrays(_model(run.cfg, 3))
    result = FEDORATrainer(run.cfg, run.settings).fit(_round(run), hat, {MODEL_PREFIX + k: v for k, v in own.items()})

    def distance(arrays: dict) -> float:
        return math.sqrt(sum(float(np.sum((arrays[k].astype(np.float64) - hat[k]) ** 2)) for k in hat))

    return result, distance(result.upload), distance(own)


def test_an_unbounded_lambda_diverges_and_the_bound_keeps_the_client_stable():
    """Issue 13's divergence, reproduced: lambda = 50 (the eps floor stands in for a client
    whose own validation loss blew up) at lr 0.05 with momentum 0.9. Unbounded, the penalty's
    step 2 lr lambda = 5 > 2 (1 + momentum) overshoots theta_hat further every step and the
    model runs away; with ``lambda_max=auto`` (1 / (2 lr) = 10) it contracts towards theta_hat."""
    dist = {}
    for bound in ("null", "auto"):
        result, dist[bound], start = _fit_distance(
            "strategy.eps=50.0", f"strategy.lambda_max={bound}", "train.lr=0.05",
            "train.momentum=0.9", "train.local_epochs=3")
        assert result.metrics["lambda"] == (50.0 if bound == "null" else 10.0)
    assert not math.isfinite(dist["null"]) or dist["null"] > 10 * start    # ran away (x32 here)
    assert dist["auto"] < 0.8 * start                                        # pulled in


def test_the_decoupled_pull_is_bounded_so_that_it_never_passes_theta_hat():
    """The authors' decoupled pull, theta <- step(theta) - lr lambda (theta_0 - theta_hat), with
    lambda = 50 at lr 0.05 (lr lambda = 2.5: the code form's exp(diff / 2) reached 95 for a
    slow-learning client of a styled-digit tree): unbounded, every step lands farther from
    theta_hat on the other side and the client runs away; ``lambda_max=auto`` (the default)
    bounds lambda at 1 / lr = 20, a pull of at most the whole way to theta_hat."""
    dist = {}
    for bound in ("null", "auto"):
        result, dist[bound], start = _fit_distance(
            "strategy.penalty=decoupled", "strategy.eps=50.0", f"strategy.lambda_max={bound}",
            "train.lr=0.05", "train.momentum=0.9", "train.local_epochs=3")
        assert result.metrics["lambda"] == (50.0 if bound == "null" else 20.0)
    assert not math.isfinite(dist["null"]) or dist["null"] > 10 * start    # ran away
    assert dist["auto"] < 0.8 * start                                        # pulled in


def test_defaults_are_the_authors_code_forms(tmp_path):
    """Where the paper's text and the authors' code differ, the default is the code (issue 28)."""
    o = compose_config({"strategy": "fedora"}).strategy
    assert (o.similarity, o.top_k, o.basis_labels, o.lambda_form, o.penalty, o.lambda_max) == \
        ("code", None, True, "code", "decoupled", "auto")    # auto: ours, see the next test
    cfg = compose_config({}, ["experiment=fedora-mnist5k-rotated"])
    assert (cfg.dataset.name, cfg.rounds, cfg.dataset.input_range) == ("mnist5k-rotated", 500, "unit")
    assert (cfg.train.lr, cfg.train.local_epochs, cfg.train.batch_size) == (5e-3, 5, 64)


def test_unit_inputs_reach_the_model_and_the_basis_unchanged():
    """dataset.input_range=unit gives the model images in [0, 1] (the authors' scale); the
    basis (basis_inputs=unit) is then of the same images, not shifted twice."""
    sym, unit = _run(), _run("dataset.input_range=unit")
    xs, _ = _stack(_round(sym, cid="1").data.train)
    xu, _ = _stack(_round(unit, cid="1").data.train)
    assert xs.min() < -0.5 and xu.min() >= 0.0 and xu.max() <= 1.0
    np.testing.assert_allclose(xu, xs * 0.5 + 0.5, atol=1e-6)
    u_sym = FEDORATrainer(sym.cfg, sym.settings).basis(_round(sym, cid="1"), {})
    u_unit = FEDORATrainer(unit.cfg, unit.settings).basis(_round(unit, cid="1"), {})
    np.testing.assert_allclose(np.abs(u_unit), np.abs(u_sym), atol=1e-5)


def test_lambda_max_option_is_checked():
    from strategies.fedora_math import FEDORAOptions

    base = dict(compose_config({"strategy": "fedora"}).strategy)
    for bad in (0, -1.0, "big", float("nan")):
        with pytest.raises(ValueError, match="lambda_max must be auto"):
            FEDORAOptions(**{**base, "lambda_max": bad})
    assert FEDORAOptions(**{**base, "lambda_max": 2.5}).lambda_max == 2.5


@pytest.mark.parametrize(("inputs", "shift"), [("unit", True), ("normalised", False)])
def test_basis_inputs_option(inputs, shift):
    """The basis is the top right singular vector of the training inputs in [0, 1] (the
    code's) or of the model's normalised inputs, computed independently here."""
    run = _run(f"strategy.basis_inputs={inputs}")
    rnd = _round(run, cid="1")
    x, _ = _stack(rnd.data.train)
    if shift:
        x = x * 0.5 + 0.5
    u = FEDORATrainer(run.cfg, run.settings).basis(rnd, {})[:, 0]
    v = np.linalg.svd(x, full_matrices=False)[2][0]
    assert abs(float(u @ v)) == pytest.approx(1.0, abs=1e-5)


def test_decoupled_pull_uses_the_weights_before_each_step_as_the_authors_code():
    """The authors' ``LocalUpdateFEDORA.train``, written out here: per batch, ``w_0 = copy of the
    weights``; an SGD step (momentum 0.9, weight decay); then ``w = w - lr * lam * (w_0 - w_ref)``
    on every tensor with a reference. ``DecoupledProximal`` as ``train_epochs``' hook gives the same
    weights after several steps (the pull on the stepped weights instead, ``w - w_ref``, would not)."""
    from learning.training import DecoupledProximal

    torch.manual_seed(0)
    x, y = torch.randn(24, 3), torch.randint(0, 2, (24,))
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]
    ref = {"weight": torch.randn(2, 3)}                    # the bias has no reference: no pull
    lr, lam = 0.1, 1.5

    def fresh() -> torch.nn.Linear:
        torch.manual_seed(1)
        return torch.nn.Linear(3, 2)

    theirs = fresh()
    opt = torch.optim.SGD(theirs.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5)
    for xb, yb in batches:
        w_0 = {k: v.detach().clone() for k, v in theirs.named_parameters()}
        loss = torch.nn.functional.cross_entropy(theirs(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            theirs.weight.sub_(lr * lam * (w_0["weight"] - ref["weight"]))

    ours = fresh()
    pull = DecoupledProximal(ours, ref, lr, lam)
    opt = torch.optim.SGD(ours.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5)
    for xb, yb in batches:
        loss = torch.nn.functional.cross_entropy(ours(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        pull(ours)
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=1e-7)
    torch.testing.assert_close(ours.bias, theirs.bias, rtol=0, atol=0)


def test_code_form_validation_loss_is_the_sum_of_batch_means():
    """lambda_form=code sums the per-batch mean losses over the validation split in batches of
    train.batch_size, as the authors' get_loss; the paper form takes the mean over samples."""
    code = _run("strategy.lambda_form=code", "train.batch_size=8")
    paper = _run("train.batch_size=8")
    rnd = _round(code, cid="1")
    model = _model(code.cfg, 3)
    x, y = _stack(rnd.data.val)
    logits = model(torch.as_tensor(x, dtype=torch.float32)).detach().double()
    per_sample = torch.nn.functional.cross_entropy(logits, torch.as_tensor(y), reduction="none")
    sums = sum(float(per_sample[i:i + 8].mean()) for i in range(0, len(y), 8))
    assert len(y) > 8
    assert FEDORATrainer(code.cfg, code.settings).validation_loss(rnd, model) == pytest.approx(sums, rel=1e-5)
    assert FEDORATrainer(paper.cfg, paper.settings).validation_loss(_round(paper, cid="1"), model) == \
        pytest.approx(float(per_sample.mean()), rel=1e-5)


def test_decoupled_penalty_pulls_towards_theta_hat_outside_the_optimiser():
    dist = {}
    for eps in (1e-8, 5.0):
        _, dist[eps], start = _fit_distance("strategy.penalty=decoupled", f"strategy.eps={eps}",
                                            "train.lr=0.05", "train.momentum=0.9", "train.local_epochs=3")
    assert dist[5.0] < 0.5 * start < dist[1e-8]


def test_lambda_bn_own_takes_both_validation_losses_with_recomputed_statistics():
    """``strategy.lambda_bn=own``: a personal model whose stored BatchNorm statistics do not fit
    its weights (as after a pull to theta_hat, docs/methods/fedora.md) is not judged worse than
    theta_hat for its statistics alone: both losses are taken after recomputing them on the
    client's train split. ``stored`` (the default) takes each model as it holds them."""
    import copy

    from learning.training import recompute_bn_statistics

    stored = _run("model=cnn", "strategy.lambda_form=paper")
    rnd = _round(stored)
    hat = _model(stored.cfg, 2)
    train_epochs(hat, rnd.data.train, OptimConfig(lr=0.05, momentum=0.9, weight_decay=5e-4, epochs=3, batch_size=16),
                 torch.device("cpu"), seed=0)
    own = copy.deepcopy(hat)
    for module in own.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.running_mean += 3.0                  # the same weights, statistics that do not fit them
    lam, own_loss, hat_loss = FEDORATrainer(stored.cfg, stored.settings).selective_weight(rnd, own, hat)
    assert own_loss > hat_loss + 0.5 and lam == pytest.approx(own_loss - hat_loss)

    own_run = _run("model=cnn", "strategy.lambda_form=paper", "strategy.lambda_bn=own")
    shifted = {k: v.clone() for k, v in own.state_dict().items()}
    lam, own_loss, hat_loss = FEDORATrainer(own_run.cfg, own_run.settings).selective_weight(_round(own_run), own, hat)
    assert all(torch.equal(v, own.state_dict()[k]) for k, v in shifted.items())   # recomputed on copies
    recomputed = recompute_bn_statistics(copy.deepcopy(hat), rnd.data.train, int(own_run.cfg.train.batch_size),
                                         torch.device("cpu"))
    assert own_loss == pytest.approx(hat_loss) == pytest.approx(_val_loss(recomputed, rnd.data.val), rel=1e-5)
    assert lam == pytest.approx(1e-8)                   # the paper form's eps: no pull
    with pytest.raises(ValueError, match="lambda_bn"):
        _run("strategy.lambda_bn=recompute")
