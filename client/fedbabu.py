"""FedBABU client (Oh, Kim and Yun, ICLR 2022): body update with a fixed head, then the
fine-tuning personalisation protocol at evaluation.

Training: theta_cls is fixed at the server's theta_cls^0 and kept out of the optimiser
(``requires_grad=False`` and not passed to SGD, so neither weight decay nor momentum can
move it); theta_ext is trained for ``train.local_epochs`` epochs and is the only thing
uploaded. The head arrives with the first payload and is kept in the client's private
state (``head/<key>``); later payloads carry only the body plus the head's SHA-256 in the
config, which the stored copy must match.

Evaluation (as FedAvg+FT, :func:`client.trainer.finetune_and_evaluate`): the global model
(body + fixed head) is tested as is (``global_accuracy``, the paper's *initial accuracy*),
then fine-tuned on the client's train split (``finetune.part``: full = the paper's choice,
head or body) and tested again (``ft_accuracy`` = ``accuracy``, the *personalised
accuracy*); with ``finetune.curve`` the final evaluation also records accuracy after each
of ``finetune.curve_epochs`` fine-tuning epochs (Table 5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from client.trainer import ClientRound, ClientTrainer, FitResult, prefixed, unprefixed
from learning.models import parameter_groups
from learning.params import NDArrays, get_arrays
from learning.training import ExtraLoss, proximal_term, train_epochs
from strategies.fedbabu_math import HEAD_DIGEST_KEY, HEAD_STORED_METRIC, head_digest, split_head

HEAD_PREFIX = "head/"


class HeadMissingError(RuntimeError):
    """The payload has no head and the client has no (matching) stored head."""


class FedBABUTrainer(ClientTrainer):
    """FedBABU client: train the body only, upload the body only, fine-tune at evaluation."""

    name: ClassVar[str] = "fedbabu"
    finetunes: ClassVar[bool] = True

    def head_keys(self, model: nn.Module) -> list[str]:
        return parameter_groups(model)["head"]

    def is_uploaded(self, model: nn.Module) -> Callable[[str], bool]:
        head = set(self.head_keys(model))
        return lambda k: k not in head

    def trainable(self, model: nn.Module) -> Callable[[str], bool] | None:
        head = set(self.head_keys(model))
        return lambda n: n not in head

    def with_head(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> NDArrays:
        """The payload completed with the head: the payload's own if it carries one, else the
        stored copy, which must match the server's digest when the server sent one."""
        model = self.new_model(rnd)
        keys = self.head_keys(model)
        _, sent = split_head(payload, keys)
        if sent:
            if set(sent) != set(keys):
                raise HeadMissingError(f"payload carries head keys {sorted(sent)}, expected {keys}")
            return dict(payload)
        stored = unprefixed(state, HEAD_PREFIX)
        if set(stored) != set(keys):
            raise HeadMissingError(
                f"client {rnd.client_id}: the server sent no head and this client has no stored "
                "head (its private state was lost or belongs to another run); the server will "
                "resend the head next round"
            )
        expected = rnd.config.get(HEAD_DIGEST_KEY)
        if expected and head_digest(stored) != str(expected):
            raise HeadMissingError(
                f"client {rnd.client_id}: the stored head does not match the server's head "
                "(state from another run?); the server will resend the head next round"
            )
        return {**payload, **stored}

    def fit(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> FitResult:
        full = self.with_head(rnd, payload, state)
        model = self.load_model(rnd, full, state).to(rnd.device)
        _, head = split_head(full, self.head_keys(model))
        head = {k: np.array(v, copy=True) for k, v in head.items()}
        metrics = train_epochs(
            model, rnd.data.train, self.optim(rnd), rnd.device, seed=rnd.seed,
            trainable=self.trainable(model), extra_loss=self.extra_loss(model, full, rnd),
        )
        check_head_unchanged(model, head)  # defensive: frozen means bit-for-bit unchanged
        upload = get_arrays(model, self.is_uploaded(model))
        new_state = {**state, **self.save_state(model), **prefixed(head, HEAD_PREFIX)}
        metrics[HEAD_STORED_METRIC] = 1.0
        return FitResult(upload, metrics, new_state, rnd.data.num_train)

    def evaluate(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> dict[str, float]:
        return super().evaluate(rnd, self.with_head(rnd, payload, state), state)


class FedProxBABUTrainer(FedBABUTrainer):
    """FedProx+BABU (FedBABU paper, Sec. 5.2.4 / Table 6): FedBABU's client (head fixed, body
    trained, uploaded and averaged, fine-tuned at evaluation) with FedProx's proximal term
    mu/2 ||theta_ext - theta_ext^t||^2 on the body (the head is frozen, so it adds nothing)."""

    name: ClassVar[str] = "fedprox"

    def extra_loss(self, model: nn.Module, payload: NDArrays, rnd: ClientRound) -> ExtraLoss | None:
        mu = float(self.cfg.strategy.mu)
        if mu <= 0:
            return None
        head = set(self.head_keys(model))
        params = dict(model.named_parameters())
        ref = {k: torch.as_tensor(v) for k, v in payload.items() if k in params and k not in head}
        return proximal_term(ref, mu)


def check_head_unchanged(model: nn.Module, head: NDArrays) -> None:
    """Raise if the model's head differs (bitwise) from ``head``."""
    now = get_arrays(model, list(head))
    changed = [k for k in head if not np.array_equal(now[k], head[k])]
    if changed:
        raise RuntimeError(f"FedBABU: head tensors {changed} changed during local training")
