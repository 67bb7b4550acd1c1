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

from common.privacy import epsilon_of_schedule
from common.settings import PrivacySettings
from learning.params import NDArrays
from strategies.privacy_math import add_noise, clip_update, noise_std


class PrivacyBudgetSpent(RuntimeError):
    """Releasing the round would spend more than ``privacy.max_epsilon`` (a resume counts
    the round it redoes again): the run stops before the round's model leaves the server."""


class CentralDP:
    """DP-FedAvg's server side (``privacy.dp=central``) for one run.

    Parameters
    ----------
    settings : the ``privacy`` group.
    population : the run's clients (N).
    shared_keys : the tensors the method averages (its shared role), in state-dict order.
    """

    def __init__(self, settings: PrivacySettings, population: int, shared_keys: Iterable[str]) -> None:
        self.settings = settings
        self.population = population
        self.shared_keys = list(shared_keys)
        self.noise_key = self._new_key()
        self.schedule: list[float] = []   # the noise multiplier of each round released (or maybe released)
        self.epsilon = 0.0

    @property
    def releases(self) -> int:
        """Rounds whose noisy model was (or may have been) released."""
        return len(self.schedule)

    def _new_key(self) -> int:
        """The noise's key: the OS's randomness (secret, kept in the server's checkpoint only),
        or ``privacy.noise_seed`` when the configuration fixes it (reproducible, not secret)."""
        seed = self.settings.noise_seed
        return seed if seed is not None else secrets.randbits(63)

    def clip(self, arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> tuple[NDArrays, float]:
        """One upload with its shared update (from ``reference``, what it was sent) clipped to
        ``clip_norm``; and the norm before. A shared tensor missing from ``reference`` is an error."""
        keys = [k for k in self.shared_keys if k in arrays]
        missing = [k for k in keys if k not in reference]
        if missing:
            raise ValueError(f"central DP: no reference for the shared tensors {missing[:3]}; cannot clip")
        return clip_update(arrays, reference, keys, self.settings.clip_norm)

    def check_budget(self, multiplier: float | None = None) -> None:
        """Raise :class:`PrivacyBudgetSpent` when one more release (of noise ``multiplier``,
        default ``privacy.noise_multiplier``) would pass ``max_epsilon``."""
        budget = self.settings.max_epsilon
        if budget is not None:
            z = self.settings.noise_multiplier if multiplier is None else multiplier
            after = epsilon_of_schedule(self.settings, self.population, [*self.schedule, z])
            if after > budget:
                raise PrivacyBudgetSpent(
                    f"privacy.max_epsilon={budget:g} is spent: {self.releases} rounds released (epsilon "
                    f"{self.epsilon:.3g}); one more would reach {after:.3g}. The run stops here, its last "
                    "released model is the last checkpoint's")

    def add_noise(self, global_arrays: Mapping[str, np.ndarray], replies: int, server_round: int) -> NDArrays:
        """The new global arrays with the noise of the mean of ``replies`` clipped updates
        (drawn from the run's noise key and the round)."""
        std = noise_std(self.settings.noise_multiplier, self.settings.clip_norm, replies)
        rng = np.random.default_rng([self.noise_key, server_round])
        keys = [k for k in self.shared_keys if k in global_arrays]
        return add_noise(global_arrays, keys, std, rng)

    def account(self, multiplier: float | None = None) -> float:
        """Compose one released round (of noise ``multiplier``, default ``privacy.noise_multiplier``);
        returns epsilon at ``privacy.delta``."""
        self.schedule.append(self.settings.noise_multiplier if multiplier is None else multiplier)
        self.epsilon = epsilon_of_schedule(self.settings, self.population, self.schedule)
        return self.epsilon

    def notes(self, norms: list[float] | None, replies: int, multiplier: float | None = None) -> dict[str, Any]:
        """The round's privacy line of metrics.jsonl. ``clipped`` and ``update_norm_median``
        come from the unclipped updates: server-side diagnostics for choosing ``clip_norm``,
        not covered by the guarantee (docs/privacy.md); None under secure aggregation (the
        clients clip, and the server never sees a norm)."""
        if norms is None:
            z = self.settings.noise_multiplier if multiplier is None else multiplier
            return {"epsilon": self.epsilon, "delta": self.settings.delta, "clip_norm": self.settings.clip_norm,
                    "noise_multiplier": z, "noise_std": noise_std(z, self.settings.clip_norm, replies) if replies else 0.0,
                    "clipped": None, "update_norm_median": None, "clipped_by": "clients",
                    "noise_added_by": "clients" if self.settings.distributed else "server"}
        return {"epsilon": self.epsilon, "delta": self.settings.delta,
                "noise_std": noise_std(self.settings.noise_multiplier, self.settings.clip_norm, replies)
                if replies else 0.0,
                "clip_norm": self.settings.clip_norm, "clipped": sum(n > self.settings.clip_norm for n in norms),
                "update_norm_median": float(np.median(norms)) if norms else 0.0}

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` entry."""
        return {"dp": self.settings.dp, "epsilon": self.epsilon, "delta": self.settings.delta,
                "noise_multiplier": self.settings.noise_multiplier, "clip_norm": self.settings.clip_norm,
                "rounds_accounted": self.releases, "max_epsilon": self.settings.max_epsilon}

    def state(self) -> dict[str, Any]:
        """What a resume needs (the server's checkpoint only: the noise key is secret)."""
        return {"noise_key": self.noise_key, "releases": self.releases, "epsilon": self.epsilon,
                "schedule": list(self.schedule)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Resume from a checkpoint. With a secret key, the round after the checkpoint may have
        been released before the run stopped (its evaluation goes out before its checkpoint):
        it is counted again, and the redone round draws fresh noise under a new key, so that
        two releases of one round never share their noise. With ``privacy.noise_seed`` (not
        secret) the run resumes bit for bit instead."""
        self.noise_key = int(state["noise_key"])
        self.schedule = [float(z) for z in state.get("schedule", [self.settings.noise_multiplier] * int(state["releases"]))]
        self.epsilon = float(state["epsilon"])
        if self.settings.noise_seed is None:
            self.noise_key = self._new_key()
            self.schedule.append(self.settings.noise_multiplier)    # the redone round, at the full noise
            self.epsilon = epsilon_of_schedule(self.settings, self.population, self.schedule)
