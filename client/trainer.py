"""Client trainers: what a client does with a round's payload, written once.

:class:`ClientTrainer` is the FedAvg client. A method subclasses it and overrides only
what differs (which keys stay private, which are uploaded, an extra loss term, how the
personalised model is formed). Trainers are plain Python (no Flower import): the ClientApp
in ``client/app.py`` is the thin glue that turns messages into these calls.

Private state is a flat dict of numpy arrays with prefixed names (``model/<key>`` for a
client's own copy of model tensors); the ClientApp persists it with ClientStateStore.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from learning.data import ClientSplit
from learning.models import build_model, parameter_groups
from learning.params import NDArrays, get_arrays, set_arrays
from learning.training import ExtraLoss, OptimConfig, evaluate, train_epochs

MODEL_PREFIX = "model/"


@dataclass
class ClientRound:
    """Everything a trainer needs for one call."""

    cfg: DictConfig
    client_id: str
    data: ClientSplit
    num_classes: int
    input_shape: tuple[int, int, int]
    device: torch.device
    server_round: int
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        """A seed unique to (run seed, client, round): reproducible local shuffling."""
        digest = hashlib.sha256(f"{self.cfg.seed}/{self.client_id}/{self.server_round}".encode())
        return int.from_bytes(digest.digest()[:4], "little")


@dataclass
class FitResult:
    upload: NDArrays
    metrics: dict[str, float]
    state: NDArrays
    num_examples: int
    extra: dict[str, NDArrays] = field(default_factory=dict)


def prefixed(arrays: Mapping[str, np.ndarray], prefix: str) -> NDArrays:
    return {prefix + k: v for k, v in arrays.items()}


def unprefixed(state: Mapping[str, np.ndarray], prefix: str) -> NDArrays:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


class ClientTrainer:
    """FedAvg client: load the global model, train it locally, upload all of it."""

    name: ClassVar[str] = "fedavg"
    finetunes: ClassVar[bool] = False      # personalised accuracy = after fine-tuning
    has_global_model: ClassVar[bool] = True

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    # ---------------------------------------------------------------- model pieces
    def new_model(self, rnd: ClientRound) -> nn.Module:
        torch.manual_seed(int(self.cfg.seed))
        return build_model(self.cfg.model, rnd.input_shape, rnd.num_classes)

    def private_keys(self, model: nn.Module) -> list[str]:
        """State-dict keys the client keeps to itself (never overwritten by the server)."""
        return []

    def is_uploaded(self, model: nn.Module) -> Callable[[str], bool]:
        private = set(self.private_keys(model))
        return lambda k: k not in private

    def trainable(self, model: nn.Module) -> Callable[[str], bool] | None:
        return None

    def extra_loss(self, model: nn.Module, payload: NDArrays, rnd: ClientRound) -> ExtraLoss | None:
        return None

    def optim(self, rnd: ClientRound) -> OptimConfig:
        train = self.cfg.train
        schedule = str(train.get("lr_schedule", "exp"))
        if schedule not in ("exp", "step"):
            raise ValueError(f"train.lr_schedule must be exp (lr * lr_decay^(round-1)) or step, "
                             f"got {schedule!r}")
        if schedule == "step":
            scale = step_lr_scale(rnd.server_round, int(self.cfg.rounds),
                                  list(train.get("lr_milestones", [0.5, 0.75])),
                                  float(train.get("lr_gamma", 0.1)))
        else:
            scale = float(train.lr_decay) ** max(0, rnd.server_round - 1)
        return OptimConfig.from_cfg(train, lr_scale=scale)

    def load_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """The model this client trains: the payload, overlaid with its private keys."""
        model = self.new_model(rnd)
        set_arrays(model, payload)
        own = unprefixed(state, MODEL_PREFIX)
        keep = {k: v for k, v in own.items() if k in set(self.private_keys(model))}
        set_arrays(model, keep)
        return model

    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """The model evaluated as this client's personalised model."""
        return self.load_model(rnd, payload, state)

    def global_model(self, rnd: ClientRound, payload: NDArrays) -> nn.Module | None:
        if not self.has_global_model:
            return None
        model = self.new_model(rnd)
        set_arrays(model, payload)
        return model

    def save_state(self, model: nn.Module) -> NDArrays:
        return prefixed(get_arrays(model, self.private_keys(model)), MODEL_PREFIX)

    # ---------------------------------------------------------------- round calls
    def fit(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> FitResult:
        model = self.load_model(rnd, payload, state).to(rnd.device)
        metrics = train_epochs(
            model, rnd.data.train, self.optim(rnd), rnd.device, seed=rnd.seed,
            trainable=self.trainable(model), extra_loss=self.extra_loss(model, payload, rnd),
        )
        upload = get_arrays(model, self.is_uploaded(model))
        return FitResult(upload, metrics, {**state, **self.save_state(model)}, rnd.data.num_train)

    def evaluate(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> dict[str, float]:
        """Personalised accuracy (``accuracy``, ``val_accuracy``) and, where the method has
        one, the global model's (``global_*``) and the fine-tuned one's (``ft_*``)."""
        out: dict[str, float] = {}
        glob = self.global_model(rnd, payload)
        if glob is not None:
            out.update(_prefixed_eval(glob, rnd, "global_"))
        if self.finetunes:
            base = glob if glob is not None else self.personal_model(rnd, payload, state)
            out.update(finetune_and_evaluate(base, rnd, final=bool(rnd.config.get("final", False))))
            out["accuracy"], out["val_accuracy"] = out["ft_accuracy"], out["ft_val_accuracy"]
            out["loss"] = out["ft_loss"]
        else:
            out.update(_prefixed_eval(self.personal_model(rnd, payload, state), rnd, ""))
        return out


def step_lr_scale(server_round: int, total_rounds: int, milestones: list[float], gamma: float) -> float:
    """Step decay (``train.lr_schedule: step``; FedBABU's schedule): the lr is multiplied by
    ``gamma`` once for every milestone m (a fraction of ``total_rounds``) that round
    ``server_round`` (1-based) is past, i.e. rounds r > floor(m * total_rounds) are decayed.
    With milestones [0.5, 0.75] and R rounds this is the authors' rule "lr *= 0.1 after
    rounds R//2 and 3R//4" (a milestone at round 0 never fires; equal ones fire once)."""
    bad = [m for m in milestones if not 0 < float(m) < 1]
    if bad:
        raise ValueError(f"train.lr_milestones must be fractions of the rounds in (0, 1), got {bad}")
    steps = {int(float(m) * total_rounds) for m in milestones}  # coinciding milestones decay once
    return float(gamma) ** sum(1 for s in steps if server_round > s >= 1)


def _prefixed_eval(model: nn.Module, rnd: ClientRound, prefix: str) -> dict[str, float]:
    test = evaluate(model, rnd.data.test, rnd.device)
    val = evaluate(model, rnd.data.val, rnd.device)
    return {f"{prefix}accuracy": test["accuracy"], f"{prefix}loss": test["loss"],
            f"{prefix}val_accuracy": val["accuracy"], f"{prefix}val_loss": val["loss"]}


def finetune_trainable(model: nn.Module, part: str) -> Callable[[str], bool]:
    head = set(parameter_groups(model)["head"])
    if part == "head":
        return lambda n: n in head
    if part == "body":
        return lambda n: n not in head
    return lambda n: True


def finetune_and_evaluate(model: nn.Module, rnd: ClientRound, final: bool = False) -> dict[str, float]:
    """The fine-tuning personalisation protocol (FedBABU, FedAvg+FT).

    Fine-tune a copy of ``model`` (whole model, or head/body only) for ``finetune.epochs``
    epochs on the client's train split with its own optimiser settings, then test. With
    ``final`` and ``finetune.curve``, also record test accuracy after each epoch count in
    ``finetune.curve_epochs`` (FedBABU's Table 5) as ``ft_acc_e<E>``.
    """
    ft = rnd.cfg.finetune
    model = copy.deepcopy(model).to(rnd.device)
    opt = OptimConfig(lr=float(ft.lr), momentum=float(ft.momentum), weight_decay=float(ft.weight_decay),
                      epochs=1, batch_size=int(ft.batch_size), clip=float(rnd.cfg.train.clip))
    trainable = finetune_trainable(model, str(ft.part))
    curve = sorted({int(e) for e in ft.curve_epochs}) if (final and bool(ft.curve)) else []
    target = int(ft.epochs)
    out: dict[str, float] = {}
    optimizer = None
    params = [p for n, p in model.named_parameters() if trainable(n)]
    if params:
        optimizer = torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    last = max([target, *curve])
    for epoch in range(0, last + 1):
        if epoch in curve:
            out[f"ft_acc_e{epoch}"] = evaluate(model, rnd.data.test, rnd.device)["accuracy"]
        if epoch == target:
            out.update(_prefixed_eval(model, rnd, "ft_"))
        if epoch == last:
            break
        if optimizer is None:  # nothing to fine-tune: every epoch count gives the same model
            continue
        train_epochs(model, rnd.data.train, opt, rnd.device, seed=rnd.seed + epoch,
                     trainable=trainable, optimizer=optimizer)
    return out
