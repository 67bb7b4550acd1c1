"""``pflower-superlink`` (``python -m ops.node.superlink``): Flower's ``flower-superlink`` (same arguments) whose tasks may
miss heartbeats for 10 minutes instead of 60 s before their run is failed
(``common/flower_compat.py``: a loaded machine lost 500-round runs to that), and whose
SuperExec, the process that starts every ServerApp, is started again when it dies
(``ops/node/keepers.py``). pflower's launchers and the Docker images start the SuperLink this
way; a plain ``flower-superlink`` works the same, with Flower's 60 s and no SuperExec restart."""

from __future__ import annotations

import os
import sys

from common.flower_compat import check_flower_version, run_superlink
from ops.node.keepers import SuperExecKeeper


def main() -> None:
    check_flower_version()
    SuperExecKeeper(os.getpid()).start()
    run_superlink(sys.argv[1:])


if __name__ == "__main__":
    main()
