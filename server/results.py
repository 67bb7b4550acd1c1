"""Run folders: resolved config, per-round metrics, summary and plots.

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
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from common.config import override_key, run_settings
from common.figures import inches, tick_step
from common.protocol import client_sort_key
from learning.storage import atomic_write_text
from server.tensorboard import TB_DIR, TensorBoardLog

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
OVERRIDES_FILE = "overrides.json"
RECOVERIES_FILE = "recoveries.jsonl"


LOCK_FILE = ".lock"
# files that make a folder a run's results (pflower.pid and the lock do not)
RUN_FILES = ("config.yaml", METRICS_FILE, SUMMARY_FILE, "FAILED", "checkpoint", "client_state",
             OVERRIDES_FILE, RECOVERIES_FILE, "failures", TB_DIR)


def run_dir_of(cfg: DictConfig) -> Path:
    return run_settings(cfg).run.run_dir


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


def finished_summary(run_dir: Path, cfg: DictConfig) -> dict[str, Any] | None:
    """The summary of the finished run of ``cfg`` in ``run_dir`` (all its rounds, not marked
    FAILED), or None. ``overwrite=true`` never finds one: it runs again. ``pflower run``,
    ``sweep`` and the ServerApp under ``flwr run`` reuse such a run instead of refusing it."""
    summary = run_dir / SUMMARY_FILE
    run = run_settings(cfg).run
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


class RunRecorder:
    """Writes one run's folder as the run goes (holding its lock until :meth:`close`)."""

    def __init__(self, cfg: DictConfig, resume: bool = False, overrides: list[str] | None = None) -> None:
        self.cfg = cfg
        self.dir = run_dir_of(cfg)
        self.lock = RunFolderLock(self.dir).acquire()
        run = run_settings(cfg).run
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
        if self.tensorboard is None and run_settings(self.cfg).run.tensorboard:
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
        self.rounds.append(record)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if (events := self._events(int(record["round"]))) is not None:
            events.log_round(record, round_s=elapsed - self._last_elapsed)
        self._last_elapsed = elapsed

    def finish(self, client_info: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any] | None = None,
               status: str = "completed") -> dict[str, Any]:
        summary = build_summary(self.cfg, self.rounds, client_info, status)
        summary.update(dict(extra or {}))
        summary["machine"] = machine_description(run_settings(self.cfg).run.device)
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


def machine_description(device: str) -> dict[str, Any]:
    """The machine the run's numbers came from (the server's: in a simulation also the
    clients'): the same seed on another CPU, GPU or torch version may differ in the last
    digits, so a table's per-seed values name it."""
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else None
    return {"torch": torch.__version__, "gpu": gpu, "cpu": _cpu_model() or platform.machine(),
            "cpu_count": os.cpu_count()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# keys whose overrides are not saved: the folder itself says where the run is
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


def _eval_rounds(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rounds if r.get("evaluate")]


def build_summary(cfg: DictConfig, rounds: list[dict[str, Any]],
                  client_info: Mapping[str, Mapping[str, Any]], status: str) -> dict[str, Any]:
    """Final (last evaluated round) and best-by-validation personalised accuracy."""
    evals = _eval_rounds(rounds)
    if not evals:
        raise RuntimeError("no evaluation round completed; nothing to summarise")
    last = evals[-1]
    settings = run_settings(cfg)
    by = best_round_metric(cfg)
    best = max(best_round_candidates(evals), key=lambda r: r["evaluate"].get(by, -1.0))
    per_client = last["clients"]
    summary: dict[str, Any] = {
        "status": status,
        "strategy": settings.strategy,
        "dataset": settings.dataset,
        "model": settings.model,
        "seed": settings.run.seed,
        "run_name": settings.run.run_name,
        "rounds": int(rounds[-1]["round"]),
        "accuracy_mean": last["evaluate"]["accuracy_mean"],
        "accuracy_min": last["evaluate"]["accuracy_min"],
        "accuracy_std": last["evaluate"]["accuracy_std"],
        "val_accuracy_mean": last["evaluate"].get("val_accuracy_mean"),
        "best_round": best["round"],
        "best_accuracy_mean": best["evaluate"]["accuracy_mean"],
        "best_accuracy_min": best["evaluate"]["accuracy_min"],
        "best_val_accuracy_mean": best["evaluate"].get("val_accuracy_mean"),
        "best_round_by": by,
        "best_val_accuracy": best["evaluate"].get(by),
        # per-client test accuracy at the best round (R-Acc/PTR there, as FEDORA's authors)
        "best_clients": {cid: m["accuracy"] for cid, m in best.get("clients", {}).items()},
        "clients": {},
    }
    for key in ("global_accuracy", "ft_accuracy"):
        if f"{key}_mean" in last["evaluate"]:
            summary[f"{key}_mean"] = last["evaluate"][f"{key}_mean"]
            summary[f"{key}_min"] = last["evaluate"][f"{key}_min"]
            summary[f"{key}_std"] = last["evaluate"][f"{key}_std"]
    curve = {k[len("ft_acc_e"):]: v for k, v in last["evaluate"].items()
             if k.startswith("ft_acc_e") and k.endswith("_mean")}
    if curve:
        summary["finetune_curve"] = {k[: -len("_mean")]: v for k, v in sorted(
            curve.items(), key=lambda kv: int(kv[0].split("_")[0]))}
    for cid, m in sorted(per_client.items(), key=lambda kv: client_sort_key(kv[0])):
        entry = {"accuracy": m["accuracy"], "num_train": int(client_info.get(cid, {}).get("num_train", 0))}
        for key in ("val_accuracy", "global_accuracy", "ft_accuracy"):
            if key in m:
                entry[key] = m[key]
        if "domain" in client_info.get(cid, {}):
            entry["domain"] = client_info[cid]["domain"]
        summary["clients"][cid] = entry
    summary.update(pooled_accuracy(per_client))
    summary.update(bn_protocol_summary(cfg, evals))
    summary.update(client_coverage(rounds, last, client_info))
    if summary["clients_missing"]:
        summary["status"] = f"{status}-partial" if status != "completed" else "partial"
    comm = [r.get("communication", {}) for r in rounds]
    up = [sum(c.get("bytes_up", {}).values()) for c in comm if c]
    down = [sum(c.get("bytes_down", {}).values()) for c in comm if c]
    if up:
        summary["bytes_up_per_round"] = float(np.mean(up))
        summary["bytes_down_per_round"] = float(np.mean(down))
        per_client_up = [np.mean(list(c["bytes_up"].values())) for c in comm if c.get("bytes_up")]
        summary["bytes_up_per_client_round"] = float(np.mean(per_client_up)) if per_client_up else 0.0
    summary["elapsed_s"] = rounds[-1].get("elapsed_s")
    return summary


def pooled_accuracy(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """FDSE's "ALL" beside the mean over clients ("AVG"): the accuracy over the pooled test
    samples of every client, sum_k acc_k n_k / sum_k n_k, with n_k the client's test size."""
    sizes = {c: float(m.get("num-examples", 0)) for c, m in per_client.items()}
    total = sum(sizes.values())
    if total <= 0:
        return {}
    return {"accuracy_all": sum(float(m["accuracy"]) * sizes[c] for c, m in per_client.items()) / total}


BN_AS_HELD = "as held (no personal BN model: the server's model, a fine-tuned model, or no BN running statistics)"


def bn_label(summary: Mapping[str, Any]) -> str:
    """The headline's BN protocol in a word or two (``own``, ``stored``, ``as held``), for
    plot titles and table cells."""
    return str(summary.get("bn_statistics", BN_AS_HELD)).split(" (")[0]


def bn_protocol_summary(cfg: DictConfig, evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Which BN statistics the headline accuracy was tested with (``bn_statistics``: ``own``,
    recomputed on each client's train split, or ``stored``), and every protocol the run
    measured (``bn_protocols``): accuracy at the last round and at the best round, each
    protocol's best round chosen by its own validation accuracy, as the headline's is."""
    measured = [p for p in ("own", "stored") if f"{p}_bn_accuracy_mean" in evals[-1]["evaluate"]]
    if not measured:
        return {"bn_statistics": BN_AS_HELD}
    by = best_round_metric(cfg)
    protocols: dict[str, dict[str, Any]] = {}
    for protocol in measured:
        key = f"{protocol}_bn_"
        rounds = [r for r in evals if f"{key}accuracy_mean" in r["evaluate"]]
        best = max(rounds, key=lambda r: r["evaluate"].get(key + by, -1.0))
        last = rounds[-1]
        protocols[protocol] = {
            "accuracy_mean": last["evaluate"][f"{key}accuracy_mean"],
            "accuracy_min": last["evaluate"][f"{key}accuracy_min"],
            "best_round": best["round"],
            "best_accuracy_mean": best["evaluate"][f"{key}accuracy_mean"],
            "best_accuracy_min": best["evaluate"][f"{key}accuracy_min"],
            "clients": {cid: m[f"{key}accuracy"] for cid, m in last.get("clients", {}).items()
                        if f"{key}accuracy" in m},
        }
    return {"bn_statistics": "own" if run_settings(cfg).run.eval_bn_statistics == "recompute" else "stored",
            "bn_protocols": protocols}


def best_round_metric(cfg: DictConfig) -> str:
    """The evaluation metric the best round maximises: ``val_accuracy_mean`` (mean over
    clients, the default) or ``val_accuracy_weighted`` (weighted by each client's validation
    size, as flgo-based code such as FDSE's selects; ``best_round_by: weighted``)."""
    return "val_accuracy_weighted" if run_settings(cfg).run.best_round_by == "weighted" else "val_accuracy_mean"


def best_round_candidates(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds the best round may be chosen from: for fine-tuning methods only evaluations
    that fine-tuned (the others measured the global model before fine-tuning, a different
    protocol), for every other method all evaluated rounds."""
    tuned = [r for r in evals if r["evaluate"].get("finetuned_mean") == 1.0]
    return tuned or evals


def client_coverage(rounds: list[dict[str, Any]], last: Mapping[str, Any],
                    client_info: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Which of the run's clients the final numbers cover, and why the others are missing
    (an accuracy mean over 7 of 8 clients must say so)."""
    expected = sorted(client_info, key=client_sort_key)
    reported = [c for c in expected if c in last.get("clients", {})]
    failed_rounds: dict[str, int] = {}
    last_reason: dict[str, str] = {}
    for r in rounds:
        for cid, reason in {**r.get("failed", {}), **r.get("rejected", {})}.items():
            if cid in client_info:
                failed_rounds[cid] = failed_rounds.get(cid, 0) + 1
                last_reason[cid] = f"round {r['round']}: {reason}"
    eval_failed = last.get("eval_failed", {})
    missing = {c: (f"final evaluation: {eval_failed[c]}" if c in eval_failed
                   else last_reason.get(c, "no reply to the final evaluation"))
               for c in expected if c not in reported}
    return {"clients_expected": len(expected), "clients_reported": len(reported),
            "clients_missing": missing, "client_failures": failed_rounds}


def accuracy_lines(evals: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The accuracy series to draw: personalised, and the global model's when it differs
    (for FedAvg they are the same model: one line, labelled so, instead of two on top of
    each other)."""
    ev = evals[-1]["evaluate"]
    if "global_accuracy_mean" not in ev:
        return [("accuracy", "personalised")]
    same = all(r["evaluate"].get("global_accuracy_mean") == r["evaluate"]["accuracy_mean"]
               and r["evaluate"].get("global_accuracy_min") == r["evaluate"]["accuracy_min"] for r in evals)
    if same:
        return [("accuracy", "personalised = global model")]
    return [("accuracy", "personalised"), ("global_accuracy", "global model")]


def plot_run(run_dir: Path, rounds: list[dict[str, Any]], summary: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    evals = _eval_rounds(rounds)
    xs = [r["round"] for r in evals]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in accuracy_lines(evals):
        ax.plot(xs, [r["evaluate"][f"{key}_mean"] for r in evals], marker=".", label=f"{label} (mean)")
        ax.plot(xs, [r["evaluate"][f"{key}_min"] for r in evals], "--", label=f"{label} (min)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy over clients")
    ax.set_title(f"{summary['strategy']} on {summary['dataset']} (seed {summary['seed']})\n"
                 f"BN statistics: {bn_label(summary)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy.png", dpi=100)
    plt.close(fig)

    clients = summary["clients"]
    domains = sorted({str(c.get("domain", "")) for c in clients.values()})
    colours = {d: f"C{i % 10}" for i, d in enumerate(domains)}
    fig, ax = plt.subplots(figsize=(inches(len(clients), 0.6, 6.0), 4))
    bars = ax.bar(range(len(clients)), [c["accuracy"] for c in clients.values()],
                  color=[colours[str(c.get("domain", ""))] for c in clients.values()])
    step = tick_step(len(clients))
    ax.set_xticks(range(0, len(clients), step), [f"{cid}\n{c.get('domain', '')}" for cid, c in
                                                 list(clients.items())[::step]], fontsize=7)
    if len(domains) > 1:
        seen: set[str] = set()
        handles = [(b, str(c.get("domain"))) for b, c in zip(bars, clients.values(), strict=True)
                   if str(c.get("domain")) not in seen and not seen.add(str(c.get("domain")))]
        ax.legend([h for h, _ in handles], [d for _, d in handles], title="domain", fontsize=7)
    ax.set_xlabel("client (domain)")
    ax.set_ylabel("final personalised test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"{summary['strategy']}: mean {summary['accuracy_mean']:.3f}, min {summary['accuracy_min']:.3f} "
                 f"(BN statistics: {bn_label(summary)})", fontsize=9)
    fig.tight_layout()
    fig.savefig(run_dir / "clients.png", dpi=100)
    plt.close(fig)

    if "finetune_curve" in summary:
        curve = summary["finetune_curve"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([int(k) for k in curve], list(curve.values()), "o-")
        ax.set_xlabel("fine-tune epochs")
        ax.set_ylabel("mean test accuracy")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(run_dir / "finetune_curve.png", dpi=100)
        plt.close(fig)
