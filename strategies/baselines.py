"""The baselines' server rules: FedAvg's mean, or nothing (Local).

FedAvg, FedAvg+FT, FedProx, FedProx+FT, FedBN and Ditto share one server rule, FedAvg over
what the clients upload (their YAML rows name :class:`FedAvg`); what differs lives on the
client (``client/baselines.py``): FedBN's clients keep BN local (so they upload no BN tensor),
FedProx's and Ditto's clients add proximal terms, the +FT clients fine-tune at evaluation.
"""

from __future__ import annotations

from logging import INFO
from typing import ClassVar

from flwr.common.logger import log

from strategies.base import ClientUpdate, PersonalizedStrategy, RoundNotes, TrainRound


class FedAvg(PersonalizedStrategy):
    """FedAvg (McMahan et al., AISTATS 2017): w <- sum_k n_k w_k / sum_k n_k, over the
    tensors the clients upload (the base class' rule, :meth:`PersonalizedStrategy.mean_of`).

    The server of FedAvg+FT, FedProx (Li et al., MLSys 2020), FedProx+FT, FedBN (Li et al.,
    ICLR 2021: the non-BN tensors) and Ditto (Li et al., ICML 2021: the global model's
    updates) too; :attr:`name` is the configured method's."""


class Local(PersonalizedStrategy):
    """Local training: no aggregation. The server only coordinates rounds and evaluation."""

    mean_rule: ClassVar[bool] = False   # nothing is uploaded or averaged

    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> RoundNotes:
        log(INFO, "aggregate: local training, nothing to aggregate (%d clients)", len(updates))
        return None
