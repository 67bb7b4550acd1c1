"""A run's folder: what it holds, its lock, and whether a run may write into it.

``<results_root>/<run_name>/``
- ``config.yaml``: the resolved Hydra config of the run;
- ``overrides.json``: the Hydra overrides the run was composed with (what ``resume=<folder>``
  composes again, so a resume needs nothing but the folder);
- ``recoveries.jsonl``: one line per automatic recovery of ``pflower run`` (why the run died,
  after which round, where its processes' output was kept);
- ``metrics.jsonl``: one JSON line per round (train metrics, evaluation summary over
  clients, per-client evaluation metrics, communication and failures);
- ``summary.json``: final personalised test accuracy over clients (mean/min/std), the
  best round chosen on validation accuracy, per-client numbers;
- ``accuracy.png`` (mean/min accuracy over rounds) and ``clients.png`` (per client).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from common.overrides import override_key
from common.settings import RunKeys
from learning.storage import atomic_write_text
from server.tensorboard import TB_DIR

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
OVERRIDES_FILE = "overrides.json"
RECOVERIES_FILE = "recoveries.jsonl"


CONFIG_FILE = "config.yaml"
# keys of a run's config.yaml that say where a run goes or where its data lies, not what it
# computes: two runs that differ only in these (and their seed) are the same configuration
WHERE_KEYS = ("run_name", "results_root", "state_root", "resume", "overwrite", "data_cache", "tensorboard",
              "dataset.root")


LOCK_FILE = ".lock"
# files that make a folder a run's results (pflower.pid and the lock do not)
RUN_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, "FAILED", "checkpoint", "client_state",
             OVERRIDES_FILE, RECOVERIES_FILE, "failures", TB_DIR)


class RunFolderError(RuntimeError):
    """The run folder holds another run, or another process is writing it."""

    def __init__(self, message: str, run_dir: Path | None = None, found: list[str] | None = None) -> None:
        super().__init__(message)
        self.run_dir, self.found = run_dir, list(found or [])


def existing_run_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*") if p.name in RUN_FILES
                  or p.name.startswith("checkpoint") or p.suffix == ".png")


def check_run_folder(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to write a run into a folder that holds another run's results, unless the run
    resumes it (``resume=<folder>``) or replaces it (``overwrite=true``). The message is in
    ``pflower`` syntax; :func:`run_config_hint` says the same in ``flwr run`` syntax."""
    if resume or overwrite or not run_dir.is_dir():
        return
    found = existing_run_files(run_dir)
    if found:
        raise RunFolderError(
            f"{run_dir} already holds a run ({', '.join(found[:4])}); resume it with "
            f"resume={run_dir}, write elsewhere with run_name=<new name>, or replace it with "
            "overwrite=true", run_dir, found)


def run_config_hint(err: RunFolderError) -> str:
    """The refusal of :func:`check_run_folder` in ``flwr run --run-config`` syntax, one line,
    for a run submitted with Flower's CLI (``flwr run .``)."""
    run_dir = err.run_dir or Path(".")
    return (f"{run_dir} already holds a run ({', '.join(err.found[:4])}); write elsewhere with "
            f"--run-config \"run-name='<new name>'\", resume it with --run-config "
            f"\"overrides='resume={run_dir}'\", or replace it with --run-config \"overrides='overwrite=true'\"")


def finished_summary(run_dir: Path, run: RunKeys) -> dict[str, Any] | None:
    """The summary of the finished run of these run keys in ``run_dir`` (all its rounds, not marked
    FAILED), or None. ``overwrite=true`` never finds one: it runs again. ``pflower run``,
    ``sweep`` and the ServerApp under ``flwr run`` reuse such a run instead of refusing it."""
    summary = run_dir / SUMMARY_FILE
    if run.overwrite or not summary.exists() or (run_dir / "FAILED").exists():
        return None
    try:
        s = json.loads(summary.read_text())
    except (OSError, ValueError):
        return None
    return s if isinstance(s, dict) and int(s.get("rounds", run.rounds)) == run.rounds else None


class RunFolderLock:
    """An exclusive ``flock`` on ``<run dir>/.lock`` for the life of a run: a second live
    run on the same folder is refused instead of interleaving its rounds with ours. The OS
    drops the lock when the process dies, so a killed run never leaves a stale lock."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunFolderLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderError(f"{self.path.parent} is being written by another live run; wait for "
                                 "it to finish or stop it, or choose another run_name") from None
        self._fd = fd
        return self

    def release(self, remove: bool = False) -> None:
        """Drop the lock; ``remove`` also deletes the file, while the lock is still held (so no
        other process holds a lock on the deleted file)."""
        if self._fd is not None:
            if remove:
                self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()


def lock_is_held(run_dir: Path) -> bool:
    """Whether a live process holds the run folder's lock (without taking it)."""
    if not (run_dir / LOCK_FILE).exists():
        return False
    try:
        RunFolderLock(run_dir).acquire().release()
    except RunFolderError:
        return True
    return False


_FOLDER_KEYS = ("resume", "run_name", "results_root", "overwrite")


def save_overrides(run_dir: Path, overrides: list[str]) -> None:
    """Write ``overrides.json``: the overrides that compose this run's config, less the
    folder's own keys (a resume takes those from the folder, wherever it was moved)."""
    kept = [o for o in overrides if override_key(o) not in _FOLDER_KEYS]
    atomic_write_text(run_dir / OVERRIDES_FILE, json.dumps({"overrides": kept}, indent=1) + "\n")


def load_overrides(run_dir: Path) -> list[str] | None:
    """The overrides saved by :func:`save_overrides`, or None for a folder without them."""
    path = run_dir / OVERRIDES_FILE
    if not path.exists():
        return None
    return [str(o) for o in json.loads(path.read_text())["overrides"]]


def record_recovery(run_dir: Path, after_round: int, reason: str, evidence: Path | None = None) -> None:
    """Append one automatic recovery to ``recoveries.jsonl``: when, after which checkpointed
    round, why the run died, and where what explains it was kept."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "after_round": int(after_round),
             "reason": reason, "evidence": str(evidence or "")}
    with (run_dir / RECOVERIES_FILE).open("a") as f:
        f.write(json.dumps(entry) + "\n")


def read_recoveries(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / RECOVERIES_FILE
    return read_rounds(path) if path.exists() else []


def read_rounds(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl lines; a last line cut short by a killed run is dropped."""
    rounds = []
    for line in path.read_text().splitlines():
        try:
            rounds.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rounds


