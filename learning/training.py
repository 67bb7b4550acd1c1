"""Training and evaluation loops shared by every method.

Methods customise local training through three hooks instead of writing their own loop:
which parameters are trainable (``trainable``), an extra loss term (``extra_loss``, e.g.
FedProx's proximal term), and the optimiser settings. Frozen parameters are kept out of
the optimiser entirely, so weight decay and momentum cannot move them.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from learning.datasets.sources import tensor_view
from learning.dpsgd import DPSGDConfig, make_private, release

ExtraLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class OptimConfig:
    """Local optimiser settings. Runs build it from their typed ``train``, ``finetune`` or
    ``personalize`` settings (``common/settings.py``: ``TrainSettings.optim`` and the others;
    conf/config.yaml holds the defaults); the field defaults are the neutral plain-SGD choices
    for direct use (no momentum, no weight decay, one epoch)."""

    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    epochs: int = 1
    clip: float = 0.0
    optimizer: str = "sgd"
    amp: bool = False          # bfloat16/float16 autocast (CUDA: float16 with a GradScaler)
    compile: bool = False      # torch.compile the model for this call


@dataclass
class LossTerm:
    """A named term added to the task loss: ``weight * fn(model, x, y, logits)``. Its
    unweighted per-batch mean is reported as the metric ``name``."""

    name: str
    fn: ExtraLoss
    weight: float = 1.0


class LossTerms:
    """The sum of a method's loss terms, as one ``extra_loss`` for :func:`train_epochs`.

    Values are accumulated on the device (float64, no host sync per step) and read once
    by :meth:`metrics` after training.
    """

    def __init__(self, terms: Iterable[LossTerm]) -> None:
        self.terms = list(terms)
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor | None = None
        for term in self.terms:
            value = term.fn(model, x, y, logits)
            acc = self._sums.get(term.name)
            detached = value.detach().to(torch.float64)
            self._sums[term.name] = detached if acc is None else acc + detached
            weighted = value if term.weight == 1.0 else term.weight * value
            total = weighted if total is None else total + weighted
        self._count += 1
        assert total is not None, "LossTerms called with no terms"
        return total

    def metrics(self) -> dict[str, float]:
        return {name: float(s) / self._count for name, s in self._sums.items()}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    seed_torch(seed)


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, without its cost where there is no accelerator. On a
    CUDA build of torch with no GPU, ``torch.manual_seed`` also queues a seed for CUDA's
    generators, and queueing formats the caller's whole stack (``torch.cuda._lazy_call``):
    0.1 ms in a short script, about 0.5 ms deep in a Ray actor, several times a message
    (every model a client builds is seeded). With no accelerator that queued seed is never
    used, so seeding the CPU generator is the same; with one, this is ``torch.manual_seed``."""
    if _has_accelerator():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


@functools.cache
def _has_accelerator() -> bool:
    """Whether torch can use a GPU or another accelerator in this process (asked once)."""
    return (torch.cuda.is_available() or torch.backends.mps.is_available()
            or (hasattr(torch, "xpu") and torch.xpu.is_available()))


class TensorBatches:
    """Mini-batches of an in-memory dataset, gathered on ``device`` once per call.

    Yields exactly the batches ``DataLoader(ds, batch_size, shuffle, generator)`` yields
    (the same ``randperm`` draws from the same generator, one per pass), without a
    per-sample ``__getitem__``, a collate or a host-to-device copy per batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool,
                 generator: torch.Generator, drop_last: bool, device: torch.device | None) -> None:
        self.x = x if device is None else x.to(device, non_blocking=True)
        self.y = y if device is None else y.to(device, non_blocking=True)
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), shuffle, drop_last
        self.generator = generator

    def __len__(self) -> int:
        n = len(self.y)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.y)
        order = None
        if self.shuffle:  # DataLoader draws a base seed for its workers first, then the order
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            order = torch.randperm(n, generator=self.generator).to(self.x.device)
        for b in range(len(self)):
            if order is None:
                yield self.x[b * self.batch_size:(b + 1) * self.batch_size], \
                    self.y[b * self.batch_size:(b + 1) * self.batch_size]
            else:
                idx = order[b * self.batch_size:(b + 1) * self.batch_size]
                yield self.x[idx], self.y[idx]
        if self.shuffle:  # RandomSampler's tail draw (a permutation it slices to nothing)
            torch.randperm(n, generator=self.generator)


def make_loader(ds: Dataset, batch_size: int, shuffle: bool, seed: int = 0,
                device: torch.device | None = None) -> Iterable[tuple[torch.Tensor, Any]]:
    """The mini-batches of ``ds`` (reshuffled on every pass when ``shuffle``): a
    :class:`TensorBatches` on ``device`` for in-memory datasets, a ``DataLoader`` otherwise."""
    gen = torch.Generator().manual_seed(seed)
    # drop_last only when it keeps at least one batch: BN needs > 1 sample per batch.
    drop_last = shuffle and len(ds) > batch_size and len(ds) % batch_size == 1  # type: ignore[arg-type]
    tensors = tensor_view(ds)
    if tensors is not None:
        return TensorBatches(*tensors, batch_size, shuffle, gen, drop_last, device)
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=gen, drop_last=drop_last)


def make_optimizer(params: Iterable[nn.Parameter], opt: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if opt.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.optimizer == "adam":
        return torch.optim.Adam(params, lr=opt.lr, weight_decay=opt.weight_decay)
    raise ValueError(f"unknown optimizer {opt.optimizer!r}; valid: sgd, adam")


class DecoupledProximal:
    """FEDORA's authors' pull towards ``w_ref``, as a ``train_epochs`` ``after_step``: after
    each optimiser step ``w <- w - lr * lam * (w_0 - w_ref)``, where ``w_0`` is the weights
    *before* that step (their ``models/ClientUpdate.py`` snapshots the state before the step and
    subtracts ``lr * lam * (w_0 - w_fedora)`` from the stepped weights), for every parameter in
    ``reference``. Outside the optimiser, so momentum and weight decay never see it. Keeps one
    copy of those parameters: the next step's ``w_0``."""

    def __init__(self, model: nn.Module, reference: dict[str, torch.Tensor], lr: float, lam: float) -> None:
        params = dict(model.named_parameters())
        self.reference = {n: r.to(device=params[n].device, dtype=params[n].dtype) for n, r in reference.items()}
        self.start = {n: params[n].detach().clone() for n in reference}
        self.lr, self.lam = lr, lam

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, ref in self.reference.items():
            p = params[name]
            p.sub_(self.lr * self.lam * (self.start[name] - ref))
            self.start[name].copy_(p)


def train_epochs(
    model: nn.Module,
    train_set: Dataset,
    opt: OptimConfig,
    device: torch.device,
    seed: int = 0,
    trainable: Callable[[str], bool] | None = None,
    extra_loss: ExtraLoss | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    after_step: Callable[[nn.Module], None] | None = None,
    dpsgd: DPSGDConfig | None = None,
) -> dict[str, float]:
    """Train ``model`` in place for ``opt.epochs`` epochs on ``train_set``.

    ``trainable(name)`` selects the parameters given to the optimiser (the others get
    ``requires_grad=False`` for the duration and are restored afterwards).
    ``extra_loss(model, x, y, logits)`` is added to the cross-entropy loss.
    ``after_step(model)`` runs (without autograd) after every optimiser step: an update
    outside the optimiser, e.g. a decoupled proximal step.
    ``dpsgd`` trains with record-level DP-SGD (``learning/dpsgd.py``, Opacus): per-example
    gradients clipped and noised; the metrics then hold ``dpsgd_steps`` and ``dpsgd_sample_rate``
    for the accounting. It takes neither an extra loss nor an after-step update (Opacus' noise
    covers only the per-example loss), nor mixed precision or ``torch.compile``.
    Returns the mean training loss and accuracy over the last epoch and the step count.
    """
    if dpsgd is not None and (extra_loss is not None or after_step is not None or opt.amp or opt.compile):
        raise ValueError("privacy.record_dp=dpsgd trains one per-example cross-entropy loss: this training adds "
                         "a loss term, an after-step update, train.amp or train.compile, which DP-SGD would not "
                         "cover; use privacy.record_dp=none for this method or setting")
    model.to(device).train()
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    if trainable is not None:
        for n, p in model.named_parameters():
            p.requires_grad_(bool(trainable(n)))
    optimizer = optimizer or make_optimizer(model.parameters(), opt)
    loader = make_loader(train_set, opt.batch_size, shuffle=True, seed=seed, device=device)
    loss_fn = nn.CrossEntropyLoss()
    forward = torch.compile(model) if opt.compile else model
    private = None
    if dpsgd is not None:     # its own (secret) seed: the noise, and which examples each step uses
        dp_seed = seed if dpsgd.seed is None else dpsgd.seed
        loader = make_loader(train_set, opt.batch_size, shuffle=True, seed=dp_seed, device=device)
        private, optimizer = make_private(model, optimizer, dpsgd, opt.batch_size, dp_seed, device)
        forward = private
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=opt.amp and device.type == "cuda")
    trained = [p for p in model.parameters() if p.requires_grad]
    # Running sums stay on the device: no host sync per step (one per epoch, below).
    steps, total = 0, 0
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    try:
        for epoch in range(max(0, opt.epochs)):
            total = 0
            correct.zero_()
            loss_sum.zero_()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=opt.amp):
                    logits = forward(x)
                    loss = loss_fn(logits, y)
                if extra_loss is not None:
                    loss = loss + extra_loss(model, x, y, logits)
                finite &= torch.isfinite(loss.detach())
                scaler.scale(loss).backward()
                if opt.clip > 0:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(trained, opt.clip)
                scaler.step(optimizer)
                scaler.update()
                if after_step is not None:
                    with torch.no_grad():
                        after_step(model)
                steps += 1
                total += len(y)
                correct += (logits.detach().argmax(1) == y).sum()
                loss_sum += loss.detach().to(torch.float64) * len(y)
            if not bool(finite):
                raise FloatingPointError(
                    f"training loss became non-finite (nan or inf) in local epoch {epoch + 1}; "
                    "lower train.lr or enable train.clip"
                )
    finally:
        if private is not None:
            release(private)
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
    metrics = {
        "train_loss": float(loss_sum) / max(total, 1),
        "train_accuracy": int(correct) / max(total, 1),
        "steps": float(steps),
    }
    if dpsgd is not None:
        metrics.update(dpsgd_steps=float(steps), dpsgd_sample_rate=min(1.0, opt.batch_size / max(len(train_set), 1)))
    return metrics


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, device: torch.device, batch_size: int = 256,
             class_weights: np.ndarray | None = None) -> dict[str, float]:
    """Cross-entropy loss and accuracy of ``model`` on ``ds`` (eval mode).

    With ``class_weights`` (PFLBED: the client's train label distribution P(y)) the
    accuracy is sum_i P(y_i) 1[correct_i] / sum_i P(y_i), FedBasis' Sec. 5 metric."""
    model.to(device).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    w = None if class_weights is None else torch.as_tensor(class_weights, dtype=torch.float64, device=device)
    total = 0
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    w_correct = torch.zeros((), dtype=torch.float64, device=device)
    w_total = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in make_loader(ds, batch_size, shuffle=False, device=device):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += loss_fn(logits, y).to(torch.float64)
        hits = logits.argmax(1) == y
        correct += hits.sum()
        total += len(y)
        if w is not None:
            w_correct += (w[y] * hits).sum()
            w_total += w[y].sum()
    accuracy = int(correct) / max(total, 1)
    if w is not None:
        accuracy = float(w_correct / w_total) if float(w_total) > 0 else 0.0
    return {"loss": float(loss_sum) / max(total, 1), "accuracy": accuracy, "num": float(total)}


def has_bn_running_stats(model: nn.Module) -> bool:
    """Whether any BN layer of ``model`` tests with running statistics (a model without
    them, e.g. an MLP or BN with ``track_running_stats=False``, has one protocol only)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
               for m in model.modules())


def recompute_bn_statistics(model: nn.Module, train: Dataset, batch_size: int,
                            device: torch.device) -> nn.Module:
    """Replace every BN layer's running statistics by their average over one pass of ``train``
    (train mode, no gradient, weights unchanged; "precise BN"), in place; returns ``model``
    in eval mode.

    Why: BN's running statistics are a momentum-0.1 average taken while the weights moved.
    A model whose weights move between its last data and its evaluation (Ditto's v pulled
    towards a new global model, PartialFed's soft mix of local and global units, FedBasis'
    combination of bases averaged over domains) carries statistics that are not those of its
    weights on its client's data; on a feature-shift tree that alone leaves a client far below
    training alone. Each layer averages its batch means and unbiased batch variances with
    equal weight per batch (``momentum=None``, then restored). In a model with a BatchNorm1d,
    a last batch of one sample is left out: it has no variance, and BatchNorm1d refuses it in
    train mode (a model without one keeps it: its BatchNorm2d layers average over the pixels)."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [layer.momentum for layer in layers]
    has_bn1d = any(isinstance(layer, nn.BatchNorm1d) for layer in layers)
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None            # cumulative moving average: every batch weighs the same
    model.to(device).train()
    with torch.no_grad():
        for x, _ in make_loader(train, batch_size, shuffle=False, device=device):
            if len(x) > 1 or not has_bn1d:
                model(x.to(device, non_blocking=True))
    for layer, momentum in zip(layers, momenta, strict=True):
        layer.momentum = momentum
    return model.eval()


def proximal_term(reference: Mapping[str, torch.Tensor], mu: float,
                  keys: Callable[[str], bool] | None = None) -> ExtraLoss:
    """``mu / 2 * sum ||w - w_ref||^2`` over the model's parameters (FedProx, Ditto)."""

    def term(model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        sq = torch.zeros((), device=logits.device)
        for n, p in model.named_parameters():
            if n in reference and (keys is None or keys(n)) and p.requires_grad:
                sq = sq + torch.sum((p - reference[n].to(p.device)) ** 2)
        return 0.5 * mu * sq

    return term
