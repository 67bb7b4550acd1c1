"""FedBasis: the combination (against an explicit weighted sum), coordinate descent (what
each phase may change), sharpening, BN statistics, new-client personalisation, the
server's warm start and per-basis averaging (against explicit loops), K-means, the
collapse diagnostics, and one end-to-end run with `pflower personalize`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import FakeGrid, model_config, pflower
from torch import nn
from torch.func import functional_call

from client.fedbasis import FedBasisTrainer
from client.finetune import personalize_curve
from client.round import ClientRound
from client.trainer import MODEL_PREFIX, LocalRound
from common.config import ComposedRun, ConfigError, compose_config, compose_run, validate_config
from common.flower_compat import send_and_receive
from common.protocol import make_reply
from learning.basis import COEFF_KEY, MAJOR_PREFIX, BasisModel, basis_prefix
from learning.datasets.federated import load_federated_data
from learning.models import build_model
from learning.params import get_arrays
from learning.training import OptimConfig
from server.app import build_strategy
from strategies.base import ClientUpdate, TrainRound
from strategies.fedbasis_math import (
    COEFF_METRIC,
    kmeans,
    mean_entropy,
    mean_pairwise_cosine,
    seed_bases,
)


def _run(*overrides: str) -> ComposedRun:
    return compose_run({"strategy": "fedbasis"}, ["dataset.clients_per_domain=1",
                                                  "strategy.coeff_epochs=1", "strategy.basis_epochs=1",
                                                  *overrides])


def _cfg(*overrides: str):
    return _run(*overrides).cfg


@pytest.fixture(scope="module")
def data():
    return load_federated_data(_cfg().dataset, 0)


def _rnd(run: ComposedRun, data, cid="0", server_round=1) -> ClientRound:
    return ClientRound(settings=run.settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=torch.device("cpu"), server_round=server_round)


def _small_basis(k: int = 3, major: bool = True) -> BasisModel:
    def make(i: int) -> nn.Module:
        torch.manual_seed(100 + i)
        return build_model(model_config("cnn", width=4, hidden=8), (1, 8, 8), 5)
    return BasisModel(make, k, major, "stage")


def _payload(model: BasisModel) -> dict[str, np.ndarray]:
    return {k: v for k, v in get_arrays(model).items() if k != COEFF_KEY}


# ---------------------------------------------------------------- the combination
@pytest.mark.parametrize("major", [True, False])
def test_combined_weights_equal_the_explicit_weighted_sum(major: bool) -> None:
    model = _small_basis(3, major)
    with torch.no_grad():
        model.coeff_logits.copy_(torch.randn(model.coeff_logits.shape))
    combined = {k: v.detach() for k, v in model.combined().items()}
    alpha = torch.softmax(model.coeff_logits.detach(), -1)
    units = model.unit_names
    state = model.state_dict()
    for key, value in model.template.state_dict().items():
        unit = next(i for i, u in enumerate(units) if key in _unit_keys(model, u))
        if not torch.is_floating_point(value):
            continue
        expected = torch.zeros_like(value, dtype=torch.float64)
        for k in range(3):
            expected += float(alpha[unit, k]) * state[f"bases.{k}.{key}"].double()
        if major:
            expected = 0.5 * state[f"major.{key}"].double() + 0.5 * expected
        torch.testing.assert_close(combined[key].double(), expected, rtol=1e-6, atol=1e-7)


def _unit_keys(model: BasisModel, unit: str) -> set[str]:
    i = model.unit_names.index(unit)
    return {k for k, j in model.unit_index.items() if j == i}


def test_forward_runs_one_network_on_the_combined_weights() -> None:
    model = _small_basis().eval()
    x = torch.randn(6, 1, 8, 8)
    combined = {k: v.detach() for k, v in model.combined().items()}
    plain = build_model(model_config("cnn", width=4, hidden=8), (1, 8, 8), 5).eval()
    plain.load_state_dict(combined)
    torch.testing.assert_close(model(x), plain(x))
    torch.testing.assert_close(model(x), functional_call(model.template, combined, (x,)))


def test_one_coefficient_vector_of_length_k_per_unit() -> None:
    model = _small_basis(4)
    assert model.unit_names == ["s1", "s2", "s3", "fc"]
    assert tuple(model.coeff_logits.shape) == (4, 4)
    assert set(model.unit_index) == set(model.template.state_dict())


def test_sharpening_divides_the_logits_by_tau() -> None:
    model = _small_basis()
    psi = torch.randn(model.coeff_logits.shape)
    with torch.no_grad():
        model.coeff_logits.copy_(psi)
    model.sharpen(0.1)
    expected = torch.exp(psi / 0.1) / torch.exp(psi / 0.1).sum(-1, keepdim=True)
    torch.testing.assert_close(model.coefficients().detach(), expected)


def test_bn_statistics_move_by_the_same_change_in_every_basis() -> None:
    model = _small_basis().train()
    key = "features.1.running_mean"
    before = {name: model.state_dict()[name + key].clone()
              for name in [MAJOR_PREFIX, *(basis_prefix(k) for k in range(3))]}
    combined_before = model.combined()[key].detach().clone()
    x = torch.randn(16, 1, 8, 8)
    model(x)
    # what BN itself does to the combined statistics: (1 - m) r + m * batch mean
    w = model.combined()
    h = torch.nn.functional.conv2d(x, w["features.0.weight"].detach(), w["features.0.bias"].detach(), padding=1)
    expected_combined = 0.9 * combined_before + 0.1 * h.mean((0, 2, 3))
    torch.testing.assert_close(model.combined()[key].detach(), expected_combined, rtol=1e-5, atol=1e-6)
    delta = expected_combined - combined_before
    for name, old in before.items():
        torch.testing.assert_close(model.state_dict()[name + key], old + delta, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- coordinate descent
def _round(data, *overrides: str) -> tuple[FedBasisTrainer, LocalRound, dict[str, np.ndarray]]:
    run = _run(*overrides)
    trainer = FedBasisTrainer(run.cfg, run.settings)
    rnd = _rnd(run, data)
    payload = _payload(trainer.new_model(rnd))
    work = LocalRound(rnd, payload, {}, {})
    work.model = trainer.start_model(work)
    work.roles = trainer.roles(work.model)
    return trainer, work, payload


def test_logits_phase_leaves_the_bases_exactly_as_received(data) -> None:
    trainer, work, payload = _round(data, "strategy.basis_epochs=0")
    trainer.train(work)
    after = get_arrays(work.model)
    for k, v in payload.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)      # parameters and BN statistics
    assert np.abs(after[COEFF_KEY]).max() > 0                       # the logits learned


def test_bases_phase_leaves_the_logits_as_sharpened(data) -> None:
    trainer, work, payload = _round(data, "strategy.coeff_epochs=2", "strategy.sharpen_tau=0.25")
    metrics = trainer.train(work)
    model = work.model
    alpha_learned = np.array([[metrics[f"{COEFF_METRIC}{u}/{k}"] for k in range(model.num_bases)]
                              for u in model.unit_names])
    # the logits after the round are exactly the learned ones / tau: softmax(tau * psi) = alpha*
    psi = model.coeff_logits.detach().double()
    np.testing.assert_allclose(torch.softmax(psi * 0.25, -1).numpy(), alpha_learned, rtol=1e-5, atol=1e-7)
    changed = [k for k, v in payload.items() if not np.array_equal(get_arrays(model)[k], v)]
    assert any(k.startswith(MAJOR_PREFIX) for k in changed)
    assert all(any(k.startswith(basis_prefix(j)) for k in changed) for j in range(model.num_bases))


def test_a_round_uploads_the_bases_and_keeps_k_numbers_per_unit(data) -> None:
    trainer, work, payload = _round(data)
    work.metrics = trainer.train(work)
    upload, _ = trainer.upload(work)
    assert set(upload) == set(payload)                              # K + 1 models, no logits
    state = trainer.private_state(work)
    assert list(state) == [MODEL_PREFIX + COEFF_KEY]
    assert state[MODEL_PREFIX + COEFF_KEY].shape == (4, 4)          # 4 units x K = 4 bases


@pytest.mark.parametrize("privacy", [["privacy.secure_aggregation=secagg+"], ["privacy.dp=central"]])
def test_under_dp_or_secure_aggregation_the_coefficients_stay_on_the_client(data, privacy: list[str]) -> None:
    """The learned coefficients are personal parameters: reported only when nothing guards the
    uploads (the server's diagnostics then have no entropy, its bases' cosine stays)."""
    plain = _round(data, "strategy.warm_fraction=0")
    guarded = _round(data, "strategy.warm_fraction=0", *privacy)
    plain_metrics, guarded_metrics = plain[0].train(plain[1]), guarded[0].train(guarded[1])
    coefficients = {k for k in plain_metrics if k.startswith(COEFF_METRIC)}
    assert len(coefficients) == 4 * 4                               # 4 units x K = 4
    assert set(guarded_metrics) == set(plain_metrics) - coefficients
    # the model trained the same either way (the metrics' choice changes nothing else)
    for k, v in get_arrays(plain[1].model).items():
        np.testing.assert_array_equal(get_arrays(guarded[1].model)[k], v, err_msg=k)


@pytest.mark.parametrize("privacy", ["privacy.secure_aggregation=secagg+", "privacy.dp=central"])
def test_a_warm_up_that_seeds_the_bases_from_client_models_refuses_privacy(privacy: str) -> None:
    """K-means (or sampling) over the clients' own models needs each of them at the server."""
    with pytest.raises(ConfigError, match=r"seeds its bases from each client's own model .* set strategy.warm_fraction=0"):
        validate_config(_cfg(privacy, "strategy.warm_fraction=0.3"))
    validate_config(_cfg(privacy, "strategy.warm_fraction=0"))


def test_logits_start_uniform_every_round_not_from_the_state(data) -> None:
    run = _run()
    trainer = FedBasisTrainer(run.cfg, run.settings)
    rnd = _rnd(run, data, server_round=3)
    payload = _payload(trainer.new_model(rnd))
    state = {MODEL_PREFIX + COEFF_KEY: np.full((4, 4), 7.0, np.float32)}
    model = trainer.start_model(LocalRound(rnd, payload, state, {}))
    assert float(model.coeff_logits.detach().abs().max()) == 0.0
    # ... while the personalised model is evaluated with the kept (sharpened) logits
    np.testing.assert_array_equal(get_arrays(trainer.personal_model(rnd, payload, state))[COEFF_KEY], 7.0)


def test_warm_up_round_trains_one_plain_model(data) -> None:
    run = _run()
    trainer = FedBasisTrainer(run.cfg, run.settings)
    rnd = _rnd(run, data)
    plain = trainer.new_model(rnd).template
    payload = {MAJOR_PREFIX + k: v for k, v in get_arrays(plain).items()}
    result = trainer.fit(rnd, payload, {})
    assert set(result.upload) == set(payload)
    assert result.state == {}
    assert not any(k.startswith(COEFF_METRIC) for k in result.metrics)


# ---------------------------------------------------------------- new clients
@pytest.mark.parametrize("head", [True, False])
def test_new_client_personalisation_changes_only_its_logits_and_classifier(data, head: bool) -> None:
    run = _run(f"strategy.personalize_head={str(head).lower()}")
    trainer = FedBasisTrainer(run.cfg, run.settings)
    rnd = _rnd(run, data, cid="new-0")
    payload = _payload(trainer.new_model(rnd))
    model, trainable = trainer.new_client_model(rnd, payload, "basis")
    opt = OptimConfig(lr=0.05, batch_size=16, momentum=0.9)
    head_before = {k: v.detach().clone() for k, v in model.combined().items() if k.startswith("head.")}
    curve = personalize_curve(model, rnd, trainable, opt, epochs=2)
    assert [c["epoch"] for c in curve] == [0.0, 1.0, 2.0]
    after = get_arrays(model)
    weights = {n for n, _ in model.named_parameters()}
    for k, v in payload.items():                                    # every basis weight as received
        if k in weights:
            np.testing.assert_array_equal(after[k], v, err_msg=k)
    assert np.abs(after[COEFF_KEY]).max() > 0
    learned = {n for n, _ in model.named_parameters() if trainable(n)}
    if head:
        assert learned == {COEFF_KEY, "head_override.head__weight", "head_override.head__bias"}
        assert not torch.equal(model.head_override["head__weight"], head_before["head.weight"])
    else:
        assert learned == {COEFF_KEY} and model.head_override is None


@pytest.mark.parametrize("swept", [0.005, 0.05])
def test_the_lr_sweep_moves_the_coefficients_lr_like_the_classifiers(data, monkeypatch, swept: float) -> None:
    """Like for like with FedAvg+FT's whole-model sweep: at each swept lr the logits learn at
    swept x coeff_lr / train.lr (the training ratio), the classifier at the swept lr itself."""
    import client.finetune as ct  # the personalisation curve makes its optimiser there

    run = _run("strategy.coeff_lr=1.0", "train.lr=0.05")
    trainer = FedBasisTrainer(run.cfg, run.settings)
    assert trainer.new_client_lr_scales() == {COEFF_KEY: pytest.approx(20.0)}
    rnd = _rnd(run, data, cid="new-0")
    model, trainable = trainer.new_client_model(rnd, _payload(trainer.new_model(rnd)), "basis")
    seen = []
    real = ct.make_optimizer
    monkeypatch.setattr(ct, "make_optimizer", lambda params, opt: seen.append(real(params, opt)) or seen[-1])
    personalize_curve(model, rnd, trainable, OptimConfig(lr=swept, batch_size=16, momentum=0.9), 1,
                      trainer.new_client_lr_scales())
    groups = seen[0].param_groups
    coeff = next(p for n, p in model.named_parameters() if n == COEFF_KEY)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert lr_of[id(coeff)] == pytest.approx(swept * 20.0)
    assert {lr for key, lr in lr_of.items() if key != id(coeff)} == {swept}


# ---------------------------------------------------------------- server
def _update(cid: str, arrays: dict[str, np.ndarray], n: int, metrics: dict[str, float] | None = None) -> ClientUpdate:
    return ClientUpdate(client_id=cid, node_id=int(cid) + 1, arrays=arrays, num_examples=n, metrics=metrics or {})


def _strategy(data, *overrides: str):
    cfg = _cfg(*overrides)
    return build_strategy(cfg, data)


def test_warm_up_sends_one_model_then_seeds_the_bases_from_the_clients(data) -> None:
    strategy = _strategy(data, "rounds=10", "strategy.warm_fraction=0.2", "strategy.num_bases=2",
                         "strategy.seed_bases=kmeans")
    assert strategy.warm_rounds == 2 and not strategy.seeded
    sent = strategy.payload_for("0")
    assert sent and all(k.startswith(MAJOR_PREFIX) for k in sent)
    rng = np.random.default_rng(0)
    # four client models in two well separated groups
    models = []
    for i in range(4):
        shift = 10.0 if i < 2 else -10.0
        models.append({k: (v + shift + rng.normal(0, 0.01, v.shape)).astype(v.dtype)
                       if np.issubdtype(v.dtype, np.floating) else v for k, v in sent.items()})
    updates = [_update(str(i), m, n) for i, (m, n) in enumerate(zip(models, [10, 30, 20, 40], strict=True))]
    strategy.aggregate_updates(TrainRound.handed(1), updates)
    assert not strategy.seeded                                   # still warm after round 1
    strategy.aggregate_updates(TrainRound.handed(2), updates)
    assert strategy.seeded and strategy.switch["round"] == 2
    key = "features.0.weight"
    # the warm-up average follows strategy.weighted too: uniform by default
    fedavg = sum(m[MAJOR_PREFIX + key].astype(np.float64) for m in models) / 4
    np.testing.assert_allclose(strategy.global_arrays[MAJOR_PREFIX + key], fedavg, rtol=1e-5,
                               atol=1e-6)   # float32 mean of +-10 shifts: cancellation ~2e-7
    groups = [strategy.switch["assignment"][c] for c in "0123"]
    assert groups[0] == groups[1] != groups[2] == groups[3]
    for j in range(2):
        members = [m for m, g in zip(models, groups, strict=True) if g == j]
        centroid = np.mean([m[MAJOR_PREFIX + key] for m in members], axis=0)
        np.testing.assert_allclose(strategy.global_arrays[basis_prefix(j) + key], centroid, rtol=1e-5)
    assert set(strategy.payload_for("0")) == {k for k in strategy.global_arrays}
    assert COEFF_KEY not in strategy.payload_for("0")


@pytest.mark.parametrize("weighted", [None, True])
def test_each_basis_is_averaged_over_the_clients(data, weighted: bool | None) -> None:
    """Default: the paper's uniform mean (1/M) sum_m V_m (Eq. 7, 9); strategy.weighted=true
    weighs by client size. Sizes differ so that the two cannot agree by chance."""
    extra = [] if weighted is None else [f"strategy.weighted={str(weighted).lower()}"]
    strategy = _strategy(data, "strategy.num_bases=2", "strategy.warm_fraction=0", *extra)
    sent = strategy.payload_for("0")
    rng = np.random.default_rng(1)
    uploads = [{k: (rng.normal(size=v.shape)).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v
                for k, v in sent.items()} for _ in range(3)]
    sizes = [5, 10, 25]
    coeff = {f"{COEFF_METRIC}{u}/{k}": 0.5 for u in ("s1", "s2", "s3", "fc") for k in range(2)}
    strategy.aggregate_updates(TrainRound.handed(1), [_update(str(i), u, n, coeff) for i, (u, n) in enumerate(zip(uploads, sizes, strict=True))])
    for key in sent:
        if not np.issubdtype(sent[key].dtype, np.floating):
            continue
        expected = np.zeros(sent[key].shape)
        for u, n in zip(uploads, sizes, strict=True):
            expected += (n / sum(sizes) if weighted else 1 / len(uploads)) * u[key].astype(np.float64)
        np.testing.assert_allclose(strategy.global_arrays[key], expected, rtol=1e-5, atol=1e-6, err_msg=key)
    diag = strategy.diagnostics[1]
    assert math.isclose(diag["coeff_entropy"], math.log(2), rel_tol=1e-9)
    assert strategy.coefficients[1]["2"] == {u: [0.5, 0.5] for u in ("s1", "s2", "s3", "fc")}


@pytest.mark.usefixtures("flower_task")
def test_a_streamed_basis_round_averages_each_basis_and_records_the_coefficients(data) -> None:
    """With ``stream_replies_mb=0`` a basis round folds each reply into the per-basis mean as it
    arrives (no client's bases kept), and so does a warm-up round; the round that seeds the
    bases never streams (K-means needs every model)."""
    warm = _strategy(data, "rounds=4", "strategy.warm_fraction=0.5", "stream_replies_mb=0")
    assert not warm.seeded and warm.streams_round(1, {}) and not warm.streams_round(2, {})   # round 2 seeds
    strategy = _strategy(data, "strategy.num_bases=2", "strategy.warm_fraction=0", "stream_replies_mb=0")
    assert strategy.seeded and strategy.streams_round(1, {})
    sent = strategy.payload_for("0")
    rng = np.random.default_rng(2)
    ids = strategy.client_ids
    uploads = {c: {k: rng.normal(size=v.shape).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v
                   for k, v in sent.items()} for c in ids}
    coeff = {c: {f"{COEFF_METRIC}{u}/{k}": (0.25 if k == 0 else 0.75) if c == ids[0] else 0.5
                 for u in ("s1", "s2", "s3", "fc") for k in range(2)} for c in ids}
    grid = FakeGrid(ids, lambda cid, msg: make_reply(msg, uploads[cid], coeff[cid], cid, 7 + int(cid)))
    train = strategy.begin_train(1, {}, grid)
    messages = train.messages
    replies = send_and_receive(grid, messages, timeout=30.0, on_reply=train.replies.take)
    assert train.replies.folded == len(ids) and not any(m.content.array_records for m in replies)
    strategy.aggregate_round(train)
    for key in sent:
        if np.issubdtype(sent[key].dtype, np.floating):
            expected = sum(uploads[c][key].astype(np.float64) for c in ids) / len(ids)   # uniform (Eq. 7, 9)
            np.testing.assert_allclose(strategy.global_arrays[key], expected, rtol=1e-5, atol=1e-6, err_msg=key)
    assert strategy.coefficients[1][ids[0]] == {u: [0.25, 0.75] for u in ("s1", "s2", "s3", "fc")}
    assert "coeff_entropy" in strategy.diagnostics[1]


def test_warm_up_upload_of_other_tensors_is_rejected(data) -> None:
    strategy = _strategy(data, "rounds=10", "strategy.warm_fraction=0.5")
    assert "warm-up upload" in strategy.check_upload({"bases.0.head.bias": np.zeros(10, np.float32)})
    assert strategy.check_upload(strategy.payload_for("0")) is None


# ---------------------------------------------------------------- math
def test_kmeans_reaches_a_fixed_point_and_finds_separated_clusters() -> None:
    rng = np.random.default_rng(3)
    truth = np.repeat([0, 1, 2], 10)
    points = np.stack([rng.normal(c * 20, 1.0, 5) for c in truth])
    centroids, labels = kmeans(points, 3, seed=0)
    for j in range(3):                                             # centroid = mean of its points
        np.testing.assert_allclose(centroids[j], points[labels == j].mean(0))
    dist = ((points[:, None] - centroids[None]) ** 2).sum(-1)      # each point nearest its centroid
    np.testing.assert_array_equal(dist.argmin(1), labels)
    for c in range(3):                                             # the true partition
        assert len(set(labels[truth == c])) == 1
    assert len(set(labels)) == 3


def _plain_kmeans(points: np.ndarray, k: int, seed: int, iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """The obvious K-means (k-means++ seeding, Lloyd) on the whole float64 n x k x d array."""
    n = len(points)
    rng = np.random.default_rng(seed)
    x = np.asarray(points, np.float64)
    centroids = [x[rng.integers(n)]]
    for _ in range(1, k):
        d2 = np.min([np.sum((x - c) ** 2, axis=1) for c in centroids], axis=0)
        centroids.append(x[rng.choice(n, p=d2 / d2.sum())] if d2.sum() > 0 else x[rng.integers(n)])
    c, labels = np.stack(centroids), np.full(n, -1)
    for _ in range(iters):
        dist = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)
        new = dist.argmin(1)
        for j in range(k):
            if not np.any(new == j):
                new[int(dist[np.arange(n), new].argmax())] = j
        if np.array_equal(new, labels):
            break
        labels = new
        c = np.stack([x[labels == j].mean(0) for j in range(k)])
    return c, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_kmeans_equals_the_plain_one(seed: int) -> None:
    """Float32 points (model vectors), distances and means over column chunks of 7: the
    same clusters and the same centroids (to float32 precision) as the plain algorithm."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, 4, 40)
    points = (rng.normal(0, 1, (40, 53)) + 3.0 * rng.normal(0, 1, (4, 53))[truth]).astype(np.float32)
    centroids, labels = kmeans(points, 4, seed=seed, chunk=7)
    ref_c, ref_labels = _plain_kmeans(points, 4, seed=seed)
    np.testing.assert_array_equal(labels, ref_labels)
    np.testing.assert_allclose(centroids, ref_c, rtol=1e-6, atol=1e-6)


def test_kmeans_memory_stays_near_the_inputs() -> None:
    """FedBasis seeds its bases from 80 ResNet-18 models (d = 11.2M): the plain algorithm's
    n x k x d float64 differences would need ~60 GB. Here the allocations beyond the n x d
    float32 input are the k float64 centroids (once) and a few n x chunk temporaries."""
    import tracemalloc

    rng = np.random.default_rng(0)
    n, d, k, chunk = 16, 300_000, 4, 1 << 14
    points = rng.normal(0, 1, (n, d)).astype(np.float32)   # 19 MB
    tracemalloc.start()
    tracemalloc.reset_peak()
    kmeans(points, k, seed=0, chunk=chunk)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    centroids, temporaries = k * d * 8, 4 * n * chunk * 8     # 9.6 MB and 8.4 MB
    assert peak < centroids + temporaries, (peak, centroids, temporaries)
    assert peak < (n * k * d * 8) / 8     # an eighth of the plain algorithm's differences alone


def test_seed_bases_by_sampling_takes_distinct_clients() -> None:
    models = [{"w": np.full(3, float(i), np.float32)} for i in range(5)]
    bases, picks = seed_bases(models, 3, "sample", seed=0)
    assert len(set(picks)) == 3
    for b, p in zip(bases, picks, strict=True):
        np.testing.assert_array_equal(b["w"], models[p]["w"])


def test_diagnostics_against_explicit_formulas() -> None:
    a, b, c = np.array([1.0, 0.0]), np.array([1.0, 1.0]), np.array([0.0, 2.0])
    cos = lambda x, y: x @ y / np.linalg.norm(x) / np.linalg.norm(y)  # noqa: E731
    assert math.isclose(mean_pairwise_cosine([a, b, c]), (cos(a, b) + cos(a, c) + cos(b, c)) / 3)
    p = np.array([[0.5, 0.5], [1.0, 0.0]])
    assert math.isclose(mean_entropy(p), (math.log(2) + 0.0) / 2, abs_tol=1e-9)


@pytest.mark.parametrize(("override", "named"), [
    ("strategy.num_bases=0", "strategy.num_bases must be >= 1"),
    ("strategy.sharpen_tau=0", "strategy.sharpen_tau must be in"),
    ("strategy.seed_bases=random", "strategy.seed_bases must be one of kmeans, sample"),
    ("strategy.warm_fraction=1", "strategy.warm_fraction must be in"),
])
def test_bad_options_are_named_before_training(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        _cfg(override)


# ---------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_pflower_run_fedbasis_and_personalize_end_to_end(tmp_path) -> None:
    proc = pflower("run", "strategy=fedbasis", "rounds=4", "strategy.warm_fraction=0.5",
                   "strategy.coeff_epochs=1", "strategy.basis_epochs=1", "dataset.clients_per_domain=1",
                   "personalize.after_run=false", "run_name=fb", f"results_root={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "fb"
    assert f"the new clients are not personalised (personalize.after_run=false); pflower personalize {run}" \
        in proc.stdout and not (run / "new_clients.json").exists()
    rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["fedbasis"]["phase"] for r in rounds] == ["warm-up", "bases", "bases", "bases"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["fedbasis_switch"]["round"] == 2
    assert sorted(summary["fedbasis_coefficients"]) == ["0", "1", "2", "3"]
    assert (run / "coefficients.png").stat().st_size > 0 and (run / "basis_diagnostics.png").stat().st_size > 0
    comm = [r["communication"] for r in rounds]                # one model down and up in the 2 warm-up
    one_model = comm[0]["bytes_down"]["0"]                      # rounds, K + 1 = 5 after them (no logits)
    for c in comm[:2]:
        assert c["bytes_down"]["0"] == c["bytes_up"]["0"] == one_model
    for c in comm[2:]:
        assert c["bytes_down"]["0"] == c["bytes_up"]["0"] == 5 * one_model
    proc = pflower("personalize", str(run), "--epochs", "2", "--lr", "0.01")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pflower: personalising 4 new clients of fb: 8 fits of 2 epochs" in proc.stdout   # not silent
    assert "pflower: personalising new clients: 8/8 (client new-3, basis M lr 0.01)" in proc.stdout
    result = json.loads((run / "new_clients.json").read_text())
    assert sorted(result["clients"]) == ["new-0", "new-1", "new-2", "new-3"]
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["new_client_accuracy_mean"] <= 1.0
    assert 0.0 <= summary["new_client_accuracy_best_mean"] <= 1.0


# ---------------------------------------------------------------- PFLBED split
def test_pflbed_split_shares_a_class_balanced_test_set_per_domain() -> None:
    cfg = _cfg("dataset.split=pflbed", "dataset.clients_per_domain=3", "dataset.new_clients_per_domain=1",
               "dataset.val_fraction=0.05", "dataset.test_fraction=0.15")
    data = load_federated_data(cfg.dataset, 0)
    assert len(data.clients) == 12 and len(data.new_clients) == 4
    everyone = {**data.clients, **data.new_clients}
    for domain in cfg.dataset.domains:
        members = [c for c in everyone.values() if c.domain == domain]
        test = members[0].test_ids
        for c in members:                                        # one shared val and test set
            np.testing.assert_array_equal(c.test_ids, test)
            np.testing.assert_array_equal(c.val_ids, members[0].val_ids)
            assert not set(c.train_ids) & (set(test) | set(c.val_ids))
        labels = np.array([int(members[0].test[i][1]) for i in range(len(members[0].test))])
        counts = np.bincount(labels, minlength=10)
        assert counts.max() - counts.min() <= 1 or counts.min() == counts.max()
        trains = [set(c.train_ids) for c in members]              # train splits disjoint
        assert sum(len(t) for t in trains) == len(set().union(*trains))
    c = data.clients["0"]
    hist = np.bincount([int(c.train[i][1]) for i in range(len(c.train))], minlength=10)
    np.testing.assert_allclose(c.class_weights, hist / hist.sum())


@pytest.mark.parametrize("new_fraction", [0.2, 0.1])
def test_pflbed_shares_are_the_papers_60_20_5_15(new_fraction: float) -> None:
    """Participating/new/validation/test = 60/20/5/15 per domain by default (paper Sec. 5),
    whatever the client counts (20 + 10 here, whose ratio would give 53.3/26.7)."""
    from learning.datasets.partition import pflbed_split

    labels = np.repeat(np.arange(10), 300)                      # 3,000 samples of one domain
    trains, news, val, test = pflbed_split(labels, 20, 10, 0.05, 0.15, 0.3, seed=0, new_fraction=new_fraction)
    n = len(labels)
    shares = [sum(map(len, trains)) / n, sum(map(len, news)) / n, len(val) / n, len(test) / n]
    np.testing.assert_allclose(shares, [0.8 - new_fraction, new_fraction, 0.05, 0.15], atol=0.005)
    everything = np.concatenate([*trains, *news, val, test])
    assert len(everything) == len(set(everything.tolist())) == n  # disjoint and complete
    cfg = compose_config({}, ["experiment=fedbasis-pacs", "dataset.synthetic=true"])
    assert cfg.dataset.pflbed_new_fraction == 0.2 and not cfg.strategy.weighted


def test_weighted_accuracy_weighs_each_test_sample_by_the_train_label_share() -> None:
    from torch.utils.data import TensorDataset

    from learning.training import evaluate

    class Fixed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x                                             # the input is the logits
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    predicted = torch.tensor([0, 1, 1, 1, 0, 0])                # correct: 1 of class 0, 2 of class 1, 0 of class 2
    logits = nn.functional.one_hot(predicted, 3).float()
    weights = np.array([0.5, 0.3, 0.2])
    got = evaluate(Fixed(), TensorDataset(logits, y), torch.device("cpu"), class_weights=weights)["accuracy"]
    expected = (0.5 * 1 + 0.3 * 2 + 0.2 * 0) / (0.5 * 2 + 0.3 * 2 + 0.2 * 2)
    assert math.isclose(got, expected, rel_tol=1e-12)
    assert evaluate(Fixed(), TensorDataset(logits, y), torch.device("cpu"))["accuracy"] == 3 / 6


def test_personalize_names_a_missing_run_or_checkpoint(tmp_path, capsys) -> None:
    from ops.cli import main

    assert main(["personalize", str(tmp_path / "nothing")]) == 2
    assert "has no config.yaml" in capsys.readouterr().err
    from omegaconf import OmegaConf

    from common.config import compose_config

    (tmp_path / "config.yaml").write_text("strategy: {name: fedbasis}\n")   # not a run's whole config
    assert main(["personalize", str(tmp_path)]) == 2
    assert "invalid configuration" in capsys.readouterr().err
    whole = compose_config(None, ["strategy=fedbasis"])
    OmegaConf.save({k: v for k, v in OmegaConf.to_container(whole).items() if k != "dataset"}, tmp_path / "config.yaml")
    for argv in (["personalize", str(tmp_path)], ["personalize", "--adapt", str(tmp_path)]):
        assert main(argv) == 2   # a group missing: named, not a traceback
        err = capsys.readouterr().err
        assert "invalid configuration" in err and "dataset" in err, err
    OmegaConf.save(compose_config(None, ["strategy=fedbasis"]), tmp_path / "config.yaml")
    assert main(["personalize", str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_table2_headline_lr_is_selected_by_validation_not_test() -> None:
    """FedBasis' Table 2 selects the lr from {0.005, 0.01, 0.05}: by the new clients' mean
    validation accuracy at their best epoch. Here 0.05 has the best test accuracy and 0.01 the
    best validation accuracy: 0.01 must be chosen; a tie goes to the first listed."""
    from client.finetune import last_and_best
    from ops.personalize import select_lr, summarise

    def curve(val: list[float], test: list[float]) -> list[dict[str, float]]:
        return [{"epoch": e, "val_accuracy": v, "accuracy": t} for e, (v, t) in enumerate(zip(val, test, strict=True))]

    per_lr = {"0.005": ([0.1, 0.3, 0.4], [0.1, 0.3, 0.4]), "0.01": ([0.1, 0.8, 0.7], [0.1, 0.5, 0.5]),
              "0.05": ([0.1, 0.6, 0.5], [0.1, 0.9, 0.9])}
    results = {c: {"results": {"ft": {"M": {lr: last_and_best(curve(v, t)) for lr, (v, t) in per_lr.items()}}}}
               for c in ("a", "b")}
    table = summarise(results)
    assert table["ft"]["M"]["0.01"]["best_val_mean"] == 0.8 and table["ft"]["M"]["0.01"]["best_mean"] == 0.5
    assert select_lr(table["ft"]["M"]) == "0.01"
    assert select_lr({"0.1": {"best_val_mean": 0.5}, "0.2": {"best_val_mean": 0.5}}) == "0.1"
    cfg = compose_config({}, ["experiment=fedbasis-pacs", "dataset.synthetic=true"])
    assert dict(cfg.personalize.sizes) == {"S": 0.5, "M": 1.0} and cfg.personalize.lr is None
