"""``python -m ops.superlink``: Flower's ``flower-superlink`` (same arguments) whose tasks may
miss heartbeats for 10 minutes instead of 60 s before their run is failed
(``common/flower_waits.py``: a loaded machine lost 500-round runs to that). pflower's
launchers start the SuperLink this way; a plain ``flower-superlink`` works the same, with
Flower's 60 s."""

from __future__ import annotations

import sys

from common.flower_waits import lengthen_task_heartbeat_ttl


def main() -> None:
    from flwr.superlink.cli import flower_superlink

    lengthen_task_heartbeat_ttl()
    sys.argv[0] = "flower-superlink"
    flower_superlink()


if __name__ == "__main__":
    main()
