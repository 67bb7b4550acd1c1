"""The method contract: every row of the method table (``common/methods.py``) passes these
checks, so a new method gets them by adding its row.

Each method runs through the real server loop (``server.loop.run_federation``: configure,
aggregate, evaluate, checkpoint) and the real ClientApp (``client.app``: wire records,
private state store), connected by a fake grid in this process:

1. one round: every sampled client replies, nothing is rejected; each upload holds exactly
   the method's shared and personal tensors (never a local or frozen one); frozen tensors
   never change on the server; every client is evaluated;
2. the server checkpoint round-trips: a fresh strategy restored from it sends every
   client bit-for-bit the payload the original would send;
3. private state survives a restart: 1 round, then every client process "restarts" (fresh
   Flower context, state only on disk) and the server resumes from its checkpoint; round 2
   then ends bit-for-bit where an uninterrupted 2-round run ends;
4. a round's evaluation carried by the next round's training messages (``eval_in_train``,
   the default) gives every client's numbers bit for bit as separate evaluate messages do,
   and only the final round sends evaluate messages;
5. a round changes only the strategy's declared ``carried_state`` (what later rounds need),
   and the checkpoint restores every part of it: what a round computes for its record comes
   back from the aggregation, it is not parked on the strategy for a later call.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, MessageType, RecordDict
from helpers import PRIVATE_FORM, FakeGrid

from client import app as client_app
from client.secure_aggregation import stage_of
from common.config import compose_run
from common.methods import method, method_names, resolve_method, roles_of
from common.protocol import ARRAYS_KEY, from_record
from common.roles import FROZEN, UPLOADED, keys_with
from common.secure_aggregation import COLLECT, MASKED_RECORD, WEIGHT_ENTRY
from learning.datasets.federated import load_federated_data
from server.app import build_strategy
from server.checkpoint import load_checkpoint
from server.loop import checkpoint_identity, run_federation
from server.results import RunRecorder

# differential privacy of the shared part (docs/privacy.md), with the noise's key fixed so that
# the restarted and straight runs draw the same noise; every method that can take it
DP = ["privacy.dp=central", "privacy.noise_seed=7", "privacy.clip_norm=2.0", "privacy.noise_multiplier=0.3"]
# secure aggregation of the shared part (SecAgg+), alone and with DP (the clients clip, the server noises)
SECURE = ["privacy.secure_aggregation=secagg+"]
SECURE_DP = [*SECURE, *DP]
DISTRIBUTED_DP = [*SECURE, *DP[1:], "privacy.dp=distributed"]   # the clients add the noise
# record-level DP-SGD of the clients' training (Opacus), on a model without BatchNorm
DPSGD = ["privacy.record_dp=dpsgd", "model=mlp", "privacy.noise_seed=7"]   # fixed noise: restarts bit for bit
CASES = [(name, []) for name in method_names()] + [
    (name, [f"strategy.{flag}=true"]) for name in method_names() for flag, _ in method(name).variants] + [
    (name, extra) for extra in (DP, SECURE) for name in method_names() if not method(name).not_private] + [
    # the combinations on two methods (one whole model, one body with a frozen head): the rest of
    # each combination is the same code path, and CI's time is kept for the lanes
    (name, extra) for extra in (SECURE_DP, DISTRIBUTED_DP) for name in ("fedavg", "fedbabu")] + [
    (name, DPSGD) for name in ("fedavg", "fedbabu", "ditto", "partialfed-fix")]
SMALL = ["dataset.clients_per_domain=1", "dataset.new_clients_per_domain=0", "finetune.epochs=1",
         "checkpoint_every=1", "fraction_train=1.0", "deterministic=true"]   # bit-identical on CUDA too
# a method whose round trains for epochs of its own options: one each (the same code path, CI's time)
SMALLER = {"fedbasis": ["strategy.coeff_epochs=1", "strategy.basis_epochs=1"]}


def _run_config(name: str, extra: list[str], root: Path, run: str, rounds: int,
                resume: Path | None = None) -> dict[str, Any]:
    form = PRIVATE_FORM.get(name, []) if any(e.startswith("privacy.") for e in extra) else []
    overrides = [*SMALL, *SMALLER.get(name, []), *form, *extra] + ([f"resume={resume}"] if resume else [])
    return {"strategy": name, "rounds": str(rounds), "results-root": str(root), "run-name": run,
            "overrides": " ".join(overrides)}


class Clients:
    """The ClientApp of every client, with one Flower context (node state) per client; the
    uploads seen per round are kept for the checks."""

    def __init__(self, run_config: dict[str, Any], client_ids: list[str], run_id: int) -> None:
        self.run_config, self.run_id = run_config, run_id
        self.contexts = {cid: self.context(cid, len(client_ids)) for cid in client_ids}
        self.uploads: dict[str, set[str]] = {}
        self.masked: dict[str, set[str]] = {}       # secure aggregation: the masked vector's entries
        self.evaluate_messages = 0

    def context(self, cid: str, n: int) -> Context:
        return Context(run_id=self.run_id, node_id=int(cid) + 1,
                       node_config={"partition-id": int(cid), "num-partitions": n},
                       state=RecordDict(), run_config=self.run_config)

    def __call__(self, cid: str, msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            reply = client_app.train(msg, self.contexts[cid])
            if stage_of(msg) in (None, COLLECT):    # a training message (not a key exchange)
                self.uploads[cid] = set(from_record(reply.content.array_records.get(ARRAYS_KEY)))
                self.masked[cid] = set(from_record(reply.content.array_records.get(MASKED_RECORD)))
            return reply
        self.evaluate_messages += 1
        return client_app.evaluate(msg, self.contexts[cid])


def _federate(run_config: dict[str, Any], run_id: int,
              before: dict[str, Any] | None = None) -> tuple[Any, Clients, Any]:
    """Run the federation; ``before`` (when given) receives a copy of the strategy's
    attributes as built, before any round."""
    run = compose_run(run_config)
    cfg = run.cfg
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    strategy = build_strategy(cfg, data)
    if before is not None:
        before.update({k: copy.deepcopy(v) for k, v in vars(strategy).items() if k not in ("data", "model")})
    clients = Clients(run_config, data.client_ids, run_id)
    run_federation(strategy, FakeGrid(data.client_ids, clients), run.settings,
                   RunRecorder(cfg, run.settings, resume=bool(cfg.resume)))
    return strategy, clients, run


def _same(a: Any, b: Any) -> bool:
    """Equal by value: arrays bit for bit (dtype and shape too), containers item by item,
    a random generator by its state, other objects by their attributes."""
    if isinstance(a, np.ndarray | np.generic) or isinstance(b, np.ndarray | np.generic):
        a, b = (np.asarray(x) if isinstance(x, np.generic) else x for x in (a, b))   # a 0-d array's scalar
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, random.Random):
        return a.getstate() == b.getstate()
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return _same(vars(a), vars(b))
    return bool(a == b)


@pytest.mark.usefixtures("flower_task")
@pytest.mark.parametrize(("name", "extra"), CASES, ids=[" ".join([n, *e]) for n, e in CASES])
def test_method_contract(name: str, extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ---- 1. one round through server loop, wire and ClientApp
    one = _run_config(name, extra, tmp_path, "restarted", rounds=1)
    true_uploads = _record_true_uploads(monkeypatch)   # under secure aggregation: what was masked
    before: dict[str, Any] = {}
    strategy, clients, composed = _federate(one, run_id=1, before=before)
    cfg = composed.cfg
    initial = build_strategy(cfg, load_federated_data(cfg.dataset, int(cfg.seed)))
    roles = roles_of(resolve_method(cfg.strategy).row, strategy.model)
    assert set(roles) == set(strategy.model.state_dict())
    record = _records(tmp_path / "restarted")[-1]
    assert record["failed"] == {} and record["rejected"] == {}, (record["failed"], record["rejected"])
    assert sorted(record["sampled"]) == sorted(strategy.client_ids)
    secure = strategy.secure is not None
    masked = set(strategy.secure.masked_keys) if secure else set()
    for cid, keys in clients.uploads.items():    # under secure aggregation the shared float tensors go masked
        assert keys == set(keys_with(roles, *UPLOADED)) - masked, f"client {cid} uploaded {sorted(keys)[:5]}"
        assert clients.masked[cid] == (masked | {WEIGHT_ENTRY} if secure else set()), f"client {cid} masked"
    if secure:
        assert masked and masked <= set(keys_with(roles, "shared"))
        assert record["secure_aggregation"]["clients"] == len(strategy.client_ids)
        if extra == SECURE:   # the unmasked mean is the plain (weighted) mean of the true uploads, within its bound
            ups = [true_uploads[c] for c in sorted(true_uploads)]
            weights = [float(n) if strategy.weighted else 1.0 for _, n in ups]
            bound = record["secure_aggregation"]["mean_bound"]
            for k in masked:
                plain = sum(w * up[k].astype(np.float64) for w, (up, _) in zip(weights, ups, strict=True)) / sum(weights)
                diff = np.abs(strategy.global_arrays[k].astype(np.float64) - plain).max()
                assert diff <= bound + 1e-6 * (1 + np.abs(plain).max()), (name, k, diff, bound)
    for k in keys_with(roles, FROZEN):
        np.testing.assert_array_equal(strategy.global_arrays[k], initial.global_arrays[k])
    assert sorted(record["clients"]) == sorted(strategy.client_ids)
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in record["clients"].values())
    if extra == DPSGD:   # every client trained with DP-SGD and reported its epsilon
        assert sorted(record["record_dp"]["epsilon"]) == sorted(strategy.client_ids), record.get("record_dp")
        assert all(e > 0 for e in record["record_dp"]["epsilon"].values())
    if extra in (DP, SECURE_DP, DISTRIBUTED_DP):   # the round was clipped, noised and accounted
        assert record["privacy"]["epsilon"] > 0 and record["privacy"]["noise_std"] > 0, record.get("privacy")
        assert strategy.privacy is not None and strategy.privacy.releases == 1

    # ---- 5. a round changes only the carried state (the checkpoint's part is checked in 2.)
    changed = sorted(k for k, v in vars(strategy).items()
                     if k not in ("data", "model") and (k not in before or not _same(before[k], v)))
    assert set(changed) <= set(strategy.carried_state), (
        f"{name}: a round wrote {sorted(set(changed) - set(strategy.carried_state))} on the strategy; return "
        "what a round computes from aggregate_updates, or declare what later rounds need in carried_state")

    # ---- 2. checkpoint round trip
    run_dir = tmp_path / "restarted"
    last, groups, meta = load_checkpoint(run_dir, checkpoint_identity(composed.settings, len(strategy.client_ids)))
    assert last == 1
    groups.pop("_rng", None)
    restored = build_strategy(cfg, load_federated_data(cfg.dataset, int(cfg.seed)))
    restored.load_state(groups, meta["strategy_state"])
    for attribute in strategy.carried_state:
        if attribute != "directory":   # which node serves which client: learned again after a restart
            assert _same(getattr(restored, attribute), getattr(strategy, attribute)), f"{name}: {attribute}"
    for cid in strategy.client_ids:
        sent, again = strategy.payload_for(cid), restored.payload_for(cid)
        assert sorted(sent) == sorted(again)
        for k in sent:
            np.testing.assert_array_equal(sent[k], again[k], err_msg=f"{name}: {cid}/{k}")

    # ---- 3. restart (fresh client contexts, server resumed) == uninterrupted
    resumed, _, _ = _federate(_run_config(name, extra, tmp_path, "restarted", 2, resume=run_dir), 2)
    straight, _, _ = _federate(_run_config(name, extra, tmp_path, "straight", rounds=2), run_id=3)
    resumed_last, straight_last = _records(run_dir)[-1], _records(tmp_path / "straight")[-1]
    assert resumed_last["failed"] == {} and resumed_last["rejected"] == {}
    for cid in straight.client_ids:
        for metric in ("accuracy", "val_accuracy"):
            assert resumed_last["clients"][cid][metric] == straight_last["clients"][cid][metric], (cid, metric)
    for group, arrays in straight.state()[0].items():
        for k, v in arrays.items():
            np.testing.assert_array_equal(resumed.state()[0][group][k], v, err_msg=f"{group}/{k}")

    # ---- 4. evaluation in the next round's training messages == evaluate messages
    separate, sep_clients, _ = _federate(_run_config(name, [*extra, "eval_in_train=false"], tmp_path, "separate",
                                                     rounds=2), run_id=4)
    fused_clients = _federate(_run_config(name, extra, tmp_path, "fused", rounds=2), run_id=5)[1]
    fused_rounds, sep_rounds = (_records(tmp_path / run) for run in ("fused", "separate"))
    assert [r["round"] for r in fused_rounds] == [1, 2]
    for f, s in zip(fused_rounds, sep_rounds, strict=True):
        assert f["clients"] == s["clients"], f"{name}: round {f['round']}"
        assert f["evaluate"] == s["evaluate"]
    n = len(separate.client_ids)
    assert (sep_clients.evaluate_messages, fused_clients.evaluate_messages) == (2 * n, n)


def _record_true_uploads(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[dict[str, np.ndarray], int]]:
    """Each client's upload of the first round as it was before masking (secure aggregation)."""
    from client import secure_aggregation as client_secagg

    seen: dict[str, tuple[dict[str, np.ndarray], int]] = {}
    real = client_secagg.mask_upload

    def recording(secrets: Any, config: Any, payload: Any, upload: Any, num_examples: int, seed: int,
                  client_id: str, *rest: Any) -> Any:
        if secrets.server_round == 1:
            seen.setdefault(client_id, ({k: np.array(v, copy=True) for k, v in upload.items()}, num_examples))
        return real(secrets, config, payload, upload, num_examples, seed, client_id, *rest)

    monkeypatch.setattr(client_secagg, "mask_upload", recording)
    return seen


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
