"""The federation loop: rounds of train -> aggregate -> evaluate all -> record -> checkpoint.

With ``eval_in_train`` (default) a round's evaluation rides on the next round's training
messages: each client first evaluates what it received (the aggregate of the round before,
on its unchanged private state: what an evaluate message would have carried), then trains;
clients not sampled get an evaluate message. That halves the messages per round (in a
deployment, one ClientApp process per message) and gives the same numbers; the final
round's evaluation is its own step.

Flower's ``Strategy.start`` runs train/evaluate rounds too; pflower drives the same
strategy methods itself to add what PFL experiments need: evaluation of *every* client
on its own test split, per-round records with communication and failures, server
checkpoints and resume, and a final evaluation flagged ``final`` (fine-tune curves).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.bundles import send_and_receive
from common.flower_compat import is_deployment_grid, simulation_worker_lost
from common.protocol import EVALUATE_ROUND
from common.settings import RunKeys, Settings
from common.timing import note, part, timed, timing_folder
from server.checkpoint import (
    CheckpointError,
    another_instruction_set,
    load_checkpoint,
    restore_rng_state,
    rng_state_groups,
    save_checkpoint,
)
from server.results import RunRecorder
from server.summary import cpu_capability
from strategies.base import PersonalizedStrategy, TrainRound


def checkpoint_identity(settings: Settings, num_clients: int | None = None) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed by this configuration."""
    ident: dict[str, Any] = {"strategy": settings.strategy, "model": settings.model,
                             "dataset": settings.dataset, "seed": settings.run.seed}
    if num_clients is not None:
        ident["num_clients"] = int(num_clients)
    return ident


class SimulationWorkerLost(RuntimeError):
    """The simulation's Ray backend lost a worker process (killed, out of memory). Flower
    removes its actor and starts no other, so the clients it served would fail every later
    round and the run would go on with fewer clients than it was asked for. The round is given
    up before it is recorded or checkpointed; ``pflower run`` resumes the run from its last
    checkpoint on a fresh simulation (``recoveries.jsonl``), which ends where an undisturbed
    run ends."""


def stop_if_worker_lost(grid: Grid, replies: list[Message], server_round: int) -> None:
    """Raise :class:`SimulationWorkerLost` when a reply of a simulation says its worker died."""
    if is_deployment_grid(grid):     # a deployment's nodes are processes of their own
        return
    for msg in replies:
        if msg.has_error() and simulation_worker_lost(msg.error.reason):
            raise SimulationWorkerLost(
                f"round {server_round}: the simulation lost the worker process of a client ({msg.error.reason[:160]}); "
                "resume the run from its checkpoint (pflower run does it by itself)")


def run_federation(strategy: PersonalizedStrategy, grid: Grid, settings: Settings,
                   recorder: RunRecorder) -> int:
    """Run rounds ``start..rounds`` of the composed run's ``settings``; returns the last
    completed round."""
    start = 1
    run = settings.run
    rounds = run.rounds
    identity = checkpoint_identity(settings, len(strategy.client_ids))
    if run.resume:
        last, groups, meta = load_checkpoint(recorder.dir, identity)
        if last > rounds:
            raise CheckpointError(f"the checkpoint in {recorder.dir} is at round {last}, beyond rounds={rounds}")
        if (why := another_instruction_set(meta, cpu_capability())) is not None:
            log(WARNING, "resuming %s: %s", recorder.dir, why)
        restore_rng_state(groups.pop("_rng", {}), meta.get("rng_state", {}))
        strategy.load_state(groups, meta.get("strategy_state", {}))
        recorder.truncate_to(last)
        start = last + 1
        log(INFO, "resumed %s from the checkpoint of round %d", recorder.dir, last)
    strategy.summary()
    # resume-round tells clients which of their saved state versions are valid
    base_config = {"run-name": run.run_name, "num-rounds": rounds, "resume-round": start - 1}
    fused = FusedEvaluation(run.eval_in_train and strategy.fuses_evaluation, run)
    latest: tuple[int, dict[str, Any]] | None = None   # the last evaluation known: (round, summary)
    if start > 1 and recorder.rounds and "evaluate" not in recorder.rounds[-1]:
        fused.resume_after(start - 1)   # the checkpoint was taken before that evaluation arrived
    for server_round in range(start, rounds + 1):
        # timed by part only when asked (PFLOWER_TIMING=<folder>): untimed, a client run in
        # this process (a test's fake grid) adds nothing to a server line
        with timed("round", role="server") if timing_folder() is not None else nullcontext():
            note(server_round=server_round)
            latest = _one_round(strategy, grid, run, recorder, server_round, rounds, base_config, identity,
                                fused, latest)
    return rounds


def _one_round(strategy: PersonalizedStrategy, grid: Grid, run: RunKeys, recorder: RunRecorder,
               server_round: int, rounds: int, base_config: dict[str, Any], identity: dict[str, Any],
               fused: FusedEvaluation, latest: tuple[int, dict[str, Any]] | None
               ) -> tuple[int, dict[str, Any]] | None:
    """One round: train (carrying the previous round's evaluation), aggregate, evaluate where
    due, record, checkpoint. Returns the last evaluation known, as ``latest``."""
    t0 = time.monotonic()
    with part("configure"):
        # each reply is validated as it arrives, and folded into the mean at once when the
        # round's replies would not fit side by side (strategy.streams_round)
        train = strategy.begin_train(server_round, {**base_config, **fused.train_config()}, grid)
    with part("replies"):   # the clients' work, and each reply taken in as it arrives
        if strategy.secure is not None:     # SecAgg+: its four exchanges around the train messages
            replies = strategy.secure.run(grid, train, strategy.directory, run.round_timeout,
                                          lambda replies: stop_if_worker_lost(grid, replies, server_round))
        else:
            replies = send_and_receive(grid, train.messages, timeout=run.round_timeout, on_reply=train.replies.take,
                                       rejoin=train.exchange)
    train.messages.clear()
    stop_if_worker_lost(grid, replies, server_round)
    pending = fused.take()
    if pending is not None:  # before aggregating: the stragglers' evaluate messages need the old model
        with part("evaluate"):
            carried = _evaluate(strategy, grid, run, base_config, pending, replies, train)
        recorder.attach_evaluation(pending, carried)
        latest = (pending, carried["evaluate"]) if carried.get("evaluate") else latest
    with part("aggregate"):
        result = strategy.aggregate_round(train)
    comm = result.log
    record: dict[str, Any] = {
        "round": server_round,
        "train": result.metrics,
        "communication": {"bytes_up": comm.bytes_up, "bytes_down": comm.bytes_down},
        "sampled": comm.sampled,
        "failed": comm.failed,
        "rejected": comm.rejected,
    }
    if _is_eval_round(server_round, run) and not fused.defer(server_round):
        with part("evaluate"):
            record.update(_evaluate(strategy, grid, run, base_config, server_round))
    with part("record"):
        record.update(result.notes)
        recorder.log_round(record)
    if record.get("evaluate"):
        latest = (server_round, record["evaluate"])
    log(INFO, "%s", round_line(server_round, rounds, time.monotonic() - t0, len(comm.replied), len(comm.sampled),
                               latest, fused.pending))
    if run.checkpoint_every > 0 and (server_round % run.checkpoint_every == 0 or server_round == rounds):
        with part("checkpoint"):
            rng_arrays, rng_meta = rng_state_groups()
            groups, meta = strategy.state()
            save_checkpoint(recorder.dir, server_round, {**groups, "_rng": rng_arrays},
                            {**identity, "strategy_state": meta, "rng_state": rng_meta,
                             "cpu_capability": cpu_capability()})
    return latest


def round_line(server_round: int, rounds: int, seconds: float, trained: int, sampled: int,
               latest: tuple[int, dict[str, Any]] | None, pending: int | None) -> str:
    """The one line a round leaves in the log (the only one ``pflower run`` shows off a
    terminal): its time, how many clients trained, and the last accuracy known, naming its
    round (with ``eval_in_train`` a round's evaluation arrives with the next round's training)."""
    line = f"[round {server_round}/{rounds}] {seconds:.1f} s, {trained}/{sampled} clients trained; "
    if latest is not None:
        known, ev = latest
        return line + (f"accuracy{'' if known == server_round else f' of round {known}'}: mean "
                       f"{ev['accuracy_mean']:.4f}, worst client {ev['accuracy_min']:.4f}")
    if pending == server_round:
        return line + f"accuracy: round {server_round}'s comes with round {server_round + 1}'s training"
    return line + "accuracy: not measured yet"


class FusedEvaluation:
    """The hand-over of a round's evaluation to the next round's training messages
    (``eval_in_train``): the loop defers an evaluation round's evaluation (not the last
    round's), names it in the next train config (``EVALUATE_ROUND``), and takes it back when
    the replies are in."""

    def __init__(self, enabled: bool, run: RunKeys) -> None:
        self.enabled, self.run = enabled, run
        self.pending: int | None = None

    def resume_after(self, last: int) -> None:
        """After a resume at ``last``: its evaluation, if it was deferred, is still owed."""
        if self.enabled and _is_eval_round(last, self.run):
            self.pending = last

    def train_config(self) -> dict[str, Any]:
        return {EVALUATE_ROUND: self.pending} if self.pending is not None else {}

    def take(self) -> int | None:
        """The round whose evaluation this round's train replies carry (then none)."""
        pending, self.pending = self.pending, None
        return pending

    def defer(self, server_round: int) -> bool:
        """Defer evaluation round ``server_round`` to the next round's messages, when that exists."""
        if self.enabled and server_round < self.run.rounds:
            self.pending = server_round
            return True
        return False


def _is_eval_round(server_round: int, run: RunKeys) -> bool:
    return server_round % run.eval_every == 0 or server_round == run.rounds


def _evaluate(strategy: PersonalizedStrategy, grid: Grid, run: RunKeys, base_config: dict[str, Any],
              server_round: int, train_replies: list[Message] | None = None,
              train: TrainRound | None = None) -> dict[str, Any]:
    """Round ``server_round``'s evaluation of every connected client: the evaluations that came with
    ``train_replies`` (``eval_in_train``) plus evaluate messages to every other client (not
    sampled, failed, or all of them when there are no such replies)."""
    evaluate = strategy.begin_evaluate(server_round, {**base_config, "final": server_round == run.rounds}, grid,
                                       carried=train_replies or (), train=train)
    replies = (send_and_receive(grid, evaluate.messages, timeout=run.round_timeout, rejoin=evaluate.exchange)
               if evaluate.messages else [])
    stop_if_worker_lost(grid, replies, server_round)
    evaluation = strategy.evaluation_of(evaluate, replies)
    summary = evaluation.summary()
    if summary is None:
        return {}
    if train_replies is not None:
        ev = summary
        log(INFO, "[round %d] evaluation (with round %d's training: %d, by evaluate message: %d) | "
            "accuracy mean %.4f min %.4f", server_round, server_round + 1, len(evaluate.carried),
            len(evaluate.messages), ev["accuracy_mean"], ev["accuracy_min"])
    return {"evaluate": summary, "clients": evaluation.per_client, "eval_failed": evaluation.failed}
