"""Where a message's and a round's time goes (``PFLOWER_TIMING``, ``PFLOWER_PROFILE=<folder>``).

``PFLOWER_TIMING=1`` logs, per ClientApp message, the process age (a deployment's per-message
start-up) and the handler's seconds. ``PFLOWER_TIMING=<folder>`` also appends one JSON line per
message to ``<folder>/client-<pid>.jsonl`` and one per server round to ``server-<pid>.jsonl``:
the wall-clock start and end and the seconds by part (:func:`part`: on a client the
configuration, data lookup, state load and save, model build, training, evaluation,
(de)serialisation; on the server the messages' construction, the wait for replies, the
aggregation, the records and the checkpoint). ``bench/message_parts.py`` turns those lines into
a table; the time a worker spends outside every handler of a round (Flower's and Ray's
hand-offs, the server's work between rounds) is what is left of the round.
``PFLOWER_PROFILE=<folder>`` writes a cProfile file per message.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# the parts of the message being timed (None: not timing; one message at a time per process)
_parts: dict[str, float] | None = None
_fields: dict[str, Any] = {}


def process_age() -> float:
    """Seconds since this process started (Linux /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def timing_enabled() -> bool:
    """``PFLOWER_TIMING`` set to anything but empty or ``0``."""
    return os.environ.get("PFLOWER_TIMING", "") not in ("", "0")


def timing_folder() -> Path | None:
    """Where message parts are written (``PFLOWER_TIMING=<folder>``); None for ``1``, ``0`` or
    unset. ``pflower`` makes a relative folder absolute before it starts any process."""
    value = os.environ.get("PFLOWER_TIMING", "")
    return Path(value) if value not in ("", "0", "1") else None


@contextmanager
def part(name: str) -> Iterator[None]:
    """Add the block's seconds to part ``name`` of the message being timed (nothing, at the
    cost of one check, when none is). Parts do not nest: each second is counted once."""
    parts = _parts   # the block's own line, even if another block started meanwhile
    if parts is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0


def note(**fields: Any) -> None:
    """Fields for the message's line (e.g. ``server_round``), when one is being timed."""
    if _parts is not None:
        _fields.update(fields)


@contextmanager
def timed(kind: str, role: str = "client") -> Iterator[dict[str, Any]]:
    """Record the parts of the block (a message's handler, a server round); the line, filled
    in when the block ends, is yielded, and appended to ``<folder>/<role>-<pid>.jsonl`` when
    a folder is set. A folder that cannot be written warns, never fails the block."""
    global _parts
    outer = _parts, dict(_fields)   # a block inside another (a test's server and clients in one process)
    _fields.clear()
    _parts = {}
    line: dict[str, Any] = {"type": kind, "pid": os.getpid()}
    start, t0 = time.time(), time.perf_counter()
    try:
        yield line
    except BaseException as err:
        line["error"] = type(err).__name__   # kept, but never summarised as a normal message
        raise
    finally:
        handler = time.perf_counter() - t0
        line.update({"start": start, "end": start + handler, "handler_s": handler, **_fields, "parts": _parts})
        _parts = outer[0]
        _fields.clear()
        _fields.update(outer[1])
        _write(line, role)


def _write(line: dict[str, Any], role: str) -> None:
    folder = timing_folder()
    if folder is None:
        return
    try:
        text = json.dumps(line, default=str) + "\n"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{role}-{os.getpid()}.jsonl", "a") as f:
            f.write(text)
    except (OSError, TypeError, ValueError) as err:
        from flwr.common.logger import log

        log(30, "pflower timing: cannot write to %s (%s); set PFLOWER_TIMING to a writable folder", folder, err)


def timed_message(call: Callable[[], T], message_type: str) -> tuple[T, dict[str, Any]]:
    """``call()`` (a ClientApp message's handler) with its parts recorded, and its line."""
    with timed(message_type) as line:
        result = call()
    return result, line


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
        from flwr.common.logger import log

        log(30, "pflower timing: cannot write the profile %s (%s); set PFLOWER_PROFILE to a writable folder",
            path, err)
    return result
