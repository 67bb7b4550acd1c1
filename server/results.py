"""The run's recorder: writes its folder (``server/run_folder.py`` says what it holds) as the
rounds go, and its summary and figures at the end."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from common.settings import Settings
from learning.storage import append_text, atomic_write_text
from server.plots import plot_run
from server.run_folder import (
    METRICS_FILE,
    SUMMARY_FILE,
    RunFolderError,
    RunFolderLock,
    check_run_folder,
    existing_run_files,
    read_recoveries,
    read_rounds,
    save_overrides,
)
from server.summary import build_summary, machine_description
from server.tensorboard import TensorBoardLog


class RunRecorder:
    """Writes one run's folder as the run goes (holding its lock until :meth:`close`)."""

    def __init__(self, cfg: DictConfig, settings: Settings, resume: bool = False,
                 overrides: list[str] | None = None) -> None:
        """``cfg`` is written to the folder as the run's ``config.yaml``; ``settings`` are its
        typed settings (composition reads them once)."""
        self.cfg, self.settings = cfg, settings
        run = settings.run
        self.dir = run.run_dir
        self.lock = RunFolderLock(self.dir).acquire()
        overwrite = run.overwrite
        try:
            check_run_folder(self.dir, resume, overwrite)
        except RunFolderError:
            self.lock.release()
            raise
        if overwrite and not resume:
            for name in existing_run_files(self.dir):
                path = self.dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        self.t0 = time.monotonic()
        atomic_write_text(self.dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        if overrides is not None:
            save_overrides(self.dir, overrides)
        self.metrics_path = self.dir / METRICS_FILE
        self.rounds: list[dict[str, Any]] = []
        if resume and self.metrics_path.exists():
            self.rounds = read_rounds(self.metrics_path)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        (self.dir / SUMMARY_FILE).unlink(missing_ok=True)
        self.tensorboard: TensorBoardLog | None = None   # opened at the first round this attempt writes
        self._last_elapsed = 0.0
        if run.tensorboard:
            TensorBoardLog.preload()

    def close(self) -> None:
        """Release the run folder's lock (the run is over, finished or failed), and remove its
        file: a finished folder holds results only. A run that starts meanwhile (it would find
        the results and stop) creates a fresh lock file."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.lock.release(remove=True)

    def _events(self, first_round: int) -> TensorBoardLog | None:
        """The run's TensorBoard log (``tensorboard=true``); events a cut-short attempt wrote
        for ``first_round`` and after are dropped (a resume redoes those rounds)."""
        if self.tensorboard is None and self.settings.run.tensorboard:
            self.tensorboard = TensorBoardLog(self.dir, purge_from=first_round)
        return self.tensorboard

    def truncate_to(self, last_round: int) -> None:
        """On resume: drop lines of rounds after the checkpoint (they will be redone)."""
        self.rounds = [r for r in self.rounds if r["round"] <= last_round]
        self._rewrite()

    def _rewrite(self) -> None:
        atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.rounds))

    def attach_evaluation(self, server_round: int, evaluation: Mapping[str, Any]) -> None:
        """Add round ``server_round``'s evaluation to its record, written before the evaluation
        arrived (it came with the next round's training); metrics.jsonl is rewritten
        atomically."""
        if not evaluation:
            return
        for rec in self.rounds:
            if rec["round"] == server_round:
                rec.update(evaluation)
                break
        else:
            raise RuntimeError(f"no record of round {server_round} to attach its evaluation to")
        self._rewrite()
        if (events := self._events(server_round + 1)) is not None:
            events.log_evaluation(rec)

    def log_round(self, record: dict[str, Any]) -> None:
        elapsed = time.monotonic() - self.t0
        record = {**record, "elapsed_s": round(elapsed, 3)}
        append_text(self.metrics_path, json.dumps(record) + "\n")   # whole line or nothing
        self.rounds.append(record)
        if (events := self._events(int(record["round"]))) is not None:
            events.log_round(record, round_s=elapsed - self._last_elapsed)
        self._last_elapsed = elapsed

    def finish(self, client_info: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any] | None = None,
               status: str = "completed") -> dict[str, Any]:
        summary = build_summary(self.settings, self.rounds, client_info, status)
        summary.update(dict(extra or {}))
        summary["machine"] = machine_description(self.settings.run.device)
        recoveries = read_recoveries(self.dir)
        summary["recoveries"] = len(recoveries)
        if recoveries:
            summary["status"] = f"{summary['status']}-recovered"   # completed-recovered, partial-recovered
            summary["recovered_after_rounds"] = [r.get("after_round") for r in recoveries]
        atomic_write_text(self.dir / SUMMARY_FILE, json.dumps(summary, indent=2))
        if (events := self._events(int(summary["rounds"]) + 1)) is not None:
            events.log_run(OmegaConf.to_container(self.cfg, resolve=True), OmegaConf.to_yaml(self.cfg, resolve=True),
                           summary)
        try:
            plot_run(self.dir, self.rounds, summary)
        except Exception as err:  # plotting must never lose the results
            summary["plot_error"] = str(err)
            atomic_write_text(self.dir / SUMMARY_FILE, json.dumps(summary, indent=2))
        return summary
