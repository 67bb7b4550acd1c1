"""Strategy name -> server Strategy class. Method modules are imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from strategies.base import PersonalizedStrategy

STRATEGIES: dict[str, str] = {
    "fedavg": "strategies.baselines:FedAvg",
    "fedavg-ft": "strategies.baselines:FedAvgFT",
    "local": "strategies.baselines:Local",
    "fedprox": "strategies.baselines:FedProx",
    "fedbn": "strategies.baselines:FedBN",
    "ditto": "strategies.baselines:Ditto",
    "fedbabu": "strategies.fedbabu:FedBABU",
    "fdse": "strategies.fdse:FDSE",
    "fedora": "strategies.fedora:FEDORA",
}


# (strategy name, option that must be true) -> variant class
VARIANTS: dict[tuple[str, str], str] = {("fedprox", "body_only"): "strategies.fedbabu:FedProxBABU"}


def strategy_class(name: str, options: Mapping[str, Any] | None = None) -> type[PersonalizedStrategy]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(sorted(STRATEGIES))}")
    for (variant, flag), path in VARIANTS.items():
        if name == variant and options is not None and bool(options.get(flag, False)):
            module, cls = path.split(":")
            return getattr(importlib.import_module(module), cls)
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)
