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
a payload carries none).

:func:`adapt_unseen` is the label-free adaptation of a held-out client (Algorithm 3): only
the personal (DSE) modules are trained, to minimise ``L_Con`` against the global BN_DFE
statistics; BN_DFE stays frozen. Run it on a finished run with
``python -m client.fdse adapt RUN_DIR`` (reads ``<run>/config.yaml`` and
``<run>/checkpoint/server.npz``; the server holds no data, so this is offline).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from client.trainer import MODEL_PREFIX, ClientRound, ClientTrainer, FitResult, prefixed, unprefixed
from learning.data import ClientSplit
from learning.fdse_model import (
    LOCAL,
    PERSONAL,
    adaptation_mode,
    consistency_loss,
    dse_blocks,
    parameter_classes,
    reset_consistency_state,
    shared_bn_stats,
)
from learning.models import build_model
from learning.params import NDArrays, get_arrays, set_arrays
from learning.training import evaluate, make_loader, seed_everything, train_epochs


def _keys_of(model: nn.Module, cls: str) -> list[str]:
    return [k for k, c in parameter_classes(model).items() if c == cls]


class FDSETrainer(ClientTrainer):
    """FDSE client (see the module docstring). Config: ``strategy.lam`` (lambda),
    ``strategy.beta`` (layer-weight exponent), ``strategy.consistency_form``,
    ``strategy.consistency_from_round``."""

    name: ClassVar[str] = "fdse"
    has_global_model: ClassVar[bool] = False   # the shared part alone is not a model

    def private_keys(self, model: nn.Module) -> list[str]:
        """Local-only state: BN_DSE running statistics (never uploaded)."""
        return _keys_of(model, LOCAL)

    def is_uploaded(self, model: nn.Module) -> Callable[[str], bool]:
        local = set(self.private_keys(model))
        return lambda k: k not in local

    def load_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """Payload (shared + this client's personal mix), then the client's local statistics;
        personal tensors the payload does not carry come from the client's own state."""
        model = self.new_model(rnd)
        classes = parameter_classes(model)
        local = [k for k in payload if classes.get(k) == LOCAL]
        if local:
            raise ValueError(f"fdse: the server sent local-only statistics {local[:3]}; "
                             "they belong to the client")
        set_arrays(model, payload)
        own = unprefixed(state, MODEL_PREFIX)
        keep = {k: v for k, v in own.items()
                if classes.get(k) == LOCAL or (classes.get(k) == PERSONAL and k not in payload)}
        set_arrays(model, keep)
        return model

    def save_state(self, model: nn.Module) -> NDArrays:
        keys = _keys_of(model, LOCAL) + _keys_of(model, PERSONAL)
        return prefixed(get_arrays(model, keys), MODEL_PREFIX)

    def _strategy_opt(self, key: str, default: Any) -> Any:
        return self.cfg.strategy.get(key, default)

    def fit(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> FitResult:
        model = self.load_model(rnd, payload, state).to(rnd.device)
        lam = float(self._strategy_opt("lam", 0.1))
        beta = float(self._strategy_opt("beta", 0.001))
        form = str(self._strategy_opt("consistency_form", "paper"))
        start = int(self._strategy_opt("consistency_from_round", 2))
        active = lam > 0 and rnd.server_round >= start
        gs = shared_bn_stats(get_arrays(model))          # the received global BN_DFE statistics
        reset_consistency_state(model)
        con_values: list[float] = []

        def con_term(m: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            value = consistency_loss(m, gs, beta, form)
            con_values.append(float(value.detach()))
            return lam * value

        metrics = train_epochs(model, rnd.data.train, self.optim(rnd), rnd.device, seed=rnd.seed,
                               extra_loss=con_term if active else None)
        metrics["consistency"] = float(np.mean(con_values)) if con_values else 0.0
        upload = get_arrays(model, self.is_uploaded(model))
        return FitResult(upload, metrics, {**state, **self.save_state(model)}, rnd.data.num_train)


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
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
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


def adapt_run(run_dir: str | Path, init: str = "mean", epochs: int | None = None,
              lr: float | None = None, adapt_on: str | None = None,
              clients: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Adapt the final model of an FDSE run to each held-out client (``data.new_clients``).

    Reads ``<run>/config.yaml`` and ``<run>/checkpoint/server.npz``; the adaptation settings
    default to ``strategy.adapt_*`` of the run's config. Returns ``{client: metrics}`` and
    writes it to ``<run>/unseen_adaptation.json``.
    """
    from learning.data import load_federated_data
    from learning.models import resolve_device
    from server.checkpoint import load_checkpoint

    run = Path(run_dir)
    cfg_path = run / "config.yaml"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{run} has no config.yaml; give the folder of an FDSE run")
    cfg: DictConfig = OmegaConf.load(cfg_path)  # type: ignore[assignment]
    if str(cfg.strategy.name) != "fdse":
        raise ValueError(f"{run} is a {cfg.strategy.name!r} run; adaptation needs an FDSE run")
    _, groups, _ = load_checkpoint(run, {"strategy": "fdse"})
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    if not data.new_clients:
        raise ValueError(f"dataset {cfg.dataset.name!r} has no held-out clients; set "
                         "dataset.new_clients_per_domain >= 1 for the run")
    st = cfg.strategy
    epochs = int(st.get("adapt_epochs", 5) if epochs is None else epochs)
    lr = float(st.get("adapt_lr", 0.01) if lr is None else lr)
    adapt_on = str(st.get("adapt_on", "train") if adapt_on is None else adapt_on)
    device = resolve_device(str(cfg.device))
    torch.manual_seed(int(cfg.seed))
    template = build_model(cfg.model, data.input_shape, data.num_classes)
    pkeys = _keys_of(template, PERSONAL)
    arrays = {**groups["global"], **personal_init(groups, pkeys, init)}
    results: dict[str, dict[str, float]] = {}
    for cid in clients or sorted(data.new_clients):
        model = copy.deepcopy(template)
        set_arrays(model, arrays)
        gs = shared_bn_stats(groups["global"])
        res = adapt_unseen(model, gs, data.new_clients[cid], device, beta=float(st.beta),
                           form=str(st.get("consistency_form", "paper")), epochs=epochs, lr=lr,
                           batch_size=int(cfg.train.batch_size), clip=float(cfg.train.clip),
                           adapt_on=adapt_on, seed=int(cfg.seed))
        res["domain"] = data.new_clients[cid].domain  # type: ignore[assignment]
        results[cid] = res
    meta = {"init": init, "epochs": epochs, "lr": lr, "adapt_on": adapt_on}
    (run / "unseen_adaptation.json").write_text(json.dumps({"settings": meta, "clients": results}, indent=2))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.fdse",
                                     description="FDSE unseen-domain adaptation (Algorithm 3)")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("adapt", help="adapt a finished FDSE run to its held-out clients")
    a.add_argument("runs", nargs="+", help="run folders (with config.yaml and checkpoint/)")
    a.add_argument("--init", default="mean", choices=("mean", "initial"))
    a.add_argument("--epochs", type=int, default=None)
    a.add_argument("--lr", type=float, default=None)
    a.add_argument("--on", dest="adapt_on", default=None, choices=("train", "test"))
    args = parser.parse_args(argv)
    for run in args.runs:
        res = adapt_run(run, init=args.init, epochs=args.epochs, lr=args.lr, adapt_on=args.adapt_on)
        print(f"{run}:")
        for cid, m in res.items():
            print(f"  {cid} ({m['domain']}): init {m['acc_init']:.4f}  before {m['acc_before']:.4f}"
                  f"  after {m['acc_after']:.4f}")
        accs = {k: float(np.mean([m[k] for m in res.values()])) for k in ("acc_init", "acc_before", "acc_after")}
        print(f"  mean: init {accs['acc_init']:.4f}  before {accs['acc_before']:.4f}  after {accs['acc_after']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
