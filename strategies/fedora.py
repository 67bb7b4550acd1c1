"""FEDORA server: federated parameter propagation over a data-subspace similarity graph.

Paper: J. Wu, W. Bao, E. Ainsworth, J. He, "Personalized Federated Learning with
Parameter Propagation", KDD 2023 (authors' code: github.com/junwu6/FEDORA).

Server side of the method (the client side is ``client/fedora.py``):

0. Once: every client uploads an orthonormal basis ``U_k`` (d x p) of its training
   inputs (the extra record ``basis`` of its reply, array ``u``); the server asks for the
   bases it does not have through the train config key ``fedora-need-basis``. When all K
   bases are known the server computes the similarity graph ``W`` (:func:`subspace_similarity`:
   ``w_kk' = sum_i cos zeta_i``, the principal-angle cosines between span(U_k) and
   span(U_k'); or the authors' ``exp(10 * sum)`` with top-2 neighbours), saves it in the
   run folder (``similarity.npy``, ``similarity.json``) and plots it (``similarity.png``).
1. Every round, clients upload their personalised parameters ``theta_k``; the server
   stacks them (the latest upload of every client) and propagates each floating tensor
   (:func:`propagate`, batched over all tensors with one solve):

       Theta_hat = (1 - a) (I - a D^-1 W)^-1 Theta,   a = alpha / (1 + alpha),

   and sends client k its own ``theta_hat_k`` (``self.personal[k]``).

Until every client's basis is known (e.g. with partial participation some clients have
not replied yet) there is no graph: the server then returns each client its own upload
(``theta_hat_k = theta_k``), so clients train locally (their selective lambda is eps).
Integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are not propagated: each
client gets its own back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.figures import inches, tick_step
from learning.params import NDArrays
from strategies.base import ClientUpdate, PersonalizedStrategy, RoundNotes, TrainRound
from strategies.fedora_math import (
    BASIS_ARRAY,
    BASIS_RECORD,
    NEED_BASIS_KEY,
    FEDORAOptions,
    data_subspace_basis,
    propagate,
    propagate_clients,
    propagate_many,
    row_normalize,
    selective_lambda,
    subspace_similarity,
)

# the strategy and its math in one import (the functions are defined in strategies/fedora_math.py)
__all__ = [
    "FEDORA",
    "subspace_similarity",
    "propagate",
    "propagate_clients",
    "propagate_many",
    "row_normalize",
    "selective_lambda",
    "data_subspace_basis",
    "plot_similarity",
]


_THETA_GROUP = "fedora-theta/"
_BASIS_GROUP = "fedora-basis/"
_GRAPH_GROUP = "fedora-graph"


class FEDORA(PersonalizedStrategy):
    """FEDORA server: similarity graph from client bases, per-round parameter propagation.

    State (all checkpointed by :meth:`state`): ``bases[cid]`` (d x p), ``theta[cid]``
    (latest upload), ``personal[cid]`` (= theta_hat, sent to the client), ``w`` (the K x K
    graph used for propagation) and ``cosine_sum`` (the full matrix of summed principal
    cosines, for the report).
    """

    mean_rule: ClassVar[bool] = False   # the propagation mixes every client's model
    extra_records: ClassVar[tuple[str, ...]] = (BASIS_RECORD,)   # sent when the server asks for it
    carried_state: ClassVar[tuple[str, ...]] = (*PersonalizedStrategy.carried_state, "bases", "theta", "w",
                                                "cosine_sum")
    options: FEDORAOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.options, FEDORAOptions):
            raise ValueError("FEDORA needs its options (method=resolve_method(cfg.strategy), conf/strategy/fedora.yaml)")
        self.bases: dict[str, np.ndarray] = {}
        self.theta: dict[str, NDArrays] = {}
        self.w: np.ndarray | None = None
        self.cosine_sum: np.ndarray | None = None
        self.basis_dim: int | None = None
        if self.data is not None:
            self.basis_dim = int(np.prod(self.data.input_shape))
            if self.options.basis_labels:
                self.basis_dim += int(self.data.num_classes)

    # ------------------------------------------------------------------ bases
    def missing_bases(self) -> list[str]:
        return [c for c in self.client_ids if c not in self.bases]

    def begin_train(self, server_round: int, config: Mapping[str, Any], grid: Grid) -> TrainRound:
        """As the base class, plus ``fedora-need-basis``: the clients asked for their basis."""
        return super().begin_train(server_round, {**config, NEED_BASIS_KEY: ",".join(self.missing_bases())}, grid)

    def check_basis(self, u: np.ndarray) -> str | None:
        """Why an uploaded basis is unusable, or None."""
        if u.ndim != 2 or u.shape[1] < 1 or u.shape[0] < u.shape[1]:
            return f"basis must be a (d, p) matrix with 1 <= p <= d, got shape {u.shape}"
        if u.shape[1] != self.options.basis_rank:
            return f"basis has rank {u.shape[1]}, strategy.basis_rank is {self.options.basis_rank}"
        expected = self.basis_dim
        if expected is None and self.bases:
            expected = next(iter(self.bases.values())).shape[0]
        if expected is not None and u.shape[0] != expected:
            return f"basis has {u.shape[0]} rows, expected {expected}"
        if not np.all(np.isfinite(u)):
            return "basis contains NaN or Inf"
        err = float(np.max(np.abs(u.T.astype(np.float64) @ u - np.eye(u.shape[1]))))
        if err > 1e-4:
            return f"basis columns are not orthonormal (max |U^T U - I| = {err:.2e})"
        return None

    def _receive_basis(self, update: ClientUpdate) -> str | None:
        """Keep the basis ``update`` carries, if any; why it was ignored, or None."""
        record = update.extra.get(BASIS_RECORD)
        if not record:
            return None
        if set(record) != {BASIS_ARRAY}:
            reason = f"basis record must hold exactly one array {BASIS_ARRAY!r}, got {sorted(record)}"
        else:
            u = np.asarray(record[BASIS_ARRAY], dtype=np.float64)
            reason = self.check_basis(u)
        if reason is not None:
            log(WARNING, "FEDORA: ignored the basis of client %s: %s", update.client_id, reason)
            return reason
        if self.w is None or update.client_id not in self.bases:   # the graph is fixed once built
            self.bases[update.client_id] = u
        return None

    def build_graph(self) -> None:
        """W from all K bases (paper or code form), saved and plotted in the run folder."""
        bases = [self.bases[c] for c in self.client_ids]
        o = self.options
        self.w = subspace_similarity(bases, form=o.similarity, top_k=o.top_k,
                                     temperature=o.temperature, self_loops=o.self_loops)
        self.cosine_sum = subspace_similarity(bases, form="paper", self_loops=True)
        log(INFO, "FEDORA: similarity graph of %d clients built (%s form, top_k=%s)",
            len(bases), o.similarity, o.top_k)
        self.save_similarity()

    def save_similarity(self) -> None:
        """Write ``similarity.npy`` (W used for propagation), ``similarity.json`` (both
        matrices with client ids and settings) and the heat map ``similarity.png``."""
        run_dir = self.run.run_dir
        if run_dir is None or self.w is None or self.cosine_sum is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        np.save(run_dir / "similarity.npy", self.w)
        (run_dir / "similarity.json").write_text(json.dumps(self.similarity_report(), indent=1))
        try:
            plot_similarity(run_dir / "similarity.png", self.cosine_sum, self.w, self.client_ids,
                            self.options.similarity)
        except Exception as err:  # a plot must never stop the run
            log(WARNING, "FEDORA: could not plot the similarity matrix: %s", err)

    def similarity_report(self) -> dict[str, Any]:
        assert self.w is not None and self.cosine_sum is not None
        return {
            "clients": list(self.client_ids),
            "form": self.options.similarity,
            "top_k": self.options.top_k,
            "temperature": self.options.temperature,
            "basis_rank": self.options.basis_rank,
            "basis_labels": self.options.basis_labels,
            "alpha": self.options.alpha,
            "cosine_sum": self.cosine_sum.tolist(),
            "w": self.w.tolist(),
        }

    # ------------------------------------------------------------------ aggregation
    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> RoundNotes:
        """Store uploads and bases; build W once all bases are known; propagate. Returns the
        round's notes: bases ignored and why, each client's lambda, whether it propagated."""
        notes: dict[str, Any] = {}
        for u in updates:
            if (reason := self._receive_basis(u)) is not None:
                notes.setdefault("basis_rejected", {})[u.client_id] = reason
            self.theta[u.client_id] = {k: np.asarray(v) for k, v in u.arrays.items()}
        notes["lambda"] = {u.client_id: u.metrics["lambda"] for u in updates if "lambda" in u.metrics}
        missing = self.missing_bases()
        if self.w is None and not missing:
            self.build_graph()
        if self.w is None:
            for u in updates:
                self.personal[u.client_id] = dict(self.theta[u.client_id])
            notes.update(propagated=False, missing_bases=missing)
            log(INFO, "FEDORA: %d of %d client bases still missing (%s); no propagation yet, "
                "clients get their own parameters back", len(missing), len(self.client_ids),
                ", ".join(missing[:8]))
        else:
            self.propagate_all()
            notes["propagated"] = True
        return {"fedora": {**notes, "bases_known": len(self.bases)}}

    def propagate_all(self) -> None:
        """theta_hat = propagation of every client's latest theta (floating tensors)."""
        assert self.w is not None
        ids = self.client_ids
        rows = [self.theta.get(c, self.global_arrays) for c in ids]
        keys = [k for k in self.reference if np.issubdtype(self.reference[k].dtype, np.floating)
                and all(k in r for r in rows)]
        out = propagate_clients(rows, keys, self.w, self.options.alpha, isolated="keep")
        for i, cid in enumerate(ids):
            own = self.theta.get(cid, self.global_arrays)
            self.personal[cid] = {**{k: v for k, v in own.items() if k not in out[i]}, **out[i]}
        log(INFO, "FEDORA: propagated %d tensors over %d clients (alpha=%g)", len(keys), len(ids),
            self.options.alpha)

    # ------------------------------------------------------------------ records
    def summary_extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fedora": {
            "options": dataclasses.asdict(self.options),
            "bases_known": len(self.bases),
            "graph_built": self.w is not None,
        }}
        if self.w is not None:
            out["fedora"]["similarity_file"] = "similarity.json"
            out["fedora"]["neighbours"] = {
                cid: [self.client_ids[j] for j in np.argsort(-self.w[i], kind="stable")
                      if self.w[i, j] > 0][:3]
                for i, cid in enumerate(self.client_ids)}
        return out

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> tuple[dict[str, NDArrays], dict[str, Any]]:
        groups, meta = super().state()
        for cid, arrays in self.theta.items():
            groups[_THETA_GROUP + cid] = dict(arrays)
        for cid, u in self.bases.items():
            groups[_BASIS_GROUP + cid] = {BASIS_ARRAY: u}
        if self.w is not None and self.cosine_sum is not None:
            groups[_GRAPH_GROUP] = {"w": self.w, "cosine_sum": self.cosine_sum}
        return groups, meta

    def load_state(self, groups: Mapping[str, NDArrays], meta: Mapping[str, Any]) -> None:
        super().load_state(groups, meta)
        self.theta = {k[len(_THETA_GROUP):]: dict(v) for k, v in groups.items()
                      if k.startswith(_THETA_GROUP)}
        self.bases = {k[len(_BASIS_GROUP):]: np.asarray(v[BASIS_ARRAY]) for k, v in groups.items()
                      if k.startswith(_BASIS_GROUP)}
        graph = groups.get(_GRAPH_GROUP)
        self.w = np.asarray(graph["w"]) if graph else None
        self.cosine_sum = np.asarray(graph["cosine_sum"]) if graph else None


def plot_similarity(path: Path, cosine_sum: np.ndarray, w: np.ndarray, labels: list[str],
                    form: str) -> None:
    """Heat maps of the summed principal cosines and of the propagation graph W."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num = len(labels)
    size = inches(num, 0.25, 4.0) / 2
    fig, axes = plt.subplots(1, 2, figsize=(2 * size + 2, size))
    for ax, mat, title in ((axes[0], cosine_sum, "sum of principal-angle cosines"),
                           (axes[1], w, f"propagation graph W ({form} form)")):
        im = ax.imshow(mat, cmap="viridis")
        ax.set_title(title)
        step = tick_step(num, 18)
        ticks = list(range(0, num, step))
        ax.set_xticks(ticks, [labels[i] for i in ticks])
        ax.set_yticks(ticks, [labels[i] for i in ticks])
        ax.set_xlabel("client")
        ax.set_ylabel("client")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
