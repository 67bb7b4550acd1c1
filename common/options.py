"""The options every method has (:class:`MethodOptions`) and the checks an options class uses.

Each method's options class subclasses :class:`MethodOptions` and lives with the method's
pure part (``strategies/<name>_math.py``; the baselines' two, FedProx's and Ditto's, here),
named by the ``options`` key of its YAML row (``common/methods.py``). The defaults live in
``conf/strategy/<name>.yaml`` and nowhere else: :func:`read_options` (``learning/typed.py``'s
reader) requires every field to be present in ``cfg.strategy`` (a missing key names the YAML
file to fix) and rejects unknown keys (a typo such as ``strategy.muu`` fails before
training, not silently). Each class checks its own ranges in ``__post_init__`` with
:func:`check_option`, :func:`check_choice` and :func:`check_finite`.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from learning.typed import ConfigKeyError, check, finite, one_of, read_typed


class OptionsError(ConfigKeyError):
    """A strategy option is missing, unknown or out of range; the message names the fix."""


def check_option(ok: bool, message: str) -> None:
    check(ok, message, OptionsError)


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    one_of(f"strategy.{name}", value, valid, OptionsError)


def check_finite(name: str, value: float, low: float = -math.inf, strict: bool = False) -> None:
    finite(f"strategy.{name}", value, low, strict, OptionsError)


@dataclasses.dataclass(frozen=True)
class MethodOptions:
    """Options every method has: its name and whether server means are sample-weighted."""

    name: str
    weighted: bool

    def not_private(self) -> str:
        """Why these settings of the method need each client's own upload at the server, so that
        neither DP of the mean nor secure aggregation applies ("" when they do not). A method
        whose rule always needs it says so in its YAML row's ``not_private`` instead; one whose
        rule needs it only in some settings (FedBasis' bases seeded from the clients' models)
        overrides this, naming the setting that lifts it."""
        return ""


@dataclasses.dataclass(frozen=True)
class FedProxOptions(MethodOptions):
    """FedProx: ``mu`` of the proximal term mu/2 ||w - w^t||^2; ``body_only`` = the BABU form."""

    mu: float
    body_only: bool

    def __post_init__(self) -> None:
        check_finite("mu", self.mu, 0.0)


@dataclasses.dataclass(frozen=True)
class DittoOptions(MethodOptions):
    """Ditto: ``lam`` of the personal model's proximal term; ``personal_epochs`` (null = the
    local epochs) of personal training per round."""

    lam: float
    personal_epochs: int | None

    def __post_init__(self) -> None:
        check_finite("lam", self.lam, 0.0)
        check_option(self.personal_epochs is None or self.personal_epochs >= 1,
                     f"strategy.personal_epochs must be >= 1 or null, got {self.personal_epochs}")


def read_options(cls: type[MethodOptions], strategy: Mapping[str, Any]) -> MethodOptions:
    """Build and validate ``cls`` from ``cfg.strategy``: every field required, no unknown keys."""
    return read_typed(cls, strategy, "strategy", "conf/strategy/{name}.yaml", OptionsError)
