"""Federated datasets: the typed dataset config, the source registry, and each client's
train/val/test split (the images themselves come from ``learning/sources.py``).

A dataset config (``conf/dataset/*.yaml``) names a ``source`` and a list of ``domains``.
Sources:
- ``digits``: scikit-learn's bundled handwritten digits (1,797 8x8 images; no download).
- ``mnist`` / ``fashion-mnist`` / ``cifar10`` / ``cifar100``: torchvision datasets read
  from ``root`` (never downloaded here; the error names the expected files).
- ``imagefolder``: a multi-domain tree ``root/<domain>/<class>/<image>`` (PACS,
  Office-Home, Office-Caltech10, DomainNet layouts).

For a single-image-set source the samples are first split disjointly among the domains,
then each domain's pool is transformed by its fixed domain transform (``rotate-90``,
``invert``, ``noise``, ...). Each domain pool is partitioned across
``clients_per_domain + new_clients_per_domain`` clients (label skew via flwr-datasets),
and every client's samples are cut into train/val/test. So every training sample belongs
to exactly one client. Client ids are ``"0".."N-1"`` (the simulation partition ids) for
participating clients and ``"new-0"..`` for held-out new clients.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from learning.partition import (
    PARTITION_SCHEMES,
    PartitionError,
    fedora_rotated_split,
    partition_indices,
    pflbed_split,
    split_among_domains,
    split_train_val_test,
)
from learning.sources import (
    AUGMENTS,
    INPUT_RANGES,
    PREPROCESSING,
    CropFlip,
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
    subfolders,
)
from learning.typed import check, finite, one_of, read_typed


@dataclass
class ClientSplit:
    """One client's data: its own train, validation and test sets."""

    client_id: str
    domain: str
    train: Dataset
    val: Dataset
    test: Dataset
    train_ids: np.ndarray = field(repr=False)   # global sample ids (unique across domains)
    val_ids: np.ndarray = field(repr=False)
    test_ids: np.ndarray = field(repr=False)
    # PFLBED: the client's train label distribution P_m(y); accuracy on the shared test
    # set then weighs each sample by P_m(y_i) (FedBasis, Sec. 5). None = plain accuracy.
    class_weights: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_train(self) -> int:
        return len(self.train)


@dataclass
class FederatedData:
    """All clients of one dataset config. Built identically on every process."""

    name: str
    num_classes: int
    input_shape: tuple[int, int, int]
    clients: dict[str, ClientSplit]
    new_clients: dict[str, ClientSplit]

    @property
    def client_ids(self) -> list[str]:
        return list(self.clients)

    def client(self, client_id: str) -> ClientSplit:
        if client_id in self.clients:
            return self.clients[client_id]
        if client_id in self.new_clients:
            return self.new_clients[client_id]
        raise DatasetError(
            f"client id {client_id!r} is not in dataset {self.name!r}, which has clients "
            f"{self.client_ids[0]}..{self.client_ids[-1]} and new clients "
            f"{list(self.new_clients)}; check num-partitions / partition-id / client-id"
        )


# --------------------------------------------------------------------------- building


def _freeze(cfg: Mapping[str, Any]) -> str:
    return json.dumps(dict(cfg), sort_keys=True, default=str)


def load_federated_data(dataset_cfg: Mapping[str, Any], seed: int) -> FederatedData:
    """Build (and cache per process) the federated dataset of a config."""
    return _load_federated_data_cached(_freeze(_plain(dataset_cfg)), int(seed))


def _plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


@functools.lru_cache(maxsize=4)
def _load_federated_data_cached(frozen: str, seed: int) -> FederatedData:
    cfg = json.loads(frozen)
    return build_federated_data(cfg, seed)


def held_out_domains(dataset_cfg: Mapping[str, Any]) -> set[str]:
    """``dataset.heldout_domains``: domains none of the training clients has (FDSE's
    leave-one-domain-out test): all their clients are held-out new clients."""
    heldout = {str(d) for d in dataset_cfg["heldout_domains"]}
    unknown = sorted(heldout - {str(d) for d in dataset_cfg["domains"]})
    if unknown:
        raise DatasetError(f"dataset.heldout_domains {unknown} are not among dataset.domains "
                           f"{list(dataset_cfg['domains'])}")
    if heldout and len(heldout) == len(dataset_cfg["domains"]):
        raise DatasetError("dataset.heldout_domains holds out every domain; keep at least one for training")
    return heldout


def num_clients(dataset_cfg: Mapping[str, Any]) -> int:
    """Number of participating clients of a dataset config, without loading any data."""
    kept = len(dataset_cfg["domains"]) - len(held_out_domains(dataset_cfg))
    return kept * int(dataset_cfg["clients_per_domain"])


# ---------------------------------------------------------------------- typed config
@dataclass(frozen=True)
class DatasetConfig:
    """``conf/dataset/<name>.yaml``: every key required (learning/typed.py), checked here."""

    name: str
    source: str
    root: str
    domains: tuple[str, ...]
    clients_per_domain: int
    new_clients_per_domain: int
    heldout_domains: tuple[str, ...]
    partition: str
    dirichlet_alpha: float
    shards_per_client: int
    val_fraction: float
    test_fraction: float
    samples_per_client: int
    image_size: int
    split: str
    pflbed_new_fraction: float
    augment: str
    preprocess: str
    input_range: str
    imbalanced_client: int
    imbalance_factor: int
    synthetic: bool
    synthetic_classes: int
    synthetic_samples: tuple[int, ...]
    synthetic_channels: int
    synthetic_size: int

    def __post_init__(self) -> None:
        one_of("dataset.source", self.source, tuple(SOURCES), DatasetError)
        one_of("dataset.partition", self.partition, PARTITION_SCHEMES, DatasetError)
        one_of("dataset.split", self.split, SPLITS, DatasetError)
        check(self.split != "fedora" or (self.source in FEDORA_SOURCES and self.clients_per_domain == 1
                                          and self.new_clients_per_domain == 0),
              f"dataset.split=fedora (FEDORA's rotated datasets) splits {' or '.join(FEDORA_SOURCES)}'s own "
              f"training and test sets among one client per domain; got source {self.source!r}, "
              f"{self.clients_per_domain} client(s) and {self.new_clients_per_domain} new client(s) per domain",
              DatasetError)
        one_of("dataset.augment", self.augment, AUGMENTS, DatasetError)
        one_of("dataset.preprocess", self.preprocess, PREPROCESSING, DatasetError)
        one_of("dataset.input_range", self.input_range, INPUT_RANGES, DatasetError)
        check(self.input_range == "symmetric" or self.source != "imagefolder",
              "dataset.input_range=unit applies to array sources (digits, MNIST, CIFAR, ...); image folders "
              "are normalised by dataset.preprocess; use dataset.input_range=symmetric", DatasetError)
        check(not self.root or self.source not in BUNDLED_SOURCES,
              f"dataset.root={self.root!r} is not read by dataset {self.name!r}: its data ({self.source}) come "
              "with the packages; for your own image tree use dataset=imagefolder dataset.root=...",
              DatasetError)
        check(self.preprocess == "plain" or self.source == "imagefolder",
              f"dataset.preprocess={self.preprocess} applies to image folders (dataset.source=imagefolder), "
              f"got source {self.source!r}; use dataset.preprocess=plain", DatasetError)
        check(self.clients_per_domain >= 1, f"dataset.clients_per_domain must be >= 1, got "
              f"{self.clients_per_domain}", DatasetError)
        for key in ("new_clients_per_domain", "samples_per_client", "image_size"):
            check(getattr(self, key) >= 0, f"dataset.{key} must be >= 0, got {getattr(self, key)}", DatasetError)
        check(self.shards_per_client >= 1, f"dataset.shards_per_client must be >= 1, got "
              f"{self.shards_per_client}", DatasetError)
        finite("dataset.dirichlet_alpha", self.dirichlet_alpha, 0.0, strict=True, error=DatasetError)
        check(0 <= self.val_fraction < 1 and 0 < self.test_fraction < 1
              and self.val_fraction + self.test_fraction < 1,
              f"dataset.val_fraction and dataset.test_fraction must be in [0, 1) and (0, 1) with a sum "
              f"below 1, got {self.val_fraction} and {self.test_fraction}", DatasetError)
        check(0.0 <= self.pflbed_new_fraction < 1.0, f"dataset.pflbed_new_fraction must be in [0, 1), got "
              f"{self.pflbed_new_fraction}", DatasetError)
        check(self.imbalance_factor >= 1, f"dataset.imbalance_factor must be >= 1, got {self.imbalance_factor}",
              DatasetError)
        if self.synthetic:
            check(self.synthetic_classes >= 2, f"dataset.synthetic=true needs dataset.synthetic_classes >= 2 "
                  f"(the real dataset's classes), got {self.synthetic_classes}", DatasetError)
            check(len(self.synthetic_samples) in (1, len(self.domains)) and min(self.synthetic_samples, default=0) > 0,
                  f"dataset.synthetic=true needs dataset.synthetic_samples: one positive count per domain "
                  f"({len(self.domains)}: {list(self.domains)}) or one total, got {list(self.synthetic_samples)}",
                  DatasetError)
            check(self.synthetic_channels in (1, 3) and (self.synthetic_size > 0 or self.image_size > 0),
                  f"dataset.synthetic=true needs dataset.synthetic_channels 1 or 3 and a size "
                  f"(dataset.synthetic_size or dataset.image_size), got {self.synthetic_channels} and "
                  f"{self.synthetic_size}/{self.image_size}", DatasetError)


SPLITS = ("per-client", "pflbed", "fedora")
FEDORA_SOURCES = ("mnist", "fashion-mnist")   # split=fedora: sources with their own train and test sets


def dataset_config(cfg: Mapping[str, Any]) -> DatasetConfig:
    """The typed dataset config (an unknown, missing or out-of-range key names itself)."""
    return read_typed(DatasetConfig, cfg, "dataset", "conf/dataset/{name}.yaml", DatasetError)


# ---------------------------------------------------------------------- the source registry
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


def fedora_sizes(cfg: DatasetConfig) -> tuple[int, int]:
    """(training, validation) images per client under ``split=fedora``: ``samples_per_client``
    less its validation and test fractions, and its validation fraction (256 x 50% / 25% =
    the authors' 128 / 64; their test images come from the test set, 10,000 // clients)."""
    n_val = round(cfg.samples_per_client * cfg.val_fraction)
    return cfg.samples_per_client - n_val - round(cfg.samples_per_client * cfg.test_fraction), n_val


def _fedora_pools(cfg: DatasetConfig, domains: list[str], seed: int) -> Pools:
    """``split=fedora``: FEDORA's rotated datasets as its authors' loader builds them
    (``learning/partition.py: fedora_rotated_split``): domain ``i`` is client ``i``, its pool
    its training, validation and test images in that order, rotated by the domain's angle with
    nearest-neighbour interpolation (torchvision's default ``rotate``, theirs). The sample ids
    are the training set's indices, then the test set's offset by its size."""
    (x_train, y_train), (x_test, y_test) = load_torchvision_sets(cfg.source, cfg.root)
    n_train, n_val = fedora_sizes(cfg)
    big, factor = _imbalance(cfg, len(domains))
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


def _fedora_splits(pool_size: int, n_train: int, n_val: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A ``_fedora_pools`` pool's one client: its images are train, validation, test in order."""
    return [(np.arange(n_train), np.arange(n_train, n_train + n_val), np.arange(n_train + n_val, pool_size))]


BUNDLED_SOURCES = ("digits", "mnist5k", "digit-sources")   # read no dataset.root
SOURCES: dict[str, Callable[[DatasetConfig, list[str], int], Pools]] = {
    "digits": _array_pools(lambda cfg: load_digits(), 10),
    "mnist5k": _array_pools(lambda cfg: load_mnist5k(), 10),
    "digit-sources": _digit_sources_pools,
    "mnist": _array_pools(lambda cfg: load_torchvision("mnist", cfg.root), 10),
    "fashion-mnist": _array_pools(lambda cfg: load_torchvision("fashion-mnist", cfg.root), 10),
    "cifar10": _array_pools(lambda cfg: load_torchvision("cifar10", cfg.root), 10),
    "cifar100": _array_pools(lambda cfg: load_torchvision("cifar100", cfg.root), 100),
    "imagefolder": _imagefolder_pools,
}


def _synthetic_pools(cfg: DatasetConfig, domains: list[str], rng_seed: int) -> Pools:
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


def build_federated_data(dataset_cfg: Mapping[str, Any], seed: int) -> FederatedData:
    """Build every client's split. Deterministic in (cfg, seed)."""
    source = str(dataset_cfg.get("source"))
    if source not in SOURCES:
        raise DatasetError(f"unknown dataset source {source!r}; valid: {', '.join(SOURCES)}")
    cfg = dataset_config(dataset_cfg)
    domains: list[str] = list(cfg.domains)
    if source == "imagefolder" and not cfg.synthetic and not domains and cfg.root and Path(cfg.root).is_dir():
        domains = [p.name for p in subfolders(Path(cfg.root))]
    if not domains:
        raise DatasetError("dataset.domains is empty; list at least one domain")
    per_domain, new_per_domain = cfg.clients_per_domain, cfg.new_clients_per_domain
    rng_seed = int(seed) * 1000 + 17
    fedora = cfg.split == "fedora" and not cfg.synthetic   # synthetic images: the per-client split
    pools = (_synthetic_pools if cfg.synthetic else _fedora_pools if fedora else SOURCES[source])(
        cfg, domains, int(seed) if fedora else rng_seed)
    num_classes = pools.num_classes
    heldout = held_out_domains(dataset_cfg)
    big, factor = _imbalance(cfg, len(domains) * per_domain)
    clients: dict[str, ClientSplit] = {}
    new_clients: dict[str, ClientSplit] = {}
    for d, (name, (pool, labels)) in enumerate(zip(domains, pools.pools, strict=True)):
        try:
            if fedora:
                scale = factor if d == big else 1
                splits = _fedora_splits(len(labels), *(n * scale for n in fedora_sizes(cfg)))
            elif cfg.split == "pflbed":
                splits = _pflbed_splits(cfg, labels, per_domain, new_per_domain, seed=rng_seed + 101 * d,
                                        domain=name)
            else:
                splits = _per_client_splits(cfg, labels, per_domain, new_per_domain, big, factor, rng_seed,
                                            d, name)
        except PartitionError as err:
            raise DatasetError(f"domain {name!r} ({len(labels)} samples) cannot be split across "
                               f"{per_domain + new_per_domain} clients: {err}") from err
        for k, (tr, va, te) in enumerate(splits):
            if k < per_domain and name not in heldout:
                cid = str(len(clients))
                target = clients
            else:   # a held-out new client (every client of a held-out domain is one)
                cid = f"new-{len(new_clients)}"
                target = new_clients
            weights = (np.bincount(labels[tr], minlength=num_classes) / max(len(tr), 1)
                       if cfg.split == "pflbed" else None)
            train: Dataset = Subset(pool if pools.train_pools is None else pools.train_pools[d], tr.tolist())
            target[cid] = ClientSplit(
                client_id=cid,
                domain=name,
                train=CropFlip(train) if cfg.augment == "crop-flip" else train,
                val=Subset(pool, va.tolist()),
                test=Subset(pool, te.tolist()),
                train_ids=pools.global_ids[d][tr],
                val_ids=pools.global_ids[d][va],
                test_ids=pools.global_ids[d][te],
                class_weights=weights,
            )
    return FederatedData(name=cfg.name, num_classes=num_classes, input_shape=pools.input_shape,
                         clients=clients, new_clients=new_clients)


def _per_client_splits(cfg: DatasetConfig, labels: np.ndarray, per_domain: int, new_per_domain: int,
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


def _pflbed_splits(cfg: DatasetConfig, labels: np.ndarray, per_domain: int, new_per_domain: int,
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


def _imbalance(cfg: DatasetConfig, num_participating: int) -> tuple[int, int]:
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
