"""``dataset.synthetic=true``: a paper setting at its real size without its images.

The stand-in must have the real dataset's shape (clients, classes, samples per domain, image
size), need no data folder, say in its name that it is synthetic, and be learnable (classes
differ in every domain; domains shift the features)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import ConfigError, compose_config
from learning.datasets.federated import build_federated_data
from learning.datasets.sources import SyntheticImages


def _images(ds, n: int) -> tuple[torch.Tensor, np.ndarray]:
    xs, ys = zip(*(ds[i] for i in range(n)), strict=True)
    return torch.stack(xs), np.asarray(ys)


def test_pflbed_paper_setting_has_the_real_shape_without_a_data_folder() -> None:
    cfg = compose_config({}, ["experiment=fedbasis-pacs", "dataset.synthetic=true"])
    assert cfg.dataset.name == "pacs-synthetic" and "pacs-synthetic" in cfg.run_name
    data = build_federated_data(cfg.dataset, 0)
    assert (len(data.clients), len(data.new_clients)) == (80, 40)   # 20 + 10 clients per domain
    assert data.input_shape == (3, 224, 224) and data.num_classes == 7
    x, y = data.client("0").train[0]
    assert x.shape == (3, 224, 224) and 0 <= y < 7
    # every sample of the four PACS domains is in exactly one participating or new train split,
    # or in its domain's shared validation/test sets
    per_domain = {}
    for split in [*data.clients.values(), *data.new_clients.values()]:
        per_domain.setdefault(split.domain, 0)
        per_domain[split.domain] += len(split.train)
    for domain, real in zip(["art_painting", "cartoon", "photo", "sketch"], [2048, 2344, 1670, 3929],
                            strict=True):
        val_test = len(next(s for s in data.clients.values() if s.domain == domain).val) + \
            len(next(s for s in data.clients.values() if s.domain == domain).test)
        assert per_domain[domain] + val_test == real


def test_one_total_is_split_among_the_domains() -> None:
    cfg = compose_config({}, ["experiment=fedbabu-cifar100-tau10", "dataset.synthetic=true"])
    data = build_federated_data(cfg.dataset, 0)
    assert len(data.clients) == 100 and data.input_shape == (3, 32, 32) and data.num_classes == 100
    everything = sum(len(s.train) + len(s.val) + len(s.test) for s in data.clients.values())
    assert everything == 60000


def test_images_are_deterministic_and_differ_between_samples() -> None:
    labels = np.array([0, 1, 2, 0])
    a = SyntheticImages(labels, 3, (3, 16, 16), domain=0, seed=5)
    b = SyntheticImages(labels, 3, (3, 16, 16), domain=0, seed=5)
    assert torch.equal(a[2][0], b[2][0]) and a[2][1] == 2
    assert not torch.equal(a[0][0], a[3][0])   # same class, own noise


def test_classes_are_learnable_in_every_domain_and_domains_shift_the_features() -> None:
    n, classes = 400, 5
    labels = np.arange(n) % classes
    domains = [SyntheticImages(labels, classes, (3, 24, 24), domain=d, seed=1) for d in range(2)]
    for ds in domains:
        x, y = _images(ds, n)
        flat = x.flatten(1)
        train, test = slice(0, 300), slice(300, n)
        means = torch.stack([flat[train][y[train] == c].mean(0) for c in range(classes)])
        predicted = torch.cdist(flat[test], means).argmin(1).numpy()
        assert (predicted == y[test]).mean() > 0.9   # nearest class mean, chance is 0.2
    x0, _ = _images(domains[0], 50)
    x1, _ = _images(domains[1], 50)
    assert (x0.mean((0, 2, 3)) - x1.mean((0, 2, 3))).abs().max() > 0.05   # a per-channel shift


def test_a_generic_tree_without_its_shape_names_the_keys_to_give() -> None:
    with pytest.raises(ConfigError, match="synthetic_classes.*synthetic_samples|synthetic_samples"):
        compose_config({}, ["dataset=imagefolder", "dataset.synthetic=true", "dataset.domains=[a,b]"])
    cfg = compose_config({}, ["dataset=imagefolder", "dataset.synthetic=true", "dataset.domains=[a,b]",
                              "dataset.synthetic_classes=4", "dataset.synthetic_samples=[100]"])
    data = build_federated_data(cfg.dataset, 0)
    assert len(data.clients) == 2 and data.input_shape == (3, 32, 32)
