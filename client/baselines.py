"""Client trainers of the baselines: Local, FedAvg+FT, FedProx(+FT), FedBN, Ditto.

(FedAvg itself is :class:`client.trainer.ClientTrainer`.) Local and FedBN differ from
FedAvg only by their parameter roles (``common/methods.py``: every key local / BN keys
local), which the base steps already honour; what is left here is the rest of each
method's difference.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from client.round import ClientRound
from client.trainer import ClientTrainer, LocalRound, prefixed
from common.options import DittoOptions, FedProxOptions
from learning.params import NDArrays, get_arrays
from learning.training import LossTerm, LossTerms, proximal_term, train_epochs


def proximal_to(model: nn.Module, reference: NDArrays, mu: float,
                exclude: frozenset[str] = frozenset()) -> LossTerm:
    """mu/2 ||w - w_ref||^2 over the model's parameters found in ``reference`` (FedProx's
    term, Ditto's personal term), reported as the metric ``proximal``."""
    params = dict(model.named_parameters())
    ref = {k: torch.as_tensor(v) for k, v in reference.items() if k in params and k not in exclude}
    return LossTerm("proximal", proximal_term(ref, mu))


class LocalTrainer(ClientTrainer):
    """Local: every key is local (private state); nothing is uploaded. The server's first
    payload only provides a common initialisation."""

    name: ClassVar[str] = "local"
    has_global_model: ClassVar[bool] = False


class FedAvgFTTrainer(ClientTrainer):
    """FedAvg + fine-tuning: FedAvg training, personalised accuracy after fine-tuning."""

    name: ClassVar[str] = "fedavg-ft"
    finetunes: ClassVar[bool] = True


class FedProxTrainer(ClientTrainer):
    """FedProx: local loss + mu/2 ||w - w_global||^2 (Li et al., MLSys 2020).

    The BABU variant (``strategy.body_only=true``) is ``client.fedbabu.FedProxBABUTrainer``.
    """

    name: ClassVar[str] = "fedprox"
    options: FedProxOptions

    def loss_terms(self, work: LocalRound) -> list[LossTerm]:
        if self.options.mu <= 0:
            return []
        return [proximal_to(work.model, work.payload, self.options.mu)]


class FedProxFTTrainer(FedProxTrainer):
    """FedProx + fine-tuning: FedProx's local training, personalised accuracy after
    fine-tuning the global model (FedBABU's Table 6 and FEDORA's FedProx+FT baseline)."""

    name: ClassVar[str] = "fedprox-ft"
    finetunes: ClassVar[bool] = True


class FedBNTrainer(ClientTrainer):
    """FedBN: BN weights, biases and running statistics are local (Li et al., ICLR 2021).
    There is no single global model, so only personalised accuracy is reported."""

    name: ClassVar[str] = "fedbn"
    has_global_model: ClassVar[bool] = False


class DittoTrainer(ClientTrainer):
    """Ditto (Li et al., ICML 2021).

    Each round: (1) train the received global model w as in FedAvg and upload it;
    (2) train the private personal model v on loss + lam/2 ||v - w^t||^2, where w^t is the
    global model received this round. Personalised accuracy is v's.
    """

    name: ClassVar[str] = "ditto"
    options: DittoOptions
    PERSONAL = "personal/"

    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """v: the private personal model, or the global model before the first round."""
        return self.own_model(rnd, payload, state, self.PERSONAL)

    def train(self, work: LocalRound) -> dict[str, float]:
        metrics = super().train(work)                      # (1) the global model, as FedAvg
        rnd = work.rnd
        personal = self.personal_model(rnd, work.payload, work.state).to(rnd.device)
        opt = self.optim(rnd)
        if self.options.personal_epochs is not None:
            opt.epochs = self.options.personal_epochs
        terms = LossTerms([proximal_to(personal, work.payload, self.options.lam)])
        personal_metrics = train_epochs(personal, rnd.data.train, opt, rnd.device, seed=rnd.seed + 1,
                                        extra_loss=terms)
        work.scratch["personal"] = get_arrays(personal)
        metrics.update({f"personal_{k}": v for k, v in {**personal_metrics, **terms.metrics()}.items()})
        return metrics

    def private_state(self, work: LocalRound) -> NDArrays:
        return {**super().private_state(work), **prefixed(work.scratch["personal"], self.PERSONAL)}


__all__ = ["LocalTrainer", "FedAvgFTTrainer", "FedProxTrainer", "FedProxFTTrainer", "FedBNTrainer", "DittoTrainer",
           "proximal_to"]
