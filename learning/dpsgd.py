"""Record-level DP-SGD of a client's local training with Opacus (``privacy.record_dp=dpsgd``).

DP-SGD (Abadi et al., CCS 2016): every step, each example's gradient is clipped to L2 norm
``max_grad_norm`` and Gaussian noise of std ``noise_multiplier * max_grad_norm`` is added to
their sum, so what training produces (the client's model, hence everything it uploads) is
(epsilon, delta)-DP with respect to any one of that client's training examples. Opacus computes
the per-example gradients (``GradSampleModule``), clips and noises (``DPOptimizer``), checks the
model (``ModuleValidator``: BatchNorm mixes a batch's examples and is refused) and accounts
(``RDPAccountant``). Nothing here imports Flower or the rest of pflower.

Accounting: each training a client runs is ``steps`` steps at sampling rate ``q = batch / n``;
the epsilon of all of them together (every round, redone rounds included) comes from Opacus'
RDP accountant. pflower's batches are a shuffled partition of the client's data each epoch,
not Poisson samples: the epsilon is the one Opacus reports for that rate, the usual
approximation (docs/privacy.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

LEDGER = "dpsgd-ledger.jsonl"     # in a client's state folder: every private training it ran


@dataclass(frozen=True)
class DPSGDConfig:
    """The DP-SGD of one client's training: per-example clip norm, noise multiplier, delta, and
    the seed of its noise and batch order. Both must be secret for the guarantee (the noise
    could be subtracted, and the accounting's amplification by sampling assumes nobody knows
    which examples a step used): the caller draws it from the OS unless a test fixes it."""

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    seed: int | None = None


def _opacus() -> None:
    """Opacus, or an error that says how to install it."""
    try:
        import opacus  # noqa: F401
    except ImportError as err:
        raise ImportError("privacy.record_dp=dpsgd needs Opacus: pip install 'pflower[dpsgd]' (or opacus>=1.5)") from err


def model_problems(model: nn.Module) -> list[str]:
    """Why Opacus cannot train ``model`` with per-example gradients (empty when it can)."""
    _opacus()
    from opacus.validators import ModuleValidator

    return [str(err).split(". ")[0] for err in ModuleValidator.validate(model, strict=False)]


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, config: DPSGDConfig, batch_size: int,
                 seed: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` with per-example gradients (trains the same parameters) and ``optimizer``
    clipping them and adding the noise (drawn from ``seed``). Call :func:`release` after training."""
    _opacus()
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    problems = model_problems(model)
    if problems:
        raise ValueError(f"privacy.record_dp=dpsgd: Opacus cannot train this model: {problems[0]}")
    for module in model.modules():   # an in-place activation would overwrite what Opacus' hooks keep
        if getattr(module, "inplace", False):
            module.inplace = False       # type: ignore[assignment]
    generator = torch.Generator(device=device).manual_seed(seed)
    private = GradSampleModule(model)
    return private, DPOptimizer(optimizer, noise_multiplier=config.noise_multiplier,
                                max_grad_norm=config.max_grad_norm, expected_batch_size=batch_size,
                                generator=generator)


def release(private: nn.Module) -> None:
    """Remove Opacus' hooks and per-example gradients from the model."""
    private._close()  # type: ignore[operator]


def epsilon_of(history: Iterable[tuple[float, float, int]], delta: float) -> float:
    """epsilon at ``delta`` of trainings ``(noise_multiplier, sample_rate, steps)`` composed."""
    _opacus()
    from opacus.accountants import RDPAccountant

    steps = [(float(z), float(q), int(n)) for z, q, n in history if n > 0]
    if not steps:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = steps
    return float(accountant.get_epsilon(delta))


def record_training(folder: Path, entry: dict[str, float | int | str]) -> list[tuple[float, float, int]]:
    """Append one private training to the client's ledger; returns every training on it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LEDGER, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
    return ledger(folder)


def ledger(folder: Path) -> list[tuple[float, float, int]]:
    """The ``(noise_multiplier, sample_rate, steps)`` of every private training in ``folder``'s ledger."""
    path = folder / LEDGER
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            out.append((float(e["noise_multiplier"]), float(e["sample_rate"]), int(e["steps"])))
    return out
