"""Test-only fault injection: a ClientApp mod, installed only when ``PFLOWER_FAULTS`` is set.

The tests that need a failing client (tests/test_failures_and_checkpoints.py) set, in the
environment of the processes they start, ``PFLOWER_FAULTS`` to a JSON object::

    {"crash_clients": ["1"], "crash_round": 2, "nan_clients": [], "nan_round": 0}

``crash_*``: the ClientApp of those clients raises in training in that round (0 = every
round); ``nan_*``: their training reply carries NaN arrays instead of their update;
``exit_*``: the process running their ClientApp exits at once (a simulation's Ray worker, a
deployment's runner), once per ``exit_once`` file: the first to hit creates it. Nothing of
this is in the run's configuration: a production ClientApp has no such mod.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message, MessageType

from client.identity import client_id_of
from common.protocol import ARRAYS_KEY, CONFIG_KEY, from_record, to_record

FAULTS_ENV = "PFLOWER_FAULTS"


@dataclass(frozen=True)
class Faults:
    """Which clients fail in which round (round 0 = every round)."""

    crash_clients: frozenset[str] = frozenset()
    crash_round: int = 0
    nan_clients: frozenset[str] = frozenset()
    nan_round: int = 0
    exit_clients: frozenset[str] = frozenset()
    exit_round: int = 0
    exit_once: str = ""

    @classmethod
    def parse(cls, text: str) -> Faults:
        spec = json.loads(text)
        unknown = set(spec) - {"crash_clients", "crash_round", "nan_clients", "nan_round", "exit_clients",
                               "exit_round", "exit_once"}
        if unknown:
            raise ValueError(f"{FAULTS_ENV}: unknown keys {sorted(unknown)}")
        return cls(frozenset(map(str, spec.get("crash_clients", []))), int(spec.get("crash_round", 0)),
                   frozenset(map(str, spec.get("nan_clients", []))), int(spec.get("nan_round", 0)),
                   frozenset(map(str, spec.get("exit_clients", []))), int(spec.get("exit_round", 0)),
                   str(spec.get("exit_once", "")))

    @staticmethod
    def _hit(clients: frozenset[str], at: int, client_id: str, server_round: int) -> bool:
        return client_id in clients and at in (0, server_round)

    def crashes(self, client_id: str, server_round: int) -> bool:
        return self._hit(self.crash_clients, self.crash_round, client_id, server_round)

    def uploads_nan(self, client_id: str, server_round: int) -> bool:
        return self._hit(self.nan_clients, self.nan_round, client_id, server_round)

    def exits(self, client_id: str, server_round: int) -> bool:
        """Whether this process exits now: at every hit, or only the first when ``exit_once``
        names a file (the first hit creates it)."""
        if not self._hit(self.exit_clients, self.exit_round, client_id, server_round):
            return False
        if not self.exit_once:
            return True
        try:
            Path(self.exit_once).open("x").close()
        except FileExistsError:
            return False
        return True


def with_nan_arrays(reply: Message) -> Message:
    """``reply`` with every floating array of its update replaced by NaN."""
    arrays = from_record(reply.content.array_records.get(ARRAYS_KEY))
    reply.content[ARRAYS_KEY] = to_record({k: np.full_like(v, np.nan) if np.issubdtype(v.dtype, np.floating)
                                           else v for k, v in arrays.items()})
    return reply


def fault_injection_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Crash or poison the training of the clients ``PFLOWER_FAULTS`` names."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    faults = Faults.parse(os.environ.get(FAULTS_ENV, "{}"))
    config = msg.content.config_records.get(CONFIG_KEY)
    client_id = client_id_of(context, config)
    server_round = int(config.get("server-round", 0)) if config is not None else 0
    if faults.exits(client_id, server_round):
        os._exit(1)          # the worker process dies mid-message, as a killed one does
    if faults.crashes(client_id, server_round):
        raise RuntimeError(f"injected fault: client {client_id} crashes in round {server_round} ({FAULTS_ENV})")
    reply = call_next(msg, context)
    if faults.uploads_nan(client_id, server_round) and not reply.has_error():
        reply = with_nan_arrays(reply)
    return reply
