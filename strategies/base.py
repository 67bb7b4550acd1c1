"""The server half every pflower method shares: a Flower Message-API ``Strategy`` with state per client.

:class:`PersonalizedStrategy` keeps
- ``global_arrays``: the shared model (or the shared part of it),
- ``personal``: per-client server-side arrays keyed by the *stable* client id (the
  partition id, never the per-run node id),
and sends every client its own payload: the global arrays overlaid with its personal ones
(:meth:`payload_for`). Which node serves which client is the :class:`ClientDirectory`'s
business (``strategies/addressing.py``); what counts as a valid reply is decided by the
pure functions of ``strategies/replies.py``.

A round passes between the strategy's calls as explicit values, never as attributes set by
one call for the next: :meth:`begin_train` returns a :class:`TrainRound` (the messages, what
each client was sent, the receiver that validates replies as they arrive, the running mean
when the round streams), :meth:`aggregate_round` takes it back and returns the round's train
metrics and log; :meth:`begin_evaluate` returns an :class:`EvaluateRound` that
:meth:`evaluation_of` takes with the replies. pflower's loop (``server/loop.py``) calls
these. Flower's own ``Strategy`` interface (``configure_train`` / ``aggregate_train`` /
``configure_evaluate`` / ``aggregate_evaluate``, driven by ``Strategy.start``) carries no
round object between its calls, so those four wrappers keep the one round in flight.

A method overrides :meth:`aggregate_updates` (the math, delegating to pure functions; it
returns its notes on the round, which the loop records, and keeps on itself only what later
rounds need, saved by :meth:`state`) and, if it needs to, :meth:`payload_for`,
:meth:`check_upload`, :meth:`summary_extras` and the checkpoint pair :meth:`state` /
:meth:`load_state`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from common.methods import ResolvedMethod, roles_of
from common.options import MethodOptions
from common.privacy import budget_problem
from common.protocol import EVAL_METRICS_KEY, client_sort_key, to_record
from common.roles import FROZEN, LOCAL, SHARED, UPLOADED, keys_with
from common.secure_aggregation import MASKED_RECORD
from common.settings import PrivacySettings
from learning.params import NDArrays, RunningMean, is_float, num_bytes, weighted_mean
from strategies.addressing import ClientDirectory, Exchange
from strategies.privacy import CentralDP
from strategies.replies import (
    NO_NODE_AT_EVALUATION,
    ClientUpdate,
    Evaluation,
    RoundFailedError,
    RoundLog,
    TrainReplies,
    mean_train_metrics,
    parse_evaluation_replies,
)
from strategies.secure_aggregation import SecureAggregation, SecureOutcome

if TYPE_CHECKING:
    from torch import nn

    from common.settings import RunKeys

# what a method's server module needs (the replies' own names are in strategies/replies.py)
__all__ = ["ClientUpdate", "EvaluateRound", "Evaluation", "PersonalizedStrategy", "RoundNotes", "RunSettings",
           "TrainResult", "TrainRound", "client_labels"]

# a train reply's metric: the client's epsilon of record-level DP-SGD so far (client/handlers.py)
DPSGD_EPSILON = "dpsgd_epsilon"

# what a method's aggregation returns for the round's metrics line: {method key: JSON-able}, or None
RoundNotes = dict[str, Any] | None


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
    privacy : the ``privacy`` group (differential privacy of the shared part); None = none.
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
    privacy: PrivacySettings | None = None

    @classmethod
    def from_run_keys(cls, run: RunKeys, num_clients: int,
                      privacy: PrivacySettings | None = None) -> RunSettings:
        """The strategy's share of the run keys (``min_train_clients`` capped at the clients)."""
        return cls(seed=run.seed, rounds=run.rounds, fraction_train=run.fraction_train,
                   min_train_clients=min(run.min_train_clients, num_clients),
                   wait_for_clients=run.wait_for_clients, round_timeout=run.round_timeout,
                   norm_bound=run.norm_bound, run_dir=run.run_dir,
                   stream_replies_mb=run.stream_replies_mb, privacy=privacy)


@dataclass
class TrainRound:
    """One round's training, from the messages sent to the update it gives.

    Parameters
    ----------
    server_round : the round.
    messages : the train messages, one per sampled client.
    sent : client id -> the payload of its train message (what an update is checked against).
    replies : the receiver that validates each reply as it arrives (:meth:`TrainReplies.take`).
    running : the mean the valid replies are folded into as they arrive, when the round
        streams (:meth:`PersonalizedStrategy.streams_round`); None otherwise.
    exchange : the messages' addressing (which client each reply answers for); None for a
        round handed its updates.
    secure : with secure aggregation, the unmasked mean of the round's masked uploads (the
        updates then hold no shared tensor); None otherwise.
    """

    server_round: int
    messages: list[Message]
    sent: dict[str, NDArrays]
    replies: TrainReplies
    running: RunningMean | None = None
    exchange: Exchange | None = None
    secure: SecureOutcome | None = None

    @classmethod
    def handed(cls, server_round: int, sent: Mapping[str, NDArrays] | None = None) -> TrainRound:
        """Round ``server_round`` with no messages, for updates handed to
        :meth:`PersonalizedStrategy.aggregate_updates` directly (a check against an author's
        code, a test); ``sent``: what each client was sent (none: the global arrays)."""
        sent = dict(sent or {})
        return cls(server_round, [], sent, TrainReplies(sent, lambda msg: "", {}))

    def take_all(self, replies: Iterable[Message]) -> None:
        """Take replies that arrived together (Flower's ``aggregate_train``, a test's grid)."""
        for msg in replies:
            self.replies.take(msg)


@dataclass
class EvaluateRound:
    """One round's evaluation as asked.

    Parameters
    ----------
    server_round : the round evaluated.
    messages : the evaluate messages (to the clients whose evaluation did not come with
        their train reply).
    asked : every client whose evaluation the round expects: those of ``carried``, then
        those messaged; one asked that does not answer is marked failed.
    carried : train replies that carry this round's evaluation (``eval_in_train``).
    exchange : the messages' addressing, the carried replies' train messages included.
    unreachable : the run's clients with no connected node, so not asked: each is marked
        failed with :data:`~strategies.replies.NO_NODE_AT_EVALUATION`, so that a round's
        record says why a client is missing from its evaluation.
    """

    server_round: int
    messages: list[Message]
    asked: list[str]
    carried: list[Message]
    exchange: Exchange
    unreachable: list[str] = field(default_factory=list)


@dataclass
class TrainResult:
    """One round's training as the loop records it: the mean train metrics, the log, and the
    method's notes on the round (JSON-able; ``{"fedora": {...}}``), which its aggregation
    returns rather than keeping them on the strategy."""

    metrics: dict[str, float]
    log: RoundLog
    notes: dict[str, Any] = field(default_factory=dict)


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
    method : the configured method, resolved at composition (``Settings.method``): its row
        (the role rule) and its typed options (``self.options``).
    model : the initial torch model, for methods that split parameters by role.
    data : the data summary (client sizes, domains, input shape), for methods that need it.
    """

    @property
    def name(self) -> str:
        """The configured method's name (``strategy.name``): several methods share a class."""
        return self.options.name

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
    # Array records a train reply may carry besides its upload (FEDORA's basis); a reply with
    # any other, or without its upload record, is rejected.
    extra_records: ClassVar[tuple[str, ...]] = ()
    # The attributes a round may change: what later rounds need, each saved by :meth:`state`
    # and restored by :meth:`load_state`, except ``directory`` (which node serves which
    # client, learned again after a restart). What a round computes for its record is
    # returned by :meth:`aggregate_updates`, never kept here; tests/test_method_contract.py
    # checks both for every method.
    carried_state: ClassVar[tuple[str, ...]] = ("global_arrays", "personal", "rng", "directory", "privacy")

    def __init__(self, initial_arrays: NDArrays, client_ids: list[str], run: RunSettings,
                 method: ResolvedMethod, model: nn.Module | None = None, data: Any = None) -> None:
        self.global_arrays: NDArrays = dict(initial_arrays)
        self.reference: NDArrays = {k: np.asarray(v) for k, v in initial_arrays.items()}
        self.client_ids = list(client_ids)
        self.personal: dict[str, NDArrays] = {}
        self.run = run
        self.method = method
        self.options: MethodOptions = method.options
        self.weighted = self.options.weighted
        self.roles: dict[str, str] = roles_of(method.row, model) if model is not None else {}
        self.model, self.data = model, data
        self.train_config: dict[str, Any] = {}    # keys a method adds to every message
        self.rng = random.Random(run.seed)
        self.directory = ClientDirectory(self.client_ids, run.min_train_clients, run.wait_for_clients,
                                         run.round_timeout)
        # the one round in flight between Flower's configure_* and aggregate_* calls (only
        # those four wrappers use them; pflower's loop passes the round objects itself)
        self._flower_train: TrainRound | None = None
        self._flower_evaluate: EvaluateRound | None = None
        self.privacy = self._central_dp(run.privacy)
        self.secure = self._secure_aggregation(run.privacy)

    def _central_dp(self, settings: PrivacySettings | None) -> CentralDP | None:
        """DP-FedAvg of the shared part (``privacy.dp=central``, or ``distributed``: the clients
        add the noise under secure aggregation): the tensors of the shared role (every uploaded
        one when no model gives the roles). A method whose rule needs each client's own upload
        refuses it (its YAML row's ``not_private``), and so do rounds that would spend more than
        ``privacy.max_epsilon`` with this run's clients."""
        if settings is None or not settings.enabled:
            return None
        why = self.method.not_private()
        if why:
            raise ValueError(f"privacy.dp={settings.dp} does not apply to {self.name}: {why}")
        if settings.distributed and not settings.secure:
            raise ValueError("privacy.dp=distributed needs privacy.secure_aggregation=secagg+ (the clients' noise "
                             "is only private in a sum the server cannot see into)")
        population = len(self.client_ids)
        if (problem := budget_problem(settings, population, self.run.rounds)) is not None:
            raise ValueError(problem)
        shared = keys_with(self.roles, SHARED) if self.roles else list(self.reference)
        return CentralDP(settings, population, shared)

    def _secure_aggregation(self, settings: PrivacySettings | None) -> SecureAggregation | None:
        """SecAgg+ of the shared part (``privacy.secure_aggregation=secagg+``): the float tensors
        of the shared role (every uploaded one when no model gives the roles) travel masked; a
        method whose rule needs each client's own upload refuses it. Integer tensors (BatchNorm
        counters) are not averaged and keep the global value."""
        if settings is None or not settings.secure:
            return None
        why = self.method.not_private()
        if why:
            raise ValueError(f"privacy.secure_aggregation=secagg+ does not apply to {self.name}: {why}")
        shared = keys_with(self.roles, SHARED) if self.roles else list(self.reference)
        masked = [k for k in shared if is_float(self.reference[k])]
        sizes = [getattr(c, "num_train", 0) for c in (getattr(self.data, "clients", None) or {}).values()]
        weighted = self.weighted and self.privacy is None and bool(sizes) and min(sizes) > 0
        if self.weighted and self.privacy is None and not weighted:
            log(INFO, "secure aggregation: the clients' sizes are not known to the server; the mean is unweighted")
        return SecureAggregation(settings, masked, self.reference, self.run.seed, float(max(sizes)) if weighted else 0.0)

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
        masked = set(self.secure.masked_keys) if self.secure is not None else set()
        missing = sorted(set(keys_with(self.roles, *UPLOADED)) - set(arrays) - masked)
        if missing:
            return f"upload is missing {missing[:3]}; a {self.name} client uploads every shared and personal tensor"
        return None

    def payload_for(self, client_id: str | None) -> NDArrays:
        """Arrays to send to one client: global, overlaid with its personal arrays."""
        payload = dict(self.global_arrays)
        if client_id is not None and client_id in self.personal:
            payload.update(self.personal[client_id])
        return payload

    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> RoundNotes:
        """FedAvg over the uploaded keys (a method overrides this with its own rule).

        Parameters
        ----------
        train : the round as sent (``server_round``, ``sent``, the streamed mean ``running``).
        updates : the valid updates, ordered by client id.

        Returns
        -------
        The method's notes on this round for its metrics line (JSON-able, under the method's
        key), or None: what a round computes is returned, never kept on the strategy.
        """
        mean = self.mean_of(updates, train.running)
        if mean is None:
            return None
        self.global_arrays.update(mean)
        log(INFO, "aggregate: FedAvg of %d tensors over %d clients%s", len(mean), len(updates),
            " (folded as they arrived)" if train.running is not None else "")
        return None

    def mean_of(self, updates: list[ClientUpdate], running: RunningMean | None = None) -> NDArrays | None:
        """sum_k w_k a_k / sum_k w_k over the uploads (w_k = n_k, or 1 with ``weighted=false``):
        ``running``, the mean the replies were folded into when the round streamed, otherwise
        the mean of the updates in client order; None when nothing was uploaded."""
        if running is not None and running.count:
            return running.result()
        uploaded = [u for u in updates if u.arrays]
        if not uploaded:
            return None
        keys = set(uploaded[0].arrays)
        return weighted_mean([{k: u.arrays[k] for k in keys} for u in uploaded], self.weights_of(uploaded))

    def weights_of(self, updates: list[ClientUpdate]) -> list[float]:
        """Each update's weight in the mean: its sample count, or 1 with ``weighted=false`` or
        with differential privacy (DP-FedAvg's mean is unweighted: a client's weight would
        scale its sensitivity)."""
        return [float(u.num_examples) if self.weighted and self.privacy is None else 1.0 for u in updates]

    def streams_round(self, server_round: int, sent: Mapping[str, NDArrays]) -> bool:
        """Whether this round folds each train reply into the mean as it arrives (server memory:
        one model, not one per client): when the rule is the mean and the round's uploads are
        expected (from what was ``sent``) to exceed ``stream_replies_mb``. Not bit for bit the
        client-order mean (:class:`learning.params.RunningMean`), hence only past the limit."""
        limit = self.run.stream_replies_mb
        if not self.mean_rule or limit is None or self.privacy is not None or self.secure is not None:
            # DP clips the replies first; secure aggregation sums masked vectors
            return False
        return limit == 0 or sum(num_bytes(p) for p in sent.values()) / 1e6 > limit

    def summary_extras(self) -> dict[str, Any]:
        """Method-specific values for summary.json (JSON-able)."""
        return {}

    def summary(self) -> None:
        log(INFO, "\t├──> %s: fraction_train=%.2f, min_train_clients=%d, weighted=%s",
            self.name, self.run.fraction_train, self.run.min_train_clients, self.weighted)
        log(INFO, "\t└──> %d clients expected: %s", len(self.client_ids), ", ".join(self.client_ids))
        if self.privacy is not None:
            p = self.privacy.settings
            log(INFO, "\t└──> central DP of %d shared tensors: clip_norm=%g, noise_multiplier=%g, unweighted mean; "
                "epsilon reported at delta=%g%s", len(self.privacy.shared_keys), p.clip_norm, p.noise_multiplier,
                p.delta, f", budget {p.max_epsilon:g}" if p.max_epsilon is not None else "")

    # ------------------------------------------------------------------ train
    def begin_train(self, server_round: int, config: Mapping[str, Any], grid: Grid) -> TrainRound:
        """Sample ``fraction_train`` of the connected clients (at least ``min_train_clients``),
        build each its train message, and the receiver that validates each reply as it arrives
        and, when the round streams (:meth:`streams_round`), folds it into the mean at once."""
        clients = self.directory.connected(grid)
        k = max(self.run.min_train_clients, int(round(len(clients) * self.run.fraction_train)))
        # sample over the list ordered by client id, so the same seed picks the same clients
        # in every run (node ids differ between runs)
        sampled = self.rng.sample(clients, min(k, len(clients)))
        sampled.sort(key=clients.index)
        cfg = {**self.train_config, **dict(config), "server-round": server_round}
        exchange = self.directory.exchange(MessageType.TRAIN)
        sent = {cid: self.payload_for(cid) for cid in sampled}
        log(INFO, "configure_train: round %d, sampled %d of %d clients", server_round, len(sampled),
            len(clients))
        messages = [exchange.message(cid, payload, cfg) for cid, payload in sent.items()]
        running = RunningMean() if self.streams_round(server_round, sent) else None
        fold = None
        if running is not None:
            def fold(update: ClientUpdate) -> None:
                running.add(update.arrays, self.weights_of([update])[0])

            log(INFO, "configure_train: round %d's replies are folded into the mean as they arrive "
                "(%.0f MB expected, stream_replies_mb=%s)", server_round,
                sum(num_bytes(p) for p in sent.values()) / 1e6, self.run.stream_replies_mb)
        receiver = TrainReplies(sent, exchange.sender_of, self.reference, norm_bound=self.run.norm_bound,
                                check_upload=self.check_upload, no_reply_reason=exchange.no_reply_reason,
                                fold=fold,
                                extra_records=(*self.extra_records, *((MASKED_RECORD,) if self.secure else ())))
        return TrainRound(server_round, messages, sent, receiver, running, exchange)

    def aggregate_round(self, train: TrainRound) -> TrainResult:
        """Aggregate the valid updates of ``train`` (its receiver took the replies as they
        arrived; :meth:`aggregate_updates`) and return the round's train metrics and log; too
        few valid replies fail the round (:class:`RoundFailedError`, naming who is missing and
        why)."""
        server_round = train.server_round
        updates, round_log = train.replies.finish()
        self.directory.learn(round_log.nodes)
        log(INFO, "aggregate_train: %d replies, %d failed, %d rejected", len(updates),
            len(round_log.failed), len(round_log.rejected))
        if len(updates) < self.run.min_train_clients:
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
        notes = self.aggregate_private(train, updates)
        spent = {u.client_id: u.metrics[DPSGD_EPSILON] for u in updates if DPSGD_EPSILON in u.metrics}
        if spent:     # record-level DP-SGD: each client's epsilon (its own accounting)
            notes["record_dp"] = {"epsilon_max": max(spent.values()), "epsilon": spent,
                                  "delta": self.run.privacy.delta if self.run.privacy else None}
        if self.keep_absent_personal:
            for cid in absent:
                if cid in kept:
                    self.personal[cid] = kept[cid]
                else:
                    self.personal.pop(cid, None)
        return TrainResult(mean_train_metrics(updates), round_log, notes)

    def aggregate_private(self, train: TrainRound, updates: list[ClientUpdate]) -> dict[str, Any]:
        """:meth:`aggregate_updates`, and with ``privacy.dp=central`` DP-FedAvg around it: each
        upload's shared update clipped before the method's (unweighted) mean, Gaussian noise
        added to the new shared tensors after it, and the release accounted; the round's notes
        (with a ``privacy`` entry then). Only shared tensors may change: a method that changed
        another global tensor would release it without noise, and the round fails instead."""
        if train.secure is not None:
            return self.aggregate_secure(train, updates)
        if self.privacy is None:
            return self.aggregate_updates(train, updates) or {}
        norms = self._clip_in_place(train, updates)
        if norms:
            self.privacy.check_budget()     # before anything of this round can leave the server
        before = dict(self.global_arrays)
        notes = self.aggregate_updates(train, updates) or {}
        changed = sorted(k for k, v in self.global_arrays.items() if before.get(k) is not v)
        unshared = [k for k in changed if k not in set(self.privacy.shared_keys)]
        if unshared:
            raise RoundFailedError(f"round {train.server_round}: {self.name} changed global tensors that are not "
                                   f"shared ({unshared[:3]}); central DP noises only the shared role")
        if norms:      # something was averaged, so something is released
            self.global_arrays = self.privacy.add_noise(self.global_arrays, len(norms), train.server_round)
            self.privacy.account()
            notes = {**notes, "privacy": self.privacy.notes(norms, len(norms))}
        return notes

    def aggregate_secure(self, train: TrainRound, updates: list[ClientUpdate]) -> dict[str, Any]:
        """A round under secure aggregation: the masked tensors become the global value plus the
        unmasked mean update (what each client was sent of them is the global value: they are
        shared), then the method's own rule runs on what the updates carry in the clear (its
        notes, acknowledgements; no shared tensor), and with DP the clients clipped their
        updates before masking; with ``privacy.dp=central`` the server noises the mean, with
        ``distributed`` the clients each added their share of the noise, and a round some of
        them dropped from carries less: it is accounted at the noise it has,
        ``z sqrt(m_active / m_sampled)``."""
        assert train.secure is not None and self.secure is not None
        multiplier = None
        if self.privacy is not None:
            multiplier = self.privacy.settings.noise_multiplier
            if self.privacy.settings.distributed:
                multiplier *= math.sqrt(train.secure.notes["clients"] / train.secure.notes["sampled"])
            self.privacy.check_budget(multiplier)   # before the round's model can leave the server
        for key, delta in train.secure.mean_update.items():
            base = self.global_arrays[key]
            self.global_arrays[key] = (np.asarray(base, dtype=np.float64) + delta).astype(np.asarray(base).dtype)
        masked = set(self.secure.masked_keys)
        before = dict(self.global_arrays)
        notes = self.aggregate_updates(train, updates) or {}
        changed = sorted(k for k, v in self.global_arrays.items() if before.get(k) is not v and k in masked)
        if changed:
            raise RoundFailedError(f"round {train.server_round}: {self.name} changed masked tensors {changed[:3]} from "
                                   "the clients' clear uploads; under secure aggregation they are the unmasked mean")
        notes = {**notes, "secure_aggregation": train.secure.notes}
        if self.privacy is not None:
            count = int(train.secure.notes["clients"])
            if self.privacy.settings.central:
                self.global_arrays = self.privacy.add_noise(self.global_arrays, count, train.server_round)
            self.privacy.account(multiplier)
            notes["privacy"] = self.privacy.notes(None, count, multiplier)
        log(INFO, "aggregate: %s, the secure mean of %d tensors over %d clients", self.name, len(masked),
            train.secure.notes["clients"])
        return notes

    def _clip_in_place(self, train: TrainRound, updates: list[ClientUpdate]) -> list[float]:
        """Each upload's shared update (from what it was sent) clipped to
        ``privacy.clip_norm`` in place (its arrays replaced one upload at a time, so the round
        holds one extra model at most), and the norms before clipping (of the uploads only)."""
        assert self.privacy is not None
        norms = []
        for u in updates:
            if u.arrays:
                reference = {**self.global_arrays, **train.sent.get(u.client_id, {})}   # what it was sent
                arrays, norm = self.privacy.clip(u.arrays, reference)
                u.arrays.update(arrays)
                norms.append(norm)
        return norms

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Flower's form of :meth:`begin_train` (the round is kept for :meth:`aggregate_train`).
        Secure aggregation's exchanges run in pflower's loop only (``server/loop.py``): here the
        clients would upload in the clear, so it is refused."""
        if self.secure is not None:
            raise RuntimeError("privacy.secure_aggregation runs in pflower's round loop (server/loop.py), not in "
                               "Flower's Strategy.start: run it with pflower run or flwr run")
        self._flower_train = self.begin_train(server_round, dict(config.items()), grid)
        return self._flower_train.messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's form of :meth:`aggregate_round`, for the round :meth:`configure_train` began."""
        train, self._flower_train = self._flower_train, None
        if train is None or train.server_round != server_round:
            raise RuntimeError(f"aggregate_train of round {server_round} without its configure_train")
        train.take_all(replies)
        result = self.aggregate_round(train)
        return to_record(self.global_arrays), MetricRecord(result.metrics)

    # ------------------------------------------------------------------ evaluate
    def begin_evaluate(self, server_round: int, config: Mapping[str, Any], grid: Grid,
                       carried: Iterable[Message] = (), train: TrainRound | None = None) -> EvaluateRound:
        """Evaluate every connected client (not only the sampled ones): the evaluations that
        came with train replies (``carried``, ``eval_in_train``: replies to ``train``'s
        messages) count as asked and answered, and every other connected client is sent an
        evaluate message."""
        carried = [m for m in carried if not m.has_error() and EVAL_METRICS_KEY in m.content.metric_records]
        train_exchange = train.exchange if train is not None else None
        if carried and train_exchange is None:
            raise ValueError("begin_evaluate: replies carried without the train round they answer")
        done = [train_exchange.sender_of(m) for m in carried] if train_exchange is not None else []
        answered = set(done)
        others = [c for c in self.directory.connected(grid) if c not in answered]
        cfg = {**self.train_config, **dict(config), "server-round": server_round}
        exchange = self.directory.exchange(MessageType.EVALUATE, earlier=train_exchange)
        messages = [exchange.message(c, self.payload_for(c), cfg) for c in others]
        unreachable = [c for c in self.client_ids if c not in answered and c not in exchange.node_of]
        return EvaluateRound(server_round, messages, [*done, *others], carried, exchange, unreachable)

    def evaluation_of(self, evaluate: EvaluateRound, replies: Iterable[Message]) -> Evaluation:
        """The round's evaluation from the replies to ``evaluate``'s messages and the train
        replies it carried; every client asked that did not answer is in ``failed``."""
        evaluation = parse_evaluation_replies([*evaluate.carried, *replies], evaluate.asked,
                                              evaluate.exchange.sender_of, evaluate.exchange.no_reply_reason)
        for client in evaluate.unreachable:
            evaluation.failed.setdefault(client, NO_NODE_AT_EVALUATION)
        self.directory.learn(evaluation.nodes)
        return evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Flower's form of :meth:`begin_evaluate` (the round is kept for :meth:`aggregate_evaluate`)."""
        self._flower_evaluate = self.begin_evaluate(server_round, dict(config.items()), grid)
        return self._flower_evaluate.messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Flower's form of :meth:`evaluation_of`: the summary over clients."""
        evaluate, self._flower_evaluate = self._flower_evaluate, None
        if evaluate is None or evaluate.server_round != server_round:
            raise RuntimeError(f"aggregate_evaluate of round {server_round} without its configure_evaluate")
        summary = self.evaluation_of(evaluate, replies).summary()
        return MetricRecord(summary) if summary is not None else None

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> tuple[dict[str, NDArrays], dict[str, Any]]:
        """Everything the strategy must restore on resume: named array groups, and JSON-able
        values. A method adds its own to both (calling this first)."""
        groups: dict[str, NDArrays] = {"global": dict(self.global_arrays)}
        for cid, arrays in self.personal.items():
            groups[f"personal/{cid}"] = dict(arrays)
        meta: dict[str, Any] = {"rng": _rng_to_json(self.rng.getstate()), "name": self.name}
        if self.privacy is not None:
            meta["privacy"] = self.privacy.state()
        return groups, meta

    def load_state(self, groups: Mapping[str, NDArrays], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned."""
        self.global_arrays = dict(groups.get("global", self.global_arrays))
        self.personal = {k.split("/", 1)[1]: dict(v) for k, v in groups.items() if k.startswith("personal/")}
        if "rng" in meta:
            self.rng.setstate(_rng_from_json(meta["rng"]))
        if self.privacy is None and "privacy" in meta:
            raise ValueError("the checkpoint was taken with privacy.dp=central; resume it with the privacy "
                             "settings it ran with (its config.yaml), or its later models are not private")
        if self.privacy is not None:
            if "privacy" not in meta:
                raise ValueError("the checkpoint was taken without privacy.dp=central; resume it with the "
                                 "privacy settings it ran with (its config.yaml)")
            self.privacy.load_state(meta["privacy"])


def _rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
