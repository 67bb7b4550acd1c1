"""Index-level partitioning: which sample goes to which client, and to which split.

Partitioning works on label arrays only, so it is cheap, testable and identical on the
server and every client (same seed -> same partition). The label-skew schemes use
flwr-datasets partitioners applied to a local `datasets.Dataset` (they work offline).
"""

from __future__ import annotations

import numpy as np

PARTITION_SCHEMES = ("iid", "dirichlet", "shard")


class PartitionError(ValueError):
    """A partition could not be built as configured (the message says how to fix it)."""


def _labels_dataset(labels: np.ndarray):  # noqa: ANN202 - datasets.Dataset
    from datasets import Dataset

    return Dataset.from_dict(
        {"label": labels.astype(np.int64).tolist(), "idx": np.arange(len(labels)).tolist()}
    )


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str,
    seed: int,
    dirichlet_alpha: float = 0.5,
    shards_per_client: int = 2,
    min_partition_size: int = 10,
) -> list[np.ndarray]:
    """Split sample indices ``0..len(labels)-1`` into ``num_partitions`` disjoint sets.

    - ``iid``: uniform random split.
    - ``dirichlet``: per-class proportions drawn from Dir(alpha) (Hsu et al., 2019), via
      flwr-datasets' ``DirichletPartitioner`` (resamples until every partition has at
      least ``min_partition_size`` samples).
    - ``shard``: sort by label, cut into ``num_partitions * shards_per_client`` equal
      shards, deal ``shards_per_client`` to each client (McMahan et al., 2017; the
      FedBABU non-IID setting), via flwr-datasets' ``ShardPartitioner``.

    Every index lands in at most one partition; ``iid`` and ``dirichlet`` use all of them,
    ``shard`` drops the incomplete last shard, as the paper's protocol does.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if num_partitions < 1:
        raise PartitionError(f"num_partitions must be >= 1, got {num_partitions}")
    if scheme not in PARTITION_SCHEMES:
        raise PartitionError(
            f"unknown partition scheme {scheme!r}; valid: {', '.join(PARTITION_SCHEMES)}"
        )
    if n < num_partitions * 3:
        raise PartitionError(
            f"{n} samples cannot give {num_partitions} clients a train/val/test split each; "
            "use fewer clients per domain or more data"
        )
    if num_partitions == 1:
        return [np.random.default_rng(seed).permutation(n)]
    if scheme == "iid":
        perm = np.random.default_rng(seed).permutation(n)
        return [np.sort(p) for p in np.array_split(perm, num_partitions)]

    from flwr_datasets.partitioner import DirichletPartitioner, ShardPartitioner

    if scheme == "dirichlet":
        if dirichlet_alpha <= 0:
            raise PartitionError(f"dirichlet_alpha must be > 0, got {dirichlet_alpha}")
        min_size = min(min_partition_size, max(3, n // (2 * num_partitions)))
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=float(dirichlet_alpha),
            min_partition_size=min_size,
            self_balancing=False,
            seed=seed,
        )
    else:
        if shards_per_client < 1:
            raise PartitionError(f"shards_per_client must be >= 1, got {shards_per_client}")
        if n < num_partitions * shards_per_client * 3:
            raise PartitionError(
                f"{n} samples are too few for {num_partitions} clients x {shards_per_client} "
                "shards; lower shards_per_client or the number of clients"
            )
        partitioner = ShardPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_shards_per_partition=int(shards_per_client),
            seed=seed,
        )
    partitioner.dataset = _labels_dataset(labels)
    try:
        parts = [
            np.sort(np.asarray(partitioner.load_partition(i)["idx"], dtype=np.int64))
            for i in range(num_partitions)
        ]
    except ValueError as err:  # flwr-datasets gives up when it cannot meet min sizes
        raise PartitionError(
            f"could not partition {n} samples into {num_partitions} clients with scheme "
            f"{scheme!r}: {err}. Raise dirichlet_alpha or use fewer clients."
        ) from err
    return parts


def split_train_val_test(
    indices: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle one client's indices and cut them into train/val/test (each non-empty)."""
    if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise PartitionError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} must be in (0, 1) "
            "and sum to less than 1"
        )
    n = len(indices)
    if n < 3:
        raise PartitionError(
            f"a client has only {n} samples; it needs at least 3 for train/val/test. "
            "Use fewer clients, a larger dirichlet_alpha, or more data"
        )
    perm = np.random.default_rng(seed).permutation(indices)
    n_val = max(1, int(round(n * val_fraction)))
    n_test = max(1, int(round(n * test_fraction)))
    n_train = n - n_val - n_test
    if n_train < 1:
        n_train, n_val = 1, n - 1 - n_test
    return perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]


def split_among_domains(n: int, num_domains: int, seed: int) -> list[np.ndarray]:
    """Disjoint random split of ``n`` samples into one pool per synthetic domain.

    Used when several domains are made from one dataset by transforms, so that no sample
    appears (transformed) in two domains.
    """
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(p) for p in np.array_split(perm, num_domains)]


def pflbed_split(labels: np.ndarray, num_clients: int, num_new: int, val_fraction: float,
                 test_fraction: float, dirichlet_alpha: float, seed: int, new_fraction: float = 0.2
                 ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, np.ndarray]:
    """One domain under PFLBED (FedBasis, Sec. 5): ``(client trains, new-client trains,
    shared val, shared test)``, indices into ``labels``.

    First a class-balanced test set and validation set, shared by every client of the
    domain (per class ``round(fraction x n / classes)`` samples, fewer where a class has
    fewer); the rest is split, class-stratified, between participating and new clients, the
    new clients getting ``new_fraction`` of the whole domain (the paper's 60/20/5/15:
    participating/new/validation/test, so 0.2), and each part across its clients by
    Dirichlet(alpha) over classes (flwr-datasets, via :func:`partition_indices`)."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    n = len(labels)
    per_test = max(1, int(round(test_fraction * n / len(classes))))
    per_val = max(1, int(round(val_fraction * n / len(classes))))
    test, val, rest = [], [], []
    for c in classes:
        idx = rng.permutation(np.flatnonzero(labels == c))
        t = min(per_test, max(0, len(idx) - 2))
        v = min(per_val, max(0, len(idx) - t - 1))
        test.append(idx[:t])
        val.append(idx[t:t + v])
        rest.append(idx[t + v:])
    rest_fraction = 1.0 - val_fraction - test_fraction
    if num_new > 0 and not 0.0 < new_fraction < rest_fraction:
        raise PartitionError(f"the new clients' share of a domain must be in (0, {rest_fraction:g}) (what validation "
                             f"and test leave), got {new_fraction}; set dataset.pflbed_new_fraction")
    new_share = new_fraction / rest_fraction if num_new > 0 else 0.0   # of what the val and test sets leave
    part_pool, new_pool = [], []
    for idx in rest:
        k = int(round(new_share * len(idx)))
        new_pool.append(idx[:k])
        part_pool.append(idx[k:])

    def spread(pool: list[np.ndarray], count: int, salt: int) -> list[np.ndarray]:
        if count == 0:
            return []
        ids = np.sort(np.concatenate(pool))
        parts = partition_indices(labels[ids], count, "dirichlet", seed=seed + salt,
                                  dirichlet_alpha=dirichlet_alpha)
        return [ids[p] for p in parts]

    return (spread(part_pool, num_clients, 1), spread(new_pool, num_new, 2),
            np.sort(np.concatenate(val)), np.sort(np.concatenate(test)))


def fedora_rotated_split(num_train_pool: int, num_test_pool: int, num_clients: int, train_per_client: int,
                         val_per_client: int, seed: int, big: int = -1, factor: int = 1,
                         val_pool: int = 10_000) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """FEDORA's rotated-dataset split, as its authors' loader builds it (junwu6/FEDORA,
    ``utils/load_rotate_mnist.py``): per client (train, validation, test) indices, the first
    two into the source's training set, the third into its test set.

    With ``np.random.seed(seed)`` as their ``set_seed`` leaves it, the training set's indices
    are shuffled once (validation = the last ``val_pool`` of them), then the test set's; client
    ``i`` takes the next ``train_per_client`` training and ``val_per_client`` validation indices
    in turn, and test slice ``i`` of ``num_test_pool // num_clients``. Client ``big`` takes
    ``factor`` times the training and validation indices (their imbalanced setting: the last
    client, 100 x, in the code). The same ``RandomState`` calls give the same indices as theirs.
    """
    rs = np.random.RandomState(seed)
    ridx = np.arange(num_train_pool)
    rs.shuffle(ridx)
    train_ridx, val_ridx = ridx[:-val_pool], ridx[-val_pool:]
    test_ridx = np.arange(num_test_pool)
    rs.shuffle(test_ridx)
    num_test = num_test_pool // num_clients
    out, start_train, start_val = [], 0, 0
    for i in range(num_clients):
        scale = factor if i == big else 1
        n_train, n_val = train_per_client * scale, val_per_client * scale
        if start_train + n_train > len(train_ridx) or start_val + n_val > len(val_ridx):
            raise PartitionError(f"{num_clients} clients of {train_per_client}/{val_per_client} training/validation "
                                 f"samples (x{factor} for client {big}) need more than the {len(train_ridx)} training "
                                 f"and {len(val_ridx)} validation samples of the pool")
        out.append((train_ridx[start_train:start_train + n_train], val_ridx[start_val:start_val + n_val],
                    test_ridx[num_test * i:num_test * (i + 1)]))
        start_train, start_val = start_train + n_train, start_val + n_val
    return out
