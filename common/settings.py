"""The run keys and the ``train``, ``finetune`` and ``personalize`` groups, typed and checked.

Their defaults are in ``conf/config.yaml`` only. Composition (``common/config.py``) reads
each group into its class with ``learning/typed.py``'s reader, so every key is required, an
unknown key (``+train.lrr=0.1``) is refused by name, and each class checks its ranges in
``__post_init__``: a bad value fails before any process starts. ``dataset`` and ``model``
are typed next to their registries (``learning/datasets/config.py: DatasetConfig``,
``learning/models.py: MODELS``), the method options in ``common/options.py``.

This module deliberately has no ``from __future__ import annotations``: the field types are
read at run time to convert YAML values.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.methods import ResolvedMethod
from learning.typed import check, finite, one_of

if TYPE_CHECKING:
    from learning.training import OptimConfig

# The BN-statistics protocols a personal model is tested under, the one vocabulary of the code,
# summaries and tables: "own" = running statistics recomputed on the client's train split at the
# tested weights, "stored" = as training, aggregation or propagation left them. The config key
# eval_bn_statistics names them by what the client does (recompute / stored).
BN_OWN, BN_STORED = "own", "stored"
BN_PROTOCOLS = (BN_OWN, BN_STORED)
BN_PROTOCOL_OF_SETTING = {"recompute": BN_OWN, "stored": BN_STORED}

# the top-level keys of conf/config.yaml that are config groups, not run keys
GROUP_KEYS = ("strategy", "dataset", "model", "train", "finetune", "personalize", "privacy")


@dataclass(frozen=True)
class RunKeys:
    """The top-level keys of ``conf/config.yaml`` (see the comments there)."""

    run_name: str
    results_root: str
    state_root: str
    seed: int
    rounds: int
    eval_every: int
    eval_in_train: bool
    eval_bn_statistics: str
    eval_bn_compare: bool
    best_round_by: str
    fraction_train: float
    min_train_clients: int
    round_timeout: float
    wait_for_clients: float
    deterministic: bool
    device: str
    tensorboard: bool
    checkpoint_every: int
    data_cache: str
    resume: str
    overwrite: bool
    norm_bound: float
    stream_replies_mb: float | None
    strategy_overrides: dict[str, list[str]]

    def __post_init__(self) -> None:
        check(self.rounds >= 1, f"rounds must be >= 1, got {self.rounds}")
        check(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        check(self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}")
        check(0 < self.fraction_train <= 1, f"fraction_train must be in (0, 1], got {self.fraction_train}")
        check(self.min_train_clients >= 1, f"min_train_clients must be >= 1, got {self.min_train_clients}")
        finite("round_timeout", self.round_timeout, 0.0, strict=True)
        finite("wait_for_clients", self.wait_for_clients, 0.0, strict=True)
        check(self.checkpoint_every >= 0, f"checkpoint_every must be >= 0 (0 = never), got {self.checkpoint_every}")
        finite("norm_bound", self.norm_bound, 0.0)
        if self.stream_replies_mb is not None:
            finite("stream_replies_mb", self.stream_replies_mb, 0.0)
        one_of("eval_bn_statistics", self.eval_bn_statistics, tuple(BN_PROTOCOL_OF_SETTING))
        check(self.best_round_by in ("mean", "weighted"), "best_round_by must be mean (over clients) or "
              f"weighted (by validation size), got {self.best_round_by!r}")
        bad = [o for extra in self.strategy_overrides.values() for o in extra if "=" not in o]
        check(not bad, f"strategy_overrides holds KEY=VALUE overrides per strategy name, got {bad}")
        check(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
              f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def bn_protocols(self) -> tuple[str, ...]:
        """The BN protocols a personal model with BN is tested under: the headline's
        (``eval_bn_statistics``) first, then the other when ``eval_bn_compare`` is on."""
        chosen = BN_PROTOCOL_OF_SETTING[self.eval_bn_statistics]
        other = tuple(p for p in BN_PROTOCOLS if p != chosen)
        return (chosen, *other) if self.eval_bn_compare else (chosen,)

    @property
    def run_dir(self) -> Path:
        """The run's folder: ``<results_root>/<run_name>``."""
        return Path(self.results_root) / self.run_name


@dataclass(frozen=True)
class TrainSettings:
    """``train``: the clients' local optimisation."""

    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    clip: float
    lr_schedule: str
    lr_decay: float
    lr_milestones: tuple[float, ...]
    lr_gamma: float
    optimizer: str
    amp: bool
    compile: bool

    def __post_init__(self) -> None:
        check(self.local_epochs >= 0, f"train.local_epochs must be >= 0, got {self.local_epochs}")
        check(self.batch_size >= 1, f"train.batch_size must be >= 1, got {self.batch_size}")
        finite("train.lr", self.lr, 0.0, strict=True)
        check(0 <= self.momentum < 1, f"train.momentum must be in [0, 1), got {self.momentum}")
        finite("train.weight_decay", self.weight_decay, 0.0)
        finite("train.clip", self.clip, 0.0)
        one_of("train.lr_schedule", self.lr_schedule, ("exp", "step"))
        check(0 < self.lr_decay <= 1, f"train.lr_decay must be in (0, 1], got {self.lr_decay}")
        check(all(0 < m < 1 for m in self.lr_milestones),
              f"train.lr_milestones must be fractions of the rounds in (0, 1), got {list(self.lr_milestones)}")
        check(0 < self.lr_gamma <= 1, f"train.lr_gamma must be in (0, 1], got {self.lr_gamma}")
        one_of("train.optimizer", self.optimizer, ("sgd", "adam"))

    def optim(self, lr_scale: float = 1.0) -> "OptimConfig":
        """A round's local optimisation, its learning rate scaled by the round's schedule."""
        from learning.training import OptimConfig

        return OptimConfig(lr=self.lr * lr_scale, batch_size=self.batch_size, momentum=self.momentum,
                           weight_decay=self.weight_decay, epochs=self.local_epochs, clip=self.clip,
                           optimizer=self.optimizer, amp=self.amp, compile=self.compile)


@dataclass(frozen=True)
class FinetuneSettings:
    """``finetune``: the +FT methods' personalisation at evaluation."""

    every: int
    epochs: int
    lr: float
    momentum: float
    weight_decay: float
    batch_size: int
    part: str
    curve_epochs: tuple[int, ...]
    curve: bool

    def __post_init__(self) -> None:
        check(self.every >= 0, f"finetune.every must be >= 0 (0 = at the final evaluation only), got {self.every}")
        check(self.epochs >= 0, f"finetune.epochs must be >= 0, got {self.epochs}")
        finite("finetune.lr", self.lr, 0.0, strict=True)
        check(0 <= self.momentum < 1, f"finetune.momentum must be in [0, 1), got {self.momentum}")
        finite("finetune.weight_decay", self.weight_decay, 0.0)
        check(self.batch_size >= 1, f"finetune.batch_size must be >= 1, got {self.batch_size}")
        one_of("finetune.part", self.part, ("full", "head", "body"))
        check(all(e >= 0 for e in self.curve_epochs), f"finetune.curve_epochs must be >= 0, got "
              f"{list(self.curve_epochs)}")

    def optim(self, train: TrainSettings) -> "OptimConfig":
        """One epoch of fine-tuning with this group's own settings (the clip and the
        optimiser are training's); epochs are counted by the caller."""
        return personalising_optim(self.lr, self.batch_size, self.momentum, self.weight_decay, train)


@dataclass(frozen=True)
class PersonalizeSettings:
    """``personalize``: the new-client protocol of ``pflower personalize``."""

    epochs: int
    lr: float | None
    lrs: tuple[float, ...]
    sizes: dict[str, float]
    batch_size: int
    momentum: float
    weight_decay: float
    after_run: bool

    def __post_init__(self) -> None:
        check(self.epochs >= 1, f"personalize.epochs must be >= 1, got {self.epochs}")
        check((self.lr is None or self.lr > 0) and bool(self.lrs) and all(lr > 0 for lr in self.lrs),
              "personalize.lr must be null or > 0 and personalize.lrs a non-empty list of numbers > 0")
        check(bool(self.sizes) and all(0 < s <= 1 for s in self.sizes.values()),
              f"personalize.sizes must be shares in (0, 1], got {self.sizes}")
        check(self.batch_size >= 1, f"personalize.batch_size must be >= 1, got {self.batch_size}")
        check(0 <= self.momentum < 1, f"personalize.momentum must be in [0, 1), got {self.momentum}")
        finite("personalize.weight_decay", self.weight_decay, 0.0)

    def optim(self, train: TrainSettings, lr: float) -> "OptimConfig":
        """One epoch of a new client's personalisation at ``lr`` (one of ``lrs``)."""
        return personalising_optim(lr, self.batch_size, self.momentum, self.weight_decay, train)


def personalising_optim(lr: float, batch_size: int, momentum: float, weight_decay: float,
                        train: TrainSettings) -> "OptimConfig":
    """Fine-tuning's and new clients' optimiser: one epoch (the caller counts them), the
    clip and optimiser of ``train``, full precision."""
    from learning.training import OptimConfig

    return OptimConfig(lr=lr, batch_size=batch_size, momentum=momentum, weight_decay=weight_decay,
                       epochs=1, clip=train.clip, optimizer=train.optimizer)


DP_MODES = ("none", "central", "distributed")
SECURE_AGGREGATION_MODES = ("none", "secagg+")
RECORD_DP_MODES = ("none", "dpsgd")


@dataclass(frozen=True)
class PrivacySettings:
    """``privacy``: client-level differential privacy of the shared part (docs/privacy.md)."""

    dp: str
    clip_norm: float
    noise_multiplier: float
    delta: float
    max_epsilon: float | None
    noise_seed: int | None
    secure_aggregation: str = "none"
    secagg_shares: int | None = None
    secagg_threshold: float = 0.5
    secagg_clip_range: float = 4.0
    secagg_bits: int = 22
    record_dp: str = "none"
    record_noise_multiplier: float = 1.0
    record_clip: float = 1.0

    def __post_init__(self) -> None:
        one_of("privacy.dp", self.dp, DP_MODES)
        one_of("privacy.secure_aggregation", self.secure_aggregation, SECURE_AGGREGATION_MODES)
        check(self.secagg_shares is None or self.secagg_shares >= 3,
              f"privacy.secagg_shares must be null (every sampled client) or >= 3, got {self.secagg_shares}")
        t = self.secagg_threshold
        check((0 < t < 1) or (t >= 2 and float(t).is_integer()),
              f"privacy.secagg_threshold must be a fraction in (0, 1) of the neighbourhood or a whole count >= 2, got {t}")
        finite("privacy.secagg_clip_range", self.secagg_clip_range, 0.0, strict=True)
        check(8 <= self.secagg_bits <= 30, f"privacy.secagg_bits must be in [8, 30], got {self.secagg_bits}")
        one_of("privacy.record_dp", self.record_dp, RECORD_DP_MODES)
        finite("privacy.record_noise_multiplier", self.record_noise_multiplier, 0.0, strict=True)
        finite("privacy.record_clip", self.record_clip, 0.0, strict=True)
        finite("privacy.clip_norm", self.clip_norm, 0.0, strict=True)
        finite("privacy.noise_multiplier", self.noise_multiplier, 0.0, strict=True)
        check(0 < self.delta < 1, f"privacy.delta must be in (0, 1), got {self.delta}")
        if self.max_epsilon is not None:
            finite("privacy.max_epsilon", self.max_epsilon, 0.0, strict=True)
        check(self.noise_seed is None or self.noise_seed >= 0,
              f"privacy.noise_seed must be null (the OS's randomness) or >= 0, got {self.noise_seed}")

    @property
    def central(self) -> bool:
        """Whether the server clips the shared updates and noises their mean."""
        return self.dp == "central"

    @property
    def distributed(self) -> bool:
        """Whether the clients add the noise (under secure aggregation), each its share of it."""
        return self.dp == "distributed"

    @property
    def enabled(self) -> bool:
        """Whether the shared part is differentially private (clipped, noised, accounted)."""
        return self.dp != "none"

    @property
    def dpsgd(self) -> bool:
        """Whether each client trains with record-level DP-SGD (Opacus)."""
        return self.record_dp == "dpsgd"

    @property
    def secure(self) -> bool:
        """Whether the shared part is summed under SecAgg+ (the server sees only the sum)."""
        return self.secure_aggregation == "secagg+"

    @property
    def guards_uploads(self) -> bool:
        """Whether what a client sends is protected (DP of the mean, or secure aggregation): then
        a client reports no personal parameter among its metrics either (FedBasis' coefficients)."""
        return self.enabled or self.secure


@dataclass(frozen=True)
class Settings:
    """One composed run's settings, typed: what every module reads instead of casting the
    ``DictConfig`` (``int(cfg.seed)``). Composition reads it once per configuration
    (``common/config.py: compose_run``, which hands it down with the config as a ``ComposedRun``); the groups that depend on the choice (``dataset``,
    ``model``) keep their typed readers beside their registries, and only their names are here;
    the method is resolved (its row, variant applied, and its typed options)."""

    run: RunKeys
    train: TrainSettings
    finetune: FinetuneSettings
    personalize: PersonalizeSettings
    privacy: PrivacySettings
    method: ResolvedMethod
    dataset: str
    model: str

    @property
    def strategy(self) -> str:
        """The configured method's name (``strategy.name``)."""
        return self.method.name
