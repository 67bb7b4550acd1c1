"""Strategy name -> client trainer class. Method modules are imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from client.trainer import ClientTrainer

# name -> "module:Class"
TRAINERS: dict[str, str] = {
    "fedavg": "client.trainer:ClientTrainer",
    "fedavg-ft": "client.baselines:FedAvgFTTrainer",
    "local": "client.baselines:LocalTrainer",
    "fedprox": "client.baselines:FedProxTrainer",
    "fedbn": "client.baselines:FedBNTrainer",
    "ditto": "client.baselines:DittoTrainer",
    "fedbabu": "client.fedbabu:FedBABUTrainer",
    "fdse": "client.fdse:FDSETrainer",
    "fedora": "client.fedora:FEDORATrainer",
}


# (strategy name, option that must be true) -> variant class
VARIANTS: dict[tuple[str, str], str] = {("fedprox", "body_only"): "client.fedbabu:FedProxBABUTrainer"}


def trainer_class(name: str, options: Mapping[str, Any] | None = None) -> type[ClientTrainer]:
    if name not in TRAINERS:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(sorted(TRAINERS))}")
    for (variant, flag), path in VARIANTS.items():
        if name == variant and options is not None and bool(options.get(flag, False)):
            module, cls = path.split(":")
            return getattr(importlib.import_module(module), cls)
    module, cls = TRAINERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
