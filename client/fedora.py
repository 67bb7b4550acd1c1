"""FEDORA client: private personalised model with selective regularisation.

Paper: J. Wu, W. Bao, E. Ainsworth, J. He, "Personalized Federated Learning with
Parameter Propagation", KDD 2023 (authors' code: github.com/junwu6/FEDORA).

Client k keeps its own parameters ``theta_k`` as durable private state (``model/<key>``;
initialised from the server's first payload). Each round it receives ``theta_hat_k``,
the propagated parameters computed by the server (``strategies/fedora.py``), and:

1. measures the selective weight on its validation split,
   ``lambda_k = max(eps, L_val(theta_k) - L_val(theta_hat_k))`` (paper; the authors'
   code: ``0`` if the difference is negative, else ``exp(diff / 2)``), see
   :func:`strategies.fedora_math.selective_lambda`, bounded by ``strategy.lambda_max``
   (ours, default ``1 / (2 lr)``: an unbounded lambda makes the penalty step unstable);
2. trains ``theta_k`` on ``L_train(theta_k) + lambda_k ||theta_k - theta_hat_k||^2``
   (sum over all trainable parameters) for ``train.local_epochs`` epochs;
3. uploads ``theta_k`` (all tensors) and keeps it.

Once, when the server asks for it (train config ``fedora-need-basis`` lists the client),
it also uploads an orthonormal rank-p basis of its training inputs
(:func:`strategies.fedora_math.data_subspace_basis`; flattened inputs in [0, 1] as the
authors' code (``strategy.basis_inputs=normalised`` for the model's [-1, 1] inputs),
optionally with one-hot labels appended as in the code). The basis is computed once and cached
in the private state; it is the only thing derived from the data that leaves the client.

Differences from the authors' code (by design; the paper is followed): the penalty is
``lambda ||.||^2`` inside the loss and goes through the optimiser (momentum, weight
decay), whereas the code applies a separate step ``w -= lr * lam * (w - w_hat)`` after
each SGD step (the gradient of ``lam/2 ||.||^2``, outside momentum;
``strategy.penalty=decoupled``); the validation loss
is the per-sample mean (the code sums per-batch means, which is the same number when the
validation split fits in one batch, as in its 64-sample Rotated-MNIST setting); the code
also fine-tunes a copy of ``theta_hat`` each round and discards it, which is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from client.baselines import proximal_to
from client.round import ClientRound
from client.trainer import ClientTrainer, LocalRound
from learning.params import NDArrays, set_arrays
from learning.training import (
    DecoupledProximal,
    LossTerm,
    evaluate,
    has_bn_running_stats,
    make_loader,
)
from strategies.fedora_math import (
    BASIS_ARRAY,
    BASIS_RECORD,
    NEED_BASIS_KEY,
    FEDORAOptions,
    data_subspace_basis,
    selective_lambda,
)

BASIS_STATE = "fedora/basis"


class FEDORATrainer(ClientTrainer):
    """FEDORA client (see the module docstring). Every key is *personal*
    (``common/roles.py``): uploaded, kept, and held per client by the server."""

    name: ClassVar[str] = "fedora"
    has_global_model: ClassVar[bool] = False
    options: FEDORAOptions

    # ---------------------------------------------------------------- pieces
    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """theta_k: the private model, or the server's payload before the first round."""
        return self.own_model(rnd, payload, state)

    def reference_models(self, rnd: ClientRound, payload: NDArrays) -> dict[str, nn.Module]:
        """theta_hat_k, the parameters the server propagated to this client (``propagated_*``)."""
        model = self.new_model(rnd)
        set_arrays(model, payload)
        return {"propagated_": model}

    def basis(self, rnd: ClientRound, state: NDArrays) -> np.ndarray:
        """The client's data-subspace basis U (d x p), computed once and cached in state."""
        if BASIS_STATE in state:
            return np.asarray(state[BASIS_STATE])
        xs, ys = [], []
        for x, y in DataLoader(rnd.data.train, batch_size=512, shuffle=False):
            if self.options.basis_inputs == "unit" and self.cfg.dataset.input_range == "symmetric":
                x = x * 0.5 + 0.5   # undo learning.datasets.sources.normalise's (x - 0.5) / 0.5
            xs.append(x.reshape(len(x), -1).numpy())
            ys.append(y.numpy())
        if not xs:
            raise ValueError(f"client {rnd.client_id} has no training samples; FEDORA needs them "
                             "for its data-subspace basis")
        x, y = np.concatenate(xs), np.concatenate(ys)
        if self.options.basis_labels:
            return data_subspace_basis(x, self.options.basis_rank, labels=y,
                                       num_classes=rnd.num_classes)
        return data_subspace_basis(x, self.options.basis_rank)

    def selective_weight(self, rnd: ClientRound, own: nn.Module,
                         hat: nn.Module) -> tuple[float, float, float]:
        """(lambda_k, L_val(theta_k), L_val(theta_hat_k)) on the validation split."""
        if len(rnd.data.val) == 0:
            raise ValueError(f"client {rnd.client_id} has an empty validation split; FEDORA's "
                             "selective lambda needs one (set dataset.val_fraction > 0)")
        if self.options.lambda_bn == "own" and has_bn_running_stats(own):
            own, hat = self.with_own_bn_statistics(own, rnd), self.with_own_bn_statistics(hat, rnd)
        own_loss, hat_loss = self.validation_loss(rnd, own), self.validation_loss(rnd, hat)
        lam = selective_lambda(own_loss, hat_loss, self.options.eps, self.options.lambda_form)
        return min(lam, self.lambda_bound(rnd)), own_loss, hat_loss

    def validation_loss(self, rnd: ClientRound, model: nn.Module) -> float:
        """The code form: as the authors' ``get_loss`` sums it, the per-batch mean losses over
        the validation split in batches of ``train.batch_size``, in order (their ``val_loader``;
        the same as the mean when the split fits in one batch, as their 64 validation images in
        batches of 64 do). The paper form: the mean over the split's samples."""
        if self.options.lambda_form != "code":
            return evaluate(model, rnd.data.val, rnd.device)["loss"]
        model.to(rnd.device).eval()
        total = torch.zeros((), dtype=torch.float64, device=rnd.device)
        with torch.no_grad():
            for x, y in make_loader(rnd.data.val, self.settings.train.batch_size, shuffle=False, device=rnd.device):
                logits = model(x.to(rnd.device))
                total += nn.functional.cross_entropy(logits, y.to(rnd.device)).to(torch.float64)
        return float(total)

    def lambda_bound(self, rnd: ClientRound) -> float:
        """``strategy.lambda_max``: ``auto`` = the largest lambda whose pull never steps past
        theta_hat: 1 / (2 lr) of this round for ``penalty=loss`` (the gradient step of
        lambda ||theta - theta_hat||^2 is 2 lr lambda (theta - theta_hat)), 1 / lr for
        ``penalty=decoupled`` (the pull lr lambda (theta_0 - theta_hat)). Unbounded, lambda
        grows with a client's own validation loss (the code form exponentially); past the
        bound the pull overshoots theta_hat, beyond twice it (heavy-ball: (1 + momentum) /
        (2 lr)) every step moves farther away and the client diverges."""
        bound = self.options.lambda_max
        if bound is None:
            return math.inf
        if bound == "auto":
            lr = self.optim(rnd).lr
            return 1.0 / (2.0 * lr) if self.options.penalty == "loss" else 1.0 / lr
        return float(bound)

    # ---------------------------------------------------------------- round steps
    def start_model(self, work: LocalRound) -> nn.Module:
        """theta_k (the payload is theta_hat_k, the regularisation target)."""
        return self.personal_model(work.rnd, work.payload, work.state)

    def loss_terms(self, work: LocalRound) -> list[LossTerm]:
        lam = work.scratch["lambda"]
        if self.options.penalty != "loss" or lam <= 0:
            return []
        # lambda ||theta - theta_hat||^2 == proximal term with mu = 2 lambda (mu/2 ||.||^2)
        return [proximal_to(work.model, work.payload, 2.0 * lam)]

    def after_step(self, work: LocalRound) -> Callable[[nn.Module], None] | None:
        """``penalty=decoupled`` (the authors' code): after each SGD step,
        ``theta <- theta - lr * lambda * (theta_0 - theta_hat)`` with ``theta_0`` the weights
        before the step, outside momentum."""
        lam = work.scratch["lambda"]
        if self.options.penalty != "decoupled" or lam <= 0:
            return None
        params = dict(work.model.named_parameters())
        target = {k: torch.as_tensor(v) for k, v in work.payload.items() if k in params}
        lr = self.optim(work.rnd).lr
        return DecoupledProximal(work.model, target, lr, lam)

    def train(self, work: LocalRound) -> dict[str, float]:
        hat = self.reference_models(work.rnd, work.payload)["propagated_"].to(work.rnd.device)
        lam, own_loss, hat_loss = self.selective_weight(work.rnd, work.model, hat)
        work.scratch["lambda"] = lam
        metrics = super().train(work)
        metrics.pop("proximal", None)   # reported as lambda instead (present or not, per round)
        return {**metrics, "lambda": lam, "val_loss_own": own_loss, "val_loss_propagated": hat_loss}

    def upload(self, work: LocalRound) -> tuple[NDArrays, dict[str, NDArrays]]:
        """theta_k, plus the basis when the server asked for it (once)."""
        arrays, extra = super().upload(work)
        wanted = str(work.rnd.message_config.get(NEED_BASIS_KEY, ""))
        if work.rnd.client_id in [c for c in wanted.split(",") if c]:
            extra[BASIS_RECORD] = {BASIS_ARRAY: self.basis(work.rnd, work.state)}
        return arrays, extra

    def private_state(self, work: LocalRound) -> NDArrays:
        return {**super().private_state(work), BASIS_STATE: self.basis(work.rnd, work.state)}


__all__ = ["FEDORATrainer", "BASIS_STATE"]
