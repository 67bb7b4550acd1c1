"""Shorter waits in Flower 1.39's object transfer, for pflower's deployment processes.

A message's arrays travel as objects. A process that asks for an object before its sender
has pushed it waits ``PULL_INITIAL_BACKOFF`` = 1 s, then 2, 4, ... up to 10 s
(``flwr/supercore/constant.py``). In a deployment the SuperNode asks the SuperLink for the
objects right after it sees a message, and the ClientApp asks the SuperNode right after its
task starts, so a round paid 1-3 s of back-off on each hop while the objects were a few
milliseconds away. pflower's ServerApp, ``pflower-supernode`` and its ClientApp runner start
at 0.05 s and double up to 2 s; with Flower's 500 tries per object a transfer still waits
about 1,000 s before it fails.
"""

from __future__ import annotations

from logging import WARNING

INITIAL_BACKOFF_S = 0.05
BACKOFF_CAP_S = 2.0


def shorten_object_pull_backoff(initial: float = INITIAL_BACKOFF_S, cap: float = BACKOFF_CAP_S) -> bool:
    """Set the default back-off of Flower's object pulls in this process; False (and a
    warning) when this Flower has no such defaults (its transfer code changed)."""
    from flwr.common.logger import log
    from flwr.supercore.inflatable import inflatable_utils

    functions = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    if not all({"initial_backoff", "backoff_cap"} <= set(f.__kwdefaults__ or {}) for f in functions):
        log(WARNING, "pflower: this Flower's object pulls take no back-off defaults; keeping its own waits")
        return False
    for function in functions:
        function.__kwdefaults__.update(initial_backoff=initial, backoff_cap=cap)
    return True
