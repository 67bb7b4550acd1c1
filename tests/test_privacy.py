"""Differential privacy of the shared part (``privacy.dp=central``, docs/privacy.md).

The math against slow, obvious computations written here; the accountant against
dp-accounting's own computation of the same schedule; the noise's scale by a statistical test
with a fixed seed; the refusals of composition; the checkpoint round trip. The method
contract test (``tests/test_method_contract.py``) runs every method that takes DP through the
real loop and ClientApp, resume included.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting
import numpy as np
import pytest
from helpers import PRIVATE_FORM

from common.config import ConfigError, compose_config, validate_config
from common.methods import method, method_names, resolve_method
from common.privacy import epsilon_of, rounds_within
from common.settings import PrivacySettings
from strategies.base import ClientUpdate, RoundFailedError, RunSettings, TrainRound
from strategies.baselines import FedAvg
from strategies.privacy import CentralDP, PrivacyBudgetSpent
from strategies.privacy_math import clip_update

KEYS = ["conv.weight", "conv.bias", "bn.running_var", "bn.num_batches_tracked"]


def _privacy(**kw: Any) -> PrivacySettings:
    values: dict[str, Any] = {"dp": "central", "clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 1e-5,
                              "max_epsilon": None, "noise_seed": 3}
    return PrivacySettings(**{**values, **kw})


def _arrays(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"conv.weight": (scale * rng.normal(size=(4, 3, 3, 3))).astype(np.float32),
            "conv.bias": (scale * rng.normal(size=4)).astype(np.float32),
            "bn.running_var": (1.0 + scale * np.abs(rng.normal(size=4))).astype(np.float32),
            "bn.num_batches_tracked": np.array(int(rng.integers(1, 100)), dtype=np.int64)}


def _near(reference: dict[str, np.ndarray], rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    """``reference`` moved by ``scale`` times a standard normal update (counters changed too)."""
    out = {k: (v + scale * rng.normal(size=v.shape)).astype(v.dtype) for k, v in reference.items() if k in KEYS[:3]}
    return out | {"bn.num_batches_tracked": reference["bn.num_batches_tracked"] + 5}


def _strategy(clients: int, privacy: PrivacySettings | None, initial: dict[str, np.ndarray],
              fraction: float = 1.0) -> FedAvg:
    run = RunSettings(seed=0, rounds=5, fraction_train=fraction, min_train_clients=1, wait_for_clients=1.0,
                      round_timeout=1.0, norm_bound=0.0, privacy=privacy)
    return FedAvg(initial, [str(c) for c in range(clients)], run, resolve_method({"name": "fedavg", "weighted": True}))


def _aggregate(strategy: FedAvg, uploads: list[dict[str, np.ndarray]], server_round: int = 1,
               sizes: list[int] | None = None) -> dict[str, Any]:
    """One handed round of ``uploads`` (client i uploads ``uploads[i]``); the round's notes."""
    sent = {str(i): dict(strategy.global_arrays) for i in range(len(uploads))}
    train = TrainRound.handed(server_round, sent)
    updates = [ClientUpdate(str(i), i + 1, a, (sizes or [10] * len(uploads))[i], {}) for i, a in enumerate(uploads)]
    return strategy.aggregate_private(train, updates)


# ------------------------------------------------------------------ the math
def test_clip_update_scales_the_joint_update_to_the_norm_and_keeps_integer_counters() -> None:
    rng = np.random.default_rng(0)
    reference, upload = _arrays(rng), _arrays(rng, scale=3.0)
    clipped, norm = clip_update(upload, reference, KEYS, clip_norm=0.5)
    # the obvious way: every float number's difference, one by one, in one list
    diffs = [float(u) - float(r) for k in KEYS[:3]
             for u, r in zip(upload[k].ravel().tolist(), reference[k].ravel().tolist(), strict=True)]
    expected_norm = math.sqrt(sum(d * d for d in diffs))
    assert norm == pytest.approx(expected_norm, rel=1e-12)
    factor = 0.5 / expected_norm
    for k in KEYS[:3]:
        want = reference[k].astype(np.float64) + (upload[k].astype(np.float64) - reference[k]) * factor
        np.testing.assert_allclose(clipped[k], want, rtol=1e-6, atol=1e-7)
        assert clipped[k].dtype == upload[k].dtype
    assert clipped["bn.num_batches_tracked"] == reference["bn.num_batches_tracked"]   # not released
    again, norm_after = clip_update(clipped, reference, KEYS, clip_norm=0.5)
    assert norm_after == pytest.approx(0.5, rel=1e-5)
    small, _ = clip_update(reference | {"conv.bias": reference["conv.bias"] + 1e-3}, reference, KEYS, 0.5)
    np.testing.assert_array_equal(small["conv.bias"], reference["conv.bias"] + 1e-3)   # within: unchanged


def test_the_private_mean_is_the_unweighted_mean_of_the_clipped_updates() -> None:
    rng = np.random.default_rng(1)
    initial = _arrays(rng)
    uploads = [_near(initial, rng, s) for s in (0.01, 2.0, 5.0)]
    strategy = _strategy(3, _privacy(clip_norm=1.5, noise_multiplier=1e-9), initial)
    notes = _aggregate(strategy, uploads, sizes=[1, 100, 1000])      # sizes ignored: unweighted
    for k in KEYS[:3]:
        deltas = []
        for u in uploads:
            norm = math.sqrt(sum(float(np.sum((u[j].astype(np.float64) - initial[j]) ** 2)) for j in KEYS[:3]))
            deltas.append((u[k].astype(np.float64) - initial[k]) * min(1.0, 1.5 / norm))
        np.testing.assert_allclose(strategy.global_arrays[k], initial[k] + sum(deltas) / 3, rtol=1e-5, atol=1e-6)
    assert strategy.global_arrays["bn.num_batches_tracked"] == initial["bn.num_batches_tracked"]
    assert notes["privacy"]["clipped"] == 2 and notes["privacy"]["noise_std"] == pytest.approx(1e-9 * 1.5 / 3)


def test_every_shared_update_the_mean_takes_is_within_the_clip_norm() -> None:
    rng = np.random.default_rng(2)
    initial = _arrays(rng)
    strategy = _strategy(5, _privacy(clip_norm=0.25), initial)
    taken: list[dict[str, np.ndarray]] = []
    original = strategy.aggregate_updates

    def spy(train: TrainRound, updates: list[ClientUpdate]) -> Any:
        taken.extend(u.arrays for u in updates)
        return original(train, updates)

    strategy.aggregate_updates = spy  # type: ignore[method-assign]
    _aggregate(strategy, [_near(initial, rng, s) for s in (0.001, 0.1, 1.0, 10.0, 100.0)])
    assert len(taken) == 5
    for arrays in taken:
        assert math.sqrt(sum(float(np.sum((arrays[k].astype(np.float64) - initial[k]) ** 2))
                             for k in KEYS[:3])) <= 0.25 * (1 + 1e-6)


def test_the_noise_has_the_configured_scale_and_is_drawn_again_on_a_resume() -> None:
    """Every client uploads exactly what it was sent, so the new global model minus the old is
    the noise alone: its std must be z C / m (20,004 draws: a 3% tolerance is about 6
    standard errors of a sample std) and its mean 0 (within 5 standard errors)."""
    initial = {"w": np.zeros((100, 200), np.float32), "b": np.zeros(4, np.float32)}
    z, c, m = 1.3, 0.8, 4
    strategy = _strategy(m, _privacy(clip_norm=c, noise_multiplier=z, noise_seed=11), initial)
    _aggregate(strategy, [dict(initial) for _ in range(m)], server_round=5)
    noise = np.concatenate([strategy.global_arrays[k].astype(np.float64).ravel() for k in ("w", "b")])
    std = z * c / m
    assert noise.std() == pytest.approx(std, rel=0.03)
    assert abs(noise.mean()) < 5 * std / math.sqrt(noise.size)
    # the same key and round draw the same noise (a resumed round), another round other noise
    again = _strategy(m, _privacy(clip_norm=c, noise_multiplier=z, noise_seed=11), initial)
    _aggregate(again, [dict(initial) for _ in range(m)], server_round=5)
    np.testing.assert_array_equal(again.global_arrays["w"], strategy.global_arrays["w"])
    later = _strategy(m, _privacy(clip_norm=c, noise_multiplier=z, noise_seed=11), initial)
    _aggregate(later, [dict(initial) for _ in range(m)], server_round=6)
    assert not np.array_equal(later.global_arrays["w"], strategy.global_arrays["w"])
    # no seed: the OS's randomness, two runs differ
    secret = [_strategy(m, _privacy(noise_seed=None), initial) for _ in range(2)]
    assert secret[0].privacy is not None and secret[1].privacy is not None
    assert secret[0].privacy.noise_key != secret[1].privacy.noise_key


def test_a_noisy_running_variance_stays_non_negative() -> None:
    initial = {"bn.running_var": np.full(1000, 1e-3, np.float32)}
    strategy = _strategy(2, _privacy(clip_norm=1.0, noise_multiplier=5.0), initial)
    _aggregate(strategy, [dict(initial), dict(initial)])
    assert strategy.global_arrays["bn.running_var"].min() >= 0.0


# ------------------------------------------------------------------ the accounting
@pytest.mark.parametrize(("population", "rounds", "z"), [(10, 30, 1.1), (10, 50, 0.9), (100, 200, 2.0)])
def test_epsilon_equals_dp_accountings_own_computation(population: int, rounds: int, z: float) -> None:
    """Each round a Gaussian mechanism of multiplier z (add or remove one client moves the sum
    of clipped updates by at most C), with no amplification by sampling: the sample is drawn
    from the run's seed, which is no secret (common/privacy.py)."""
    privacy = _privacy(noise_multiplier=z, delta=1e-6)
    dp = CentralDP(privacy, population, ["w"])
    for _ in range(rounds):
        ours = dp.account()
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.GaussianDpEvent(z), rounds)
    assert ours == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    assert dp.summary()["rounds_accounted"] == rounds
    # sampling fewer clients a round claims no amplification: the same epsilon
    few = _strategy(population, privacy, {"w": np.zeros(2, np.float32)}, fraction=0.2)
    assert few.privacy is not None
    for _ in range(rounds):
        few.privacy.account()
    assert few.privacy.epsilon == ours


def test_rounds_of_different_noise_compose_as_dp_accounting_composes_them() -> None:
    """privacy.dp=distributed: a round some clients dropped from carries less noise and is
    accounted at its own multiplier; the composition is dp-accounting's own."""
    privacy = _privacy(noise_multiplier=1.0, delta=1e-6)
    dp = CentralDP(privacy, 20, ["w"])
    schedule = [1.0, 1.0, 0.8, 1.0, 0.6, 0.9]
    for z in schedule:
        ours = dp.account(z)
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for z in schedule:
        acc.compose(dp_accounting.GaussianDpEvent(z))
    assert ours == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    assert dp.state()["schedule"] == schedule


def test_the_budget_gives_the_largest_number_of_rounds_that_fits() -> None:
    privacy = _privacy(noise_multiplier=1.0, max_epsilon=8.0)
    fit = rounds_within(privacy, 8, 100)
    assert 0 < fit < 100
    assert epsilon_of(privacy, 8, fit) <= 8.0 < epsilon_of(privacy, 8, fit + 1)


def test_a_round_past_the_budget_stops_before_its_model_is_released() -> None:
    """The server counts what it released (a resume adds the round it redoes), so a budget
    composition allowed can still run out: the round stops before the noise and the release."""
    initial = {"w": np.zeros(3, np.float32)}
    privacy = _privacy(noise_multiplier=1.0, max_epsilon=8.0, noise_seed=None)
    fit = rounds_within(privacy, 2, 100)
    assert fit < 5
    with pytest.raises(ValueError, match=f"at most {fit} rounds fit"):   # rounds=5: refused when built
        _strategy(2, privacy, initial)
    run = RunSettings(seed=0, rounds=fit, fraction_train=1.0, min_train_clients=1, wait_for_clients=1.0,
                      round_timeout=1.0, norm_bound=0.0, privacy=privacy)
    strategy = FedAvg(initial, ["0", "1"], run, resolve_method({"name": "fedavg", "weighted": True}))
    assert strategy.privacy is not None
    for r in range(1, fit + 1):
        _aggregate(strategy, [dict(initial), dict(initial)], server_round=r)
    released = dict(strategy.global_arrays)
    with pytest.raises(PrivacyBudgetSpent, match="privacy.max_epsilon=8 is spent"):
        _aggregate(strategy, [{"w": initial["w"] + 1}, dict(initial)], server_round=fit + 1)
    np.testing.assert_array_equal(strategy.global_arrays["w"], released["w"])   # nothing new to send


def test_a_resume_with_a_secret_key_draws_new_noise_and_counts_the_redone_round() -> None:
    initial = {"w": np.zeros(50, np.float32)}
    private = _strategy(2, _privacy(noise_seed=None), initial)
    _aggregate(private, [dict(initial), dict(initial)])
    groups, meta = private.state()
    resumed = _strategy(2, _privacy(noise_seed=None), initial)
    resumed.load_state(groups, meta)
    assert resumed.privacy is not None and private.privacy is not None
    assert resumed.privacy.releases == private.privacy.releases + 1
    assert resumed.privacy.epsilon > private.privacy.epsilon
    assert resumed.privacy.noise_key != private.privacy.noise_key
    # the redone round 2 and the first attempt's round 2 draw independent noise
    _aggregate(private, [dict(initial), dict(initial)], server_round=2)
    _aggregate(resumed, [dict(initial), dict(initial)], server_round=2)
    assert not np.array_equal(private.global_arrays["w"], resumed.global_arrays["w"])


def test_a_method_that_changes_an_unshared_global_tensor_fails_the_round() -> None:
    initial = {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    strategy = _strategy(2, _privacy(), initial)
    assert strategy.privacy is not None
    strategy.privacy.shared_keys = ["w"]
    original = strategy.aggregate_updates

    def leaky(train: TrainRound, updates: list[ClientUpdate]) -> Any:
        notes = original(train, updates)
        strategy.global_arrays["b"] = np.ones(2, np.float32)     # an unshared tensor, not noised
        return notes

    strategy.aggregate_updates = leaky  # type: ignore[method-assign]
    with pytest.raises(RoundFailedError, match=r"not shared \(\['b'\]\)"):
        _aggregate(strategy, [{"w": np.ones(3, np.float32)}, {"w": np.ones(3, np.float32)}])


# ------------------------------------------------------------------ refusals (one line, nothing started)
@pytest.mark.parametrize("name", [n for n in method_names() if method(n).not_private or n in PRIVATE_FORM])
def test_a_method_that_needs_each_upload_refuses_dp_at_composition(name: str) -> None:
    with pytest.raises(ConfigError, match=f"privacy.dp=central does not apply to {name}: "):
        validate_config(compose_config(overrides=[f"strategy={name}", "privacy.dp=central"]))
    initial = {"w": np.zeros(3, np.float32)}
    run = RunSettings(seed=0, rounds=1, fraction_train=1.0, min_train_clients=1, wait_for_clients=1.0,
                      round_timeout=1.0, norm_bound=0.0, privacy=_privacy())
    with pytest.raises(ValueError, match="does not apply"):     # a strategy built by hand refuses too
        FedAvg(initial, ["0"], run, resolve_method(compose_config(overrides=[f"strategy={name}"]).strategy))


def test_every_averaging_method_composes_with_dp() -> None:
    private = [n for n in method_names() if not method(n).not_private]
    assert {"fedavg", "fedbn", "fedbabu", "ditto", "fedprox", "partialfed-fix", "fedbasis"} <= set(private)
    for name in private:
        validate_config(compose_config(overrides=[f"strategy={name}", *PRIVATE_FORM.get(name, []), "privacy.dp=central"]))


def test_rounds_beyond_the_budget_are_refused_naming_the_rounds_that_fit() -> None:
    overrides = ["privacy.dp=central", "privacy.max_epsilon=8", "rounds=100"]
    with pytest.raises(ConfigError, match=r"at most \d+ rounds fit: set rounds=\d+") as err:
        validate_config(compose_config(overrides=overrides))
    fit = int(str(err.value).split("set rounds=")[1].split(",")[0])
    validate_config(compose_config(overrides=[*overrides[:2], f"rounds={fit}"]))
    with pytest.raises(ConfigError, match="not even one round fits"):
        validate_config(compose_config(overrides=["privacy.dp=central", "privacy.max_epsilon=0.01"]))
    with pytest.raises(ConfigError, match="privacy.dp must be one of none, central"):
        validate_config(compose_config(overrides=["privacy.dp=local"]))


def test_a_private_checkpoint_does_not_resume_without_privacy_nor_the_reverse() -> None:
    initial = {"w": np.zeros(3, np.float32)}
    private = _strategy(2, _privacy(), initial)
    _aggregate(private, [dict(initial), dict(initial)])
    groups, meta = private.state()
    with pytest.raises(ValueError, match="taken with privacy.dp=central"):
        _strategy(2, None, initial).load_state(groups, meta)
    plain_groups, plain_meta = _strategy(2, None, initial).state()
    with pytest.raises(ValueError, match="taken without privacy.dp=central"):
        _strategy(2, _privacy(), initial).load_state(plain_groups, plain_meta)
    resumed = _strategy(2, _privacy(), initial)      # noise_seed fixed: bit for bit
    resumed.load_state(groups, meta)
    assert resumed.privacy is not None and private.privacy is not None
    assert resumed.privacy.state() == private.privacy.state()
