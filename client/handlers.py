"""What the ClientApp does with each message: thin glue between Flower messages and a
method's trainer. ``client/app.py`` imports this module on the first message that needs it.

Identity and data come from the node: ``partition-id`` (simulation) or ``client-id`` in
``--node-config``, optional ``data-root`` (overrides ``dataset.root``) and ``state-dir``
(where this client's private state lives; default ``<results_root>/<run>/client_state``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message

from client import secure_aggregation as secagg
from client.identity import client_id_of, serves_several
from client.round import ClientRound
from client.state import ClientStateStore
from client.trainer import ClientTrainer
from common.config import ComposedRun, compose_run
from common.methods import ResolvedMethod, load_named
from common.protocol import (
    ARRAYS_KEY,
    CONFIG_KEY,
    EVALUATE_ROUND,
    NUM_VAL_EXAMPLES,
    add_evaluation,
    config_dict,
    from_record,
    make_reply,
    to_record,
)
from common.secure_aggregation import CLIPPED_METRIC, COLLECT, MASKED_RECORD
from common.settings import Settings
from common.timing import note, part
from learning.datasets.cache import load_client_data, resolve_cache_dir
from learning.dpsgd import epsilon_of, record_training
from learning.models import resolve_device, set_deterministic


def client_config(context: Context) -> ComposedRun:
    """The run's configuration on this node, composed once per process: the node's
    ``data-root`` (if any) is where a dataset read from files lies here."""
    return compose_run(dict(context.run_config), node_root=str(context.node_config.get("data-root") or ""))


def state_dir_of(context: Context, settings: Settings, client_id: str, run_name: str) -> Path:
    node_dir = context.node_config.get("state-dir")
    if node_dir:
        return Path(str(node_dir)) / run_name / client_id
    run = settings.run
    root = Path(run.state_root) if run.state_root else Path(run.results_root) / run_name / "client_state"
    return root / client_id


# config keys of an instruction that are round numbers: (smallest value, required)
ROUND_KEYS = {"server-round": (1, True), "resume-round": (0, False), EVALUATE_ROUND: (1, False)}


def check_instruction(msg: Message) -> None:
    """Refuse a message that is not a pflower ServerApp's instruction before anything is
    loaded or saved: its config record, its round numbers (whole numbers, not below their
    least value) and its arrays record, each named with what was found."""
    kind = msg.metadata.message_type
    record = msg.content.config_records.get(CONFIG_KEY)
    if record is None:
        raise ValueError(f"the {kind} message has no {CONFIG_KEY!r} config record (records: "
                         f"{sorted(msg.content.keys())}); only a pflower ServerApp of this version can instruct "
                         "this ClientApp")
    for key, (least, required) in ROUND_KEYS.items():
        if key not in record:
            if required:
                raise ValueError(f"the {kind} message's config has no {key!r}; a pflower ServerApp always sends it")
            continue
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"the {kind} message's {key!r} must be a whole number >= {least}, got {value!r}")
    if ARRAYS_KEY not in msg.content.array_records:
        raise ValueError(f"the {kind} message has no {ARRAYS_KEY!r} array record (records: "
                         f"{sorted(msg.content.keys())}); the model it carries is missing")


def check_payload(payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A payload with NaN or Inf would train into NaN (and say "lower the lr"): refused by name."""
    bad = sorted(k for k, a in payload.items() if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)))
    if bad:
        raise ValueError(f"the server's arrays {bad[:3]} contain NaN or Inf; nothing was trained or saved")
    return payload


def _addressed(msg: Message, context: Context) -> tuple[ComposedRun, dict[str, Any], str, Path]:
    """What every message needs first: the instruction checked, the run's configuration on this
    node, the message's config, the client it is for (a simulated node may serve several,
    client/identity.py) and that client's state folder."""
    check_instruction(msg)
    composed = client_config(context)
    server_cfg = config_dict(msg.content.config_records.get(CONFIG_KEY))
    client_id = client_id_of(context, server_cfg)
    run_name = str(server_cfg.get("run-name", composed.settings.run.run_name))
    return composed, server_cfg, client_id, state_dir_of(context, composed.settings, client_id, run_name)


def _round(msg: Message, context: Context) -> tuple[Any, ClientRound, ClientStateStore]:
    with part("config"):
        composed, server_cfg, client_id, state_dir = _addressed(msg, context)
        cfg, settings = composed.cfg, composed.settings
        run = settings.run
    with part("data"):
        # only this client's split, from the on-disk cache after the first process built it
        split, info = load_client_data(cfg.dataset, run.seed, client_id, resolve_cache_dir(run.data_cache))
    with part("config"):
        set_deterministic(run.deterministic)
        rnd = ClientRound(
            settings=settings, client_id=client_id, data=split, num_classes=info.num_classes,
            input_shape=info.input_shape, device=resolve_device(run.device),
            server_round=int(server_cfg.get("server-round", 0)), message_config=server_cfg,
        )
        note(server_round=rnd.server_round, client_id=client_id)
        # context.state (the in-memory copy of the state) is the node's: a simulation runs two
        # messages for one node at once and keeps whichever context comes back last, which may
        # hold an older state of another client. A node serving several clients reads from disk.
        store = ClientStateStore(state_dir,
                                 None if serves_several(context.node_config, len(info.client_ids)) else context.state,
                                 checkpoint_every=run.checkpoint_every)
        trainer = trainer_for(composed)
    return trainer, rnd, store


def trainer_class(resolved: ResolvedMethod) -> type[ClientTrainer]:
    """The client trainer class of the resolved method (its variant's when its options set one)."""
    cls: type[ClientTrainer] = load_named(resolved.row.client)
    return cls


# A trainer holds its configuration, settings and checked options, nothing of a client: a
# process makes one trainer per composed run configuration, not one per message. Kept under the
# composition's key with the composition it was made from: a configuration composed again (after
# compose_run's cache let it go) may differ (an image tree's domains are read from disk), so it
# gets a trainer of its own.
_TRAINERS: dict[str, tuple[ComposedRun, ClientTrainer]] = {}


def trainer_for(composed: ComposedRun) -> ClientTrainer:
    """This process' trainer of the composed run configuration (made on first use)."""
    kept = _TRAINERS.get(composed.key)
    if kept is None or kept[0] is not composed:
        if len(_TRAINERS) >= 16:    # as many as compose_run keeps
            _TRAINERS.clear()
        cls = trainer_class(composed.settings.method)
        kept = _TRAINERS[composed.key] = (composed, cls(composed.cfg, composed.settings))
    return kept[1]


def _state_scope(rnd: ClientRound, context: Context) -> dict[str, Any]:
    """Which saved state versions this call may use (see client/state.py): the server's
    ``resume-round`` and this run attempt's id."""
    resumed = rnd.message_config.get("resume-round")
    return {"resumed_from": None if resumed is None else int(resumed),  # type: ignore[arg-type]
            "attempt": str(context.run_id)}


def _secure_stage(msg: Message, context: Context) -> Message:
    """A SecAgg+ step that is not training (client/secure_aggregation.py): no data is loaded."""
    return secagg.answer_stage(msg, context, _addressed(msg, context)[3])


def train(msg: Message, context: Context) -> Message:
    stage = secagg.stage_of(msg)
    if stage in secagg.KEY_STAGES:
        return _secure_stage(msg, context)
    trainer, rnd, store = _round(msg, context)
    secrets = None
    if stage == COLLECT:    # the shares sent to this client, before anything is trained or saved
        secrets = secagg.receive_shares(rnd.message_config, store.dir)
    elif stage is not None:
        raise ValueError(f"unknown secure aggregation stage {stage!r} in a train message; this ClientApp knows "
                         f"{(*secagg.KEY_STAGES, COLLECT)}")
    with part("decode"):
        payload = check_payload(from_record(msg.content.array_records.get(ARRAYS_KEY)))
    # under secure aggregation, what was sent of the masked tensors (their update is masked), kept
    # apart from what training may change
    sent = {k: np.array(payload[k], copy=True) for k in secagg.masked_keys_of(rnd.message_config)
            if k in payload} if secrets is not None else payload
    scope = _state_scope(rnd, context)
    with part("state load"):
        state, meta = store.load(max_round=rnd.server_round - 1, **scope)
    evaluation = None
    if rnd.message_config.get(EVALUATE_ROUND) is not None:
        # the previous round's evaluation, riding on this message: the payload and the state
        # are exactly what that round's evaluate message would have met (nothing changes in
        # between), so the numbers are the same and a message (a process, in a deployment)
        # is saved
        with part("evaluate"):
            evaluation = _evaluate_round(trainer, rnd, int(rnd.message_config[EVALUATE_ROUND]), payload, state)
    result = trainer.fit(rnd, payload, state)   # its parts: model build, train, upload
    if "dpsgd_steps" in result.metrics:     # record-level DP: this training composed into the client's ledger
        result.metrics["dpsgd_epsilon"] = _record_dp_epsilon(store.dir, rnd, scope["attempt"], result.metrics)
    with part("state save"):
        store.save(result.state, {**meta, "last_round": rnd.server_round, "client_id": rnd.client_id,
                                  # the rounds this state went through (survives SuperNode restarts)
                                  "trained_rounds": [*meta.get("trained_rounds", []), rnd.server_round]},
                   server_round=rnd.server_round, attempt=scope["attempt"])
    with part("encode"):
        upload, metrics = result.upload, result.metrics
        extra = {k: to_record(v) for k, v in result.extra.items()}
        if secrets is not None:     # the shared tensors leave only masked
            settings = rnd.settings
            upload, masked, clipped = secagg.mask_upload(secrets, rnd.message_config, sent, upload,
                                                         result.num_examples, settings.run.seed, rnd.client_id,
                                                         settings.privacy.noise_seed)
            extra[MASKED_RECORD] = to_record(masked)
            metrics = {**metrics, CLIPPED_METRIC: float(clipped)}
        reply = make_reply(msg, upload, metrics, rnd.client_id, result.num_examples, extra)
        if evaluation is not None:
            add_evaluation(reply, evaluation, rnd.client_id, len(rnd.data.test))
    return reply


def _record_dp_epsilon(folder: Path, rnd: ClientRound, attempt: str, metrics: dict[str, float]) -> float:
    """This client's epsilon of record-level DP-SGD over every training it has run for the run
    (its ledger in the state folder: a redone round counts again), at ``privacy.delta``."""
    privacy = rnd.settings.privacy
    history = record_training(folder, {"round": rnd.server_round, "attempt": attempt,
                                       "noise_multiplier": privacy.record_noise_multiplier,
                                       "sample_rate": metrics["dpsgd_sample_rate"],
                                       "steps": int(metrics["dpsgd_steps"])})
    return epsilon_of(history, privacy.delta)


def _evaluate_round(trainer: Any, rnd: ClientRound, server_round: int, payload: dict[str, np.ndarray],
                    state: dict[str, np.ndarray]) -> dict[str, float]:
    """The metrics of an evaluate message of ``server_round`` (not the final one)."""
    config = {**rnd.message_config, "server-round": server_round, "final": False}
    config.pop(EVALUATE_ROUND, None)
    return _evaluation(trainer, replace(rnd, server_round=server_round, message_config=config), dict(payload), dict(state))


def _evaluation(trainer: Any, rnd: ClientRound, payload: dict[str, np.ndarray],
                state: dict[str, np.ndarray]) -> dict[str, float]:
    """What an evaluate reply carries: the trainer's metrics and the validation split's size."""
    return {**trainer.evaluate(rnd, payload, state), NUM_VAL_EXAMPLES: float(len(rnd.data.val))}


def evaluate(msg: Message, context: Context) -> Message:
    trainer, rnd, store = _round(msg, context)
    with part("decode"):
        payload = check_payload(from_record(msg.content.array_records.get(ARRAYS_KEY)))
    with part("state load"):
        state, _ = store.load(max_round=rnd.server_round, **_state_scope(rnd, context))
    with part("evaluate"):
        metrics = _evaluation(trainer, rnd, payload, state)
    with part("encode"):
        return make_reply(msg, {}, metrics, rnd.client_id, len(rnd.data.test))


# what each message type runs (client/app.py dispatches on it)
HANDLERS = {"train": train, "evaluate": evaluate}
