"""Method name -> (server Strategy class, client trainer class), in one table.

Modules are imported on first use, so a method's code is only loaded when it runs. A
variant (e.g. FedProx's BABU form, ``strategy.body_only=true``) swaps both classes.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from client.trainer import ClientTrainer
    from strategies.base import PersonalizedStrategy

# name -> ("server module:Class", "client module:Class")
METHODS: dict[str, tuple[str, str]] = {
    "fedavg": ("strategies.baselines:FedAvg", "client.trainer:ClientTrainer"),
    "fedavg-ft": ("strategies.baselines:FedAvgFT", "client.baselines:FedAvgFTTrainer"),
    "local": ("strategies.baselines:Local", "client.baselines:LocalTrainer"),
    "fedprox": ("strategies.baselines:FedProx", "client.baselines:FedProxTrainer"),
    "fedbn": ("strategies.baselines:FedBN", "client.baselines:FedBNTrainer"),
    "ditto": ("strategies.baselines:Ditto", "client.baselines:DittoTrainer"),
    "fedbabu": ("strategies.fedbabu:FedBABU", "client.fedbabu:FedBABUTrainer"),
    "fdse": ("strategies.fdse:FDSE", "client.fdse:FDSETrainer"),
    "fedora": ("strategies.fedora:FEDORA", "client.fedora:FEDORATrainer"),
}

# (method name, option that must be true) -> the variant's (server, client) classes
VARIANTS: dict[tuple[str, str], tuple[str, str]] = {
    ("fedprox", "body_only"): ("strategies.fedbabu:FedProxBABU", "client.fedbabu:FedProxBABUTrainer"),
}

STRATEGIES = tuple(METHODS)


def _paths(name: str, options: Mapping[str, Any] | None) -> tuple[str, str]:
    if name not in METHODS:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(sorted(METHODS))}")
    for (variant, flag), paths in VARIANTS.items():
        if name == variant and options is not None and bool(options.get(flag, False)):
            return paths
    return METHODS[name]


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def strategy_class(name: str, options: Mapping[str, Any] | None = None) -> type[PersonalizedStrategy]:
    return _load(_paths(name, options)[0])


def trainer_class(name: str, options: Mapping[str, Any] | None = None) -> type[ClientTrainer]:
    return _load(_paths(name, options)[1])
