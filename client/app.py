"""The pflower ClientApp: Flower's entry point on the client side.

It imports no torch itself: the handlers (``client/handlers.py``: torch, the data, the
trainers) load on the first training or evaluation message, so a process that only answers
the server's query stays light. In a simulation the ClientApp lives in a Ray actor across
rounds; ``pflower-supernode`` runs it in one long-lived process per node
(``ops/node/runner.py``); with Flower's plain ``flower-supernode`` each message gets a
process of its own.
"""

from __future__ import annotations

import os
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from client.identity import identify
from common.bundles import run_bundle
from common.flower_compat import engine_waits_for_messages
from common.timing import process_age, profiled, timed_message, timing_enabled

_AGE_AT_IMPORT = process_age()
engine_waits_for_messages()   # in the simulation's process, before its engine starts (item 9)


def timing_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """With ``PFLOWER_TIMING``: where a message's time goes in this ClientApp process
    (``common/timing.py``; ``PFLOWER_PROFILE=<folder>`` also writes a cProfile file per message).
    Under plain ``flower-supernode`` Flower starts one process per message, so the process
    age when the handler starts is the per-message start-up cost (Python, Flower, FAB, task
    pull, our imports); under ``pflower-supernode`` it is the age of the node's runner, which
    also logs its seconds per task. The handler's own seconds are the work. ``loaded`` = the
    process age when this module had been imported (Python, Flower's start and ours)."""
    kind = msg.metadata.message_type
    age = process_age()
    reply, line = timed_message(lambda: profiled(lambda: call_next(msg, context), kind), kind)
    log(20, "pflower timing: %s message: process age %.2f s when loaded, %.2f s at the handler; handler %.2f s%s",
        kind, _AGE_AT_IMPORT, age, line["handler_s"],
        "".join(f", {name} {seconds:.3f}" for name, seconds in line["parts"].items()))
    return reply


def _mods() -> list[Any]:
    """``run_bundle`` first: a bundle of several clients' messages (``common/bundles.py``) goes
    through the other mods and the handlers one message at a time. ``timing_mod`` with
    ``PFLOWER_TIMING`` (``1`` or a folder); the tests' fault injection when they set
    ``PFLOWER_FAULTS`` (``client/faults.py``; never part of a run's configuration)."""
    mods: list[Any] = [run_bundle] + ([timing_mod] if timing_enabled() else [])
    if os.environ.get("PFLOWER_FAULTS"):
        from client.faults import fault_injection_mod

        mods.append(fault_injection_mod)
    return mods


app = ClientApp(mods=_mods())


def handle(kind: str, msg: Message, context: Context) -> Message:
    """Run the ``kind`` handler (imported on first use, see the module docstring)."""
    from client.handlers import HANDLERS

    return HANDLERS[kind](msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return handle("train", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return handle("evaluate", msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Identify this node (no torch needed; see ``client/identity.py``)."""
    return identify(msg, context)
