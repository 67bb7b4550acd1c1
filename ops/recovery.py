"""Resume a run from its folder alone, and recover a run whose processes died.

A run folder holds ``overrides.json`` (written by the ServerApp): the Hydra overrides the
run was composed with. ``resume=<folder>`` composes exactly those again, so the command
that resumes a run is ``pflower run resume=<folder>`` and nothing else. Overrides given
beside it may change only what does not change what the run computes up to its
checkpoint (:data:`RESUMABLE_KEYS`: more rounds, timeouts, the device); any other
difference from the saved configuration is refused, naming the key.

A *death* is a run that ended without its ServerApp saying why: no fresh ``summary.json``
and no fresh ``FAILED`` (the ServerApp writes ``FAILED`` for every error of the run
itself, e.g. too few clients, which would only happen again). Flower 1.39 ends a
simulation whose task missed its heartbeats for 60 s (see :func:`death_reason`); the
SuperLink or the simulation can also be killed from outside. ``pflower run`` then resumes
the run from its last checkpoint, at most ``--max-recoveries`` times and only while it
makes progress, and logs each recovery in ``recoveries.jsonl``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from common.config import ConfigError, compose_config
from common.overrides import override_key, override_values, split_overrides

# keys that may change when a run is resumed: they do not change what the rounds already
# done computed (rounds extends the run; the others are how and how long to wait, where
# to train, and where the data cache lives)
RESUMABLE_KEYS = ("rounds", "round_timeout", "wait_for_clients", "device", "deterministic",
                  "data_cache", "checkpoint_every", "stream_replies_mb")
# keys that name the folder, not the run: they are taken from the folder
FOLDER_KEYS = ("resume", "run_name", "results_root", "overwrite")


def resume_folder(overrides: list[str]) -> Path | None:
    """The folder of a ``resume=<folder>`` override, if any (the last one wins)."""
    found = override_values(overrides, "resume")
    return Path(found[-1]).resolve() if found and found[-1] else None


def _flat(cfg: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    items = cfg.items() if isinstance(cfg, dict) else enumerate(cfg) if isinstance(cfg, list) else None
    if items is None:
        return {prefix: cfg}
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict | list) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def _resolved(overrides: list[str]) -> dict[str, Any]:
    run_cfg, rest = split_overrides(overrides)
    cfg = compose_config(run_cfg, rest)
    return _flat(OmegaConf.to_container(cfg, resolve=True))


def changed_keys(saved: list[str], extra: list[str]) -> dict[str, tuple[Any, Any]]:
    """Keys whose resolved value differs between the saved overrides and the saved ones
    plus ``extra``: ``{key: (saved value, new value)}``, folder keys left out."""
    before, after = _resolved(saved), _resolved([*saved, *extra])
    keys = set(before) | set(after)
    return {k: (before.get(k), after.get(k)) for k in sorted(keys)
            if before.get(k) != after.get(k) and k.split(".")[0] not in FOLDER_KEYS}


def expand_resume(overrides: list[str], command: str = "pflower run") -> list[str]:
    """``resume=<folder> [KEY=VALUE ...]`` -> the folder's saved overrides, the allowed
    changes, and ``resume=<folder>``. Without ``resume=`` the overrides are returned as
    they are; a folder written before ``overrides.json`` existed keeps the old behaviour
    (the overrides given must repeat the run's own, and the checkpoint checks them)."""
    from server.run_folder import load_overrides

    folder = resume_folder(overrides)
    if folder is None:
        return list(overrides)
    if not folder.is_dir():
        raise ConfigError(f"resume={folder} is not a run folder; give the path of an earlier run")
    saved = load_overrides(folder)
    if saved is None:
        return list(overrides)
    extra = [o for o in overrides if override_key(o) not in FOLDER_KEYS]
    refused = {k: v for k, v in changed_keys(saved, extra).items()
               if k.split(".")[0] not in RESUMABLE_KEYS}
    if refused:
        lines = [f"{k}: the run has {a!r}, this command gives {b!r}" for k, (a, b) in refused.items()]
        raise ConfigError(
            f"resume={folder} takes the run's configuration from {folder}/overrides.json; these keys "
            "may not change on resume:\n  - " + "\n  - ".join(lines)
            + f"\nleave them out (`{command} resume={folder}`), change only "
            f"{', '.join(RESUMABLE_KEYS)}, or start a new run (run_name=<new name>)")
    return [*saved, *extra, f"resume={folder}"]


def death_reason(flwr_code: int, link_status: Mapping[str, Any] | None, link_log: str,
                 watched: str = "") -> str:
    """One line saying why a run died, from what pflower saw (``watched``: a process that
    exited) and what Flower left: the run's status and details on the SuperLink (``flwr
    ls``) and the SuperLink's log (which also holds the simulation process's output)."""
    from ops.deployment.launch import EXIT_WORK_GONE

    parts = [watched] if watched else []
    if flwr_code != EXIT_WORK_GONE:
        parts.append(f"flwr exit code {flwr_code}")
    if link_status:
        detail = str(link_status.get("status-details") or link_status.get("details") or "")
        parts.append(f"SuperLink run status {link_status.get('status', '?')}"
                     + (f" ({detail})" if detail else ""))
    else:
        parts.append("SuperLink unreachable")
    for marker in ("No heartbeat received from the task", "Task failed because the run expired",
                   "Traceback", "Killed", "MemoryError", "out of memory"):
        if marker in link_log:
            parts.append(f"SuperLink log: {marker!r}")
    return "; ".join(parts)


def keep_evidence(workdir: Path, run_dir: Path, attempt: int, run_info: Mapping[str, Any] | None = None,
                  run_log: str = "") -> Path:
    """Keep what explains a failure in ``<run>/failures/attempt-<n>-<time>/`` before the
    SuperLink's folder is removed: its log and database (Flower sends the simulation's
    output to the database, not to a file), the run's status on the SuperLink
    (``run.json``) and the run's log as the SuperLink stored it (``run.log``)."""
    import json

    dest = run_dir / "failures" / f"attempt-{attempt}-{time.strftime('%Y%m%dT%H%M%S')}"
    shutil.copytree(workdir, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.key", "flwr-home"))
    if run_info:
        (dest / "run.json").write_text(json.dumps(dict(run_info), indent=2))
    if run_log:
        (dest / "run.log").write_text(run_log)
    return dest
