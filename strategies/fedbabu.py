"""FedBABU server (Oh, Kim and Yun, ICLR 2022): body aggregation, head fixed and sent once.

- The head theta_cls^0 is initialised once here from the run seed (``head_init``:
  ``orthogonal`` = the paper, default; ``default`` = the seeded PyTorch init the authors'
  code used) and never changes: it is not aggregated and clients never train it.
- Each client gets the head until it has acknowledged storing it (reply metric
  ``head_stored``) in a *training* reply; after that only the body is sent, and the
  digest of the head travels in the config (``head-sha256``) so the client can check its
  stored copy. A client that fails (e.g. lost its state) is sent the head again.
- Clients upload only the body; the server averages only the body
  (:func:`strategies.fedbabu_math.average_body`; sample-weighted by default,
  ``weighted: false`` for the authors' unweighted mean).

Nothing here depends on simulation: it is the same message flow in the gRPC deployment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

from flwr.app import Message
from flwr.common.logger import log

from common.options import FedProxOptions
from common.protocol import client_sort_key
from common.roles import FROZEN, keys_with
from learning.params import NDArrays, num_bytes
from strategies.base import (
    ClientUpdate,
    EvaluateRound,
    Evaluation,
    PersonalizedStrategy,
    RoundNotes,
    TrainResult,
    TrainRound,
)
from strategies.fedbabu_math import (
    HEAD_DIGEST_KEY,
    HEAD_STORED_METRIC,
    FedBABUOptions,
    average_body,
    head_digest,
    init_head,
    split_head,
)


class FedBABU(PersonalizedStrategy):
    """FedBABU: theta_ext <- sum_i w_i theta_ext,i / sum_i w_i over the round's clients;
    theta_cls = theta_cls^0 for the whole training (fine-tuned only at evaluation).

    Also the server of FedProx+BABU (``strategy=fedprox strategy.body_only=true``, FedProx's
    options: the orthogonal head at gain 1); its proximal term lives on the client
    (``client.fedbabu.FedProxBABUTrainer``)."""

    mean_rule: ClassVar[bool] = False   # its own body average (average_body), over every update
    # the clients that acknowledged storing the head (sent the body only from then on)
    carried_state: ClassVar[tuple[str, ...]] = (*PersonalizedStrategy.carried_state, "head_acked")

    def __init__(self, initial_arrays: NDArrays, client_ids: list[str], **kwargs: Any) -> None:
        super().__init__(initial_arrays, client_ids, **kwargs)
        if self.model is None or not isinstance(self.options, FedBABUOptions | FedProxOptions):
            raise ValueError("FedBABU needs the initial model and its options to find its head "
                             "(pass model= and method=resolve_method(cfg.strategy))")
        self.head_keys: list[str] = keys_with(self.roles, FROZEN)
        seed = self.run.seed
        mode = self.options.head_init if isinstance(self.options, FedBABUOptions) else "orthogonal"
        self.head_init = mode
        _, head0 = split_head(self.global_arrays, self.head_keys)
        gain = self.options.head_gain if isinstance(self.options, FedBABUOptions) else 1.0
        self.head: NDArrays = init_head(head0, seed, mode, gain)
        self.global_arrays.update(self.head)
        self.head_sha = head_digest(self.head)
        self.train_config[HEAD_DIGEST_KEY] = self.head_sha
        self.head_acked: set[str] = set()
        log(INFO, "FedBABU: head %s (%d bytes, init %s) fixed for the whole training",
            self.head_keys, num_bytes(self.head), mode)

    # ------------------------------------------------------------------ payloads
    def payload_for(self, client_id: str | None) -> NDArrays:
        """Body always; the head only until this client has acknowledged storing it."""
        body, _ = split_head(self.global_arrays, self.head_keys)
        if client_id is not None and client_id in self.head_acked:
            return body
        return {**body, **self.head}

    # ------------------------------------------------------------------ aggregation
    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> RoundNotes:
        """The body's average (the head stays as initialised); returns which of the round's
        clients were sent the head (those that had not acknowledged storing it)."""
        body_bytes = self._body_bytes()
        notes = {"fedbabu": {"head_sent_to": sorted((c for c, p in train.sent.items() if num_bytes(p) > body_bytes),
                                                    key=client_sort_key)}}
        uploaded = [u for u in updates if u.arrays]
        for u in updates:
            if u.metrics.get(HEAD_STORED_METRIC, 0.0) >= 1.0:
                self.head_acked.add(u.client_id)
        if not uploaded:
            return notes
        sent_head = [u.client_id for u in uploaded if set(u.arrays) & set(self.head_keys)]
        if sent_head:
            log(WARNING, "FedBABU: clients %s uploaded head tensors; they are ignored", sent_head)
        weights = self.weights_of(uploaded)
        self.global_arrays.update(average_body([u.arrays for u in uploaded], weights, self.head_keys))
        log(INFO, "aggregate: FedBABU body average over %d clients (weighted=%s)", len(uploaded),
            self.weighted)
        return notes

    def _forget_failed(self, failed: Iterable[str]) -> None:
        for label in failed:
            if label in self.head_acked:
                self.head_acked.discard(label)
                log(WARNING, "FedBABU: client %s failed; it will be sent the head again", label)

    def aggregate_round(self, train: TrainRound) -> TrainResult:
        failed = list(train.sent)    # if the round fails, every sampled client is sent the head again
        try:
            result = super().aggregate_round(train)
            failed = list(result.log.failed) + list(result.log.rejected)
            return result
        finally:
            self._forget_failed(failed)

    def evaluation_of(self, evaluate: EvaluateRound, replies: Iterable[Message]) -> Evaluation:
        evaluation = super().evaluation_of(evaluate, replies)
        self._forget_failed(evaluation.failed)
        return evaluation

    def _body_bytes(self) -> int:
        return num_bytes(split_head(self.global_arrays, self.head_keys)[0])

    def summary_extras(self) -> dict[str, Any]:
        return {"head_bytes": num_bytes(self.head), "body_bytes": self._body_bytes(),
                "head_init": self.head_init,
                "head_sha256": self.head_sha}

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> tuple[dict[str, NDArrays], dict[str, Any]]:
        groups, meta = super().state()
        return groups, {**meta, "head_acked": sorted(self.head_acked)}

    def load_state(self, groups: Mapping[str, NDArrays], meta: Mapping[str, Any]) -> None:
        super().load_state(groups, meta)
        self.head_acked = set(meta.get("head_acked", []))
        _, head = split_head(self.global_arrays, self.head_keys)
        if head_digest(head) != self.head_sha:
            raise ValueError("the checkpoint's head differs from this run's initial head (different "
                             "seed or head_init?); resume with the original configuration")
