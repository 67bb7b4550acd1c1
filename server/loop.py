"""The federation loop: rounds of train -> aggregate -> evaluate all -> record -> checkpoint.

Flower's ``Strategy.start`` runs train/evaluate rounds too; pflower drives the same
strategy methods itself to add what PFL experiments need: evaluation of *every* client
on its own test split, per-round records with communication and failures, server
checkpoints and resume, and a final evaluation flagged ``final`` (fine-tune curves).
"""

from __future__ import annotations

import time
from logging import INFO
from typing import Any

from flwr.app import ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from omegaconf import DictConfig

from common.protocol import to_record
from server.checkpoint import (
    CheckpointError,
    load_checkpoint,
    restore_rng_state,
    rng_state_groups,
    save_checkpoint,
)
from server.results import RunRecorder
from strategies.base import PersonalizedStrategy


def checkpoint_identity(cfg: DictConfig, num_clients: int | None = None) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed by this configuration."""
    ident: dict[str, Any] = {"strategy": str(cfg.strategy.name), "model": str(cfg.model.name),
                             "dataset": str(cfg.dataset.name), "seed": int(cfg.seed)}
    if num_clients is not None:
        ident["num_clients"] = int(num_clients)
    return ident


def run_federation(strategy: PersonalizedStrategy, grid: Grid, cfg: DictConfig,
                   recorder: RunRecorder) -> int:
    """Run rounds ``start..cfg.rounds``; returns the last completed round."""
    start = 1
    rounds = int(cfg.rounds)
    identity = checkpoint_identity(cfg, len(strategy.client_ids))
    if cfg.resume:
        last, groups, meta = load_checkpoint(recorder.dir, identity)
        if last > rounds:
            raise CheckpointError(f"the checkpoint in {recorder.dir} is at round {last}, beyond rounds={rounds}")
        restore_rng_state(groups.pop("_rng", {}), meta.get("rng_state", {}))
        strategy.load_state_arrays(groups)
        strategy.load_state_meta(meta.get("strategy_state", {}))
        recorder.truncate_to(last)
        start = last + 1
        log(INFO, "resumed %s from the checkpoint of round %d", recorder.dir, last)
    strategy.summary()
    # resume-round tells clients which of their saved state versions are valid
    base_config = {"run-name": str(cfg.run_name), "num-rounds": rounds, "resume-round": start - 1}
    for rnd in range(start, rounds + 1):
        t0 = time.monotonic()
        messages = list(strategy.configure_train(rnd, to_record(strategy.global_arrays),
                                                 ConfigRecord(dict(base_config)), grid))
        replies = grid.send_and_receive(messages, timeout=float(cfg.round_timeout))
        _, train_metrics = strategy.aggregate_train(rnd, replies)
        comm = strategy.round_log
        record: dict[str, Any] = {
            "round": rnd,
            "train": dict(train_metrics.items()) if train_metrics is not None else {},
            "communication": {"bytes_up": comm.bytes_up, "bytes_down": comm.bytes_down},
            "sampled": comm.sampled,
            "failed": comm.failed,
            "rejected": comm.rejected,
        }
        if rnd % int(cfg.eval_every) == 0 or rnd == rounds:
            eval_cfg = ConfigRecord({**base_config, "final": rnd == rounds})
            messages = list(strategy.configure_evaluate(rnd, to_record(strategy.global_arrays), eval_cfg, grid))
            replies = grid.send_and_receive(messages, timeout=float(cfg.round_timeout))
            summary = strategy.aggregate_evaluate(rnd, replies)
            if summary is not None:
                record["evaluate"] = dict(summary.items())
                record["clients"] = strategy.last_eval
                record["eval_failed"] = strategy.eval_failed
        record.update(strategy.round_extras(rnd))
        recorder.log_round(record)
        ev = record.get("evaluate", {})
        log(INFO, "[round %d/%d] %.1fs | %d/%d clients trained | accuracy mean %s min %s",
            rnd, rounds, time.monotonic() - t0, len(comm.replied), len(comm.sampled),
            f"{ev['accuracy_mean']:.4f}" if ev else "-", f"{ev['accuracy_min']:.4f}" if ev else "-")
        if int(cfg.checkpoint_every) > 0 and (rnd % int(cfg.checkpoint_every) == 0 or rnd == rounds):
            rng_arrays, rng_meta = rng_state_groups()
            save_checkpoint(recorder.dir, rnd, {**strategy.state_arrays(), "_rng": rng_arrays},
                            {**identity, "strategy_state": strategy.state_meta(), "rng_state": rng_meta})
    return rounds
