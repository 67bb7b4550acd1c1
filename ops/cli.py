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
import importlib
import os
import signal
import sys

from common.flower_compat import FlowerVersionError, check_flower_version
from ops.resources import cpus_per_run, number_text, ray_cluster, usable_cpus

# every command: a module whose add_parser(sub) registers it (its options, its func), in the
# order of the help; the options several share are in ops/options.py
COMMANDS = ("ops.running", "ops.compare", "ops.sweep", "ops.deployment.deploy", "ops.personalize", "ops.data",
            "ops.tune")


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


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    absolute_timing_folder()
    parser = argparse.ArgumentParser(prog="pflower", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        importlib.import_module(module).add_parser(sub)
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
