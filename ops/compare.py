"""Compare run folders: one Markdown table (mean ± std over seeds) and one plot.

Runs fall in one row when their composed configurations (``config.yaml``) differ in nothing but
their seeds (``SEED_KEYS``) and where the run goes (``WHERE_KEYS``); runs without a config.yaml are grouped by
(strategy, dataset, model). Where one strategy has several rows, each is labelled by the keys
that set it apart, e.g. ``ditto (strategy.lam=0.01)``; a second run of a seed in one row is left
out and named under the table. Each row gives the mean and
standard deviation over its seeds of the final personalised accuracy (mean over
clients and worst client), the global model's accuracy where there is one, and the
best-by-validation round's accuracy. If a ``local`` run with the same dataset, seed and
clients is present (the same model preferred, any model otherwise: R-Acc compares each
client with what it reaches alone, whatever the method's model), FEDORA's relative accuracy (R-Acc: mean over clients of
(acc - acc_local) / acc_local, so 0 = as good as Local) and positive transfer ratio (PTR:
share of clients whose accuracy beats Local's) are added, computed per seed and client
against the Local run with the same seed, at the final round and (when every summary records
it) at each run's best-validation round, as FEDORA's authors report them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from common.config import with_added_groups
from common.settings import BN_PROTOCOLS
from server.run_folder import CONFIG_FILE, WHERE_KEYS
from server.summary import bn_label

COLUMNS = (
    ("accuracy_mean", "acc mean"),
    ("accuracy_min", "acc min"),
    ("global_accuracy_mean", "global acc"),
    ("best_accuracy_mean", "acc @ best val round"),
)


BN_COLUMNS = (("accuracy_mean", "acc mean"), ("accuracy_min", "acc min"),
              ("best_accuracy_mean", "acc @ best val round"))


def machines(runs: list[dict[str, Any]]) -> str:
    """The machines the runs' numbers came from (GPU, else CPU model and the instruction set
    torch used on it, when the summary records it; torch version)."""
    names = {f"{m.get('gpu') or _cpu_text(m)}, torch {m.get('torch', '?')}"
             for r in runs if (m := r.get("machine"))}
    return "; ".join(sorted(names)) or "-"


def _cpu_text(machine: Mapping[str, Any]) -> str:
    cpu = str(machine.get("cpu", "?"))
    return f"{cpu} ({machine['cpu_capability']})" if machine.get("cpu_capability") else cpu


def load_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no summary.json (did the run finish?)")
    data = json.loads(path.read_text())
    data["_dir"] = str(run_dir)
    data["_config"] = configuration(run_dir)
    return data


# the seeds a row's runs differ in: the run's, and the key of its DP noise (docs/privacy.md)
SEED_KEYS = ("seed", "privacy.noise_seed")


def configuration(run_dir: Path) -> dict[str, str]:
    """The run's composed configuration as dotted key -> value (JSON text), without its seeds
    (:data:`SEED_KEYS`) and
    the keys that say where it goes (``WHERE_KEYS``); {} when the folder has no config.yaml."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return {}
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = json.dumps(node, sort_keys=True)

    try:
        loaded = yaml.safe_load(path.read_text()) or {}
        walk(with_added_groups(loaded) if isinstance(loaded, dict) else loaded, "")   # groups it predates: off
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not a readable config ({err}); copy it again from the run, or remove "
                         "it to group this run by strategy, dataset and model") from None
    return {k: v for k, v in flat.items() if k not in (*WHERE_KEYS, *SEED_KEYS)}


Row = tuple[str, str, str]   # (label, dataset, model)


def rows_by_configuration(runs: list[dict[str, Any]]) -> tuple[dict[Row, list[dict[str, Any]]], list[str]]:
    """Runs grouped into rows: one row per composed configuration (seed and ``WHERE_KEYS``
    aside), labelled by its strategy and, where that strategy has several rows on the same
    dataset and model, the keys that set this one apart (``ditto (strategy.lam=0.01)``). A
    row keeps one run per seed (the first by folder name); the others are returned as notes."""
    by_config: dict[tuple[str, str, str, frozenset[tuple[str, str]]], list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: Path(r["_dir"]).name):
        by_config[(r["strategy"], r["dataset"], r.get("model", ""), frozenset(r["_config"].items()))].append(r)
    siblings: dict[Row, list[dict[str, str]]] = defaultdict(list)
    for strategy, dataset, model, config in by_config:
        siblings[(strategy, dataset, model)].append(dict(config))
    rows: dict[Row, list[dict[str, Any]]] = {}
    notes: list[str] = []
    for (strategy, dataset, model, config), members in by_config.items():
        label = strategy
        others = siblings[(strategy, dataset, model)]
        if len(others) > 1:
            keys = sorted(k for k in set().union(*others) if len({o.get(k) for o in others}) > 1)
            mine = dict(config)
            keys = [k for k in keys if not _inert_privacy_key(k, mine)]
            label += " (" + ", ".join(f"{k}={_value_text(mine.get(k))}" for k in keys) + ")"
        kept: dict[int, dict[str, Any]] = {}
        for r in members:
            if r["seed"] in kept:
                notes.append(f"Left out of `{label}`: {Path(r['_dir']).name} (acc mean {r['accuracy_mean']:.4f}), "
                             f"a second run of seed {r['seed']}; the row has {Path(kept[r['seed']]['_dir']).name}.")
            else:
                kept[r["seed"]] = r
        rows[(label, dataset, model)] = sorted(kept.values(), key=lambda r: r["seed"])
    return rows, notes


def _value_text(value: str | None) -> str:
    if value is None:
        return "(unset)"
    loaded = json.loads(value)
    return loaded if isinstance(loaded, str) else json.dumps(loaded)


def client_accuracies(run: Mapping[str, Any], at: str = "final") -> dict[str, float]:
    """Per-client test accuracy of a run at its final round (``at="final"``) or at its
    best-validation round (``at="best"``; summaries written before that was recorded have
    none: {})."""
    if at == "best":
        if "best_clients" in run:
            return {c: float(a) for c, a in run["best_clients"].items()}
        return _best_round_from_metrics(run)
    return {c: float(m["accuracy"]) for c, m in run["clients"].items()}


def _best_round_from_metrics(run: Mapping[str, Any]) -> dict[str, float]:
    """Per-client accuracy of the summary's best round read from the run's metrics.jsonl
    (for summaries written before ``best_clients`` was recorded); {} if not there."""
    path = Path(str(run.get("_dir", ""))) / "metrics.jsonl"
    if "best_round" not in run or not path.exists():
        return {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("round") == run["best_round"] and rec.get("clients"):
            return {c: float(m["accuracy"]) for c, m in rec["clients"].items()}
    return {}


def relative_to_local(run: Mapping[str, Any], local: Mapping[str, Any], at: str = "final") -> tuple[float, float]:
    """(R-Acc, PTR) of one run against the Local run of the same seed and splits (FEDORA,
    KDD 2023): R-Acc = mean_k (acc_k - acc_k^local) / acc_k^local, PTR = mean_k
    [acc_k > acc_k^local]; both runs at their final round, or (``at="best"``) each at its
    best-validation round, as FEDORA's authors report."""
    mine, theirs = client_accuracies(run, at), client_accuracies(local, at)
    common = sorted(set(mine) & set(theirs))
    if not common:
        raise ValueError(f"runs {run['_dir']} and {local['_dir']} share no clients"
                         + (" with best-round accuracies" if at == "best" else ""))
    ratios, wins = [], []
    for cid in common:
        a, b = mine[cid], theirs[cid]
        ratios.append((a - b) / b if b > 0 else (0.0 if a == 0 else float("inf")))
        wins.append(a > b)
    return float(np.mean(ratios)), float(np.mean(wins))


def matching_local(run: Mapping[str, Any], local_runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Local run to measure ``run`` against: same dataset, seed and client ids; one with
    the same model if there is one."""
    same = [r for r in local_runs if r["dataset"] == run["dataset"] and r["seed"] == run["seed"]
            and set(run["clients"]) <= set(r["clients"])]
    same.sort(key=lambda r: r.get("model", "") != run.get("model", ""))
    return same[0] if same else None


RELATIVE_LEGEND = ("R-Acc: mean over clients of (acc - acc of that client's Local run) / acc of its "
                   "Local run, so 0 = as good as training alone; PTR: share of clients whose accuracy beats "
                   "their Local run's (FEDORA, KDD 2023; the Local run of the same seed).")


# the privacy keys that do something only with DP on, and only with secure aggregation on
DP_KEYS = ("privacy.clip_norm", "privacy.noise_multiplier", "privacy.delta", "privacy.max_epsilon",
           "privacy.noise_seed")


def _inert_privacy_key(key: str, config: dict[str, str]) -> bool:
    """A privacy key that changes nothing in a run of ``config`` (not a label's difference):
    a DP key with ``privacy.dp=none``, a ``privacy.secagg_*`` key without secure aggregation."""
    if key in DP_KEYS:
        return config.get("privacy.dp") == json.dumps("none")
    if key.startswith("privacy.secagg_"):
        return config.get("privacy.secure_aggregation", json.dumps("none")) == json.dumps("none")
    return False


def privacy_text(runs: list[dict[str, Any]]) -> str:
    """The spent epsilon at its delta of a row's runs (summary.json's ``privacy``): "none"
    without differential privacy; each distinct value once."""
    spent = sorted({(round(float(r["privacy"]["epsilon"]), 4), float(r["privacy"]["delta"]))
                    for r in runs if "privacy" in r})
    records = sorted({(round(float(r["record_dp"]["epsilon_max"]), 4), float(r["record_dp"]["delta"]))
                      for r in runs if "record_dp" in r})
    texts = [f"{eps:.4g} ({delta:g})" for eps, delta in spent]
    texts += [f"record {eps:.4g} ({delta:g})" for eps, delta in records]     # DP-SGD: the largest client's
    return ", ".join(texts) if texts else "none"


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    arr = np.asarray(values, dtype=np.float64)
    if len(arr) == 1:
        return f"{arr[0]:.4f}"
    return f"{arr.mean():.4f} ± {arr.std():.4f}"


def compare_runs(run_dirs: list[Path], out: Path | None = None, plot: Path | None = None) -> str:
    groups, left_out = rows_by_configuration([load_summary(d) for d in run_dirs])
    runs = [r for members in groups.values() for r in members]
    local_runs = [r for r in runs if r["strategy"] == "local"]
    show_rel = bool(local_runs)
    header = ["strategy", "dataset", "model", "seeds", *[c[1] for c in COLUMNS]]
    show_best_rel = show_rel and all(client_accuracies(r, "best") for r in runs)
    show_bn = any("bn_protocols" in r for r in runs)
    show_dp = any("privacy" in r or "record_dp" in r for r in runs)
    header += ["acc mean by seed", "machine"]
    if show_dp:
        header += ["DP epsilon (delta)"]
    if show_bn:
        header += ["BN stats", *[f"{label} ({p} BN)" for p in BN_PROTOCOLS for _, label in BN_COLUMNS]]
    if show_rel:
        header += ["R-Acc", "PTR"]
    if show_best_rel:
        header += ["R-Acc @ best val", "PTR @ best val"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows_for_plot = []
    for (strategy, dataset, model), members in sorted(groups.items()):
        cells = [strategy, dataset, model, ",".join(str(r["seed"]) for r in members)]
        for key, _ in COLUMNS:
            cells.append(_fmt([r[key] for r in members if key in r]))
        cells += [", ".join(f"{r['accuracy_mean']:.4f}" for r in members), machines(members)]
        if show_dp:
            cells.append(privacy_text(members))
        if show_bn:
            cells.append(", ".join(sorted({bn_label(r) for r in members})))
            for protocol in BN_PROTOCOLS:
                for key, _ in BN_COLUMNS:
                    cells.append(_fmt([r["bn_protocols"][protocol][key] for r in members
                                       if protocol in r.get("bn_protocols", {})]))
        if show_rel:
            rel = [relative_to_local(r, local) for r in members
                   if (local := matching_local(r, local_runs)) is not None]
            cells += [_fmt([x[0] for x in rel]), _fmt([x[1] for x in rel])]
        if show_best_rel:
            rel = [relative_to_local(r, local, at="best") for r in members
                   if (local := matching_local(r, local_runs)) is not None]
            cells += [_fmt([x[0] for x in rel]), _fmt([x[1] for x in rel])]
        lines.append("| " + " | ".join(cells) + " |")
        accs = [r["accuracy_mean"] for r in members]
        rows_for_plot.append((f"{strategy}\n{dataset}", float(np.mean(accs)), float(np.std(accs))))
    if show_rel:
        lines += ["", RELATIVE_LEGEND + (" The `@ best val` columns take each run at its best-validation "
                                         "round." if show_best_rel else "")]
    if left_out:
        lines += [""] + left_out
    text = "\n".join(lines)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    if plot is not None:
        _plot(rows_for_plot, plot)
    return text


def _plot(rows: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 4))
    ax.bar([r[0] for r in rows], [r[1] for r in rows], yerr=[r[2] for r in rows], capsize=4)
    ax.set_ylabel("final personalised accuracy (mean over clients)")
    ax.set_ylim(0, 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_compare(args: argparse.Namespace) -> int:
    """``pflower compare RUN [RUN ...] [--out FILE] [--plot FILE]``."""
    return print_comparison([Path(p) for p in args.runs], args.out, args.plot)


def print_comparison(runs: list[Path], out: str = "", plot: str = "") -> int:
    """Print the runs' table (written to ``out`` and plotted to ``plot`` when given); 2 when
    they cannot be compared (the message says why)."""
    try:
        text = compare_runs(runs, out=Path(out) if out else None, plot=Path(plot) if plot else None)
    except (FileNotFoundError, ValueError) as err:
        print(f"pflower compare: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``pflower compare``."""
    p = sub.add_parser("compare", help="compare run folders in one table and plot: one row per configuration "
                                        "(seeds averaged), labelled by the keys that set it apart")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="", help="write the Markdown table here")
    p.add_argument("--plot", default="", help="write the comparison plot here (PNG)")
    p.set_defaults(func=cmd_compare)
