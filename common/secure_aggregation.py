"""SecAgg+ (Bell et al., CCS 2020) for the averaged part of a method, as Flower implements its
steps, on pflower's messages: the client's and the server's side of each step, read by both.

Every piece of cryptography is Flower's (``flwr.common.secure_aggregation``): key pairs and
their (de)serialisation, ECDH + HKDF shared keys, Fernet encryption of the shares, Shamir
sharing (pycryptodome) and the seeded mask generator. What is here is the protocol's
bookkeeping and the arithmetic around it, in plain functions (bytes and numpy in and out).

One round, for the ``m`` clients sampled (secure ids ``1..m``, each with a neighbourhood of
``shares`` ids on a ring, itself included; all ``m`` by default):

1. **setup**: each client makes two key pairs and sends their public halves.
2. **share keys**: each client is sent its neighbours' public keys; it draws its self-mask seed
   ``b`` and Shamir-shares ``b`` and its first secret key ``sk1`` among its neighbours (any
   ``threshold`` of the shares rebuild them), each share encrypted for its receiver.
3. **collect**: with its training message each client receives the shares meant for it; it
   trains, and uploads its update masked:
   ``y = q(r * (w - g)) + PRG(b) + sum_{j>i} PRG(s_ij) - sum_{j<i} PRG(s_ij)  (mod M)``, where
   ``q`` quantises ``[-c, c]`` to ``[0, Q)`` with seeded stochastic rounding, ``r`` is the
   client's weight (``n / max_weight``, or 1), ``s_ij`` its pairwise key with neighbour ``j``,
   and the weight itself travels masked as an extra entry.
4. **unmask**: the server sums the ``y`` it received; each surviving client sends, for every
   neighbour, a share of ``b`` (if that neighbour's ``y`` is in the sum) or of ``sk1`` (if it
   dropped after step 2). With ``threshold`` shares of each, the server removes every mask and
   is left with ``sum r_i (w_i - g)`` and ``sum r_i``: the weighted mean update, and nothing of
   any one client's.

Precision: each client's value is rounded to a step of ``2c/Q``, so the mean of the updates
is within ``m * (2c/Q) / sum_i r_i`` of the plain weighted mean per element (``2c/Q`` when
unweighted), plus what clipping to ``[-c, c]`` removes (counted by the client, docs/privacy.md).
The rounding is drawn from (run seed, round, client), so a resumed round is bit for bit.
"""

from __future__ import annotations

import base64
import json
import math
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen,
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from common.flower_compat import secagg_key_functions

_KEYS = secagg_key_functions()
generate_key_pairs, private_key_to_bytes, public_key_to_bytes = (
    _KEYS.generate_key_pairs, _KEYS.private_key_to_bytes, _KEYS.public_key_to_bytes)
bytes_to_private_key, bytes_to_public_key = _KEYS.bytes_to_private_key, _KEYS.bytes_to_public_key

# config keys of the stage messages (the server's CONFIG record) and of the clients' answers
STAGE = "secagg.stage"
SETUP, SHARE_KEYS, COLLECT, UNMASK = "setup", "share-keys", "collect", "unmask"
STAGES = (SETUP, SHARE_KEYS, COLLECT, UNMASK)
SECURE_ID = "secagg.sid"
PARAMS = "secagg.params"          # the protocol's numbers, as JSON (setup)
IDS, PK1, PK2 = "secagg.ids", "secagg.pk1", "secagg.pk2"          # neighbours' public keys (share keys)
SOURCES, CIPHERTEXTS = "secagg.sources", "secagg.ciphertexts"     # shares for this client (collect)
DESTINATIONS = "secagg.destinations"                             # where each ciphertext goes (share keys reply)
MASKED_KEYS = "secagg.keys"                                      # the tensors masked (collect)
ACTIVE, DEAD = "secagg.active", "secagg.dead"                    # unmask
SHARE_IDS, SHARES = "secagg.share-ids", "secagg.shares"          # unmask reply
REPLY_KEY = "secagg"              # the config record of a stage's reply
MASKED_RECORD = "secagg.masked"   # the array record of a collect reply: the masked vector
WEIGHT_ENTRY = "secagg.weight"    # its entry holding the masked weight
CLIPPED_METRIC = "secagg_clipped" # values the client's quantisation clipped to [-c, c]
STATE_FILE = "secagg-round.json"  # the client's secrets of the round in flight (its state folder)


@dataclass(frozen=True)
class SecAggParams:
    """The protocol's numbers for one round.

    Parameters
    ----------
    shares : the neighbourhood size (itself included): every client gets a share of each
        neighbour's secrets.
    threshold : shares that rebuild a secret (fewer reveal nothing of it).
    clip_range : ``c``: each value of a (weighted) update is clipped to ``[-c, c]``.
    quant_range : ``Q``: the integers ``[0, Q)`` the range is quantised to.
    mod_range : ``M``: masks and sums are modulo ``M`` (``M >= m * Q`` and ``M >= Q * (sum r_i)``).
    max_weight : a client's weight is ``n / max_weight`` (0: every weight 1).
    clip_norm : with differential privacy, each client clips its update to this L2 norm first (0: off).
    noise_std : with ``privacy.dp=distributed``, each client then adds Gaussian noise of this
        std per value, ``z C / sqrt(m)`` for ``m`` clients sampled: the sum of ``m`` carries
        ``N(0, (z C)^2)``, as the server's noise would (0: off).
    """

    shares: int
    threshold: int
    clip_range: float
    quant_range: int
    mod_range: int
    max_weight: float = 0.0
    clip_norm: float = 0.0
    noise_std: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SecAggParams:
        return cls(**json.loads(text))


def neighbourhoods(num_clients: int, shares: int, rng: np.random.Generator) -> dict[int, list[int]]:
    """Secure id -> its neighbours' ids (itself included), SecAgg+'s ring: the ids shuffled,
    each with the ``shares // 2`` before and after it (all ids when ``shares >= num_clients``)."""
    ids = [int(i) for i in rng.permutation(np.arange(1, num_clients + 1))]
    if shares >= num_clients:
        return {i: sorted(ids) for i in ids}
    half = shares // 2
    return {sid: sorted({ids[(pos + off) % num_clients] for off in range(-half, half + 1)})
            for pos, sid in enumerate(ids)}


def threshold_of(value: float, shares: int) -> int:
    """``privacy.secagg_threshold`` as a share count: a fraction of ``shares`` (at least 2), or a count."""
    if value < 1:
        return max(2, math.ceil(value * shares))
    return int(value)


# ------------------------------------------------------------------ client side
@dataclass
class ClientSecrets:
    """A client's side of one round (kept in its state folder between the round's messages)."""

    server_round: int
    sid: int
    params: SecAggParams
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    seed: bytes = b""                                            # b, the self-mask seed
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    seed_shares: dict[int, bytes] = field(default_factory=dict)  # shares of the neighbours' b held here
    sk1_shares: dict[int, bytes] = field(default_factory=dict)   # shares of the neighbours' sk1 held here

    def save(self, folder: Path) -> None:
        def b64(b: bytes) -> str:
            return base64.b64encode(b).decode()

        data = {"server_round": self.server_round, "sid": self.sid, "params": asdict(self.params),
                **{k: b64(getattr(self, k)) for k in ("sk1", "pk1", "sk2", "pk2", "seed")},
                "public_keys": {str(i): [b64(a), b64(b)] for i, (a, b) in self.public_keys.items()},
                "seed_shares": {str(i): b64(s) for i, s in self.seed_shares.items()},
                "sk1_shares": {str(i): b64(s) for i, s in self.sk1_shares.items()}}
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (STATE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)   # secrets: owner only
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, folder / STATE_FILE)

    @classmethod
    def load(cls, folder: Path, server_round: int) -> ClientSecrets:
        path = folder / STATE_FILE
        if not path.is_file():
            raise ValueError(f"secure aggregation: no secrets of round {server_round} in {folder} (this client "
                             "missed the round's setup, or its state folder changed); it sits this round out")
        data = json.loads(path.read_text())
        if data["server_round"] != server_round:
            raise ValueError(f"secure aggregation: the secrets in {path} are of round {data['server_round']}, "
                             f"not {server_round}; this client missed the round's setup and sits it out")

        def raw(s: str) -> bytes:
            return base64.b64decode(s)

        return cls(server_round=data["server_round"], sid=data["sid"], params=SecAggParams(**data["params"]),
                   **{k: raw(data[k]) for k in ("sk1", "pk1", "sk2", "pk2", "seed")},
                   public_keys={int(i): (raw(a), raw(b)) for i, (a, b) in data["public_keys"].items()},
                   seed_shares={int(i): raw(s) for i, s in data["seed_shares"].items()},
                   sk1_shares={int(i): raw(s) for i, s in data["sk1_shares"].items()})

    @staticmethod
    def forget(folder: Path) -> None:
        (folder / STATE_FILE).unlink(missing_ok=True)


def client_setup(server_round: int, sid: int, params: SecAggParams) -> ClientSecrets:
    """Step 1: two fresh key pairs (``1``: key agreement for the masks' pairwise keys, ``2``:
    for encrypting the shares)."""
    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    return ClientSecrets(server_round, sid, params, private_key_to_bytes(sk1), public_key_to_bytes(pk1),
                         private_key_to_bytes(sk2), public_key_to_bytes(pk2))


def client_share_keys(secrets: ClientSecrets, public_keys: Mapping[int, tuple[bytes, bytes]]
                      ) -> tuple[list[int], list[bytes]]:
    """Step 2: check the neighbours' keys, draw ``b``, share ``b`` and ``sk1`` among the
    neighbours; returns (destination ids, ciphertexts) for the server to forward."""
    p = secrets.params
    if len(public_keys) < p.threshold:
        raise ValueError(f"secure aggregation: {len(public_keys)} neighbours, fewer than the threshold {p.threshold}")
    if public_keys.get(secrets.sid) != (secrets.pk1, secrets.pk2):
        raise ValueError("secure aggregation: the server sent this client's own public keys wrong")
    flat = [k for pair in public_keys.values() for k in pair]
    if len(set(flat)) != len(flat):
        raise ValueError("secure aggregation: two neighbours sent the same public key")
    secrets.public_keys = dict(public_keys)
    secrets.seed = os.urandom(32)
    seed_shares = create_shares(secrets.seed, p.threshold, len(public_keys))
    sk1_shares = create_shares(secrets.sk1, p.threshold, len(public_keys))
    destinations, ciphertexts = [], []
    for idx, (nid, (_, pk2)) in enumerate(sorted(public_keys.items())):
        if nid == secrets.sid:
            secrets.seed_shares[nid], secrets.sk1_shares[nid] = seed_shares[idx], sk1_shares[idx]
            continue
        key = generate_shared_key(bytes_to_private_key(secrets.sk2), bytes_to_public_key(pk2))
        plaintext = share_keys_plaintext_concat(secrets.sid, nid, seed_shares[idx], sk1_shares[idx])
        destinations.append(nid)
        ciphertexts.append(encrypt(key, plaintext))
    return destinations, ciphertexts


def client_receive_shares(secrets: ClientSecrets, sources: Sequence[int], ciphertexts: Sequence[bytes]) -> None:
    """Step 3's first half: decrypt the shares the neighbours sent this client."""
    if len(sources) + 1 < secrets.params.threshold:
        raise ValueError(f"secure aggregation: shares from {len(sources)} neighbours, fewer than the threshold")
    for src, ciphertext in zip(sources, ciphertexts, strict=True):
        pk2 = secrets.public_keys[int(src)][1]
        key = generate_shared_key(bytes_to_private_key(secrets.sk2), bytes_to_public_key(pk2))
        actual, dst, seed_share, sk1_share = share_keys_plaintext_separate(decrypt(key, ciphertext))
        if actual != src or dst != secrets.sid:
            raise ValueError(f"secure aggregation: a share claiming {src} -> {secrets.sid} is {actual} -> {dst}")
        secrets.seed_shares[int(src)], secrets.sk1_shares[int(src)] = seed_share, sk1_share


def rounding_rng(seed: int, server_round: int, client_id: str) -> np.random.Generator:
    """The stochastic rounding's draws of one client's upload in one round (a resume redraws them alike)."""
    return np.random.default_rng([int(seed), int(server_round), zlib.crc32(client_id.encode())])


def quantize(values: np.ndarray, clip_range: float, quant_range: int, rng: np.random.Generator) -> np.ndarray:
    """``[-c, c]`` -> integers in ``[0, Q]``, rounded up or down at random in proportion to the
    distance (unbiased). The caller clips first."""
    scaled = (values.astype(np.float64) + clip_range) * (quant_range / (2 * clip_range))
    low = np.floor(scaled)
    return (low + (rng.random(scaled.shape) < scaled - low)).astype(np.int64)


def client_masked_update(secrets: ClientSecrets, delta: Mapping[str, np.ndarray], num_examples: int,
                         rng: np.random.Generator, noise_rng: np.random.Generator | None = None
                         ) -> tuple[dict[str, np.ndarray], int]:
    """Step 3's second half: the weighted update quantised and masked (one int64 array per
    tensor, plus :data:`WEIGHT_ENTRY`), and how many values were clipped to ``[-c, c]``.
    With ``clip_norm`` the update is first clipped to that L2 norm, and with ``noise_std`` this
    client's share of the noise is added, drawn from ``noise_rng`` (differential privacy)."""
    p = secrets.params
    keys = sorted(delta)
    arrays = [np.asarray(delta[k], dtype=np.float64) for k in keys]
    if p.clip_norm > 0:
        norm = math.sqrt(sum(float(np.sum(a * a)) for a in arrays))
        arrays = [a * min(1.0, p.clip_norm / norm) if norm > 0 else a for a in arrays]
    if p.noise_std > 0:
        if noise_rng is None:
            raise ValueError("secure aggregation with distributed DP: no noise generator given")
        arrays = [a + noise_rng.normal(0.0, p.noise_std, a.shape) for a in arrays]
    ratio = num_examples / p.max_weight if p.max_weight > 0 else 1.0
    q_ratio = round(ratio * p.quant_range)
    weight = q_ratio / p.quant_range
    clipped = 0
    masked: list[np.ndarray] = []
    for a in arrays:
        v = a * weight
        clipped += int(np.count_nonzero(np.abs(v) > p.clip_range))
        masked.append(quantize(np.clip(v, -p.clip_range, p.clip_range), p.clip_range, p.quant_range, rng))
    masked.append(np.array([q_ratio], dtype=np.int64))
    shapes = [m.shape for m in masked]
    masked = [m + s for m, s in zip(masked, pseudo_rand_gen(secrets.seed, p.mod_range, shapes), strict=True)]
    for nid in secrets.seed_shares:          # the neighbours whose shares arrived (they completed step 2)
        if nid == secrets.sid:
            continue
        key = generate_shared_key(bytes_to_private_key(secrets.sk1), bytes_to_public_key(secrets.public_keys[nid][0]))
        sign = 1 if secrets.sid > nid else -1
        masked = [m + sign * s for m, s in zip(masked, pseudo_rand_gen(key, p.mod_range, shapes), strict=True)]
    masked = [np.mod(m, p.mod_range) for m in masked]
    return {**dict(zip(keys, masked[:-1], strict=True)), WEIGHT_ENTRY: masked[-1]}, clipped


def client_unmask(secrets: ClientSecrets, active: Iterable[int], dead: Iterable[int]) -> tuple[list[int], list[bytes]]:
    """Step 4: shares of ``b`` for the neighbours whose update is in the sum, of ``sk1`` for those
    that dropped; never both for one neighbour (that would unmask its update)."""
    active, dead = [int(i) for i in active], [int(i) for i in dead]
    if set(active) & set(dead):
        raise ValueError("secure aggregation: the server asked for both shares of one neighbour; refused")
    if len(active) < secrets.params.threshold:
        raise ValueError(f"secure aggregation: {len(active)} active neighbours, fewer than the threshold")
    ids = [i for i in active if i in secrets.seed_shares] + [i for i in dead if i in secrets.sk1_shares]
    shares = [secrets.seed_shares[i] for i in active if i in secrets.seed_shares]
    shares += [secrets.sk1_shares[i] for i in dead if i in secrets.sk1_shares]
    return ids, shares


# ------------------------------------------------------------------ server side
def sum_masked(vectors: Iterable[Mapping[str, np.ndarray]], mod_range: int) -> dict[str, np.ndarray]:
    """The sum of masked uploads, modulo ``M``."""
    total: dict[str, np.ndarray] = {}
    for vector in vectors:
        for k, v in vector.items():
            total[k] = np.mod(total[k] + v, mod_range) if k in total else np.array(v, dtype=np.int64, copy=True)
    return total


def unmask_mean(total: Mapping[str, np.ndarray], num_active: int, params: SecAggParams,
                active_seeds: Mapping[int, bytes], dead_sk1: Mapping[int, bytes],
                public_keys: Mapping[int, tuple[bytes, bytes]], neighbours: Mapping[int, Sequence[int]],
                active_ids: Iterable[int]) -> tuple[dict[str, np.ndarray], float]:
    """Remove every mask from ``total`` (the sum of the ``num_active`` active clients' uploads):
    the self masks rebuilt from ``active_seeds`` (id -> ``b``), and the pairwise masks between
    each dropped client (id -> its rebuilt ``sk1``) and its active neighbours. Returns the
    weighted mean update per tensor (float64) and the total weight ``sum r_i``."""
    p = params
    keys = [k for k in total if k != WEIGHT_ENTRY]
    order = sorted(keys) + [WEIGHT_ENTRY]
    vec = [np.array(total[k], dtype=np.int64, copy=True) for k in order]
    shapes = [v.shape for v in vec]
    for seed in active_seeds.values():
        vec = [v - s for v, s in zip(vec, pseudo_rand_gen(seed, p.mod_range, shapes), strict=True)]
    active = set(int(i) for i in active_ids)
    for did, sk1 in dead_sk1.items():
        for nid in neighbours[did]:
            if nid == did or nid not in active:   # a dead neighbour's masks are not in the sum
                continue
            key = generate_shared_key(bytes_to_private_key(sk1), bytes_to_public_key(public_keys[nid][0]))
            sign = 1 if did > nid else -1      # undo what the active neighbour added
            vec = [v + sign * s for v, s in zip(vec, pseudo_rand_gen(key, p.mod_range, shapes), strict=True)]
    vec = [np.mod(v, p.mod_range) for v in vec]
    q_total = int(vec[-1][0])
    if q_total <= 0:
        raise ValueError("secure aggregation: the unmasked total weight is 0 (the masks did not cancel)")
    step = 2 * p.clip_range / p.quant_range
    weight_total = q_total / p.quant_range
    mean = {k: (v.astype(np.float64) * step - num_active * p.clip_range) / weight_total
            for k, v in zip(order[:-1], vec[:-1], strict=True)}
    return mean, weight_total


def rebuild(shares: Sequence[bytes]) -> bytes:
    """A secret from at least ``threshold`` of its Shamir shares (Flower's ``combine_shares``)."""
    return combine_shares(list(shares))


def mean_bound(params: SecAggParams, num_active: int, weight_total: float) -> float:
    """The largest difference per element between the unmasked mean and the plain weighted mean
    of the (clipped) updates: one rounding step per client, over the total weight."""
    return num_active * (2 * params.clip_range / params.quant_range) / weight_total


def encode_keys(public_keys: Mapping[int, tuple[bytes, bytes]]) -> dict[str, Any]:
    """Neighbours' public keys as config values (share keys message)."""
    ids = sorted(public_keys)
    return {IDS: ids, PK1: [public_keys[i][0] for i in ids], PK2: [public_keys[i][1] for i in ids]}


def decode_keys(config: Mapping[str, Any]) -> dict[int, tuple[bytes, bytes]]:
    return {int(i): (bytes(a), bytes(b)) for i, a, b in zip(config[IDS], config[PK1], config[PK2], strict=True)}
