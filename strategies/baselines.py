"""Baseline strategies: Local, FedAvg(+FT), FedProx(+FT), FedBN, Ditto.

Their server rules are all FedAvg over what the clients upload (or nothing, for Local);
what differs lives on the client (``client/baselines.py``): FedBN's clients keep BN local,
FedProx's and Ditto's clients add proximal terms, FedAvg+FT's clients fine-tune.
"""

from __future__ import annotations

from logging import INFO
from typing import ClassVar

from flwr.common.logger import log

from strategies.base import ClientUpdate, PersonalizedStrategy, TrainRound


class FedAvg(PersonalizedStrategy):
    """FedAvg (McMahan et al., AISTATS 2017): w <- sum_k n_k w_k / sum_k n_k."""

    name: ClassVar[str] = "fedavg"


class FedAvgFT(PersonalizedStrategy):
    """FedAvg + fine-tuning: FedAvg's server rule; clients fine-tune at evaluation."""

    name: ClassVar[str] = "fedavg-ft"


class FedProx(PersonalizedStrategy):
    """FedProx (Li et al., MLSys 2020): FedAvg's server rule; clients minimise
    F_k(w) + mu/2 ||w - w^t||^2. With ``body_only`` clients upload only the body."""

    name: ClassVar[str] = "fedprox"


class FedProxFT(PersonalizedStrategy):
    """FedProx + fine-tuning: FedProx's training (FedAvg's server rule, proximal clients);
    clients fine-tune the global model at evaluation, as FedAvg+FT."""

    name: ClassVar[str] = "fedprox-ft"


class FedBN(PersonalizedStrategy):
    """FedBN (Li et al., ICLR 2021): FedAvg over the non-BN tensors the clients upload;
    BN parameters and statistics never leave the clients."""

    name: ClassVar[str] = "fedbn"


class Ditto(PersonalizedStrategy):
    """Ditto (Li et al., ICML 2021): FedAvg over the clients' global-model updates; each
    client's personal model (proximal to the global one) stays on the client."""

    name: ClassVar[str] = "ditto"


class Local(PersonalizedStrategy):
    """Local training: no aggregation. The server only coordinates rounds and evaluation."""

    name: ClassVar[str] = "local"
    mean_rule: ClassVar[bool] = False   # nothing is uploaded or averaged

    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> None:
        log(INFO, "aggregate: local training, nothing to aggregate (%d clients)", len(updates))
