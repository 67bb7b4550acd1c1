"""A multi-domain image tree that is not styled digits: Fashion-MNIST garments photographed
four ways, as a new user's own ``<root>/<domain>/<class>/`` folder (docs/results.md's
"a tree of our own" table; not CI).

    apt-get install dataset-fashion-mnist          # Debian's package: /usr/share/datasets/fashion-mnist/
    python3 -m bench.fashion_domains data/fashion-domains
    pflower sweep dataset=imagefolder dataset.root=data/fashion-domains model=alexnet-bn ...

Each domain takes its own disjoint 500 images of the 10,000-image test file (50 per class),
drawn as 28x28 RGB PNGs:

- ``studio``: the garment as shot, light on black;
- ``catalogue``: a dark garment on a warm paper-white page (inverted);
- ``street``: the garment in a random colour over a patch of scikit-learn's two real photos;
- ``sketch``: the garment's outline only (Sobel edge magnitude), dark lines on grey with noise.

The four differ in colour statistics and in which features carry the class (texture and fill
vs. outline), the feature shift BN-based personalisation is meant for.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import numpy as np

SOURCE = Path("/usr/share/datasets/fashion-mnist")
DOMAINS = ("studio", "catalogue", "street", "sketch")
CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


def read_idx(path: Path, header: int) -> np.ndarray:
    """An idx file's payload (images: header 16, labels: header 8) as uint8."""
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=header)


def edges(g: np.ndarray) -> np.ndarray:
    """Sobel gradient magnitude of a 28x28 image in [0, 1], scaled to [0, 1]."""
    p = np.pad(g, 1, mode="edge")
    gx = (p[:-2, 2:] + 2 * p[1:-1, 2:] + p[2:, 2:]) - (p[:-2, :-2] + 2 * p[1:-1, :-2] + p[2:, :-2])
    gy = (p[2:, :-2] + 2 * p[2:, 1:-1] + p[2:, 2:]) - (p[:-2, :-2] + 2 * p[:-2, 1:-1] + p[:-2, 2:])
    mag = np.hypot(gx, gy)
    return mag / mag.max() if mag.max() > 0 else mag


def draw(g: np.ndarray, domain: str, rng: np.random.Generator, photos: list[np.ndarray]) -> np.ndarray:
    """One garment (28x28 in [0, 1]) as a 28x28x3 uint8 image of ``domain``."""
    m = g[..., None]
    if domain == "studio":
        rgb = np.repeat(m, 3, axis=-1)
    elif domain == "catalogue":
        rgb = np.array([0.97, 0.93, 0.85]) * (1 - 0.9 * m)
    elif domain == "street":
        photo = photos[rng.integers(len(photos))]
        y, x = rng.integers(0, photo.shape[0] - 28), rng.integers(0, photo.shape[1] - 28)
        colour = rng.uniform(0.2, 1.0, size=3)
        rgb = (1 - m) * photo[y:y + 28, x:x + 28] / 255.0 + m * colour
    elif domain == "sketch":
        line = 0.75 - 0.6 * edges(g)[..., None] + rng.normal(0, 0.05, m.shape)
        rgb = np.repeat(line, 3, axis=-1)
    else:
        raise ValueError(f"unknown domain {domain!r}; valid: {', '.join(DOMAINS)}")
    return (np.clip(rgb, 0, 1) * 255).astype(np.uint8)


def make_fashion_domains(root: Path, source: Path = SOURCE, per_class: int = 50, seed: int = 0) -> Path:
    """Write the tree under ``root`` from the Fashion-MNIST idx files in ``source``."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    files = source / "t10k-images-idx3-ubyte.gz", source / "t10k-labels-idx1-ubyte.gz"
    if not all(f.exists() for f in files):
        raise SystemExit(f"no Fashion-MNIST idx files in {source}: `apt-get install dataset-fashion-mnist` "
                         "(Debian) installs them there")
    images = read_idx(files[0], 16).reshape(-1, 28, 28) / 255.0
    labels = read_idx(files[1], 8)
    photos = [np.asarray(p) for p in load_sample_images().images]
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(len(CLASSES))]
    for d, domain in enumerate(DOMAINS):
        for c, name in enumerate(CLASSES):
            folder = root / domain / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in by_class[c][d * per_class:(d + 1) * per_class]:   # disjoint across domains
                Image.fromarray(draw(images[i], domain, rng, photos)).save(folder / f"{i:05d}.png")
    return root


if __name__ == "__main__":
    out = make_fashion_domains(Path(sys.argv[1] if len(sys.argv) > 1 else "data/fashion-domains"))
    print(f"wrote {sum(1 for _ in out.rglob('*.png'))} images under {out}")
