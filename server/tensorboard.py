"""TensorBoard event files per run, so ``tensorboard --logdir results/`` compares runs side
by side while they train: ``<run>/tensorboard/``.

Per round (step = server round), from the record that goes into ``metrics.jsonl``:
``accuracy/mean|worst|std`` (personalised test accuracy over clients), ``accuracy/global_*``
where the method has a global model, ``clients/accuracy/<id>``, every numeric training
metric as ``train/<name>`` (loss, and the methods' own: PartialFed's gate probabilities
``p_global/<unit>``, FEDORA's ``lambda``, ...), ``communication/bytes_up|down``,
``time/round_s``, ``clients/failed``, and the method's diagnostics from
notes its aggregation returns as ``method/<path>`` (FedBasis' basis entropy and coefficients, FDSE's
consensus weights, ...), and with differential privacy ``privacy/epsilon|delta|noise_std|clipped|...``
(docs/privacy.md). At the end the run's hyper-parameters with its final numbers
(TensorBoard's HPARAMS tab), and the resolved config as text.

Written only when the optional ``tensorboard`` package is installed (``pip install
".[tensorboard]"``) and ``tensorboard=true`` (the default); a writing error never stops a run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

TB_DIR = "tensorboard"
MAX_METHOD_TAGS = 512   # diagnostics beyond this many scalars a round are left to metrics.jsonl


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(float(value)) else None


def flatten_scalars(tree: Any, prefix: str) -> dict[str, float]:
    """Every finite number in nested dicts/lists as ``prefix/key/.../index`` -> value."""
    out: dict[str, float] = {}
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            out.update(flatten_scalars(value, f"{prefix}/{key}"))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            out.update(flatten_scalars(value, f"{prefix}/{i}"))
    elif (number := _number(tree)) is not None:
        out[prefix] = number
    return out


# keys of a round record that are not diagnostics of the method
_RECORD_KEYS = {"round", "train", "communication", "sampled", "failed", "rejected", "evaluate",
                "clients", "eval_failed", "elapsed_s", "privacy", "record_dp", "secure_aggregation"}


def evaluation_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The tags of a round's evaluation (it may arrive after the round's training)."""
    out: dict[str, float] = {}
    ev = record.get("evaluate") or {}
    for name, tag in (("accuracy", "accuracy"), ("global_accuracy", "accuracy/global"),
                      ("val_accuracy", "accuracy/val"), ("ft_accuracy", "accuracy/finetuned")):
        for stat, label in (("mean", "mean"), ("min", "worst"), ("std", "std")):
            if (value := _number(ev.get(f"{name}_{stat}"))) is not None:
                out[f"{tag}/{label}" if name != "accuracy" else f"accuracy/{label}"] = value
    for cid, metrics in (record.get("clients") or {}).items():
        if (value := _number(metrics.get("accuracy"))) is not None:
            out[f"clients/accuracy/{cid}"] = value
    if record.get("evaluate") is not None:
        out["clients/eval_failed"] = float(len(record.get("eval_failed") or {}))
    return out


def round_scalars(record: Mapping[str, Any], round_s: float | None = None) -> dict[str, float]:
    """The tags of one round record (see the module docstring)."""
    train = {k.removeprefix("train_"): v for k, v in (record.get("train") or {}).items()}
    out = flatten_scalars(train, "train")   # train_loss -> train/loss
    comm = record.get("communication") or {}
    out["communication/bytes_up"] = float(sum((comm.get("bytes_up") or {}).values()))
    out["communication/bytes_down"] = float(sum((comm.get("bytes_down") or {}).values()))
    out["clients/sampled"] = float(len(record.get("sampled") or []))
    out["clients/failed"] = float(len(record.get("failed") or {}) + len(record.get("rejected") or {}))
    if round_s is not None:
        out["time/round_s"] = float(round_s)
    out.update(flatten_scalars(record.get("privacy") or {}, "privacy"))   # epsilon, noise_std, clipped, ...
    # record-level DP-SGD: each client's epsilon and the largest; SecAgg+: clients, drop-outs, bound, bytes
    out.update(flatten_scalars(record.get("record_dp") or {}, "privacy/record"))
    out.update(flatten_scalars(record.get("secure_aggregation") or {}, "secure_aggregation"))
    method = flatten_scalars({k: v for k, v in record.items() if k not in _RECORD_KEYS}, "method")
    out.update(dict(list(method.items())[:MAX_METHOD_TAGS]))
    out.update(evaluation_scalars(record))
    return out


def hparams_of(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The run's hyper-parameters as TensorBoard takes them (flat; numbers, strings, bools)."""
    flat: dict[str, Any] = {}

    def walk(tree: Any, prefix: str) -> None:
        if isinstance(tree, Mapping):
            for key, value in tree.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(tree, bool | int | float | str):
            flat[prefix] = tree
    keep = ("strategy", "dataset", "model", "train", "seed", "rounds", "fraction_train")
    walk({k: cfg[k] for k in keep if k in cfg}, "")
    return {k: v for k, v in flat.items() if not k.startswith("dataset.root")}


class TensorBoardLog:
    """One run's event files; every method is a no-op when TensorBoard is not installed."""

    def __init__(self, run_dir: Path, purge_from: int | None = None) -> None:
        """``purge_from``: a resumed run's first round; events of that round and after,
        from the attempt that was cut short, are dropped as the new ones are written."""
        self.writer: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:   # the optional extra is not installed
            return
        try:
            self.writer = SummaryWriter(str(Path(run_dir) / TB_DIR), purge_step=purge_from)
        except Exception as err:   # a log must never stop the run
            log(WARNING, "tensorboard: cannot write events in %s: %s", run_dir, err)

    @staticmethod
    def preload() -> None:
        """Import the writer before the first round (~0.25 s), so that no round pays for it."""
        with contextlib.suppress(ImportError):
            import torch.utils.tensorboard  # noqa: F401

    @property
    def active(self) -> bool:
        return self.writer is not None

    def _scalars(self, scalars: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        try:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        except Exception as err:
            log(WARNING, "tensorboard: writing round %d failed (%s); no more events for this run", step, err)
            self.close()

    def log_round(self, record: Mapping[str, Any], round_s: float | None = None) -> None:
        self._scalars(round_scalars(record, round_s), int(record["round"]))

    def log_evaluation(self, record: Mapping[str, Any]) -> None:
        """A round's evaluation that arrived with the next round's training messages."""
        self._scalars(evaluation_scalars(record), int(record["round"]))

    def log_run(self, cfg: Mapping[str, Any], config_yaml: str, summary: Mapping[str, Any]) -> None:
        """Hyper-parameters with the run's final numbers (HPARAMS tab) and its config."""
        if self.writer is None:
            return
        try:
            from torch.utils.tensorboard.summary import hparams

            metrics = {f"final/{k}": v for k in ("accuracy_mean", "accuracy_min", "best_accuracy_mean")
                       if (v := _number(summary.get(k))) is not None}
            for part in hparams(hparams_of(cfg), metrics):
                self.writer.file_writer.add_summary(part)
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, int(summary.get("rounds", 0)))
            self.writer.add_text("config", "```\n" + config_yaml + "\n```")
            self.writer.flush()
        except Exception as err:
            log(WARNING, "tensorboard: writing the run's hyper-parameters failed: %s", err)

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            finally:
                self.writer = None
