"""The command line's overrides and Flower's run-config: reading one override (Hydra's own
parser), splitting the run-config keys from the rest, and expanding a sweep's grid.

``pflower run`` takes Hydra overrides; Flower's run-config (``flwr run . --run-config ...``)
carries the same run as a few named keys plus one ``overrides`` string. Both directions live
here, so the CLI, the ServerApp and the ClientApp read an override one way.
"""

from __future__ import annotations

import functools
import itertools
import json
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from common.errors import ConfigError

if TYPE_CHECKING:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Override

# Flower run-config key -> Hydra key (empty values mean "keep the conf/ default").
RUN_CONFIG_KEYS = {
    "strategy": "strategy",
    "dataset": "dataset",
    "model": "model",
    "experiment": "experiment",
    "rounds": "rounds",
    "seed": "seed",
    "run-name": "run_name",
    "results-root": "results_root",
}


def run_config_to_overrides(run_config: Mapping[str, Any]) -> list[str]:
    """Turn Flower run-config entries into Hydra override strings."""
    overrides: list[str] = []
    for key, hydra_key in RUN_CONFIG_KEYS.items():
        value = run_config.get(key, "")
        if value is None or str(value) == "":
            continue
        overrides.append(f"{hydra_key}={value}")
    extra = str(run_config.get("overrides", "") or "")
    overrides.extend(shlex.split(extra))
    return overrides


# ---------------------------------------------------------------- command-line overrides
# command-line key -> Flower run-config key (the inverse of RUN_CONFIG_KEYS)
CLI_RUN_CONFIG_KEYS = {"strategy": "strategy", "dataset": "dataset", "model": "model",
                   "experiment": "experiment", "rounds": "rounds", "seed": "seed",
                   "run_name": "run-name", "results_root": "results-root"}


# ---------------------------------------------------------------- reading one override
@functools.lru_cache(maxsize=4096)
def parse_override(text: str) -> Override:
    """One command-line override read by Hydra's own parser (the one place pflower reads an
    override's key and value: prefixes ``+``, ``++``, ``~``, quotes, lists, sweeps)."""
    from hydra.errors import HydraException

    try:
        return hydra_override_parser().parse_override(text)
    except HydraException as err:
        hint = " is not KEY=VALUE (e.g. strategy=fedbn)" if "=" not in text and not text.startswith("~") \
            else " cannot be read"
        raise ConfigError(f"override {text!r}{hint}: {str(err).splitlines()[0]}") from None


@functools.cache
def hydra_override_parser() -> OverridesParser:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def override_key(text: str) -> str:
    """The key (or group) an override sets, without its prefix: ``+train.lr=1`` -> ``train.lr``."""
    return str(parse_override(text).key_or_group)


def override_value(text: str) -> Any:
    """An override's value as Hydra reads it (quotes removed; ``seed=1`` -> 1)."""
    return parse_override(text).value()


def override_values(overrides: list[str], key: str) -> list[Any]:
    """The values the overrides give ``key``, in order (the last one wins)."""
    return [override_value(o) for o in overrides if override_key(o) == key]


def split_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """Separate run-config keys (strategy=..., seed=...) from other Hydra overrides."""
    run_cfg: dict[str, str] = {}
    rest: list[str] = []
    for ov in overrides:
        override = parse_override(ov)
        if override.get_key_element() in CLI_RUN_CONFIG_KEYS and not override.is_sweep_override():
            run_cfg[CLI_RUN_CONFIG_KEYS[override.key_or_group]] = ov.partition("=")[2]
        else:
            rest.append(ov)
    return run_cfg, rest


def to_toml_run_config(run_cfg: dict[str, str], rest: list[str]) -> str:
    items = dict(run_cfg)
    if rest:
        items["overrides"] = " ".join(shlex.quote(o) for o in rest)
    return " ".join(f"{k}={json.dumps(str(v))}" for k, v in items.items())


def _unexpanded_sweeps() -> tuple[Any, ...]:
    from hydra.core.override_parser.types import ValueType

    # glob(...) names config files and interval(...) asks a sampler: neither is a list of runs
    return (ValueType.GLOB_CHOICE_SWEEP, ValueType.INTERVAL_SWEEP)


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Hydra's sweep syntax, expanded as its basic sweeper does: ``a=1,2 b=x`` -> [[a=1, b=x],
    [a=2, b=x]]; ``seed=range(0,3)``; ``'x,y'`` and ``[x,y]`` are one value. A swept value is
    written as Hydra writes it (``1e-3`` -> ``0.001``); an override that is not swept is kept
    as given."""
    axes = []
    for text in overrides:
        override = parse_override(text)
        if not override.is_sweep_override():
            axes.append([text])
        elif override.is_hydra_override() or override.value_type in _unexpanded_sweeps():
            raise ConfigError(f"override {text!r}: pflower sweeps comma lists and range(); list the values "
                              "(e.g. strategy=fedavg,fedbn)")
        else:
            axes.append([f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()])
    return [list(c) for c in itertools.product(*axes)]
