"""``pflower`` command line: run a simulation, compare runs, sweep a grid.

    pflower run [KEY=VALUE ...]          # Hydra overrides, e.g. strategy=fedbn seed=1 train.lr=0.01
    pflower compare RUN_DIR [RUN_DIR ...] [--out report.md]
    pflower sweep strategy=fedavg,fedbn seed=0,1,2 [KEY=VALUE ...]
    pflower tune strategy=fedavg,fedbn --grid train.lr=0.01,0.1 [--seeds 0,1,2]
    pflower data mnist --root DIR        # fill a dataset root (mnist, fashion-mnist)
    pflower deploy [--mode tls|insecure] experiment=deploy-3 strategy=fedavg,fedbn rounds=2
    pflower personalize RUN_DIR [RUN_DIR ...] [--lr LR ...] [--sizes S=0.5,M=1] [--epochs E]
    pflower personalize --adapt RUN_DIR [...] [--init mean|initial] [--epochs E] [--lr LR] [--on train|test]
    pflower adapt RUN_DIR [...]          # = personalize --adapt

A FedBasis run whose dataset has new clients is followed by their personalisation at
``personalize`` (``new_client_accuracy_*`` in its summary.json).

``run`` validates the config before anything starts, runs the Flower simulation through
``flwr run`` against a private SuperLink, stops every process it started, and exits
non-zero unless the run wrote its ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from common.config import (
    ConfigError,
    compose_config,
    expand_grid,
    override_key,
    split_overrides,
    to_toml_run_config,
)
from common.flower_compat import FlowerVersionError, check_flower_version
from learning.data import DatasetError, num_clients


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


EXIT_PARTIAL = 4   # the run completed but some clients are missing from its final numbers
EXIT_INTERRUPTED = 130   # Ctrl-C or SIGTERM: every Flower process of the run was stopped
DEFAULT_MAX_RECOVERIES = 3   # automatic resumes of a run whose processes died
ACTORS_PER_GPU = 8  # each client actor holds its own CUDA context (about 0.5 GB) and model


def gpu_share(num_clients: int, gpus: int, cpus: int, cpus_per_client: float) -> float:
    """GPUs per simulated client when ``--num-gpus`` is not given: 0 without a GPU, else
    the GPUs split evenly among the clients that can run at once (bounded by the clients,
    the CPUs they reserve and ``ACTORS_PER_GPU`` per GPU), as ``1/k`` of a GPU."""
    if gpus <= 0:
        return 0.0
    concurrent = min(num_clients, max(1, int(cpus // max(cpus_per_client, 1e-9))), ACTORS_PER_GPU * gpus)
    per_gpu = max(1, -(-concurrent // gpus))   # ceil
    return 1.0 / per_gpu


def cpus_per_run(jobs: int) -> int:
    """The CPUs each of ``jobs`` runs at once may use: an equal share of this machine's.

    Every run starts its own private Ray instance, and each would otherwise take the whole
    machine: ``jobs`` instances start ``jobs`` times as many clients as there are cores, each
    with as many threads as its ``--num-cpus`` (Ray sets ``OMP_NUM_THREADS``), and the cores
    spend the round switching threads (measured in docs/benchmarks.md)."""
    return max(1, (os.cpu_count() or 1) // max(jobs, 1))


def check_client_resources(num_cpus: float, num_gpus: float, ray_address: str,
                           ray_cpus: int | None = None) -> None:
    """A client that asks for more than this machine (or this run's ``--cpus`` share of it)
    has never starts: Flower's Ray engine builds an empty actor pool and the run dies after its
    start-up ("ActorPool is empty"). Refused before anything starts, for the private Ray
    instance (a cluster may have more). Flower 1.39 takes a whole number of CPUs per client
    (its ``client-resources-num-cpus`` is an integer), so a fraction is refused here too."""
    if num_cpus > 0 and not float(num_cpus).is_integer():
        raise ConfigError(f"--num-cpus {_num(num_cpus)}: Flower takes a whole number of CPUs per simulated "
                          f"client; use --num-cpus {max(1, round(num_cpus))} (to run more clients at once, "
                          "give the run more CPUs rather than each client less)")
    if ray_address != "local":
        return
    import torch

    cpus = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_cpus <= 0:
        raise ConfigError(f"--num-cpus {_num(num_cpus)}: each simulated client needs a positive CPU share "
                          "(e.g. --num-cpus 1)")
    if ray_cpus is not None and ray_cpus < 1:
        raise ConfigError(f"--cpus {ray_cpus}: a run needs at least one CPU (leave it out for all of them)")
    if ray_cpus is not None and num_cpus > ray_cpus:
        raise ConfigError(f"--num-cpus {_num(num_cpus)} per client, but this run may use {ray_cpus} CPUs "
                          f"(--cpus {ray_cpus}): no simulated client could start; use --num-cpus {ray_cpus} "
                          "or less, or a larger --cpus")
    if num_cpus > cpus:
        raise ConfigError(f"--num-cpus {_num(num_cpus)} per client, but this machine has {cpus} CPUs: no "
                          f"simulated client could start; use --num-cpus {cpus} or less (clients run "
                          "num_cpus_of_machine / --num-cpus at a time)")
    if num_gpus > max(gpus, 0):
        raise ConfigError(f"--num-gpus {_num(num_gpus)} per client, but this machine has {gpus} GPU(s): no "
                          "simulated client could start; use a share such as --num-gpus 0.25, or leave it "
                          "out (an automatic share)")


def resolve_gpu_share(cfg: DictConfig, num_clients: int, requested: float | None,
                      cpus_per_client: float, ray_cpus: int | None = None) -> float:
    """The ``client-resources-num-gpus`` of a simulation. Ray hides the GPU from actors that
    reserve none, so on a CUDA machine clients get a share unless told ``--num-gpus 0``;
    ``device=cuda`` without CUDA, or with ``--num-gpus 0``, is refused before anything starts."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = str(cfg.device)
    if device.startswith("cuda") and gpus == 0:
        raise ConfigError(f"device={device} but this machine has no CUDA GPU (torch "
                          f"{torch.__version__}); use device=auto (CUDA when present) or device=cpu")
    cpus = ray_cpus or os.cpu_count() or 1
    share = gpu_share(num_clients, gpus, cpus, cpus_per_client) if requested is None \
        else float(requested)
    if device.startswith("cuda") and share <= 0:
        raise ConfigError(f"device={device} with --num-gpus 0: Ray hides the GPU from clients that "
                          "reserve none; leave --num-gpus out (an automatic share) or pass e.g. --num-gpus 0.25")
    return share


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


def preflight(args: argparse.Namespace) -> tuple[DictConfig, dict[str, str], list[str], int]:
    """Everything that can be checked before a Flower process starts (exit 2 on failure):
    the config, the dataset (the whole image tree for image folders: missing or empty
    folders, nested folders, unreadable images, too few images for the split), and the run
    folder (another run's results, or a live run writing it)."""
    from learning.data import image_tree_problems
    from learning.data_cache import fill_cache, resolve_cache_dir
    from ops.recovery import expand_resume
    from server.results import RunFolderError, check_run_folder, finished_summary, lock_is_held

    run_cfg, rest = split_overrides(expand_resume(list(args.overrides)))
    run_cfg["results-root"] = str(Path(run_cfg.get("results-root", "results")).resolve())
    cfg = compose_config(run_cfg, rest)
    if finished_summary(Path(cfg.results_root) / cfg.run_name, cfg) is not None:
        raise RunFinished(Path(cfg.results_root) / cfg.run_name)
    n = num_clients(cfg.dataset)
    if cfg.dataset.source == "imagefolder" and not cfg.dataset.synthetic:
        problems = image_tree_problems(str(cfg.dataset.root), list(cfg.dataset.domains), verify_images=True)
        if problems:
            raise DatasetError(f"dataset {cfg.dataset.name!r}: the image-folder tree has problems:\n  - "
                               + "\n  - ".join(problems))
    # builds every split (fails here, not in a client) and caches them for the clients
    fill_cache(cfg.dataset, int(cfg.seed), resolve_cache_dir(str(cfg.data_cache)))
    if cfg.resume:
        run_cfg, rest = resume_overrides(cfg, run_cfg, rest)
    run_dir = Path(cfg.results_root) / cfg.run_name
    try:
        check_run_folder(run_dir, bool(cfg.resume), bool(cfg.overwrite))
    except RunFolderError as err:
        raise ConfigError(str(err)) from err
    if lock_is_held(run_dir):
        raise ConfigError(f"{run_dir} is being written by another live run; wait for it to finish "
                          "or stop it, or choose another run_name")
    return cfg, run_cfg, rest, n


@dataclass
class Attempt:
    """How one submission of the run ended: flwr's exit code, and, when the run died (no
    fresh summary.json and no FAILED from the ServerApp), why and where its output was kept."""

    code: int
    died: str = ""
    evidence: Path | None = None


class SimulationWatch:
    """Whether a simulation's processes are still there, asked once a second while
    ``flwr run --stream`` waits: False once the SuperLink has exited, or once the
    ``flwr-simulation`` process (seen before) has been gone for ``grace_s`` (a run that
    completes ends its stream within a second of its simulation exiting)."""

    def __init__(self, link: object, grace_s: float = 20.0) -> None:
        self.link, self.grace_s = link, grace_s
        self.seen, self.gone_since, self.reason = False, None, ""
        self.pid: int | None = None   # the simulation's, once found: then one /proc read a call

    def __call__(self) -> bool:
        from ops.deployment.launch import cmdline, pid_alive, process_tree

        proc = getattr(self.link, "proc", None)
        if proc is None or proc.poll() is not None:
            self.reason = "the SuperLink exited"
            return False
        if self.pid is None or not pid_alive(self.pid) or "flwr-simulation" not in cmdline(self.pid):
            self.pid = next((p for p in process_tree(proc.pid)[1:] if "flwr-simulation" in cmdline(p)), None)
        if self.pid is not None:
            self.seen, self.gone_since = True, None
            return True
        if self.seen:
            self.gone_since = self.gone_since or time.monotonic()
            if time.monotonic() - self.gone_since > self.grace_s:
                self.reason = f"the simulation process exited and the run had not ended {self.grace_s:.0f} s later"
                return False
        return True


def run_once(cfg: DictConfig, run_cfg: dict[str, str], rest: list[str], federation: str,
             keep: Path | None, attempt: int) -> Attempt:
    """Submit the run once on a private SuperLink; on any failure keep what explains it (the
    SuperLink's log and database, the run's status and stored log) in ``<run>/failures``."""
    from ops.deployment.launch import APP_DIR, flwr_run, run_info, run_log, simulation_superlink
    from ops.progress import RUN_LOG, RunOutput, run_progress
    from ops.recovery import death_reason, keep_evidence

    run_dir = Path(cfg.results_root) / cfg.run_name
    started = time.time()
    try:
        with simulation_superlink(keep_in=keep) as (link, flwr_home):
            print(f"pflower: private SuperLink {link.control_address} (work dir {link.workdir})", flush=True)
            write_pid_file(run_dir, link)
            watch = SimulationWatch(link)
            with run_progress(run_dir, int(cfg.rounds), f"{cfg.strategy.name} {cfg.run_name}") as bar, \
                    RunOutput(run_dir / RUN_LOG, bar, append=attempt > 1 or bool(cfg.resume)) as output:
                code = flwr_run(APP_DIR, flwr_home, to_toml_run_config(run_cfg, rest), federation, alive=watch,
                                on_line=output)
            if code != 0 and not watch.reason:
                follow_after_stream_loss(code, flwr_home, run_dir, int(cfg.rounds), alive=watch)
            if fresh(run_dir / "summary.json", started):
                return Attempt(code)
            # any failure keeps the processes' own output with the run
            info = run_info(flwr_home) if link.proc is not None and link.proc.poll() is None else None
            log_text = run_log(flwr_home, str(info["run-id"])) if info and "run-id" in info else ""
            evidence = None
            with contextlib.suppress(OSError):
                evidence = keep_evidence(link.workdir, run_dir, attempt, info, log_text)
            if fresh(run_dir / "FAILED", started):   # the ServerApp said why
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


RAY_ADDRESS_HELP = ("run the simulation's clients on an existing Ray cluster (host:port of its head, "
                    "started with `ray start --head`; other machines join with `ray start --address`), "
                    "for a simulation larger than one machine; default: the RAY_ADDRESS environment "
                    "variable, else a private Ray instance on this machine (never a cluster found by chance)")


def ray_cluster(address: str | None) -> str | None:
    """The Ray cluster a run joins: ``address``, else ``RAY_ADDRESS``; None for a private
    instance on this machine (neither set, or ``local``, which :func:`use_ray_cluster` itself
    writes into this process's environment)."""
    chosen = address or os.environ.get("RAY_ADDRESS")
    return chosen if chosen and chosen != "local" else None


def use_ray_cluster(address: str | None) -> str:
    """Where the simulation's Ray runs: ``address`` (or ``RAY_ADDRESS``), else ``local``, a
    private instance. Ray's own default would join any cluster ``ray start`` left running on
    this machine; the simulation process (started by the SuperLink) inherits the variable."""
    chosen = ray_cluster(address) or "local"
    os.environ["RAY_ADDRESS"] = chosen
    return chosen


def simulation_config(num_clients: int, num_cpus: float, num_gpus: float, ray_cpus: int | None) -> str:
    """Flower's ``--federation-config`` of a simulation: one SuperNode per client, each
    client's Ray resources, and (``ray_cpus``) the CPUs the run's private Ray instance
    may use, all of the machine's when None."""
    config = (f"num-supernodes={num_clients} client-resources-num-cpus={_num(num_cpus)} "
              f"client-resources-num-gpus={_num(num_gpus)}")
    return config + (f" init-args-num-cpus={ray_cpus}" if ray_cpus is not None else "")


def cmd_run(args: argparse.Namespace) -> int:
    from ops.deployment.launch import LaunchError
    from server.checkpoint import checkpoint_round
    from server.results import record_recovery

    try:
        cfg, run_cfg, rest, n = preflight(args)
        ray_cpus = getattr(args, "cpus", None)
        num_gpus = resolve_gpu_share(cfg, n, args.num_gpus, float(args.num_cpus), ray_cpus)
        ray_address = use_ray_cluster(getattr(args, "ray_address", None))
        check_client_resources(float(args.num_cpus), num_gpus, ray_address, ray_cpus)
    except RunFinished as done:
        return say_finished(Path(str(done)))
    except (ConfigError, DatasetError) as err:
        print(f"pflower: {err}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.results_root) / cfg.run_name
    summary = run_dir / "summary.json"
    started = time.time()
    federation = simulation_config(n, float(args.num_cpus), num_gpus,
                                   ray_cpus if ray_address == "local" else None)
    print(f"pflower: {cfg.strategy.name} on {cfg.dataset.name} ({n} clients), {cfg.rounds} rounds -> {run_dir}"
          + (f" ({_num(num_gpus)} GPU per client)" if num_gpus else "")
          + ("" if ray_address == "local" else f" on the Ray cluster at {ray_address}"))
    keep = run_dir / "superlink" if getattr(args, "keep_temp", False) else None
    max_recoveries = int(getattr(args, "max_recoveries", DEFAULT_MAX_RECOVERIES))
    recoveries, last_round = 0, checkpoint_round(run_dir) if cfg.resume else None
    try:
        while True:
            attempt = run_once(cfg, run_cfg, rest, federation, keep, recoveries + 1)
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
            cfg, run_cfg, rest = resume_config(run_dir)
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
    if str(cfg.strategy.name) == "fedbasis" and int(cfg.dataset.new_clients_per_domain) > 0 \
            and not cfg.personalize.after_run:
        print(f"pflower: the new clients are not personalised (personalize.after_run=false); "
              f"pflower personalize {run_dir} does it")
    elif str(cfg.strategy.name) == "fedbasis" and int(cfg.dataset.new_clients_per_domain) > 0:
        from ops.personalize import personalize_run

        settings = cfg.personalize
        try:
            personalize_run(run_dir, lrs=list(settings.lrs) if settings.lr is None else [float(settings.lr)],
                            sizes=dict([max(settings.sizes.items(), key=lambda item: float(item[1]))]))
        except (ValueError, FileNotFoundError, RuntimeError) as err:
            print(f"pflower: the run completed, but personalising its new clients failed: {err}; "
                  f"retry with: pflower personalize {run_dir}", file=sys.stderr)
            return 1
    s = json.loads(summary.read_text())
    if "new_client_accuracy_mean" in s:
        how = s.get("new_client_protocol", {})
        print(f"pflower: new clients (personalised, {cfg.personalize.epochs} epochs at lr {how.get('lr')}, "
              f"{how.get('lr_selected_by', 'fixed')}): "
              f"accuracy mean {s['new_client_accuracy_mean']:.4f} min {s['new_client_accuracy_min']:.4f}")
    return report_done(s, summary)


def resume_config(run_dir: Path) -> tuple[DictConfig, dict[str, str], list[str]]:
    """The configuration that resumes ``run_dir`` (its saved overrides plus ``resume=``), as
    ``pflower run resume=<run_dir>`` composes it."""
    from ops.recovery import expand_resume

    run_cfg, rest = split_overrides(expand_resume([f"resume={run_dir}"]))
    run_cfg, rest = resume_overrides(compose_config(run_cfg, rest), run_cfg, rest, quiet=True)
    return compose_config(run_cfg, rest), run_cfg, rest


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
        atomic_write_text(run_dir / "FAILED", f"{reason}\n{hint}\n")
    print(f"pflower: run failed: {reason}\npflower: {hint}", file=sys.stderr)
    return 1


ACTIVE = ("pending", "starting", "running")


def follow_after_stream_loss(code: int, flwr_home: Path, run_dir: Path, rounds: int,
                             poll_s: float = 3.0, alive: Callable[[], bool] | None = None) -> None:
    """``flwr run --stream`` can exit while the run goes on (the log stream to the SuperLink
    dropped, e.g. a SuperLink too busy to answer in time). Ask the SuperLink (a few times:
    the same load may delay that answer): while the run is still active, follow its progress
    from ``metrics.jsonl`` until it finishes or its processes are gone (``alive``), instead
    of killing a healthy run."""
    from ops.deployment.launch import run_status

    status = None
    for _ in range(5):
        status = run_status(flwr_home)
        if status is not None or (alive is not None and not alive()):
            break
        time.sleep(poll_s)
    if status is None or not status.startswith(ACTIVE):
        return
    print(f"pflower: the log stream ended (flwr exit code {code}) but the run is still {status} on "
          "the SuperLink; following it from its metrics", file=sys.stderr, flush=True)
    metrics, seen, unreachable = run_dir / "metrics.jsonl", 0, 0
    while True:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        for line in lines[seen:]:
            with contextlib.suppress(json.JSONDecodeError, KeyError):
                rec = json.loads(line)
                ev = rec.get("evaluate", {})
                acc = f" accuracy mean {ev['accuracy_mean']:.4f}" if ev else ""
                print(f"pflower: [round {rec['round']}/{rounds}]{acc}", flush=True)
        seen = len(lines)
        status = run_status(flwr_home)
        unreachable = unreachable + 1 if status is None else 0
        if alive is not None and not alive():
            print("pflower: the run's processes are gone", file=sys.stderr, flush=True)
            return
        if unreachable >= 5 or (status is not None and not status.startswith(ACTIVE)):
            print(f"pflower: the run is {status or 'unreachable'}", file=sys.stderr, flush=True)
            return
        time.sleep(poll_s)


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


def resume_overrides(cfg: DictConfig, run_cfg: dict[str, str], rest: list[str], quiet: bool = False
                     ) -> tuple[dict[str, str], list[str]]:
    """``resume=<run dir>``: verify the folder and its checkpoint (checksum, strategy,
    model, dataset, seed, clients, round) before anything starts, and make the resumed run
    write into that same folder (its run_name and results_root)."""
    from server.checkpoint import CheckpointError, check_checkpoint
    from server.loop import checkpoint_identity

    run_dir = Path(str(cfg.resume))
    if not run_dir.is_dir():
        raise ConfigError(f"resume={run_dir} is not a run folder; give the path of an earlier run")
    try:
        last = check_checkpoint(run_dir, checkpoint_identity(cfg, num_clients(cfg.dataset)), int(cfg.rounds))
    except CheckpointError as err:
        raise ConfigError(f"cannot resume: {err}") from err
    if not quiet:
        stale_processes(run_dir)
        print(f"pflower: resuming {run_dir} after round {last}")
    run_cfg = {**run_cfg, "run-name": str(cfg.run_name), "results-root": str(cfg.results_root)}
    rest = [o for o in rest if override_key(o) != "resume"] + [f"resume={run_dir}"]
    return run_cfg, rest


def cmd_compare(args: argparse.Namespace) -> int:
    from ops.compare import compare_runs

    try:
        text = compare_runs([Path(p) for p in args.runs], out=Path(args.out) if args.out else None,
                            plot=Path(args.plot) if args.plot else None)
    except (FileNotFoundError, ValueError) as err:
        print(f"pflower compare: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def run_folder(combo: list[str]) -> tuple[Path, bool]:
    """The folder a configuration runs into, and whether a finished run is there to reuse
    (``overwrite=true`` never reuses; a run marked FAILED is run again)."""
    from server.results import finished_summary

    run_cfg, rest = split_overrides(combo)
    root = Path(run_cfg.get("results-root", "results")).resolve()
    cfg = compose_config({**run_cfg, "results-root": str(root)}, rest)
    folder = root / cfg.run_name
    return folder, finished_summary(folder, cfg) is not None


def continue_unfinished(combo: list[str], folder: Path, who: str = "sweep") -> list[str]:
    """The overrides that go on with ``combo`` in a sweep or tune whose folder holds an
    unfinished run (Ctrl-C, a killed machine, a failed round): resumed from its checkpoint
    (``resume=<folder>``, the command a user would type; bit-identical on the CPU), or run
    afresh when it stopped before computing anything (only its config was written). A folder
    with results but no checkpoint is left to ``pflower run``, which refuses to overwrite it."""
    from server.checkpoint import checkpoint_round
    from server.results import OVERRIDES_FILE, existing_run_files

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


def run_or_reuse(combo: list[str], args: argparse.Namespace, who: str = "sweep") -> tuple[Path | None, bool]:
    """Run one configuration, or reuse its finished folder (``overwrite=true`` runs it again).
    Returns (the run folder, or None when it failed; whether it completed only partly)."""
    folder, done = run_folder(combo)
    if done:
        say_reused(who, folder)
        return folder, False
    code = cmd_run(argparse.Namespace(overrides=continue_unfinished(combo, folder, who), num_cpus=args.num_cpus,
                                      num_gpus=args.num_gpus,
                                      max_recoveries=args.max_recoveries, ray_address=args.ray_address))
    if code == EXIT_INTERRUPTED:   # Ctrl-C stops the sweep (or tune), not only its current run
        raise KeyboardInterrupt(f"{who} interrupted during {' '.join(combo)}")
    if code not in (0, EXIT_PARTIAL):
        return None, False
    return folder, code == EXIT_PARTIAL


def run_command(combo: list[str], args: argparse.Namespace) -> list[str]:
    """The ``pflower run`` command line of one configuration, with the sweep's options."""
    cmd = [sys.executable, "-m", "ops.cli", "run", *combo, "--num-cpus", _num(args.num_cpus),
           "--max-recoveries", str(args.max_recoveries)]
    if args.num_gpus is not None:
        cmd += ["--num-gpus", _num(args.num_gpus)]
    if args.ray_address:
        cmd += ["--ray-address", str(args.ray_address)]
    if getattr(args, "cpus", None) is not None:
        cmd += ["--cpus", str(args.cpus)]
    return cmd


def run_in_parallel(grid: list[list[str]], args: argparse.Namespace, jobs: int, who: str = "sweep",
                    poll_s: float = 1.0) -> list[tuple[Path | None, bool]]:
    """``--jobs N``: the grid's runs N at a time, each a ``pflower run`` process of its own
    (its own SuperLink and Ray instance), so a many-core box runs a table's small runs side by
    side instead of one after another (a run of a small model uses about two cores however
    many it is given: its server and SuperLink are sequential). Each run's output goes to
    ``<results_root>/.sweep-logs/<run name>.log``; a finished run is reused, as sequentially.
    Returns, in grid order, what :func:`run_or_reuse` returns for each configuration."""
    import subprocess

    from ops.deployment.launch import kill_tree

    if ray_cluster(args.ray_address) is None:   # each private Ray gets its share
        args = argparse.Namespace(**{**vars(args), "cpus": cpus_per_run(jobs)})
        print(f"pflower {who}: {jobs} runs at once, each on {args.cpus} of this machine's {os.cpu_count()} "
              f"CPUs ({_num(args.num_cpus)} per client)", flush=True)
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
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                i, combo, folder = waiting.pop(0)
                log = folder.parent / ".sweep-logs" / f"{folder.name}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                with log.open("w") as out:
                    proc = subprocess.Popen(run_command(continue_unfinished(combo, folder, who), args), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                running[folder] = (proc, log, i)
                print(f"pflower {who}: [{i}/{len(grid)}] started {' '.join(combo)} (output: {log})", flush=True)
            for folder, (proc, log, i) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[folder]
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


def run_all(grid: list[list[str]], args: argparse.Namespace, who: str = "sweep") -> list[tuple[Path | None, bool]]:
    """A batch of configurations: one after another in this process, or ``--jobs N`` at a time
    (:func:`run_in_parallel`). Returns what :func:`run_or_reuse` returns for each, in order;
    Ctrl-C stops the whole batch (``KeyboardInterrupt``)."""
    jobs = int(getattr(args, "jobs", 1) or 1)
    if jobs > 1:
        return run_in_parallel(grid, args, jobs, who)
    outcomes = []
    for i, combo in enumerate(grid, 1):
        print(f"pflower {who}: [{i}/{len(grid)}] {' '.join(combo)}", flush=True)
        outcomes.append(run_or_reuse(combo, args, who))
    return outcomes


def cmd_sweep(args: argparse.Namespace) -> int:
    grid = expand_grid(args.overrides)
    try:  # every run's configuration is checked before the first one starts
        for combo in grid:
            run_folder(combo)
    except ConfigError as err:
        print(f"pflower sweep: {err}", file=sys.stderr)
        return 2
    try:
        outcomes = run_all(grid, args)
    except KeyboardInterrupt:
        print(f"pflower sweep: interrupted ({len(grid)} runs in the grid); finished runs are reused when the "
              "same sweep is run again", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    runs = [folder for folder, _ in outcomes if folder is not None]
    failures = sum(1 for folder, partial in outcomes if folder is None or partial)
    if runs:
        cmd_compare(argparse.Namespace(runs=[str(r) for r in runs], out=args.out, plot=args.plot))
    return 1 if failures else 0


JOBS_HELP = ("runs at once, each its own `pflower run` process (default 1: one after another) on an equal "
             "share of this machine's CPUs (cores / N; --num-cpus of them per client); a run of a small model "
             "uses about two cores, so e.g. --jobs 8 on 16 cores; each run's output goes to "
             "<results_root>/.sweep-logs/")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def absolute_timing_folder() -> None:
    """``PFLOWER_TIMING=<folder>`` as an absolute path: the processes a run starts (SuperLink,
    ServerApp, Ray's workers) do not share this one's working directory."""
    from common.timing import timing_folder

    folder = timing_folder()
    if folder is not None:
        os.environ["PFLOWER_TIMING"] = str(folder.resolve())


def install_signal_handlers() -> None:
    """Ctrl-C (SIGINT) and SIGTERM become KeyboardInterrupt, so every command stops the Flower
    processes it started. Python leaves SIGINT ignored when it was ignored at start-up (e.g. a
    job started in the background by a non-interactive shell); we want it handled anyway."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def overrides_help() -> str:
    """The keys, strategies, datasets and models a run takes (from conf/, never stale)."""
    from common.config import group_options

    groups = "\n".join(f"  {g:<11} {', '.join(group_options(g))}" for g in ("strategy", "dataset", "model",
                                                                           "experiment"))
    return f"""overrides (KEY=VALUE, anywhere on the line, options too):
{groups}
  resume=<run folder> alone resumes a run with its own configuration (only rounds, round_timeout,
    wait_for_clients, device, deterministic, data_cache, checkpoint_every, stream_replies_mb may change)
  rounds, seed, run_name, results_root, overwrite=true, device,
  eval_every, eval_bn_statistics, eval_bn_compare, fraction_train, min_train_clients, round_timeout, checkpoint_every,
  stream_replies_mb,
  train.{{lr,local_epochs,batch_size,momentum,weight_decay,optimizer,amp}},
  dataset.{{root,clients_per_domain,new_clients_per_domain,partition,dirichlet_alpha,image_size}},
  strategy.<option> (see conf/strategy/<name>.yaml), finetune.*, personalize.*
  e.g.  pflower run strategy=fdse --num-gpus 0.25 rounds=5
        pflower run dataset=imagefolder dataset.root=/data/my-digits strategy=fedbn
A run writes <results_root>/<run_name>/ (default name [<experiment>-]<strategy>-<dataset>-
<model>-s<seed>[-<hash of other overrides>]); an existing run folder is refused unless
resume=<folder> or overwrite=true. Exit codes: 0 done, 1 failed, 2 bad input (nothing
started), 3 Flower could not start, 4 done but some clients are missing, 130 interrupted.
A run whose simulation dies is resumed from its checkpoint by itself (--max-recoveries)."""


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    absolute_timing_folder()
    parser = argparse.ArgumentParser(prog="pflower", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run one simulation", epilog=overrides_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides KEY=VALUE")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per simulated client (a whole number; --cpus is the whole run's share)")
    p.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs per simulated client (e.g. 0.25; default: an even share of the "
                        "machine's GPUs when CUDA is present, 0 without)")
    p.add_argument("--keep-temp", action="store_true",
                   help="keep the private SuperLink's folder (log, database) as <run folder>/superlink")
    p.add_argument("--max-recoveries", type=int, default=DEFAULT_MAX_RECOVERIES,
                   help="times a run whose processes died is resumed from its checkpoint by itself "
                        f"(default {DEFAULT_MAX_RECOVERIES}; 0 = never)")
    p.add_argument("--ray-address", default=None, help=RAY_ADDRESS_HELP)
    p.add_argument("--cpus", type=int, default=None,
                   help="CPUs this whole run's private Ray instance may use (default: all of this machine's; "
                        "`pflower sweep --jobs N` gives each run cores / N); --num-cpus is per client")
    p.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="compare run folders in one table and plot")
    c.add_argument("runs", nargs="+")
    c.add_argument("--out", default="", help="write the Markdown table here")
    c.add_argument("--plot", default="", help="write the comparison plot here (PNG)")
    c.set_defaults(func=cmd_compare)
    s = sub.add_parser("sweep", help="run a grid (comma lists are swept) and compare it",
                       epilog=overrides_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("overrides", nargs="+")
    s.add_argument("--out", default="", help="write the grid's Markdown table here (as compare --out)")
    s.add_argument("--plot", default="", help="write the grid's comparison plot here (PNG)")
    s.add_argument("--num-cpus", type=float, default=1.0,
                   help="CPUs per simulated client, as for run (not --cpus: a whole run's share)")
    s.add_argument("--num-gpus", type=float, default=None, help="as for run")
    s.add_argument("--max-recoveries", type=int, default=DEFAULT_MAX_RECOVERIES, help="as for run")
    s.add_argument("--ray-address", default=None, help="as for run")
    s.add_argument("--jobs", type=int, default=1, help=JOBS_HELP)
    s.set_defaults(func=cmd_sweep)
    from ops.data import add_parser as add_data_parser
    from ops.deployment.deploy import add_parser as add_deploy_parser
    from ops.personalize import add_parser as add_personalize_parser
    from ops.tune import add_parser as add_tune_parser

    add_deploy_parser(sub)
    add_personalize_parser(sub)
    add_data_parser(sub)
    add_tune_parser(sub, run_all, cmd_compare, DEFAULT_MAX_RECOVERIES, JOBS_HELP)
    args, extra = parser.parse_known_args(argv)
    # options may come anywhere: `run strategy=fdse --num-gpus 0.25 rounds=5` leaves
    # `rounds=5` unparsed (argparse stops the positional list at the option)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "jobs", 1) < 1:
        parser.error(f"--jobs {args.jobs}: give the number of runs at once, 1 or more (1 = one after another)")
    jobs, num_cpus = getattr(args, "jobs", 1), getattr(args, "num_cpus", 1.0)
    if jobs > 1 and ray_cluster(getattr(args, "ray_address", None)) is None and num_cpus > cpus_per_run(jobs):
        parser.error(f"--jobs {jobs} gives each run {cpus_per_run(jobs)} of this machine's {os.cpu_count()} "
                     f"CPUs, but --num-cpus {_num(num_cpus)} asks for more per client: no client could start; "
                     f"use --num-cpus {cpus_per_run(jobs)} or less, or fewer --jobs")
    try:
        check_flower_version()     # before anything starts: pflower adapts Flower 1.39's internals
    except FlowerVersionError as err:
        print(f"pflower: {err}", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
