"""FedBasis server (Chen et al., arXiv 2304.07882): average each basis over the clients.

The global state is the basis model's shared tensors (``learning/basis.py``): the major
basis ``major.*`` and K bases ``bases.<k>.*``; the clients' coefficient logits never
leave them. The round, per Alg. 1 and Sec. 4.4:

* warm-up, rounds 1..W with W = floor(warm_fraction x rounds): FedAvg of one model, sent
  and received as the major basis (basis 0 without a major basis);
* at the end of round W the FedAvg model stays the major basis and the K bases are seeded
  from the clients' local models of that round (``seed_bases``: their K-means centroids,
  or K of them sampled; :func:`strategies.fedbasis_math.seed_bases`), logged as the switch;
* later rounds: every basis (and the major one) is averaged over the clients of the round,
  v_k <- sum_m n_m v_k^m / sum_m n_m (FedAvg per basis: the base class' rule).

Recorded per round (``metrics.jsonl`` ``fedbasis``): the mean pairwise cosine similarity
between the bases and the mean entropy of the clients' learned coefficients (the collapse
diagnostics of Sec. 4.2), and every client's coefficients per unit; ``basis_diagnostics.png``
plots the first two, ``coefficients.png`` the last (the paper's Figure 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from flwr.common.logger import log

from common.figures import inches, tick_step
from common.protocol import client_sort_key
from learning.basis import COEFF_KEY, MAJOR_PREFIX, basis_prefix
from learning.params import NDArrays
from strategies.base import (
    ClientUpdate,
    PersonalizedStrategy,
    RoundNotes,
    TrainRound,
    client_labels,
)
from strategies.fedbasis_math import (
    COEFF_METRIC,
    FedBasisOptions,
    flatten,
    mean_entropy,
    mean_pairwise_cosine,
    seed_bases,
)


class FedBasis(PersonalizedStrategy):
    """FedBasis (see the module docstring)."""

    options: FedBasisOptions
    # the warm-up's end and, by round, the coefficients and diagnostics (the summary's plots)
    carried_state: ClassVar[tuple[str, ...]] = (*PersonalizedStrategy.carried_state, "seeded", "switch",
                                                "coefficients", "diagnostics")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.global_arrays.pop(COEFF_KEY, None)              # the clients' own, never sent
        self.warm_rounds = int(self.options.warm_fraction * self.run.rounds)
        self.seeded = self.warm_rounds == 0
        self.switch: dict[str, Any] = {}
        self.coefficients: dict[int, dict[str, dict[str, list[float]]]] = {}   # round -> client -> unit -> alpha
        self.diagnostics: dict[int, dict[str, float]] = {}
        template = getattr(self.model, "template", None)
        self.param_keys = [k for k, _ in template.named_parameters()] if template is not None else []
        if self.seeded:
            self._record_diagnostics(0, [])

    @property
    def warm_prefix(self) -> str:
        return MAJOR_PREFIX if self.options.major else basis_prefix(0)

    def payload_for(self, client_id: str | None) -> NDArrays:
        """All bases; during the warm-up only the FedAvg model (one model down, not K+1)."""
        if self.seeded:
            return dict(self.global_arrays)
        return {k: v for k, v in self.global_arrays.items() if k.startswith(self.warm_prefix)}

    def streams_round(self, server_round: int, sent: Mapping[str, NDArrays]) -> bool:
        """Per-basis FedAvg (and the warm-up's FedAvg) folds as replies arrive; the round that
        seeds the bases needs every client's model at once (K-means)."""
        seeding = not self.seeded and server_round >= self.warm_rounds
        return not seeding and super().streams_round(server_round, sent)

    def check_upload(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        if self.seeded:
            return super().check_upload(arrays)
        expected = {k for k in self.global_arrays if k.startswith(self.warm_prefix)}
        if set(arrays) != expected:
            return f"a warm-up upload holds exactly the {self.warm_prefix}* tensors, got {sorted(arrays)[:3]}"
        return None

    # ------------------------------------------------------------------ aggregation
    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> RoundNotes:
        super().aggregate_updates(train, updates)          # FedAvg per basis
        server_round = train.server_round
        if not self.seeded:
            if server_round >= self.warm_rounds:
                self.seed_from(server_round, updates)
        else:
            self.coefficients[server_round] = {u.client_id: client_coefficients(u.metrics) for u in updates}
            self._record_diagnostics(server_round, updates)
        # coefficients and diagnostics by round are carried (the summary's plots and latest values)
        return {"fedbasis": {"phase": "bases" if self.seeded else "warm-up",
                             **self.diagnostics.get(server_round, {}),
                             "coefficients": self.coefficients.get(server_round, {})}}

    def seed_from(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """End of the warm-up: the K bases from the clients' models of this round."""
        n = len(self.warm_prefix)
        models = [{k[n:]: v for k, v in u.arrays.items()} for u in updates]
        k = self.options.num_bases
        bases, assignment = seed_bases(models, k, self.options.seed_bases, seed=self.run.seed)
        for j, basis in enumerate(bases):
            self.global_arrays.update({basis_prefix(j) + key: v for key, v in basis.items()})
        self.seeded = True
        self.switch = {"round": server_round, "seed_bases": self.options.seed_bases,
                       "assignment": {u.client_id: a for u, a in zip(updates, assignment, strict=False)}}
        if len(models) < k:
            log(WARNING, "fedbasis: only %d client models for %d bases; some bases start equal", len(models), k)
        log(INFO, "fedbasis: warm-up (FedAvg) ended after round %d; %s = FedAvg model, %d bases seeded "
            "by %s from %d client models (%s)", server_round, "major basis" if self.options.major else "-",
            k, self.options.seed_bases, len(models), self.switch["assignment"])
        self._record_diagnostics(server_round, [])

    def _record_diagnostics(self, server_round: int, updates: list[ClientUpdate]) -> None:
        vectors = [flatten({k[len(basis_prefix(j)):]: v for k, v in self.global_arrays.items()
                            if k.startswith(basis_prefix(j))}, self.param_keys)
                   for j in range(self.options.num_bases)]
        diag = {"basis_cosine": mean_pairwise_cosine(vectors)}
        coeffs = [np.array(list(c.values())) for c in self.coefficients.get(server_round, {}).values() if c]
        if coeffs:
            diag["coeff_entropy"] = mean_entropy(np.stack(coeffs))
        self.diagnostics[server_round] = diag
        log(INFO, "fedbasis: round %d, mean pairwise cosine of the bases %.4f, mean coefficient entropy %s "
            "(uniform = %.3f)", server_round, diag["basis_cosine"],
            f"{diag['coeff_entropy']:.4f}" if "coeff_entropy" in diag else "-", np.log(self.options.num_bases))

    # ------------------------------------------------------------------ records
    def latest_coefficients(self) -> dict[str, dict[str, list[float]]]:
        out: dict[str, dict[str, list[float]]] = {}
        for server_round in sorted(self.coefficients):
            out.update(self.coefficients[server_round])
        return out

    def summary_extras(self) -> dict[str, Any]:
        run_dir = self.run.run_dir
        if run_dir is not None:
            try:
                if self.diagnostics:
                    plot_diagnostics(run_dir / "basis_diagnostics.png", self.diagnostics, self.warm_rounds,
                                     float(np.log(self.options.num_bases)))
                if self.coefficients:
                    plot_coefficients(run_dir / "coefficients.png", self.latest_coefficients(),
                                      client_labels(self.data, prefix=""), self.options.major)
            except Exception as err:  # a plot must never stop the run
                log(WARNING, "fedbasis: could not plot: %s", err)
        last = self.diagnostics[max(self.diagnostics)] if self.diagnostics else {}
        return {"fedbasis_coefficients": self.latest_coefficients(), "fedbasis_warm_rounds": self.warm_rounds,
                "fedbasis_switch": self.switch, "fedbasis_basis_cosine": last.get("basis_cosine"),
                "fedbasis_coeff_entropy": last.get("coeff_entropy")}

    def state(self) -> tuple[dict[str, NDArrays], dict[str, Any]]:
        groups, meta = super().state()
        return groups, {**meta, "seeded": self.seeded, "switch": self.switch,
                        "coefficients": {str(r): v for r, v in self.coefficients.items()},
                        "diagnostics": {str(r): v for r, v in self.diagnostics.items()}}

    def load_state(self, groups: Mapping[str, NDArrays], meta: Mapping[str, Any]) -> None:
        super().load_state(groups, meta)
        self.seeded = bool(meta.get("seeded", self.seeded))
        self.switch = dict(meta.get("switch", {}))
        self.coefficients = {int(r): v for r, v in meta.get("coefficients", {}).items()}
        self.diagnostics = {int(r): v for r, v in meta.get("diagnostics", {}).items()}


def client_coefficients(metrics: Mapping[str, float]) -> dict[str, list[float]]:
    """``{unit: [alpha_1..alpha_K]}`` from a reply's ``coeff/<unit>/<k>`` metrics."""
    out: dict[str, dict[int, float]] = {}
    for key, v in metrics.items():
        if key.startswith(COEFF_METRIC):
            unit, k = key[len(COEFF_METRIC):].rsplit("/", 1)
            out.setdefault(unit, {})[int(k)] = float(v)
    return {u: [ks[i] for i in sorted(ks)] for u, ks in out.items()}


def plot_diagnostics(path: Path, diagnostics: Mapping[int, Mapping[str, float]], warm_rounds: int,
                     uniform_entropy: float) -> None:
    """Bases' mean pairwise cosine similarity and the coefficients' mean entropy per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = sorted(diagnostics)
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.plot(rounds, [diagnostics[r].get("basis_cosine", np.nan) for r in rounds], marker=".")
    a.set_title("bases: mean pairwise cosine")
    ent = [(r, diagnostics[r]["coeff_entropy"]) for r in rounds if "coeff_entropy" in diagnostics[r]]
    if ent:
        b.plot(*zip(*ent, strict=True), marker=".")
    b.axhline(uniform_entropy, ls="--", c="gray", label="uniform")
    b.set_title("coefficients: mean entropy (nats)")
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.set_xlabel("round")
        if warm_rounds:
            ax.axvline(warm_rounds, ls=":", c="k")
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_coefficients(path: Path, coefficients: Mapping[str, Mapping[str, list[float]]],
                      labels: Mapping[str, str], major: bool) -> None:
    """FedBasis' Figure 4: each client's learned coefficients, one panel per unit (rows =
    clients, columns = bases; the major basis, when used, always weighs 1/2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    clients = sorted(coefficients, key=client_sort_key)
    units = list(dict.fromkeys(u for c in clients for u in coefficients[c]))
    fig, axes = plt.subplots(1, len(units), figsize=(2.0 * len(units) + 1.5, inches(len(clients), 0.35, 0.0) + 1.5),
                             squeeze=False, sharey=True)
    for ax, unit in zip(axes[0], units, strict=True):
        grid = np.array([coefficients[c].get(unit, []) for c in clients])
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(unit)
        ax.set_xticks(range(grid.shape[1]), [str(k + 1) for k in range(grid.shape[1])])
        ax.set_xlabel("basis")
    step = tick_step(len(clients))
    axes[0][0].set_yticks(range(0, len(clients), step), [labels.get(c, c) for c in clients[::step]], fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8,
                 label="coefficient" + (" (major basis: 1/2 fixed)" if major else ""))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
