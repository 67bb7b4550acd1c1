"""The method table: one row per method, read by the server, the client and the tests.

A row names the server Strategy class, the client trainer class, the parameter-role rule
(``common/roles.py``) and the options class (``common/options.py``). Classes are imported
on first use, so a process only loads the code of the method it runs. A variant (e.g.
FedProx's BABU form, ``strategy.body_only=true``) is a second row selected by an option.

Adding a method = one row here (plus its YAML, server and client modules): the method
contract test (``tests/test_method_contract.py``) then checks it.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.options import (
    DittoOptions,
    FDSEOptions,
    FedBABUOptions,
    FedBasisOptions,
    FEDORAOptions,
    FedProxOptions,
    MethodOptions,
    PartialFedAdaptiveOptions,
    PartialFedFixOptions,
    read_options,
)

if TYPE_CHECKING:
    from torch import nn

    from client.trainer import ClientTrainer
    from strategies.base import PersonalizedStrategy


@dataclass(frozen=True)
class Method:
    """One method: where its two halves live, how it labels parameters, its options."""

    server: str                     # "module:Class" of the server Strategy
    client: str                     # "module:Class" of the client trainer
    roles: str                      # parameter-role rule (common.roles.RULES)
    options: type[MethodOptions] = MethodOptions
    model: tuple[str, ...] = ()     # models it works with (empty = any)
    wrapper: str = ""               # "module:function" wrapping the network (FedBasis' bases)


METHODS: dict[str, Method] = {
    "fedavg": Method("strategies.baselines:FedAvg", "client.trainer:ClientTrainer", "all-shared"),
    "fedavg-ft": Method("strategies.baselines:FedAvgFT", "client.baselines:FedAvgFTTrainer", "all-shared"),
    "local": Method("strategies.baselines:Local", "client.baselines:LocalTrainer", "all-local"),
    "fedprox": Method("strategies.baselines:FedProx", "client.baselines:FedProxTrainer", "all-shared",
                      FedProxOptions),
    "fedprox-ft": Method("strategies.baselines:FedProxFT", "client.baselines:FedProxFTTrainer", "all-shared",
                         FedProxOptions),
    "fedbn": Method("strategies.baselines:FedBN", "client.baselines:FedBNTrainer", "bn-local"),
    "ditto": Method("strategies.baselines:Ditto", "client.baselines:DittoTrainer", "all-shared",
                    DittoOptions),
    "fedbabu": Method("strategies.fedbabu:FedBABU", "client.fedbabu:FedBABUTrainer", "head-frozen",
                      FedBABUOptions),
    "fdse": Method("strategies.fdse:FDSE", "client.fdse:FDSETrainer", "fdse", FDSEOptions,
                   model=("fdse-alexnet", "fdse-resnet18")),
    "fedora": Method("strategies.fedora:FEDORA", "client.fedora:FEDORATrainer", "all-personal",
                     FEDORAOptions),
    "partialfed-fix": Method("strategies.partialfed:PartialFedFix", "client.partialfed:PartialFedFixTrainer",
                             "all-shared", PartialFedFixOptions),
    "partialfed-adaptive": Method("strategies.partialfed:PartialFedAdaptive",
                                  "client.partialfed:PartialFedAdaptiveTrainer", "all-shared",
                                  PartialFedAdaptiveOptions),
    "fedbasis": Method("strategies.fedbasis:FedBasis", "client.fedbasis:FedBasisTrainer", "fedbasis",
                       FedBasisOptions, wrapper="learning.basis:wrap_in_bases"),
}

# (method name, option that must be true) -> the variant's row
VARIANTS: dict[tuple[str, str], Method] = {
    ("fedprox", "body_only"): Method("strategies.fedbabu:FedProxBABU", "client.fedbabu:FedProxBABUTrainer",
                                     "head-frozen", FedProxOptions),
    # FedProx+BABU fine-tunes at evaluation anyway (as FedBABU): the same variant
    ("fedprox-ft", "body_only"): Method("strategies.fedbabu:FedProxBABU", "client.fedbabu:FedProxBABUTrainer",
                                        "head-frozen", FedProxOptions),
}

STRATEGIES = tuple(METHODS)


def method(name: str, options: Mapping[str, Any] | None = None) -> Method:
    """The row for ``name`` (the variant's row when its option is set)."""
    if name not in METHODS:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(sorted(METHODS))}")
    for (variant, flag), row in VARIANTS.items():
        if name == variant and options is not None and bool(options.get(flag, False)):
            return row
    return METHODS[name]


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def strategy_class(name: str, options: Mapping[str, Any] | None = None) -> type[PersonalizedStrategy]:
    return _load(method(name, options).server)


def trainer_class(name: str, options: Mapping[str, Any] | None = None) -> type[ClientTrainer]:
    return _load(method(name, options).client)


def method_options(strategy: Mapping[str, Any]) -> MethodOptions:
    """The validated options object of the configured strategy (``cfg.strategy``)."""
    name = str(strategy["name"])
    return read_options(method(name, strategy).options, strategy)


# built models per process: (key) -> (template, last seed set, CPU RNG state after building)
_BUILT: OrderedDict[str, tuple[nn.Module, int, Any]] = OrderedDict()
_BUILT_MAX = 4


def build_method_model(cfg: Mapping[str, Any], input_shape: tuple[int, int, int],
                       num_classes: int) -> nn.Module:
    """The model a method trains, identical on server and client: the configured network
    (``cfg.model``) initialised from ``cfg.seed``, or the method's wrapper around copies of
    it (copy k initialised from ``seed + 1000 k``; copy 0 is the plain network).

    A client builds this model several times per message; a process builds it once per
    configuration and hands out deep copies (construction and random initialisation, or
    loading pretrained weights, cost more than copying). The global torch RNG is left
    exactly as building it leaves it (seeded, then advanced by the initialisation), so
    later random draws (dropout) do not depend on whether the model came from the cache."""
    import torch

    key = json.dumps([_plain(cfg["model"]), _plain(cfg["strategy"]), int(cfg["seed"]),
                      list(input_shape), int(num_classes)], sort_keys=True, default=str)
    if key in _BUILT:
        template, last_seed, rng_after = _BUILT[key]
        _BUILT.move_to_end(key)
        torch.manual_seed(last_seed)       # CUDA generators as building leaves them
        torch.set_rng_state(rng_after)     # CPU generator as building leaves it
        return copy.deepcopy(template)

    from learning.models import build_model

    seed = int(cfg["seed"])
    seeds: list[int] = []

    def make(k: int) -> nn.Module:
        seeds.append(seed + 1000 * k)
        torch.manual_seed(seeds[-1])
        return build_model(cfg["model"], input_shape, num_classes)

    row = method(str(cfg["strategy"]["name"]), cfg["strategy"])
    model = make(0) if not row.wrapper else _load(row.wrapper)(make, method_options(cfg["strategy"]))  # type: ignore[operator]
    _BUILT[key] = (copy.deepcopy(model), seeds[-1], torch.get_rng_state())
    while len(_BUILT) > _BUILT_MAX:
        _BUILT.popitem(last=False)
    return model


def _plain(node: Any) -> Any:
    """A config node as plain containers (for a cache key)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def parameter_roles(strategy: Mapping[str, Any], model: nn.Module) -> dict[str, str]:
    """``{state-dict key: role}`` of ``model`` under the configured strategy."""
    from common.roles import roles_by_rule

    return roles_by_rule(method(str(strategy["name"]), strategy).roles, model)
