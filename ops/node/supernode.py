"""``pflower-supernode``: Flower's ``flower-supernode`` (same arguments, same protocol) with
changes that shorten a deployment round (measured in ``docs/benchmarks.md``, (d)); the
patches to Flower's internals are in ``common/flower_compat.py``:

- Its idle waits last at most ``--poll-interval`` seconds (default 0.2). Flower 1.39's
  SuperNode sleeps 3 s when the SuperLink has no message for it and looks for a ClientApp's
  reply every 0.5 s (``flwr/supernode/start_client_internal.py``, both hard-coded); it asks
  again right after sending its reply, while the server still aggregates, so every round
  waited about 3 s for nothing. Its SuperExec looks for tasks at the same pace (1 s by
  default; ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` set in the environment wins). Each wait is
  one small request to the SuperLink: for thousands of nodes raise it (3 is Flower's pace).
- Its ClientApps run in one long-lived runner per node (``ops/node/runner.py``) instead of
  one fresh process per message (``--no-runner``: Flower's processes). A runner that dies is
  started again, and the task it died with is failed at once (the server sends its message
  again), not after 10 minutes without heartbeats.
- Its SuperExec, the process that starts its ClientApps, is started again when it dies
  (``ops/node/keepers.py``); Flower's would leave the node pulling messages it never runs.
- Its object pulls back off from 0.05 s, not 1 s (``common/flower_compat.py``).
- A ClientApp task may miss heartbeats for 10 minutes, not 60 s, before it is failed
  (``common/flower_compat.py``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from common.flower_compat import check_flower_version, run_supernode
from ops.node.keepers import SuperExecKeeper

DEFAULT_POLL_INTERVAL = 0.2


def split_poll_interval(argv: list[str]) -> tuple[float, list[str]]:
    """``--poll-interval S`` (or ``=S``) out of the arguments; the rest go to flower-supernode."""
    interval, rest, i = DEFAULT_POLL_INTERVAL, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--poll-interval" or arg.startswith("--poll-interval="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            try:
                interval = float(value)
            except ValueError:
                raise SystemExit(f"pflower-supernode: --poll-interval needs seconds (e.g. 0.2), got {value!r}") from None
            if not 0.01 <= interval <= 60:
                raise SystemExit(f"pflower-supernode: --poll-interval {interval} is not within [0.01, 60] s")
            continue
        rest.append(arg)
        i += 1
    return interval, rest


def use_runner(argv: list[str]) -> tuple[bool, list[str]]:
    """``--no-runner``: Flower's own process per message instead of the node's runner."""
    return "--no-runner" not in argv, [a for a in argv if a != "--no-runner"]


def start_runner() -> None:
    """The node's ClientApp runner (``ops/node/runner.py``) and the stand-in
    ``flwr-clientapp`` that hands it each task, first on the SuperExec's ``PATH``."""
    from ops.node.runner import (
        REAL_CLIENTAPP_ENV,
        RUNNER_ENV,
        RunnerKeeper,
        runner_dir,
        write_stand_in,
    )

    real = shutil.which("flwr-clientapp") or str(Path(sys.executable).parent / "flwr-clientapp")
    if not Path(real).is_file():
        raise SystemExit("pflower-supernode: flwr-clientapp not found; install flwr (pip install -e .)")
    keeper = RunnerKeeper(os.getpid())   # restarts a runner that died; fails the task it died with
    keeper.start()
    address = keeper.address
    stand_in = write_stand_in(runner_dir() / "bin")
    os.environ[RUNNER_ENV], os.environ[REAL_CLIENTAPP_ENV] = str(address), real
    os.environ["PATH"] = f"{stand_in.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def main() -> None:
    interval, rest = split_poll_interval(sys.argv[1:])
    runner, rest = use_runner(rest)
    check_flower_version()
    if "--help" in rest or "-h" in rest:
        print(f"pflower-supernode: flower-supernode's options below, and\n"
              f"  --poll-interval S  longest idle wait of the SuperNode and its SuperExec, seconds "
              f"(default {DEFAULT_POLL_INTERVAL})\n"
              f"  --no-runner        one process per message, as Flower does (default: one runner per node)\n")
    elif runner:
        start_runner()

    # the SuperExec it starts looks for ClientApp tasks every second by default
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(interval))
    SuperExecKeeper(os.getpid()).start()   # Flower's SuperExec started again when it dies
    run_supernode(rest, interval)   # capped sleeps, short object pulls, long task heartbeats


if __name__ == "__main__":
    main()
