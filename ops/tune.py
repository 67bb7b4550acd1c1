"""``pflower tune``: every method's hyper-parameters chosen the same way, then its seeds.

Why: an ordering of methods at one shared learning rate says more about that learning rate
than about the methods. The FDSE paper tunes the learning rate of every method by grid
search, and FLGo-Bench reports that way: for each method, each value of a small grid is run
with one seed, the value with the best validation accuracy is kept, and the seeds are run at
it. Test accuracy never takes part in the choice.

    pflower tune experiment=fdse-digits strategy=fdse,fedavg,fedbn \\
        --grid train.lr=0.01,0.05,0.1 --grid fdse:strategy.lam=0.01,0.1,1 --seeds 0,1,2 --out table.md

``--grid [STRATEGY:]KEY=V1,V2,...`` is one axis (the prefix limits it to that strategy, for a
method's own keys); several axes are crossed. The validation score is the run's
``best_val_accuracy`` (``summary.json``; the round chosen by ``best_round_by``). Finished runs are
reused, as ``pflower sweep`` does. The choices go to ``<results_root>/tuning.json`` and the
table's head.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, compose_config, expand_grid, split_overrides


@dataclass(frozen=True)
class GridAxis:
    """One tuned key and its values; ``strategy`` limits it to one method (None: every one)."""

    key: str
    values: tuple[str, ...]
    strategy: str | None = None

    @classmethod
    def parse(cls, spec: str) -> GridAxis:
        """``[strategy:]key=v1,v2,...``"""
        head, eq, values = spec.partition("=")
        strategy, colon, key = head.rpartition(":")
        items = tuple(v for v in values.split(",") if v)
        if not eq or not key or not items:
            raise ConfigError(f"--grid {spec!r}: expected [STRATEGY:]KEY=V1,V2,... (e.g. train.lr=0.01,0.1 "
                              "or fedprox:strategy.mu=0.01,0.1)")
        return cls(key, items, strategy if colon else None)


def grid_for(strategy: str, axes: Sequence[GridAxis]) -> list[list[str]]:
    """Every combination of the axes that apply to ``strategy``, in grid order ([[]]: none)."""
    mine = [[f"{a.key}={v}" for v in a.values] for a in axes if a.strategy in (None, strategy)]
    return [list(c) for c in itertools.product(*mine)]


def select_best(scored: Sequence[tuple[list[str], float]]) -> tuple[list[str], float]:
    """The combination with the highest validation accuracy; a tie goes to the first in grid
    order (so the choice does not depend on floating-point noise in the order runs finish)."""
    if not scored:
        raise ValueError("nothing to choose from: every run of the grid failed")
    best = max(range(len(scored)), key=lambda i: (scored[i][1], -i))
    return scored[best]


def validation_score(run: Path) -> float:
    summary = json.loads((run / "summary.json").read_text())
    score = summary.get("best_val_accuracy")
    if score is None:
        raise ConfigError(f"{run} has no validation accuracy: tuning chooses on validation, so give the "
                          "clients a validation split (dataset.val_fraction > 0)")
    return float(score)


RunOne = Callable[[list[str], argparse.Namespace, str], tuple[Path | None, bool]]


def tune(overrides: list[str], axes: Sequence[GridAxis], seeds: Sequence[int], tune_seed: int,
         args: argparse.Namespace, run_one: RunOne) -> tuple[list[dict[str, Any]], list[Path], int]:
    """For each setting of ``overrides`` (comma lists swept; seed excluded): the grid at
    ``tune_seed``, the best combination on validation, then ``seeds`` at it. Returns the
    choices, the seed runs and the number of failed runs."""
    if any(o.lstrip("+~").startswith("seed=") for o in overrides):
        raise ConfigError("give the seeds with --seeds (and the tuning seed with --tune-seed), not seed=")
    choices: list[dict[str, Any]] = []
    runs: list[Path] = []
    failures = 0
    for setting in expand_grid(overrides):
        run_cfg, rest = split_overrides(setting)
        strategy = str(compose_config(run_cfg, rest).strategy.name)
        scored = []
        for combo in grid_for(strategy, axes):
            folder, partial = run_one([*setting, *combo, f"seed={tune_seed}"], args, "tune")
            failures += folder is None or partial
            if folder is not None:
                scored.append((combo, validation_score(folder)))
        best, score = select_best(scored)
        choices.append({"setting": setting, "strategy": strategy, "chosen": best, "val_accuracy": score,
                        "tuning_seed": tune_seed,
                        "grid": [{"overrides": c, "val_accuracy": s} for c, s in scored]})
        print(f"pflower tune: {' '.join(setting)}: {' '.join(best) or '(nothing to tune)'} "
              f"(validation accuracy {score:.4f} at seed {tune_seed})", flush=True)
        for seed in seeds:
            folder, partial = run_one([*setting, *best, f"seed={seed}"], args, "tune")
            failures += folder is None or partial
            if folder is not None:
                runs.append(folder)
    return choices, runs, failures


def tuning_table(choices: Sequence[dict[str, Any]]) -> str:
    """What was tuned over which grid, and what was chosen (the head of the results table)."""
    out = ["| setting | grid: validation accuracy (tuning seed) | chosen |", "|---|---|---|"]
    for c in choices:
        grid = "; ".join(f"{' '.join(g['overrides']) or '-'}: {g['val_accuracy']:.4f}" for g in c["grid"])
        out.append(f"| {' '.join(c['setting'])} | {grid} (seed {c['tuning_seed']}) | {' '.join(c['chosen']) or '-'} |")
    return "\n".join(out)


def cmd_tune(args: argparse.Namespace, run_one: RunOne, compare: Callable[[argparse.Namespace], int]) -> int:
    """The command: ``run_one`` runs (or reuses) one configuration, ``compare`` writes the table
    (``ops/cli.py``'s ``run_or_reuse`` and ``cmd_compare``, passed in: the command line imports
    this module, not the other way round)."""
    try:
        axes = [GridAxis.parse(g) for g in args.grid]
        seeds = [int(s) for s in str(args.seeds).split(",") if s != ""]
        choices, runs, failures = tune(list(args.overrides), axes, seeds, int(args.tune_seed), args, run_one)
    except (ConfigError, ValueError) as err:
        print(f"pflower tune: {err}", flush=True)
        return 2
    except KeyboardInterrupt:
        print("pflower tune: interrupted; finished runs are reused when the same tune is run again", flush=True)
        return 130
    run_cfg, _ = split_overrides(list(args.overrides))
    root = Path(run_cfg.get("results-root", "results")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "tuning.json").write_text(json.dumps(choices, indent=1))
    head = tuning_table(choices)
    print(head, flush=True)
    if runs:
        compare(argparse.Namespace(runs=[str(r) for r in runs], out=args.out, plot=args.plot))
        if args.out:
            path = Path(args.out)
            path.write_text(f"Tuned on validation accuracy:\n\n{head}\n\n{path.read_text()}")
    return 1 if failures else 0


def add_parser(sub: Any, run_one: RunOne, compare: Callable[[argparse.Namespace], int], max_recoveries: int) -> None:
    p = sub.add_parser("tune", help="choose each method's hyper-parameters on validation accuracy, then run the "
                                    "seeds at them", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="+", help="Hydra overrides (comma lists sweep, e.g. strategy=fedavg,fedbn)")
    p.add_argument("--grid", action="append", default=[], metavar="[STRATEGY:]KEY=V1,V2",
                   help="a tuned axis (repeat for more; crossed)")
    p.add_argument("--seeds", default="0,1,2", help="seeds run at the chosen values (default 0,1,2)")
    p.add_argument("--tune-seed", type=int, default=0, help="the seed of the grid runs (default 0)")
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--num-cpus", type=float, default=1.0)
    p.add_argument("--num-gpus", type=float, default=None, help="as for run")
    p.add_argument("--max-recoveries", type=int, default=max_recoveries, help="as for run")
    p.add_argument("--ray-address", default=None, help="as for run")
    p.set_defaults(func=lambda args: cmd_tune(args, run_one, compare))
