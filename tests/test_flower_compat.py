"""The one module that adapts Flower's internals (common/flower_compat.py): nothing else
reaches into them, and another Flower release is refused before anything starts."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Message, MessageType

import ops.running
from common import flower_compat
from ops import cli

REPO = Path(__file__).resolve().parent.parent
INTERNALS = re.compile(r"flwr\.(superlink|supernode)|__kwdefaults__|_parse_args")


def test_only_the_compat_module_touches_flowers_internals() -> None:
    offenders = [f"{path.relative_to(REPO)}:{n}" for path in sorted(REPO.rglob("*.py"))
                 if ".venv" not in path.parts and path != REPO / "common" / "flower_compat.py"
                 and path != Path(__file__).resolve()
                 for n, line in enumerate(path.read_text().splitlines(), 1) if INTERNALS.search(line)]
    assert offenders == [], "Flower internals used outside common/flower_compat.py: " + ", ".join(offenders)


@pytest.mark.parametrize("version", ["1.38.0", "1.40.0", "1.41.2", "1.43.0", "2.0.0", "none"])
def test_another_flower_is_refused_by_name(version: str) -> None:
    with pytest.raises(flower_compat.FlowerVersionError,
                       match=rf"needs Flower 1\.42\.x or 1\.39\.x.*installed: flwr {version}"):
        flower_compat.check_flower_version(version)


@pytest.mark.parametrize("version", ["1.39.0", "1.39.7", "1.42.0", "1.42.3"])
def test_the_tested_releases_are_accepted(version: str) -> None:
    flower_compat.check_flower_version(version)


def test_the_installed_flower_is_accepted_and_its_fleet_transport_known() -> None:
    flower_compat.check_flower_version()     # CI runs one lane on each supported release
    assert flower_compat.fleet_over_http() == (flower_compat.flower_series() == "1.42")
    assert flower_compat.fleet_over_http("1.42.0") and not flower_compat.fleet_over_http("1.39.0")


def test_pflower_says_so_before_starting_anything(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    started: list[str] = []
    monkeypatch.setattr(flower_compat, "installed_flower_version", lambda: "1.40.1")
    monkeypatch.setattr(ops.running, "cmd_run", lambda args: started.append("run") or 0)
    assert cli.main(["run", "rounds=1"]) == 2
    assert started == []
    err = capsys.readouterr().err
    assert "installed: flwr 1.40.1" in err and "pip install 'flwr[simulation,dp]>=1.39,<1.43'" in err


def test_the_indexed_message_lookup_answers_as_flowers_scan() -> None:
    """Item 7: each node's oldest undelivered messages of the run, up to ``limit``, marked
    delivered; an expired message (deleted by Flower's check) is skipped and leaves the index;
    a message stored before the index existed is found too."""
    import threading
    from types import SimpleNamespace

    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    assert flower_compat.index_undelivered_messages() and flower_compat.index_undelivered_messages()

    def msg(node: int, run: int = 1) -> SimpleNamespace:
        return SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node, run_id=run, delivered_at=""))

    class State:
        def __init__(self) -> None:
            self.lock, self.message_ins_store, self.expired = threading.RLock(), {}, set()

        def _check_stored_messages(self, ids: set[str]) -> None:   # Flower deletes expired ones
            for i in ids & self.expired:
                self.message_ins_store.pop(i, None)

    state = State()
    state.message_ins_store.update({"a": msg(7), "b": msg(8), "c": msg(7), "d": msg(7, run=2), "e": msg(7)})
    state.expired.add("c")
    lookup = InMemoryLinkState.get_message_ins
    first = lookup(state, 7, limit=1, run_id=1)
    assert [m is state.message_ins_store["a"] for m in first] == [True] and first[0].metadata.delivered_at
    assert lookup(state, 7, limit=None, run_id=1) == [state.message_ins_store["e"]]   # c expired, d other run
    assert lookup(state, 7, limit=1, run_id=1) == [] and lookup(state, 8, limit=5) == [state.message_ins_store["b"]]
    assert lookup(state, 7, limit=1) == [state.message_ins_store["d"]]                 # any run
    with pytest.raises(AssertionError, match="limit"):
        lookup(state, 7, limit=0)



def test_the_simulations_hand_off_wakes_when_a_message_is_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 9: with nothing undelivered, the engine's lookup at the first node of its pass waits
    for the next store (Flower's own returns at once and sleeps 0.1 s), and returns the message
    stored meanwhile; a store at a pass's other nodes, or with messages pending, waits for nothing."""
    import threading
    import time
    from types import SimpleNamespace

    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    assert flower_compat.index_undelivered_messages()
    monkeypatch.setattr(flower_compat, "STORE_WAIT_S", 30.0)   # a missed wake-up would show as 30 s

    class State:
        def __init__(self) -> None:
            self.lock, self.message_ins_store = threading.RLock(), {}

        def _check_stored_messages(self, ids: set[str]) -> None:
            pass

    state, message = State(), SimpleNamespace(metadata=SimpleNamespace(dst_node_id=3, run_id=1, delivered_at=""))

    def store_later() -> None:
        time.sleep(0.2)
        with state.lock:
            state.message_ins_store["m"] = message
            flower_compat._undelivered_index(state).setdefault(3, []).append("m")
        flower_compat._note_a_store()

    lookup = InMemoryLinkState.get_message_ins
    threading.Thread(target=store_later).start()
    t0 = time.monotonic()
    found = lookup(state, 3, limit=1)          # the first node queried: the pass's first
    assert found == [message] and time.monotonic() - t0 < 20 and state._pflower_first_node == 3
    t0 = time.monotonic()
    assert lookup(state, 4, limit=1) == [] and time.monotonic() - t0 < 20   # not the pass's first node
    seen = flower_compat.stores_seen()
    threading.Timer(0.2, flower_compat._note_a_store).start()
    assert flower_compat.wait_for_a_store(seen) and flower_compat.stores_seen() == seen + 1

def test_the_engines_pass_loop_goes_on_while_it_delivers_and_waits_for_a_message_to_a_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 9: pflower's pass loop gives every node its messages in Flower's order (one a node
    a pass), passes again at once while it delivered some, and otherwise waits for the next
    message to a client: a reply stored meanwhile does not end the wait (Flower's loop slept
    0.1 s after every pass, so a round pushed during that sleep waited). It replaces the
    engine's loop only where the engine is loaded and its loop has Flower's arguments."""
    import queue
    import sys
    import threading
    import time
    from types import ModuleType

    monkeypatch.setattr(flower_compat, "STORE_WAIT_S", 30.0)   # a missed wake-up would show as 30 s
    pending = {1: ["a1", "a2"], 2: ["b1"], 3: []}
    passes: list[int] = []

    class State:
        def get_message_ins(self, node_id: int, limit: int) -> list[str]:
            if node_id == 1:
                passes.append(1)
            taken, pending[node_id][:limit] = pending[node_id][:limit], []
            if node_id == 3 and len(passes) == 3:   # the third pass found nothing: stop after it
                f_stop.set()
            return taken

    delivered: queue.Queue[str] = queue.Queue()
    f_stop = threading.Event()
    t0 = time.monotonic()
    flower_compat._add_messages_to_queue(State(), delivered, {1: 0, 2: 1, 3: 2}, f_stop)
    assert time.monotonic() - t0 < 10            # no wait after a pass that delivered messages
    assert [delivered.get_nowait() for _ in range(3)] == ["a1", "b1", "a2"] and len(passes) == 3

    seen = flower_compat.instructions_seen()
    threading.Timer(0.1, flower_compat._note_a_store).start()              # a reply: no wake-up
    assert not flower_compat.wait_for_an_instruction(seen, timeout=1.0)
    threading.Timer(0.1, flower_compat._note_a_store, kwargs={"instruction": True}).start()
    assert flower_compat.wait_for_an_instruction(seen) and flower_compat.instructions_seen() == seen + 1

    engine = ModuleType("flwr.server.superlink.fleet.vce.vce_api")
    monkeypatch.setitem(sys.modules, engine.__name__, engine)
    assert not flower_compat.engine_waits_for_messages()                   # no loop to replace
    engine.add_messages_to_queue = lambda state, queue, f_stop: None       # type: ignore[attr-defined]
    assert not flower_compat.engine_waits_for_messages()                   # another loop: kept
    engine.add_messages_to_queue = lambda state, queue, nodes_mapping, f_stop: None  # type: ignore[attr-defined]
    assert flower_compat.engine_waits_for_messages() and flower_compat.engine_waits_for_messages()
    assert engine.add_messages_to_queue is flower_compat._add_messages_to_queue  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, engine.__name__)
    assert not flower_compat.engine_waits_for_messages()


def test_the_simulation_process_loads_the_clientapp_before_its_engine_starts_the_loop() -> None:
    """``client/app.py`` installs the loop when it is imported: Flower's engine loads the
    ClientApp (``_load``, "Test if ClientApp can be loaded") before ``run_api`` starts the
    thread that runs ``add_messages_to_queue``, so the thread runs pflower's loop."""
    import inspect

    from flwr.server.superlink.fleet.vce import vce_api

    source = inspect.getsource(vce_api.start_vce)
    assert source.index("client_app = app_fn()") < source.index("run_api(")
    assert "target=add_messages_to_queue" in inspect.getsource(vce_api.run_api)   # looked up at start


def _receive_a_message_of_a_run_that_stops(loop: object) -> tuple[int, list[str]]:
    """Flower's SuperNode step ``_pull_and_store_message`` on a real in-memory NodeState, for
    a message of a run the SuperLink stops while its arrays are pulled: (messages left in
    the state, the run's task statuses)."""
    import numpy as np
    from flwr.app import ArrayRecord, Message, MessageType, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run, RunNotRunningException
    from flwr.supernode.nodestate import NodeStateFactory

    factory = ObjectStoreFactory()
    state = NodeStateFactory(factory).state()
    state.store_run(Run.create_empty(7))
    msg = Message(RecordDict({"w": ArrayRecord([np.ones(3)])}), dst_node_id=1, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_run_id"] = 7
    msg.metadata.__dict__["_message_id"] = msg.object_id

    def stopped(run_id: int, object_id: str) -> bytes:
        raise RunNotRunningException(f"run {run_id} is finished")

    loop._pull_and_store_message(  # type: ignore[attr-defined]
        state=state, object_store=factory.store(), node_config={}, receive=lambda: (msg, get_object_tree(msg)),
        get_run=None, get_fab=None, pull_object=stopped, confirm_message_received=None, trusted_entities=None)
    # NodeState.get_messages (1.39) is get_messages_legacy on 1.42
    get_messages = getattr(state, "get_messages_legacy", None) or state.get_messages
    return len(get_messages(run_ids=[7])), [t.status.status for t in state.get_tasks(run_ids=[7])]


def test_a_message_whose_run_stops_while_it_is_received_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower 1.39 leaves such a message stored and its task pending (its ClientApp then waits
    ~1,000 s for arrays that never come, and pflower's runner answers nothing else meanwhile:
    the SuperLink-restart test timed out on it); patched, Flower's own clean-up runs."""
    import flwr.supernode.start_client_internal as loop
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    monkeypatch.setattr(loop, "pull_objects", loop.pull_objects)       # restored after the test
    assert _receive_a_message_of_a_run_that_stops(loop) == (1, ["pending"])        # Flower's bug
    assert flower_compat.release_messages_of_stopped_runs(loop)
    assert flower_compat.release_messages_of_stopped_runs(loop)                    # once only
    assert _receive_a_message_of_a_run_that_stops(loop) == (0, ["finished"])


def _in_memory_link(monkeypatch: pytest.MonkeyPatch) -> tuple[object, int]:
    """Flower's in-memory LinkState with one node and a run pre-registered as
    ``flwr/simulation/run_simulation.py`` does it, and the ServerApp's task identity."""
    import secrets

    from flwr.common.constant import HEARTBEAT_INTERVAL_INF, NOOP_ACCOUNT_NAME, NOOP_FLWR_AID
    from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.federation import NoOpFederationManager

    state = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()).state()
    node = state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32),
                             heartbeat_interval=HEARTBEAT_INTERVAL_INF)
    state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=HEARTBEAT_INTERVAL_INF)
    run = Run.create_empty(5)
    run.primary_task_id, run.federation_id = 11, NOOP_FEDERATION_ID
    state.task_store[11] = Task(task_id=11, run_id=run.run_id)
    state.run_ids[run.run_id] = RunRecord(run=run)
    for name, value in (("_run_id", run.run_id), ("_node_id", 1), ("_task_id", 11)):   # the SuperLink's node: 1
        monkeypatch.setattr(TaskIdentity, name, value)
    return state, node


@pytest.mark.parametrize("ttl", ["round timeout", "flower default"])
def test_a_reply_after_the_round_timeout_is_refused_not_kept(monkeypatch: pytest.MonkeyPatch, ttl: str) -> None:
    """pflower's messages live as long as their round waits (``ClientDirectory.message``:
    TTL = round_timeout). On Flower's real in-memory LinkState a reply that comes after that is
    refused and nothing of it is kept; with Flower's default TTL (12 h) it is stored, and after a
    round that timed out nobody ever pulls it (FedBasis' 80-client round: 213 MB of bases per
    late reply in the server). A message not delivered before its TTL is never delivered."""
    import time

    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from common.protocol import make_reply
    from strategies.addressing import ClientDirectory

    state, node = _in_memory_link(monkeypatch)
    grid = InMemoryGrid(state_factory=SimpleNamespace(state=lambda: state))
    grid.set_run(state.run_ids[5].run)
    directory = ClientDirectory(["0"], 1, wait_for_clients=1.0, query_timeout=0.4)
    directory.node_of["0"] = node
    exchange = directory.exchange(MessageType.TRAIN)
    msg = exchange.message("0", {"w": np.ones(3, np.float32)}, {})
    if ttl == "flower default":
        msg = Message(content=msg.content, message_type=MessageType.TRAIN, dst_node_id=node)
    assert msg.metadata.ttl == (0.4 if ttl == "round timeout" else 43200.0)
    grid.push_messages([msg])
    [delivered] = state.get_message_ins(node_id=node, limit=1)
    late = exchange.message("0", {"w": np.ones(3, np.float32)}, {})
    grid.push_messages([late])
    time.sleep(0.6)                                      # the round gave up on both
    reply = make_reply(delivered, {"w": np.full(3, 2.0, np.float32)}, {"loss": 1.0}, "0", 3)
    reply.metadata.__dict__["_message_id"] = "reply"
    stored = state.store_message_res(reply)
    if ttl == "flower default":
        assert stored == "reply" and len(state.message_res_store) == 1
        return
    assert stored is None and not state.message_res_store           # refused, nothing kept
    assert state.get_message_ins(node_id=node, limit=None) == []     # the other one: never delivered


def test_the_app_bundle_holds_the_packages_and_conf_only(tmp_path: Path) -> None:
    """`flwr run` packages the project folder. A results folder that .gitignore does not list
    (results_root=results_gpu) used to travel too, and a parallel run renaming its client state
    failed the packaging ("No such file ... state-r1.json"): pyproject's fab-include keeps the
    bundle to the packages and conf/."""
    import io
    import shutil
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    repo = Path(__file__).resolve().parent.parent
    shutil.copy(repo / "pyproject.toml", tmp_path / "pyproject.toml")
    code = [f"{package}/app.py" for package in ("client", "common", "learning", "ops", "server", "strategies")]
    for path in (*code, "conf/config.yaml", "results_gpu/run/client_state/0/state-r1.json",
                 "results_gpu/run/summary.json", "docs/results.md", "tests/test_x.py", "bench/x.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}" if path.endswith(".json") else "# x\n")
    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(tmp_path))).namelist()
    assert sorted(n for n in names if not n.startswith(".info")) == sorted([*code, "conf/config.yaml", "pyproject.toml"])
