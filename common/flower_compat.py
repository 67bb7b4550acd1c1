"""Every use of Flower's internals, in one place, behind one version check.

pflower uses Flower's public API (``flwr.app``, ``flwr.serverapp``, ``flwr.clientapp``,
``flwr.simulation``, ``flwr.common.logger``) everywhere else (``tests/test_boundaries.py``
fails on any other ``flwr`` import outside this module). What the public API does not offer,
and a deployment needs, is done here; each item names Flower's file it depends on and why it is
needed. Written for, and tested on, two minor releases: **1.42** (what a fresh install resolves;
its Fleet API is HTTP on the SuperLink's one uvicorn port) and **1.39** (the last whose Fleet API
is gRPC). Every item below was re-read against both wheels: the files each names are the same
path in both, and all of them still apply on 1.42 (``http_grid.py`` still sleeps 3 s between
pulls, ``start_client_internal.py`` still sleeps 3 s and 0.5 s and lets
``RunNotRunningException`` escape its message pull, ``InMemoryLinkState.get_message_ins``
still scans; 1.42's new destination-indexed message table is called by nothing). What differs
between the two releases is the Fleet transport only: :func:`fleet_over_http`. Another minor
release may move or change any of them, so :func:`check_flower_version` refuses to start on one
(``pflower`` calls it before starting anything); ``bench/next_flower.py`` reports, for the
newest Flower the package index serves, which items no longer apply.

1. :func:`send_and_receive`: replies pulled every 0.1 s from a deployment's grid
   (``flwr/superlink/grid/http_grid.py`` sleeps 3 s between pulls).
2. :func:`shorten_object_pull_backoff`: arrays pulled with a 0.05 s first back-off, not 1 s
   (``flwr/supercore/inflatable/inflatable_utils.py``).
3. :func:`lengthen_task_heartbeat_ttl`: a busy task may miss heartbeats for 10 minutes, not
   60 s (``flwr/supercore/corestate/*_corestate.py``).
4. :func:`run_supernode`: the SuperNode's idle sleeps capped at the poll interval
   (``flwr/supernode/start_client_internal.py`` sleeps 3 s).
5. :func:`run_superlink`: Flower's SuperLink entry point with item 3 applied.
6. :func:`run_clientapp_task`: what ``flwr-clientapp`` does for one task, in a long-lived
   process (``flwr/supernode/runtime/run_clientapp.py``, ``flwr/supernode/cli/flwr_clientapp.py``).
7. :func:`index_undelivered_messages`: the simulation finds a node's messages through an index,
   not a scan of every stored message for every node every 0.1 s
   (``flwr/server/superlink/linkstate/in_memory_linkstate.py``).
8. :func:`release_messages_of_stopped_runs`: a message whose run stops while the SuperNode
   receives it is dropped, not left as a task whose ClientApp waits for its arrays
   (``flwr/supernode/start_client_internal.py``).
9. :func:`wait_for_a_store`, :func:`engine_waits_for_messages`: the simulation's hand-offs wake
   when a message is stored, not on 0.1 s timers (``flwr/server/superlink/fleet/vce/vce_api.py``:
   ``add_messages_to_queue``; ``flwr/superlink/grid/inmemory_grid.py``: ``pull_interval``).
10. :func:`log_refusals_as_one_line`: a run the ServerApp refuses (bad input, a run folder that
    holds another run) is logged as one line, not with Flower's traceback
    (``flwr/simulation/app.py``, ``flwr/superlink/runtime/run_serverapp.py``: ``log(ERROR, "%s
    raised an exception", ..., exc_info=ex)``).
11. :func:`is_inapplicable_notice`: the simulation's notices about the federation size, which
    ``pflower run`` sets itself, are left out of its output (``flwr/simulation/app.py``).
12. :func:`give_message_id`, :func:`expires_at`, :func:`engine_error_reason`: what bundles of
    several clients' messages (``common/bundles.py``) need of a message's metadata and of the
    simulation's error replies (``flwr/superlink/grid/inmemory_grid.py``,
    ``flwr/simulation/ray_transport/ray_actor.py``, ``flwr/server/superlink/fleet/vce/vce_api.py``).
13. :func:`message_to_bytes`, :func:`message_from_bytes`, :func:`context_to_bytes`,
    :func:`context_from_bytes`: a task's Message and Context moved to another process as Flower
    moves them (``flwr/supercore/inflatable/``, ``flwr/common/serde.py``, ``flwr/proto/message_pb2``),
    for ``pflower-supernode``'s runner (``ops/node/runner.py``).
14. :func:`task_identity`, :func:`set_task_identity`, :func:`install_fab`,
    :func:`load_fab_clientapp`: what that runner does per task as Flower's runner does
    (``flwr/supercore/task_identity.py``, ``flwr/cli/install.py``, ``flwr/clientapp/utils.py``).
15. :func:`parse_node_config`: a ``--node-config`` string parsed as ``flower-supernode`` parses it
    (``flwr/common/config.py``).
16. :func:`keep_node_state`, :func:`fail_task_now`: a ClientApp task whose process died is
    failed at once, as Flower fails it when its heartbeats stop (``CLIENT_APP_CRASHED``), not
    after the 10 minutes of item 3 (``flwr/supernode/nodestate/``,
    ``flwr/supercore/corestate/in_memory_corestate.py``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from importlib import metadata
from logging import ERROR, WARNING
from types import SimpleNamespace
from typing import Any, Protocol

# The Flower minor releases these items are written for and CI tests: 1.42 (what a fresh install
# resolves, its Fleet API over HTTP) and 1.39 (the last whose Fleet API is gRPC). 1.40 and 1.41
# are not tested, so they are refused.
FLOWER_SERIES = ("1.42", "1.39")
FLOWER_REQUIREMENT = "flwr[simulation,dp]>=1.39,<1.43"


class FlowerVersionError(RuntimeError):
    """The installed Flower is not a release pflower's patches to its internals were written for."""


def installed_flower_version() -> str:
    try:
        return metadata.version("flwr")
    except metadata.PackageNotFoundError:
        return "none"


def flower_series(installed: str | None = None) -> str:
    """The installed Flower's minor release, e.g. ``"1.42"`` (``"none"`` when not installed)."""
    version = installed if installed is not None else installed_flower_version()
    return ".".join(version.split(".")[:2])


def fleet_over_http(installed: str | None = None) -> bool:
    """Whether this Flower's Fleet API (what SuperNodes connect to) is HTTP on the SuperLink's one
    uvicorn port (1.40 and later: ``flwr/superlink/routers/fleet/``,
    ``flwr/supernode/fleet_http_connection.py``) rather than gRPC on a port of its own (1.39)."""
    return flower_series(installed) != "1.39"


def check_flower_version(installed: str | None = None) -> None:
    """Refuse to run on a Flower other than one of ``FLOWER_SERIES``, naming the fix."""
    version = installed if installed is not None else installed_flower_version()
    if flower_series(version) not in FLOWER_SERIES:
        raise FlowerVersionError(
            f"pflower needs Flower {' or '.join(s + '.x' for s in FLOWER_SERIES)} (it adapts "
            f"Flower's internals in common/flower_compat.py for those releases); installed: flwr "
            f"{version}. Install it with: python3 -m pip install '{FLOWER_REQUIREMENT}' (1.42; "
            f"'flwr[simulation]>=1.39,<1.40' for 1.39, whose Fleet API is gRPC)")


# ---------------------------------------------------------------------- 1. the server's grid
@functools.cache
def _grid_classes() -> tuple[Any, Any]:
    """Flower's ``HttpGrid`` and ``InMemoryGrid`` (None, None on another release), imported on first
    use: their imports take about a second, which a ClientApp process (it imports this module
    for item 9) does not need."""
    try:
        from flwr.superlink.grid.http_grid import HttpGrid
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:  # pragma: no cover - another Flower release; check_flower_version says so
        return None, None
    return HttpGrid, InMemoryGrid


def __getattr__(name: str) -> Any:
    """``HttpGrid`` and ``InMemoryGrid`` as attributes of this module (imported on first use)."""
    if name in ("HttpGrid", "InMemoryGrid"):
        return _grid_classes()[name == "InMemoryGrid"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


REPLY_POLL_S = 0.1   # how often replies are pulled from a deployment's SuperLink


def is_simulation_grid(grid: Any) -> bool:
    """The simulation's grid (Flower's ``InMemoryGrid``)."""
    in_memory_grid = _grid_classes()[1]
    return in_memory_grid is not None and isinstance(grid, in_memory_grid)


def is_deployment_grid(grid: Any) -> bool:
    """A deployment's grid (its nodes are separate machines, one client each); otherwise the
    simulation's grid (or a test's), whose nodes may serve several clients."""
    http_grid = _grid_classes()[0]
    return http_grid is not None and isinstance(grid, http_grid)


# Flower's Ray backend (``flwr/simulation/ray_transport/ray_actor.py``,
# ``BasicActorPool._fetch_future_result``): when a worker process dies (killed, out of memory)
# Ray raises RayActorError, Flower flags the actor for removal, re-raises, and never starts a
# new one; the error reaches the ServerApp as the reply's error reason, with Ray's words.
RAY_WORKER_LOST = ("The actor is dead", "RayActorError", "ActorDiedError")


def simulation_worker_lost(reason: str) -> bool:
    """Whether a reply's error ``reason`` says the simulation's Ray backend lost the worker
    process that ran the client (Flower 1.39 and 1.42 alike)."""
    return any(marker in reason for marker in RAY_WORKER_LOST)


class Rejoin(Protocol):
    """What :func:`send_and_receive` asks of the sender (``strategies/addressing.py: Exchange``)
    to send a message again when its node was unavailable."""

    window_s: float   # how long a client's node may be away before its message is given up

    def resend(self, grid: Any, lost: list[Any], time_left: float) -> dict[str, Any]:
        """New messages for the clients of ``lost`` whose node is back (by the lost message's id),
        each to live ``time_left`` seconds (what is left of the round), looked for within it."""
        ...

    def give_up(self, lost: Any) -> None:
        """The node of ``lost``'s client did not come back in time."""
        ...


# flwr/common/constant.py ErrorCode.NODE_UNAVAILABLE (1.39 and 1.42): the SuperLink's reply to a
# message whose node missed its heartbeats (killed, restarting, or cut off while the SuperLink
# itself was paused or restarted)
NODE_UNAVAILABLE = 5
RESEND_POLL_S = 1.0   # how often a lost message's node is looked for


def node_unavailable(reply: Any) -> bool:
    """Whether ``reply`` is the SuperLink's error for a message whose node was unavailable."""
    return bool(reply.has_error()) and int(reply.error.code) == NODE_UNAVAILABLE


# ErrorCode.CLIENT_APP_CRASHED (1.39 and 1.42): the SuperNode's reply to a message whose ClientApp
# stopped responding (its process died: killed, out of memory) while the node itself lives on
CLIENT_APP_CRASHED = 8
CRASH_RESENDS = 1   # a message whose ClientApp crashed is sent again once; a second crash is handed on


def client_app_crashed(reply: Any) -> bool:
    """Whether ``reply`` is the SuperNode's error for a message whose ClientApp process died."""
    return bool(reply.has_error()) and int(reply.error.code) == CLIENT_APP_CRASHED


def may_send_again(reply: Any, crashes: int) -> bool:
    """Whether the message ``reply`` answers is sent again: its node was unavailable (however
    often), or its ClientApp crashed and fewer than ``CRASH_RESENDS`` of its sends crashed before
    (a ClientApp that crashes every time, say out of memory, fails its client as before)."""
    return node_unavailable(reply) or (client_app_crashed(reply) and crashes < CRASH_RESENDS)


def send_and_receive(grid: Any, messages: Iterable[Any], timeout: float,
                     on_reply: Callable[[Any], Any] | None = None, rejoin: Rejoin | None = None) -> list[Any]:
    """``grid.send_and_receive``, but pulling replies every ``REPLY_POLL_S`` seconds and
    handing each to ``on_reply`` as soon as it is pulled.

    Flower 1.39's ``HttpGrid`` (the ServerApp's grid in a deployment) sleeps 3 s between
    two pulls, which rounds every exchange up to a multiple of 3 s: a round whose clients
    answer in 7 s waited 9 s for train and again for evaluate. ``InMemoryGrid`` (the
    simulation) sleeps 0.1 s between pulls and returns nothing before the last reply: its
    replies are pulled here too, waking as soon as one is stored (item 9), so that a strategy
    can fold each one in and drop its arrays while the others train (``on_reply`` returns what
    is kept). Test grids that only answer ``send_and_receive`` get ``on_reply`` applied to what
    they return. Same contract: the replies (as ``on_reply`` returns them) that arrived before
    ``timeout``, in arrival order. (``common/bundles.py: send_and_receive`` sends several
    messages to one simulated node in bundles through this one.)

    With ``rejoin``, a message whose node was unavailable (:func:`node_unavailable`: a
    SuperNode restarting, or the SuperLink paused or restarted so that it missed the node's
    heartbeats) is held, not handed on: it is sent again, by ``rejoin.resend``, to the node
    serving its client once that node is connected, for up to ``rejoin.window_s`` (and within
    ``timeout``). So is, once, a message whose ClientApp crashed on a live node
    (:func:`client_app_crashed`, :func:`may_send_again`). A client's training loads its state of
    the round before, so the round then ends as if nothing had happened; a node that does not
    come back in time fails its client for the round with the SuperLink's error, as before."""
    keep = on_reply if on_reply is not None else (lambda message: message)
    deployment = is_deployment_grid(grid)
    simulation = is_simulation_grid(grid)
    polled = deployment or simulation or (on_reply is not None and hasattr(grid, "push_messages")
                                          and hasattr(grid, "pull_messages"))
    if not polled:
        return [keep(m) for m in grid.send_and_receive(messages, timeout=timeout)]
    outgoing = list(messages)
    del messages
    ids = list(grid.push_messages(outgoing))
    waiting = {i for i in ids if i}
    # a grid that refused a message returns no id for it (Flower's HttpGrid: none at all on HTTP
    # 413): such messages are not sent again, their clients fail with no reply, as before
    pushed = dict(zip(ids, outgoing, strict=True)) if rejoin is not None and len(ids) == len(outgoing) else {}
    del outgoing
    held: dict[str, tuple[Any, float]] = {}   # lost message id -> (its error reply, when it is given up)
    crashes: dict[str, int] = {}              # message id -> how many earlier sends of it crashed
    replies: list[Any] = []
    end = time.monotonic() + timeout
    next_look = 0.0
    while waiting or held:
        seen = stores_seen()
        arrived = list(grid.pull_messages(waiting)) if waiting else []
        waiting.difference_update(m.metadata.reply_to_message_id for m in arrived)
        for reply in arrived:
            lost = reply.metadata.reply_to_message_id
            if rejoin is not None and lost in pushed and may_send_again(reply, crashes.get(lost, 0)):
                held[lost] = (reply, min(end, time.monotonic() + rejoin.window_s))
            else:
                replies.append(keep(reply))
        del arrived
        now = time.monotonic()
        if held and rejoin is not None and now >= next_look and end - now > REPLY_POLL_S:
            next_look = now + RESEND_POLL_S
            for lost, again in rejoin.resend(grid, [pushed[i] for i in held], end - now).items():
                new_ids = list(grid.push_messages([again]))
                if new_ids and new_ids[0]:
                    reply, _ = held.pop(lost)
                    waiting.add(new_ids[0])
                    pushed[new_ids[0]] = again
                    crashes[new_ids[0]] = crashes.get(lost, 0) + client_app_crashed(reply)
            now = time.monotonic()
        if held and rejoin is not None:   # every pass, and at the round's end: the node did not come back
            for lost in [i for i, (_, give_up_at) in held.items() if now >= give_up_at or now >= end]:
                reply, _ = held.pop(lost)
                rejoin.give_up(pushed[lost])
                replies.append(keep(reply))
        if not (waiting or held) or now >= end:
            break
        if deployment or held:
            time.sleep(REPLY_POLL_S)   # the SuperLink is another process: pull again
        else:                          # the simulation: wake when a reply is stored (item 9)
            wait_for_a_store(seen, min(REPLY_POLL_S, max(end - time.monotonic(), 0.0)))
    return replies   # (nothing is held here: the round's end gave up every held message above)


# ---------------------------------------------------------------------- 2. object pulls
# A message's arrays travel as objects. A process that asks for an object before its sender
# has pushed it waits PULL_INITIAL_BACKOFF = 1 s, then 2, 4, ... up to 10 s
# (flwr/supercore/constant.py). In a deployment the SuperNode asks the SuperLink for the
# objects right after it sees a message, and the ClientApp asks the SuperNode right after its
# task starts, so a round paid 1-3 s of back-off on each hop while the objects were a few
# milliseconds away. With Flower's 500 tries per object a transfer still waits about 1,000 s
# before it fails.
INITIAL_BACKOFF_S = 0.05
BACKOFF_CAP_S = 2.0


def _pull_functions() -> tuple[Callable[..., Any], ...]:
    from flwr.supercore.inflatable import inflatable_utils

    return (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)


def object_pull_backoff() -> list[tuple[float, float]]:
    """(initial back-off, cap) of each of Flower's object-pull functions in this process."""
    return [(f.__kwdefaults__["initial_backoff"], f.__kwdefaults__["backoff_cap"]) for f in _pull_functions()]


def shorten_object_pull_backoff(initial: float = INITIAL_BACKOFF_S, cap: float = BACKOFF_CAP_S) -> bool:
    """Set the default back-off of Flower's object pulls in this process; False (and a
    warning) when this Flower has no such defaults (its transfer code changed)."""
    from flwr.common.logger import log

    functions = _pull_functions()
    if not all({"initial_backoff", "backoff_cap"} <= set(f.__kwdefaults__ or {}) for f in functions):
        log(WARNING, "pflower: this Flower's object pulls take no back-off defaults; keeping its own waits")
        return False
    for function in functions:
        function.__kwdefaults__.update(initial_backoff=initial, backoff_cap=cap)
    return True


# ---------------------------------------------------------------------- 3. task heartbeats
# A Flower 1.39 task (the simulation process, a ServerApp or ClientApp process) is declared
# dead when its heartbeats stop for HEARTBEAT_PATIENCE x HEARTBEAT_DEFAULT_INTERVAL = 2 x 30 s
# (flwr/supercore/corestate/sql_corestate.py and in_memory_corestate.py: activate_task,
# acknowledge_task_heartbeat); the SuperLink then fails the run and the simulation ends at its
# next heartbeat. A heartbeat is a small HTTP call from a thread of the task's process, every
# 17.5-22.5 s; a process that cannot make one for 60 s (paused, starved on a loaded machine,
# or a SuperLink that cannot answer) loses a run of hours. pflower watches its processes
# itself (a simulation that exits is noticed within seconds, ops/running.py), so the SuperLink
# may wait far longer.
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


# ---------------------------------------------------------------------- 4-5. entry points
def capped_time(cap: float) -> SimpleNamespace:
    """The ``time`` module as the SuperNode loop sees it: every sleep at most ``cap`` s."""
    namespace = SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("__")})
    namespace.sleep = lambda seconds: time.sleep(min(float(seconds), cap))
    return namespace


def run_supernode(argv: list[str], poll_interval: float) -> None:
    """Flower's ``flower-supernode argv`` whose idle sleeps last at most ``poll_interval``.

    Flower's SuperNode (1.39 and 1.42: flwr/supernode/start_client_internal.py, both
    hard-coded) sleeps 3 s when the SuperLink has no message for it and looks for a
    ClientApp's reply (and the reply's objects) every 0.5 s; only that module's ``time`` is
    replaced. Items 2, 3 and 8 are applied too. (Shorter waits on the node's own state were
    tried on 1.42, ``experiment=deploy-3``, 15 rounds, 3 runs each, 2 cores: median rounds of
    2.17-2.29 s at 0.05 s and 2.10-2.69 s at 0.01 s against 1.91-2.48 s at 0.2 s: no shorter,
    the polls' CPU taken from the training.)"""
    import sys

    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    loop.time = capped_time(poll_interval)   # type: ignore[attr-defined]
    release_messages_of_stopped_runs(loop)
    keep_node_state()
    shorten_object_pull_backoff()
    lengthen_task_heartbeat_ttl()
    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


def run_superlink(argv: list[str]) -> None:
    """Flower's ``flower-superlink argv`` whose tasks may miss heartbeats for 10 minutes."""
    import sys

    from flwr.superlink.cli import flower_superlink

    lengthen_task_heartbeat_ttl()
    sys.argv = ["flower-superlink", *argv]
    flower_superlink()


# ---------------------------------------------------------------------- 16. a ClientApp that died
# Flower's SuperNode learns that a ClientApp task's process died only when the task's
# heartbeats stop for HEARTBEAT_PATIENCE x 30 s (10 minutes with item 3): it then answers the
# task's message with CLIENT_APP_CRASHED (InMemoryNodeState._on_task_tokens_expired). Until then
# its loop waits for that reply and pulls no other message (start_client_internal.py:
# _push_messages): the node is lost to the run, and the server's message expires (found by
# bench/chaos.py: a SIGKILLed runner under a live SuperNode). ``pflower-supernode`` knows at once
# when its runner died during a task (the stand-in holding the task's token tells it,
# ops/node/runner.py): the token's time runs out now, and Flower's own expiry does the rest, as
# it would 10 minutes later. Both releases keep tokens in ``task_token_store`` /
# ``task_token_to_task_id`` under ``lock_task_store`` (flwr/supercore/corestate/in_memory_corestate.py).
_NODE_STATES: list[Any] = []   # the NodeStates this process's SuperNode made


def keep_node_state() -> bool:
    """Keep the NodeState this process's SuperNode creates, for :func:`fail_task_now`. False
    (and a warning) when this Flower's node state has no such factory."""
    from flwr.common.logger import log

    try:
        from flwr.supernode.nodestate.nodestate_factory import NodeStateFactory
        original = NodeStateFactory.state
    except (ImportError, AttributeError) as err:
        log(WARNING, "pflower: this Flower's NodeStateFactory changed (%s); a ClientApp that dies is "
            "failed only when its heartbeats stop", err)
        return False
    if getattr(original, "_pflower_kept", False):
        return True

    @functools.wraps(original)
    def state(self: Any) -> Any:
        made = original(self)
        if not any(made is kept for kept in _NODE_STATES):
            _NODE_STATES.append(made)
        return made

    state._pflower_kept = True   # type: ignore[attr-defined]
    NodeStateFactory.state = state   # type: ignore[method-assign]
    return True


def fail_task_now(token: str) -> bool:
    """End the heartbeat time of the ClientApp task holding ``token`` now, as if its heartbeats
    had stopped 10 minutes ago: Flower then answers the message of a task that had started with
    ``CLIENT_APP_CRASHED`` (the server sends it again, :func:`may_send_again`) and puts a task
    still starting back to pending (its SuperExec starts it again). False when no kept NodeState
    holds the token (the task finished, or it is another SuperNode's).

    Flower's expiry answers every message of the run that a ClientApp took and nobody answered.
    The SuperNode hands out one message at a time, so while another task of the run is running
    the dead task's message was answered already (the runner died between its reply and its
    outcome): that task is then only finished, failed, and the running one left alone."""
    from datetime import timedelta

    from flwr.common.constant import Status, SubStatus
    from flwr.supercore.date import now

    for state in _NODE_STATES:
        with state.lock_task_store:
            task_id = state.task_token_to_task_id.get(token)
            record = state.task_token_store.get(task_id) if task_id is not None else None
            if record is None:
                continue
            run_id = state.task_store[task_id].run_id
            other_running = any(t.run_id == run_id and t.task_id != task_id and t.status.status == Status.RUNNING
                                for t in state.task_store.values())
            if not other_running:
                record.active_until = now() - timedelta(seconds=1)
                state._cleanup_expired_task_tokens_locked()
                return True
        state.finish_task(task_id, sub_status=SubStatus.FAILED, details="its ClientApp runner died after replying")
        return True
    return False


# ---------------------------------------------------------------------- 6. one ClientApp task
def run_clientapp_task(argv: list[str], handle: Callable[[Any, Any, Any, Any], tuple[Any, Any]],
                       lock: AbstractContextManager[Any] | None = None) -> int:
    """What ``flwr-clientapp <argv>`` does for one task (``run_clientapp`` in
    flwr/supernode/runtime/run_clientapp.py), in the calling process: pull the task's message,
    context, run and FAB, ``handle(message, context, run, fab) -> (reply, context)``, push the
    reply and the task's outcome, with Flower's heartbeats meanwhile (also while waiting for
    ``lock``, held from the pull to the reply: Flower's task identity is per process, one task
    at a time). Returns the exit code
    ``flwr-clientapp`` would have (0 done, 1 failed)."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.args import try_obtain_flwr_app_token
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.common.logger import log
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.cli.flwr_clientapp import _parse_args_run_flwr_clientapp
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    args = _parse_args_run_flwr_clientapp().parse_args(argv)
    retry_invoker = make_simple_http_retry_invoker()
    client = RuntimeHttpClient.from_server_address(
        server_address=args.runtime_api_address, insecure=args.insecure,
        root_certificates=validate_and_resolve_root_certificates(args.root_certificates, args.insecure),
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                      RuntimeTokenHttpInterceptor(try_obtain_flwr_app_token(args))],
        retry_invoker=retry_invoker)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = reply = context = None
    sub_status, details, code = SubStatus.FAILED, "ClientApp task failed due to unknown reason", 0
    try:
        with lock or nullcontext():
            try:
                message, context, run, fab = pull_task_input(client)
                reply, context = handle(message, context, run, fab)
                sub_status, details = SubStatus.COMPLETED, ""
            except Exception as ex:
                reason = f"{type(ex)}:<'{ex}'>"
                log(ERROR, "ClientApp raised an exception", exc_info=ex)
                details, code = reason, 1
                if message is not None:
                    reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                                    reply_to=message)
            if reply is not None and context is not None:
                try:
                    push_message(client, reply, context)
                except Exception as ex:
                    log(ERROR, "Failed to push reply message", exc_info=ex)
                    code = 1
    finally:
        retry_invoker.max_tries = 1
        push_task_output(client=client, context=context, sub_status=sub_status, details=details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
    return code


# ---------------------------------------------------------------------- 7. the simulation's message store
# Flower 1.39's simulation engine (flwr/server/superlink/fleet/vce/vce_api.py,
# add_messages_to_queue) asks the in-memory LinkState for each node's next message, for every
# node, every 0.1 s; InMemoryLinkState.get_message_ins answers by scanning every stored message
# (and checking each one's expiry) for each node: N nodes x M messages per 0.1 s, quadratic in
# the clients (at 1,000 clients, most of the simulation process's time: docs/benchmarks.md
# (f)). The replacement keeps, per node, the ids of its messages in the order they were stored and gives
# the same answer: the node's oldest undelivered messages of the run (up to ``limit``), marked
# delivered, each checked for expiry and federation first as Flower does.
_INDEX = "_pflower_undelivered"


# Item 9. The ServerApp and the simulation engine share one in-memory LinkState (one process).
# Flower 1.39 moves messages from it to the workers in a loop that sleeps 0.1 s after each pass
# over the nodes (vce_api.py: add_messages_to_queue, ``f_stop.wait(0.1)``), and InMemoryGrid
# pulls replies every 0.1 s: on a 0.3 s round up to 0.2 s was waiting. Every store into the
# state now notifies one condition; the engine's pass waits on it before its first node when no
# message is undelivered (so a pushed round starts at once), and the ServerApp's pull waits on
# it between pulls (so a reply is read as soon as it is stored). Each wait still ends after
# STORE_WAIT_S, so a missed notification costs what Flower's timer cost before. Where the
# engine's loop is pflower's (engine_waits_for_messages, below), the pass no longer sleeps
# after itself either; the first node's wait then only adds a bounded wait to an idle pass.
STORE_WAIT_S = 0.1
_STORED = threading.Condition()
_stores = 0
_instructions = 0   # of the stores, the messages to clients (the rest are their replies)


def _note_a_store(instruction: bool = False) -> None:
    global _stores, _instructions
    with _STORED:
        _stores += 1
        _instructions += instruction
        _STORED.notify_all()


def stores_seen() -> int:
    """How many messages this process's in-memory LinkState has stored (a count to wait past)."""
    return _stores


def wait_for_a_store(seen: int, timeout: float | None = None) -> bool:
    """Block until a message is stored after ``seen`` (:func:`stores_seen`), or ``timeout`` s
    (``STORE_WAIT_S`` by default); True if one was."""
    with _STORED:
        return _STORED.wait_for(lambda: _stores != seen, STORE_WAIT_S if timeout is None else timeout)


def instructions_seen() -> int:
    """How many messages to clients this process' in-memory LinkState has stored."""
    return _instructions


def wait_for_an_instruction(seen: int, timeout: float | None = None) -> bool:
    """Block until a message to a client is stored after ``seen`` (:func:`instructions_seen`),
    or ``timeout`` s (``STORE_WAIT_S`` by default); a reply stored meanwhile does not end the
    wait. True if one was."""
    with _STORED:
        return _STORED.wait_for(lambda: _instructions != seen, STORE_WAIT_S if timeout is None else timeout)


# The engine's pass over the nodes (vce_api.add_messages_to_queue) ends with ``f_stop.wait(0.1)``
# whatever it found. The wait above, at the pass' first node, ends at any store, a client's reply
# too, so the pass that a reply woke then slept 0.1 s: a round pushed by the server during that
# sleep (its last reply wakes the pass, then the server aggregates and pushes at once) waited
# for the rest of it. Measured with bench/handoff.py (an echo ClientApp, 8 nodes): 0.099 s a
# round, the sleep's length. The replacement goes on at once while a pass delivered messages
# (a node gets one a pass) and otherwise waits for the next message to a client, bounded by
# STORE_WAIT_S so that ``f_stop`` is seen as before.
def _add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: threading.Event) -> None:
    """Flower's ``add_messages_to_queue`` (same arguments, same messages in the same order),
    without its fixed sleep between passes."""
    while not f_stop.is_set():
        seen = instructions_seen()
        delivered = 0
        for node_id in nodes_mapping.keys():
            for msg in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
                delivered += 1
        if not delivered and not f_stop.is_set():
            wait_for_an_instruction(seen)


def engine_waits_for_messages(load: bool = False) -> bool:
    """Install :func:`_add_messages_to_queue` as the simulation engine's pass loop, where the
    engine is loaded in this process and has not started it yet (the engine loads the
    ClientApp, ``client/app.py``, before it starts its threads: that import calls this; a
    caller that starts the engine itself, ``bench/handoff.py``, loads it first with ``load``).
    False where there is no engine here, or its loop is not the one this replaces."""
    import inspect
    import sys

    if load:
        import flwr.server.superlink.fleet.vce.vce_api  # noqa: F401  (as run_simulation loads it)
    vce = sys.modules.get("flwr.server.superlink.fleet.vce.vce_api")
    loop = getattr(vce, "add_messages_to_queue", None)
    if loop is None:
        return False
    if loop is _add_messages_to_queue:
        return True
    if list(inspect.signature(loop).parameters) != ["state", "queue", "nodes_mapping", "f_stop"]:
        from flwr.common.logger import log

        log(WARNING, "pflower: this Flower's simulation engine changed; keeping its message loop")
        return False
    vce.add_messages_to_queue = _add_messages_to_queue   # type: ignore[union-attr]
    return True


def _undelivered_index(state: Any) -> dict[int, list[str]]:
    """The state's node -> message ids index (built from its store on first use)."""
    index = state.__dict__.get(_INDEX)
    if index is None:
        index = {}
        for msg_id, msg in state.message_ins_store.items():
            if msg.metadata.delivered_at == "":
                index.setdefault(msg.metadata.dst_node_id, []).append(msg_id)
        state.__dict__[_INDEX] = index
    return index


def index_undelivered_messages() -> bool:
    """Install the indexed ``get_message_ins`` on Flower's in-memory LinkState (this process:
    the simulation's). False (and a warning) when this Flower's state differs."""
    from flwr.common.logger import log

    try:
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    except ImportError:
        log(WARNING, "pflower: this Flower has no in-memory LinkState; keeping its message lookup")
        return False
    if getattr(InMemoryLinkState.get_message_ins, "_pflower", False):
        return True
    if not all(hasattr(InMemoryLinkState, name)
               for name in ("store_message_ins", "store_message_res", "_check_stored_messages")):
        log(WARNING, "pflower: this Flower's in-memory LinkState changed; keeping its message lookup")
        return False
    store, store_res = InMemoryLinkState.store_message_ins, InMemoryLinkState.store_message_res

    def store_message_ins(self: Any, message: Any) -> Any:
        msg_id = store(self, message)
        if msg_id:
            with self.lock:
                index = _undelivered_index(self)
                ids = index.setdefault(message.metadata.dst_node_id, [])
                if str(msg_id) not in ids:
                    ids.append(str(msg_id))
            _note_a_store(instruction=True)
        return msg_id

    def store_message_res(self: Any, message: Any) -> Any:
        msg_id = store_res(self, message)
        _note_a_store()
        return msg_id

    def get_message_ins(self: Any, node_id: int, limit: int | None, *, run_id: int | None = None) -> list[Any]:
        if limit is not None and limit < 1:
            raise AssertionError("`limit` must be >= 1")
        # the engine's pass over the nodes starts with the same node every time: there, with
        # nothing undelivered, wait for the next store instead of Flower's 0.1 s sleep (item 9)
        if self.__dict__.setdefault("_pflower_first_node", node_id) == node_id:
            seen = stores_seen()
            with self.lock:
                pending = any(_undelivered_index(self).values())
            if not pending:
                wait_for_a_store(seen)
        found: list[Any] = []
        with self.lock:
            ids = _undelivered_index(self).get(node_id, [])
            keep = []
            for msg_id in ids:
                if limit and len(found) == limit:
                    keep.append(msg_id)
                    continue
                self._check_stored_messages({msg_id})
                msg = self.message_ins_store.get(msg_id)
                if msg is None or msg.metadata.delivered_at != "":
                    continue   # expired, deleted or delivered: out of the index
                if run_id is not None and msg.metadata.run_id != run_id:
                    keep.append(msg_id)
                    continue
                found.append(msg)
            ids[:] = keep
        delivered_at = now_isoformat()
        for msg in found:
            msg.metadata.delivered_at = delivered_at
        return found

    get_message_ins._pflower = True   # type: ignore[attr-defined]
    InMemoryLinkState.store_message_ins = store_message_ins   # type: ignore[method-assign]
    InMemoryLinkState.store_message_res = store_message_res   # type: ignore[method-assign]
    InMemoryLinkState.get_message_ins = get_message_ins   # type: ignore[method-assign]
    return True


def now_isoformat() -> str:
    """Flower's delivery timestamp (``flwr.supercore.date.now``, UTC, ISO 8601)."""
    from flwr.supercore.date import now

    return now().isoformat()


# ---------------------------------------------------------------------- 8. runs stopped mid-message
# When a SuperLink stops a run (it finished, failed, or the SuperLink was restarted and the run
# is over) while a SuperNode is pulling one of its messages' arrays, Flower 1.39's
# ``_pull_and_store_message`` (flwr/supernode/start_client_internal.py) has already created a
# task and stored the message; the pull raises ``RunNotRunningException``, a ``BaseException``,
# which skips the handler that deletes the message and fails the task. The task stays pending,
# its ClientApp is started and waits for arrays that never come (500 tries, ~1,000 s), and
# pflower's runner, which runs one task at a time, answers nothing else meanwhile: after a
# SuperLink restart the resumed run found its clients silent and timed out. Raised as an
# ``Exception``, the same stop takes Flower's own clean-up path ("Failed to receive message").
class RunStoppedError(RuntimeError):
    """The run of a message stopped while the SuperNode was receiving the message's arrays."""


def release_messages_of_stopped_runs(loop: Any) -> bool:
    """Make the SuperNode loop's ``pull_objects`` raise :class:`RunStoppedError` (an
    ``Exception``) where Flower's raises ``RunNotRunningException``; False (and a warning)
    when this Flower's loop or exception differs."""
    from flwr.common.logger import log

    try:
        from flwr.supercore.run import RunNotRunningException
    except ImportError:
        log(WARNING, "pflower: this Flower has no RunNotRunningException; keeping its message handling")
        return False
    original = getattr(loop, "pull_objects", None)
    if original is None:
        log(WARNING, "pflower: this Flower's SuperNode loop pulls no objects; keeping its message handling")
        return False
    if getattr(original, "releases_stopped_runs", False):
        return True

    def pull_objects(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RunNotRunningException as err:
            raise RunStoppedError(f"the run stopped while its message was being received: {err!r}") from None

    pull_objects.releases_stopped_runs = True   # type: ignore[attr-defined]
    loop.pull_objects = pull_objects
    return True


# ---------------------------------------------------------------------- 10. refusals in one line
class _OneLineRefusals(logging.Filter):
    """Rewrites Flower's record of an exception of ``kinds`` as the exception's own message,
    without the traceback (which says nothing a refusal's message does not)."""

    def __init__(self, kinds: tuple[type[BaseException], ...]) -> None:
        super().__init__("pflower-refusals")
        self.kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.kinds):
            record.msg, record.args = "%s", (str(exc),)
            record.exc_info, record.exc_text = None, None
        return True


def log_refusals_as_one_line(*kinds: type[BaseException]) -> None:
    """Flower ends a ServerApp that raised by logging ``"ServerApp raised an exception"`` (or
    ``"Simulation ..."``) with the traceback, and marks the run failed with the exception's
    message as its details (``flwr ls``). For pflower's refusals (a mistyped key, a run folder
    that holds another run) the log line becomes the message itself; the run still fails."""
    from flwr.common.logger import FLOWER_LOGGER

    for old in [f for f in FLOWER_LOGGER.filters if isinstance(f, _OneLineRefusals)]:
        FLOWER_LOGGER.removeFilter(old)
    FLOWER_LOGGER.addFilter(_OneLineRefusals(tuple(kinds)))


# ---------------------------------------------------------------------- 11. notices that do not apply
# Printed by every simulation (flwr/simulation/app.py) for a federation of Flower's default
# size; ``pflower run`` sets the simulation's number of SuperNodes itself. They are printed
# before any pflower code runs in that process, so they are left out where ``pflower run``
# reads the log stream (and kept in the run folder's full log).
INAPPLICABLE_NOTICES = (
    "Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.",
    "To change federation size, use the following command:",
    "flwr federation simulation-config ",
)


def is_inapplicable_notice(line: str) -> bool:
    """Whether a line of the simulation's log is one of :data:`INAPPLICABLE_NOTICES`."""
    return any(notice in line for notice in INAPPLICABLE_NOTICES)


# ---------------------------------------------------------------------- 12. bundles' messages
CLIENT_APP_RAISED_EXCEPTION = 2   # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def give_message_id(msg: Any) -> str:
    """Give a message that is not pushed itself (it travels in a bundle) an id, as the grid
    gives a pushed one (``InMemoryGrid.push_messages``), so that its reply can name it."""
    import uuid

    msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    return str(msg.metadata.message_id)


def expires_at(msg: Any) -> float:
    """When a message expires (its creation time plus its time to live, seconds since the epoch)."""
    return float(msg.metadata.created_at) + float(msg.metadata.ttl)


def engine_error_reason(ex: BaseException) -> str:
    """An exception's error reason as Flower's simulation words it: its Ray actor wraps the
    ClientApp's exception in ``ClientAppException`` (``ray_actor.py``) and the engine writes its
    type and text (``vce_api.py``), which ``strategies/replies.py: short_reason`` reads back."""
    from flwr.clientapp.client_app import ClientAppException

    wrapped = ClientAppException(str(ex))
    return str(type(wrapped)) + ":<'" + str(wrapped) + "'>"


# ---------------------------------------------------------------------- 13. messages as bytes
# pflower-supernode's runner (ops/node/runner.py) hands a task whose FAB is not this
# installation's code to a process of its own, and moves the Message there the way Flower moves
# it between processes: as its inflatable objects, no pickle
# (``flwr/supercore/inflatable/inflatable_object.py``, ``inflatable_utils.py``; 1.39 and 1.42 alike).
def message_to_bytes(message: Any) -> bytes:
    """A Message as a JSON header (root object id, object ids and sizes) and its objects' bytes."""
    import json
    import struct

    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    objects = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    header = json.dumps({"root": message.object_id, "ids": list(objects),
                         "sizes": [len(b) for b in objects.values()]}).encode()
    return struct.pack("<Q", len(header)) + header + b"".join(objects.values())


def message_from_bytes(data: bytes) -> Any:
    """The Message :func:`message_to_bytes` wrote, with its message id (as Flower's runner gives
    a pulled message its id, which a reply names)."""
    import json
    import struct

    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + size])
    contents, offset = {}, 8 + size
    for oid, n in zip(header["ids"], header["sizes"], strict=True):
        contents[oid] = data[offset:offset + n]
        offset += n
    message = inflate_object_from_contents(header["root"], contents)
    if not isinstance(message, Message):
        raise TypeError(f"expected a Message, the data holds a {type(message).__name__}")
    message.metadata.__dict__["_message_id"] = header["root"]
    return message


def context_to_bytes(context: Any) -> bytes:
    """A ClientApp's Context as Flower stores it (``flwr/common/serde.py``, ``flwr/proto/message_pb2``)."""
    from flwr.common.serde import context_to_proto

    return context_to_proto(context).SerializeToString()


def context_from_bytes(data: bytes) -> Any:
    """The Context :func:`context_to_bytes` wrote."""
    from flwr.common.serde import context_from_proto
    from flwr.proto.message_pb2 import Context as ContextProto  # pylint: disable=E0611

    proto = ContextProto()
    proto.ParseFromString(data)
    return context_from_proto(proto)


# ---------------------------------------------------------------------- 14. a task's identity and FAB
def task_identity() -> tuple[int, int, int]:
    """(run id, node id, task id) of the task this process runs (``flwr/supercore/task_identity.py``:
    Flower's runner sets them per task; a ClientApp's logs and heartbeats read them)."""
    from flwr.supercore.task_identity import TaskIdentity

    return TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id


def set_task_identity(run_id: int, node_id: int, task_id: int) -> None:
    """Make this process run the task ``(run_id, node_id, task_id)``, as Flower's runner does."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, task_id


def install_fab(content: bytes) -> None:
    """Install a FAB as a SuperNode does before it runs the FAB's ClientApp (``flwr/cli/install.py``)."""
    from flwr.cli.install import install_from_fab

    install_from_fab(content, skip_prompt=True)


def load_fab_clientapp(fab_id: str, fab_version: str, fab_hash: str) -> Any:
    """An installed FAB's ClientApp, loaded by Flower's loader (``flwr/clientapp/utils.py``)."""
    from flwr.clientapp.utils import get_load_client_app_fn

    return get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(fab_id, fab_version, fab_hash)


# ---------------------------------------------------------------------- 15. node config
def parse_node_config(text: str) -> dict[str, Any]:
    """A SuperNode's ``--node-config`` string parsed exactly as ``flower-supernode`` parses it
    (``flwr/common/config.py: parse_config_args``)."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text]))


# ---------------------------------------------------------------------- the next release
def _item_4_8() -> bool:
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli import flower_supernode  # noqa: F401

    return hasattr(loop, "time") and release_messages_of_stopped_runs(loop)


def _item_5() -> bool:
    from flwr.superlink.cli import flower_superlink  # noqa: F401

    return True


def _item_6() -> bool:
    from flwr.supernode.cli.flwr_clientapp import _parse_args_run_flwr_clientapp  # noqa: F401
    from flwr.supernode.runtime import run_clientapp

    return all(hasattr(run_clientapp, n) for n in ("pull_task_input", "push_message", "push_task_output"))


def _items_13_15() -> bool:
    import flwr.cli.install  # noqa: F401
    import flwr.clientapp.utils  # noqa: F401
    import numpy as np
    from flwr.app import ArrayRecord, Context, Message, RecordDict

    set_task_identity(1, 0, 0)
    sent = Message(RecordDict({"a": ArrayRecord([np.zeros(2)])}), dst_node_id=1, message_type="train")
    back = message_from_bytes(message_to_bytes(sent))
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    context_from_bytes(context_to_bytes(context))
    return (back.content["a"]["0"].numpy().shape == (2,)
            and parse_node_config('partition-id=0 state-dir="/x"') == {"partition-id": 0, "state-dir": "/x"})


def _item_16() -> bool:
    """A started ClientApp task failed by its token has its message answered
    ``CLIENT_APP_CRASHED``; a task still starting goes back to pending (:func:`crash_drill`)."""
    drill = crash_drill()
    return (drill["started"] == [(CLIENT_APP_CRASHED, "ClientApp stopped responding.")]
            and drill["starting"] == "pending" and not drill["finished"]
            and drill["answered"] == (True, "finished", "running", 0))


def crash_drill(run_id: int = 1) -> dict[str, Any]:
    """:func:`fail_task_now` on a NodeState of this Flower made as its SuperNode makes one
    (kept by :func:`keep_node_state`): ``started``, the (code, reason) of the replies to the
    message of a task whose ClientApp had taken it; ``starting``, the status of a task failed
    while starting; ``finished``, what failing a finished task's token again returns;
    ``answered``, for a task whose runner died after its reply while the run's next task runs:
    (failed, its status, the running task's status, replies to the running task's message)."""
    from flwr.app import Message, RecordDict
    from flwr.supercore.constant import TaskType
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate.nodestate_factory import NodeStateFactory

    keep_node_state()
    state = NodeStateFactory(ObjectStoreFactory()).state()
    try:
        state.set_node_id(7)
        set_task_identity(run_id, 0, 0)
        sent = Message(RecordDict(), dst_node_id=7, message_type="train", group_id="1")
        sent.metadata.__dict__["_message_id"] = sent.object_id
        state.store_message(sent)
        task_id = state.create_task(TaskType.CLIENT_APP, run_id)
        token = state.claim_task(task_id)
        state.activate_task(task_id)
        messages = getattr(state, "get_messages_legacy", None) or state.get_messages   # 1.42, 1.39
        taken = [m.metadata.message_id for m in messages(run_ids=[run_id], is_reply=False)]
        state.record_message_processing_start(sent.metadata.message_id)   # as the Runtime API's pull does
        started = []
        if taken == [sent.metadata.message_id] and token is not None and fail_task_now(token):
            started = [(int(m.error.code), m.error.reason) for m in messages(is_reply=True)
                       if m.metadata.reply_to_message_id == sent.metadata.message_id]
        starting_id = state.create_task(TaskType.CLIENT_APP, run_id)
        starting_token = state.claim_task(starting_id)
        starting = (str(state.get_tasks(task_ids=[starting_id])[0].status.status)
                    if starting_token is not None and fail_task_now(starting_token) else "")
        # a task whose runner died after its reply, while the next task of the run is running:
        # finished, and the running task's message not answered for it
        answered_id, running_id = (state.create_task(TaskType.CLIENT_APP, run_id) for _ in range(2))
        answered_token = state.claim_task(answered_id)
        state.activate_task(answered_id)
        state.claim_task(running_id)
        state.activate_task(running_id)
        nxt = Message(RecordDict(), dst_node_id=7, message_type="train", group_id="2")
        nxt.metadata.__dict__["_message_id"] = nxt.object_id
        state.store_message(nxt)
        messages(run_ids=[run_id], is_reply=False)   # taken by the running task
        state.record_message_processing_start(nxt.metadata.message_id)
        failed_answered = answered_token is not None and fail_task_now(answered_token)
        running_answered = [m for m in messages(is_reply=True) if m.metadata.reply_to_message_id == nxt.metadata.message_id]
        statuses = {t.task_id: str(t.status.status) for t in state.get_tasks(task_ids=[answered_id, running_id])}
        return {"started": started, "starting": starting, "finished": fail_task_now(token or ""),
                "answered": (failed_answered, statuses[answered_id], statuses[running_id], len(running_answered))}
    finally:
        _NODE_STATES.remove(state)


def item_report() -> list[tuple[str, bool, str]]:
    """Each item applied (or imported and exercised) in this process, on the installed Flower:
    (item, applies, why not). ``bench/next_flower.py`` runs it on the next release."""
    checks: list[tuple[str, Callable[[], bool]]] = [
        ("1 replies pulled every 0.1 s (http_grid.py, inmemory_grid.py)",
         lambda: all(c is not None for c in _grid_classes())),
        ("2 object-pull back-off (inflatable_utils.py)", shorten_object_pull_backoff),
        ("3 task heartbeat TTL (corestate/*_corestate.py)", lengthen_task_heartbeat_ttl),
        ("4, 8 SuperNode loop's sleeps, stopped runs (start_client_internal.py)", _item_4_8),
        ("5 SuperLink entry point (superlink/cli/flower_superlink.py)", _item_5),
        ("6 one ClientApp task (runtime/run_clientapp.py, cli/flwr_clientapp.py)", _item_6),
        ("7 indexed message lookup (in_memory_linkstate.py)", index_undelivered_messages),
        ("9 the engine's pass loop (fleet/vce/vce_api.py)", lambda: engine_waits_for_messages(load=True)),
        ("13-15 messages, contexts, task identity, FAB, node config", _items_13_15),
        ("16 a dead ClientApp's task failed at once (nodestate/, in_memory_corestate.py)", _item_16),
    ]
    rows = []
    for name, check in checks:
        try:
            ok, why = bool(check()), "its function returned False (its warning says why)"
        except Exception as ex:   # an import or a signature that moved: what the report is for
            ok, why = False, f"{type(ex).__name__}: {ex}"
        rows.append((name, ok, "" if ok else why))
    return rows


def secagg_key_functions() -> SimpleNamespace:
    """The elliptic-curve key helpers Flower's own SecAgg+ uses (``secaggplus_mod``): generate a
    key pair, and private and public keys to and from bytes. They live in
    ``flwr.supercore.primitives.asymmetric`` in 1.39 and 1.42 alike (not in the public API)."""
    from flwr.supercore.primitives import asymmetric

    return SimpleNamespace(generate_key_pairs=asymmetric.generate_key_pairs,
                           private_key_to_bytes=asymmetric.private_key_to_bytes,
                           bytes_to_private_key=asymmetric.bytes_to_private_key,
                           public_key_to_bytes=asymmetric.public_key_to_bytes,
                           bytes_to_public_key=asymmetric.bytes_to_public_key)
