"""Federated datasets: each client's train/val/test split, built from a dataset config and
kept per process (the typed config is ``config.py``, the sources' pools ``pools.py``, the
splits ``splits.py``, the images themselves ``sources.py``).

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Subset

from learning.datasets.config import held_out_domains
from learning.datasets.partition import PartitionError
from learning.datasets.pools import SOURCES, dataset_config, fedora_pools, synthetic_pools
from learning.datasets.sources import CropFlip, DatasetError, subfolders
from learning.datasets.splits import (
    fedora_client_splits,
    fedora_sizes,
    imbalance,
    per_client_splits,
    pflbed_splits,
)


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


def build_federated_data(dataset_cfg: Mapping[str, Any], seed: int) -> FederatedData:
    """Build every client's split. Deterministic in (cfg, seed)."""
    cfg = dataset_config(dataset_cfg)   # names an unknown source, key or value
    source = cfg.source
    domains: list[str] = list(cfg.domains)
    if source == "imagefolder" and not cfg.synthetic and not domains and cfg.root and Path(cfg.root).is_dir():
        domains = [p.name for p in subfolders(Path(cfg.root))]
    if not domains:
        raise DatasetError("dataset.domains is empty; list at least one domain")
    per_domain, new_per_domain = cfg.clients_per_domain, cfg.new_clients_per_domain
    rng_seed = int(seed) * 1000 + 17
    fedora = cfg.split == "fedora" and not cfg.synthetic   # synthetic images: the per-client split
    pools = (synthetic_pools if cfg.synthetic else fedora_pools if fedora else SOURCES[source])(
        cfg, domains, int(seed) if fedora else rng_seed)
    num_classes = pools.num_classes
    heldout = held_out_domains(dataset_cfg)
    big, factor = imbalance(cfg, len(domains) * per_domain)
    clients: dict[str, ClientSplit] = {}
    new_clients: dict[str, ClientSplit] = {}
    for d, (name, (pool, labels)) in enumerate(zip(domains, pools.pools, strict=True)):
        try:
            if fedora:
                scale = factor if d == big else 1
                splits = fedora_client_splits(len(labels), *(n * scale for n in fedora_sizes(cfg)))
            elif cfg.split == "pflbed":
                splits = pflbed_splits(cfg, labels, per_domain, new_per_domain, seed=rng_seed + 101 * d,
                                        domain=name)
            else:
                splits = per_client_splits(cfg, labels, per_domain, new_per_domain, big, factor, rng_seed,
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
