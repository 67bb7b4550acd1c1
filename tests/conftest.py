"""Shared fixtures; helpers live in ``tests/helpers.py``.

Markers: ``e2e`` = end-to-end runs of real processes (``pflower run``/``deploy``, Flower's
simulation); ``docker`` = the Docker demo (tests/test_docker.py). CI runs the fast lane
(``-m "not e2e and not docker"``) first, then the e2e lane, then the Docker lane.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from flwr.supercore.task_identity import TaskIdentity

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the per-client data cache (learning/datasets/cache.py) of this test session, not the user's
os.environ.setdefault("PFLOWER_DATA_CACHE", tempfile.mkdtemp(prefix="pflower-test-data-cache-"))


@pytest.fixture
def flower_task() -> None:
    """Messages can only be created inside a Flower task; pretend to be one."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0


@pytest.fixture
def digits_cfg():
    from common.config import compose_config

    return compose_config({}, ["rounds=2"])
