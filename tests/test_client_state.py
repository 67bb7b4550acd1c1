"""Per-client private state survives rounds and a client restart; corruption is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.baselines import DittoTrainer, FedBNTrainer, LocalTrainer
from client.round import ClientRound
from client.state import ClientStateStore, StateCorruptError
from client.trainer import ClientTrainer
from common.config import ComposedRun, _compose_cached, compose_run
from learning.datasets.federated import load_federated_data
from learning.models import build_model, parameter_groups
from learning.params import get_arrays


def test_store_roundtrip_and_restart(tmp_path):
    from flwr.app import RecordDict

    ctx_state = RecordDict()
    store = ClientStateStore(tmp_path / "c0", ctx_state)
    assert store.load() == ({}, {})
    arrays = {"model/w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(3, dtype=np.int64)}
    store.save(arrays, {"last_round": 2})
    got, meta = store.load()  # from context.state
    assert meta == {"last_round": 2} and np.array_equal(got["model/w"], arrays["model/w"])
    # a restarted client has a fresh context: state comes back from disk
    got2, meta2 = ClientStateStore(tmp_path / "c0", RecordDict()).load()
    assert meta2 == {"last_round": 2} and np.array_equal(got2["n"], arrays["n"])


def test_truncated_state_is_refused(tmp_path):
    store = ClientStateStore(tmp_path / "c1")
    store.save({"w": np.ones(1000, dtype=np.float32)}, {})
    data = store.path.read_bytes()
    store.path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StateCorruptError, match="checksum"):
        ClientStateStore(tmp_path / "c1").load()


def _round(run: ComposedRun, cid="0", server_round=1):
    data = load_federated_data(run.cfg.dataset, int(run.cfg.seed))
    return ClientRound(settings=run.settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=torch.device("cpu"), server_round=server_round)


def _initial(cfg):
    data = load_federated_data(cfg.dataset, int(cfg.seed))
    torch.manual_seed(0)
    return get_arrays(build_model(cfg.model, data.input_shape, data.num_classes))


def test_fedbn_keeps_bn_local_across_rounds_and_restart(tmp_path):
    run = compose_run({"strategy": "fedbn"})
    cfg = run.cfg
    trainer = FedBNTrainer(cfg, run.settings)
    payload = _initial(cfg)
    res1 = trainer.fit(_round(run), payload, {})
    model = build_model(cfg.model, (1, 8, 8), 10)
    bn = parameter_groups(model)["bn"]
    assert bn and not set(bn) & set(res1.upload), "FedBN must not upload BN tensors"
    store = ClientStateStore(tmp_path / "0")
    store.save(res1.state, {"last_round": 1})
    # restart: a new store object reads the disk; the server sends a payload with other BN values
    state, _ = ClientStateStore(tmp_path / "0").load()
    payload2 = {k: (v + 5.0 if k in bn and v.dtype.kind == "f" else v) for k, v in payload.items()}
    loaded = trainer.load_model(_round(run, server_round=2), payload2, state)
    got = get_arrays(loaded, bn)
    for k in bn:
        np.testing.assert_array_equal(got[k], res1.state["model/" + k])


def test_local_uploads_nothing_and_continues_its_own_model(tmp_path):
    run = compose_run({"strategy": "local"})
    cfg = run.cfg
    trainer = LocalTrainer(cfg, run.settings)
    payload = _initial(cfg)
    r1 = trainer.fit(_round(run), payload, {})
    assert r1.upload == {}
    junk = {k: np.zeros_like(v) for k, v in payload.items()}
    model = trainer.load_model(_round(run, server_round=2), junk, r1.state)
    for k, v in get_arrays(model).items():
        np.testing.assert_array_equal(v, r1.state["model/" + k])


def test_ditto_personal_model_persists_and_differs_from_global():
    run = compose_run({"strategy": "ditto"})
    cfg = run.cfg
    trainer = DittoTrainer(cfg, run.settings)
    payload = _initial(cfg)
    r1 = trainer.fit(_round(run), payload, {})
    personal = {k[len("personal/"):]: v for k, v in r1.state.items() if k.startswith("personal/")}
    assert personal and set(personal) == set(payload)
    assert any(not np.array_equal(personal[k], r1.upload[k]) for k in r1.upload)
    model = trainer.personal_model(_round(run, server_round=2), payload, r1.state)
    for k, v in get_arrays(model).items():
        np.testing.assert_array_equal(v, personal[k])


def test_fedavg_trainer_learns_on_its_split():
    run = compose_run({}, ["train.local_epochs=5"])
    cfg = run.cfg
    trainer = ClientTrainer(cfg, run.settings)
    rnd = _round(run)
    payload = _initial(cfg)
    before = trainer.evaluate(rnd, payload, {})
    res = trainer.fit(rnd, payload, {})
    after = trainer.evaluate(rnd, res.upload, {})
    assert after["val_loss"] < before["val_loss"]
    assert res.num_examples == len(rnd.data.train)


def test_fedprox_proximal_term_pulls_towards_the_global_model():
    from client.baselines import FedProxTrainer

    def drift(strategy, mu):
        run = compose_run({"strategy": strategy}, ["train.local_epochs=3"] + ([f"strategy.mu={mu}"] if mu else []))
        cfg = run.cfg
        trainer = FedProxTrainer(cfg, run.settings) if strategy == "fedprox" else ClientTrainer(cfg, run.settings)
        payload = _initial(cfg)
        up = trainer.fit(_round(run), payload, {}).upload
        params = [k for k in up if "running_" not in k and up[k].dtype.kind == "f"]  # parameters, not BN stats
        return sum(float(np.sum((up[k].astype(np.float64) - payload[k]) ** 2)) for k in params)

    assert drift("fedprox", 5.0) < 0.5 * drift("fedavg", 0)


def test_a_process_makes_one_trainer_per_configuration() -> None:
    """A trainer holds nothing of a client, so the messages of one run share the process'
    trainer of its configuration (made once, not per message); another configuration gets
    its own, of its own method."""
    from client.handlers import trainer_for

    fedavg, ditto = compose_run({}, []), compose_run({"strategy": "ditto"}, [])
    first = trainer_for(fedavg)
    assert trainer_for(compose_run({}, [])) is first and type(first) is ClientTrainer
    # composed again after the composition cache let it go (it may read other files now: an
    # image tree's domains), the configuration gets a trainer of its own, made from it
    _compose_cached.cache_clear()
    again = compose_run({}, [])
    assert again is not fedavg and again.key == fedavg.key
    assert trainer_for(again) is not first and trainer_for(again).cfg is again.cfg
    other = trainer_for(ditto)
    assert isinstance(other, DittoTrainer) and other.cfg is ditto.cfg and first.cfg is fedavg.cfg
    assert other.settings is ditto.settings and other.settings.strategy == "ditto"
