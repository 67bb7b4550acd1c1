"""One validated options object per method, read by the server and the client alike.

The defaults live in ``conf/strategy/<name>.yaml`` and nowhere else: :func:`read_options`
(``learning/typed.py``'s reader) requires every field to be present in ``cfg.strategy`` (a
missing key names the YAML file to fix) and rejects unknown keys (a typo such as
``strategy.muu`` fails before training, not silently). Each class checks its own ranges in
``__post_init__``.

This module deliberately has no ``from __future__ import annotations``: the field types
are read at run time to convert YAML values.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from learning.typed import ConfigKeyError, check, finite, one_of, read_typed


class OptionsError(ConfigKeyError):
    """A strategy option is missing, unknown or out of range; the message names the fix."""


def _check(ok: bool, message: str) -> None:
    check(ok, message, OptionsError)


def _one_of(name: str, value: str, valid: tuple[str, ...]) -> None:
    one_of(f"strategy.{name}", value, valid, OptionsError)


def _finite(name: str, value: float, low: float = -math.inf, strict: bool = False) -> None:
    finite(f"strategy.{name}", value, low, strict, OptionsError)


@dataclasses.dataclass(frozen=True)
class MethodOptions:
    """Options every method has: its name and whether server means are sample-weighted."""

    name: str
    weighted: bool


@dataclasses.dataclass(frozen=True)
class FedProxOptions(MethodOptions):
    """FedProx: ``mu`` of the proximal term mu/2 ||w - w^t||^2; ``body_only`` = the BABU form."""

    mu: float
    body_only: bool

    def __post_init__(self) -> None:
        _finite("mu", self.mu, 0.0)


@dataclasses.dataclass(frozen=True)
class DittoOptions(MethodOptions):
    """Ditto: ``lam`` of the personal model's proximal term; ``personal_epochs`` (null = the
    local epochs) of personal training per round."""

    lam: float
    personal_epochs: int | None

    def __post_init__(self) -> None:
        _finite("lam", self.lam, 0.0)
        _check(self.personal_epochs is None or self.personal_epochs >= 1,
               f"strategy.personal_epochs must be >= 1 or null, got {self.personal_epochs}")


@dataclasses.dataclass(frozen=True)
class FedBABUOptions(MethodOptions):
    """FedBABU: how the fixed head is initialised (and the orthogonal init's gain)."""

    head_init: str
    head_gain: float

    def __post_init__(self) -> None:
        _one_of("head_init", self.head_init, ("orthogonal", "default"))
        _finite("head_gain", self.head_gain, 0.0, strict=True)


@dataclasses.dataclass(frozen=True)
class FDSEOptions(MethodOptions):
    """FDSE: consistency loss (lam, beta, form, first round), server rules (tau,
    consensus_tol, zero_policy) and unseen-domain adaptation (adapt_*)."""

    lam: float
    beta: float
    tau: float
    consistency_form: str
    consistency_from_round: int
    consensus_tol: float
    zero_policy: str
    adapt_epochs: int
    adapt_lr: float
    adapt_on: str
    evaluate: str

    def __post_init__(self) -> None:
        _one_of("evaluate", self.evaluate, ("trained", "aggregated"))
        _finite("lam", self.lam, 0.0)
        _finite("beta", self.beta)
        _finite("tau", self.tau, 0.0, strict=True)
        _one_of("consistency_form", self.consistency_form, ("paper", "code"))
        _finite("consensus_tol", self.consensus_tol, 0.0)
        _one_of("zero_policy", self.zero_policy, ("exclude", "include"))
        _check(self.adapt_epochs >= 0, f"strategy.adapt_epochs must be >= 0, got {self.adapt_epochs}")
        _finite("adapt_lr", self.adapt_lr, 0.0, strict=True)
        _one_of("adapt_on", self.adapt_on, ("train", "test"))


@dataclasses.dataclass(frozen=True)
class FEDORAOptions(MethodOptions):
    """FEDORA: propagation strength, similarity form, data-subspace basis, selective lambda."""

    alpha: float
    similarity: str
    top_k: int | None
    temperature: float
    self_loops: bool
    basis_rank: int
    basis_labels: bool
    lambda_form: str
    eps: float
    lambda_max: float | str | None
    basis_inputs: str
    penalty: str

    def __post_init__(self) -> None:
        _one_of("basis_inputs", self.basis_inputs, ("unit", "normalised"))
        _one_of("penalty", self.penalty, ("loss", "decoupled"))
        _check(self.lambda_max is None or self.lambda_max == "auto"
               or (isinstance(self.lambda_max, int | float) and not isinstance(self.lambda_max, bool)
                   and math.isfinite(self.lambda_max) and self.lambda_max > 0),
               f"strategy.lambda_max must be auto, a number > 0 or null (unbounded), got {self.lambda_max!r}")
        _finite("alpha", self.alpha, 0.0, strict=True)
        _one_of("similarity", self.similarity, ("paper", "code"))
        _check(self.top_k is None or self.top_k >= 1, f"strategy.top_k must be >= 1 or null, got {self.top_k}")
        _finite("temperature", self.temperature)
        _check(self.basis_rank >= 1, f"strategy.basis_rank must be >= 1, got {self.basis_rank}")
        _one_of("lambda_form", self.lambda_form, ("paper", "code"))
        _finite("eps", self.eps, 0.0)


@dataclasses.dataclass(frozen=True)
class PartialFedFixOptions(MethodOptions):
    """PartialFed-Fix: the named loading rule (``strategies.partialfed_math.FIX_RULES``)."""

    rule: str

    def __post_init__(self) -> None:
        _one_of("rule", self.rule, ("all", "no-bn", "no-fc", "no-bn-fc", "s1", "s1-s2", "s1-s3", "s1-s4",
                                    "fc", "s4-fc", "s3-fc", "s2-fc", "ABCD", "abcd"))


@dataclasses.dataclass(frozen=True)
class PartialFedAdaptiveOptions(MethodOptions):
    """PartialFed-Adaptive: unit granularity, Gumbel temperature schedule, the f_m/f_s
    alternation, the logits' learning rate and how the round's model is taken."""

    granularity: str
    tau_start: float
    tau_end: float
    tau_schedule: str
    model_batches: int
    strategy_batches: int
    gate_lr: float | None
    final: str
    finetune_epochs: int

    def __post_init__(self) -> None:
        _one_of("granularity", self.granularity, ("stage", "block", "layer"))
        _finite("tau_start", self.tau_start, 0.0, strict=True)
        _finite("tau_end", self.tau_end, 0.0, strict=True)
        _one_of("tau_schedule", self.tau_schedule, ("exp", "linear"))
        _check(self.model_batches >= 1, f"strategy.model_batches (f_m) must be >= 1, got {self.model_batches}")
        _check(self.strategy_batches >= 1,
               f"strategy.strategy_batches (f_s) must be >= 1, got {self.strategy_batches}")
        _check(self.gate_lr is None or self.gate_lr > 0, f"strategy.gate_lr must be > 0 or null, got {self.gate_lr}")
        _one_of("final", self.final, ("soft", "hard"))
        _check(self.finetune_epochs >= 0, f"strategy.finetune_epochs must be >= 0, got {self.finetune_epochs}")


@dataclasses.dataclass(frozen=True)
class FedBasisOptions(MethodOptions):
    """FedBasis (Chen et al., arXiv 2304.07882): the basis model and its coordinate descent.

    ``num_bases`` K (besides the major basis when ``major``); one coefficient vector per unit
    of ``granularity``; per round ``coeff_epochs`` on the logits (bases frozen, lr
    ``coeff_lr``, null = train.lr), sharpening by ``sharpen_tau``, ``basis_epochs`` on the
    bases (logits frozen); FedAvg for the first ``warm_fraction`` of the rounds, then the
    bases are seeded from the clients' models by ``seed_bases`` (kmeans | sample); new
    clients learn their logits and, with ``personalize_head``, the classifier.
    """

    num_bases: int
    major: bool
    granularity: str
    coeff_epochs: int
    basis_epochs: int
    coeff_lr: float | None
    sharpen_tau: float
    warm_fraction: float
    seed_bases: str
    personalize_head: bool

    def __post_init__(self) -> None:
        _check(self.num_bases >= 1, f"strategy.num_bases must be >= 1, got {self.num_bases}")
        _one_of("granularity", self.granularity, ("stage", "block", "layer"))
        _check(self.coeff_epochs >= 0, f"strategy.coeff_epochs must be >= 0, got {self.coeff_epochs}")
        _check(self.basis_epochs >= 0, f"strategy.basis_epochs must be >= 0, got {self.basis_epochs}")
        _check(self.coeff_lr is None or self.coeff_lr > 0, f"strategy.coeff_lr must be > 0 or null, got {self.coeff_lr}")
        _check(0 < self.sharpen_tau <= 1, f"strategy.sharpen_tau must be in (0, 1], got {self.sharpen_tau}")
        _check(0 <= self.warm_fraction < 1, f"strategy.warm_fraction must be in [0, 1), got {self.warm_fraction}")
        _one_of("seed_bases", self.seed_bases, ("kmeans", "sample"))


def read_options(cls: type[MethodOptions], strategy: Mapping[str, Any]) -> MethodOptions:
    """Build and validate ``cls`` from ``cfg.strategy``: every field required, no unknown keys."""
    return read_typed(cls, strategy, "strategy", "conf/strategy/{name}.yaml", OptionsError)
