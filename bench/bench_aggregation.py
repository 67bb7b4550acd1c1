"""Aggregation cost per round: FedAvg vs FedAvg with central differential privacy (each
update clipped, the mean noised: ``privacy.dp=central``) vs FDSE's MGDA consensus and
attention vs FEDORA's propagation, for K clients and a model of d parameters (split into
tensors like a CNN's).

    python3 -m bench.bench_aggregation --clients 10 50 --params 1e5 1e6

Prints seconds per aggregation (median of --repeats) and the ratio to FedAvg. The design's
performance model: FedAvg is one memory-bound pass over K x d numbers; the other rules
should stay within a small factor of it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np

from learning.params import weighted_mean
from strategies.fdse_math import attention_mix_many, consensus_update_many
from strategies.fedora_math import propagate_many
from strategies.privacy_math import add_noise, clip_update, noise_std


def private_mean(clients: list[dict[str, np.ndarray]], reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """DP-FedAvg's server work: clip every update (C = 1), the unweighted mean, noise (z = 1)."""
    keys = list(reference)
    clipped = [clip_update(c, reference, keys, 1.0)[0] for c in clients]
    mean = weighted_mean(clipped, [1.0] * len(clipped))
    return add_noise(mean, keys, noise_std(1.0, 1.0, len(clipped)), np.random.default_rng(0))


def make_clients(k: int, d: int, tensors: int = 8, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    sizes = np.full(tensors, d // tensors)
    return [{f"t{i}": rng.normal(size=int(s)).astype(np.float32) for i, s in enumerate(sizes)} for _ in range(k)]


def timeit(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--params", type=float, nargs="+", default=[1e5, 1e6])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("| K | d | FedAvg s | FedAvg + DP s (x) | MGDA consensus s (x) | attention mix s (x) | propagation s (x) |")
    print("|---|---|---|---|---|---|---|")
    for k in args.clients:
        for d in (int(p) for p in args.params):
            clients = make_clients(k, d)
            weights = [1.0] * k
            w = np.random.default_rng(1).random((k, k))
            np.fill_diagonal(w, 0)
            stacked = {key: np.stack([c[key] for c in clients]) for key in clients[0]}
            t_avg = timeit(partial(weighted_mean, clients, weights), args.repeats)
            t_dp = timeit(partial(private_mean, clients, make_clients(1, d, seed=2)[0]), args.repeats)
            t_mgda = timeit(partial(consensus_update_many, clients), args.repeats)
            t_att = timeit(partial(attention_mix_many, clients, 0.5), args.repeats)
            t_prop = timeit(partial(propagate_many, stacked, w, 4.0), args.repeats)
            print(f"| {k} | {d:.0e} | {t_avg:.4f} | {t_dp:.4f} ({t_dp / t_avg:.1f}) | {t_mgda:.4f} ({t_mgda / t_avg:.1f}) | "
                  f"{t_att:.4f} ({t_att / t_avg:.1f}) | {t_prop:.4f} ({t_prop / t_avg:.1f}) |")


if __name__ == "__main__":
    main()
