"""FedBABU client (Oh, Kim and Yun, ICLR 2022): body update with a fixed head, then the
fine-tuning personalisation protocol at evaluation.

Training: theta_cls is fixed at the server's theta_cls^0 and kept out of the optimiser
(``requires_grad=False`` and not passed to SGD, so neither weight decay nor momentum can
move it); theta_ext is trained for ``train.local_epochs`` epochs and is the only thing
uploaded. The head arrives with the first payload and is kept in the client's private
state (``head/<key>``); later payloads carry only the body plus the head's SHA-256 in the
config, which the stored copy must match.

Evaluation (as FedAvg+FT, :func:`client.finetune.finetune_and_evaluate`): the global model
(body + fixed head) is tested as is (``global_accuracy``, the paper's *initial accuracy*),
then fine-tuned on the client's train split (``finetune.part``: full = the paper's choice,
head or body) and tested again (``ft_accuracy`` = ``accuracy``, the *personalised
accuracy*); with ``finetune.curve`` the final evaluation also records accuracy after each
of ``finetune.curve_epochs`` fine-tuning epochs (Table 5).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from torch import nn

from client.baselines import proximal_to
from client.round import ClientRound
from client.trainer import ClientTrainer, LocalRound, prefixed, unprefixed
from common.options import FedProxOptions
from common.roles import FROZEN, keys_with
from learning.params import NDArrays, get_arrays
from learning.training import LossTerm
from strategies.fedbabu_math import HEAD_DIGEST_KEY, HEAD_STORED_METRIC, head_digest, split_head

HEAD_PREFIX = "head/"


class HeadMissingError(RuntimeError):
    """The payload has no head and the client has no (matching) stored head."""


class FedBABUTrainer(ClientTrainer):
    """FedBABU client: the head's role is *frozen* (``common/roles.py``), so the base steps
    already keep it out of the optimiser and the upload; this class adds where the head
    comes from (payload or stored copy) and the check that it never changed."""

    name: ClassVar[str] = "fedbabu"
    finetunes: ClassVar[bool] = True

    def head_keys(self, model: nn.Module) -> list[str]:
        return keys_with(self.roles(model), FROZEN)

    def receive(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> NDArrays:
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
        expected = rnd.message_config.get(HEAD_DIGEST_KEY)
        if expected and head_digest(stored) != str(expected):
            raise HeadMissingError(
                f"client {rnd.client_id}: the stored head does not match the server's head "
                "(state from another run?); the server will resend the head next round"
            )
        return {**payload, **stored}

    def head(self, work: LocalRound) -> NDArrays:
        _, head = split_head(work.payload, self.head_keys(work.model))
        return {k: np.array(v, copy=True) for k, v in head.items()}

    def train(self, work: LocalRound) -> dict[str, float]:
        head = self.head(work)
        metrics = super().train(work)
        check_head_unchanged(work.model, head)  # defensive: frozen means bit-for-bit unchanged
        metrics[HEAD_STORED_METRIC] = 1.0
        return metrics

    def private_state(self, work: LocalRound) -> NDArrays:
        return {**super().private_state(work), **prefixed(self.head(work), HEAD_PREFIX)}


class FedProxBABUTrainer(FedBABUTrainer):
    """FedProx+BABU (FedBABU paper, Sec. 5.2.4 / Table 6): FedBABU's client (head fixed, body
    trained, uploaded and averaged, fine-tuned at evaluation) with FedProx's proximal term
    mu/2 ||theta_ext - theta_ext^t||^2 on the body (the head is frozen, so it adds nothing)."""

    name: ClassVar[str] = "fedprox"
    options: FedProxOptions

    def loss_terms(self, work: LocalRound) -> list[LossTerm]:
        if self.options.mu <= 0:
            return []
        return [proximal_to(work.model, work.payload, self.options.mu,
                            exclude=frozenset(self.head_keys(work.model)))]


def check_head_unchanged(model: nn.Module, head: NDArrays) -> None:
    """Raise if the model's head differs (bitwise) from ``head``."""
    now = get_arrays(model, list(head))
    changed = [k for k in head if not np.array_equal(now[k], head[k])]
    if changed:
        raise RuntimeError(f"FedBABU: head tensors {changed} changed during local training")
