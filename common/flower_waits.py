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


# A Flower 1.39 task (the simulation process, a ServerApp or ClientApp process) is declared
# dead when its heartbeats stop for HEARTBEAT_PATIENCE x HEARTBEAT_DEFAULT_INTERVAL = 2 x 30 s
# (``flwr/supercore/corestate/sql_corestate.py`` and ``in_memory_corestate.py``:
# ``activate_task``/``acknowledge_task_heartbeat``); the SuperLink then fails the run and the
# simulation ends at its next heartbeat. A heartbeat is a small HTTP call from a thread of
# the task's process, every 17.5-22.5 s; a process that cannot make one for 60 s (paused,
# starved on a loaded machine, or a SuperLink that cannot answer) loses a run of hours.
# Stopping the simulation process (SIGSTOP) for 75 s reproduces it: the run ends 56 s into
# the pause with no error of its own. pflower watches its processes itself (a simulation that
# exits is noticed within seconds, ops/cli.py), so the SuperLink may wait far longer.
TASK_HEARTBEAT_TTL_S = 600.0


def lengthen_task_heartbeat_ttl(ttl_s: float = TASK_HEARTBEAT_TTL_S) -> bool:
    """Let a task miss heartbeats for ``ttl_s`` seconds before it is failed, in this process
    (a SuperLink or SuperNode). Node heartbeats (a SuperNode's liveness) are not changed.
    False (and a warning) when this Flower's task state has no such constants."""
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
    from flwr.common.logger import log

    try:
        from flwr.supercore.corestate import in_memory_corestate, sql_corestate
    except ImportError:
        log(WARNING, "pflower: this Flower has no task heartbeat state; keeping its own timeout")
        return False
    modules = (in_memory_corestate, sql_corestate)
    if not all(isinstance(getattr(m, "HEARTBEAT_PATIENCE", None), int) for m in modules):
        log(WARNING, "pflower: this Flower's task heartbeats changed; keeping its own timeout")
        return False
    patience = max(2, int(round(ttl_s / HEARTBEAT_DEFAULT_INTERVAL)))
    for module in modules:
        module.HEARTBEAT_PATIENCE = patience   # type: ignore[attr-defined]
    return True
