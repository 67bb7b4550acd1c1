"""The source registry: for each ``dataset.source``, how its samples become one pool per
configured domain (:class:`Pools`), and the typed reader of the dataset config that checks the
source against it.

Adding a source: its loader in ``learning/datasets/sources.py``, its line in :data:`SOURCES`
(and its name in :data:`BUNDLED_SOURCES` when it comes with the packages), and its
``conf/dataset/<name>.yaml`` (docs/architecture.md, "Adding a data source").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from learning.datasets.config import DatasetConfig
from learning.datasets.partition import PartitionError, fedora_rotated_split, split_among_domains
from learning.datasets.sources import (
    DatasetError,
    SyntheticImages,
    apply_domain_transform,
    digit_source_pools,
    image_transform,
    imagefolder_domains,
    load_digits,
    load_mnist5k,
    load_torchvision,
    load_torchvision_sets,
    normalise,
)
from learning.datasets.splits import fedora_sizes, imbalance
from learning.registry import Registry
from learning.typed import check, one_of, read_typed


@dataclass
class Pools:
    """A source's samples for the configured domains: one (dataset, labels) pool per domain,
    the ids of each pool's samples in the source (unique over all domains), the classes and
    the input shape."""

    pools: list[tuple[Dataset, np.ndarray]]
    global_ids: list[np.ndarray]
    num_classes: int
    input_shape: tuple[int, int, int]
    train_pools: list[Dataset] | None = None   # the same samples read for training, where that differs


def _imagefolder_pools(cfg: DatasetConfig, domains: list[str], rng_seed: int) -> Pools:
    folders, classes = imagefolder_domains(cfg.root, domains, cfg.image_size, cfg.preprocess)
    offsets = np.cumsum([0] + [len(f) for f in folders])
    train = None
    if cfg.preprocess != "plain":
        train_transform = image_transform(cfg.image_size, cfg.preprocess, train=True)
        train = [f.with_transform(train_transform) for f in folders]
    return Pools([(f, f.targets) for f in folders], [np.arange(len(f)) + offsets[d] for d, f in enumerate(folders)],
                 len(classes), (3, cfg.image_size, cfg.image_size), train)


def _digit_sources_pools(cfg: DatasetConfig, domains: list[str], rng_seed: int) -> Pools:
    pools, ids = [], []
    for x, y, sample_ids in digit_source_pools(domains, rng_seed):
        pools.append((TensorDataset(normalise(x, cfg.input_range), torch.as_tensor(y)), y))
        ids.append(sample_ids)
    return Pools(pools, ids, 10, (3, 28, 28))


def _array_pools(load: Callable[[DatasetConfig], tuple[torch.Tensor, np.ndarray]],
                 num_classes: int | None = None) -> Callable[[DatasetConfig, list[str], int], Pools]:
    """A source of one array of images (N, C, H, W) in [0, 1]: split disjointly among the
    domains, each domain's share transformed by its domain transform."""

    def pools(cfg: DatasetConfig, domains: list[str], rng_seed: int) -> Pools:
        x, y = load(cfg)
        if cfg.image_size and cfg.image_size != x.shape[-1]:
            import torch.nn.functional as F

            x = F.interpolate(x, size=(cfg.image_size, cfg.image_size), mode="bilinear", align_corners=False)
        out, ids = [], []
        for d, (name, idx) in enumerate(zip(domains, split_among_domains(len(y), len(domains), rng_seed),
                                            strict=True)):
            xd = apply_domain_transform(x[idx], name, seed=rng_seed + d)
            out.append((TensorDataset(normalise(xd, cfg.input_range), torch.as_tensor(y[idx])), y[idx]))
            ids.append(np.asarray(idx))
        return Pools(out, ids, num_classes or int(y.max()) + 1, (int(x.shape[1]), int(x.shape[2]), int(x.shape[3])))

    return pools


def fedora_pools(cfg: DatasetConfig, domains: list[str], seed: int) -> Pools:
    """``split=fedora``: FEDORA's rotated datasets as its authors' loader builds them
    (``learning/datasets/partition.py: fedora_rotated_split``): domain ``i`` is client ``i``, its pool
    its training, validation and test images in that order, rotated by the domain's angle with
    nearest-neighbour interpolation (torchvision's default ``rotate``, theirs). The sample ids
    are the training set's indices, then the test set's offset by its size."""
    (x_train, y_train), (x_test, y_test) = load_torchvision_sets(cfg.source, cfg.root)
    n_train, n_val = fedora_sizes(cfg)
    big, factor = imbalance(cfg, len(domains))
    try:
        splits = fedora_rotated_split(len(y_train), len(y_test), len(domains), n_train, n_val, seed, big, factor,
                                      val_pool=len(y_train) // 6)   # theirs: 10,000 of 60,000
    except PartitionError as err:
        raise DatasetError(f"dataset {cfg.name!r} (split=fedora): {err}") from err
    pools, ids = [], []
    for name, (tr, va, te) in zip(domains, splits, strict=True):
        x = apply_domain_transform(torch.cat([x_train[tr], x_train[va], x_test[te]]), name, seed,
                                   interpolation="nearest")
        y = np.concatenate([y_train[tr], y_train[va], y_test[te]])
        pools.append((TensorDataset(normalise(x, cfg.input_range), torch.as_tensor(y)), y))
        ids.append(np.concatenate([tr, va, len(y_train) + te]))
    return Pools(pools, ids, 10, (int(x_train.shape[1]), int(x_train.shape[2]), int(x_train.shape[3])))


BUNDLED_SOURCES = ("digits", "mnist5k", "digit-sources")   # read no dataset.root
SourcePools = Callable[[DatasetConfig, list[str], int], Pools]   # (config, domains, seed) -> pools
SOURCES: Registry[SourcePools] = Registry("dataset source", DatasetError)
SOURCES.add("digits", _array_pools(lambda cfg: load_digits(), 10))
SOURCES.add("mnist5k", _array_pools(lambda cfg: load_mnist5k(), 10))
SOURCES.add("digit-sources", _digit_sources_pools)
SOURCES.add("mnist", _array_pools(lambda cfg: load_torchvision("mnist", cfg.root), 10))
SOURCES.add("fashion-mnist", _array_pools(lambda cfg: load_torchvision("fashion-mnist", cfg.root), 10))
SOURCES.add("cifar10", _array_pools(lambda cfg: load_torchvision("cifar10", cfg.root), 10))
SOURCES.add("cifar100", _array_pools(lambda cfg: load_torchvision("cifar100", cfg.root), 100))
SOURCES.add("imagefolder", _imagefolder_pools)


def synthetic_pools(cfg: DatasetConfig, domains: list[str], rng_seed: int) -> Pools:
    """``dataset.synthetic=true``: each domain a :class:`SyntheticImages` of the configured real
    size (``synthetic_samples``), classes balanced and shuffled."""
    counts = list(cfg.synthetic_samples)
    if len(counts) == 1 and len(domains) > 1:   # one total, split among the domains as the array sources do
        counts = [len(idx) for idx in split_among_domains(counts[0], len(domains), rng_seed)]
    side = cfg.image_size or cfg.synthetic_size
    shape = (cfg.synthetic_channels, side, side)
    pools, ids, offset = [], [], 0
    for d, n in enumerate(counts):
        labels = np.random.default_rng(rng_seed + d).permutation(np.arange(n) % cfg.synthetic_classes)
        ds = SyntheticImages(labels, cfg.synthetic_classes, shape, d, rng_seed)
        pools.append((ds, ds.targets))
        ids.append(np.arange(n) + offset)
        offset += n
    return Pools(pools, ids, cfg.synthetic_classes, shape)




def dataset_config(cfg: Mapping[str, Any]) -> DatasetConfig:
    """The typed dataset config: an unknown, missing or out-of-range key (``DatasetConfig``), then
    a source not in :data:`SOURCES` or a ``root`` given to one that comes with the packages,
    names itself."""
    typed = read_typed(DatasetConfig, cfg, "dataset", "conf/dataset/{name}.yaml", DatasetError)
    one_of("dataset.source", typed.source, tuple(SOURCES), DatasetError)
    check(not typed.root or typed.source not in BUNDLED_SOURCES,
          f"dataset.root={typed.root!r} is not read by dataset {typed.name!r}: its data ({typed.source}) come "
          "with the packages; for your own image tree use dataset=imagefolder dataset.root=...", DatasetError)
    return typed
