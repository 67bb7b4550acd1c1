"""FEDORA's and Local's own scripts, end to end, beside pflower's kept runs (not CI; needs the
authors' checkout and the data).

    pflower data fashion-mnist --root DIR
    python3 -m bench.authors_fedora_run --repo /path/to/FEDORA --root DIR --data fashion-mnist \\
        --method fedora --seed 0 --out theirs-fedora-s0.json
    python3 -m bench.authors_fedora_run --compare theirs-*.json --ours docs/runs/fedora-rotated-fashion-mnist

Nothing of the authors' code is in this repository. The script runs their ``main_fedora.py:
run_FEDORA`` (``--method fedora``) or ``main_local.py: run_LOCAL`` (``--method local``) as
their ``__main__`` does: ``args_parser()`` with their defaults (500 steps, batch 64, 5 inner
epochs, SGD at 5e-3 with momentum 0.9 and weight decay 5e-5, evaluation every 10 steps), then
``set_logger()``, ``set_seed(seed)`` and ``get_device``, in a temporary folder whose ``data/`` is
``--root`` (their loader reads ``data/``; torchvision finds the files and downloads nothing).
Two things their command line cannot say are set on the parsed arguments instead:
``--gpu 0`` is passed because their parser asserts ``gpu <= torch.cuda.device_count()``
(their default 1 fails on a machine with fewer than 2 GPUs; on a CPU-only machine their
``get_device`` then gives the CPU), and ``data_name`` is set after parsing because their
``--data-name`` accepts only ``cifar10``/``cifar100`` although the code reads
``mnist``/``fashion-mnist`` (its default is ``mnist``).

Their script keeps its results in a local variable and logs only each evaluation's test loss,
mean and per-client accuracies; every call of their ``eval_model`` is recorded instead (their function, called as they call it, its
return values kept), so the JSON holds each evaluation's per-client accuracy on the test and
validation splits. Evaluations come in pairs: test then validation at steps 1, 11, ..., 491,
then validation and test after the last step (500). ``--compare`` prints, per method, their
mean and worst client at step 500 and at their best-validation evaluation, per seed, beside
pflower's kept runs of the same seeds (``summary.json``: round 500, and its best-validation round).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ENTRY = {"fedora": ("main_fedora", "run_FEDORA"), "local": ("main_local", "run_LOCAL")}


def run_theirs(repo: Path, root: Path, data: str, method: str, seed: int, steps: int | None = None) -> dict[str, Any]:
    """Their script's run for one method and seed; every evaluation's per-client accuracies."""
    import importlib

    import torch

    from server.summary import machine_description

    sys.path.insert(0, str(repo))
    module_name, entry = ENTRY[method]
    saved_argv = sys.argv
    sys.argv = [f"{module_name}.py", "--gpu", "0", "--seed", str(seed)] + ([] if steps is None else ["--num-steps", str(steps)])
    try:
        from utils.helper import get_device, set_logger, set_seed  # the authors' code
        from utils.params import args_parser

        module = importlib.import_module(module_name)
        args = args_parser()
    finally:
        sys.argv = saved_argv
    args.data_name = data
    evaluations: list[dict[str, Any]] = []
    their_eval = module.eval_model

    def recorded(nodes, num_nodes, nets, criteria, device, split):  # noqa: ANN001, ANN202
        out = their_eval(nodes, num_nodes, nets, criteria, device, split)
        _, avg_loss, avg_acc, all_acc = out
        evaluations.append({"split": split, "loss": float(avg_loss), "acc_mean": float(avg_acc),
                            "acc": [float(a) for a in all_acc]})
        return out

    module.eval_model = recorded
    here = Path.cwd()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        os.symlink(root.resolve(), Path(work) / "data")
        os.chdir(work)
        try:
            set_logger()
            set_seed(args.seed)
            getattr(module, entry)(args, get_device(gpus=args.gpu))
        finally:
            os.chdir(here)
            module.eval_model = their_eval
    return {"method": method, "data": data, "seed": seed, "steps": args.num_steps,
            "settings": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
            "evaluations": evaluations, "elapsed_s": round(time.perf_counter() - started, 1),
            "machine": {**machine_description("cpu"), "threads": torch.get_num_threads()}}


def eval_points(run: dict[str, Any]) -> list[dict[str, list[float]]]:
    """The run's evaluations paired into points: {"test": per-client accs, "val": per-client accs}."""
    evals = run["evaluations"]
    if len(evals) % 2:
        raise ValueError(f"{run['method']} seed {run['seed']}: an odd number of evaluations ({len(evals)}); "
                         "the run did not finish: run it again")
    points = []
    for a, b in zip(evals[::2], evals[1::2], strict=True):
        pair = {a["split"]: a["acc"], b["split"]: b["acc"]}
        if set(pair) != {"test", "val"}:
            raise ValueError(f"evaluations out of pairs: {a['split']}, {b['split']}")
        points.append(pair)
    return points


def their_row(run: dict[str, Any]) -> dict[str, float]:
    """Mean and worst client on the test split at the last step, and at their best-validation point
    (their ``best_acc < val_avg_acc``: the first of equal validation means)."""
    points = eval_points(run)
    last = points[-1]["test"]
    best = max(range(len(points)), key=lambda i: (np.mean(points[i]["val"]), -i))
    return {"acc_mean": float(np.mean(last)), "acc_min": float(np.min(last)),
            "best_acc_mean": float(np.mean(points[best]["test"])), "best_acc_min": float(np.min(points[best]["test"]))}


def our_row(folder: Path) -> dict[str, float]:
    s = json.loads((folder / "summary.json").read_text())
    return {"acc_mean": s["accuracy_mean"], "acc_min": s["accuracy_min"],
            "best_acc_mean": s["best_accuracy_mean"], "best_acc_min": s["best_accuracy_min"]}


def our_runs(folder: Path, method: str) -> dict[int, dict[str, float]]:
    """pflower's kept runs of ``method`` at its defaults (the folder without a hash suffix), by seed."""
    rows = {}
    for run in sorted(folder.iterdir()):
        summary = run / "summary.json"
        if not summary.exists():
            continue
        s = json.loads(summary.read_text())
        kept = json.loads((run / "overrides.json").read_text()) if (run / "overrides.json").exists() else {}
        overrides = kept.get("overrides", []) if isinstance(kept, dict) else kept
        tuned = [o for o in overrides if not o.startswith(("experiment=", "dataset.root=", "seed=", "strategy="))]
        if s["strategy"] == method and not tuned:
            rows[int(s["seed"])] = our_row(run)
    return rows


def compare(files: list[Path], ours: Path) -> str:
    """The table: per method, the authors' script's runs (``files``) and pflower's kept runs of
    the same seeds (``ours``), mean ± std over seeds (a page prints it verbatim;
    ``tests/test_kept_tables.py`` recomputes it)."""
    theirs: dict[str, dict[int, dict[str, float]]] = {}
    for f in sorted(files):
        run = json.loads(f.read_text())
        theirs.setdefault(run["method"], {})[run["seed"]] = their_row(run)
    keys = ("acc_mean", "acc_min", "best_acc_mean", "best_acc_min")
    lines = ["| method | code | seeds | acc mean | acc min | acc @ best val | acc min @ best val | acc mean by seed |",
             "|---|---|---|---|---|---|---|---|"]
    for method in sorted(theirs):
        seeds = sorted(theirs[method])
        for code, rows in (("authors' script", theirs[method]), ("pflower", our_runs(ours, method))):
            missing = [s for s in seeds if s not in rows]
            if missing:
                lines.append(f"| {method} | {code} | no run for seeds {missing} | | | | | |")
                continue
            cells = [f"{np.mean([rows[s][k] for s in seeds]):.4f} ± {np.std([rows[s][k] for s in seeds]):.4f}"
                     for k in keys]
            by_seed = " / ".join(f"{rows[s]['acc_mean']:.4f}" for s in seeds)
            lines.append(f"| {method} | {code} | {','.join(map(str, seeds))} | {' | '.join(cells)} | {by_seed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.authors_fedora_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, help="a checkout of junwu6/FEDORA")
    parser.add_argument("--root", type=Path, help="the torchvision root `pflower data` filled")
    parser.add_argument("--data", choices=("mnist", "fashion-mnist"), default="fashion-mnist")
    parser.add_argument("--method", choices=sorted(ENTRY), default="fedora")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="their --num-steps (default: theirs, 500); fewer for a quick look")
    parser.add_argument("--out", type=Path, help="where the run's JSON goes")
    parser.add_argument("--compare", type=Path, nargs="+", help="runs written by --out, to print beside --ours")
    parser.add_argument("--ours", type=Path, help="a folder of pflower's kept runs (docs/runs/<table>)")
    args = parser.parse_args(argv)
    if args.compare:
        if args.ours is None:
            parser.error("--compare needs --ours, a folder of pflower's kept runs")
        print(compare(args.compare, args.ours))
        return 0
    if args.repo is None or args.root is None or args.out is None:
        parser.error("a run needs --repo, --root and --out (or --compare FILES --ours FOLDER)")
    if not (args.repo / ENTRY[args.method][0]).with_suffix(".py").exists():
        parser.error(f"{args.repo} is not a checkout of the authors' FEDORA (no {ENTRY[args.method][0]}.py)")
    run = run_theirs(args.repo.resolve(), args.root, args.data, args.method, args.seed, args.steps)
    args.out.write_text(json.dumps(run))
    print(f"{args.out}: {their_row(run)} in {run['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
