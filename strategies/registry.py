"""Strategy name -> server Strategy class. Method modules are imported on first use."""

from __future__ import annotations

import importlib

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


def strategy_class(name: str) -> type[PersonalizedStrategy]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(sorted(STRATEGIES))}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)
