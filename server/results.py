"""Run folders: resolved config, per-round metrics, summary and plots.

``<results_root>/<run_name>/``
- ``config.yaml``: the resolved Hydra config of the run;
- ``metrics.jsonl``: one JSON line per round (train metrics, evaluation summary over
  clients, per-client evaluation metrics, communication and failures);
- ``summary.json``: final personalised test accuracy over clients (mean/min/std), the
  best round chosen on validation accuracy, per-client numbers;
- ``accuracy.png`` (mean/min accuracy over rounds) and ``clients.png`` (per client).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from learning.storage import atomic_write_text

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(str(cfg.results_root)) / str(cfg.run_name)


class RunRecorder:
    """Writes one run's folder as the run goes."""

    def __init__(self, cfg: DictConfig, resume: bool = False) -> None:
        self.cfg = cfg
        self.dir = run_dir_of(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        atomic_write_text(self.dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        self.metrics_path = self.dir / METRICS_FILE
        self.rounds: list[dict[str, Any]] = []
        if resume and self.metrics_path.exists():
            self.rounds = _read_rounds(self.metrics_path)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        (self.dir / SUMMARY_FILE).unlink(missing_ok=True)

    def truncate_to(self, last_round: int) -> None:
        """On resume: drop lines of rounds after the checkpoint (they will be redone)."""
        self.rounds = [r for r in self.rounds if r["round"] <= last_round]
        atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.rounds))

    def log_round(self, record: dict[str, Any]) -> None:
        record = {**record, "elapsed_s": round(time.monotonic() - self.t0, 3)}
        self.rounds.append(record)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def finish(self, client_info: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any] | None = None,
               status: str = "completed") -> dict[str, Any]:
        summary = build_summary(self.cfg, self.rounds, client_info, status)
        summary.update(dict(extra or {}))
        atomic_write_text(self.dir / SUMMARY_FILE, json.dumps(summary, indent=2))
        try:
            plot_run(self.dir, self.rounds, summary)
        except Exception as err:  # plotting must never lose the results
            summary["plot_error"] = str(err)
            atomic_write_text(self.dir / SUMMARY_FILE, json.dumps(summary, indent=2))
        return summary


def _read_rounds(path: Path) -> list[dict[str, Any]]:
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
    best = max(evals, key=lambda r: r["evaluate"].get("val_accuracy_mean", -1.0))
    per_client = last["clients"]
    summary: dict[str, Any] = {
        "status": status,
        "strategy": str(cfg.strategy.name),
        "dataset": str(cfg.dataset.name),
        "model": str(cfg.model.name),
        "seed": int(cfg.seed),
        "run_name": str(cfg.run_name),
        "rounds": int(rounds[-1]["round"]),
        "accuracy_mean": last["evaluate"]["accuracy_mean"],
        "accuracy_min": last["evaluate"]["accuracy_min"],
        "accuracy_std": last["evaluate"]["accuracy_std"],
        "val_accuracy_mean": last["evaluate"].get("val_accuracy_mean"),
        "best_round": best["round"],
        "best_accuracy_mean": best["evaluate"]["accuracy_mean"],
        "best_accuracy_min": best["evaluate"]["accuracy_min"],
        "best_val_accuracy_mean": best["evaluate"].get("val_accuracy_mean"),
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
    for cid, m in sorted(per_client.items(), key=lambda kv: _cid_key(kv[0])):
        entry = {"accuracy": m["accuracy"], "num_train": int(client_info.get(cid, {}).get("num_train", 0))}
        for key in ("val_accuracy", "global_accuracy", "ft_accuracy"):
            if key in m:
                entry[key] = m[key]
        if "domain" in client_info.get(cid, {}):
            entry["domain"] = client_info[cid]["domain"]
        summary["clients"][cid] = entry
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


def _cid_key(cid: str) -> tuple[int, int]:
    return (1, int(cid[4:])) if cid.startswith("new-") else (0, int(cid) if cid.isdigit() else 0)


def plot_run(run_dir: Path, rounds: list[dict[str, Any]], summary: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = _eval_rounds(rounds)
    xs = [r["round"] for r in evals]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("accuracy", "personalised"), ("global_accuracy", "global model")):
        if f"{key}_mean" in evals[-1]["evaluate"]:
            ax.plot(xs, [r["evaluate"][f"{key}_mean"] for r in evals], label=f"{label} (mean)")
            ax.plot(xs, [r["evaluate"][f"{key}_min"] for r in evals], "--", label=f"{label} (min)")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy over clients")
    ax.set_title(f"{summary['strategy']} on {summary['dataset']} (seed {summary['seed']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy.png", dpi=100)
    plt.close(fig)

    clients = summary["clients"]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(clients)), 4))
    ax.bar(list(clients), [c["accuracy"] for c in clients.values()])
    ax.set_xlabel("client")
    ax.set_ylabel("final personalised test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"{summary['strategy']}: mean {summary['accuracy_mean']:.3f}, min {summary['accuracy_min']:.3f}")
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
