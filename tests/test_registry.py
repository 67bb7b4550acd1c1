"""The one registration style (``learning/registry.py``) of models, dataset sources and
parameter-role rules: a name is registered once, an unknown one is answered with the valid ones."""

from __future__ import annotations

import pytest

from common.roles import RULES
from learning.backbones import ModelError
from learning.datasets.pools import SOURCES
from learning.datasets.sources import DatasetError
from learning.models import MODELS
from learning.registry import Registry


def test_a_name_is_registered_once_and_an_unknown_one_lists_the_valid_ones() -> None:
    colours: Registry[int] = Registry("colour", KeyError)
    assert colours.add("red", 1) == 1 and colours.add("blue", 2) == 2
    assert list(colours) == ["red", "blue"] and len(colours) == 2 and "red" in colours and "green" not in colours
    assert colours["blue"] == 2
    with pytest.raises(ValueError, match="colour 'red' is registered twice"):
        colours.add("red", 3)
    assert colours["red"] == 1   # the first entry kept
    with pytest.raises(KeyError, match="unknown colour 'green'; valid: red, blue"):
        colours["green"]


def test_models_sources_and_role_rules_share_it() -> None:
    for registry, error, known in ((MODELS, ModelError, "cnn"), (SOURCES, DatasetError, "digits"),
                                   (RULES, ValueError, "bn-local")):
        assert isinstance(registry, Registry) and known in registry
        with pytest.raises(error, match=f"valid: .*{known}"):
            registry["no-such-entry"]
