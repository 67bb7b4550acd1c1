"""Secure aggregation of the shared part (``privacy.secure_aggregation=secagg+``, docs/privacy.md).

The protocol's arithmetic against a slow, obvious weighted mean; what the server receives in a
real round (the real loop and ClientApp over a fake grid) inspected for any client's unmasked
shared tensor; clients dropping after key sharing, above and below the threshold (the run fails
cleanly and its resume ends where an undisturbed run ends); the refusals. The method contract
test runs every method that takes secure aggregation (alone and with DP) through the loop,
restart included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, MessageType, RecordDict
from helpers import PRIVATE_FORM, FakeGrid

from client import app as client_app
from client import secure_aggregation as client_secagg
from client.secure_aggregation import stage_of
from common.config import ConfigError, compose_config, compose_run, validate_config
from common.methods import method, method_names, resolve_method
from common.secure_aggregation import (
    COLLECT,
    SETUP,
    UNMASK,
    SecAggParams,
    client_masked_update,
    client_receive_shares,
    client_setup,
    client_share_keys,
    client_unmask,
    neighbourhoods,
    rebuild,
    rounding_rng,
    sum_masked,
    unmask_mean,
)
from learning.datasets.federated import load_federated_data
from server.app import build_strategy
from server.loop import run_federation
from server.results import RunRecorder
from strategies.replies import RoundFailedError

PARAMS = SecAggParams(shares=5, threshold=3, clip_range=4.0, quant_range=2**22, mod_range=2**32, max_weight=100.0)


# ------------------------------------------------------------------ the protocol alone
def _protocol(num: int, params: SecAggParams, drop_after_keys: set[int], seed: int = 0
              ) -> tuple[dict[str, np.ndarray], float, dict[int, dict[str, np.ndarray]], dict[int, int], set[int]]:
    """Every step for ``num`` clients, those in ``drop_after_keys`` never sending their masked
    vector; returns the unmasked mean, the total weight, each client's update and size, the active ids."""
    rng = np.random.default_rng(seed)
    neighbours = neighbourhoods(num, params.shares, rng)
    clients = {i: client_setup(1, i, params) for i in range(1, num + 1)}
    public = {i: (c.pk1, c.pk2) for i, c in clients.items()}
    inbox: dict[int, list[tuple[int, bytes]]] = {i: [] for i in clients}
    for i, c in clients.items():
        for dst, ciphertext in zip(*client_share_keys(c, {n: public[n] for n in neighbours[i]}), strict=True):
            inbox[dst].append((i, ciphertext))
    updates = {i: {"w": rng.normal(size=(3, 4)), "b": 0.1 * rng.normal(size=4)} for i in clients}
    sizes = {i: int(rng.integers(10, 100)) for i in clients}
    masked = {}
    for i, c in clients.items():
        got = sorted(inbox[i])
        client_receive_shares(c, [s for s, _ in got], [x for _, x in got])
        if i not in drop_after_keys:
            masked[i], clipped = client_masked_update(c, updates[i], sizes[i], rounding_rng(0, 1, str(i)))
            assert clipped == 0
    active = set(masked)
    held: dict[int, list[bytes]] = {s: [] for s in clients}
    for i in active:
        ids, shares = client_unmask(clients[i], [n for n in neighbours[i] if n in active],
                                    [n for n in neighbours[i] if n in drop_after_keys])
        for owner, share in zip(ids, shares, strict=True):
            held[owner].append(share)
    mean, weight = unmask_mean(sum_masked(masked.values(), params.mod_range), len(active), params,
                               {s: rebuild(held[s]) for s in active},
                               {s: rebuild(held[s]) for s in drop_after_keys}, public, neighbours, active)
    return mean, weight, updates, sizes, active


@pytest.mark.parametrize(("num", "shares", "dropped"), [(5, 5, set()), (7, 5, {2}), (9, 5, {1, 6})])
def test_the_unmasked_sum_is_the_weighted_mean_within_the_rounding_bound(num: int, shares: int,
                                                                        dropped: set[int]) -> None:
    params = SecAggParams(**{**PARAMS.__dict__, "shares": shares})
    mean, weight, updates, sizes, active = _protocol(num, params, dropped)
    weights = {i: round(sizes[i] / params.max_weight * params.quant_range) / params.quant_range for i in active}
    assert weight == pytest.approx(sum(weights.values()))
    bound = len(active) * 2 * params.clip_range / params.quant_range / weight
    for key in ("w", "b"):
        plain = sum(weights[i] * updates[i][key] for i in sorted(active)) / sum(weights.values())
        assert np.abs(mean[key] - plain).max() <= bound, key
        # and the rounding is not a no-op: the bound is tight to within an order of magnitude
        assert np.abs(mean[key] - plain).max() > bound / 1000


def test_a_client_refuses_to_send_both_shares_of_one_neighbour() -> None:
    client = client_setup(1, 1, PARAMS)
    with pytest.raises(ValueError, match="both shares of one neighbour"):
        client_unmask(client, [1, 2, 3], [3])


def test_a_masked_upload_looks_uniform_and_differs_from_the_update() -> None:
    params = PARAMS
    client = client_setup(1, 1, params)
    others = {i: client_setup(1, i, params) for i in range(2, 6)}
    keys = {1: (client.pk1, client.pk2), **{i: (c.pk1, c.pk2) for i, c in others.items()}}
    client_share_keys(client, keys)
    client.seed_shares.update({i: b"x" for i in others})      # as if every neighbour's share arrived
    vector, _ = client_masked_update(client, {"w": np.zeros((100, 100))}, 50, rounding_rng(0, 1, "1"))
    values = vector["w"].ravel() / params.mod_range
    assert 0.45 < values.mean() < 0.55 and 0.27 < values.std() < 0.31     # uniform on [0, 1): mean 1/2, std 0.289


def test_distributed_noise_sums_to_the_central_scale() -> None:
    """Each of m clients adds N(0, (z C)^2 / m): the unmasked mean carries N(0, (z C / m)^2),
    the noise the server would add (a statistical test, fixed seeds, 4000 coordinates: the
    sample std is within 5% of the target with probability > 0.99)."""
    z, clip, m = 1.5, 2.0, 5
    params = SecAggParams(shares=m, threshold=3, clip_range=64.0, quant_range=2**22, mod_range=2**32,
                          clip_norm=clip, noise_std=z * clip / np.sqrt(m))
    neighbours = neighbourhoods(m, m, np.random.default_rng(0))
    clients = {i: client_setup(1, i, params) for i in range(1, m + 1)}
    public = {i: (c.pk1, c.pk2) for i, c in clients.items()}
    inbox: dict[int, list[tuple[int, bytes]]] = {i: [] for i in clients}
    for i, c in clients.items():
        for dst, ciphertext in zip(*client_share_keys(c, public), strict=True):
            inbox[dst].append((i, ciphertext))
    masked = {}
    for i, c in clients.items():
        got = sorted(inbox[i])
        client_receive_shares(c, [s for s, _ in got], [x for _, x in got])
        masked[i], clipped = client_masked_update(c, {"w": np.zeros(4000)}, 10, rounding_rng(0, 1, str(i)),
                                                  np.random.default_rng(100 + i))
        assert clipped == 0
    held: dict[int, list[bytes]] = {s: [] for s in clients}
    for i in clients:
        for owner, share in zip(*client_unmask(clients[i], list(clients), []), strict=True):
            held[owner].append(share)
    mean, _ = unmask_mean(sum_masked(masked.values(), params.mod_range), m, params,
                          {s: rebuild(held[s]) for s in clients}, {}, public, neighbours, clients)
    assert abs(mean["w"].std() / (z * clip / m) - 1) < 0.05
    assert abs(mean["w"].mean()) < 4 * z * clip / m / np.sqrt(4000)


# ------------------------------------------------------------------ a real round
SMALL = ["dataset.clients_per_domain=1", "dataset.new_clients_per_domain=0", "checkpoint_every=1",
         "fraction_train=1.0", "deterministic=true", "privacy.secure_aggregation=secagg+"]


def _run_config(root: Path, run: str, rounds: int, extra: list[str] = (), strategy: str = "fedavg",  # type: ignore[assignment]
                resume: Path | None = None) -> dict[str, Any]:
    return {"strategy": strategy, "rounds": str(rounds), "results-root": str(root), "run-name": run,
            "overrides": " ".join([*SMALL, *extra, *([f"resume={resume}"] if resume else [])])}


class Clients:
    """Each client's ClientApp (its own Flower context); every reply the server receives is
    kept, and each client's true upload as it was before masking; ``drop`` says which client
    gives no reply to which stage of which round."""

    def __init__(self, run_config: dict[str, Any], client_ids: list[str], monkeypatch: pytest.MonkeyPatch,
                 drop: set[tuple[int, str, str]] = frozenset()) -> None:  # type: ignore[assignment]
        self.contexts = {c: Context(run_id=1, node_id=int(c) + 1, node_config={"partition-id": int(c),
                                                                               "num-partitions": len(client_ids)},
                                    state=RecordDict(), run_config=run_config) for c in client_ids}
        self.replies: list[Message] = []
        self.true_uploads: dict[tuple[int, str], tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]] = {}
        self.drop = drop
        real = client_secagg.mask_upload

        def recording(secrets: Any, config: Any, payload: Any, upload: Any, num_examples: int, seed: int,
                      client_id: str, *rest: Any) -> Any:
            self.true_uploads[(secrets.server_round, client_id)] = (dict(payload), dict(upload), num_examples)
            return real(secrets, config, payload, upload, num_examples, seed, client_id, *rest)

        monkeypatch.setattr(client_secagg, "mask_upload", recording)

    def __call__(self, cid: str, msg: Message) -> Message | None:
        server_round = int(msg.content.config_records["config"]["server-round"])
        if (server_round, cid, stage_of(msg) or "") in self.drop:
            return None
        handler = client_app.train if msg.metadata.message_type == MessageType.TRAIN else client_app.evaluate
        reply = handler(msg, self.contexts[cid])
        self.replies.append(reply)
        return reply


def _federate(run_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
              drop: set[tuple[int, str, str]] = frozenset()) -> tuple[Any, Clients]:  # type: ignore[assignment]
    run = compose_run(run_config)
    cfg = run.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    strategy = build_strategy(cfg, data)
    clients = Clients(run_config, data.client_ids, monkeypatch, drop)
    run_federation(strategy, FakeGrid(data.client_ids, clients), run.settings, RunRecorder(cfg, run.settings, resume=bool(cfg.resume)))
    return strategy, clients


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _plain_mean(clients: Clients, server_round: int, keys: list[str], cids: list[str]) -> dict[str, np.ndarray]:
    """The slow, obvious weighted mean of the true uploads of ``cids`` in ``server_round``."""
    ups = [clients.true_uploads[(server_round, c)] for c in cids]
    total = sum(n for _, _, n in ups)
    return {k: sum(n * up[k].astype(np.float64) for _, up, n in ups) / total for k in keys}


@pytest.mark.usefixtures("flower_task")
@pytest.mark.parametrize("strategy_name", ["fedavg", "fedbn"])
def test_the_server_receives_no_unmasked_shared_tensor_and_gets_the_mean(
        strategy_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = build_strategy(compose_config(_run_config(tmp_path, "x", 1, strategy=strategy_name)),
                            load_federated_data(compose_config(_run_config(tmp_path, "x", 1)).dataset, 0))
    initial = {k: np.array(v, copy=True) for k, v in before.global_arrays.items()}
    strategy, clients = _federate(_run_config(tmp_path, "run", 1, strategy=strategy_name), monkeypatch)
    assert strategy.secure is not None
    keys = strategy.secure.masked_keys
    cids = sorted(strategy.client_ids, key=int)
    assert len(clients.true_uploads) == len(cids)
    # every array of every message the server received, against every client's true shared tensors
    received = [a for reply in clients.replies for record in reply.content.array_records.values()
                for a in record.values()]
    assert received, "the clients sent nothing"
    for (_, cid), (_, upload, _) in clients.true_uploads.items():
        for k in keys:
            true = upload[k].ravel()
            for array in received:
                values = array.numpy().ravel()
                assert not (values.shape == true.shape and np.allclose(values, true, atol=1e-3)), (cid, k)
                if values.size > 1 and values.shape == true.shape:     # nor a scaled copy of it
                    assert abs(np.corrcoef(values.astype(np.float64), true)[0, 1]) < 0.5, (cid, k)
    # the new global model is the plain weighted mean of the true uploads, within the stated bound
    record = _records(tmp_path / "run")[-1]
    bound = record["secure_aggregation"]["mean_bound"]
    assert record["secure_aggregation"]["clipped_values"] == 0
    plain = _plain_mean(clients, 1, keys, cids)
    for k in keys:
        diff = np.abs(strategy.global_arrays[k].astype(np.float64) - plain[k]).max()
        assert diff <= bound + 1e-6 * (1 + np.abs(plain[k]).max()), (k, diff, bound)   # + float32 storage
    moved = [k for k in keys if not np.array_equal(strategy.global_arrays[k], initial[k])]
    assert moved == keys          # every masked tensor was aggregated (none left at its initial value)


@pytest.mark.usefixtures("flower_task")
def test_a_client_that_drops_after_key_sharing_leaves_the_round_complete(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    strategy, clients = _federate(_run_config(tmp_path, "run", 1), monkeypatch, drop={(1, "2", COLLECT)})
    record = _records(tmp_path / "run")[-1]
    assert "2" in record["failed"] and record["secure_aggregation"]["dropped_after_key_sharing"] == ["2"]
    assert record["secure_aggregation"]["clients"] == 3
    survivors = ["0", "1", "3"]
    plain = _plain_mean(clients, 1, strategy.secure.masked_keys, survivors)
    bound = record["secure_aggregation"]["mean_bound"]
    for k, v in plain.items():
        assert np.abs(strategy.global_arrays[k].astype(np.float64) - v).max() <= bound + 1e-6 * (1 + np.abs(v).max())


@pytest.mark.usefixtures("flower_task")
def test_below_the_threshold_the_run_fails_cleanly_and_its_resume_ends_as_an_undisturbed_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    threshold = ["privacy.secagg_threshold=4"]       # all 4 clients needed
    with pytest.raises(RoundFailedError, match="fell below its threshold at collect"):
        _federate(_run_config(tmp_path, "run", 2, threshold), monkeypatch, drop={(2, "1", COLLECT)})
    assert [r["round"] for r in _records(tmp_path / "run")] == [1]     # round 2 left nothing behind
    resumed, _ = _federate(_run_config(tmp_path, "run", 2, threshold, resume=tmp_path / "run"), monkeypatch)
    straight, _ = _federate(_run_config(tmp_path, "straight", 2, threshold), monkeypatch)
    for k, v in straight.global_arrays.items():
        np.testing.assert_array_equal(resumed.global_arrays[k], v, err_msg=k)
    assert _records(tmp_path / "run")[-1]["clients"] == _records(tmp_path / "straight")[-1]["clients"]


@pytest.mark.usefixtures("flower_task")
def test_distributed_dp_accounts_a_round_with_a_dropout_at_the_noise_it_has(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    dp = ["privacy.dp=distributed", "privacy.noise_multiplier=0.5", "privacy.clip_norm=1.0"]
    _federate(_run_config(tmp_path, "run", 2, dp), monkeypatch, drop={(2, "2", COLLECT)})
    first, second = _records(tmp_path / "run")
    assert first["privacy"]["noise_multiplier"] == 0.5 and first["privacy"]["noise_added_by"] == "clients"
    assert second["privacy"]["noise_multiplier"] == pytest.approx(0.5 * np.sqrt(3 / 4))   # 3 of 4 noise shares
    from common.privacy import epsilon_of_schedule
    from common.settings import PrivacySettings

    settings = PrivacySettings(dp="distributed", clip_norm=1.0, noise_multiplier=0.5, delta=1e-5, max_epsilon=None,
                               noise_seed=None)
    assert second["privacy"]["epsilon"] == pytest.approx(epsilon_of_schedule(settings, 4, [0.5, 0.5 * np.sqrt(3 / 4)]))
    assert second["privacy"]["epsilon"] > epsilon_of_schedule(settings, 4, [0.5, 0.5])


@pytest.mark.usefixtures("flower_task")
def test_a_client_missing_at_unmask_is_covered_by_the_others_shares(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    strategy, clients = _federate(_run_config(tmp_path, "run", 1), monkeypatch, drop={(1, "3", UNMASK)})
    record = _records(tmp_path / "run")[-1]
    assert record["secure_aggregation"]["clients"] == 4 and record["failed"] == {}
    plain = _plain_mean(clients, 1, strategy.secure.masked_keys, ["0", "1", "2", "3"])
    for k, v in plain.items():
        assert np.abs(strategy.global_arrays[k].astype(np.float64) - v).max() <= (
            record["secure_aggregation"]["mean_bound"] + 1e-6 * (1 + np.abs(v).max()))


@pytest.mark.usefixtures("flower_task")
def test_a_client_missing_at_setup_sits_the_round_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _federate(_run_config(tmp_path, "run", 1), monkeypatch, drop={(1, "0", SETUP)})
    record = _records(tmp_path / "run")[-1]
    assert "secure aggregation's setup" in record["failed"]["0"] or "no setup reply" in record["failed"]["0"]
    assert record["secure_aggregation"]["clients"] == 3


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("name", [n for n in method_names() if method(n).not_private or n in PRIVATE_FORM])
def test_a_method_that_needs_each_upload_refuses_secure_aggregation(name: str) -> None:
    with pytest.raises(ConfigError, match=f"privacy.secure_aggregation=secagg\\+ does not apply to {name}: "):
        validate_config(compose_config(overrides=[f"strategy={name}", "privacy.secure_aggregation=secagg+"]))


def test_distributed_dp_without_secure_aggregation_is_refused() -> None:
    with pytest.raises(ConfigError, match="privacy.dp=distributed needs privacy.secure_aggregation=secagg"):
        validate_config(compose_config(overrides=["privacy.dp=distributed"]))
    validate_config(compose_config(overrides=["privacy.dp=distributed", "privacy.secure_aggregation=secagg+"]))


def test_a_threshold_above_the_clients_and_a_norm_bound_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"secagg_threshold=40 is above the \d+ clients"):
        validate_config(compose_config(overrides=["privacy.secure_aggregation=secagg+",
                                                  "privacy.secagg_threshold=40"]))
    with pytest.raises(ConfigError, match="norm_bound=5 cannot be checked under secure aggregation"):
        validate_config(compose_config(overrides=["privacy.secure_aggregation=secagg+", "norm_bound=5"]))
    with pytest.raises(ConfigError, match="privacy.secure_aggregation must be one of none, secagg"):
        validate_config(compose_config(overrides=["privacy.secure_aggregation=secagg"]))
    with pytest.raises(ConfigError, match="privacy.secagg_threshold must be a fraction"):
        validate_config(compose_config(overrides=["privacy.secure_aggregation=secagg+", "privacy.secagg_threshold=1.5"]))


def test_every_averaging_method_composes_with_secure_aggregation() -> None:
    for name in (n for n in method_names() if not method(n).not_private):
        validate_config(compose_config(overrides=[f"strategy={name}", *PRIVATE_FORM.get(name, []),
                                                  "privacy.secure_aggregation=secagg+"]))


def test_flowers_strategy_start_is_refused_with_secure_aggregation_on() -> None:
    """Flower's own round driver would send plain train messages (clients upload in the clear)."""
    from flwr.app import ArrayRecord, ConfigRecord

    from common.settings import PrivacySettings
    from strategies.base import RunSettings
    from strategies.baselines import FedAvg

    privacy = PrivacySettings(dp="none", clip_norm=1.0, noise_multiplier=1.0, delta=1e-5, max_epsilon=None,
                              noise_seed=None, secure_aggregation="secagg+")
    run = RunSettings(seed=0, rounds=2, fraction_train=1.0, min_train_clients=2, wait_for_clients=1.0,
                      round_timeout=1.0, norm_bound=0.0, privacy=privacy)
    strategy = FedAvg({"w": np.zeros(3, np.float32)}, ["0", "1"], run, resolve_method({"name": "fedavg", "weighted": True}))
    assert strategy.secure is not None and strategy.secure.masked_keys == ["w"]
    with pytest.raises(RuntimeError, match="runs in pflower's round loop"):
        strategy.configure_train(1, ArrayRecord(), ConfigRecord({}), FakeGrid(["0", "1"]))
