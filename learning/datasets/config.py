"""The dataset config (``conf/dataset/<name>.yaml``) typed and checked, and what can be read
from it without loading any data (the held-out domains, the number of clients).

Every key is required (``learning/typed.py``); ranges are checked in
:meth:`DatasetConfig.__post_init__`. The source (its name, and no ``root`` for a source that
comes with the packages) is checked by :func:`learning.datasets.pools.dataset_config`, the
typed reader that lives beside the source registry (as ``learning/models.py:
read_model_config`` beside ``MODELS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from learning.datasets.partition import PARTITION_SCHEMES
from learning.datasets.sources import AUGMENTS, INPUT_RANGES, PREPROCESSING, DatasetError
from learning.typed import check, finite, one_of

SPLITS = ("per-client", "pflbed", "fedora")
FEDORA_SOURCES = ("mnist", "fashion-mnist")   # split=fedora: sources with their own train and test sets


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
