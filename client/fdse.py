"""FDSE client: task loss + lambda * consistency loss; unseen-domain adaptation.

Wang et al., "Federated Learning with Domain Shift Eraser", CVPR 2025 (Algorithm 1 lines
5-10, Sec. 4.2; Algorithm 3 for unseen domains).

Each round the client loads the received shared tensors and its personal (DSE) tensors,
overlays its own local-only BN_DSE running statistics, takes the received BN_DFE running
statistics as the global statistics ``gs`` (before any training step), and trains *all*
parameters on ``CE + lambda * L_Con(model, gs, beta)`` (``L_Con`` active from round
``strategy.consistency_from_round``, paper: 2; ``form`` "paper" = Eq. 4-6, "code" = the
authors' current code). It uploads the shared and personal tensors; the local-only
statistics stay in its private state (with its personal tensors, kept as a fallback when
a payload carries none). Its personalised accuracy is that of its model right after local
training (``strategy.evaluate=trained``, the authors' protocol), or of the aggregated model
the server sends (``aggregated``).

:func:`adapt_unseen` is the label-free adaptation of a held-out client (Algorithm 3): only
the personal (DSE) modules are trained, to minimise ``L_Con`` against the global BN_DFE
statistics; BN_DFE stays frozen. Run it on a finished run with ``pflower personalize --adapt
RUN_DIR`` (alias ``pflower adapt``), which drives :meth:`FDSETrainer.adapt_new_client` (it
reads ``<run>/config.yaml`` and ``<run>/checkpoint/server.npz``; the server holds no data,
so this is offline).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from client.round import ClientRound
from client.trainer import ClientTrainer, LocalRound, prefixed, unprefixed
from common.roles import LOCAL, PERSONAL, keys_with
from learning.datasets.federated import ClientSplit
from learning.fdse_model import (
    adaptation_mode,
    consistency_loss,
    dse_blocks,
    reset_consistency_state,
    shared_bn_stats,
)
from learning.params import NDArrays, get_arrays, set_arrays
from learning.training import (
    LossTerm,
    OptimConfig,
    evaluate,
    make_loader,
    make_optimizer,
    seed_everything,
)
from strategies.fdse_math import FDSEOptions


class FDSETrainer(ClientTrainer):
    """FDSE client (see the module docstring). The roles (``common/roles.py``: DFE shared,
    DSE personal, BN_DSE statistics local) already say what is loaded, kept and uploaded;
    this class adds the consistency loss."""

    name: ClassVar[str] = "fdse"
    has_global_model: ClassVar[bool] = False   # the shared part alone is not a model
    options: FDSEOptions

    def start_model(self, work: LocalRound) -> nn.Module:
        model = super().start_model(work)
        roles = self.roles(model)
        leaked = [k for k in work.payload if roles.get(k) == LOCAL]
        if leaked:
            raise ValueError(f"fdse: the server sent local-only statistics {leaked[:3]}; "
                             "they belong to the client")
        # the received global BN_DFE statistics, before any training step
        work.scratch["global_stats"] = shared_bn_stats(get_arrays(model))
        reset_consistency_state(model)
        return model

    def loss_terms(self, work: LocalRound) -> list[LossTerm]:
        o = self.options
        if not (o.lam > 0 and work.rnd.server_round >= o.consistency_from_round):
            return []
        gs = work.scratch["global_stats"]
        return [LossTerm("consistency",
                         lambda m, x, y, logits: consistency_loss(m, gs, o.beta, o.consistency_form),
                         weight=o.lam)]

    def train(self, work: LocalRound) -> dict[str, float]:
        metrics = super().train(work)
        metrics.setdefault("consistency", 0.0)   # the term is off in the first round(s)
        return metrics

    TRAINED = "trained/"

    def private_state(self, work: LocalRound) -> NDArrays:
        """With ``evaluate=trained``, also the whole model as it left local training, which
        the evaluation of this round tests (the authors evaluate each client's model right
        after its local training)."""
        state = super().private_state(work)
        if self.options.evaluate == "trained":
            state.update(prefixed(get_arrays(work.model), self.TRAINED))
        return state

    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """``evaluate=trained``: the client's model after its last local training (before
        its first training, the received one); ``aggregated``: the received shared and
        personal tensors with the client's local statistics."""
        if self.options.evaluate == "trained" and unprefixed(state, self.TRAINED):
            return self.own_model(rnd, payload, state, self.TRAINED)
        return super().personal_model(rnd, payload, state)

    def adapt_new_client(self, rnd: ClientRound, groups: Mapping[str, NDArrays],
                         settings: Mapping[str, Any]) -> dict[str, float]:
        """Algorithm 3 for a client of an unseen domain (``rnd.data``): the final shared
        tensors, personal tensors from ``settings["init"]`` (:func:`personal_init`), then
        :func:`adapt_unseen`; ``epochs``, ``lr``, ``adapt_on`` of ``settings`` when given,
        else ``strategy.adapt_*``."""
        o = self.options
        model = self.new_model(rnd)
        personal = keys_with(self.roles(model), PERSONAL)
        set_arrays(model, {**groups["global"], **personal_init(groups, personal, str(settings["init"]))})
        pick = {k: settings[k] if settings.get(k) is not None else d
                for k, d in (("epochs", o.adapt_epochs), ("lr", o.adapt_lr), ("adapt_on", o.adapt_on))}
        return adapt_unseen(model, shared_bn_stats(groups["global"]), rnd.data, rnd.device, beta=o.beta,
                            form=o.consistency_form, epochs=int(pick["epochs"]), lr=float(pick["lr"]),
                            batch_size=self.settings.train.batch_size, clip=self.settings.train.clip,
                            adapt_on=str(pick["adapt_on"]), seed=self.settings.run.seed)


# ---------------------------------------------------------------- unseen domains
def personal_init(groups: Mapping[str, NDArrays], keys: list[str], how: str = "mean") -> NDArrays:
    """Personal tensors a held-out client starts from.

    ``"mean"``: the unweighted mean of the stored personal tensors of all training clients
    (``personal/<cid>`` checkpoint groups); ``"initial"``: the server's own copy, which FDSE
    never updates (the initial DSE modules, as the authors' server model holds).
    """
    if how == "initial":
        return {k: groups["global"][k] for k in keys}
    if how != "mean":
        raise ValueError(f"personal init must be 'mean' or 'initial', got {how!r}")
    clients = [g for name, g in groups.items() if name.startswith("personal/")]
    if not clients:
        raise ValueError("the checkpoint holds no personal state; use init='initial'")
    return {k: np.mean(np.stack([np.asarray(c[k], np.float64) for c in clients]), axis=0)
            .astype(np.asarray(clients[0][k]).dtype) for k in keys}


@torch.no_grad()
def collect_dse_stats(model: nn.Module, data: torch.utils.data.Dataset, device: torch.device,
                      batch_size: int = 50) -> None:
    """Re-estimate the BN_DSE running statistics on ``data`` (no labels, no gradients;
    cumulative average over one pass, FDSE's Algorithm 2 applied to the local-only BNs).
    Every other BN keeps its statistics."""
    bns = [block.dse_bn for _, block in dse_blocks(model)]
    saved = [bn.momentum for bn in bns]
    model.to(device).eval()
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
        bn.train()
    loader = torch.utils.data.DataLoader(  # BN needs > 1 sample per batch in train mode
        data, batch_size=batch_size, shuffle=False,
        drop_last=len(data) > batch_size and len(data) % batch_size == 1)  # type: ignore[arg-type]
    try:
        for x, _ in loader:
            model(x.to(device))
    finally:
        for bn, m in zip(bns, saved, strict=True):
            bn.momentum = m
        model.eval()


def adapt_unseen(
    model: nn.Module,
    global_stats: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    split: ClientSplit,
    device: torch.device,
    beta: float,
    form: str = "paper",
    epochs: int = 5,
    lr: float = 0.01,
    momentum: float = 0.9,
    batch_size: int = 50,
    clip: float = 10.0,
    adapt_on: str = "train",
    seed: int = 0,
) -> dict[str, float]:
    """Label-free unseen-domain adaptation (FDSE Algorithm 3), before/after test accuracy.

    ``model`` holds the shared tensors and the chosen personal initialisation. Reports
    ``acc_init`` (BN_DSE statistics as given, i.e. freshly initialised), ``acc_before`` (BN_DSE
    statistics re-estimated on the adaptation data, no training: the fair "no adaptation"
    point for a client that has no statistics of its own) and ``acc_after``: personal (DSE)
    parameters trained for ``epochs`` epochs with SGD on ``L_Con`` only (labels unused),
    shared parameters frozen and BN_DFE in eval mode (statistics fixed to the global ones),
    followed by one BN_DSE statistics pass. ``adapt_on`` = "train" (the client's unlabeled
    train split; default) or "test" (the paper's transductive protocol: the target's test
    data). Accuracy is always measured on the test split. ``model`` is modified in place.
    """
    if adapt_on not in ("train", "test"):
        raise ValueError(f"adapt_on must be 'train' or 'test', got {adapt_on!r}")
    data = split.train if adapt_on == "train" else split.test
    out = {"acc_init": evaluate(model, split.test, device)["accuracy"]}
    collect_dse_stats(model, data, device, batch_size)
    out["acc_before"] = evaluate(model, split.test, device)["accuracy"]
    seed_everything(seed)
    model.to(device).train()
    params = adaptation_mode(model)
    optimizer = make_optimizer(params, OptimConfig(lr=lr, batch_size=batch_size, momentum=momentum))
    reset_consistency_state(model)
    losses: list[float] = []
    for epoch in range(epochs):
        for x, _ in make_loader(data, batch_size, shuffle=True, seed=seed + epoch):
            optimizer.zero_grad(set_to_none=True)
            model(x.to(device))
            loss = consistency_loss(model, global_stats, beta, form)
            loss.backward()
            if clip > 0:
                nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            losses.append(float(loss.detach()))
    for p in model.parameters():
        p.requires_grad_(True)
    collect_dse_stats(model, data, device, batch_size)
    out["acc_after"] = evaluate(model, split.test, device)["accuracy"]
    out["consistency_first"] = losses[0] if losses else float("nan")
    out["consistency_last"] = losses[-1] if losses else float("nan")
    return out
