"""``pflower adapt``: FDSE's label-free unseen-domain adaptation of a finished run.

Reads ``<run>/config.yaml`` and ``<run>/checkpoint/server.npz`` (the server holds no
data, so this is an offline operator step) and runs the client-side Algorithm 3
(:func:`client.fdse.adapt_unseen`) for every held-out client of the run's dataset.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from client.fdse import adapt_unseen, personal_init
from common.methods import method_options, parameter_roles
from common.options import FDSEOptions
from common.roles import PERSONAL, keys_with
from learning.data import load_federated_data
from learning.fdse_model import shared_bn_stats
from learning.models import build_model, resolve_device
from learning.params import set_arrays
from server.checkpoint import load_checkpoint


def adapt_run(run_dir: str | Path, init: str = "mean", epochs: int | None = None,
              lr: float | None = None, adapt_on: str | None = None,
              clients: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Adapt the final model of an FDSE run to each held-out client (``data.new_clients``).

    Reads ``<run>/config.yaml`` and ``<run>/checkpoint/server.npz``; the adaptation settings
    default to ``strategy.adapt_*`` of the run's config. Returns ``{client: metrics}`` and
    writes it to ``<run>/unseen_adaptation.json``.
    """
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
    st = method_options(cfg.strategy)
    assert isinstance(st, FDSEOptions)
    epochs = st.adapt_epochs if epochs is None else int(epochs)
    lr = st.adapt_lr if lr is None else float(lr)
    adapt_on = st.adapt_on if adapt_on is None else str(adapt_on)
    device = resolve_device(str(cfg.device))
    torch.manual_seed(int(cfg.seed))
    template = build_model(cfg.model, data.input_shape, data.num_classes)
    pkeys = keys_with(parameter_roles(cfg.strategy, template), PERSONAL)
    arrays = {**groups["global"], **personal_init(groups, pkeys, init)}
    results: dict[str, dict[str, float]] = {}
    for cid in clients or sorted(data.new_clients):
        model = copy.deepcopy(template)
        set_arrays(model, arrays)
        gs = shared_bn_stats(groups["global"])
        res = adapt_unseen(model, gs, data.new_clients[cid], device, beta=st.beta,
                           form=st.consistency_form, epochs=epochs, lr=lr,
                           batch_size=int(cfg.train.batch_size), clip=float(cfg.train.clip),
                           adapt_on=adapt_on, seed=int(cfg.seed))
        res["domain"] = data.new_clients[cid].domain  # type: ignore[assignment]
        results[cid] = res
    meta = {"init": init, "epochs": epochs, "lr": lr, "adapt_on": adapt_on}
    (run / "unseen_adaptation.json").write_text(json.dumps({"settings": meta, "clients": results}, indent=2))
    return results


def cmd_adapt(args: argparse.Namespace) -> int:
    for run in args.runs:
        res = adapt_run(run, init=args.init, epochs=args.epochs, lr=args.lr, adapt_on=args.adapt_on)
        print(f"{run}:")
        for cid, m in res.items():
            print(f"  {cid} ({m['domain']}): init {m['acc_init']:.4f}  before {m['acc_before']:.4f}"
                  f"  after {m['acc_after']:.4f}")
        accs = {k: float(np.mean([m[k] for m in res.values()])) for k in ("acc_init", "acc_before", "acc_after")}
        print(f"  mean: init {accs['acc_init']:.4f}  before {accs['acc_before']:.4f}  after {accs['acc_after']:.4f}")
    return 0


def add_parser(sub: Any) -> None:
    a = sub.add_parser("adapt", help="FDSE: adapt a finished run to its held-out clients (Algorithm 3)")
    a.add_argument("runs", nargs="+", help="run folders (with config.yaml and checkpoint/)")
    a.add_argument("--init", default="mean", choices=("mean", "initial"))
    a.add_argument("--epochs", type=int, default=None)
    a.add_argument("--lr", type=float, default=None)
    a.add_argument("--on", dest="adapt_on", default=None, choices=("train", "test"))
    a.set_defaults(func=cmd_adapt)
