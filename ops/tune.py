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
table's head. ``--jobs N`` runs N at a time, as for ``pflower sweep``: first every method's grid,
then every method's seeds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, compose_config
from common.overrides import expand_grid, override_key, split_overrides
from ops.running import RunOptions


@dataclass(frozen=True)
class GridAxis:
    """One tuned key and its values; ``strategy`` limits it to one method (None: every one)."""

    key: str
    values: tuple[str, ...]
    strategy: str | None = None

    @classmethod
    def parse(cls, spec: str) -> GridAxis:
        """``[strategy:]key=v1,v2,...``: the part after ``strategy:`` is a Hydra sweep."""
        head = spec.partition("=")[0]
        strategy, colon, _ = head.rpartition(":")
        sweep = spec[len(strategy) + 1:] if colon else spec
        settings = expand_grid([sweep]) if "=" in sweep else []
        items = tuple(setting[0].partition("=")[2] for setting in settings)
        key = override_key(sweep) if settings else ""
        if not key or not all(items):
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


RunAll = Callable[[list[list[str]], RunOptions, str], list[tuple[Path | None, bool]]]


def tune(overrides: list[str], axes: Sequence[GridAxis], seeds: Sequence[int], tune_seed: int,
         options: RunOptions, run_all: RunAll) -> tuple[list[dict[str, Any]], list[Path], int]:
    """For each setting of ``overrides`` (comma lists swept; seed excluded): the grid at
    ``tune_seed``, the best combination on validation, then ``seeds`` at it. Returns the
    choices, the seed runs and the number of failed runs.

    Two batches go to ``run_all`` (``ops/sweep.py``'s: one after another, or ``--jobs`` at a
    time): every setting's grid, then every setting's seeds at its choice, so a many-core box
    runs a whole phase side by side. A setting whose grid runs all failed is reported and
    gets no seed runs; the other settings go on."""
    if any(override_key(o) == "seed" for o in overrides):
        raise ConfigError("give the seeds with --seeds (and the tuning seed with --tune-seed), not seed=")
    settings = []
    for setting in expand_grid(overrides):
        run_cfg, rest = split_overrides(setting)
        strategy = str(compose_config(run_cfg, rest).strategy.name)
        settings.append((setting, strategy, grid_for(strategy, axes)))
    grid_runs = [[*setting, *combo, f"seed={tune_seed}"] for setting, _, combos in settings for combo in combos]
    print(f"pflower tune: {len(grid_runs)} grid runs at seed {tune_seed}, then {len(seeds)} seeds for each of "
          f"{len(settings)} settings", flush=True)
    outcomes = iter(run_all(grid_runs, options, "tune"))
    choices: list[dict[str, Any]] = []
    failures = 0
    for setting, strategy, combos in settings:
        scored = []
        for combo in combos:
            folder, partial = next(outcomes)
            failures += folder is None or partial
            if folder is not None:
                scored.append((combo, validation_score(folder)))
        if not scored:
            print(f"pflower tune: {' '.join(setting)}: every grid run failed; no seeds are run for it", flush=True)
            continue
        best, score = select_best(scored)
        choices.append({"setting": setting, "strategy": strategy, "chosen": best, "val_accuracy": score,
                        "tuning_seed": tune_seed,
                        "grid": [{"overrides": c, "val_accuracy": s} for c, s in scored]})
        print(f"pflower tune: {' '.join(setting)}: {' '.join(best) or '(nothing to tune)'} "
              f"(validation accuracy {score:.4f} at seed {tune_seed})", flush=True)
    seed_runs = [[*c["setting"], *c["chosen"], f"seed={seed}"] for c in choices for seed in seeds]
    runs: list[Path] = []
    for folder, partial in run_all(seed_runs, options, "tune"):
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


def cmd_tune(args: argparse.Namespace) -> int:
    """The command: the sweep's ``run_all`` runs (or reuses) each batch of configurations,
    ``pflower compare``'s code writes the table."""
    from ops.compare import print_comparison
    from ops.sweep import run_all

    try:
        axes = [GridAxis.parse(g) for g in args.grid]
        seeds = [int(s) for s in str(args.seeds).split(",") if s != ""]
        choices, runs, failures = tune(list(args.overrides), axes, seeds, int(args.tune_seed),
                                         RunOptions.from_args(args), run_all)
    except (ConfigError, ValueError) as err:
        print(f"pflower tune: {err}", file=sys.stderr, flush=True)
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
        print_comparison(runs, args.out, args.plot)
        if args.out:
            path = Path(args.out)
            path.write_text(f"Tuned on validation accuracy:\n\n{head}\n\n{path.read_text()}")
    return 1 if failures else 0


def add_parser(sub: Any) -> None:
    """``pflower tune``, with the options it shares with run and sweep (``ops/options.py``)."""
    from ops.options import batch_options, run_options

    parents = [run_options(), batch_options()]
    p = sub.add_parser("tune", help="choose each method's hyper-parameters on validation accuracy, then run the "
                                    "seeds at them", description=__doc__, parents=parents,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="+", help="Hydra overrides (comma lists sweep, e.g. strategy=fedavg,fedbn)")
    p.add_argument("--grid", action="append", default=[], metavar="[STRATEGY:]KEY=V1,V2",
                   help="a tuned axis (repeat for more; crossed)")
    p.add_argument("--seeds", default="0,1,2", help="seeds run at the chosen values (default 0,1,2)")
    p.add_argument("--tune-seed", type=int, default=0, help="the seed of the grid runs (default 0)")
    p.set_defaults(func=cmd_tune)
