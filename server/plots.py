"""A finished run's figures: ``accuracy.png`` (mean and worst client over rounds) and
``clients.png`` (each client)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.figures import inches, tick_step
from server.summary import bn_label, evaluated_rounds


def accuracy_lines(evals: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The accuracy series to draw: personalised, and the global model's when it differs
    (for FedAvg they are the same model: one line, labelled so, instead of two on top of
    each other)."""
    ev = evals[-1]["evaluate"]
    if "global_accuracy_mean" not in ev:
        return [("accuracy", "personalised")]
    same = all(r["evaluate"].get("global_accuracy_mean") == r["evaluate"]["accuracy_mean"]
               and r["evaluate"].get("global_accuracy_min") == r["evaluate"]["accuracy_min"] for r in evals)
    if same:
        return [("accuracy", "personalised = global model")]
    return [("accuracy", "personalised"), ("global_accuracy", "global model")]


def plot_run(run_dir: Path, rounds: list[dict[str, Any]], summary: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    evals = evaluated_rounds(rounds)
    xs = [r["round"] for r in evals]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in accuracy_lines(evals):
        ax.plot(xs, [r["evaluate"][f"{key}_mean"] for r in evals], marker=".", label=f"{label} (mean)")
        ax.plot(xs, [r["evaluate"][f"{key}_min"] for r in evals], "--", label=f"{label} (min)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy over clients")
    ax.set_title(f"{summary['strategy']} on {summary['dataset']} (seed {summary['seed']})\n"
                 f"BN statistics: {bn_label(summary)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy.png", dpi=100)
    plt.close(fig)

    clients = summary["clients"]
    domains = sorted({str(c.get("domain", "")) for c in clients.values()})
    colours = {d: f"C{i % 10}" for i, d in enumerate(domains)}
    fig, ax = plt.subplots(figsize=(inches(len(clients), 0.6, 6.0), 4))
    bars = ax.bar(range(len(clients)), [c["accuracy"] for c in clients.values()],
                  color=[colours[str(c.get("domain", ""))] for c in clients.values()])
    step = tick_step(len(clients))
    ax.set_xticks(range(0, len(clients), step), [f"{cid}\n{c.get('domain', '')}" for cid, c in
                                                 list(clients.items())[::step]], fontsize=7)
    if len(domains) > 1:
        seen: set[str] = set()
        handles = [(b, str(c.get("domain"))) for b, c in zip(bars, clients.values(), strict=True)
                   if str(c.get("domain")) not in seen and not seen.add(str(c.get("domain")))]
        ax.legend([h for h, _ in handles], [d for _, d in handles], title="domain", fontsize=7)
    ax.set_xlabel("client (domain)")
    ax.set_ylabel("final personalised test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"{summary['strategy']}: mean {summary['accuracy_mean']:.3f}, min {summary['accuracy_min']:.3f} "
                 f"(BN statistics: {bn_label(summary)})", fontsize=9)
    fig.tight_layout()
    fig.savefig(run_dir / "clients.png", dpi=100)
    plt.close(fig)

    if "finetune_curve" in summary:
        curve = summary["finetune_curve"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([int(k) for k in curve], list(curve.values()), "o-")
        ax.set_xlabel("fine-tune epochs")
        ax.set_ylabel("mean test accuracy")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(run_dir / "finetune_curve.png", dpi=100)
        plt.close(fig)
