"""``pflower run``: one simulation, checked before anything starts, on a private SuperLink,
resumed by itself when its processes die (``--max-recoveries``), every process it started
stopped at the end; the exit code says whether it wrote its ``summary.json``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import ComposedRun, ConfigError, compose_run
from common.overrides import override_key, split_overrides, to_toml_run_config
from learning.datasets.config import num_clients
from learning.datasets.pools import dataset_config
from learning.datasets.sources import DatasetError
from ops.options import DEFAULT_MAX_RECOVERIES, overrides_help, run_options
from ops.resources import (
    check_client_resources,
    number_text,
    resolve_gpu_share,
    simulated_nodes,
    simulation_config,
    usable_cpus,
    use_ray_cluster,
    visible_gpus,
)

EXIT_PARTIAL = 4   # the run completed but some clients are missing from its final numbers
EXIT_INTERRUPTED = 130   # Ctrl-C or SIGTERM: every Flower process of the run was stopped


class RunFinished(Exception):
    """The configuration's folder already holds its finished run: nothing to start."""


def say_finished(run_dir: Path) -> int:
    """A command whose run is already done says where its result is and starts nothing (exit 0)."""
    s = json.loads((run_dir / "summary.json").read_text())
    result = (f": accuracy mean {s['accuracy_mean']:.4f} min {s['accuracy_min']:.4f}"
              if {"accuracy_mean", "accuracy_min"} <= s.keys() else "")
    print(f"pflower: {run_dir} already holds this run, finished ({s.get('status', 'completed')}){result} -> "
          f"{run_dir / 'summary.json'}; nothing started (overwrite=true runs it again, run_name=<new name> "
          "keeps both)")
    return 0


@dataclass(frozen=True)
class RunOptions:
    """How runs run: the command-line options of ``run``, ``sweep`` and ``tune`` (the config
    itself is in the overrides). ``jobs`` is a batch's (sweep, tune): runs at once."""

    num_cpus: float = 1.0                  # CPUs per simulated client
    num_gpus: float | None = None          # GPUs per simulated client (None: an automatic share)
    max_recoveries: int = DEFAULT_MAX_RECOVERIES
    ray_address: str | None = None         # an existing Ray cluster (None: RAY_ADDRESS, else private)
    cpus: int | None = None                # CPUs of the run's private Ray instance (None: all)
    keep_temp: bool = False                # keep the private SuperLink's folder in the run folder
    jobs: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        """The options a command's parser gave (those it does not have keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def preflight(overrides: list[str]) -> tuple[ComposedRun, dict[str, str], list[str], int]:
    """Everything that can be checked before a Flower process starts (exit 2 on failure):
    the config, the dataset (the whole image tree for image folders: missing or empty
    folders, nested folders, unreadable images, too few images for the split), and the run
    folder (another run's results, or a live run writing it)."""
    from learning.datasets.cache import cache_holds, fill_cache, resolve_cache_dir
    from learning.datasets.sources import image_tree_problems
    from ops.recovery import expand_resume
    from server.run_folder import RunFolderError, check_run_folder, finished_summary, lock_is_held

    run_cfg, rest = split_overrides(expand_resume(list(overrides)))
    run_cfg["results-root"] = str(Path(run_cfg.get("results-root", "results")).resolve())
    composed = compose_run(run_cfg, rest)
    cfg, run = composed.cfg, composed.settings.run
    if finished_summary(run.run_dir, run) is not None:
        raise RunFinished(run.run_dir)
    n = num_clients(cfg.dataset)
    dataset = dataset_config(cfg.dataset)
    if dataset.source == "imagefolder" and not dataset.synthetic:
        problems = image_tree_problems(dataset.root, list(dataset.domains), verify_images=True)
        if problems:
            raise DatasetError(f"dataset {dataset.name!r}: the image-folder tree has problems:\n  - "
                               + "\n  - ".join(problems))
    # builds every split (fails here, not in a client) and caches them for the clients; a config
    # the cache holds was built before (the build and its imports were 5 s of a run's start-up)
    cache_dir = resolve_cache_dir(run.data_cache)
    if not cache_holds(cfg.dataset, run.seed, cache_dir):
        fill_cache(cfg.dataset, run.seed, cache_dir)
    if run.resume:
        run_cfg, rest = resume_overrides(composed, run_cfg, rest)
    run_dir = run.run_dir
    try:
        check_run_folder(run_dir, bool(run.resume), run.overwrite)
    except RunFolderError as err:
        raise ConfigError(str(err)) from err
    if lock_is_held(run_dir):
        raise ConfigError(f"{run_dir} is being written by another live run; wait for it to finish "
                          "or stop it, or choose another run_name")
    return composed, run_cfg, rest, n


@dataclass
class Attempt:
    """How one submission of the run ended: flwr's exit code, and, when the run died (no
    fresh summary.json and no FAILED from the ServerApp), why and where its output was kept."""

    code: int
    died: str = ""
    evidence: Path | None = None


def run_once(composed: ComposedRun, run_cfg: dict[str, str], rest: list[str], federation: str,
             keep: Path | None, attempt: int) -> Attempt:
    """Submit the run once on a private SuperLink; on any failure keep what explains it (the
    SuperLink's log and database, the run's status and stored log) in ``<run>/failures``."""
    from ops.deployment.launch import (
        APP_DIR,
        AppWatch,
        flwr_run,
        follow_after_stream_loss,
        run_info,
        run_log,
        simulation_superlink,
    )
    from ops.progress import RUN_LOG, RunOutput, run_progress
    from ops.recovery import death_reason, keep_evidence
    from server.loop import SimulationWorkerLost

    run = composed.settings.run
    run_dir = run.run_dir
    started = time.time()
    try:
        with simulation_superlink(keep_in=keep) as (link, flwr_home):
            print(f"pflower: private SuperLink {link.control_address} (work dir {link.workdir})", flush=True)
            write_pid_file(run_dir, link)
            watch = AppWatch(link, "flwr-simulation")
            with run_progress(run_dir, run.rounds, f"{composed.settings.strategy} {run.run_name}") as bar, \
                    RunOutput(run_dir / RUN_LOG, bar, append=attempt > 1 or bool(run.resume)) as output:
                code = flwr_run(APP_DIR, flwr_home, to_toml_run_config(run_cfg, rest), federation, alive=watch,
                                on_line=output)
            if code != 0 and not watch.reason:
                follow_after_stream_loss(code, flwr_home, run_dir, run.rounds, alive=watch)
            if fresh(run_dir / "summary.json", started):
                return Attempt(code)
            # any failure keeps the processes' own output with the run
            info = run_info(flwr_home) if link.proc is not None and link.proc.poll() is None else None
            log_text = run_log(flwr_home, str(info["run-id"])) if info and "run-id" in info else ""
            evidence = None
            with contextlib.suppress(OSError):
                evidence = keep_evidence(link.workdir, run_dir, attempt, info, log_text)
            if fresh(run_dir / "FAILED", started):   # the ServerApp said why
                said = _read(run_dir / "FAILED")
                if said.startswith(SimulationWorkerLost.__name__):   # the engine, not the run: recover
                    return Attempt(code, died=said.splitlines()[0], evidence=evidence)
                return Attempt(code, evidence=evidence)
            reason = death_reason(code, info, _read(link.workdir / "superlink.log") + log_text, watch.reason)
            return Attempt(code, died=reason, evidence=evidence)
    finally:   # the SuperLink and its processes are stopped: the folder keeps results only
        (run_dir / PID_FILE).unlink(missing_ok=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def fresh(path: Path, since: float) -> bool:
    """Whether ``path`` was written at or after ``since`` (by this attempt)."""
    return path.exists() and path.stat().st_mtime >= since


def cmd_run(args: argparse.Namespace) -> int:
    """``pflower run [KEY=VALUE ...] [options]``."""
    return run_configuration(list(args.overrides), RunOptions.from_args(args))


def run_configuration(overrides: list[str], options: RunOptions) -> int:
    """Run one configuration to its end (resumed by itself when its processes die, at most
    ``options.max_recoveries`` times); the exit code says how it ended."""
    from ops.deployment.launch import LaunchError
    from server.checkpoint import checkpoint_round
    from server.run_folder import record_recovery

    try:
        composed, run_cfg, rest, n = preflight(overrides)
        ray_cpus = options.cpus
        num_gpus = resolve_gpu_share(composed.settings.run.device, n, options.num_gpus, options.num_cpus, ray_cpus)
        ray_address = use_ray_cluster(options.ray_address)
        check_client_resources(options.num_cpus, num_gpus, ray_address, ray_cpus)
    except RunFinished as done:
        return say_finished(Path(str(done)))
    except (ConfigError, DatasetError) as err:
        print(f"pflower: {err}", file=sys.stderr)
        return 2
    settings = composed.settings
    run_dir = settings.run.run_dir
    summary = run_dir / "summary.json"
    started = time.time()
    local = ray_address == "local"
    federation = simulation_config(n, options.num_cpus, num_gpus, ray_cpus if local else None,
                                   simulated_nodes(n, options.num_cpus, num_gpus, ray_cpus or usable_cpus(),
                                                   visible_gpus()) if local else None)
    print(f"pflower: {settings.strategy} on {settings.dataset} ({n} clients), {settings.run.rounds} rounds -> {run_dir}"
          + (f" ({number_text(num_gpus)} GPU per client)" if num_gpus else "")
          + ("" if ray_address == "local" else f" on the Ray cluster at {ray_address}"))
    keep = run_dir / "superlink" if options.keep_temp else None
    max_recoveries = options.max_recoveries
    recoveries, last_round = 0, checkpoint_round(run_dir) if settings.run.resume else None
    try:
        while True:
            attempt = run_once(composed, run_cfg, rest, federation, keep, recoveries + 1)
            if not attempt.died:
                break
            after = checkpoint_round(run_dir)
            print(f"pflower: the run died: {attempt.died}; its processes' output is in {attempt.evidence}",
                  file=sys.stderr, flush=True)
            if after is None or recoveries >= max_recoveries or after == last_round:
                why = ("no checkpoint was written" if after is None else
                       "automatic recovery is off (--max-recoveries 0)" if max_recoveries <= 0 else
                       f"{recoveries} recoveries already (--max-recoveries {max_recoveries})"
                       if recoveries >= max_recoveries else
                       f"no round completed since the last recovery (still round {after})")
                return report_failure(run_dir, f"run did not complete ({attempt.died}); not recovering: {why}")
            recoveries, last_round = recoveries + 1, after
            record_recovery(run_dir, after, attempt.died, attempt.evidence)
            print(f"pflower: recovering ({recoveries} of at most {max_recoveries}): resuming {run_dir} "
                  f"from its checkpoint of round {after}", file=sys.stderr, flush=True)
            composed, run_cfg, rest = resume_config(run_dir)
    except LaunchError as err:
        print(f"pflower: could not start the simulation: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"pflower: interrupted; all Flower processes were stopped\npflower: {go_on_hint(run_dir)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    code = attempt.code
    failed = run_dir / "FAILED"
    if fresh(failed, started):
        if attempt.evidence is not None:
            print(f"pflower: the SuperLink's and the simulation's output is in {attempt.evidence}",
                  file=sys.stderr)
        return report_failure(run_dir, failed.read_text().strip())
    if not summary.exists() or summary.stat().st_mtime < started:
        return report_failure(run_dir, f"run did not complete (flwr exit code {code}, no fresh "
                                       f"{summary}); its log: {run_dir / 'run.log'}")
    new_clients = settings.strategy == "fedbasis" and dataset_config(composed.cfg.dataset).new_clients_per_domain > 0
    protocol = settings.personalize
    if new_clients and not protocol.after_run:
        print(f"pflower: the new clients are not personalised (personalize.after_run=false); "
              f"pflower personalize {run_dir} does it")
    elif new_clients:
        from ops.personalize import personalize_run

        try:
            personalize_run(run_dir, lrs=list(protocol.lrs) if protocol.lr is None else [protocol.lr],
                            sizes=dict([max(protocol.sizes.items(), key=lambda item: item[1])]))
        except (ValueError, FileNotFoundError, RuntimeError) as err:
            print(f"pflower: the run completed, but personalising its new clients failed: {err}; "
                  f"retry with: pflower personalize {run_dir}", file=sys.stderr)
            return 1
    s = json.loads(summary.read_text())
    if "new_client_accuracy_mean" in s:
        how = s.get("new_client_protocol", {})
        print(f"pflower: new clients (personalised, {protocol.epochs} epochs at lr {how.get('lr')}, "
              f"{how.get('lr_selected_by', 'fixed')}): "
              f"accuracy mean {s['new_client_accuracy_mean']:.4f} min {s['new_client_accuracy_min']:.4f}")
    return report_done(s, summary)


def resume_config(run_dir: Path) -> tuple[ComposedRun, dict[str, str], list[str]]:
    """The configuration that resumes ``run_dir`` (its saved overrides plus ``resume=``), as
    ``pflower run resume=<run_dir>`` composes it."""
    from ops.recovery import expand_resume

    run_cfg, rest = split_overrides(expand_resume([f"resume={run_dir}"]))
    run_cfg, rest = resume_overrides(compose_run(run_cfg, rest), run_cfg, rest, quiet=True)
    return compose_run(run_cfg, rest), run_cfg, rest


def report_done(s: dict, summary: Path) -> int:
    """The last line: the result, and loudly whether it covers every client."""
    line = (f"accuracy mean {s['accuracy_mean']:.4f} min {s['accuracy_min']:.4f} "
            f"std {s['accuracy_std']:.4f} -> {summary}")
    missing = s.get("clients_missing") or {}
    if missing:
        reasons = "; ".join(f"{c}: {r}" for c, r in missing.items())
        print(f"pflower: done, PARTIAL: only {s['clients_reported']} of {s['clients_expected']} clients "
              f"reported (missing {reasons}); {line}", file=sys.stderr)
        return EXIT_PARTIAL
    print(f"pflower: done. {line}")
    return 0


def go_on_hint(run_dir: Path) -> str:
    """How to go on with a run that stopped before its end (failed or interrupted)."""
    from server.checkpoint import CHECKPOINT

    return (f"resume with: pflower run resume={run_dir}" if (run_dir / CHECKPOINT).exists()
            else "no checkpoint was written; run again (with overwrite=true to replace this folder)")


def report_failure(run_dir: Path, reason: str) -> int:
    """Leave ``FAILED`` (the reason and how to go on) in the run folder, and say it."""
    from learning.storage import atomic_write_text

    hint = go_on_hint(run_dir)
    if run_dir.is_dir():
        try:
            atomic_write_text(run_dir / "FAILED", f"{reason}\n{hint}\n")
        except OSError as err:   # a full disk: say it here, where it can still be read
            print(f"pflower: could not write FAILED: {err}", file=sys.stderr)
    print(f"pflower: run failed: {reason}\npflower: {hint}", file=sys.stderr)
    return 1


PID_FILE = "pflower.pid"


def write_pid_file(run_dir: Path, link: object) -> None:
    """Record this command's pid and its SuperLink's process group in the run folder, so a
    resume can detect a run still in progress and clean up after a killed ``pflower``."""
    from learning.storage import atomic_write_text

    proc = getattr(link, "proc", None)
    info = {"pflower": os.getpid(), "superlink_pgid": proc.pid if proc is not None else None}
    atomic_write_text(run_dir / PID_FILE, json.dumps(info))


def stale_processes(run_dir: Path) -> None:
    """Before resuming: refuse if the run's ``pflower`` is still alive; stop the SuperLink
    process group it left behind if it was killed (e.g. SIGKILL), which would otherwise
    keep running the old attempt into the same folder."""
    from ops.deployment.launch import cmdline, kill_tree

    path = run_dir / PID_FILE
    if not path.exists():
        return
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    pid, pgid = info.get("pflower"), info.get("superlink_pgid")
    if isinstance(pid, int) and pid != os.getpid() and ("pflower" in cmdline(pid) or "ops.cli" in cmdline(pid)):
        raise ConfigError(f"{run_dir} is still being run by pflower (pid {pid}); stop it first "
                          f"(kill {pid}) or wait for it to finish")
    if isinstance(pgid, int) and ("flower-superlink" in cmdline(pgid) or "ops.node.superlink" in cmdline(pgid)):
        print(f"pflower: stopping the SuperLink (pid {pgid}) and its processes, left running by "
              "the interrupted run", file=sys.stderr)
        kill_tree(pgid)


def resume_overrides(composed: ComposedRun, run_cfg: dict[str, str], rest: list[str], quiet: bool = False
                     ) -> tuple[dict[str, str], list[str]]:
    """``resume=<run dir>``: verify the folder and its checkpoint (checksum, strategy,
    model, dataset, seed, clients, round) before anything starts, and make the resumed run
    write into that same folder (its run_name and results_root)."""
    from server.checkpoint import CheckpointError, check_checkpoint
    from server.loop import checkpoint_identity

    settings = composed.settings
    run = settings.run
    run_dir = Path(run.resume)
    if not run_dir.is_dir():
        raise ConfigError(f"resume={run_dir} is not a run folder; give the path of an earlier run")
    try:
        last = check_checkpoint(run_dir, checkpoint_identity(settings, num_clients(composed.cfg.dataset)), run.rounds)
    except CheckpointError as err:
        raise ConfigError(f"cannot resume: {err}") from err
    if not quiet:
        stale_processes(run_dir)
        print(f"pflower: resuming {run_dir} after round {last}")
    run_cfg = {**run_cfg, "run-name": run.run_name, "results-root": run.results_root}
    rest = [o for o in rest if override_key(o) != "resume"] + [f"resume={run_dir}"]
    return run_cfg, rest


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``pflower run``."""
    p = sub.add_parser("run", help="run one simulation", parents=[run_options()], epilog=overrides_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides KEY=VALUE")
    p.add_argument("--keep-temp", action="store_true",
                   help="keep the private SuperLink's folder (log, database) as <run folder>/superlink")
    p.add_argument("--cpus", type=int, default=None,
                   help="CPUs this whole run's private Ray instance may use (default: all of this machine's; "
                        "`pflower sweep --jobs N` gives each run cores / N); --num-cpus is per client")
    p.set_defaults(func=cmd_run)
