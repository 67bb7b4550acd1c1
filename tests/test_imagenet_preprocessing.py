"""ImageNet-style preprocessing for image folders read by ImageNet-pretrained backbones
(PartialFed's and FedBasis' settings), and the refusal to start such a setting without its
pretrained weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.config import ConfigError, compose_config
from learning.datasets.federated import build_federated_data
from learning.datasets.sources import IMAGENET_MEAN, IMAGENET_STD


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Two domains x two classes x 8 RGB images of 48 x 36 pixels (not square)."""
    rng = np.random.default_rng(0)
    for domain in ("a", "b"):
        for cls in ("cat", "dog"):
            folder = tmp_path / "tree" / domain / cls
            folder.mkdir(parents=True)
            for i in range(8):
                Image.fromarray(rng.integers(0, 256, (36, 48, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return tmp_path / "tree"


def _data(tree: Path, preprocess: str):
    cfg = compose_config({}, ["dataset=imagefolder", f"dataset.root={tree}", "dataset.image_size=32",
                              f"dataset.preprocess={preprocess}", "dataset.val_fraction=0.2",
                              "dataset.test_fraction=0.3"])
    return build_federated_data(cfg.dataset, 0)


def _centre_crop_reference(path: Path, size: int) -> torch.Tensor:
    """Resize the short side to round(size * 256 / 224), crop the centre, ImageNet-normalise:
    written with PIL and numpy, apart from torchvision."""
    img = Image.open(path).convert("RGB")
    short = round(size * 256 / 224)
    w, h = img.size
    new = (round(w * short / h), short) if h <= w else (short, round(h * short / w))
    img = img.resize(new, Image.BILINEAR)
    left, top = round((new[0] - size) / 2.0), round((new[1] - size) / 2.0)
    arr = np.asarray(img.crop((left, top, left + size, top + size)), np.float32) / 255.0
    arr = (arr - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)
    return torch.from_numpy(arr.transpose(2, 0, 1))


def test_evaluation_images_are_resized_centre_cropped_and_imagenet_normalised(tree: Path) -> None:
    data = _data(tree, "imagenet")
    test = data.client("0").test
    x, _ = test[0]
    base, index = test.dataset, test.indices[0]
    path = Path(base._ds.samples[index][0])
    assert x.shape == (3, 32, 32)
    torch.testing.assert_close(x, _centre_crop_reference(path, 32), atol=0.05, rtol=0)  # antialias rounding
    assert torch.equal(test[0][0], x)                        # evaluation is deterministic


def test_training_images_are_random_crops_and_flips_of_the_same_samples(tree: Path) -> None:
    data = _data(tree, "imagenet")
    train = data.client("0").train
    torch.manual_seed(0)
    first = torch.stack([train[i][0] for i in range(len(train))])
    second = torch.stack([train[i][0] for i in range(len(train))])
    assert first.shape[1:] == (3, 32, 32)
    assert not torch.equal(first, second)                    # drawn anew each read
    assert [train[i][1] for i in range(len(train))] == [data.client("0").train[i][1] for i in range(len(train))]
    # the same images as evaluation reads them: the ImageNet statistics put the means near 0
    assert abs(float(first.mean())) < 0.5


def test_plain_preprocessing_is_unchanged(tree: Path) -> None:
    data = _data(tree, "plain")
    x, _ = data.client("0").train[0]
    assert x.shape == (3, 32, 32) and float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    assert torch.equal(data.client("0").train[0][0], x)


def test_imagenet_preprocessing_is_for_image_folders_only() -> None:
    with pytest.raises(ConfigError, match="dataset.preprocess=imagenet applies to image folders"):
        compose_config({}, ["dataset.preprocess=imagenet"])


@pytest.mark.parametrize("experiment", ["partialfed-office-home", "fedbasis-pacs", "fedbasis-office-home"])
def test_a_setting_that_starts_from_imagenet_weights_refuses_to_start_without_them(experiment: str,
                                                                                  tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.pretrained_path=/path/resnet18.pth"):
        compose_config({}, [f"experiment={experiment}", f"dataset.root={tmp_path}"])
    cfg = compose_config({}, [f"experiment={experiment}", f"dataset.root={tmp_path}",
                              "model.pretrained_required=false"])
    assert cfg.dataset.preprocess == "imagenet"
    weights = tmp_path / "resnet18.pth"
    weights.write_bytes(b"")   # existence is checked when the model is built (tests/test_models.py)
    compose_config({}, [f"experiment={experiment}", f"dataset.root={tmp_path}", f"model.pretrained_path={weights}"])
    compose_config({}, [f"experiment={experiment}", "dataset.synthetic=true"])   # memory and time only
