"""FDSE server: consensus maximisation for the shared part, attention for the personal part.

Wang et al., "Federated Learning with Domain Shift Eraser" (FDSE), CVPR 2025, Sec. 4.3 and
Algorithm 1. The pure math lives in :mod:`strategies.fdse_math` and is re-exported here
(``min_norm_weights``, ``consensus_update``, ``attention_mix`` and their batched forms), so
``strategies.fdse`` is the one place to import FDSE's server math from.

Parameter classes (``learning.fdse_model.parameter_classes``):

* **shared** (DFE convs/linears, BN_DFE, the head): for every shared *float parameter*
  tensor l, with client k's update ``delta_k = theta_k - theta_sent`` (its uploaded tensor
  minus the global tensor the server sent it this round)::

      dbar = mean_k ||delta_k||,  d_k = delta_k / ||delta_k||,
      u = argmin_{u in simplex} ||sum_k u_k d_k||^2        (MGDA min-norm QP, Eq. 8)
      theta_new = theta_old + dbar * sum_k u_k d_k

  solved for all tensors at once (``consensus_update_many``: K x K Gram per tensor, batched
  accelerated projected gradient + exact support polish, duality gap <= ``consensus_tol``).
  BN_DFE running mean/variance: plain (unweighted) mean over the round's clients, as in the
  paper ("directly average them for BN_DFE"); ``num_batches_tracked``: rounded mean.
* **personal** (DSE depthwise convs, BN_DSE affine): per tensor, over the clients of the
  round, ``theta_i <- sum_j softmax_j(cos(theta_i, theta_j) / tau) theta_j`` (Eq. 9);
  each client receives its own mix next round (``self.personal[cid]``, keyed by the stable
  client id and checkpointed by the base class). Clients absent from a round keep their
  stored personal tensors unchanged. Before a client's first round it receives the
  initial personal tensors (kept in ``global_arrays``; Algorithm 1 line 2).
* **local** (BN_DSE running statistics): never uploaded by clients, never sent by the
  server (they are not in ``global_arrays``); an upload containing them is rejected.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.common.logger import log

from learning.params import NDArrays, is_float, weighted_mean
from strategies.base import ClientUpdate, PersonalizedStrategy, RoundNotes, TrainRound
from strategies.fdse_math import (
    FDSEOptions,
    attention_mix,
    attention_mix_many,
    consensus_update,
    consensus_update_many,
    duality_gap,
    gram_matrix,
    layer_weights,
    min_norm_weights,
    min_norm_weights_batched,
)

__all__ = [
    "FDSE",
    "attention_mix",
    "attention_mix_many",
    "consensus_update",
    "consensus_update_many",
    "duality_gap",
    "gram_matrix",
    "layer_weights",
    "min_norm_weights",
    "min_norm_weights_batched",
    "split_keys",
]

_BN_STATS = ("running_mean", "running_var")


def split_keys(roles: Mapping[str, str]) -> dict[str, list[str]]:
    """Split the parameter roles (``common.roles``; FDSE's are its ``parameter_classes``) into the groups the server treats differently:
    ``consensus`` (shared float parameters), ``bn_stats`` (shared BN running mean/var),
    ``counters`` (shared ``num_batches_tracked``), ``personal`` and ``local``."""
    out: dict[str, list[str]] = {"consensus": [], "bn_stats": [], "counters": [],
                                 "personal": [], "local": []}
    for key, cls in roles.items():
        leaf = key.rsplit(".", 1)[-1]
        if cls == "shared":
            if leaf in _BN_STATS:
                out["bn_stats"].append(key)
            elif leaf == "num_batches_tracked":
                out["counters"].append(key)
            else:
                out["consensus"].append(key)
        elif cls == "personal":
            out["personal"].append(key)
        elif cls == "local":
            out["local"].append(key)
        else:
            raise ValueError(f"split_keys: unknown parameter class {cls!r} for {key!r}")
    return out


class FDSE(PersonalizedStrategy):
    """FDSE server rule (see the module docstring). Options (``conf/strategy/fdse.yaml``):
    ``tau`` (attention temperature), ``consensus_tol`` (duality-gap tolerance of the
    min-norm QP), ``zero_policy`` ("exclude": a client with a zero update gets no weight;
    "include": the authors' code's ``delta / (||delta|| + 1e-8)``)."""

    mean_rule: ClassVar[bool] = False   # MGDA consensus and attention need every update at once

    def __init__(self, initial_arrays: NDArrays, client_ids: list[str], **kwargs: Any) -> None:
        super().__init__(initial_arrays, client_ids, **kwargs)
        if self.model is None or not isinstance(self.options, FDSEOptions):
            raise ValueError("FDSE needs the initial model (model=...) and its options "
                             "(method=resolve_method(cfg.strategy)) to find its shared, personal and local parameters")
        missing = [k for k in initial_arrays if k not in self.roles]
        if missing:
            raise ValueError(f"FDSE: initial arrays {missing[:3]} are not keys of the model")
        self.groups = split_keys(self.roles)
        self.tau, self.tol, self.zero_policy = self.options.tau, self.options.consensus_tol, self.options.zero_policy
        local = set(self.groups["local"])
        # the server never holds nor sends local-only statistics
        self.global_arrays = {k: v for k, v in self.global_arrays.items() if k not in local}

    # ------------------------------------------------------------------ aggregation
    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> RoundNotes:
        """Consensus step for the shared tensors, mean of the shared BN statistics, attention
        mix of the personal ones; returns the min-norm weights per shared tensor (clients in
        ``fdse_clients`` order) for the round's metrics line."""
        server_round = train.server_round
        uploaded = updates     # uploads breaking the roles were rejected (strategies/replies.py)
        if not uploaded:
            log(WARNING, "fdse: round %d had no valid uploads; nothing to aggregate", server_round)
            return {"fdse_clients": [], "fdse_consensus_weights": {}}
        # --- shared parameters: consensus maximisation (Eq. 8), update vs what was sent
        deltas = []
        for u in uploaded:
            sent = train.sent.get(u.client_id, self.global_arrays)
            # in the tensors' own precision (float32 models: no float64 copies)
            deltas.append({k: np.subtract(u.arrays[k], sent[k]) for k in self.groups["consensus"]})
        step, weights = consensus_update_many(deltas, tol=self.tol, zero_policy=self.zero_policy,
                                              return_weights=True)
        del deltas
        for k, d in step.items():
            old = np.asarray(self.global_arrays[k])
            self.global_arrays[k] = (old + d).astype(old.dtype, copy=False)
        # --- shared BN running statistics: plain mean; counters: rounded mean
        stats_keys = self.groups["bn_stats"] + self.groups["counters"]
        if stats_keys:
            mean = weighted_mean([{k: u.arrays[k] for k in stats_keys} for u in uploaded],
                                 [1.0] * len(uploaded))
            self.global_arrays.update(mean)
        # --- personal parameters: similarity-aware attention (Eq. 9), one mix per client
        pkeys = self.groups["personal"]
        if pkeys:
            mixed = attention_mix_many([{k: u.arrays[k] for k in pkeys} for u in uploaded], self.tau)
            for u, mix in zip(uploaded, mixed, strict=True):
                self.personal[u.client_id] = {
                    k: (np.asarray(v).astype(self.reference[k].dtype) if is_float(self.reference[k])
                        else np.asarray(u.arrays[k]))
                    for k, v in mix.items()
                }
        log(INFO, "fdse: round %d, consensus over %d shared tensors, attention over %d personal "
            "tensors, %d clients", server_round, len(step), len(pkeys), len(uploaded))
        return {"fdse_clients": [u.client_id for u in uploaded],
                "fdse_consensus_weights": {k: [float(x) for x in w] for k, w in weights.items()}}

    # ------------------------------------------------------------------ records

    def summary_extras(self) -> dict[str, Any]:
        """Parameter counts per class and the per-client upload size of one round."""
        sizes = {g: int(sum(np.asarray(self.reference[k]).size for k in keys))
                 for g, keys in self.groups.items()}
        upload = [k for g in ("consensus", "bn_stats", "counters", "personal") for k in self.groups[g]]
        return {
            "fdse_numel": sizes,
            "fdse_upload_bytes_per_client": int(sum(np.asarray(self.reference[k]).nbytes for k in upload)),
            "fdse_model_bytes": int(sum(np.asarray(v).nbytes for v in self.reference.values())),
        }
