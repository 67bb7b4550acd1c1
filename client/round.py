"""One client call's inputs, and the evaluation of a model on a client's splits: what the
trainers (``client/trainer.py``) and the fine-tuning protocols (``client/finetune.py``) share."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from common.settings import Settings
from learning.datasets.federated import ClientSplit
from learning.training import evaluate


@dataclass
class ClientRound:
    """Everything a trainer needs for one call."""

    settings: Settings       # the run's, typed (composition reads them once)
    client_id: str
    data: ClientSplit
    num_classes: int
    input_shape: tuple[int, int, int]
    device: torch.device
    server_round: int
    message_config: Mapping[str, Any] = field(default_factory=dict)   # the server's config record for this call

    @property
    def seed(self) -> int:
        """A seed unique to (run seed, client, round): reproducible local shuffling."""
        digest = hashlib.sha256(f"{self.settings.run.seed}/{self.client_id}/{self.server_round}".encode())
        return int.from_bytes(digest.digest()[:4], "little")


def evaluate_splits(model: nn.Module, rnd: ClientRound, prefix: str) -> dict[str, float]:
    """Test and validation accuracy and loss of ``model`` on this client's splits, their keys
    with ``prefix`` (``global_``, ``ft_``)."""
    weights = rnd.data.class_weights
    test = evaluate(model, rnd.data.test, rnd.device, class_weights=weights)
    val = evaluate(model, rnd.data.val, rnd.device, class_weights=weights)
    return {f"{prefix}accuracy": test["accuracy"], f"{prefix}loss": test["loss"],
            f"{prefix}val_accuracy": val["accuracy"], f"{prefix}val_loss": val["loss"]}
