"""Client trainers of the baselines: Local, FedAvg+FT, FedProx, FedBN, Ditto.

(FedAvg itself is :class:`client.trainer.ClientTrainer`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from client.trainer import MODEL_PREFIX, ClientRound, ClientTrainer, FitResult, prefixed, unprefixed
from learning.models import parameter_groups
from learning.params import NDArrays, get_arrays, set_arrays
from learning.training import ExtraLoss, proximal_term, train_epochs


class LocalTrainer(ClientTrainer):
    """Local: the whole model is private; nothing is uploaded. The server's first payload
    only provides a common initialisation."""

    name: ClassVar[str] = "local"
    has_global_model: ClassVar[bool] = False

    def private_keys(self, model: nn.Module) -> list[str]:
        return list(model.state_dict().keys())

    def is_uploaded(self, model: nn.Module) -> Callable[[str], bool]:
        return lambda k: False


class FedAvgFTTrainer(ClientTrainer):
    """FedAvg + fine-tuning: FedAvg training, personalised accuracy after fine-tuning."""

    name: ClassVar[str] = "fedavg-ft"
    finetunes: ClassVar[bool] = True


class FedProxTrainer(ClientTrainer):
    """FedProx: local loss + mu/2 ||w - w_global||^2 (Li et al., MLSys 2020).

    The BABU variant (``strategy.body_only=true``) is ``client.fedbabu.FedProxBABUTrainer``.
    """

    name: ClassVar[str] = "fedprox"

    def extra_loss(self, model: nn.Module, payload: NDArrays, rnd: ClientRound) -> ExtraLoss | None:
        mu = float(self.cfg.strategy.mu)
        if mu <= 0:
            return None
        ref = {k: torch.as_tensor(v) for k, v in payload.items() if k in dict(model.named_parameters())}
        return proximal_term(ref, mu)


class FedBNTrainer(ClientTrainer):
    """FedBN: BN weights, biases and running statistics stay local (Li et al., ICLR 2021).
    There is no single global model, so only personalised accuracy is reported."""

    name: ClassVar[str] = "fedbn"
    has_global_model: ClassVar[bool] = False

    def private_keys(self, model: nn.Module) -> list[str]:
        return parameter_groups(model)["bn"]


class DittoTrainer(ClientTrainer):
    """Ditto (Li et al., ICML 2021).

    Each round: (1) train the received global model w as in FedAvg and upload it;
    (2) train the private personal model v on loss + lam/2 ||v - w^t||^2, where w^t is the
    global model received this round. Personalised accuracy is v's.
    """

    name: ClassVar[str] = "ditto"
    PERSONAL = "personal/"

    def _personal(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        model = self.new_model(rnd)
        own = unprefixed(state, self.PERSONAL)
        set_arrays(model, own if own else payload)
        return model

    def fit(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> FitResult:
        result = super().fit(rnd, payload, state)
        personal = self._personal(rnd, payload, state).to(rnd.device)
        opt = self.optim(rnd)
        opt.epochs = int(self.cfg.strategy.get("personal_epochs", opt.epochs))
        ref = {k: torch.as_tensor(v) for k, v in payload.items() if k in dict(personal.named_parameters())}
        metrics = train_epochs(personal, rnd.data.train, opt, rnd.device, seed=rnd.seed + 1,
                               extra_loss=proximal_term(ref, float(self.cfg.strategy.lam)))
        result.state.update(prefixed(get_arrays(personal), self.PERSONAL))
        result.metrics.update({f"personal_{k}": v for k, v in metrics.items()})
        return result

    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        return self._personal(rnd, payload, state)


__all__ = ["LocalTrainer", "FedAvgFTTrainer", "FedProxTrainer", "FedBNTrainer", "DittoTrainer",
           "MODEL_PREFIX"]
