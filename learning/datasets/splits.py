"""How a domain's samples become its clients' train/val/test splits: the default per-client
split (``partition`` across the clients, then each client's own three sets), PFLBED's
(FedBasis: own train sets, the domain's shared val and test) and FEDORA's (its authors'
images in order), and FEDORA's imbalanced setting. The index math is
``learning/datasets/partition.py``; this module applies it to a typed dataset config.
"""

from __future__ import annotations

import numpy as np

from learning.datasets.config import DatasetConfig
from learning.datasets.partition import (
    PartitionError,
    partition_indices,
    pflbed_split,
    split_train_val_test,
)
from learning.datasets.sources import DatasetError


def fedora_sizes(cfg: DatasetConfig) -> tuple[int, int]:
    """(training, validation) images per client under ``split=fedora``: ``samples_per_client``
    less its validation and test fractions, and its validation fraction (256 x 50% / 25% =
    the authors' 128 / 64; their test images come from the test set, 10,000 // clients)."""
    n_val = round(cfg.samples_per_client * cfg.val_fraction)
    return cfg.samples_per_client - n_val - round(cfg.samples_per_client * cfg.test_fraction), n_val


def fedora_client_splits(pool_size: int, n_train: int, n_val: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A ``pools.fedora_pools`` pool's one client: its images are train, validation, test in order."""
    return [(np.arange(n_train), np.arange(n_train, n_train + n_val), np.arange(n_train + n_val, pool_size))]


def per_client_splits(cfg: DatasetConfig, labels: np.ndarray, per_domain: int, new_per_domain: int,
                       big: int, factor: int, rng_seed: int, d: int, name: str
                       ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The default split: the domain across its clients (``partition``), then each client's
    samples into its own train/val/test."""
    try:
        parts = partition_indices(
            labels,
            per_domain + new_per_domain,
            scheme=cfg.partition,
            seed=rng_seed + 101 * d,
            dirichlet_alpha=cfg.dirichlet_alpha,
            shards_per_client=cfg.shards_per_client,
        )
    except PartitionError as err:
        raise DatasetError(f"domain {name!r}: {err}") from err
    cap = cfg.samples_per_client
    out = []
    for k, part in enumerate(parts):
        is_big = k < per_domain and d * per_domain + k == big
        limit = cap * factor if (cap and is_big) else cap
        if limit and len(part) > limit:
            part = np.sort(np.random.default_rng(rng_seed + 7 * k + d).permutation(part)[:limit])
        tr, va, te = split_train_val_test(
            part,
            cfg.val_fraction,
            cfg.test_fraction,
            seed=rng_seed + 1000 * d + k,
        )
        if big >= 0 and not cap and not is_big:  # others keep 1/factor of their train split
            tr = tr[: max(1, len(tr) // factor)]
        out.append((tr, va, te))
    return out


def pflbed_splits(cfg: DatasetConfig, labels: np.ndarray, per_domain: int, new_per_domain: int,
                   seed: int, domain: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """PFLBED (FedBasis, Sec. 5): every client of the domain, participating then new, with
    its own Dirichlet train split and the domain's shared class-balanced val and test sets."""
    if cfg.partition != "dirichlet":
        raise DatasetError("dataset.split=pflbed splits clients by Dirichlet over classes; "
                           "set dataset.partition=dirichlet")
    try:
        trains, news, val, test = pflbed_split(
            labels, per_domain, new_per_domain, cfg.val_fraction, cfg.test_fraction, cfg.dirichlet_alpha, seed,
            new_fraction=cfg.pflbed_new_fraction)
    except PartitionError as err:
        raise DatasetError(f"domain {domain!r}: {err}") from err
    return [(tr, val, test) for tr in [*trains, *news]]


def imbalance(cfg: DatasetConfig, num_participating: int) -> tuple[int, int]:
    """(imbalanced_client, imbalance_factor); -1 = balanced (FEDORA's imbalanced setting).

    With ``imbalanced_client: i`` (a participating client index) that client gets
    ``imbalance_factor`` times the data of the others: with ``samples_per_client`` set,
    its pool cap is ``samples_per_client * imbalance_factor`` (train, val and test grow;
    limited by what its partition holds); without a cap, every other client keeps only
    ``1 / imbalance_factor`` of its train split (val and test unchanged).
    """
    big, factor = cfg.imbalanced_client, cfg.imbalance_factor
    if big < -1 or big >= num_participating:
        raise DatasetError(
            f"dataset.imbalanced_client={big} is not a participating client index "
            f"(0..{num_participating - 1}), or -1 for the balanced setting"
        )
    if big >= 0 and factor < 1:
        raise DatasetError(f"dataset.imbalance_factor must be >= 1, got {factor}")
    return big, factor
