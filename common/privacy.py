"""Differential-privacy accounting of a run's rounds, with Flower's ``RdpAccountant``.

Composition refuses a configuration whose rounds would spend more than ``privacy.max_epsilon``
(:func:`rounds_within`), and the server's :class:`strategies.privacy.CentralDP` composes each
round as it happens; both use the one accounting model here.

pflower samples a fixed number ``k`` of the ``N`` clients each round, uniformly without
replacement (:func:`planned_sample`). With every client sampled (``k = N``) a round is a
Gaussian mechanism of noise multiplier ``z`` on the sum of the clipped updates (add or remove
one client: L2 sensitivity ``C``), accounted with no amplification. With ``k < N`` the round is
accounted as sampling without replacement, whose neighbouring relation is *replace one*
client: the sensitivity is then ``2C`` and the accountant is given ``z / 2``. Both are
models of Flower's ``PrivacyConfig``.
"""

from __future__ import annotations

from typing import Any

from common.settings import PrivacySettings


def planned_sample(num_clients: int, fraction_train: float, min_train_clients: int) -> int:
    """The clients a round samples when all ``num_clients`` are connected (the rule of
    ``PersonalizedStrategy.begin_train``)."""
    return min(num_clients, max(min_train_clients, int(round(num_clients * fraction_train))))


def accounting_model(sampled: int, population: int) -> tuple[str, str, float]:
    """(sampling method, neighbouring relation, sensitivity in units of C) of a round that
    samples ``sampled`` of ``population`` clients (Flower's ``SamplingMethod`` and
    ``NeighboringRelation`` values)."""
    if sampled >= population:
        return "no-amplification", "add-or-remove-one", 1.0
    return "without-replacement", "replace-one", 2.0


def new_accountant(settings: PrivacySettings, sampled: int, population: int) -> Any:
    """Flower's ``RdpAccountant`` for rounds of ``sampled`` of ``population`` clients (needs
    the ``dp-accounting`` package, Flower's ``dp`` extra, and Flower >= 1.42)."""
    try:
        from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
    except ImportError as err:
        raise ImportError("privacy.dp=central needs Flower >= 1.42 with its accountant (pip install "
                          f"'flwr[dp]>=1.42'): {err}") from err
    sampling, relation, _ = accounting_model(sampled, population)
    return RdpAccountant(PrivacyConfig(target_delta=settings.delta, population_size=population,
                                       neighboring_relation=NeighboringRelation(relation),
                                       sampling_method=SamplingMethod(sampling),
                                       max_epsilon=settings.max_epsilon))


def round_event(settings: PrivacySettings, sampled: int, population: int, sensitivity: float) -> Any:
    """Flower's ``GaussianPrivacyEvent`` of one round of ``sampled`` clients (the noise
    multiplier over the ``sensitivity``, in units of C, of :func:`accounting_model`)."""
    from flwr.serverapp import GaussianPrivacyEvent

    return GaussianPrivacyEvent(noise_multiplier=settings.noise_multiplier / sensitivity,
                                sample_size=sampled, population_size=population)


def epsilon_of(settings: PrivacySettings, planned: int, population: int, ledger: list[int]) -> float:
    """epsilon at ``privacy.delta`` after rounds that sampled ``ledger[i]`` clients each, under
    the accounting model of ``planned`` of ``population`` (:func:`accounting_model`)."""
    accountant = new_accountant(settings, planned, population)
    _, _, sensitivity = accounting_model(planned, population)
    for sampled in sorted(set(ledger)):
        accountant.compose(round_event(settings, sampled, population, sensitivity), ledger.count(sampled))
    return float(accountant.get_epsilon(settings.delta)) if ledger else 0.0


def projected_epsilon(settings: PrivacySettings, sampled: int, population: int, rounds: int) -> float:
    """epsilon at ``privacy.delta`` after ``rounds`` rounds of ``sampled`` of ``population``."""
    return epsilon_of(settings, sampled, population, [sampled] * rounds)


def rounds_within(settings: PrivacySettings, sampled: int, population: int, rounds: int) -> int:
    """The most rounds (<= ``rounds``) whose epsilon stays within ``privacy.max_epsilon``."""
    budget = settings.max_epsilon
    if budget is None:
        return rounds
    low, high = 0, rounds       # epsilon grows with the rounds: bisect
    while low < high:
        mid = (low + high + 1) // 2
        if projected_epsilon(settings, sampled, population, mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return low
