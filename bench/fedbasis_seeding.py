"""FedBasis' K-means seeding at the paper's size (not CI): can the seeding round run here?

    python3 -m bench.fedbasis_seeding [--clients 80] [--k 4]

Builds ``--clients`` ResNet-18 state dicts (7 classes, d = 11.2M; four planted groups of
clients around one random initialisation), seeds ``--k`` bases from them with
``strategies.fedbasis_math.seed_bases`` (K-means), and prints the seconds, this process's
peak resident memory (the models themselves included) and the cluster sizes.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    import torchvision

    from strategies.fedbasis_math import seed_bases

    parser = argparse.ArgumentParser(prog="python3 -m bench.fedbasis_seeding", description=__doc__)
    parser.add_argument("--clients", type=int, default=80)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args(argv)
    base = {k: v.detach().numpy().copy() for k, v in torchvision.models.resnet18(num_classes=7).state_dict().items()}
    floating = [k for k, v in base.items() if np.issubdtype(v.dtype, np.floating)]
    d = sum(base[k].size for k in floating)
    rng = np.random.default_rng(0)
    models = []
    for i in range(args.clients):
        shift = 0.05 * (i % args.k)
        models.append({k: (v + rng.normal(0, 0.01, v.shape).astype(v.dtype) + shift) if k in floating else v.copy()
                       for k, v in base.items()})
    t0 = time.perf_counter()
    _, assignment = seed_bases(models, args.k, "kmeans", seed=0)
    seconds = time.perf_counter() - t0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{args.clients} ResNet-18 models (d = {d:,}), K = {args.k}: seeding {seconds:.1f} s, peak RSS "
          f"{peak_gb:.2f} GB (models {args.clients * d * 4 / 1e9:.2f} GB), cluster sizes "
          f"{sorted(np.bincount(assignment).tolist())}")


if __name__ == "__main__":
    main()
