"""PartialFed clients (Sun et al., NeurIPS 2021): partial initialisation from the global model.

The client's model of the previous round ``W_{t-1}^c`` is durable private state
(``model/<key>``); before a client has one it starts from the payload.

* :class:`PartialFedFixTrainer` (Sec. 3.2): the ``start_model`` step takes every key the
  rule (``strategy.rule``, :func:`strategies.partialfed_math.fix_global_keys`) marks
  global from the payload and every other key from ``W_{t-1}^c``; BN running statistics
  follow the BN rule (local under ``no-bn*``, else with their stage). Then ordinary local
  training; the whole model is uploaded (FedAvg on the server) and kept.
* :class:`PartialFedAdaptiveTrainer` (Sec. 3.3, Alg. 2): the ``train`` step keeps both
  copies (global ``W_t`` and local ``W_{t-1}^c``) and per unit two logits (durable state
  ``partialfed/logits``, uniform before the first round). Each batch samples hard gates
  (Gumbel-softmax, straight-through), runs the model on the composed weights
  (``torch.func.functional_call``) and updates either the chosen copies (``f_m`` model
  batches) or the logits (``f_s`` strategy batches). The round's model is the soft mix
  by the gate probabilities followed by a short fine-tune (default) or the argmax copy.

Personalised accuracy is that of the client's own model after the round's local training
(for rule ``all`` this is FedAvg + fine-tuning); the payload is also evaluated as the
global model (``global_*``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import Dataset

from client.round import ClientRound
from client.trainer import MODEL_PREFIX, ClientTrainer, LocalRound, prefixed, unprefixed
from learning.models import parameter_groups
from learning.params import NDArrays, get_arrays, set_arrays
from learning.training import OptimConfig, make_loader, make_optimizer, train_epochs
from learning.units import model_units, unit_of
from strategies.partialfed_math import (
    GLOBAL,
    P_GLOBAL_METRIC,
    PartialFedAdaptiveOptions,
    PartialFedFixOptions,
    anneal_tau,
    compose_weights,
    fix_global_keys,
    gumbel_gates,
    merge_by_unit,
)

LOGITS_STATE = "partialfed/logits"


class PartialFedFixTrainer(ClientTrainer):
    """PartialFed-Fix client (see the module docstring)."""

    name: ClassVar[str] = "partialfed-fix"
    options: PartialFedFixOptions

    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """The client's own model (its last round's), or the payload before it has one."""
        return self.own_model(rnd, payload, state)

    def global_keys(self, model: nn.Module) -> set[str]:
        return fix_global_keys(model_units(model, "stage"), model_units(model, "block"),
                               parameter_groups(model)["bn"], self.options.rule)

    def start_model(self, work: LocalRound) -> nn.Module:
        model = self.new_model(work.rnd)
        set_arrays(model, work.payload)
        own = unprefixed(work.state, MODEL_PREFIX)
        if own:
            from_global = self.global_keys(model)
            set_arrays(model, {k: v for k, v in own.items() if k not in from_global})
        return model

    def private_state(self, work: LocalRound) -> NDArrays:
        return {**work.state, **prefixed(get_arrays(work.model), MODEL_PREFIX)}


class PartialFedAdaptiveTrainer(PartialFedFixTrainer):
    """PartialFed-Adaptive client (see the module docstring)."""

    name: ClassVar[str] = "partialfed-adaptive"
    options: PartialFedAdaptiveOptions  # type: ignore[assignment]

    def units(self, model: nn.Module) -> dict[str, list[str]]:
        return model_units(model, self.options.granularity)

    def start_model(self, work: LocalRound) -> nn.Module:
        """W_{t-1}^c (the payload before the client has a model of its own)."""
        return self.personal_model(work.rnd, work.payload, work.state)

    def initial_logits(self, state: NDArrays, units: list[str]) -> np.ndarray:
        stored = state.get(LOGITS_STATE)
        if stored is None:
            return np.zeros((len(units), 2), np.float32)       # uniform: p(global) = 0.5
        if stored.shape != (len(units), 2):
            raise ValueError(f"stored PartialFed logits have shape {stored.shape}, this model has "
                             f"{len(units)} units at granularity {self.options.granularity!r} "
                             "(state from another configuration?); remove the client state")
        return np.asarray(stored, np.float32)

    def train(self, work: LocalRound) -> dict[str, float]:
        rnd, o = work.rnd, self.options
        local = work.model
        glob = self.new_model(rnd)
        set_arrays(glob, work.payload)
        glob.to(rnd.device)
        units = self.units(local)
        names = list(units)
        index = {k: names.index(u) for k, u in unit_of(units).items()}
        logits = torch.tensor(self.initial_logits(work.state, names), device=rnd.device, requires_grad=True)
        tau = anneal_tau(rnd.server_round, self.settings.run.rounds, o.tau_start, o.tau_end, o.tau_schedule)
        opt = self.optim(rnd)
        metrics = train_gated(local, glob, logits, index, rnd.data.train, opt, rnd.device, tau,
                              o.model_batches, o.strategy_batches, o.gate_lr or opt.lr, seed=rnd.seed)
        p_global = torch.softmax(logits.detach(), dim=-1)[:, GLOBAL].cpu()
        merged = merge_by_unit(p_global, index, glob.state_dict(), local.state_dict(), o.final)
        local.load_state_dict(merged)
        if o.final == "soft" and o.finetune_epochs > 0:
            ft = train_epochs(local, rnd.data.train, dataclasses.replace(opt, epochs=o.finetune_epochs),
                              rnd.device, seed=rnd.seed + 1)
            metrics.update({f"finetune_{k}": v for k, v in ft.items()})
        work.scratch["logits"] = logits.detach().cpu().numpy()
        metrics.update({P_GLOBAL_METRIC + u: float(p_global[i]) for i, u in enumerate(names)})
        metrics["tau"] = tau
        return metrics

    def private_state(self, work: LocalRound) -> NDArrays:
        return {**super().private_state(work), LOGITS_STATE: work.scratch["logits"]}


def train_gated(local: nn.Module, glob: nn.Module, logits: torch.Tensor, unit_index: Mapping[str, int],
                data: Dataset, opt: OptimConfig, device: torch.device, tau: float, model_batches: int,
                strategy_batches: int, gate_lr: float, seed: int = 0,
                after_step: Callable[[int, bool], None] | None = None) -> dict[str, float]:
    """Alg. 2's inner loop: per batch, sample gates, compose, compute the loss, and step
    either the chosen model copies (batch index mod (f_m + f_s) < f_m) or the logits.

    Only the copy a gate chose receives this batch's update (the other's gradient is
    dropped, so neither weight decay nor momentum moves it); BN buffers of the chosen copy
    are passed as themselves, so their running statistics are updated in place.
    ``after_step(step, was_model_step)`` is called after each step (tests, diagnostics).
    """
    local.to(device).train()
    glob.to(device).train()
    l_par, g_par = dict(local.named_parameters()), dict(glob.named_parameters())
    l_buf, g_buf = dict(local.named_buffers()), dict(glob.named_buffers())
    model_opt = make_optimizer([*l_par.values(), *g_par.values()], opt)
    # Alg. 2 steps the weights and the logits with one optimiser: the same kind and momentum,
    # step size eta (gate_lr = train.lr unless strategy.gate_lr sets it; ours); no weight decay
    # on the logits (it would pull every gate towards p = 1/2, which Alg. 2 does not do).
    gate_opt = make_optimizer([logits], dataclasses.replace(opt, lr=gate_lr, weight_decay=0.0))
    generator = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    step, total, correct, loss_sum = 0, 0, 0, torch.zeros((), device=device, dtype=torch.float64)
    for epoch in range(max(0, opt.epochs)):
        total, correct, loss_sum = 0, 0, torch.zeros((), device=device, dtype=torch.float64)
        for x, y in make_loader(data, opt.batch_size, shuffle=True, seed=seed + epoch):
            x, y = x.to(device), y.to(device)
            gates = gumbel_gates(logits, tau, generator)
            tensors = compose_weights(gates, unit_index, {**g_par, **g_buf}, {**l_par, **l_buf})
            out = functional_call(local, tensors, (x,))
            loss = loss_fn(out, y)
            model_step = step % (model_batches + strategy_batches) < model_batches
            model_opt.zero_grad(set_to_none=True)
            gate_opt.zero_grad(set_to_none=True)
            loss.backward()
            if model_step:
                chose_global = gates[:, GLOBAL].detach().cpu() > 0.5
                for k in g_par:
                    dropped = l_par[k] if bool(chose_global[unit_index[k]]) else g_par[k]
                    dropped.grad = None
                if opt.clip > 0:
                    nn.utils.clip_grad_norm_([p for p in [*l_par.values(), *g_par.values()]
                                              if p.grad is not None], opt.clip)
                model_opt.step()
            else:
                gate_opt.step()
            if after_step is not None:
                after_step(step, model_step)
            step += 1
            total += len(y)
            correct += int((out.argmax(1) == y).sum())
            loss_sum += loss.detach().double() * len(y)
    loss_value = float(loss_sum) / max(total, 1)
    if not np.isfinite(loss_value):
        raise FloatingPointError(f"PartialFed training loss became {loss_value}; lower train.lr")
    return {"train_loss": loss_value, "train_accuracy": correct / max(total, 1), "steps": float(step)}


__all__ = ["PartialFedFixTrainer", "PartialFedAdaptiveTrainer", "train_gated", "LOGITS_STATE"]
