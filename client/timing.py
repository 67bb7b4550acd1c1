"""Where a ClientApp message's time goes (``PFLOWER_TIMING=1``, ``PFLOWER_PROFILE=<folder>``):
process ages and an optional cProfile file per message, for the ClientApp process and
``pflower-supernode``'s runner alike."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from flwr.common.logger import log

T = TypeVar("T")


def process_age() -> float:
    """Seconds since this process started (Linux /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def profiled(call: Callable[[], T], name: str) -> T:
    """``call()``; with ``PFLOWER_PROFILE=<folder>`` under cProfile, written to
    ``<folder>/<name>-<pid>.prof`` (an unwritable folder warns, never fails the message)."""
    profile_dir = os.environ.get("PFLOWER_PROFILE")
    if not profile_dir:
        return call()
    import cProfile

    with cProfile.Profile() as prof:
        result = call()
    path = Path(profile_dir) / f"{name}-{os.getpid()}.prof"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(path)
    except OSError as err:
        log(30, "pflower timing: cannot write the profile %s (%s); set PFLOWER_PROFILE to a writable folder",
            path, err)
    return result
