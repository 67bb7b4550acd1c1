"""The server's side of SecAgg+ for a round's training (``privacy.secure_aggregation=secagg+``).

:class:`SecureAggregation` runs the round's four exchanges around the method's train messages
(setup, share keys, the train messages themselves carrying each client's shares, unmask) and
hands the method the unmasked weighted mean of the masked tensors (:class:`SecureOutcome`);
it never holds one client's update. The protocol's steps are in ``common/secure_aggregation.py``;
what the server sees, the threat model and the precision are in docs/privacy.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Protocol

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType
from flwr.common.logger import log

from common.bundles import send_and_receive
from common.protocol import CONFIG_KEY, EVALUATE_ROUND
from common.secure_aggregation import (
    ACTIVE,
    CIPHERTEXTS,
    CLIPPED_METRIC,
    COLLECT,
    DEAD,
    DESTINATIONS,
    MASKED_KEYS,
    MASKED_RECORD,
    PARAMS,
    PK1,
    PK2,
    REPLY_KEY,
    SECURE_ID,
    SETUP,
    SHARE_IDS,
    SHARE_KEYS,
    SHARES,
    SOURCES,
    STAGE,
    UNMASK,
    WEIGHT_ENTRY,
    SecAggParams,
    encode_keys,
    mean_bound,
    neighbourhoods,
    rebuild,
    sum_masked,
    threshold_of,
    unmask_mean,
)
from common.settings import PrivacySettings
from strategies.addressing import ClientDirectory
from strategies.replies import RoundFailedError, TrainReplies, short_reason

MOD_BITS = 32       # masks and sums modulo 2**32 (Flower's default), or more when m * Q needs it


@dataclass
class SecureOutcome:
    """What a round's secure aggregation gives the method: the weighted mean update of the
    masked tensors (from what the clients were sent), and the round's protocol numbers."""

    mean_update: dict[str, np.ndarray]
    weight_total: float
    notes: dict[str, Any] = field(default_factory=dict)


class TrainRound(Protocol):
    """What a round's secure aggregation reads and writes of ``strategies.base.TrainRound``."""

    server_round: int
    messages: list[Message]
    sent: dict[str, Any]
    replies: TrainReplies
    secure: SecureOutcome | None


class SecureAggregation:
    """SecAgg+ of the tensors ``masked_keys`` for one run.

    Parameters
    ----------
    settings : the ``privacy`` group.
    masked_keys : the float tensors of the method's shared role (what is averaged).
    reference : the model's tensors (shapes a masked upload must have).
    seed : the run seed (the neighbourhoods' draw).
    max_weight : a client's weight is ``n / max_weight``; 0 = unweighted.
    """

    def __init__(self, settings: PrivacySettings, masked_keys: list[str], reference: Mapping[str, np.ndarray],
                 seed: int, max_weight: float) -> None:
        self.settings = settings
        self.masked_keys = sorted(masked_keys)
        self.shapes = {k: tuple(np.shape(reference[k])) for k in self.masked_keys}
        self.seed, self.max_weight = seed, max_weight

    def summary(self) -> dict[str, Any]:
        """summary.json's ``secure_aggregation`` entry."""
        s = self.settings
        return {"protocol": s.secure_aggregation, "masked_tensors": len(self.masked_keys),
                "shares": s.secagg_shares or "all sampled", "threshold": s.secagg_threshold,
                "clip_range": s.secagg_clip_range, "quantization_bits": s.secagg_bits,
                "weighted": self.max_weight > 0}

    def params_for(self, sampled: int) -> SecAggParams:
        """The round's numbers for ``sampled`` clients (fails the round when the threshold cannot be met)."""
        s = self.settings
        shares = sampled if not s.secagg_shares or s.secagg_shares >= sampled else int(s.secagg_shares) | 1
        threshold = threshold_of(s.secagg_threshold, shares)
        if sampled < 2 or threshold > shares:
            raise RoundFailedError(
                f"secure aggregation: {sampled} clients sampled, neighbourhoods of {shares}, threshold {threshold}: "
                "it needs at least 2 clients and a threshold within the neighbourhood (privacy.secagg_threshold, "
                "privacy.secagg_shares, run.fraction_train)")
        quant_range = 2 ** s.secagg_bits
        mod_range = 2 ** max(MOD_BITS, int(np.ceil(np.log2(sampled * quant_range))) + 1)
        return SecAggParams(shares=shares, threshold=threshold, clip_range=s.secagg_clip_range,
                            quant_range=quant_range, mod_range=mod_range, max_weight=self.max_weight,
                            clip_norm=s.clip_norm if s.enabled else 0.0,
                            noise_std=s.noise_multiplier * s.clip_norm / np.sqrt(sampled) if s.distributed else 0.0)

    # ------------------------------------------------------------------ the round
    def run(self, grid: Any, train: TrainRound, directory: ClientDirectory, timeout: float,
            check_replies: Callable[[list[Message]], None] = lambda replies: None) -> list[Message]:
        """The round's four exchanges; returns the train (collect) replies, each taken by
        ``train.replies`` as it arrived, and leaves :class:`SecureOutcome` in ``train.secure``.
        Clients that drop are marked failed with the step they dropped at; too few left fails
        the round (:class:`RoundFailedError`)."""
        server_round = train.server_round
        sampled = list(train.sent)
        params = self.params_for(len(sampled))
        sid_of = {cid: i + 1 for i, cid in enumerate(sampled)}
        cid_of = {i: c for c, i in sid_of.items()}
        neighbours = neighbourhoods(len(sampled), params.shares, np.random.default_rng([self.seed, server_round, 7]))
        base = {cid: {k: v for k, v in dict(msg.content.config_records[CONFIG_KEY]).items() if k != EVALUATE_ROUND}
                for cid, msg in zip(sampled, train.messages, strict=True)}
        dropped: dict[str, str] = {}
        stage_bytes = {"up": 0, "down": 0}

        def exchange(stage: str, targets: list[str], config_of: Callable[[str], dict[str, Any]]) -> dict[int, dict]:
            ex = directory.exchange(MessageType.TRAIN)
            msgs = [ex.message(c, {}, {**base[c], STAGE: stage, SECURE_ID: sid_of[c], **config_of(c)}) for c in targets]
            stage_bytes["down"] += sum(_config_bytes(m) for m in msgs)
            replies = send_and_receive(grid, msgs, timeout=timeout)
            check_replies(replies)
            answers: dict[int, dict] = {}
            for reply in replies:
                cid = ex.sender_of(reply)
                if cid not in sid_of:
                    continue
                if reply.has_error():
                    dropped[cid] = f"dropped at secure aggregation's {stage}: {short_reason(reply.error.reason)}"
                    continue
                record = reply.content.config_records.get(REPLY_KEY)
                if record is None:
                    dropped[cid] = f"its {stage} reply has no {REPLY_KEY!r} record"
                    continue
                stage_bytes["up"] += _config_bytes(reply)
                answers[sid_of[cid]] = dict(record.items())
            for c in targets:
                if sid_of[c] not in answers:
                    dropped.setdefault(c, f"no {stage} reply: {ex.no_reply_reason()}")
            self._check_threshold(server_round, stage, set(answers), neighbours, params, dropped)
            return answers

        # 1. setup: public keys
        keys = exchange(SETUP, sampled, lambda c: {PARAMS: params.to_json()})
        public = {sid: (bytes(a[PK1]), bytes(a[PK2])) for sid, a in keys.items()}
        # 2. share keys: each client its neighbours' public keys; its encrypted shares come back
        alive = [cid_of[s] for s in sorted(public)]
        shared = exchange(SHARE_KEYS, alive, lambda c: encode_keys(
            {n: public[n] for n in neighbours[sid_of[c]] if n in public}))
        inbox: dict[int, list[tuple[int, bytes]]] = {s: [] for s in shared}
        for src, answer in shared.items():
            for dst, ciphertext in zip(answer.get(DESTINATIONS, []), answer.get(CIPHERTEXTS, []), strict=True):
                if int(dst) in inbox:
                    inbox[int(dst)].append((src, bytes(ciphertext)))
        # 3. collect: the train messages, each with the shares meant for its client
        collect = []
        for cid, msg in zip(sampled, train.messages, strict=True):
            sid = sid_of[cid]
            if sid not in shared:
                train.replies.answered.add(cid)
                train.replies.log.failed[cid] = dropped.get(cid, "dropped during secure aggregation's key sharing")
                continue
            config = msg.content.config_records[CONFIG_KEY]
            got = sorted(inbox[sid])
            msg.content[CONFIG_KEY] = ConfigRecord({**dict(config.items()), STAGE: COLLECT, SECURE_ID: sid,
                                                    SOURCES: [s for s, _ in got], CIPHERTEXTS: [c for _, c in got],
                                                    MASKED_KEYS: self.masked_keys})
            collect.append(msg)
        train.messages[:] = collect
        replies = send_and_receive(grid, collect, timeout=timeout, on_reply=train.replies.take)
        train.messages.clear()
        check_replies(replies)
        masked, clipped = self._take_masked(train, params)
        active = {sid_of[c] for c in masked}
        dead = set(shared) - active
        for cid in (cid_of[s] for s in dead):
            dropped.setdefault(cid, train.replies.log.failed.get(cid) or train.replies.log.rejected.get(cid, "dropped"))
        self._check_threshold(server_round, COLLECT, active, neighbours, params, dropped)
        total = sum_masked(masked.values(), params.mod_range)
        del masked
        # 4. unmask: shares of the active clients' self-mask seeds and of the dropped ones' keys
        answers = exchange(UNMASK, [cid_of[s] for s in sorted(active)], lambda c: {
            ACTIVE: [n for n in neighbours[sid_of[c]] if n in active],
            DEAD: [n for n in neighbours[sid_of[c]] if n in dead]})
        held: dict[int, list[bytes]] = {s: [] for s in active | dead}
        for answer in answers.values():
            for owner, share in zip(answer.get(SHARE_IDS, []), answer.get(SHARES, []), strict=True):
                if int(owner) in held:
                    held[int(owner)].append(bytes(share))
        short = sorted(s for s, got in held.items() if len(got) < params.threshold)
        if short:
            raise RoundFailedError(
                f"round {server_round}: secure aggregation could not unmask: clients {[cid_of[s] for s in short][:5]} "
                f"have fewer than {params.threshold} shares back ({len(answers)} of {len(active)} answered the "
                "unmask step); the round's model was not changed. Resume the run from its checkpoint")
        try:
            seeds = {s: rebuild(held[s]) for s in active}
            dead_keys = {s: rebuild(held[s]) for s in dead}
            mean, weight_total = unmask_mean(total, len(active), params, seeds, dead_keys, public, neighbours, active)
        except ValueError as err:
            raise RoundFailedError(f"round {server_round}: secure aggregation could not unmask: {err}") from err
        train.secure = SecureOutcome(mean, weight_total, {
            "clients": len(active), "sampled": len(sampled), "dropped_after_key_sharing": sorted((cid_of[s] for s in dead), key=sampled.index),
            "threshold": params.threshold, "shares": params.shares, "clipped_values": clipped,
            "mean_bound": mean_bound(params, len(active), weight_total),
            "stage_bytes_up": stage_bytes["up"], "stage_bytes_down": stage_bytes["down"]})
        log(INFO, "secure aggregation: round %d unmasked the mean of %d clients (%d dropped after key sharing, "
            "threshold %d of %d)", server_round, len(active), len(dead), params.threshold, params.shares)
        return replies

    def _take_masked(self, train: TrainRound, params: SecAggParams) -> tuple[dict[str, dict[str, np.ndarray]], int]:
        """The valid updates' masked vectors (taken out of the updates); an update whose vector
        is malformed is rejected, as any malformed upload is."""
        expected = {**self.shapes, WEIGHT_ENTRY: (1,)}
        masked: dict[str, dict[str, np.ndarray]] = {}
        clipped = 0
        for update in list(train.replies.updates):
            vector = update.extra.pop(MASKED_RECORD, None)
            reason = _masked_problem(vector, expected, params.mod_range)
            if reason is not None:
                train.replies.updates.remove(update)
                train.replies.log.replied.remove(update.client_id)
                train.replies.log.rejected[update.client_id] = reason
                log(WARNING, "rejected the update of client %s: %s", update.client_id, reason)
                continue
            assert vector is not None
            masked[update.client_id] = vector
            clipped += int(update.metrics.get(CLIPPED_METRIC, 0))
        return masked, clipped

    @staticmethod
    def _check_threshold(server_round: int, stage: str, alive: set[int], neighbours: Mapping[int, list[int]],
                         params: SecAggParams, dropped: Mapping[str, str]) -> None:
        """Every client still in needs ``threshold`` live neighbours (itself included)."""
        low = sorted(s for s in alive if len(set(neighbours[s]) & alive) < params.threshold)
        if low or not alive:
            raise RoundFailedError(
                f"round {server_round}: secure aggregation fell below its threshold at {stage}: "
                f"{len(alive)} clients left, {params.threshold} live neighbours needed"
                + (f" (dropped: {'; '.join(f'{c}: {r}' for c, r in list(dropped.items())[:3])})" if dropped else "")
                + ". The round's model was not changed; resume the run from its checkpoint")


def _masked_problem(vector: Mapping[str, np.ndarray] | None, expected: Mapping[str, tuple[int, ...]],
                    mod_range: int) -> str | None:
    """Why a masked vector cannot enter the sum (None when it can)."""
    if vector is None:
        return f"the reply has no {MASKED_RECORD!r} record (secure aggregation is on)"
    if set(vector) != set(expected):
        return f"its masked vector holds {sorted(vector)[:3]}..., expected {sorted(expected)[:3]}..."
    for k, shape in expected.items():
        a = vector[k]
        if a.dtype != np.int64 or tuple(a.shape) != tuple(shape):
            return f"its masked {k!r} is {a.dtype}{tuple(a.shape)}, expected int64{tuple(shape)}"
        if a.size and (a.min() < 0 or a.max() >= mod_range):
            return f"its masked {k!r} has values outside [0, {mod_range})"
    return None


def _config_bytes(msg: Message) -> int:
    """The bytes of a message's keys and ciphertexts (what the protocol's extra steps carry)."""
    total = 0
    for record in msg.content.config_records.values():
        for value in record.values():
            items = value if isinstance(value, list) else [value]
            total += sum(len(v) if isinstance(v, bytes | str) else 8 for v in items)
    return total
