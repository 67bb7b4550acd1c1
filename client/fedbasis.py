"""FedBasis client (Chen et al., arXiv 2304.07882, Alg. 1): coordinate descent on the
combination coefficients and the bases.

The trained model is :class:`learning.basis.BasisModel` (K bases, a major basis, one
coefficient vector per unit). One round, as steps:

* warm-up rounds (the payload holds the FedAvg model only, Sec. 4.4): plain FedAvg local
  training of that model, uploaded under the warm-up prefix;
* later rounds: ``start_model`` loads the bases and starts the logits uniform (they are not
  kept from round to round during training, Sec. 4.1); ``train`` learns the logits with
  the bases frozen (``coeff_epochs``), sharpens them (``psi <- psi / tau``), then learns
  the bases with the logits frozen (``basis_epochs``); ``upload`` sends the K (+1) bases;
  ``private_state`` keeps the sharpened logits, with which the client's personalised
  model is evaluated (the combination its bases were trained for).

Each round reports the learned (pre-sharpening) coefficients as ``coeff/<unit>/<k>``, except
under DP or secure aggregation (``privacy``), where they are personal parameters that stay
home like the logits themselves (the server's coefficient diagnostics are then empty).

New clients (:meth:`FedBasisTrainer.new_client_model`) receive the bases and learn only
their logits (and, with ``personalize_head``, the classifier), from uniform.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

from torch import nn

from client.round import ClientRound
from client.trainer import ClientTrainer, LocalRound
from common.roles import SHARED
from learning.basis import COEFF_KEY, HEAD_OVERRIDE, MAJOR_PREFIX, BasisModel, basis_prefix
from learning.params import NDArrays, get_arrays, set_arrays
from learning.training import train_epochs
from strategies.fedbasis_math import COEFF_METRIC, FedBasisOptions


class FedBasisTrainer(ClientTrainer):
    """FedBasis client (see the module docstring)."""

    name: ClassVar[str] = "fedbasis"
    options: FedBasisOptions

    # ---------------------------------------------------------------- phases
    @property
    def warm_prefix(self) -> str:
        """Where the FedAvg model of the warm-up travels: the major basis (or basis 0)."""
        return MAJOR_PREFIX if self.options.major else basis_prefix(0)

    def is_warm(self, payload: NDArrays) -> bool:
        """A warm-up payload carries the FedAvg model only, not the last basis."""
        last = basis_prefix(self.options.num_bases - 1)
        return not any(k.startswith(last) for k in payload)

    def plain_model(self, rnd: ClientRound, payload: NDArrays) -> nn.Module:
        model = self.new_model(rnd).template  # type: ignore[union-attr]
        n = len(self.warm_prefix)
        set_arrays(model, {k[n:]: v for k, v in payload.items() if k.startswith(self.warm_prefix)})
        return model

    def roles(self, model: nn.Module) -> dict[str, str]:
        if isinstance(model, BasisModel):
            return super().roles(model)
        return {k: SHARED for k in model.state_dict()}          # the warm-up's plain model

    # ---------------------------------------------------------------- steps
    def start_model(self, work: LocalRound) -> nn.Module:
        if self.is_warm(work.payload):
            return self.plain_model(work.rnd, work.payload)
        model = self.new_model(work.rnd)                         # logits start at zero: uniform
        set_arrays(model, {k: v for k, v in work.payload.items() if k != COEFF_KEY})
        return model

    def train(self, work: LocalRound) -> dict[str, float]:
        model = work.model
        if not isinstance(model, BasisModel):
            return super().train(work)
        rnd, o = work.rnd, self.options
        opt = self.optim(rnd)
        coeff_opt = dataclasses.replace(opt, epochs=o.coeff_epochs, lr=o.coeff_lr or opt.lr, weight_decay=0.0)
        model.track_stats = False                                # Step 2: the bases stay as received
        coeff = train_epochs(model, rnd.data.train, coeff_opt, rnd.device, seed=rnd.seed,
                             trainable=lambda n: n == COEFF_KEY)
        alpha = model.coefficients().detach().cpu().numpy()
        model.sharpen(o.sharpen_tau)                              # Step 3
        model.track_stats = True                                 # Step 4: the bases learn
        bases = train_epochs(model, rnd.data.train, dataclasses.replace(opt, epochs=o.basis_epochs),
                             rnd.device, seed=rnd.seed + 1, trainable=lambda n: n != COEFF_KEY)
        metrics = {**bases, **{f"coeff_{k}": v for k, v in coeff.items()}}
        if not self.settings.privacy.guards_uploads:     # personal parameters: kept home under DP or SecAgg+
            metrics.update({f"{COEFF_METRIC}{u}/{k}": float(alpha[i, k])
                            for i, u in enumerate(model.unit_names) for k in range(model.num_bases)})
        return metrics

    def upload(self, work: LocalRound) -> tuple[NDArrays, dict[str, NDArrays]]:
        if isinstance(work.model, BasisModel):
            return super().upload(work)
        return {self.warm_prefix + k: v for k, v in get_arrays(work.model).items()}, {}

    def private_state(self, work: LocalRound) -> NDArrays:
        if isinstance(work.model, BasisModel):
            return super().private_state(work)                   # + the sharpened logits
        return dict(work.state)

    # ---------------------------------------------------------------- evaluation
    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """The bases combined by this client's last sharpened logits (uniform before it has
        any); the FedAvg model during the warm-up."""
        if self.is_warm(payload):
            return self.plain_model(rnd, payload)
        return self.load_model(rnd, payload, state)

    def reference_models(self, rnd: ClientRound, payload: NDArrays) -> dict[str, nn.Module]:
        """``global_``: the un-personalised model (uniform coefficients; FedAvg's during the
        warm-up)."""
        if self.is_warm(payload):
            return {"global_": self.plain_model(rnd, payload)}
        model = self.new_model(rnd)
        set_arrays(model, {k: v for k, v in payload.items() if k != COEFF_KEY})
        return {"global_": model}

    # ---------------------------------------------------------------- new clients
    def new_client_modes(self) -> tuple[str, ...]:
        return ("basis",)

    def new_client_lr_scales(self) -> dict[str, float]:
        """The logits learn at ``coeff_lr / train.lr`` times the swept lr (when ``coeff_lr`` is
        set), the ratio of training: their gradient is a sum over a whole unit's parameters, so
        their scale differs from the weights'. Scaling (not fixing) it makes a learning-rate
        sweep move the coefficients' lr as it moves the baselines' whole-model lr."""
        coeff_lr = self.options.coeff_lr
        return {COEFF_KEY: float(coeff_lr) / self.settings.train.lr} if coeff_lr else {}

    def new_client_model(self, rnd: ClientRound, payload: NDArrays,
                         mode: str) -> tuple[nn.Module, Callable[[str], bool]]:
        """The received bases with uniform logits; learned: the logits (+ the classifier
        with ``personalize_head``). The bases' weights stay as received; BN running
        statistics follow the new client's data in training mode, as they do in the
        ``ft`` and ``lp`` baselines' PyTorch loop (one rule for every method)."""
        if mode != "basis":
            raise ValueError(f"fedbasis personalises new clients by 'basis', not {mode!r}")
        if self.is_warm(payload):
            raise ValueError("the run ended in its FedAvg warm-up (no bases yet); run more rounds "
                             "or lower strategy.warm_fraction")
        model = self.new_model(rnd)
        assert isinstance(model, BasisModel)
        set_arrays(model, {k: v for k, v in payload.items() if k != COEFF_KEY})
        if self.options.personalize_head:
            model.free_head()
        return model, lambda n: n == COEFF_KEY or n.startswith(HEAD_OVERRIDE + ".")


__all__ = ["FedBasisTrainer"]
