"""A finished run's personal models tested with both BN protocols: the statistics they
carry (``stored``) and statistics recomputed on each client's own train split (``own``);
a diagnostic for runs made before every run measured both (not CI).

    python3 -m bench.bn_statistics RUN [RUN ...]

Why: a model whose weights move between its training steps and its evaluation without its
data going through it (Ditto's v pulled towards a new global model, PartialFed's soft mix,
FEDORA's propagated parameters, FedBasis' combination of bases averaged over clients) carries
running statistics that are not those of its weights on its client's data. Since
``eval_bn_statistics``/``eval_bn_compare`` a run reports both itself (``summary.json``'s
``bn_protocols``); this re-evaluates an older run's final state the same way.

The personal model is formed by the method's own code from what the run left: the server's
final checkpoint (its per-client payload, ``Strategy.payload_for``) and each client's newest
private state, through ``ClientTrainer.personal_model`` and ``with_own_bn_statistics``, so
every method's model is read, FedBasis' bases included. Both columns come from the same
weights; only the running statistics differ.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from client.handlers import trainer_class
from client.round import ClientRound
from client.state import ClientStateStore
from common.config import load_finished_run
from learning.datasets.federated import load_federated_data
from learning.training import evaluate
from server.app import build_strategy
from server.checkpoint import CHECKPOINT, load_checkpoint


def both_protocols(run: Path) -> dict[str, dict[str, float]]:
    """``{client: {"stored": acc, "own": acc}}`` of the run's final personal models (test split)."""
    finished = load_finished_run(run)
    cfg, settings = finished.cfg, finished.settings
    last, groups, meta = load_checkpoint(run, {"strategy": settings.strategy})
    groups.pop("_rng", None)
    data = load_federated_data(cfg.dataset, settings.run.seed)
    strategy = build_strategy(cfg, data)
    strategy.load_state(groups, meta.get("strategy_state", {}))
    trainer = trainer_class(settings.method)(cfg, settings)
    state_root = Path(settings.run.state_root or run / "client_state")
    device = torch.device("cpu")
    out: dict[str, dict[str, float]] = {}
    for cid in data.client_ids:
        rnd = ClientRound(settings=settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                          input_shape=data.input_shape, device=device, server_round=last + 1)
        state, _ = ClientStateStore(state_root / cid).load(max_round=last)
        payload = trainer.receive(rnd, strategy.payload_for(cid), state)
        model = trainer.personal_model(rnd, payload, state)
        weights = rnd.data.class_weights
        out[cid] = {"stored": evaluate(model, rnd.data.test, device, class_weights=weights)["accuracy"],
                    "own": evaluate(trainer.with_own_bn_statistics(model, rnd), rnd.data.test, device,
                                    class_weights=weights)["accuracy"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="finished run folders (config.yaml, checkpoint/, "
                        "client_state/)")
    args = parser.parse_args(argv)
    for run in args.runs:
        if not (run / "config.yaml").exists() or not (run / CHECKPOINT).exists():
            parser.error(f"{run} is not a finished run folder (it needs config.yaml and checkpoint/, "
                         "as pflower run writes with checkpoint_every >= 1)")
    print("| run | stored: mean (worst) | own: mean (worst) | per client, stored -> own |")
    print("|---|---|---|---|")
    for run in args.runs:
        acc = both_protocols(run)
        stored, own = (np.array([a[p] for a in acc.values()]) for p in ("stored", "own"))
        clients = ", ".join(f"{c}: {a['stored']:.3f} -> {a['own']:.3f}" for c, a in acc.items())
        print(f"| {run.name} | {stored.mean():.4f} ({stored.min():.4f}) | {own.mean():.4f} ({own.min():.4f}) "
              f"| {clients} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
