"""Differential-privacy accounting of a run's rounds, with Flower's ``RdpAccountant``.

Composition refuses a configuration whose rounds would spend more than ``privacy.max_epsilon``
(:func:`rounds_within`), the server's strategy checks it again with the clients it has, and
:class:`strategies.privacy.CentralDP` composes each round as it is released; all use the one
model here.

Each round is a Gaussian mechanism of noise multiplier ``z`` on the sum of the clipped
updates: adding or removing one client changes that sum by at most ``C`` in L2. It is
accounted *with no amplification by sampling*, whatever ``fraction_train`` is. Amplification
needs the round's sample to be secret, and pflower draws it from the run's seed (which is in
the configuration) and records it in metrics.jsonl. So the epsilon reported for ``k`` of ``N``
clients a round is that of every client every round: an upper bound.
"""

from __future__ import annotations

from typing import Any

from common.settings import PrivacySettings


def new_accountant(settings: PrivacySettings, population: int) -> Any:
    """Flower's ``RdpAccountant`` (no amplification, add or remove one client) for a run of
    ``population`` clients (needs the ``dp-accounting`` package, Flower's ``dp`` extra, and
    Flower >= 1.42)."""
    try:
        from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
    except ImportError as err:
        raise ImportError("privacy.dp (central or distributed) needs Flower >= 1.42 with its accountant (pip install "
                          f"'flwr[dp]>=1.42'): {err}") from err
    return RdpAccountant(PrivacyConfig(target_delta=settings.delta, population_size=population,
                                       neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                       sampling_method=SamplingMethod.NO_AMPLIFICATION,
                                       max_epsilon=settings.max_epsilon))


def epsilon_of(settings: PrivacySettings, population: int, releases: int) -> float:
    """epsilon at ``privacy.delta`` after ``releases`` rounds released (0 for none)."""
    return epsilon_of_schedule(settings, population, [settings.noise_multiplier] * releases)


def epsilon_of_schedule(settings: PrivacySettings, population: int, multipliers: list[float]) -> float:
    """epsilon at ``privacy.delta`` after rounds released with these noise multipliers (with
    ``privacy.dp=distributed`` a round some clients dropped from carries less noise)."""
    if not multipliers:
        return 0.0
    from flwr.serverapp import GaussianPrivacyEvent

    accountant = new_accountant(settings, population)
    counts: dict[float, int] = {}
    for z in multipliers:
        counts[float(z)] = counts.get(float(z), 0) + 1
    for z, count in counts.items():    # composition commutes: one event per distinct multiplier
        accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=population,
                                                population_size=population), count)
    return float(accountant.get_epsilon(settings.delta))


def rounds_within(settings: PrivacySettings, population: int, rounds: int) -> int:
    """The most rounds (<= ``rounds``) whose epsilon stays within ``privacy.max_epsilon``."""
    budget = settings.max_epsilon
    if budget is None:
        return rounds
    low, high = 0, rounds       # epsilon grows with the rounds: bisect
    while low < high:
        mid = (low + high + 1) // 2
        if epsilon_of(settings, population, mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def budget_problem(settings: PrivacySettings, population: int, rounds: int) -> str | None:
    """Why ``rounds`` rounds of ``population`` clients do not fit in ``privacy.max_epsilon``
    (one line naming how many do), or None."""
    if settings.max_epsilon is None:
        return None
    spent = epsilon_of(settings, population, rounds)
    if spent <= settings.max_epsilon:
        return None
    fit = rounds_within(settings, population, rounds)
    return (f"privacy.max_epsilon={settings.max_epsilon:g}: {rounds} rounds of {population} clients spend epsilon "
            f"{spent:.3g} at delta {settings.delta:g} (noise_multiplier={settings.noise_multiplier:g}); "
            + (f"at most {fit} rounds fit: set rounds={fit}" if fit else "not even one round fits")
            + ", or raise privacy.noise_multiplier or privacy.max_epsilon")
