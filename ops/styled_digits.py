"""A user's own multi-domain image tree, made from real images that install with pip.

scikit-learn's 1,797 handwritten digits are split disjointly into 4 domains (about 450
images each) and drawn in 4 styles as 28x28 RGB PNGs under ``<root>/<domain>/<class>/``:

- ``ink``: dark digit on paper white;
- ``neon``: bright green digit on a dark blue background;
- ``photo``: the digit blended over random patches of scikit-learn's two real photographs
  (the way MNIST-M is made from MNIST and BSDS500 patches);
- ``noisy``: low-contrast grey digit under Gaussian noise;
- ``warped`` (not in the default four): a dark digit on white, sheared, shrunk and shifted
  off-centre, with salt noise: the one domain unlike the others, where a method that leans
  on its neighbours' models (FEDORA's propagation) is tested (docs/methods/fedora.md).

The tests use it as the "tree the project has not seen" (``dataset=imagefolder``), and it
is the tree of the FedBN vs FedAvg measurement in the README:

    python3 -m ops.styled_digits /tmp/my-digits
    pflower run dataset=imagefolder dataset.root=/tmp/my-digits strategy=fedbn
    python3 -m ops.styled_digits /tmp/unlike-digits ink,neon,photo,warped   # one unlike domain
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

STYLES = ("ink", "neon", "photo", "noisy")
EVERY_STYLE = (*STYLES, "warped")


def _warp(g: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A 28x28 grey digit sheared by 0.5, shrunk to 60 % and shifted 3-5 px off-centre."""
    from PIL import Image

    shift = rng.integers(3, 6, size=2) * rng.choice([-1, 1], size=2)
    scale, shear = 0.6, 0.5
    # PIL's affine maps output (x, y) to input: centre, undo the scale and shear, shift back
    a, b = 1 / scale, shear / scale
    c = 14 - a * (14 + shift[0]) - b * (14 + shift[1])
    e = 1 / scale
    f = 14 - e * (14 + shift[1])
    img = Image.fromarray((g * 255).astype(np.uint8)).transform((28, 28), Image.AFFINE, (a, b, c, 0, e, f),
                                                                 resample=Image.BILINEAR)
    return np.asarray(img) / 255.0


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
    elif style == "warped":
        w = _warp(img, rng)[..., None]
        out = 0.95 - 0.85 * w * np.array([1.0, 1.0, 1.0])
        out[rng.random((28, 28)) < 0.08] = 1.0         # salt: 8 % of pixels white
    elif style == "noisy":
        out = 0.4 + 0.25 * g + rng.normal(0, 0.12, g.shape)
        out = np.repeat(out, 3, axis=-1)
    else:
        raise ValueError(f"unknown style {style!r}; valid: {', '.join(EVERY_STYLE)}")
    return (np.clip(out, 0, 1) * 255).astype(np.uint8)


def make_styled_digits(root: Path, seed: int = 0, per_domain: int = 0,
                       styles: tuple[str, ...] = STYLES) -> Path:
    """Write the tree, one domain per style of ``styles`` (``per_domain`` > 0 keeps that many
    images per domain)."""
    unknown = [s for s in styles if s not in EVERY_STYLE]
    if unknown:
        raise ValueError(f"unknown style(s) {', '.join(unknown)}; valid: {', '.join(EVERY_STYLE)}")
    from PIL import Image
    from sklearn.datasets import load_digits, load_sample_images

    digits = load_digits()
    x = digits.images / 16.0
    y = digits.target
    photos = [np.asarray(p) for p in load_sample_images().images]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    for style, idx in zip(styles, np.array_split(order, len(styles)), strict=True):
        if per_domain:
            idx = idx[:per_domain]
        for i in idx:
            big = np.asarray(Image.fromarray((x[i] * 255).astype(np.uint8)).resize((28, 28), Image.BILINEAR)) / 255.0
            folder = root / style / str(int(y[i]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(_style(big, style, rng, photos)).save(folder / f"{i:04d}.png")
    return root


if __name__ == "__main__":
    chosen = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else STYLES
    out = make_styled_digits(Path(sys.argv[1] if len(sys.argv) > 1 else "my-digits"), styles=chosen)
    print(f"wrote {sum(1 for _ in out.rglob('*.png'))} images under {out}")
