"""Malformed train replies, drawn by Hypothesis, against every method's server side.

For each method, one honest round of the real ClientApps is recorded once; then each example
sends a fresh copy of the strategy the honest replies of every client but one, whose reply is
mutated: a record dropped, renamed or of the wrong kind; an array of another dtype, shape or
size, with NaN or inf, missing, or unknown; the client id of another client, or none; the
number of examples not a count. The server must

- never raise (the round completes on the other clients),
- name the mutated client in the round's ``rejected`` or ``failed`` with a reason (the lines
  of metrics.jsonl), and
- end the round exactly where the round ends when that client's training fails outright:
  every array the strategy keeps (global, each client's personal arrays, the method's own),
  bit for bit. So a malformed reply changes no other client's state, and nothing at all.

Fixed seed (``derandomize``) and a bounded number of examples: the fast lane.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from helpers import FakeGrid
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from client import app as client_app
from common.bundles import BUNDLE_KEY, bundle, replies_of, run_bundle
from common.config import compose_config
from common.methods import method_names
from common.protocol import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    NUM_EXAMPLES,
    TARGET_CLIENT,
    from_record,
    make_reply,
    to_record,
)
from learning.datasets.federated import load_federated_data
from server.app import build_strategy

SMALL = ["dataset.clients_per_domain=1", "dataset.new_clients_per_domain=0", "finetune.epochs=1",
         "fraction_train=1.0", "min_train_clients=2", "train.local_epochs=1"]
EXAMPLES = 12   # per method: 13 methods x 12 examples, a few seconds each method


class Honest:
    """A method's strategy before its first round, and the honest reply content of each client
    to that round's train message (recorded once through the real ClientApp)."""

    def __init__(self, name: str, root: Path) -> None:
        run_config = {"strategy": name, "rounds": "2", "results-root": str(root), "run-name": name,
                      "overrides": " ".join(SMALL)}
        cfg = compose_config(run_config)
        data = load_federated_data(cfg.dataset, int(cfg.seed))
        self.strategy = build_strategy(cfg, data)
        self.answers: dict[str, Any] = {}
        self.grid = FakeGrid(data.client_ids, lambda cid, msg: self.answers[cid](msg))
        contexts = {cid: Context(run_id=1, node_id=i + 1, node_config={"partition-id": i,
                                                                       "num-partitions": len(data.client_ids)},
                                 state=RecordDict(), run_config=run_config)
                    for i, cid in enumerate(data.client_ids)}
        first = copy.deepcopy(self.strategy)
        train = first.begin_train(1, {"run-name": name, "num-rounds": 2, "resume-round": 0}, self.grid)
        self.config = {"run-name": name, "num-rounds": 2, "resume-round": 0}
        self.content: dict[str, RecordDict] = {}
        for msg in train.messages:
            cid = self.grid.target_of(msg)
            self.content[cid] = client_app.train(msg, contexts[cid]).content
        self.client_ids = sorted(self.content)

    def round(self, victim: str, reply_of_victim: Any) -> tuple[Any, Any]:
        """A fresh strategy's round 1 with the honest replies and ``reply_of_victim(msg)``
        for ``victim``: (the strategy after it, the round's log)."""
        strategy = copy.deepcopy(self.strategy)
        for cid in self.client_ids:
            self.answers[cid] = (lambda msg, cid=cid: Message(copy.deepcopy(self.content[cid]), reply_to=msg))
        self.answers[victim] = reply_of_victim
        train = strategy.begin_train(1, self.config, self.grid)
        for reply in self.grid.send_and_receive(train.messages):
            train.replies.take(reply)
        result = strategy.aggregate_round(train)
        json.dumps(result.notes)     # the round's notes go into metrics.jsonl as they are
        return strategy, result.log


_HONEST: dict[str, Honest] = {}


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Any:
    def get(name: str) -> Honest:
        if name not in _HONEST:
            _HONEST[name] = Honest(name, tmp_path_factory.mktemp(name))
        return _HONEST[name]
    return get


# ------------------------------------------------------------------ mutations
def _arrays(content: RecordDict) -> dict[str, np.ndarray]:
    return from_record(content.array_records[ARRAYS_KEY])


def _with_arrays(content: RecordDict, arrays: dict[str, np.ndarray]) -> RecordDict:
    content[ARRAYS_KEY] = to_record(arrays)
    return content


def _pick(draw: Any, keys: list[str]) -> str:
    return draw(st.sampled_from(sorted(keys)))


ARRAY_KINDS = ("dtype", "shape", "nonfinite", "drop-array")


@st.composite
def mutations(draw: Any) -> tuple[str, Any]:
    """(what it does, content -> malformed content); each one breaks the reply's contract."""
    kind = draw(st.sampled_from(["drop-record", "rename-record", "wrong-kind", "dtype", "shape", "nonfinite",
                                 "drop-array", "unknown-array", "other-client", "no-client", "num-examples"]))
    record = draw(st.sampled_from([ARRAYS_KEY, METRICS_KEY]))
    dtype = draw(st.sampled_from(["float64", "float16", "int32", "int64", "uint8", "bool"]))
    special = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    grow = draw(st.integers(min_value=-3, max_value=3).filter(lambda n: n != 0))
    count = draw(st.sampled_from([math.nan, math.inf, -1.0, 1e30, 0.5]))
    other = draw(st.integers(min_value=1, max_value=50))
    new_name = draw(st.text("abcdefghij.", min_size=1, max_size=12))

    def mutate(content: RecordDict) -> RecordDict:
        arrays = _arrays(content)
        # a method that uploads no arrays (Local) has none to break, and an empty record
        # dropped is the same reply
        assume(arrays or kind not in ARRAY_KINDS and (kind, record) != ("drop-record", ARRAYS_KEY))
        key = _pick(draw, list(arrays)) if arrays else None
        if kind == "drop-record":
            del content[record]
        elif kind == "rename-record":
            content[f"{record}-{new_name}"] = content[record]
            del content[record]
        elif kind == "wrong-kind":
            del content[record]
            content[record] = ConfigRecord({"x": 1}) if record == ARRAYS_KEY else to_record({"x": np.ones(2)})
        elif kind == "dtype":
            a = arrays[key]
            target = np.dtype(dtype) if np.dtype(dtype) != a.dtype else np.dtype("complex64")
            arrays[key] = a.astype(target)
            _with_arrays(content, arrays)
        elif kind == "shape":
            a = arrays[key].ravel()
            arrays[key] = (np.concatenate([a, np.zeros(abs(grow), a.dtype)]) if grow > 0 or a.size + grow <= 0
                           else a[: a.size + grow])
            _with_arrays(content, arrays)
        elif kind == "nonfinite":
            floating = [k for k, a in arrays.items() if np.issubdtype(a.dtype, np.floating) and a.size]
            key = _pick(draw, floating)
            a = arrays[key].copy()
            a.ravel()[draw(st.integers(0, a.size - 1))] = special
            arrays[key] = a
            _with_arrays(content, arrays)
        elif kind == "drop-array":
            del arrays[key]
            _with_arrays(content, arrays)
        elif kind == "unknown-array":
            arrays[f"zz.{new_name}"] = np.zeros(3, np.float32)
            _with_arrays(content, arrays)
        else:
            metrics = dict(content.metric_records[METRICS_KEY].items())
            ids = [k for k in metrics if k.startswith("client")]
            if kind == "other-client":
                for k in ids:
                    metrics[k] = metrics[k] + other if isinstance(metrics[k], int) else metrics[k]
                metrics = {**metrics, **_client_id_metrics(str(other + 100))}
            elif kind == "no-client":
                for k in ids:
                    metrics.pop(k)
            else:
                metrics[NUM_EXAMPLES] = count
            content[METRICS_KEY] = MetricRecord(metrics)
        return content

    return kind, mutate


def _client_id_metrics(cid: str) -> dict[str, Any]:
    from common.protocol import encode_client_id

    return dict(encode_client_id(cid))


# ------------------------------------------------------------------ the property
def _state(strategy: Any) -> dict[str, dict[str, np.ndarray]]:
    return strategy.state()[0]


def _assert_same_state(got: Any, want: Any, why: str) -> None:
    a, b = _state(got), _state(want)
    assert sorted(a) == sorted(b), why
    for group in a:
        assert sorted(a[group]) == sorted(b[group]), (why, group)
        for k in a[group]:
            np.testing.assert_array_equal(a[group][k], b[group][k], err_msg=f"{why}: {group}/{k}")


@pytest.mark.usefixtures("flower_task")
@pytest.mark.parametrize("name", method_names())
def test_a_malformed_reply_is_refused_and_changes_nothing(name: str, honest: Any) -> None:
    method = honest(name)
    failed_rounds: dict[str, Any] = {}

    def crashed(victim: str) -> Any:
        """The round in which ``victim``'s training fails outright (the reference)."""
        if victim not in failed_rounds:
            failed_rounds[victim] = method.round(
                victim, lambda msg: Message(Error(code=0, reason="training failed"), reply_to=msg))[0]
        return failed_rounds[victim]

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(victim=st.sampled_from(method.client_ids), mutation=mutations())
    def check(victim: str, mutation: tuple[str, Any]) -> None:
        kind, mutate = mutation
        strategy, round_log = method.round(
            victim, lambda msg: Message(mutate(copy.deepcopy(method.content[victim])), reply_to=msg))
        problems = {**round_log.failed, **round_log.rejected}
        assert victim in problems and str(problems[victim]).strip(), (kind, problems)
        others = [c for c in method.client_ids if c != victim]
        assert sorted(round_log.replied) == others, (kind, round_log.replied)
        _assert_same_state(strategy, crashed(victim), f"{name}, {kind} from client {victim}")

    check()


# ------------------------------------------------------------------ the client's side
class Instruction:
    """An honest train message of round 1 for client 0 (FedBN: BN layers of its own), and the
    ClientApp's context of that client's node."""

    def __init__(self, root: Path) -> None:
        self.run_config = {"strategy": "fedbn", "rounds": "2", "results-root": str(root), "run-name": "c",
                           "overrides": " ".join(SMALL)}
        cfg = compose_config(self.run_config)
        data = load_federated_data(cfg.dataset, int(cfg.seed))
        self.num_clients = len(data.client_ids)
        train = build_strategy(cfg, data).begin_train(1, {"run-name": "c", "num-rounds": 2, "resume-round": 0},
                                                      FakeGrid(data.client_ids))
        self.message = next(m for m in train.messages if FakeGrid(data.client_ids).target_of(m) == "0")
        self.state_dir = root / "c" / "client_state" / "0"

    def context(self) -> Context:
        return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": self.num_clients},
                       state=RecordDict(), run_config=self.run_config)


@st.composite
def bad_instructions(draw: Any) -> tuple[str, Any]:
    """(what it does, content -> malformed content): each must be refused."""
    kind = draw(st.sampled_from(["drop-config", "drop-arrays", "round", "resume-round", "nonfinite", "shape",
                                 "unknown-array", "other-client"]))
    bad_round = draw(st.one_of(st.text(max_size=5), st.floats(allow_nan=True), st.integers(max_value=0),
                               st.booleans()))
    bad_resume = draw(st.one_of(st.text(max_size=5), st.floats(), st.integers(max_value=-1)))
    special = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    grow = draw(st.integers(min_value=1, max_value=3))
    other = draw(st.one_of(st.integers(1, 40).map(str), st.text("xyz-", min_size=1, max_size=4)))

    def mutate(content: RecordDict) -> RecordDict:
        config = dict(content.config_records[CONFIG_KEY].items())
        arrays = _arrays(content)
        key = _pick(draw, list(arrays))
        if kind == "drop-config":
            del content[CONFIG_KEY]
        elif kind == "drop-arrays":
            del content[ARRAYS_KEY]
        elif kind in ("round", "resume-round", "other-client"):
            name = {"round": "server-round", "resume-round": "resume-round", "other-client": TARGET_CLIENT}[kind]
            config[name] = {"round": bad_round, "resume-round": bad_resume, "other-client": other}[kind]
            content[CONFIG_KEY] = ConfigRecord(config)
        elif kind == "nonfinite":
            a = arrays[key].astype(np.float32, copy=True)
            a.ravel()[draw(st.integers(0, a.size - 1))] = special
            arrays[key] = a
            _with_arrays(content, arrays)
        elif kind == "shape":
            arrays[key] = np.concatenate([arrays[key].ravel(), np.zeros(grow, arrays[key].dtype)])
            _with_arrays(content, arrays)
        else:
            arrays[f"zz.{other}"] = np.zeros(2, np.float32)
            _with_arrays(content, arrays)
        return content

    return kind, mutate


@pytest.mark.usefixtures("flower_task")
def test_the_clientapp_refuses_a_malformed_instruction_by_name_and_saves_nothing(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    setup = Instruction(tmp_path_factory.mktemp("client"))
    honest_reply = client_app.train(Message(copy.deepcopy(setup.message.content), dst_node_id=1,
                                            message_type=MessageType.TRAIN), setup.context())
    assert not honest_reply.has_error() and sorted(p.name for p in setup.state_dir.glob("*.npz")) == \
        ["state-r000001.npz"]
    saved = (setup.state_dir / "state-r000001.npz").read_bytes()

    @settings(max_examples=40, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutation=bad_instructions())
    def check(mutation: tuple[str, Any]) -> None:
        kind, mutate = mutation
        msg = Message(mutate(copy.deepcopy(setup.message.content)), dst_node_id=1, message_type=MessageType.TRAIN)
        with pytest.raises((ValueError, KeyError)) as caught:
            client_app.train(msg, setup.context())
        assert len(str(caught.value)) > 20, (kind, caught.value)   # a sentence, not a bare key
        # nothing saved: the one version is the honest round's, byte for byte
        assert sorted(p.name for p in setup.state_dir.glob("*.npz")) == ["state-r000001.npz"], kind
        assert (setup.state_dir / "state-r000001.npz").read_bytes() == saved, kind

    check()


# ------------------------------------------------------------------ bundles
@st.composite
def lying_bundles(draw: Any) -> tuple[str, Any]:
    """(what it does, content -> the reply content of a bundle of 3 that lies about it)."""
    kind = draw(st.sampled_from(["size", "index", "no-index", "drop-size"]))
    size = draw(st.one_of(st.integers(-2, 9).filter(lambda n: n != 3), st.text(max_size=3), st.floats()))
    index = draw(st.one_of(st.integers(3, 99).map(str), st.sampled_from(["-1", "x", "", "1.0"])))

    def mutate(content: RecordDict) -> RecordDict:
        if kind == "size":
            content[BUNDLE_KEY] = ConfigRecord({"size": size})
        elif kind == "drop-size":
            del content[BUNDLE_KEY]
        else:
            key = draw(st.sampled_from(sorted(k for k in content if k != BUNDLE_KEY)))
            content[f"{index}/{key.partition('/')[2]}" if kind == "index" else key.partition("/")[2] + "x"] = \
                content[key]
            del content[key]
        return content

    return kind, mutate


@pytest.mark.usefixtures("flower_task")
def test_a_bundle_reply_that_lies_is_every_message_s_error_never_a_crash() -> None:
    group = [Message(RecordDict({CONFIG_KEY: ConfigRecord({TARGET_CLIENT: str(c)})}), dst_node_id=7,
                     message_type=MessageType.TRAIN) for c in range(3)]
    one = bundle(group)

    def answer(msg: Message, context: Context) -> Message:
        cid = str(msg.content.config_records[CONFIG_KEY][TARGET_CLIENT])
        return make_reply(msg, {"w": np.full(2, float(cid), np.float32)}, {"loss": 1.0}, cid, 10)

    honest = run_bundle(one, Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={}), answer)
    replies = replies_of(honest, group)
    assert [from_record(r.content.array_records[ARRAYS_KEY])["w"][0] for r in replies] == [0.0, 1.0, 2.0]

    @settings(max_examples=40, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutation=lying_bundles())
    def check(mutation: tuple[str, Any]) -> None:
        kind, mutate = mutation
        lie = Message(mutate(copy.deepcopy(honest.content)), reply_to=one)
        got = replies_of(lie, group)
        assert [r.metadata.reply_to_message_id for r in got] == [m.metadata.message_id for m in group], kind
        assert all(r.has_error() and "malformed bundle reply" in r.error.reason for r in got), kind

    check()


# ------------------------------------------------------------------ the examples they found, kept
FOUND_INSTRUCTIONS = [
    ("no config record", lambda c: c.__delitem__(CONFIG_KEY), "has no 'config' config record"),
    ("a textual round", lambda c: c.__setitem__(CONFIG_KEY, ConfigRecord(
        {**dict(c.config_records[CONFIG_KEY].items()), "server-round": "two"})), "'server-round' must be a whole"),
    ("a negative round", lambda c: c.__setitem__(CONFIG_KEY, ConfigRecord(
        {**dict(c.config_records[CONFIG_KEY].items()), "server-round": -3})), "'server-round' must be a whole"),
    ("NaN in the server's arrays", lambda c: _with_arrays(c, {k: np.full_like(a, np.nan) if a.dtype.kind == "f" else a
                                                              for k, a in _arrays(c).items()}), "contain NaN or Inf"),
]


@pytest.mark.usefixtures("flower_task")
@pytest.mark.parametrize(("what", "mutate", "says"), FOUND_INSTRUCTIONS, ids=[c[0] for c in FOUND_INSTRUCTIONS])
def test_found_a_malformed_instruction_is_refused_by_name(what: str, mutate: Any, says: str,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Found by the property above: without a config record the ClientApp trained as round 0;
    NaN arrays trained into NaN and said to lower the lr; a textual round failed with
    ``invalid literal for int()`` and a negative one was taken."""
    setup = Instruction(tmp_path_factory.mktemp("found"))
    content = copy.deepcopy(setup.message.content)
    mutate(content)
    with pytest.raises(ValueError, match=re.escape(says)):
        client_app.train(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), setup.context())
    assert not list(setup.state_dir.glob("*.npz")), what


@pytest.mark.usefixtures("flower_task")
def test_found_a_bundle_reply_with_a_record_past_its_size_is_an_error_per_message() -> None:
    """Found by the property above: ``IndexError`` in the split stopped the run."""
    group = [Message(RecordDict({CONFIG_KEY: ConfigRecord({TARGET_CLIENT: str(c)})}), dst_node_id=7,
                     message_type=MessageType.TRAIN) for c in range(2)]
    one = bundle(group)
    lie = Message(RecordDict({BUNDLE_KEY: ConfigRecord({"size": 2}), "5/metrics": MetricRecord({"x": 1.0})}),
                  reply_to=one)
    got = replies_of(lie, group)
    assert [r.error.reason for r in got] == ["malformed bundle reply: a bundle of 2 messages holds a record "
                                             "'5/metrics' of none of them"] * 2
