"""Strategy name -> client trainer class. Method modules are imported on first use."""

from __future__ import annotations

import importlib

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


def trainer_class(name: str) -> type[ClientTrainer]:
    if name not in TRAINERS:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(sorted(TRAINERS))}")
    module, cls = TRAINERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
