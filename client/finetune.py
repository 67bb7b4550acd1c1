"""Fine-tuning a model on one client: the +FT methods' evaluation (FedBABU, FedAvg+FT: the
global model fine-tuned on the client's train split, then tested) and a new client's
personalisation curve (``pflower personalize``, FedBasis' protocol)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping

from torch import nn

from client.round import ClientRound, evaluate_splits
from learning.models import parameter_groups
from learning.training import OptimConfig, evaluate, make_optimizer, train_epochs


def personalize_curve(model: nn.Module, rnd: ClientRound, trainable: Callable[[str], bool],
                      opt: OptimConfig, epochs: int,
                      lr_scales: Mapping[str, float] | None = None) -> list[dict[str, float]]:
    """A new client's personalisation: train the ``trainable`` parameters of ``model`` for
    ``epochs`` epochs on its train split (one optimiser throughout; ``lr_scales`` gives some
    parameters ``opt.lr`` times their scale) and evaluate the validation and test splits
    before training (epoch 0) and after every epoch."""
    model = model.to(rnd.device)
    own = {name: opt.lr * float(scale) for name, scale in (lr_scales or {}).items()}
    params = [p for n, p in model.named_parameters() if trainable(n) and n not in own]
    special = [(n, p) for n, p in model.named_parameters() if trainable(n) and n in own]
    if not params and not special:
        raise ValueError("personalisation has no parameter to learn")
    optimizer = make_optimizer(params, opt)
    for n, p in special:
        optimizer.add_param_group({"params": [p], "lr": float(own[n])})
    curve = [{"epoch": 0.0, **evaluate_splits(model, rnd, "")}]
    one = dataclasses.replace(opt, epochs=1)
    for epoch in range(1, epochs + 1):
        train_epochs(model, rnd.data.train, one, rnd.device, seed=rnd.seed + epoch,
                     trainable=trainable, optimizer=optimizer)
        curve.append({"epoch": float(epoch), **evaluate_splits(model, rnd, "")})
    return curve


def last_and_best(curve: list[dict[str, float]]) -> dict[str, float]:
    """Test accuracy after the last epoch, and at the epoch with the best validation
    accuracy (the earliest on ties; epochs >= 1), as FedBasis' Table 2 reports them."""
    trained = [c for c in curve if c["epoch"] >= 1] or curve
    best = max(trained, key=lambda c: (c["val_accuracy"], -c["epoch"]))
    return {"last_accuracy": trained[-1]["accuracy"], "best_accuracy": best["accuracy"],
            "best_epoch": best["epoch"], "best_val_accuracy": best["val_accuracy"],
            "start_accuracy": curve[0]["accuracy"]}


def finetune_trainable(model: nn.Module, part: str) -> Callable[[str], bool]:
    head = set(parameter_groups(model)["head"])
    if part == "head":
        return lambda n: n in head
    if part == "body":
        return lambda n: n not in head
    return lambda n: True


FINETUNED = "finetuned"   # eval metric: 1 when this evaluation fine-tuned (FT methods)


def finetunes_this_round(rnd: ClientRound) -> bool:
    """Fine-tuning is the costly part of an evaluation (5 epochs per client): do it at the
    final evaluation, and every ``finetune.every`` rounds when asked."""
    every = rnd.settings.finetune.every
    return bool(rnd.message_config.get("final", False)) or (every > 0 and rnd.server_round % every == 0)


def finetune_and_evaluate(model: nn.Module, rnd: ClientRound, final: bool = False) -> dict[str, float]:
    """The fine-tuning personalisation protocol (FedBABU, FedAvg+FT).

    Fine-tune a copy of ``model`` (whole model, or head/body only) for ``finetune.epochs``
    epochs on the client's train split with its own optimiser settings, then test. With
    ``final`` and ``finetune.curve``, also record test accuracy after each epoch count in
    ``finetune.curve_epochs`` (FedBABU's Table 5) as ``ft_acc_e<E>``.
    """
    ft = rnd.settings.finetune
    model = copy.deepcopy(model).to(rnd.device)
    opt = ft.optim(rnd.settings.train)
    trainable = finetune_trainable(model, ft.part)
    curve = sorted(set(ft.curve_epochs)) if (final and ft.curve) else []
    target = ft.epochs
    out: dict[str, float] = {}
    params = [p for n, p in model.named_parameters() if trainable(n)]
    optimizer = make_optimizer(params, opt) if params else None
    last = max([target, *curve])
    for epoch in range(0, last + 1):
        if epoch in curve:
            out[f"ft_acc_e{epoch}"] = evaluate(model, rnd.data.test, rnd.device,
                                               class_weights=rnd.data.class_weights)["accuracy"]
        if epoch == target:
            out.update(evaluate_splits(model, rnd, "ft_"))
        if epoch == last:
            break
        if optimizer is None:  # nothing to fine-tune: every epoch count gives the same model
            continue
        train_epochs(model, rnd.data.train, opt, rnd.device, seed=rnd.seed + epoch,
                     trainable=trainable, optimizer=optimizer)
    return out
