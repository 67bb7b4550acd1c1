"""Partitioning invariants: disjoint, non-empty, every training sample in exactly one client."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import compose_config
from learning.datasets.federated import build_federated_data
from learning.datasets.partition import PartitionError, partition_indices, split_train_val_test


def _labels(n=600, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, size=n)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shard"])
def test_partitions_are_disjoint_and_non_empty(scheme):
    labels = _labels()
    parts = partition_indices(labels, 6, scheme, seed=3, dirichlet_alpha=0.3, shards_per_client=2)
    assert len(parts) == 6
    assert all(len(p) > 0 for p in parts)
    flat = np.concatenate(parts)
    assert len(flat) == len(np.unique(flat)), "a sample landed in two partitions"
    if scheme != "shard":
        assert sorted(flat.tolist()) == list(range(len(labels)))


def test_shard_partition_limits_classes_per_client():
    labels = np.repeat(np.arange(10), 60)  # 600 samples, 10 classes
    parts = partition_indices(labels, 10, "shard", seed=0, shards_per_client=2)
    for p in parts:
        # 2 shards of 30 sorted-by-label samples touch at most 2 (+1 at a boundary) classes
        assert len(np.unique(labels[p])) <= 3


def test_dirichlet_skews_labels_more_with_small_alpha():
    labels = _labels(2000)

    def skew(alpha):
        parts = partition_indices(labels, 5, "dirichlet", seed=1, dirichlet_alpha=alpha)
        return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])

    assert skew(0.1) > skew(100.0) + 0.1


def test_partition_is_deterministic_in_seed():
    labels = _labels()
    a = partition_indices(labels, 4, "dirichlet", seed=5)
    b = partition_indices(labels, 4, "dirichlet", seed=5)
    c = partition_indices(labels, 4, "dirichlet", seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_too_many_clients_is_a_clear_error():
    with pytest.raises(PartitionError, match="fewer clients"):
        partition_indices(_labels(20), 10, "iid", seed=0)
    with pytest.raises(PartitionError, match="unknown partition scheme 'bogus'"):
        partition_indices(_labels(), 2, "bogus", seed=0)


def test_train_val_test_split_is_a_partition_of_the_client():
    idx = np.arange(100, 157)
    tr, va, te = split_train_val_test(idx, 0.15, 0.25, seed=0)
    assert min(len(tr), len(va), len(te)) >= 1
    assert sorted(np.concatenate([tr, va, te]).tolist()) == idx.tolist()


@pytest.mark.parametrize("dataset", ["digits-domains", "digits-shards", "digits-rotated"])
def test_every_training_sample_belongs_to_exactly_one_client(dataset):
    cfg = compose_config({"dataset": dataset})
    data = build_federated_data(cfg.dataset, seed=0)
    clients = list(data.clients.values()) + list(data.new_clients.values())
    ids = np.concatenate([c.train_ids for c in clients])
    assert len(ids) == len(np.unique(ids)), "a training sample is shared by two clients"
    all_ids = np.concatenate([np.concatenate([c.train_ids, c.val_ids, c.test_ids]) for c in clients])
    assert len(all_ids) == len(np.unique(all_ids)), "train/val/test overlap across or within clients"
    for c in clients:
        assert min(len(c.train), len(c.val), len(c.test)) > 0, f"client {c.client_id} has an empty split"
    if dataset == "digits-domains":
        assert len(data.clients) == 8 and len(data.new_clients) == 4
        assert {c.domain for c in data.clients.values()} == {"original", "rotate-90", "invert", "noise"}
        assert len(all_ids) == 1797  # dirichlet uses every sample of the bundled digits


def test_domain_transforms_differ_and_are_deterministic():
    cfg = compose_config({})
    a = build_federated_data(cfg.dataset, seed=0)
    b = build_federated_data(cfg.dataset, seed=0)
    xa, _ = a.clients["0"].train[0]
    xb, _ = b.clients["0"].train[0]
    assert np.array_equal(xa.numpy(), xb.numpy())
    # the "invert" domain's images are the negated originals (pixels in [-1, 1])
    inv = next(c for c in a.clients.values() if c.domain == "invert")
    from sklearn.datasets import load_digits

    raw = load_digits().images
    sid = int(inv.train_ids[0])
    x, y = inv.train[0]
    expected = (1.0 - raw[sid] / 16.0 - 0.5) / 0.5
    np.testing.assert_allclose(x.numpy()[0], expected, atol=1e-6)
    assert int(y) == int(load_digits().target[sid])
