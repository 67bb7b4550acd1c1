"""Shared test fixtures: small configs that build in well under a second."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def digits_cfg():
    from learning.config import compose_config

    return compose_config({}, ["rounds=2"])
