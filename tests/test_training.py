"""The shared training loop: frozen parameters stay frozen, options work, proximal term math."""

from __future__ import annotations

import pytest
import torch
from helpers import model_config
from torch.utils.data import TensorDataset

from learning.models import build_model
from learning.training import OptimConfig, evaluate, proximal_term, train_epochs


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    return TensorDataset(x, y)


def _model():
    torch.manual_seed(0)
    return build_model(model_config("cnn", width=8, hidden=16), (1, 8, 8), 2)


def test_frozen_parameters_never_move_with_momentum_and_weight_decay():
    model = _model()
    head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("head.")}
    body_before = model.features[0].weight.clone()
    opt = OptimConfig(lr=0.1, momentum=0.9, weight_decay=0.1, epochs=3, batch_size=16)
    train_epochs(model, _data(), opt, torch.device("cpu"), trainable=lambda n: not n.startswith("head."))
    for k, v in head.items():
        assert torch.equal(model.state_dict()[k], v), f"{k} moved"
    assert not torch.equal(model.features[0].weight, body_before)
    assert all(p.requires_grad for p in model.parameters()), "requires_grad must be restored"


@pytest.mark.parametrize("amp", [False, True])
def test_training_reduces_loss_with_and_without_amp(amp):
    model, ds = _model(), _data(128)
    before = evaluate(model, ds, torch.device("cpu"))["loss"]
    train_epochs(model, ds, OptimConfig(lr=0.05, momentum=0.9, weight_decay=5e-4, epochs=5, batch_size=16, amp=amp), torch.device("cpu"))
    assert evaluate(model, ds, torch.device("cpu"))["loss"] < before


def test_proximal_term_matches_manual_sum():
    model = _model()
    ref = {n: p.detach() + 0.5 for n, p in model.named_parameters()}
    term = proximal_term(ref, mu=0.2)(model, None, None, torch.zeros(1))
    manual = 0.5 * 0.2 * sum(float(((p.detach() - ref[n]) ** 2).sum()) for n, p in model.named_parameters())
    assert float(term.detach()) == pytest.approx(manual, rel=1e-5)


def test_nan_loss_is_a_clear_error():
    model = _model()
    x = torch.full((8, 1, 8, 8), float("nan"))
    with pytest.raises(FloatingPointError, match="lower train.lr"):
        train_epochs(model, TensorDataset(x, torch.zeros(8, dtype=torch.long)), OptimConfig(lr=0.05, batch_size=4),
                     torch.device("cpu"))


@pytest.mark.parametrize(("n", "batch", "shuffle"), [(9, 4, True), (8, 4, True), (10, 4, False), (3, 8, True)])
def test_in_memory_batches_are_exactly_the_dataloaders(n, batch, shuffle):
    """make_loader gathers in-memory (TensorDataset / Subset) data without a DataLoader;
    every pass must give the very batches torch's DataLoader gives with the same generator,
    so runs stay bit-identical to the plain PyTorch loop."""
    from torch.utils.data import DataLoader, Subset

    from learning.training import TensorBatches, make_loader

    x, y = torch.randn(20, 1, 2, 2), torch.arange(20)
    ds = Subset(Subset(TensorDataset(x, y), list(range(2, 19))), [0, 3, 5, 7, 9, 11, 12, 13, 14, 15][:n])
    ours = make_loader(ds, batch, shuffle, seed=3)
    assert isinstance(ours, TensorBatches)
    drop = shuffle and len(ds) > batch and len(ds) % batch == 1
    ref = DataLoader(ds, batch_size=batch, shuffle=shuffle, generator=torch.Generator().manual_seed(3), drop_last=drop)
    for _ in range(3):   # the generator advances across passes the same way
        a, b = list(ours), list(ref)
        assert len(a) == len(b)
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_seed_torch_draws_as_torch_manual_seed_does() -> None:
    """Seeding without queueing CUDA's seed (no accelerator here) gives the draws, and the
    model initialisation, that ``torch.manual_seed`` gives."""
    from learning.training import seed_torch

    for seed in (0, 7, 2**40 + 3):
        torch.manual_seed(seed)
        expected = (torch.rand(5), torch.randn(3), torch.nn.Linear(4, 2).weight.detach().clone())
        seed_torch(seed)
        drawn = (torch.rand(5), torch.randn(3), torch.nn.Linear(4, 2).weight.detach().clone())
        for a, b in zip(expected, drawn, strict=True):
            assert torch.equal(a, b)
