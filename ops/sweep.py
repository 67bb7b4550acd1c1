"""``pflower sweep`` (and ``tune``'s batches): a grid of configurations, each run or its
finished folder reused, one after another in this process or ``--jobs N`` at a time."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from common.config import ConfigError, compose_run
from common.overrides import expand_grid, override_key, split_overrides
from ops.options import batch_options, overrides_help, run_options
from ops.resources import core_groups, cpus_per_run, number_text, pin_to, ray_cluster, usable_cores
from ops.running import EXIT_INTERRUPTED, EXIT_PARTIAL, RunOptions, run_configuration


def run_folder(combo: list[str]) -> tuple[Path, bool]:
    """The folder a configuration runs into, and whether a finished run is there to reuse
    (``overwrite=true`` never reuses; a run marked FAILED is run again)."""
    from server.run_folder import finished_summary

    run_cfg, rest = split_overrides(combo)
    root = Path(run_cfg.get("results-root", "results")).resolve()
    run = compose_run({**run_cfg, "results-root": str(root)}, rest).settings.run
    folder = root / run.run_name
    return folder, finished_summary(folder, run) is not None


def continue_unfinished(combo: list[str], folder: Path, who: str = "sweep") -> list[str]:
    """The overrides that go on with ``combo`` in a sweep or tune whose folder holds an
    unfinished run (Ctrl-C, a killed machine, a failed round): resumed from its checkpoint
    (``resume=<folder>``, the command a user would type; bit-identical on the CPU), or run
    afresh when it stopped before computing anything (only its config was written). A folder
    with results but no checkpoint is left to ``pflower run``, which refuses to overwrite it."""
    from server.checkpoint import checkpoint_round
    from server.run_folder import OVERRIDES_FILE, existing_run_files

    if not folder.is_dir() or any(override_key(o) in ("resume", "overwrite") for o in combo):
        return combo
    nothing_computed = {"config.yaml", OVERRIDES_FILE, "FAILED"}   # what a run writes before its first round
    found = set(existing_run_files(folder))
    if not found:
        return combo
    at = checkpoint_round(folder)
    if at is not None:
        print(f"pflower {who}: {folder} stopped after round {at}; resuming it from its checkpoint", flush=True)
        return [f"resume={folder}"]
    if found <= nothing_computed:
        print(f"pflower {who}: {folder} stopped before its first round; running it afresh", flush=True)
        return [*combo, "overwrite=true"]
    return combo


def say_reused(who: str, folder: Path) -> None:
    """A sweep or tune reuses a finished run instead of running it again."""
    print(f"pflower {who}: {folder} is already done; reusing it (overwrite=true to run it again)", flush=True)


def run_or_reuse(combo: list[str], options: RunOptions, who: str = "sweep") -> tuple[Path | None, bool]:
    """Run one configuration, or reuse its finished folder (``overwrite=true`` runs it again).
    Returns (the run folder, or None when it failed; whether it completed only partly)."""
    folder, done = run_folder(combo)
    if done:
        say_reused(who, folder)
        return folder, False
    code = run_configuration(continue_unfinished(combo, folder, who), options)
    if code == EXIT_INTERRUPTED:   # Ctrl-C stops the sweep (or tune), not only its current run
        raise KeyboardInterrupt(f"{who} interrupted during {' '.join(combo)}")
    if code not in (0, EXIT_PARTIAL):
        return None, False
    return folder, code == EXIT_PARTIAL


def run_command(combo: list[str], options: RunOptions) -> list[str]:
    """The ``pflower run`` command line of one configuration, with the sweep's options."""
    cmd = [sys.executable, "-m", "ops.cli", "run", *combo, "--num-cpus", number_text(options.num_cpus),
           "--max-recoveries", str(options.max_recoveries)]
    if options.num_gpus is not None:
        cmd += ["--num-gpus", number_text(options.num_gpus)]
    if options.ray_address:
        cmd += ["--ray-address", str(options.ray_address)]
    if options.cpus is not None:
        cmd += ["--cpus", str(options.cpus)]
    return cmd


def run_in_parallel(grid: list[list[str]], options: RunOptions, jobs: int, who: str = "sweep",
                    poll_s: float = 1.0) -> list[tuple[Path | None, bool]]:
    """``--jobs N``: the grid's runs N at a time, each a ``pflower run`` process of its own
    (its own SuperLink and Ray instance), so a many-core box runs a table's small runs side by
    side instead of one after another (a run of a small model uses about two cores however
    many it is given: its server and SuperLink are sequential). Each run's output goes to
    ``<results_root>/.sweep-logs/<run name>.log``; a finished run is reused, as sequentially.
    On a private Ray, each run is pinned to cores of its own (:func:`ops.resources.core_groups`),
    and a run that ends hands its cores to the next.
    Returns, in grid order, what :func:`run_or_reuse` returns for each configuration."""
    import functools
    import subprocess

    from ops.deployment.launch import kill_tree

    free_cores: list[tuple[int, ...]] = []
    if ray_cluster(options.ray_address) is None:   # each private Ray gets its share
        options = dataclasses.replace(options, cpus=cpus_per_run(jobs))
        cores = usable_cores()
        free_cores = core_groups(cores, jobs) or []
        print(f"pflower {who}: {jobs} runs at once, each on {options.cpus} of this machine's {len(cores)} "
              f"CPUs ({number_text(options.num_cpus)} per client)"
              + (", each run pinned to cores of its own" if free_cores else ""), flush=True)
    folders = [run_folder(combo) for combo in grid]
    results: dict[Path, tuple[Path | None, bool]] = {}
    waiting: list[tuple[int, list[str], Path]] = []
    for i, (combo, (folder, done)) in enumerate(zip(grid, folders, strict=True), 1):
        if done:
            say_reused(who, folder)
            results[folder] = (folder, False)
        elif folder not in {f for _, _, f in waiting}:   # the same run named twice runs once
            waiting.append((i, combo, folder))
    running: dict[Path, tuple[subprocess.Popen, Path, int]] = {}
    pinned: dict[Path, tuple[int, ...]] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                i, combo, folder = waiting.pop(0)
                log = folder.parent / ".sweep-logs" / f"{folder.name}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                if free_cores:
                    pinned[folder] = free_cores.pop(0)
                pin = functools.partial(pin_to, pinned[folder]) if folder in pinned else None
                with log.open("w") as out:
                    proc = subprocess.Popen(run_command(continue_unfinished(combo, folder, who), options), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin)
                running[folder] = (proc, log, i)
                print(f"pflower {who}: [{i}/{len(grid)}] started {' '.join(combo)} (output: {log})", flush=True)
            for folder, (proc, log, i) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[folder]
                if folder in pinned:
                    free_cores.append(pinned.pop(folder))
                ok = code in (0, EXIT_PARTIAL)
                results[folder] = (folder if ok else None, code == EXIT_PARTIAL)
                print(f"pflower {who}: [{i}/{len(grid)}] " + (f"done: {folder}" if ok else
                      f"failed (exit {code}); its output: {log}"), flush=True)
            time.sleep(poll_s)
    finally:
        for proc, _, _ in running.values():   # interrupted: each run stops its own Flower processes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
        for proc, _, _ in running.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
    return [results[folder] for folder, _ in folders]


def run_all(grid: list[list[str]], options: RunOptions, who: str = "sweep") -> list[tuple[Path | None, bool]]:
    """A batch of configurations: one after another in this process, or ``--jobs N`` at a time
    (:func:`run_in_parallel`). Returns what :func:`run_or_reuse` returns for each, in order;
    Ctrl-C stops the whole batch (``KeyboardInterrupt``)."""
    if options.jobs > 1:
        return run_in_parallel(grid, options, options.jobs, who)
    outcomes = []
    for i, combo in enumerate(grid, 1):
        print(f"pflower {who}: [{i}/{len(grid)}] {' '.join(combo)}", flush=True)
        outcomes.append(run_or_reuse(combo, options, who))
    return outcomes


def cmd_sweep(args: argparse.Namespace) -> int:
    """``pflower sweep``: every configuration checked first, then run (or reused), then one table."""
    from ops.compare import print_comparison

    grid = expand_grid(args.overrides)
    try:  # every run's configuration is checked before the first one starts
        for combo in grid:
            run_folder(combo)
    except ConfigError as err:
        print(f"pflower sweep: {err}", file=sys.stderr)
        return 2
    try:
        outcomes = run_all(grid, RunOptions.from_args(args))
    except KeyboardInterrupt:
        print(f"pflower sweep: interrupted ({len(grid)} runs in the grid); finished runs are reused when the "
              "same sweep is run again", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    runs = [folder for folder, _ in outcomes if folder is not None]
    failures = sum(1 for folder, partial in outcomes if folder is None or partial)
    if runs:
        print_comparison(runs, args.out, args.plot)
    return 1 if failures else 0



def add_parser(sub: argparse._SubParsersAction) -> None:
    """``pflower sweep``."""
    p = sub.add_parser("sweep", help="run a grid (comma lists are swept) and compare it",
                       parents=[run_options(), batch_options()], epilog=overrides_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="+")
    p.set_defaults(func=cmd_sweep)
