"""What the checks against the authors' code share (``bench/authors_*.py``): the checkout
argument, and replaying to their code exactly the mini-batches pflower's ``train_epochs`` drew."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def checkout_args(argv: list[str] | None, prog: str, doc: str | None, method: str, marker: str) -> argparse.Namespace:
    """``--repo`` (a checkout of the authors' repository, put first on ``sys.path``) and ``--seed``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", required=True, help=f"a checkout of the authors' {method} repository")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    repo = Path(args.repo).resolve()
    if not (repo / marker).exists():
        parser.error(f"{repo} is not a checkout of the authors' {method} (no {marker})")
    sys.path.insert(0, str(repo))
    return args


class Replay:
    """A loader that yields, on its i-th pass, the i-th epoch's mini-batches pflower drew."""

    def __init__(self, epochs: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self.epochs, self.passes = epochs, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = self.epochs[self.passes]
        self.passes += 1
        return iter(batches)

    def __len__(self) -> int:
        return len(self.epochs[0])


@contextmanager
def recorded_training() -> Iterator[dict[str, Any]]:
    """While active, the client trainers' ``train_epochs`` calls record their dataset, optimiser
    settings and seed (the last call's) in the yielded dict."""
    import client.trainer as ct

    drawn: dict[str, Any] = {}
    real = ct.train_epochs

    def spy(model, ds, opt, device, seed=0, **kw):  # noqa: ANN001, ANN202
        drawn.update(ds=ds, opt=opt, seed=seed)
        return real(model, ds, opt, device, seed=seed, **kw)

    ct.train_epochs = spy
    try:
        yield drawn
    finally:
        ct.train_epochs = real


def replay_of(drawn: dict[str, Any]) -> Replay:
    """The mini-batches of every epoch of the recorded ``train_epochs`` call, as it drew them."""
    from learning.training import make_loader

    opt = drawn["opt"]
    loader = make_loader(drawn["ds"], opt.batch_size, shuffle=True, seed=int(drawn["seed"]))
    return Replay([[(x.clone(), y.clone()) for x, y in loader] for _ in range(opt.epochs)])
