"""``pflower-superlink`` (``python -m ops.node.superlink``): Flower's ``flower-superlink`` (same arguments) whose tasks may
miss heartbeats for 10 minutes instead of 60 s before their run is failed
(``common/flower_compat.py``: a loaded machine lost 500-round runs to that). pflower's
launchers and the Docker images start the SuperLink this way; a plain ``flower-superlink`` works
the same, with Flower's 60 s."""

from __future__ import annotations

import sys

from common.flower_compat import check_flower_version, run_superlink


def main() -> None:
    check_flower_version()
    run_superlink(sys.argv[1:])


if __name__ == "__main__":
    main()
