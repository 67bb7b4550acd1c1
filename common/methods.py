"""The method registry: each method's row lives in its own ``conf/strategy/<name>.yaml``.

A row (the YAML's ``_method_`` block) names the server Strategy class, the client trainer
class, the parameter-role rule (a name in ``common/roles.py`` or the method's own
``"module:function"``), the options class, the models it works with and, when it trains a
different model around the configured network, the wrapper that builds it. Classes are
imported on first use, so a process only loads the code of the method it runs. A variant
(e.g. FedProx's BABU form, ``strategy.body_only=true``) is a block under ``variants:`` whose
keys replace the row's when its option is true.

Adding a method = its YAML (options and row), its server and client modules, and its pure
``strategies/<name>_math.py`` (options class, wire names, math): nothing else to edit. The
composed configuration drops the block (``common/config.py``), so a method's options stay
exactly the YAML's other keys. The method contract test (``tests/test_method_contract.py``)
checks every row listed here, with no test written.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.options import MethodOptions, read_options

if TYPE_CHECKING:
    from torch import nn

STRATEGY_DIR = Path(__file__).resolve().parent.parent / "conf" / "strategy"
ROW_KEY = "_method_"     # the registry block of conf/strategy/<name>.yaml


@dataclass(frozen=True)
class Method:
    """One method: where its two halves live, how it labels parameters, its options."""

    server: str                              # "module:Class" of the server Strategy
    client: str                              # "module:Class" of the client trainer
    roles: str                               # a rule of common.roles.RULES, or "module:function"
    options: str = "common.options:MethodOptions"   # "module:Class" of its options
    models: tuple[str, ...] = ()             # models it works with (empty = any; first = default)
    wrapper: str = ""                        # "module:function" wrapping the network (FedBasis' bases)
    not_private: str = ""                    # why the server rule needs each client's own upload, so neither
                                             # DP of the mean nor secure aggregation applies ("" = it can)
    no_record_dp: str = ""                   # why its local training cannot be DP-SGD ("" = it can)
    variants: tuple[tuple[str, Method], ...] = ()   # (option that must be true, the variant's row)


def method_names() -> list[str]:
    """Every method: the YAML files of ``conf/strategy/`` (a leading underscore marks a base
    file, not a method)."""
    return sorted(p.stem for p in STRATEGY_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def _row(values: Mapping[str, Any], where: str, base: Method | None = None) -> Method:
    """A :class:`Method` from a YAML row, every key checked (``base``: the row whose keys a
    variant's block replaces)."""
    known = {f.name for f in fields(Method)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} in {ROW_KEY}; valid: {sorted(known)}")
    merged: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(Method)} if base else {}
    merged.update({k: v for k, v in values.items() if k != "variants"})
    merged["models"] = tuple(merged.get("models") or ())
    merged["variants"] = ()
    missing = [k for k in ("server", "client", "roles") if not merged.get(k)]
    if missing:
        raise ValueError(f"{where}: {ROW_KEY} lacks {missing} (the server class, client class and "
                         "role rule; see docs/architecture.md, 'Adding a method')")
    row = Method(**merged)
    if base is None and values.get("variants"):
        variants = tuple((flag, _row(v, f"{where} (variant {flag})", row))
                         for flag, v in dict(values["variants"]).items())
        row = Method(**{**merged, "variants": variants})
    return row


@functools.cache
def _method_row(name: str) -> Method:
    import yaml

    path = STRATEGY_DIR / f"{name}.yaml"
    if name.startswith("_") or "/" in name or not path.is_file():
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(method_names())}")
    doc = yaml.safe_load(path.read_text()) or {}
    block = doc.get("strategy", doc) if isinstance(doc, dict) else {}   # a `# @package _global_` file
    if ROW_KEY not in block:
        raise ValueError(f"conf/strategy/{name}.yaml has no {ROW_KEY} block naming the method's server "
                         "class, client class and role rule (see docs/architecture.md, 'Adding a method')")
    return _row(block[ROW_KEY], f"conf/strategy/{name}.yaml")


def method(name: str, options: Mapping[str, Any] | None = None) -> Method:
    """The row for ``name`` (the variant's row when its option is set); read once per process."""
    row = _method_row(name)
    for flag, variant in row.variants:
        if options is not None and bool(options.get(flag, False)):
            return variant
    return row


@dataclass(frozen=True)
class ResolvedMethod:
    """The configured method, resolved once at composition (``Settings.method``): its row with
    the variant its options select applied, and its options checked and typed. The two app
    edges load its classes (``row.server``, ``row.client``); strategies and trainers read
    ``options``, never the ``strategy`` mapping."""

    row: Method
    options: MethodOptions

    @property
    def name(self) -> str:
        return self.options.name

    def not_private(self) -> str:
        """Why this method, in these settings, needs each client's own upload at the server, so
        that neither DP of the mean nor secure aggregation applies; "" when it can take both. Its
        YAML row's ``not_private`` (the whole method) or its options' (some settings of it)."""
        return self.row.not_private or self.options.not_private()


def resolve_method(strategy: Mapping[str, Any]) -> ResolvedMethod:
    """The configured method (``cfg.strategy``) resolved: its row, variant applied, and its
    options validated (a missing, unknown or out-of-range option raises, naming the fix)."""
    row = method(str(strategy["name"]), strategy)
    return ResolvedMethod(row, read_options(load_named(row.options), strategy))


def not_private(strategy: Mapping[str, Any]) -> str:
    """:meth:`ResolvedMethod.not_private` of the configured method (``cfg.strategy``)."""
    return resolve_method(strategy).not_private()


def load_named(path: str) -> Any:
    """The object a row names as ``"module:attribute"`` (the server and client classes are
    loaded by the two app edges, ``server/app.py`` and ``client/handlers.py``, so that this
    layer names no module above it)."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{path!r}, named in a conf/strategy/*.yaml {ROW_KEY} row, cannot be imported "
                         f"({err}); give it as 'package.module:Name'") from err


def method_options(strategy: Mapping[str, Any]) -> MethodOptions:
    """The validated options object of the configured strategy (``cfg.strategy``)."""
    return resolve_method(strategy).options


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

    from learning.training import seed_torch

    key = json.dumps([_plain(cfg["model"]), _plain(cfg["strategy"]), int(cfg["seed"]),
                      list(input_shape), int(num_classes)], sort_keys=True, default=str)
    if key in _BUILT:
        template, last_seed, rng_after = _BUILT[key]
        _BUILT.move_to_end(key)
        seed_torch(last_seed)              # CUDA generators as building leaves them
        torch.set_rng_state(rng_after)     # CPU generator as building leaves it
        return copy.deepcopy(template)

    from learning.models import build_model

    seed = int(cfg["seed"])
    seeds: list[int] = []

    def make(k: int) -> nn.Module:
        seeds.append(seed + 1000 * k)
        seed_torch(seeds[-1])
        return build_model(cfg["model"], input_shape, num_classes)

    resolved = resolve_method(cfg["strategy"])
    wrapper = resolved.row.wrapper
    model = make(0) if not wrapper else load_named(wrapper)(make, resolved.options)
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


def roles_of(row: Method, model: nn.Module) -> dict[str, str]:
    """``{state-dict key: role}`` of ``model`` under the method row ``row`` (its role rule)."""
    from common.roles import roles_by_rule

    return roles_by_rule(row.roles, model, load_named(row.roles) if ":" in row.roles else None)
