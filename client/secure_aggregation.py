"""The client's side of SecAgg+ (``privacy.secure_aggregation=secagg+``): the three messages of
the protocol that are not training (setup, share keys, unmask), answered without loading any
data, and the masking of the training reply's shared tensors. The steps are in
``common/secure_aggregation.py``; this client's secrets of the round in flight live in its
state folder (owner-readable only) and are deleted when it has sent its unmask shares.
"""

from __future__ import annotations

import secrets as secrets_module
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message

from client.identity import client_id_of
from common.protocol import CONFIG_KEY, config_dict, make_reply
from common.secure_aggregation import (
    ACTIVE,
    CIPHERTEXTS,
    DEAD,
    DESTINATIONS,
    MASKED_KEYS,
    PARAMS,
    PK1,
    PK2,
    REPLY_KEY,
    SECURE_ID,
    SETUP,
    SHARE_IDS,
    SHARE_KEYS,
    SHARES,
    SOURCES,
    STAGE,
    UNMASK,
    ClientSecrets,
    SecAggParams,
    client_masked_update,
    client_receive_shares,
    client_setup,
    client_share_keys,
    client_unmask,
    decode_keys,
    rounding_rng,
)

# the stages answered here (the collect stage is the training message, client/handlers.py)
KEY_STAGES = (SETUP, SHARE_KEYS, UNMASK)


def stage_of(msg: Message) -> str | None:
    """The protocol step a train message is (None: an ordinary training message)."""
    record = msg.content.config_records.get(CONFIG_KEY)
    value = record.get(STAGE) if record is not None else None
    return str(value) if value is not None else None


def _round_of(config: Mapping[str, Any]) -> tuple[int, int]:
    server_round, sid = config.get("server-round"), config.get(SECURE_ID)
    for name, value in (("server-round", server_round), (SECURE_ID, sid)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"a secure aggregation message's {name!r} must be a whole number >= 1, got {value!r}")
    return int(server_round), int(sid)  # type: ignore[arg-type]


def answer_stage(msg: Message, context: Context, state_folder: Path) -> Message:
    """Answer a setup, share-keys or unmask message (what each sends back is in
    ``common/secure_aggregation.py``)."""
    config = config_dict(msg.content.config_records.get(CONFIG_KEY))
    stage = str(config[STAGE])
    server_round, sid = _round_of(config)
    if stage == SETUP:
        secrets = client_setup(server_round, sid, SecAggParams.from_json(str(config[PARAMS])))
        secrets.save(state_folder)
        answer: dict[str, Any] = {PK1: secrets.pk1, PK2: secrets.pk2}
    elif stage == SHARE_KEYS:
        secrets = ClientSecrets.load(state_folder, server_round)
        destinations, ciphertexts = client_share_keys(secrets, decode_keys(config))
        secrets.save(state_folder)
        answer = {DESTINATIONS: destinations, CIPHERTEXTS: ciphertexts}
    elif stage == UNMASK:
        secrets = ClientSecrets.load(state_folder, server_round)
        ids, shares = client_unmask(secrets, list(config.get(ACTIVE, [])), list(config.get(DEAD, [])))  # type: ignore[call-overload]
        ClientSecrets.forget(state_folder)      # one unmask per round: never a second answer
        answer = {SHARE_IDS: ids, SHARES: shares}
    else:
        raise ValueError(f"unknown secure aggregation stage {stage!r}; expected one of {KEY_STAGES}")
    reply = make_reply(msg, {}, {}, client_id_of(context, config), 0)
    reply.content[REPLY_KEY] = ConfigRecord(answer)
    return reply


def receive_shares(config: Mapping[str, Any], state_folder: Path) -> ClientSecrets:
    """The collect message's first half, before any training: the shares sent to this client."""
    server_round, _ = _round_of(config)
    secrets = ClientSecrets.load(state_folder, server_round)
    client_receive_shares(secrets, [int(s) for s in config.get(SOURCES, [])],  # type: ignore[union-attr]
                          [bytes(c) for c in config.get(CIPHERTEXTS, [])])  # type: ignore[union-attr]
    secrets.save(state_folder)
    return secrets


def masked_keys_of(config: Mapping[str, Any]) -> list[str]:
    """The tensors the server asks this round's upload to mask (the collect message's list)."""
    return [str(k) for k in config.get(MASKED_KEYS, [])]  # type: ignore[union-attr]


def mask_upload(secrets: ClientSecrets, config: Mapping[str, Any], payload: Mapping[str, np.ndarray],
                upload: Mapping[str, np.ndarray], num_examples: int, seed: int, client_id: str,
                noise_seed: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """The upload split: what stays in the clear (never a masked tensor), the masked vector of
    the update of the tensors the server named, and how many values its quantisation clipped.
    With distributed DP the noise is drawn from the OS's randomness (secret), or from
    ``noise_seed`` (``privacy.noise_seed``: reproducible, protects nothing against whoever knows it)."""
    keys = masked_keys_of(config)
    missing = [k for k in keys if k not in upload or k not in payload]
    if missing:
        raise ValueError(f"secure aggregation: the tensors {missing[:3]} to mask are not in this client's upload "
                         "and payload; the server and this client disagree on the method's shared part")
    delta = {k: np.asarray(upload[k], dtype=np.float64) - np.asarray(payload[k], dtype=np.float64) for k in keys}
    rng = rounding_rng(seed, secrets.server_round, client_id)
    noise_rng = np.random.default_rng(secrets_module.randbits(128) if noise_seed is None else
                                      [noise_seed, secrets.server_round, zlib.crc32(client_id.encode())])
    masked, clipped = client_masked_update(secrets, delta, num_examples, rng, noise_rng)
    clear = {k: v for k, v in upload.items() if k not in set(keys)}
    return clear, masked, clipped
