"""The server half every pflower method shares: a Flower Message-API ``Strategy`` with state per client.

:class:`PersonalizedStrategy` keeps
- ``global_arrays``: the shared model (or the shared part of it),
- ``personal``: per-client server-side arrays keyed by the *stable* client id (the
  partition id, never the per-run node id),
and sends every client its own payload: the global arrays overlaid with its personal ones
(:meth:`payload_for`). Which node serves which client is the :class:`ClientDirectory`'s
business (``strategies/addressing.py``); what counts as a valid reply is decided by the
pure functions of ``strategies/replies.py``. The round loop (``server/loop.py``) takes
return values: :meth:`aggregate_round` gives the round's train metrics and log,
:meth:`evaluation_of` the round's evaluation.

A method overrides :meth:`aggregate_updates` (the math, delegating to pure functions) and,
if it needs to, :meth:`payload_for`, :meth:`check_upload`, :meth:`round_extras`,
:meth:`summary_extras` and the checkpoint pair :meth:`state` / :meth:`load_state`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from common.methods import method_options, parameter_roles
from common.options import MethodOptions
from common.protocol import client_sort_key, to_record
from common.roles import FROZEN, LOCAL, UPLOADED, keys_with
from learning.params import NDArrays, RunningMean, num_bytes, weighted_mean
from strategies.addressing import ClientDirectory, place_clients
from strategies.replies import (
    ClientUpdate,
    Evaluation,
    RoundFailedError,
    RoundLog,
    TrainReplies,
    conform_scalars,
    mean_train_metrics,
    parse_evaluation_replies,
    short_reason,
    summarise_clients,
    validate_arrays,
)

if TYPE_CHECKING:
    from torch import nn

    from common.settings import RunKeys

__all__ = ["ClientUpdate", "Evaluation", "PersonalizedStrategy", "RoundFailedError", "RoundLog",
           "RunSettings", "TrainReplies", "TrainResult", "client_labels", "client_sort_key", "conform_scalars",
           "place_clients", "short_reason", "summarise_clients", "validate_arrays"]


@dataclass(frozen=True)
class RunSettings:
    """The run keys a strategy reads; their defaults are in ``conf/config.yaml`` only.

    Parameters
    ----------
    seed : the run seed (sampling, and methods' own random draws).
    rounds : the number of rounds of the run.
    fraction_train : the share of connected clients sampled each round.
    min_train_clients : fewer valid replies fail the round.
    wait_for_clients : seconds the first round waits for every expected client.
    round_timeout : seconds a round waits for replies.
    norm_bound : reject an update farther than this (L2) from its payload; 0 = off.
    run_dir : the run's results folder (for a method's plots); None = none written.
    stream_replies_mb : fold a round's train replies into the mean as they arrive once the
        round's uploads are expected to exceed this many MB (0 = always; None = never), for a
        method whose rule is the mean (:meth:`PersonalizedStrategy.streams_round`).
    """

    seed: int
    rounds: int
    fraction_train: float
    min_train_clients: int
    wait_for_clients: float
    round_timeout: float
    norm_bound: float
    run_dir: Path | None = None
    stream_replies_mb: float | None = None

    @classmethod
    def from_run_keys(cls, run: RunKeys, num_clients: int) -> RunSettings:
        """The strategy's share of the run keys (``min_train_clients`` capped at the clients)."""
        return cls(seed=run.seed, rounds=run.rounds, fraction_train=run.fraction_train,
                   min_train_clients=min(run.min_train_clients, num_clients),
                   wait_for_clients=run.wait_for_clients, round_timeout=run.round_timeout,
                   norm_bound=run.norm_bound, run_dir=run.run_dir,
                   stream_replies_mb=run.stream_replies_mb)


@dataclass
class TrainResult:
    """One round's training as the loop records it: the mean train metrics and the log."""

    metrics: dict[str, float]
    log: RoundLog


def client_labels(data: Any, prefix: str = "client ") -> dict[str, str]:
    """``<prefix><id> (<domain>)`` per participating client of ``data``, for plot legends."""
    clients = getattr(data, "clients", None) or {}
    return {c: f"{prefix}{c} ({d.domain})" if getattr(d, "domain", "") else f"{prefix}{c}"
            for c, d in clients.items()}


class PersonalizedStrategy(Strategy):
    """FedAvg with per-client state and the shared mechanics above.

    FedAvg (McMahan et al., 2017): w <- sum_k n_k w_k / sum_k n_k over the clients of the
    round, per uploaded tensor (unweighted mean with ``strategy.weighted=false``).

    Parameters
    ----------
    initial_arrays : the initial model's tensors (the global model, and the reference an
        upload must match in names, shapes and dtypes).
    client_ids : the run's participating clients.
    run : the run keys (:class:`RunSettings`).
    options : the method's options (``cfg.strategy``: ``name``, ``weighted`` and its own keys,
        validated into ``self.options``, its typed options class).
    model : the initial torch model, for methods that split parameters by role.
    data : the data summary (client sizes, domains, input shape), for methods that need it.
    """

    name: ClassVar[str] = "fedavg"
    # Clients that were sampled but delivered no valid update keep their server-side
    # ``personal`` arrays unchanged (restored after ``aggregate_updates``). A method whose
    # rule must touch absent clients' personal state sets this to False.
    keep_absent_personal: ClassVar[bool] = True
    # A round's evaluation may ride on the next round's training messages (``eval_in_train``):
    # exact when the evaluate message would carry what the next train message carries
    # (``payload_for`` after the aggregation) and the client evaluates before training on its
    # unchanged state; tests/test_method_contract.py checks the numbers are identical for
    # every method. A method for which that does not hold sets this to False.
    fuses_evaluation: ClassVar[bool] = True
    # The round's rule is this class' mean of the uploads (:meth:`mean_of`), so each reply can
    # be folded into it as it arrives and dropped (:meth:`streams_round`). A method whose rule
    # needs every update at once (MGDA, propagation, K-means) sets this to False.
    mean_rule: ClassVar[bool] = True

    def __init__(self, initial_arrays: NDArrays, client_ids: list[str], run: RunSettings,
                 options: Mapping[str, Any], model: nn.Module | None = None, data: Any = None) -> None:
        self.global_arrays: NDArrays = dict(initial_arrays)
        self.reference: NDArrays = {k: np.asarray(v) for k, v in initial_arrays.items()}
        self.client_ids = list(client_ids)
        self.personal: dict[str, NDArrays] = {}
        self.run = run
        self.options: MethodOptions = method_options(dict(options))
        self.weighted = self.options.weighted
        self.roles: dict[str, str] = parameter_roles(dict(options), model) if model is not None else {}
        self.model, self.data = model, data
        self.train_config: dict[str, Any] = {}    # keys a method adds to every message
        self.rng = random.Random(run.seed)
        self.directory = ClientDirectory(self.client_ids, run.min_train_clients, run.wait_for_clients,
                                         run.round_timeout)
        self.sent: dict[str, NDArrays] = {}       # client id -> the payload of its train message
        self.running: RunningMean | None = None   # this round's folded mean, when it streams
        self._asked_to_evaluate: list[str] = []

    # ------------------------------------------------------------------ method hooks
    def check_upload(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """Why an upload breaks the method's parameter roles (None if it does not): a client
        uploads exactly its shared and personal tensors, never a local or frozen one."""
        if not self.roles:
            return None
        leaked = sorted(k for k in arrays if self.roles.get(k) in (LOCAL, FROZEN))
        if leaked:
            return (f"uploaded {self.roles[leaked[0]]} tensors {leaked[:3]} (local-only and "
                    "frozen tensors never leave the client)")
        missing = sorted(set(keys_with(self.roles, *UPLOADED)) - set(arrays))
        if missing:
            return f"upload is missing {missing[:3]}; a {self.name} client uploads every shared and personal tensor"
        return None

    def payload_for(self, client_id: str | None) -> NDArrays:
        """Arrays to send to one client: global, overlaid with its personal arrays."""
        payload = dict(self.global_arrays)
        if client_id is not None and client_id in self.personal:
            payload.update(self.personal[client_id])
        return payload

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """FedAvg over the uploaded keys (a method overrides this with its own rule)."""
        mean = self.mean_of(updates)
        if mean is None:
            return
        self.global_arrays.update(mean)
        log(INFO, "aggregate: FedAvg of %d tensors over %d clients%s", len(mean), len(updates),
            " (folded as they arrived)" if self.running is not None else "")

    def mean_of(self, updates: list[ClientUpdate]) -> NDArrays | None:
        """sum_k w_k a_k / sum_k w_k over the uploads (w_k = n_k, or 1 with ``weighted=false``):
        the running mean the replies were folded into when the round streamed, otherwise the
        mean of the updates in client order; None when nothing was uploaded."""
        if self.running is not None and self.running.count:
            return self.running.result()
        uploaded = [u for u in updates if u.arrays]
        if not uploaded:
            return None
        keys = set(uploaded[0].arrays)
        return weighted_mean([{k: u.arrays[k] for k in keys} for u in uploaded], self.weights_of(uploaded))

    def weights_of(self, updates: list[ClientUpdate]) -> list[float]:
        """Each update's weight in the mean: its sample count, or 1 with ``weighted=false``."""
        return [float(u.num_examples) if self.weighted else 1.0 for u in updates]

    def streams_round(self, server_round: int) -> bool:
        """Whether this round folds each train reply into the mean as it arrives (server memory:
        one model, not one per client): when the rule is the mean and the round's uploads are
        expected (from what was sent) to exceed ``stream_replies_mb``. Not bit for bit the
        client-order mean (:class:`learning.params.RunningMean`), hence only past the limit."""
        limit = self.run.stream_replies_mb
        if not self.mean_rule or limit is None:
            return False
        return limit == 0 or sum(num_bytes(p) for p in self.sent.values()) / 1e6 > limit

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Method-specific values to record in this round's metrics line (JSON-able)."""
        return {}

    def summary_extras(self) -> dict[str, Any]:
        """Method-specific values for summary.json (JSON-able)."""
        return {}

    def summary(self) -> None:
        log(INFO, "\t├──> %s: fraction_train=%.2f, min_train_clients=%d, weighted=%s",
            self.name, self.run.fraction_train, self.run.min_train_clients, self.weighted)
        log(INFO, "\t└──> %d clients expected: %s", len(self.client_ids), ", ".join(self.client_ids))

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample ``fraction_train`` of the connected clients (at least ``min_train_clients``)
        and send each its payload."""
        clients = self.directory.connected(grid)
        k = max(self.run.min_train_clients, int(round(len(clients) * self.run.fraction_train)))
        # sample over the list ordered by client id, so the same seed picks the same clients
        # in every run (node ids differ between runs)
        sampled = self.rng.sample(clients, min(k, len(clients)))
        sampled.sort(key=clients.index)
        cfg = {**self.train_config, **dict(config.items()), "server-round": server_round}
        self.directory.begin(MessageType.TRAIN)
        self.sent = {cid: self.payload_for(cid) for cid in sampled}
        log(INFO, "configure_train: round %d, sampled %d of %d clients", server_round, len(sampled),
            len(clients))
        return [self.directory.message(cid, payload, cfg, MessageType.TRAIN) for cid, payload in self.sent.items()]

    def receive_train(self, server_round: int) -> TrainReplies:
        """The receiver of this round's train replies: each reply is validated as it arrives
        (``TrainReplies.take``) and, when the round streams (:meth:`streams_round`), folded into
        the mean at once and dropped."""
        self.running = RunningMean() if self.streams_round(server_round) else None
        fold = None
        if self.running is not None:
            running = self.running

            def fold(update: ClientUpdate) -> None:
                running.add(update.arrays, self.weights_of([update])[0])

            log(INFO, "configure_train: round %d's replies are folded into the mean as they arrive "
                "(%.0f MB expected, stream_replies_mb=%s)", server_round,
                sum(num_bytes(p) for p in self.sent.values()) / 1e6, self.run.stream_replies_mb)
        return TrainReplies(self.sent, self.directory.sender_of, self.reference, norm_bound=self.run.norm_bound,
                            check_upload=self.check_upload, no_reply_reason=self.directory.no_reply_reason,
                            fold=fold)

    def aggregate_round(self, server_round: int, replies: Iterable[Message] | TrainReplies) -> TrainResult:
        """Validate the round's replies (or take those a :meth:`receive_train` receiver took as
        they arrived), aggregate the valid updates (:meth:`aggregate_updates`) and return the
        round's train metrics and log; too few valid replies fail the round
        (:class:`RoundFailedError`, naming who is missing and why)."""
        if not isinstance(replies, TrainReplies):
            receiver = self.receive_train(server_round)
            for msg in replies:
                receiver.take(msg)
            replies = receiver
        updates, round_log = replies.finish()
        self.directory.learn(round_log.nodes)
        log(INFO, "aggregate_train: %d replies, %d failed, %d rejected", len(updates),
            len(round_log.failed), len(round_log.rejected))
        if len(updates) < self.run.min_train_clients:
            self.running = None
            problems = {**round_log.failed, **round_log.rejected}
            raise RoundFailedError(
                f"round {server_round}: only {len(updates)} valid replies, min_train_clients="
                f"{self.run.min_train_clients}; missing or rejected: "
                + (", ".join(f"{c} ({problems[c]})" for c in sorted(problems, key=client_sort_key))
                   or "none sampled")
            )
        absent = set(round_log.failed) | set(round_log.rejected)
        kept = ({c: {k: np.array(v, copy=True) for k, v in self.personal[c].items()}
                 for c in absent if c in self.personal} if self.keep_absent_personal else {})
        try:
            self.aggregate_updates(server_round, updates)
        finally:
            self.running = None
        if self.keep_absent_personal:
            for cid in absent:
                if cid in kept:
                    self.personal[cid] = kept[cid]
                else:
                    self.personal.pop(cid, None)
        return TrainResult(mean_train_metrics(updates), round_log)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's form of :meth:`aggregate_round`."""
        result = self.aggregate_round(server_round, replies)
        return to_record(self.global_arrays), MetricRecord(result.metrics)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Evaluate every connected client (not only the sampled ones)."""
        return self.evaluate_messages(server_round, config, self.directory.connected(grid))

    def evaluate_messages(self, server_round: int, config: ConfigRecord, clients: list[str],
                          already: Iterable[str] = ()) -> list[Message]:
        """Evaluate messages to ``clients``; ``already`` = clients whose evaluation of this
        round came with their training reply (they count as asked, see :meth:`evaluation_of`)."""
        cfg = {**self.train_config, **dict(config.items()), "server-round": server_round}
        self._asked_to_evaluate = [*already, *clients]
        self.directory.begin(MessageType.EVALUATE)
        return [self.directory.message(c, self.payload_for(c), cfg, MessageType.EVALUATE) for c in clients]

    def evaluation_of(self, server_round: int, replies: Iterable[Message]) -> Evaluation:
        """The round's evaluation from its replies (evaluate replies, or train replies that
        carry the evaluation); every client asked that did not answer is in ``failed``."""
        evaluation = parse_evaluation_replies(replies, self._asked_to_evaluate, self.directory.sender_of,
                                              self.directory.no_reply_reason)
        self.directory.learn(evaluation.nodes)
        return evaluation

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Flower's form of :meth:`evaluation_of`: the summary over clients."""
        summary = self.evaluation_of(server_round, replies).summary()
        return MetricRecord(summary) if summary is not None else None

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> tuple[dict[str, NDArrays], dict[str, Any]]:
        """Everything the strategy must restore on resume: named array groups, and JSON-able
        values. A method adds its own to both (calling this first)."""
        groups: dict[str, NDArrays] = {"global": dict(self.global_arrays)}
        for cid, arrays in self.personal.items():
            groups[f"personal/{cid}"] = dict(arrays)
        return groups, {"rng": _rng_to_json(self.rng.getstate()), "name": self.name}

    def load_state(self, groups: Mapping[str, NDArrays], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned."""
        self.global_arrays = dict(groups.get("global", self.global_arrays))
        self.personal = {k.split("/", 1)[1]: dict(v) for k, v in groups.items() if k.startswith("personal/")}
        if "rng" in meta:
            self.rng.setstate(_rng_from_json(meta["rng"]))


def _rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
