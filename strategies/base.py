"""Shared server mechanics for every pflower strategy (written once).

:class:`PersonalizedStrategy` is a Flower Message-API ``Strategy`` that keeps
- ``global_arrays``: the shared model (or the shared part of it),
- ``personal``: per-client server-side arrays keyed by the *stable* client id (the
  partition id the client reports in its reply metrics, never the per-run node id),
and sends every client its own fresh RecordDict: the global arrays overlaid with its
personal ones. It validates replies (names, shapes, dtypes, finite values, optional norm
bound), records failures, refuses to aggregate when fewer than ``min_train_clients``
replied (naming who is missing), evaluates *all* clients, and can be checkpointed.

A method overrides :meth:`aggregate_updates` (the math, delegating to pure functions) and,
if it needs to, :meth:`payload_for`. The default :meth:`aggregate_updates` is FedAvg over
whatever keys the clients uploaded.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

try:  # the deployment grid; where a Flower release moves it, the grid's own polling is used
    from flwr.superlink.grid.http_grid import HttpGrid as _HttpGrid
except ImportError:  # pragma: no cover
    _HttpGrid = None

from common.methods import method_options, parameter_roles
from common.options import MethodOptions
from common.protocol import (
    ARRAYS_KEY,
    CONFIG_KEY,
    EVAL_METRICS_KEY,
    METRICS_KEY,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    NUM_VAL_EXAMPLES,
    TARGET_CLIENT,
    decode_client_id,
    from_record,
    to_record,
)
from common.roles import FROZEN, LOCAL, UPLOADED, keys_with
from learning.params import NDArrays, num_bytes, weighted_mean


def _is_deployment(grid: Grid) -> bool:
    """A deployment's grid (its nodes are separate machines, one client each); otherwise the
    simulation's grid (or a test's), whose nodes may serve several clients."""
    return _HttpGrid is not None and isinstance(grid, _HttpGrid)


def place_clients(client_ids: Iterable[str], own: Mapping[str, int],
                  federation_size: int | None = None) -> dict[str, int]:
    """Which node serves each client: the node identified as that client, else (in a
    simulation of ``federation_size`` SuperNodes, fewer than the clients) the node of
    partition ``c mod federation_size``, the rule the ClientApp checks
    (``client/identity.py``). Clients with neither are left out (missing)."""
    placed: dict[str, int] = {}
    for cid in client_ids:
        if cid in own:
            placed[cid] = own[cid]
        elif federation_size and cid.isdigit() and str(int(cid) % federation_size) in own:
            placed[cid] = own[str(int(cid) % federation_size)]
    return placed


class RoundFailedError(RuntimeError):
    """Too few clients replied in a round; the message names the missing ones."""


# After the first round, how long to wait for a client that has just disappeared (e.g. a
# SuperNode restarting) before going on without it; a client already missing in the
# previous round is not waited for again, so one dead SuperNode slows one round, not all.
REJOIN_WAIT_S = 15.0
REPLY_POLL_S = 0.1   # how often replies are pulled from a deployment's SuperLink


def send_and_receive(grid: Grid, messages: Iterable[Message], timeout: float) -> list[Message]:
    """``grid.send_and_receive``, but pulling replies every ``REPLY_POLL_S`` seconds.

    Flower 1.39's ``HttpGrid`` (the ServerApp's grid in a deployment) sleeps 3 s between
    two pulls, which rounds every exchange up to a multiple of 3 s: a round whose clients
    answer in 7 s waited 9 s for train and again for evaluate. ``InMemoryGrid`` (the
    simulation) already pulls every 0.1 s, and test grids answer at once; they keep their
    own method. Same contract: replies that arrived before ``timeout``, in arrival order."""
    if _HttpGrid is None or not isinstance(grid, _HttpGrid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    waiting = set(grid.push_messages(messages))
    replies: list[Message] = []
    end = time.monotonic() + timeout
    while waiting:
        arrived = list(grid.pull_messages(waiting))
        replies.extend(arrived)
        waiting.difference_update(m.metadata.reply_to_message_id for m in arrived)
        if not waiting or time.monotonic() >= end:
            break
        time.sleep(REPLY_POLL_S)
    return replies


@dataclass
class ClientUpdate:
    """One client's validated reply."""

    client_id: str
    node_id: int
    arrays: NDArrays
    num_examples: int
    metrics: dict[str, float]
    extra: dict[str, NDArrays] = field(default_factory=dict)


@dataclass
class RoundLog:
    """What happened in one round's communication (goes into metrics.jsonl)."""

    sampled: list[str] = field(default_factory=list)
    replied: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)   # client or node -> reason
    rejected: dict[str, str] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)


def short_reason(reason: str, limit: int = 300) -> str:
    """A client error for the metrics: no ANSI colours, no traceback, the message only."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(reason))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    msg = next((ln.split("Message:", 1)[1].strip() for ln in reversed(lines) if "Message:" in ln), "")
    if not msg:
        msg = lines[-1] if lines else text
    return msg.strip(" '>\"")[:limit]


def client_sort_key(cid: str) -> tuple[int, int, str]:
    """Order client ids as numbers ("2" < "10"), held-out "new-k" after, other labels last."""
    if cid.isdigit():
        return (0, int(cid), "")
    if cid.startswith("new-") and cid[4:].isdigit():
        return (1, int(cid[4:]), "")
    return (2, 0, cid)


def conform_scalars(arrays: NDArrays, reference: Mapping[str, np.ndarray]) -> NDArrays:
    """Flower ships 0-d arrays (e.g. BN's num_batches_tracked) as shape (1,): restore them."""
    return {k: (a.reshape(()) if k in reference and reference[k].ndim == 0 and a.shape == (1,) else a)
            for k, a in arrays.items()}


def validate_arrays(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                    norm_bound: float = 0.0, base: Mapping[str, np.ndarray] | None = None) -> str | None:
    """Return why an uploaded set of arrays is unacceptable, or None if it is fine.

    Checks: every name is a known model tensor, shapes and dtypes match, values are finite,
    and (if ``norm_bound`` > 0) the update's L2 norm against ``base`` is within the bound.
    """
    unknown = [k for k in arrays if k not in reference]
    if unknown:
        return f"unknown array names {unknown[:3]}"
    for k, a in arrays.items():
        ref = reference[k]
        if a.shape != ref.shape:
            return f"array {k!r} has shape {a.shape}, expected {ref.shape}"
        if a.dtype != ref.dtype:
            return f"array {k!r} has dtype {a.dtype}, expected {ref.dtype}"
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            return f"array {k!r} contains NaN or Inf"
    if norm_bound > 0 and base is not None:
        sq = sum(float(np.sum((a.astype(np.float64) - base[k]) ** 2)) for k, a in arrays.items()
                 if k in base and np.issubdtype(a.dtype, np.floating))
        if np.sqrt(sq) > norm_bound:
            return f"update norm {np.sqrt(sq):.3g} exceeds the bound {norm_bound:.3g}"
    return None


class PersonalizedStrategy(Strategy):
    """FedAvg with per-client state and the shared mechanics above.

    FedAvg (McMahan et al., 2017): w <- sum_k n_k w_k / sum_k n_k over the clients of the
    round, per uploaded tensor (unweighted mean with ``weighted=False``).
    """

    name: ClassVar[str] = "fedavg"

    def __init__(
        self,
        initial_arrays: NDArrays,
        client_ids: list[str],
        fraction_train: float = 1.0,
        min_train_clients: int = 2,
        weighted: bool = True,
        seed: int = 0,
        wait_for_clients: float = 120.0,
        norm_bound: float = 0.0,
        train_config: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        model: Any = None,
        cfg: Any = None,
        data: Any = None,
    ) -> None:
        """``model``, ``cfg`` and ``data`` (the initial torch model, the resolved config and
        the FederatedData) are given to methods that need them (e.g. to split parameter
        classes or know the held-out clients); the base class only keeps references."""
        self.global_arrays: NDArrays = dict(initial_arrays)
        self.reference: NDArrays = {k: np.asarray(v) for k, v in initial_arrays.items()}
        self.client_ids = list(client_ids)
        self.personal: dict[str, NDArrays] = {}
        self.node_to_client: dict[int, str] = {}
        self.fraction_train = float(fraction_train)
        self.min_train_clients = int(min_train_clients)
        self.weighted = bool(weighted)
        self.wait_for_clients = float(wait_for_clients)
        self.norm_bound = float(norm_bound)
        self.train_config = dict(train_config or {})
        self.options = dict(options or {})
        self.rng = random.Random(seed)
        self.round_log = RoundLog()
        self.last_eval: dict[str, dict[str, float]] = {}
        self._sent: dict[str, NDArrays] = {}       # client id -> the payload of its train message
        self._sent_eval: list[str] = []
        self.node_of: dict[str, int] = {}          # client id -> the node serving it (this round)
        self._addressed: list[tuple[Message, str]] = []   # messages out, with their client
        self._by_message_id: dict[str, str] = {}           # the same by message id, once pushed
        self._placement_logged = False
        self.eval_failed: dict[str, str] = {}
        self.model, self.cfg, self.data = model, cfg, data
        # the method's validated options and parameter roles (common/), when configured
        self.opts: MethodOptions | None = method_options(self.options) if "name" in self.options else None
        self.roles: dict[str, str] = (parameter_roles(self.options, model)
                                      if model is not None and "name" in self.options else {})
        # seconds to wait for identification (QUERY) replies; bounded like a round
        self.query_timeout = float(cfg.get("round_timeout", 600.0)) if cfg is not None else 600.0
        self.federation_size: int | None = None   # num-partitions reported by simulated nodes
        self._missing: set[str] | None = None      # expected clients without a node, last call
        self._idle_logged: set[str] = set()
        self._sent_at = 0.0

    def client_labels(self, prefix: str = "client ") -> dict[str, str]:
        """``<prefix><id> (<domain>)`` per participating client, for plot legends."""
        clients = getattr(self.data, "clients", None) or {}
        return {c: f"{prefix}{c} ({d.domain})" if getattr(d, "domain", "") else f"{prefix}{c}"
                for c, d in clients.items()}

    def run_dir(self) -> Path | None:
        """This run's results folder (for method files such as plots), when configured."""
        if self.cfg is None:
            return None
        return Path(str(self.cfg.results_root)) / str(self.cfg.run_name)

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
        uploaded = [u for u in updates if u.arrays]
        if not uploaded:
            return
        keys = set(uploaded[0].arrays)
        weights = [float(u.num_examples) if self.weighted else 1.0 for u in uploaded]
        mean = weighted_mean([{k: u.arrays[k] for k in keys} for u in uploaded], weights)
        self.global_arrays.update(mean)
        log(INFO, "aggregate: FedAvg of %d tensors over %d clients", len(keys), len(uploaded))

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Method-specific values to record in this round's metrics line (JSON-able)."""
        return {}

    def summary_extras(self) -> dict[str, Any]:
        """Method-specific values for summary.json (JSON-able)."""
        return {}

    def summary(self) -> None:
        log(INFO, "\t├──> %s: fraction_train=%.2f, min_train_clients=%d, weighted=%s",
            self.name, self.fraction_train, self.min_train_clients, self.weighted)
        log(INFO, "\t└──> %d clients expected: %s", len(self.client_ids), ", ".join(self.client_ids))

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

    # ------------------------------------------------------------------ nodes
    def identify(self, grid: Grid, nodes: Iterable[int]) -> None:
        """Learn the stable client id of nodes not seen yet with one QUERY message each
        (bounded by the round timeout). Node ids are random per run and change when a
        SuperNode restarts or a run is resumed; without this, the first round (and the
        first round after a resume) could neither sample by client id nor send each client
        its personal arrays."""
        unknown = [n for n in nodes if n not in self.node_to_client]
        if not unknown:
            return
        messages = [Message(content=RecordDict({CONFIG_KEY: ConfigRecord({})}), message_type=MessageType.QUERY,
                            dst_node_id=n) for n in unknown]
        for msg in send_and_receive(grid, messages, timeout=self.query_timeout):
            if msg.has_error():
                log(WARNING, "node %s did not identify itself: %s", msg.metadata.src_node_id, msg.error.reason)
                continue
            rec = msg.content.metric_records.get(METRICS_KEY)
            metrics = dict(rec.items()) if rec else {}
            try:
                self.node_to_client[msg.metadata.src_node_id] = decode_client_id(metrics)
            except (KeyError, ValueError) as err:
                log(WARNING, "node %s sent an unusable identification: %s", msg.metadata.src_node_id, err)
            if NUM_PARTITIONS in metrics:
                self.federation_size = int(metrics[NUM_PARTITIONS])

    def connected_clients(self, grid: Grid) -> list[str]:
        """The clients to address this round, ordered by client id (nodes that could not be
        identified last, as ``node-<id>``); ``self.node_of`` says which node serves each.

        Nodes are identified as they connect; the first call waits (up to
        ``wait_for_clients``) for every expected client, later calls only ``REJOIN_WAIT_S``
        for a client that has just disappeared. In a simulation with fewer SuperNodes than
        clients (Flower's default federation has 2) every node serves several clients
        (:func:`place_clients`); in a deployment a node is one client and a client without
        its node is missing. Nodes that serve none of the run's clients stay idle."""
        expected = set(self.client_ids)
        first = self._missing is None
        wait = self.wait_for_clients if first else min(self.wait_for_clients, REJOIN_WAIT_S)
        deadline = time.monotonic() + wait
        shared = not _is_deployment(grid)
        while True:
            nodes = list(grid.get_node_ids())
            self.identify(grid, nodes)
            own = {self.node_to_client[n]: n for n in nodes if n in self.node_to_client}
            placed = place_clients(self.client_ids, own, self.federation_size if shared else None)
            missing = expected - set(placed)
            newly_missing = missing if first else missing - (self._missing or set())
            if not newly_missing or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if missing and missing != self._missing:
            log(WARNING, "clients without a connected node: %s", ", ".join(sorted(missing, key=client_sort_key)))
        self._missing = missing
        if len(set(placed.values())) < len(placed) and not self._placement_logged:
            log(INFO, "%d clients on %d SuperNodes: the node of partition p of %d serves the clients "
                "c with c mod %d = p", len(placed), len(set(placed.values())), self.federation_size,
                self.federation_size)
            self._placement_logged = True
        serving = set(placed.values())
        idle = {c for c, n in own.items() if n not in serving and not c.startswith("new-")}
        if idle - self._idle_logged:
            log(INFO, "idle SuperNodes (not clients of this dataset): %s", ", ".join(sorted(idle, key=client_sort_key)))
            self._idle_logged |= idle
        # held-out clients ("new-k") connected for personalisation, and nodes that could not
        # identify themselves (addressed by node, their failures recorded under that name)
        placed.update({c: n for c, n in own.items() if c.startswith("new-")})
        placed.update({f"node-{n}": n for n in nodes if n not in self.node_to_client})
        if len(placed) < self.min_train_clients:
            raise RoundFailedError(
                f"only {len(placed)} of {len(self.client_ids)} clients connected within "
                f"{wait:.0f}s (min_train_clients={self.min_train_clients}); missing: "
                f"{', '.join(sorted(missing, key=client_sort_key)) or '-'}; "
                "start more SuperNodes or lower min_train_clients"
            )
        self.node_of = placed
        return sorted(placed, key=lambda c: (c.startswith("node-"), client_sort_key(c)))

    def _message(self, client_id: str, payload: NDArrays, config: Mapping[str, Any],
                 message_type: str) -> Message:
        """A message to the node serving ``client_id``, naming the client it is for."""
        if not client_id.startswith("node-"):
            config = {**config, TARGET_CLIENT: client_id}
        record = RecordDict({ARRAYS_KEY: to_record(payload), CONFIG_KEY: ConfigRecord(dict(config))})
        msg = Message(content=record, message_type=message_type, dst_node_id=self.node_of[client_id])
        self._addressed.append((msg, client_id))
        return msg

    def sender_of(self, reply: Message) -> str:
        """The client a reply answers for (also an error reply, which names no client): by
        the message it replies to, else by the node it came from."""
        wanted = reply.metadata.reply_to_message_id
        if wanted and wanted not in self._by_message_id:   # ids are given when messages are pushed
            self._by_message_id = {m.metadata.message_id: c for m, c in self._addressed if m.metadata.message_id}
        return self._by_message_id.get(wanted) or self._label(reply.metadata.src_node_id)

    def _label(self, node_id: int) -> str:
        return self.node_to_client.get(node_id, f"node-{node_id}")

    def no_reply_reason(self) -> str:
        """Why a node sent nothing back: the round timed out, or (when the grid returned well
        before the timeout) the message never reached a live node."""
        waited = time.monotonic() - self._sent_at
        if waited < 0.9 * self.query_timeout:
            return (f"no reply after {waited:.0f}s: the node went offline or the message could "
                    f"not be delivered (the round timeout is {self.query_timeout:.0f}s)")
        return f"no reply within the round timeout ({self.query_timeout:.0f}s)"

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        clients = self.connected_clients(grid)
        k = max(self.min_train_clients, int(round(len(clients) * self.fraction_train)))
        # sample over the list ordered by client id, so the same seed picks the same clients
        # in every run (node ids differ between runs)
        sampled = self.rng.sample(clients, min(k, len(clients)))
        sampled.sort(key=clients.index)
        cfg = {**self.train_config, **dict(config.items()), "server-round": server_round}
        self.round_log = RoundLog(sampled=list(sampled))
        self._sent = {}
        self._addressed = []
        messages = []
        for cid in sampled:
            payload = self.payload_for(cid)
            self._sent[cid] = payload
            self.round_log.bytes_down[cid] = num_bytes(payload)
            messages.append(self._message(cid, payload, cfg, MessageType.TRAIN))
        log(INFO, "configure_train: round %d, sampled %d of %d clients", server_round, len(sampled),
            len(clients))
        self._sent_at = time.monotonic()
        return messages

    def parse_replies(self, replies: Iterable[Message], sent_to: Iterable[str]) -> list[ClientUpdate]:
        """Validate replies into ClientUpdates; record failures, rejections and no-shows."""
        updates: list[ClientUpdate] = []
        answered: set[str] = set()
        for msg in replies:
            node, target = msg.metadata.src_node_id, self.sender_of(msg)
            answered.add(target)
            if msg.has_error():
                self.round_log.failed[target] = f"client error: {short_reason(msg.error.reason)}"
                log(WARNING, "client %s failed: %s", target, self.round_log.failed[target])
                continue
            metrics = dict(msg.content.metric_records[METRICS_KEY].items()) \
                if METRICS_KEY in msg.content.metric_records else {}
            try:
                cid = decode_client_id(metrics)
            except (KeyError, ValueError) as err:
                self.round_log.rejected[target] = str(err)
                continue
            if cid != target and not target.startswith("node-"):
                self.round_log.rejected[target] = f"the reply to client {target}'s message is for client {cid}"
                log(WARNING, "rejected a reply: %s", self.round_log.rejected[target])
                continue
            self.node_to_client.setdefault(node, cid)
            arrays = conform_scalars(from_record(msg.content.array_records.get(ARRAYS_KEY)), self.reference)
            reason = (validate_arrays(arrays, self.reference, self.norm_bound, self._sent.get(target))
                      or self.check_upload(arrays))
            if reason is not None:
                self.round_log.rejected[cid] = reason
                log(WARNING, "rejected the update of client %s: %s", cid, reason)
                continue
            extra = {k: from_record(v) for k, v in msg.content.array_records.items() if k != ARRAYS_KEY}
            bad = [f"{rk}/{k}" for rk, rec in extra.items() for k, a in rec.items()
                   if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a))]
            if bad:
                self.round_log.rejected[cid] = f"array {bad[0]!r} contains NaN or Inf"
                log(WARNING, "rejected the update of client %s: %s", cid, self.round_log.rejected[cid])
                continue
            updates.append(ClientUpdate(
                client_id=cid, node_id=node, arrays=arrays,
                num_examples=int(metrics.get(NUM_EXAMPLES, 0)),
                metrics={k: float(v) for k, v in metrics.items()}, extra=extra,
            ))
            self.round_log.replied.append(cid)
            self.round_log.bytes_up[cid] = num_bytes(arrays) + sum(num_bytes(e) for e in extra.values())
        for target in sent_to:
            if target not in answered:
                self.round_log.failed[target] = self.no_reply_reason()
                log(WARNING, "client %s: %s", target, self.round_log.failed[target])
        # a fixed order (by client id, not arrival) keeps float sums reproducible
        updates.sort(key=lambda u: client_sort_key(u.client_id))
        return updates

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        updates = self.parse_replies(replies, self._sent.keys())
        log(INFO, "aggregate_train: %d replies, %d failed, %d rejected", len(updates),
            len(self.round_log.failed), len(self.round_log.rejected))
        if len(updates) < self.min_train_clients:
            problems = {**self.round_log.failed, **self.round_log.rejected}
            raise RoundFailedError(
                f"round {server_round}: only {len(updates)} valid replies, min_train_clients="
                f"{self.min_train_clients}; missing or rejected: "
                + (", ".join(f"{c} ({problems[c]})" for c in sorted(problems, key=client_sort_key))
                   or "none sampled")
            )
        absent = set(self.round_log.failed) | set(self.round_log.rejected)
        kept = ({c: {k: np.array(v, copy=True) for k, v in self.personal[c].items()}
                 for c in absent if c in self.personal} if self.keep_absent_personal else {})
        self.aggregate_updates(server_round, updates)
        for cid in absent:
            if not self.keep_absent_personal:
                break
            if cid in kept:
                self.personal[cid] = kept[cid]
            else:
                self.personal.pop(cid, None)
        return to_record(self.global_arrays), MetricRecord(self.train_metrics(updates))

    def train_metrics(self, updates: list[ClientUpdate]) -> dict[str, float]:
        weights = np.array([u.num_examples for u in updates], dtype=np.float64)
        keys = set.intersection(*(set(u.metrics) for u in updates)) - {NUM_EXAMPLES}
        out = {k: float(np.average([u.metrics[k] for u in updates], weights=weights))
               for k in sorted(keys) if not k.startswith(("client-index", "new-client-index"))}
        out["clients"] = float(len(updates))
        return out

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Evaluate every connected client (not only the sampled ones)."""
        return self.evaluate_messages(server_round, config, self.connected_clients(grid))

    def evaluate_messages(self, server_round: int, config: ConfigRecord, clients: list[str],
                          already: Iterable[str] = ()) -> list[Message]:
        """Evaluate messages to ``clients``; ``already`` = clients whose evaluation of this
        round came with their training reply (they count as asked, see
        :meth:`aggregate_evaluate`)."""
        cfg = {**self.train_config, **dict(config.items()), "server-round": server_round}
        self._sent_eval = [*already, *clients]
        self._sent_at = time.monotonic()
        self._addressed = [(m, c) for m, c in self._addressed if m.metadata.message_type != MessageType.EVALUATE]
        return [self._message(c, self.payload_for(c), cfg, MessageType.EVALUATE) for c in clients]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self.last_eval = {}
        eval_failed: dict[str, str] = {}
        answered = set()
        for msg in replies:
            target = self.sender_of(msg)
            answered.add(target)
            if msg.has_error():
                eval_failed[target] = short_reason(msg.error.reason)
                continue
            # an evaluate reply, or a train reply carrying the evaluation (EVAL_METRICS_KEY)
            rec = msg.content.metric_records.get(EVAL_METRICS_KEY) or msg.content.metric_records.get(METRICS_KEY)
            metrics = dict(rec.items()) if rec is not None else {}
            try:
                cid = decode_client_id(metrics)
            except (KeyError, ValueError) as err:
                eval_failed[target] = f"unusable reply: {err}"
                continue
            self.node_to_client.setdefault(msg.metadata.src_node_id, cid)
            self.last_eval[cid] = {k: float(v) for k, v in metrics.items()}
        for target in self._sent_eval:
            if target not in answered:
                eval_failed[target] = self.no_reply_reason()
        self.eval_failed = eval_failed
        if not self.last_eval:
            return None
        # by client id, not arrival: float sums (the means) reproduce bit for bit, also on resume
        self.last_eval = dict(sorted(self.last_eval.items(), key=lambda kv: client_sort_key(kv[0])))
        return MetricRecord(summarise_clients(self.last_eval))

    # ------------------------------------------------------------------ checkpoint
    def state_arrays(self) -> dict[str, NDArrays]:
        """Everything the strategy must restore on resume, as named array groups."""
        groups: dict[str, NDArrays] = {"global": dict(self.global_arrays)}
        for cid, arrays in self.personal.items():
            groups[f"personal/{cid}"] = dict(arrays)
        return groups

    def load_state_arrays(self, groups: Mapping[str, NDArrays]) -> None:
        self.global_arrays = dict(groups.get("global", self.global_arrays))
        self.personal = {k.split("/", 1)[1]: dict(v) for k, v in groups.items() if k.startswith("personal/")}

    def state_meta(self) -> dict[str, Any]:
        return {"rng": _rng_to_json(self.rng.getstate()), "name": self.name}

    def load_state_meta(self, meta: Mapping[str, Any]) -> None:
        if "rng" in meta:
            self.rng.setstate(_rng_from_json(meta["rng"]))


def summarise_clients(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Mean, min and std over clients of every metric all clients reported, and the
    sample-weighted validation accuracy ``val_accuracy_weighted`` = sum_k a_k n_k / sum_k n_k
    (n_k = client k's validation size), the quantity flgo-based code (FDSE's) selects the
    best round on."""
    keys = set.intersection(*(set(m) for m in per_client.values()))
    out: dict[str, float] = {"clients": float(len(per_client))}
    for k in sorted(keys):
        if k in (NUM_EXAMPLES, NUM_VAL_EXAMPLES, "client-index", "new-client-index"):
            continue
        vals = np.array([m[k] for m in per_client.values()], dtype=np.float64)
        out[f"{k}_mean"], out[f"{k}_min"], out[f"{k}_std"] = float(vals.mean()), float(vals.min()), float(vals.std())
    if {"val_accuracy", NUM_VAL_EXAMPLES} <= keys:
        sizes = np.array([m[NUM_VAL_EXAMPLES] for m in per_client.values()], dtype=np.float64)
        accs = np.array([m["val_accuracy"] for m in per_client.values()], dtype=np.float64)
        if sizes.sum() > 0:
            out["val_accuracy_weighted"] = float((accs * sizes).sum() / sizes.sum())
    return out


def _rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
