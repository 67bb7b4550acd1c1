"""A user's own multi-domain image tree, made from real images that install with pip.

scikit-learn's 1,797 handwritten digits are split disjointly into 4 domains (about 450
images each) and drawn in 4 styles as 28x28 RGB PNGs under ``<root>/<domain>/<class>/``:

- ``ink``: dark digit on paper white;
- ``neon``: bright green digit on a dark blue background;
- ``photo``: the digit blended over random patches of scikit-learn's two real photographs
  (the way MNIST-M is made from MNIST and BSDS500 patches);
- ``noisy``: low-contrast grey digit under Gaussian noise.

The tests use it as the "tree the project has not seen" (``dataset=imagefolder``), and it
is the tree of the FedBN vs FedAvg measurement in the README:

    python3 -m ops.styled_digits /tmp/my-digits
    pflower run dataset=imagefolder dataset.root=/tmp/my-digits strategy=fedbn
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

STYLES = ("ink", "neon", "photo", "noisy")


def _style(img: np.ndarray, style: str, rng: np.random.Generator, photos: list[np.ndarray]) -> np.ndarray:
    """One 28x28 grey digit in [0, 1] -> a 28x28x3 uint8 image of the style."""
    g = img[..., None]
    if style == "ink":
        out = 0.95 - 0.85 * g * np.array([1.0, 1.0, 1.0])
    elif style == "neon":
        out = (1 - g) * np.array([0.05, 0.05, 0.3]) + g * np.array([0.2, 1.0, 0.3])
    elif style == "photo":
        photo = photos[rng.integers(len(photos))]
        y, x = rng.integers(0, photo.shape[0] - 28), rng.integers(0, photo.shape[1] - 28)
        patch = photo[y:y + 28, x:x + 28] / 255.0
        out = np.abs(patch - g)          # MNIST-M: |patch - digit|
    elif style == "noisy":
        out = 0.4 + 0.25 * g + rng.normal(0, 0.12, g.shape)
        out = np.repeat(out, 3, axis=-1)
    else:
        raise ValueError(f"unknown style {style!r}; valid: {', '.join(STYLES)}")
    return (np.clip(out, 0, 1) * 255).astype(np.uint8)


def make_styled_digits(root: Path, seed: int = 0, per_domain: int = 0) -> Path:
    """Write the tree (``per_domain`` > 0 keeps that many images per domain)."""
    from PIL import Image
    from sklearn.datasets import load_digits, load_sample_images

    digits = load_digits()
    x = digits.images / 16.0
    y = digits.target
    photos = [np.asarray(p) for p in load_sample_images().images]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    for style, idx in zip(STYLES, np.array_split(order, len(STYLES)), strict=True):
        if per_domain:
            idx = idx[:per_domain]
        for i in idx:
            big = np.asarray(Image.fromarray((x[i] * 255).astype(np.uint8)).resize((28, 28), Image.BILINEAR)) / 255.0
            folder = root / style / str(int(y[i]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(_style(big, style, rng, photos)).save(folder / f"{i:04d}.png")
    return root


if __name__ == "__main__":
    out = make_styled_digits(Path(sys.argv[1] if len(sys.argv) > 1 else "my-digits"))
    print(f"wrote {sum(1 for _ in out.rglob('*.png'))} images under {out}")
