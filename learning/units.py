"""Named units of a model (stages, blocks, layers): what PartialFed loads globally or locally.

Every state-dict key belongs to exactly one unit at each granularity:

* ``layer``: each module that owns parameters or buffers (a conv, a BN, a linear layer).
* ``block``: ResNet-18 (``model=resnet18``): the stem (input conv + BN), the eight residual
  blocks lettered as in PartialFed's Figure 2 (``A a`` = the two blocks of stage 1, ``B b``
  of stage 2, ...) and ``fc``. Other models: a conv/linear layer together with the BN that
  follows it (they have no residual blocks), named ``s1, s2, ...``, and ``fc``.
* ``stage``: ResNet-18: ``s1`` (stem + stage 1), ``s2``, ``s3``, ``s4`` and ``fc``. Other
  models: as ``block`` (one conv/linear + its BN per stage), so the small CNN has ``s1``
  (conv1 + bn1), ``s2`` (conv2 + bn2), ``s3`` (hidden linear) and ``fc``.

``fc`` is always the classifier (the ``head.*`` keys). Units are listed bottom-up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

GRANULARITIES = ("stage", "block", "layer")
HEAD_UNIT = "fc"
_BLOCK_LETTERS = "abcd"


def _owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that directly own parameters or buffers, in registration order."""
    return [(name, m) for name, m in model.named_modules()
            if name and (any(True for _ in m.parameters(recurse=False))
                         or any(True for _ in m.buffers(recurse=False)))]


def _keys_of(model: nn.Module, module_name: str) -> list[str]:
    prefix = module_name + "."
    return [k for k in model.state_dict() if k.startswith(prefix) and "." not in k[len(prefix):]]


def _is_resnet18(model: nn.Module) -> bool:
    body = getattr(model, "body", None)
    return body is not None and all(hasattr(body, f"layer{i}") for i in range(1, 5)) \
        and len(body.layer1) == 2


def _resnet_unit(key: str, granularity: str) -> str:
    if key.startswith("head."):
        return HEAD_UNIT
    m = re.match(r"body\.layer(\d)\.(\d)\.", key)
    if granularity == "stage":
        return f"s{m.group(1)}" if m else "s1"          # the stem belongs to stage 1
    if m:
        letter = _BLOCK_LETTERS[int(m.group(1)) - 1]
        return letter.upper() if m.group(2) == "0" else letter
    return "stem"


def model_units(model: nn.Module, granularity: str) -> dict[str, list[str]]:
    """``{unit: [state-dict keys]}`` bottom-up; every key in exactly one unit."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    units: dict[str, list[str]] = {}
    if granularity == "layer":
        for name, _ in _owners(model):
            units[HEAD_UNIT if name == "head" else name] = _keys_of(model, name)
    elif _is_resnet18(model):
        for key in model.state_dict():
            units.setdefault(_resnet_unit(key, granularity), []).append(key)
        order = (["s1", "s2", "s3", "s4"] if granularity == "stage"
                 else ["stem", "A", "a", "B", "b", "C", "c", "D", "d"]) + [HEAD_UNIT]
        units = {u: units[u] for u in order}
    else:
        n = 0
        for name, module in _owners(model):
            keys = _keys_of(model, name)
            if name == "head":
                units[HEAD_UNIT] = keys
            elif isinstance(module, nn.modules.batchnorm._BatchNorm) and n > 0:
                units[f"s{n}"] += keys                      # a BN joins the layer before it
            else:
                n += 1
                units[f"s{n}"] = keys
        if HEAD_UNIT in units:                              # keep fc last
            units[HEAD_UNIT] = units.pop(HEAD_UNIT)
    covered = [k for keys in units.values() for k in keys]
    missing = [k for k in model.state_dict() if k not in covered]
    if missing or len(covered) != len(set(covered)):
        raise ValueError(f"{type(model).__name__}: units do not partition the state dict "
                         f"(missing {missing[:3]})")
    return units


def unit_of(units: Mapping[str, list[str]]) -> dict[str, str]:
    """``{key: unit}`` from :func:`model_units`' output."""
    return {k: u for u, keys in units.items() for k in keys}
