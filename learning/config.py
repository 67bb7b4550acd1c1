"""Compose the run's Hydra config from ``conf/`` with the Flower run-config as overrides.

Both apps call :func:`compose_config` with the same run-config, so the server and every
client see the same resolved config. Hydra's global state is per process and Ray actors
live across rounds, so composition happens inside ``initialize_config_dir`` each time
(and the result is cached per run-config).
"""

from __future__ import annotations

import functools
import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("strategy", "dataset", "model", "experiment")
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


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and how to fix it."""


def group_options(group: str) -> list[str]:
    """Valid names of a config group (the yaml files in ``conf/<group>/``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def run_config_to_overrides(run_config: Mapping[str, Any]) -> list[str]:
    """Turn Flower run-config entries into Hydra override strings."""
    overrides: list[str] = []
    for key, hydra_key in RUN_CONFIG_KEYS.items():
        value = run_config.get(key, "")
        if value is None or str(value) == "":
            continue
        if hydra_key in GROUPS:
            overrides.append(f"{hydra_key}={value}")
        else:
            overrides.append(f"{hydra_key}={value}")
    extra = str(run_config.get("overrides", "") or "")
    overrides.extend(shlex.split(extra))
    return overrides


def _check_group_choices(overrides: list[str]) -> None:
    for ov in overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if key in GROUPS:
            options = group_options(key)
            if value not in options:
                raise ConfigError(
                    f"unknown {key} {value!r}; valid {key} names: {', '.join(options)}"
                )


def compose_config(run_config: Mapping[str, Any] | None = None,
                   overrides: list[str] | None = None) -> DictConfig:
    """Compose ``conf/config.yaml`` with run-config entries and extra Hydra overrides."""
    all_overrides = run_config_to_overrides(run_config or {}) + list(overrides or [])
    return _compose_cached(json.dumps(all_overrides))


@functools.lru_cache(maxsize=16)
def _compose_cached(overrides_json: str) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    overrides = json.loads(overrides_json)
    _check_group_choices(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except HydraException as err:
        raise ConfigError(f"invalid config override: {err}") from err
    finally:
        GlobalHydra.instance().clear()
    validate_config(cfg)
    if not cfg.run_name:
        cfg.run_name = f"{cfg.strategy.name}-{cfg.dataset.name}-{cfg.model.name}-s{cfg.seed}"
    OmegaConf.set_readonly(cfg, True)
    return cfg


def validate_config(cfg: DictConfig) -> None:
    """Fail before any training with one clear message per problem."""
    problems: list[str] = []
    if OmegaConf.is_missing(cfg.dataset, "root"):
        problems.append(
            f"dataset {cfg.dataset.name!r} needs a data folder: add overrides=\"dataset.root=/path\" "
            "(see conf/dataset/ for the expected layout)"
        )
    if int(cfg.rounds) < 1:
        problems.append(f"rounds must be >= 1, got {cfg.rounds}")
    if not 0 < float(cfg.fraction_train) <= 1:
        problems.append(f"fraction_train must be in (0, 1], got {cfg.fraction_train}")
    if int(cfg.min_train_clients) < 1:
        problems.append(f"min_train_clients must be >= 1, got {cfg.min_train_clients}")
    if float(cfg.round_timeout) <= 0:
        problems.append(f"round_timeout must be > 0 seconds, got {cfg.round_timeout}")
    if int(cfg.eval_every) < 1:
        problems.append(f"eval_every must be >= 1, got {cfg.eval_every}")
    if float(cfg.train.lr) <= 0:
        problems.append(f"train.lr must be > 0, got {cfg.train.lr}")
    if int(cfg.train.local_epochs) < 0:
        problems.append(f"train.local_epochs must be >= 0, got {cfg.train.local_epochs}")
    if int(cfg.train.batch_size) < 1:
        problems.append(f"train.batch_size must be >= 1, got {cfg.train.batch_size}")
    if str(cfg.finetune.part) not in ("full", "head", "body"):
        problems.append(f"finetune.part must be full, head or body, got {cfg.finetune.part!r}")
    if cfg.resume and not Path(str(cfg.resume)).is_dir():
        problems.append(f"resume={cfg.resume!r} is not a run folder; give the path of an earlier run")
    from learning.data import SOURCES

    if not OmegaConf.is_missing(cfg.dataset, "root") and cfg.dataset.source not in SOURCES:
        problems.append(f"dataset.source {cfg.dataset.source!r} is unknown; valid: {', '.join(SOURCES)}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
