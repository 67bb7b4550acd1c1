"""FEDORA's rotated datasets against its authors' loader on the same files (not CI; needs
their checkout and the datasets).

    pflower data mnist --root data/torchvision && pflower data fashion-mnist --root data/torchvision
    python3 -m bench.authors_fedora_split --repo /path/to/FEDORA --root data/torchvision --seed 0

Nothing of the authors' code is in this repository: the script imports their
``utils/load_rotate_mnist.py: BaseNodes_RotateMNIST`` from the folder given and runs it, as
their ``main_fedora.py`` does after ``set_seed(seed)``, in a temporary folder whose ``data/``
is ``--root`` (their loader reads ``data/``; the files are there, so torchvision downloads
nothing). pflower builds ``experiment=fedora-rotated-mnist`` (and ``-fashion-mnist``) with the
same seed from the same root. Compared, per client: the angle, the split sizes, every image
and label of the training, validation and test sets (the same images in the same order);
and over all clients: no image in two splits or two clients, training and validation images
from the training set, test images from the test set. Their imbalanced setting is in
commented-out lines of their loader, so it is not run here; ``tests/test_data_sources.py``
checks pflower's split against their procedure written out, imbalanced client included.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.authors import checkout_args

DATASETS = {"mnist": "fedora-rotated-mnist", "fashion-mnist": "fedora-rotated-fashion-mnist"}


def their_clients(name: str, root: Path, num_clients: int, seed: int) -> tuple[np.ndarray, list[dict]]:
    """Their loader's angles and per-client (data, targets) of train, val and test."""
    from utils.helper import set_seed  # the authors' code
    from utils.load_rotate_mnist import BaseNodes_RotateMNIST

    here = Path.cwd()
    with tempfile.TemporaryDirectory() as work:
        os.symlink(root.resolve(), Path(work) / "data")
        os.chdir(work)
        try:
            set_seed(seed)
            nodes = BaseNodes_RotateMNIST(name, num_clients, batch_size=64)
        finally:
            os.chdir(here)
    clients = [{split: (loader.dataset.data, torch.as_tensor(loader.dataset.targets))
                for split, loader in (("train", tr), ("val", va), ("test", te))}
               for tr, va, te in zip(nodes.train_loaders, nodes.val_loaders, nodes.test_loaders, strict=True)]
    return np.arange(0, 360.0, 360.0 / num_clients), clients


def our_clients(experiment: str, root: Path, seed: int) -> tuple[list[float], list[dict], list[dict]]:
    from common.config import compose_config
    from learning.datasets.federated import load_federated_data

    cfg = compose_config({}, [f"experiment={experiment}", f"dataset.root={root.resolve()}", f"seed={seed}"])
    data = load_federated_data(cfg.dataset, seed)
    ordered = [data.clients[str(i)] for i in range(len(data.clients))]
    clients, ids = [], []
    for c in ordered:
        clients.append({split: tuple(torch.stack(t) if k == 0 else torch.as_tensor(t)
                                     for k, t in enumerate(zip(*[getattr(c, split)[i] for i in range(len(getattr(c, split)))],
                                                               strict=True)))
                        for split in ("train", "val", "test")})
        ids.append({"train": c.train_ids, "val": c.val_ids, "test": c.test_ids})
    return [float(c.domain.split("-", 1)[1]) for c in ordered], clients, ids


def compare(name: str, root: Path, seed: int) -> bool:
    ours_angles, ours, ids = our_clients(DATASETS[name], root, seed)
    their_angles, theirs = their_clients(name, root, len(ours), seed)
    ok = len(ours) == len(theirs) and np.allclose(ours_angles, their_angles)
    print(f"{name}: {len(ours)} clients (theirs {len(theirs)}), angles {ours_angles[:3]}...{ours_angles[-1]} "
          f"({'same' if ok else 'DIFFERENT'} as theirs)")
    worst = {split: 0.0 for split in ("train", "val", "test")}
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for split in worst:
            (xa, ya), (xb, yb) = a[split], b[split]
            same_shape = xa.shape == xb.shape and len(ya) == len(yb)
            if not same_shape:
                print(f"  client {i} {split}: {tuple(xa.shape)} against their {tuple(xb.shape)}")
                ok = False
                continue
            worst[split] = max(worst[split], float((xa - xb).abs().max()))
            ok &= bool(torch.equal(ya.long(), yb.long()))
    sizes = {split: (len(ours[0][split][1]), len(theirs[0][split][1])) for split in worst}
    print("  per-client sizes (ours, theirs): " + ", ".join(f"{s} {a}/{b}" for s, (a, b) in sizes.items()))
    print("  largest |pixel difference| over all clients: "
          + ", ".join(f"{s} {v:.1e}" for s, v in worst.items()) + "; labels " + ("equal" if ok else "DIFFER"))
    ok &= all(v == 0.0 for v in worst.values())
    every = np.concatenate([np.concatenate([d["train"], d["val"], d["test"]]) for d in ids])
    n_train = 60_000
    pools = all((d["train"] < n_train).all() and (d["val"] < n_train).all() and (d["test"] >= n_train).all() for d in ids)
    disjoint = len(np.unique(every)) == len(every)
    print(f"  no image twice: {disjoint}; train/val from the training set, test from the test set: {pools}")
    return ok and disjoint and pools


def main(argv: list[str] | None = None) -> int:
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--root", required=True, help="a torchvision root holding MNIST/raw and FashionMNIST/raw")
    pre.add_argument("--datasets", default="mnist,fashion-mnist")
    known, rest = pre.parse_known_args(argv)
    args = checkout_args(rest, "python3 -m bench.authors_fedora_split", __doc__, "FEDORA", "utils/load_rotate_mnist.py")
    results = {name: compare(name, Path(known.root), args.seed) for name in known.datasets.split(",")}
    print("PASS" if all(results.values()) else f"FAIL: {[n for n, r in results.items() if not r]}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
