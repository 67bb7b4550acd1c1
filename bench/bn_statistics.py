"""A finished run's personal models with their stored BatchNorm statistics and with statistics
recomputed on each client's own train split (a diagnostic; not CI).

    python3 -m bench.bn_statistics RUN --prefix personal/     # Ditto's personal model v
    python3 -m bench.bn_statistics RUN --prefix model/        # PartialFed's, FEDORA's model

Why: a model whose weights are moved between its training steps and its evaluation without its
data going through it (Ditto's v pulled towards a new global model every round, PartialFed's
soft mix of global and local weights, whose running statistics are mixed with the global
model's average over domains) is evaluated with BN running statistics that are not its own.
On a feature-shift tree that alone can put a client far below training alone while its training
loss is low. The weights are left as stored; only the running statistics are recomputed (a
cumulative average over one pass of the train split in train mode, no gradient), so a gap
between the two columns is the statistics' share of the client's accuracy. A run with
``eval_bn_statistics=recompute`` evaluates its clients this way itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from client.state import VERSION_RE
from learning.data import load_federated_data
from learning.models import build_model
from learning.params import set_arrays
from learning.storage import load_arrays_file
from learning.training import evaluate, recompute_bn_statistics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a finished run folder (config.yaml, client_state/)")
    parser.add_argument("--prefix", default="model/", help="the state prefix of the evaluated model")
    args = parser.parse_args(argv)
    cfg = yaml.safe_load((args.run / "config.yaml").read_text())
    state_root = Path(cfg.get("state_root") or args.run / "client_state")
    data = load_federated_data(cfg["dataset"], int(cfg["seed"]))
    device = torch.device("cpu")
    for cid, split in data.clients.items():
        versions = sorted(p for p in (state_root / cid).glob("state-r*.npz") if VERSION_RE.match(p.name))
        if not versions:
            print(f"client {cid}: no saved state under {state_root / cid}")
            continue
        arrays, _ = load_arrays_file(versions[-1])
        own = {k[len(args.prefix):]: v for k, v in arrays.items() if k.startswith(args.prefix)}
        if not own:
            print(f"client {cid}: no arrays with prefix {args.prefix!r} in {versions[-1].name}")
            continue
        model = build_model(cfg["model"], data.input_shape, data.num_classes)
        set_arrays(model, own)
        stored = evaluate(model, split.test, device)["accuracy"]
        model = recompute_bn_statistics(model, split.train, int(cfg["train"]["batch_size"]), device)
        recomputed = evaluate(model, split.test, device)["accuracy"]
        print(f"client {cid} ({split.domain}): test accuracy with its stored BN statistics {stored:.4f}, "
              f"with statistics recomputed on its train split {recomputed:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
