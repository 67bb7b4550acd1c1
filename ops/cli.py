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
import os
import signal
import sys

from common.flower_compat import FlowerVersionError, check_flower_version
from ops.compare import cmd_compare
from ops.resources import RAY_ADDRESS_HELP, cpus_per_run, number_text, ray_cluster, usable_cpus
from ops.running import DEFAULT_MAX_RECOVERIES, cmd_run
from ops.sweep import JOBS_HELP, cmd_sweep


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


def run_options() -> argparse.ArgumentParser:
    """The options of every command that starts runs (run, sweep, tune): each simulated
    client's resources, where its Ray runs, and how often a dead run resumes by itself."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-cpus", type=float, default=1.0,
                   help="CPUs per simulated client (a whole number; --cpus is the whole run's share)")
    p.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs per simulated client (e.g. 0.25; default: an even share of the "
                        "machine's GPUs when CUDA is present, 0 without)")
    p.add_argument("--max-recoveries", type=int, default=DEFAULT_MAX_RECOVERIES,
                   help="times a run whose processes died is resumed from its checkpoint by itself "
                        f"(default {DEFAULT_MAX_RECOVERIES}; 0 = never)")
    p.add_argument("--ray-address", default=None, help=RAY_ADDRESS_HELP)
    return p


def batch_options() -> argparse.ArgumentParser:
    """The options of the commands that run a batch (sweep, tune): its table, its plot, and
    how many of its runs go at once."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", default="", help="write the batch's Markdown table here (as compare --out)")
    p.add_argument("--plot", default="", help="write the batch's comparison plot here (PNG)")
    p.add_argument("--jobs", type=int, default=1, help=JOBS_HELP)
    return p


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
  strategy.<option> (see conf/strategy/<name>.yaml), finetune.*, personalize.*,
  privacy.{{dp,clip_norm,noise_multiplier,delta,max_epsilon,noise_seed}} (docs/privacy.md)
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
    runs, batches = run_options(), batch_options()   # the options run, sweep and tune share
    p = sub.add_parser("run", help="run one simulation", parents=[runs], epilog=overrides_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides KEY=VALUE")
    p.add_argument("--keep-temp", action="store_true",
                   help="keep the private SuperLink's folder (log, database) as <run folder>/superlink")
    p.add_argument("--cpus", type=int, default=None,
                   help="CPUs this whole run's private Ray instance may use (default: all of this machine's; "
                        "`pflower sweep --jobs N` gives each run cores / N); --num-cpus is per client")
    p.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="compare run folders in one table and plot: one row per configuration "
                                        "(seeds averaged), labelled by the keys that set it apart")
    c.add_argument("runs", nargs="+")
    c.add_argument("--out", default="", help="write the Markdown table here")
    c.add_argument("--plot", default="", help="write the comparison plot here (PNG)")
    c.set_defaults(func=cmd_compare)
    s = sub.add_parser("sweep", help="run a grid (comma lists are swept) and compare it", parents=[runs, batches],
                       epilog=overrides_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("overrides", nargs="+")
    s.set_defaults(func=cmd_sweep)
    from ops.data import add_parser as add_data_parser
    from ops.deployment.deploy import add_parser as add_deploy_parser
    from ops.personalize import add_parser as add_personalize_parser
    from ops.tune import add_parser as add_tune_parser

    add_deploy_parser(sub)
    add_personalize_parser(sub)
    add_data_parser(sub)
    add_tune_parser(sub, [runs, batches])
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
        parser.error(f"--jobs {jobs} gives each run {cpus_per_run(jobs)} of this machine's {usable_cpus()} "
                     f"CPUs, but --num-cpus {number_text(num_cpus)} asks for more per client: no client could start; "
                     f"use --num-cpus {cpus_per_run(jobs)} or less, or fewer --jobs")
    try:
        check_flower_version()     # before anything starts: pflower adapts Flower 1.39's internals
    except FlowerVersionError as err:
        print(f"pflower: {err}", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
