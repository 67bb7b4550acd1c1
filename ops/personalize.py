"""``pflower personalize RUN [RUN ...]``: personalise new clients from a finished run.

FedBasis' protocol (Chen et al., Sec. 6, Tables 2 and 4): every held-out client of the
run's dataset (``dataset.new_clients_per_domain``) starts from the run's final server
state and learns, on a share of its train split (sizes S/M/L) with each learning rate,
for ``personalize.epochs`` epochs, what its method learns for a client that never took
part: FedBasis its coefficients (+ the classifier), the global-model methods either the
whole model (``ft``) or the classifier only (``lp``, linear probe). Test accuracy is
reported after the last epoch and at the epoch with the best validation accuracy.

The client side is the method's own trainer (``ClientTrainer.new_client_model`` and
:func:`client.finetune.personalize_curve`), so this is the client's code, run by an
operator on data the server never holds. Writes ``<run>/new_clients.json`` and adds
``new_client_accuracy_{mean,min}`` (last epoch) and ``new_client_accuracy_best_{mean,min}``
at the largest size to ``<run>/summary.json``, at the learning rate Table 2 uses: the one of
``personalize.lrs`` whose best-epoch validation accuracy, averaged over the new clients, is
highest (``personalize.lr: null``; a number fixes it instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Subset

from client.finetune import last_and_best, personalize_curve
from client.handlers import trainer_class
from client.round import ClientRound
from common.config import load_finished_run
from common.protocol import client_sort_key
from learning.datasets.federated import ClientSplit, load_federated_data
from learning.models import resolve_device
from learning.training import OptimConfig
from ops.progress import PhaseProgress
from server.checkpoint import CheckpointError, load_checkpoint


def subset_train(split: ClientSplit, share: float, seed: int) -> ClientSplit:
    """The client with only ``share`` of its train split (a fixed random subset)."""
    n = len(split.train)
    keep = max(1, int(round(share * n)))
    idx = np.sort(np.random.default_rng(seed).permutation(n)[:keep])
    return dataclasses.replace(split, train=Subset(split.train, idx.tolist()), train_ids=split.train_ids[idx])


def personalize_run(run_dir: str | Path, lrs: list[float] | None = None, sizes: Mapping[str, float] | None = None,
                    epochs: int | None = None, clients: list[str] | None = None) -> dict[str, Any]:
    """Run the new-client protocol on one finished run; returns (and writes) the results."""
    run = Path(run_dir)
    finished = load_finished_run(run)
    cfg, settings = finished.cfg, finished.settings
    last_round, groups, _ = load_checkpoint(run, {"strategy": cfg.strategy.name})
    protocol = settings.personalize
    lrs = [float(x) for x in (lrs or protocol.lrs)]
    sizes = dict(sizes or protocol.sizes)
    epochs = int(epochs if epochs is not None else protocol.epochs)
    payload = groups["global"]
    data = load_federated_data(cfg.dataset, settings.run.seed)
    if not data.new_clients:
        raise ValueError(f"dataset {cfg.dataset.name!r} of {run} has no new clients; run with "
                         "dataset.new_clients_per_domain >= 1")
    trainer = trainer_class(settings.method)(cfg, settings)
    device = resolve_device(settings.run.device)
    opt = protocol.optim(settings.train, lrs[0])
    results: dict[str, Any] = {}
    chosen = clients or sorted(data.new_clients, key=client_sort_key)
    fits = len(chosen) * len(trainer.new_client_modes()) * len(sizes) * len(lrs)
    print(f"pflower: personalising {len(chosen)} new clients of {run.name}: {fits} fits of {epochs} epochs "
          f"({len(trainer.new_client_modes())} modes x {len(sizes)} sizes x {len(lrs)} lrs a client)", flush=True)
    with PhaseProgress("personalising new clients", fits) as progress:
        for cid in chosen:
            results[cid] = personalize_client(cid, data, trainer, payload, sizes, lrs, epochs, opt, device,
                                              last_round, progress)
    table = summarise(results)
    out = {"settings": {"epochs": epochs, "lrs": lrs, "sizes": sizes, "batch_size": opt.batch_size,
                        "momentum": opt.momentum, "weight_decay": opt.weight_decay, "round": last_round},
           "summary": table, "clients": results}
    (run / "new_clients.json").write_text(json.dumps(out, indent=2))
    mode, size = trainer.new_client_modes()[0], max(sizes, key=lambda s: float(sizes[s]))
    fixed = protocol.lr
    lr = str(fixed) if fixed is not None and fixed in lrs else select_lr(table[mode][size])
    update_summary(run, table, mode, lr, size, selected=fixed is None or fixed not in lrs)
    return out


def personalize_client(cid: str, data: Any, trainer: Any, payload: Any,
                       sizes: Mapping[str, float], lrs: list[float], epochs: int, opt: OptimConfig,
                       device: Any, last_round: int, progress: PhaseProgress) -> dict[str, Any]:
    """One new client's fits: each of the method's modes, each train-split size, each lr."""
    split = data.new_clients[cid]
    per_mode: dict[str, Any] = {}
    for mode in trainer.new_client_modes():
        for size, share in sizes.items():
            part = subset_train(split, float(share), trainer.settings.run.seed)
            for lr in lrs:
                rnd = ClientRound(settings=trainer.settings, client_id=cid, data=part, num_classes=data.num_classes,
                                  input_shape=data.input_shape, device=device, server_round=last_round + 1)
                model, trainable = trainer.new_client_model(rnd, payload, mode)
                curve = personalize_curve(model, rnd, trainable, dataclasses.replace(opt, lr=lr), epochs,
                                          trainer.new_client_lr_scales())
                per_mode.setdefault(mode, {}).setdefault(size, {})[str(lr)] = {
                    **last_and_best(curve), "num_train": len(part.train),
                    "test_curve": [c["accuracy"] for c in curve]}
                progress.step(f"client {cid}, {mode} {size} lr {lr}")
    return {"domain": split.domain, "results": per_mode}


def adapt_run(run_dir: str | Path, init: str = "mean", epochs: int | None = None, lr: float | None = None,
              adapt_on: str | None = None, clients: list[str] | None = None) -> dict[str, dict[str, float]]:
    """The label-free mode (``--adapt``, FDSE's Algorithm 3): each held-out client adapts the
    run's final server state with its method's ``adapt_new_client`` (other methods refuse).
    Returns ``{client: metrics}`` and writes ``<run>/unseen_adaptation.json``."""
    run = Path(run_dir)
    finished = load_finished_run(run)
    cfg, typed = finished.cfg, finished.settings
    last_round, groups, _ = load_checkpoint(run, {"strategy": cfg.strategy.name})
    trainer = trainer_class(typed.method)(cfg, typed)
    data = load_federated_data(cfg.dataset, typed.run.seed)
    if not data.new_clients:
        raise ValueError(f"dataset {cfg.dataset.name!r} of {run} has no held-out clients; run with "
                         "dataset.new_clients_per_domain >= 1 (or dataset.heldout_domains)")
    settings = {"init": init, "epochs": epochs, "lr": lr, "adapt_on": adapt_on}
    device = resolve_device(typed.run.device)
    results: dict[str, dict[str, float]] = {}
    for cid in clients or sorted(data.new_clients, key=client_sort_key):
        rnd = ClientRound(settings=typed, client_id=cid, data=data.new_clients[cid], num_classes=data.num_classes,
                          input_shape=data.input_shape, device=device, server_round=last_round + 1)
        res: dict[str, Any] = trainer.adapt_new_client(rnd, groups, settings)
        res["domain"] = data.new_clients[cid].domain
        results[cid] = res
    (run / "unseen_adaptation.json").write_text(json.dumps({"settings": settings, "clients": results}, indent=2))
    return results


def summarise(results: Mapping[str, Any]) -> dict[str, Any]:
    """Mean and min over new clients of last and best accuracy, per mode, size and lr."""
    table: dict[str, Any] = {}
    cells: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for r in results.values():
        for mode, by_size in r["results"].items():
            for size, by_lr in by_size.items():
                for lr, m in by_lr.items():
                    cells.setdefault((mode, size, lr), []).append(m)
    for (mode, size, lr), ms in cells.items():
        last = np.array([m["last_accuracy"] for m in ms])
        best = np.array([m["best_accuracy"] for m in ms])
        val = np.array([m["best_val_accuracy"] for m in ms])
        table.setdefault(mode, {}).setdefault(size, {})[lr] = {
            "last_mean": float(last.mean()), "last_min": float(last.min()),
            "best_mean": float(best.mean()), "best_min": float(best.min()),
            "best_val_mean": float(val.mean()), "clients": len(ms)}
    return table


def select_lr(by_lr: Mapping[str, Mapping[str, float]]) -> str:
    """FedBasis' Table 2: the learning rate "selected from {0.005, 0.01, 0.05}", here by the new
    clients' mean validation accuracy at their best epoch (test data never choose it; the
    first listed wins a tie)."""
    return max(by_lr, key=lambda lr: (by_lr[lr]["best_val_mean"], -list(by_lr).index(lr)))


def update_summary(run: Path, table: Mapping[str, Any], mode: str, lr: str, size: str,
                   selected: bool = False) -> None:
    path = run / "summary.json"
    if not path.exists():
        return
    cell = table.get(mode, {}).get(size, {}).get(lr)
    summary = json.loads(path.read_text())
    summary["new_clients"] = table
    if cell is not None:
        summary.update({"new_client_accuracy_mean": cell["last_mean"], "new_client_accuracy_min": cell["last_min"],
                        "new_client_accuracy_best_mean": cell["best_mean"],
                        "new_client_accuracy_best_min": cell["best_min"],
                        "new_client_protocol": {"mode": mode, "lr": float(lr), "size": size,
                                                "lr_selected_by": "validation" if selected else "fixed"}})
    path.write_text(json.dumps(summary, indent=2))


def _sizes(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        name, _, share = item.partition("=")
        try:
            out[name.strip()] = float(share)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"--sizes takes NAME=SHARE,... (e.g. S=0.5,M=1), got {text!r}") from err
        if not 0 < out[name.strip()] <= 1:
            raise argparse.ArgumentTypeError(f"--sizes: a share is a fraction of the train split in (0, 1], got {item!r}")
    return out


def cmd_personalize(args: argparse.Namespace) -> int:
    if getattr(args, "adapt", False):
        return cmd_adapt(args)
    for run in args.runs:
        try:
            out = personalize_run(run, lrs=args.lr, sizes=args.sizes, epochs=args.epochs)
        except (FileNotFoundError, ValueError, KeyError, CheckpointError) as err:
            print(f"pflower personalize: {run}: {err}", file=sys.stderr)
            return 2
        print(f"{run}: new clients, test accuracy last / best-by-validation (mean over {len(out['clients'])} clients)")
        for mode, by_size in out["summary"].items():
            for size, by_lr in by_size.items():
                cells = "  ".join(f"lr {lr}: {m['last_mean']:.4f} / {m['best_mean']:.4f}" for lr, m in by_lr.items())
                print(f"  {mode:6s} {size:3s} {cells}")
    return 0


def cmd_adapt(args: argparse.Namespace) -> int:
    lr = args.lr[0] if isinstance(args.lr, list) else args.lr
    for run in args.runs:
        try:
            res = adapt_run(run, init=args.init, epochs=args.epochs, lr=lr, adapt_on=args.adapt_on)
        except (FileNotFoundError, ValueError, KeyError, CheckpointError) as err:
            print(f"pflower personalize --adapt: {run}: {err}", file=sys.stderr)
            return 2
        print(f"{run}: label-free adaptation of the held-out clients, test accuracy")
        for cid, m in res.items():
            print(f"  {cid} ({m['domain']}): init {m['acc_init']:.4f}  before {m['acc_before']:.4f}"
                  f"  after {m['acc_after']:.4f}")
        accs = {k: float(np.mean([m[k] for m in res.values()])) for k in ("acc_init", "acc_before", "acc_after")}
        print(f"  mean: init {accs['acc_init']:.4f}  before {accs['acc_before']:.4f}  after {accs['acc_after']:.4f}")
    return 0


def _adapt_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", default="mean", choices=("mean", "initial"),
                   help="--adapt: personal tensors from the mean of the clients' or the initial ones")
    p.add_argument("--on", dest="adapt_on", default=None, choices=("train", "test"),
                   help="--adapt: adapt on the unlabeled train split (default) or the test split")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("personalize", help="personalise a finished run's new clients (FedBasis' protocol; "
                                           "--adapt: FDSE's label-free adaptation)")
    p.add_argument("runs", nargs="+", help="run folders (with config.yaml and checkpoint/)")
    p.add_argument("--adapt", action="store_true",
                   help="label-free adaptation (FDSE, Algorithm 3) instead of supervised personalisation")
    p.add_argument("--lr", type=float, nargs="+", default=None, help="learning rates (default: personalize.lrs; "
                   "--adapt: one, default strategy.adapt_lr)")
    p.add_argument("--sizes", type=_sizes, default=None, help="train-split shares, e.g. S=0.5,M=1")
    p.add_argument("--epochs", type=int, default=None)
    _adapt_options(p)
    p.set_defaults(func=cmd_personalize)
    # `pflower adapt RUN` = `pflower personalize --adapt RUN` (the older command)
    a = sub.add_parser("adapt", help="= personalize --adapt (FDSE: adapt a finished run to its held-out clients)")
    a.add_argument("runs", nargs="+", help="run folders (with config.yaml and checkpoint/)")
    a.add_argument("--epochs", type=int, default=None)
    a.add_argument("--lr", type=float, default=None)
    _adapt_options(a)
    a.set_defaults(func=cmd_adapt)
