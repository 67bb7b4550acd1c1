"""PartialFed server (Sun et al., NeurIPS 2021): FedAvg over what the clients return.

PartialFed's idea lives on the client (``client/partialfed.py``): which parameters a client
loads from the global model. The server averages the clients' returned models
(sample-weighted FedAvg, ``strategy.weighted``) and, for the Adaptive variant, records
every client's probability of loading global per unit and round (the reply metrics
``p_global/<unit>``): in ``metrics.jsonl`` (``partialfed.p_global``), in ``summary.json``
(the last value per client and unit) and as the paper's Figure 3 (``gates.png``: one
panel per unit, one line per client).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar

from flwr.common.logger import log

from common.protocol import client_sort_key
from learning.params import NDArrays
from strategies.base import (
    ClientUpdate,
    PersonalizedStrategy,
    RoundNotes,
    TrainRound,
    client_labels,
)
from strategies.partialfed_math import P_GLOBAL_METRIC as P_GLOBAL


class PartialFedFix(PersonalizedStrategy):
    """PartialFed-Fix: FedAvg's server rule; each client loads part of the global model."""



class PartialFedAdaptive(PersonalizedStrategy):
    """PartialFed-Adaptive: FedAvg's server rule; records the clients' learned gates."""

    # the gates by round (the summary's plot and each client's latest gates)
    carried_state: ClassVar[tuple[str, ...]] = (*PersonalizedStrategy.carried_state, "gate_history")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate_history: dict[int, dict[str, dict[str, float]]] = {}   # round -> client -> unit -> p

    def aggregate_updates(self, train: TrainRound, updates: list[ClientUpdate]) -> RoundNotes:
        super().aggregate_updates(train, updates)
        gates = {u.client_id: {k[len(P_GLOBAL):]: v for k, v in u.metrics.items() if k.startswith(P_GLOBAL)}
                 for u in updates}
        self.gate_history[train.server_round] = gates     # carried: the summary's plot and latest gates
        log(INFO, "partialfed: gates of %d clients recorded", len(updates))
        return {"partialfed": {"p_global": gates}}

    def latest_gates(self) -> dict[str, dict[str, float]]:
        """Each client's most recent probabilities of loading global, per unit."""
        out: dict[str, dict[str, float]] = {}
        for server_round in sorted(self.gate_history):
            out.update(self.gate_history[server_round])
        return out

    def summary_extras(self) -> dict[str, Any]:
        run_dir = self.run.run_dir
        if run_dir is not None and self.gate_history:
            try:
                plot_gates(run_dir / "gates.png", self.gate_history, client_labels(self.data))
            except Exception as err:  # a plot must never stop the run
                log(WARNING, "partialfed: could not plot the gates: %s", err)
        return {"partialfed_p_global": self.latest_gates()}

    def state(self) -> tuple[dict[str, NDArrays], dict[str, Any]]:
        groups, meta = super().state()
        return groups, {**meta, "gate_history": {str(r): v for r, v in self.gate_history.items()}}

    def load_state(self, groups: Mapping[str, NDArrays], meta: Mapping[str, Any]) -> None:
        super().load_state(groups, meta)
        self.gate_history = {int(r): v for r, v in meta.get("gate_history", {}).items()}


def plot_gates(path: Path, history: Mapping[int, Mapping[str, Mapping[str, float]]],
               labels: Mapping[str, str] | None = None) -> None:
    """PartialFed's Figure 3: probability of loading global vs round, a panel per unit and a
    line per client."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = sorted(history)
    units = list(dict.fromkeys(u for r in rounds for c in history[r].values() for u in c))
    clients = sorted({c for r in rounds for c in history[r]}, key=client_sort_key)
    cols = min(len(units), 5)
    rows = (len(units) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharey=True)
    for ax, unit in zip(axes.flat, units, strict=False):
        for cid in clients:
            pts = [(r, history[r][cid][unit]) for r in rounds if unit in history[r].get(cid, {})]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=(labels or {}).get(cid, f"client {cid}"))
        ax.set_title(unit)
        ax.set_ylim(0, 1)
        ax.set_xlabel("round")
    for ax in list(axes.flat)[len(units):]:
        ax.axis("off")
    axes[0][0].set_ylabel("P(load global)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
