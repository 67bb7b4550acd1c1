"""Clients' replies into validated updates and evaluations: pure functions of the replies.

What the server accepts from a client is decided here, once for every method: a train reply
becomes a :class:`ClientUpdate` when its client id matches the message it answers, its
arrays are known model tensors of the right shape and dtype, finite, within the optional
norm bound, and respect the method's parameter roles (``check_upload``); everything else is
recorded in the round's :class:`RoundLog` (``failed``: the client erred or never answered;
``rejected``: it answered with something unusable). Nothing here keeps state: the strategy
passes what it sent and how to name a reply's client, and gets the round back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import Message
from flwr.common.logger import log

from common.protocol import (
    ARRAYS_KEY,
    EVAL_METRICS_KEY,
    METRICS_KEY,
    NUM_EXAMPLES,
    NUM_VAL_EXAMPLES,
    client_sort_key,
    decode_client_id,
    from_record,
)
from learning.params import NDArrays, num_bytes


class RoundFailedError(RuntimeError):
    """Too few clients replied in a round; the message names the missing ones."""


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
    nodes: dict[int, str] = field(default_factory=dict)    # node id -> the client it answered for


NO_NODE_AT_EVALUATION = "no connected node at this evaluation (its SuperNode is gone or has not reconnected)"


@dataclass
class Evaluation:
    """One round's evaluation: each client's metrics (ordered by client id, so that float
    sums reproduce bit for bit, also on resume), the clients that failed and why, and the
    node each reply came from."""

    per_client: dict[str, dict[str, float]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)

    def summary(self) -> dict[str, float] | None:
        """Mean, worst and spread over clients (:func:`summarise_clients`); None if nobody answered."""
        return summarise_clients(self.per_client) if self.per_client else None


def short_reason(reason: str, limit: int = 300) -> str:
    """A client error for the metrics: no ANSI colours, no traceback, the message only."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(reason))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    msg = next((ln.split("Message:", 1)[1].strip() for ln in reversed(lines) if "Message:" in ln), "")
    if not msg:
        msg = lines[-1] if lines else text
    return msg.strip(" '>\"")[:limit]


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


def _is_count(value: object) -> bool:
    """Whether a reply's number of examples can weigh its update: a whole number in [0, 2**31)
    (a float that is one too: metric records carry numbers as floats)."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and float(value).is_integer() and 0 <= value < 2**31)


def _metrics_of(msg: Message, *keys: str) -> dict[str, float]:
    """The first of ``keys``' metric records in a reply, as a dict (empty if none)."""
    for key in keys:
        rec = msg.content.metric_records.get(key)
        if rec is not None:
            return dict(rec.items())
    return {}


class TrainReplies:
    """A round's train replies, validated one at a time as they arrive (:meth:`take`).

    Parameters
    ----------
    sent : client id -> the payload of its train message, in sampling order (the log's
        ``sampled`` and ``bytes_down``, and the base of the norm bound).
    sender_of : the client a reply answers for (also an error reply, which names none).
    reference : the model's tensors (names, shapes, dtypes an upload must have).
    norm_bound : reject an update whose L2 distance from its payload exceeds this (0: off).
    check_upload : why an upload breaks the method's parameter roles, or None.
    no_reply_reason : why a client that was sent a message did not answer.
    extra_records : the array records a reply may carry besides the upload (FEDORA's basis);
        a reply without its upload record, or with any other array record, is rejected.
    fold : when given, each valid update is passed to it as it arrives (the strategy adds its
        arrays to a running mean), then its arrays are dropped from the update and every
        reply's from the reply (a rejected one's too), so that the round holds metrics, not
        models (``ClientUpdate.arrays`` is then empty; ``folded`` counts the folded updates).
    """

    def __init__(self, sent: Mapping[str, NDArrays], sender_of: Callable[[Message], str],
                 reference: Mapping[str, np.ndarray], *, norm_bound: float = 0.0,
                 check_upload: Callable[[Mapping[str, np.ndarray]], str | None] = lambda arrays: None,
                 no_reply_reason: Callable[[], str] = lambda: "no reply",
                 fold: Callable[[ClientUpdate], None] | None = None,
                 extra_records: Iterable[str] = ()) -> None:
        self.sent, self.sender_of, self.reference = sent, sender_of, reference
        self.extra_records = frozenset(extra_records)
        self.norm_bound, self.check_upload, self.no_reply_reason = norm_bound, check_upload, no_reply_reason
        self.fold = fold
        self.folded = 0
        self.log = RoundLog(sampled=list(sent), bytes_down={c: num_bytes(p) for c, p in sent.items()})
        self.updates: list[ClientUpdate] = []
        self.answered: set[str] = set()

    def take(self, msg: Message) -> Message:
        """Validate one reply into an update or a log entry; returns the reply (without its
        arrays when they were folded)."""
        update = self._parse(msg)
        if self.fold is None or not msg.has_content():
            return msg
        if update is not None and update.arrays:
            try:
                self.fold(update)
            except ValueError as err:   # the running mean refused it (and is unchanged): a rejection
                self._reject_folded(update, str(err))
            else:
                update.arrays, update.extra = {}, {}
                self.folded += 1
        for key in list(msg.content.array_records):   # a rejected reply's arrays are of no use either
            del msg.content[key]
        return msg

    def _reject_folded(self, update: ClientUpdate, reason: str) -> None:
        """An update the fold refused leaves the round as a rejected one would."""
        self.updates.remove(update)
        self.log.replied.remove(update.client_id)
        self.log.bytes_up.pop(update.client_id, None)
        self.log.rejected[update.client_id] = reason
        log(WARNING, "rejected the update of client %s: %s", update.client_id, reason)

    def _parse(self, msg: Message) -> ClientUpdate | None:
        round_log = self.log
        node, target = msg.metadata.src_node_id, self.sender_of(msg)
        self.answered.add(target)
        if msg.has_error():
            round_log.failed[target] = f"client error: {short_reason(msg.error.reason)}"
            log(WARNING, "client %s failed: %s", target, round_log.failed[target])
            return None
        metrics = _metrics_of(msg, METRICS_KEY)
        try:
            cid = decode_client_id(metrics)
        except (KeyError, ValueError) as err:
            round_log.rejected[target] = str(err)
            return None
        if cid != target and not target.startswith("node-"):
            round_log.rejected[target] = f"the reply to client {target}'s message is for client {cid}"
            log(WARNING, "rejected a reply: %s", round_log.rejected[target])
            return None
        round_log.nodes.setdefault(node, cid)
        unknown = sorted(set(msg.content.array_records) - {ARRAYS_KEY, *self.extra_records})
        if ARRAYS_KEY not in msg.content.array_records or unknown:
            round_log.rejected[cid] = (f"the reply has array records {sorted(msg.content.array_records)}; "
                                       f"expected {ARRAYS_KEY!r}" + "".join(f", {k!r}" for k in sorted(self.extra_records)))
            log(WARNING, "rejected the update of client %s: %s", cid, round_log.rejected[cid])
            return None
        count = metrics.get(NUM_EXAMPLES, 0)
        if not _is_count(count):
            round_log.rejected[cid] = (f"{NUM_EXAMPLES} must be a count of training examples (an integer "
                                       f"in [0, 2**31)), got {count!r}")
            log(WARNING, "rejected the update of client %s: %s", cid, round_log.rejected[cid])
            return None
        arrays = conform_scalars(from_record(msg.content.array_records.get(ARRAYS_KEY)), self.reference)
        reason = (validate_arrays(arrays, self.reference, self.norm_bound, self.sent.get(target))
                  or self.check_upload(arrays))
        extra = {k: from_record(v) for k, v in msg.content.array_records.items() if k != ARRAYS_KEY}
        bad = [f"{rk}/{k}" for rk, rec in extra.items() for k, a in rec.items()
               if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a))]
        reason = reason or (f"array {bad[0]!r} contains NaN or Inf" if bad else None)
        if reason is not None:
            round_log.rejected[cid] = reason
            log(WARNING, "rejected the update of client %s: %s", cid, reason)
            return None
        update = ClientUpdate(client_id=cid, node_id=node, arrays=arrays,
                              num_examples=int(count),
                              metrics={k: float(v) for k, v in metrics.items()}, extra=extra)
        self.updates.append(update)
        round_log.replied.append(cid)
        round_log.bytes_up[cid] = num_bytes(arrays) + sum(num_bytes(e) for e in extra.values())
        return update

    def finish(self) -> tuple[list[ClientUpdate], RoundLog]:
        """The valid updates ordered by client id (a fixed order keeps float sums reproducible,
        whatever the arrival order), and the round's :class:`RoundLog` with every client that
        was sent a message and did not answer marked failed."""
        for target in self.sent:
            if target not in self.answered:
                self.log.failed[target] = self.no_reply_reason()
                log(WARNING, "client %s: %s", target, self.log.failed[target])
        self.updates.sort(key=lambda u: client_sort_key(u.client_id))
        return self.updates, self.log


def parse_evaluation_replies(replies: Iterable[Message], asked: Iterable[str],
                             sender_of: Callable[[Message], str],
                             no_reply_reason: Callable[[], str] = lambda: "no reply") -> Evaluation:
    """A round's evaluation from its replies: evaluate replies, or train replies carrying
    the evaluation (``EVAL_METRICS_KEY``, ``eval_in_train``); ``asked`` = every client the
    evaluation counted on (those that did not answer are failed with ``no_reply_reason``)."""
    evaluation = Evaluation()
    answered: set[str] = set()
    for msg in replies:
        target = sender_of(msg)
        answered.add(target)
        if msg.has_error():
            evaluation.failed[target] = short_reason(msg.error.reason)
            continue
        metrics = _metrics_of(msg, EVAL_METRICS_KEY, METRICS_KEY)
        try:
            cid = decode_client_id(metrics)
        except (KeyError, ValueError) as err:
            evaluation.failed[target] = f"unusable reply: {err}"
            continue
        evaluation.nodes.setdefault(msg.metadata.src_node_id, cid)
        evaluation.per_client[cid] = {k: float(v) for k, v in metrics.items()}
    for target in asked:
        if target not in answered:
            evaluation.failed[target] = no_reply_reason()
    evaluation.per_client = dict(sorted(evaluation.per_client.items(), key=lambda kv: client_sort_key(kv[0])))
    return evaluation


def mean_train_metrics(updates: list[ClientUpdate]) -> dict[str, float]:
    """Sample-weighted mean over the round's clients of every train metric all reported,
    and the number of clients (``clients``)."""
    weights = np.array([u.num_examples for u in updates], dtype=np.float64)
    keys = set.intersection(*(set(u.metrics) for u in updates)) - {NUM_EXAMPLES}
    out = {k: float(np.average([u.metrics[k] for u in updates], weights=weights))
           for k in sorted(keys) if not k.startswith(("client-index", "new-client-index"))}
    out["clients"] = float(len(updates))
    return out


def summarise_clients(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Mean, min and std over clients of every metric all clients reported, and the
    sample-weighted validation accuracy ``val_accuracy_weighted`` = sum_k a_k n_k / sum_k n_k
    (n_k = client k's validation size), the quantity flgo-based code (FDSE's) selects the
    best round on, and the same ``<key>_weighted`` of every other validation accuracy (a
    reference model's, each BN protocol's)."""
    keys = set.intersection(*(set(m) for m in per_client.values()))
    out: dict[str, float] = {"clients": float(len(per_client))}
    for k in sorted(keys):
        if k in (NUM_EXAMPLES, NUM_VAL_EXAMPLES, "client-index", "new-client-index"):
            continue
        vals = np.array([m[k] for m in per_client.values()], dtype=np.float64)
        out[f"{k}_mean"], out[f"{k}_min"], out[f"{k}_std"] = float(vals.mean()), float(vals.min()), float(vals.std())
    if NUM_VAL_EXAMPLES in keys:
        sizes = np.array([m[NUM_VAL_EXAMPLES] for m in per_client.values()], dtype=np.float64)
        for key in sorted(k for k in keys if k.endswith("val_accuracy") and sizes.sum() > 0):
            accs = np.array([m[key] for m in per_client.values()], dtype=np.float64)
            out[f"{key}_weighted"] = float((accs * sizes).sum() / sizes.sum())
    return out
