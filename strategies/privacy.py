"""Central differential privacy of the shared part: the server's clipping, noise and accounting.

:class:`CentralDP` is what a :class:`strategies.base.PersonalizedStrategy` holds when
``privacy.dp=central``: it clips each valid update's shared tensors (:meth:`clip`) before the
method's mean, adds the noise to the new global arrays (:meth:`add_noise`), and composes the
round into Flower's ``RdpAccountant`` (:meth:`account`). The math is in
``strategies/privacy_math.py``; what the guarantee covers is in docs/privacy.md.

Accounting (the model, and the budget composition refuses) is in ``common/privacy.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from common.privacy import epsilon_of
from common.settings import PrivacySettings
from learning.params import NDArrays
from strategies.privacy_math import add_noise, clip_update, noise_std


class CentralDP:
    """DP-FedAvg's server side (``privacy.dp=central``) for one run.

    Parameters
    ----------
    settings : the ``privacy`` group.
    population : the run's clients (N).
    shared_keys : the tensors the method averages (its shared role), in state-dict order.
    """

    def __init__(self, settings: PrivacySettings, population: int, planned_sample: int,
                 shared_keys: Iterable[str]) -> None:
        self.settings = settings
        self.population = population
        self.shared_keys = list(shared_keys)
        # the noise's secret: the OS's randomness unless the configuration fixes it; kept in
        # the server's checkpoint so that a resumed round draws the same noise
        self.noise_key = settings.noise_seed if settings.noise_seed is not None else secrets.randbits(63)
        # the accounting model follows the planned sampling (every client, or k of N); a round
        # that samples fewer (clients not connected) is composed under the same model
        self.planned_sample = planned_sample
        self.ledger: list[int] = []      # the clients sampled in each round released so far
        self.epsilon = 0.0

    def clip(self, arrays: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray]) -> tuple[NDArrays, float]:
        """One upload with its shared update clipped to ``clip_norm``; and the norm before."""
        keys = [k for k in self.shared_keys if k in arrays and k in sent]
        return clip_update(arrays, sent, keys, self.settings.clip_norm)

    def add_noise(self, global_arrays: Mapping[str, np.ndarray], replies: int, server_round: int) -> NDArrays:
        """The new global arrays with the noise of the mean of ``replies`` clipped updates
        (drawn from the run's noise key and the round: a resumed round draws the same)."""
        std = noise_std(self.settings.noise_multiplier, self.settings.clip_norm, replies)
        rng = np.random.default_rng([self.noise_key, server_round])
        keys = [k for k in self.shared_keys if k in global_arrays]
        return add_noise(global_arrays, keys, std, rng)

    def account(self, sampled: int) -> float:
        """Compose one round of ``sampled`` clients; returns epsilon at ``privacy.delta``."""
        self.ledger.append(int(sampled))
        self.epsilon = epsilon_of(self.settings, self.planned_sample, self.population, self.ledger)
        return self.epsilon

    def notes(self, norms: list[float], replies: int) -> dict[str, Any]:
        """The round's privacy line of metrics.jsonl."""
        return {"epsilon": self.epsilon, "delta": self.settings.delta,
                "noise_std": noise_std(self.settings.noise_multiplier, self.settings.clip_norm, replies)
                if replies else 0.0,
                "clip_norm": self.settings.clip_norm, "clipped": sum(n > self.settings.clip_norm for n in norms),
                "update_norm_median": float(np.median(norms)) if norms else 0.0}

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` entry."""
        return {"dp": self.settings.dp, "epsilon": self.epsilon, "delta": self.settings.delta,
                "noise_multiplier": self.settings.noise_multiplier, "clip_norm": self.settings.clip_norm,
                "rounds_accounted": len(self.ledger),
                "max_epsilon": self.settings.max_epsilon}

    def state(self) -> dict[str, Any]:
        """What a resume needs (the server's checkpoint only: the noise key is secret)."""
        return {"noise_key": self.noise_key, "ledger": list(self.ledger), "epsilon": self.epsilon}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.noise_key = int(state["noise_key"])
        self.ledger = [int(k) for k in state["ledger"]]
        self.epsilon = float(state["epsilon"])
