"""The message protocol between pflower's ServerApp and ClientApp (written once).

A message from the server carries:
- ``arrays``: an ArrayRecord of named arrays this client should load (the global model or
  the part of it the method shares, plus the client's personalised arrays if the server
  holds any for it);
- ``config``: a ConfigRecord with ``server-round``, ``run-name`` and method settings.

A reply carries ``arrays`` (what the client uploads; may be empty) and ``metrics``, a
MetricRecord that always holds ``num-examples`` and ``client-id`` (the stable client id,
as an int partition id or as a hash-free string in ``client-name``), plus method metrics.
Other records (e.g. FEDORA's ``basis``) are method-specific extras.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
NUM_EXAMPLES = "num-examples"
# evaluate replies also carry the validation split's size (sample-weighted best-round choice)
NUM_VAL_EXAMPLES = "num-val-examples"
# evaluation carried by a training message: the train config names the (previous) round to
# evaluate first; the reply holds that evaluation's metrics under EVAL_METRICS_KEY
EVALUATE_ROUND = "evaluate-round"
EVAL_METRICS_KEY = "eval-metrics"
CLIENT_INDEX = "client-index"     # int: participating client index, or -1 for named clients
NEW_CLIENT_INDEX = "new-client-index"



# A record of many arrays travels as two: the bytes of all of them and an index. In a
# deployment every Array is two objects the SuperLink stores and hands over one request at a
# time (a database transaction each), so a message's cost grows with its number of tensors.
# Packed, a message is a handful of objects whatever the model.
PACKED_ARRAY = "__pflower_packed__"
PACKED_INDEX = "__pflower_index__"
_ALIGN = 16   # every array starts on a 16-byte boundary in the packed bytes


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, list[list]]:
    """All arrays' bytes in one uint8 buffer and ``[name, dtype, shape, offset]`` per array."""
    index, offset = [], 0
    parts = [np.asarray(v, order="C") for v in arrays.values()]   # keeps 0-d shapes
    for name, a in zip(arrays, parts, strict=True):
        index.append([name, a.dtype.str, list(a.shape), offset])
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    blob = np.zeros(offset, np.uint8)
    for (_, _, _, start), a in zip(index, parts, strict=True):
        blob[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
    return blob, index


def unpack_arrays(blob: np.ndarray, index: list[list]) -> dict[str, np.ndarray]:
    """The inverse of :func:`pack_arrays` (views into ``blob``, which must be writeable)."""
    out = {}
    for name, dtype, shape, start in index:
        dt = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out[name] = blob[start:start + size].view(dt).reshape(tuple(shape))
    return out


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Numpy dict -> ArrayRecord (order preserved; more than one array: packed)."""
    if len(arrays) <= 1:
        return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    blob, index = pack_arrays(arrays)
    text = np.frombuffer(json.dumps(index).encode(), np.uint8)
    return ArrayRecord({PACKED_ARRAY: Array(blob), PACKED_INDEX: Array(text)})


def from_record(record: ArrayRecord | None) -> dict[str, np.ndarray]:
    """ArrayRecord -> numpy dict (no pickle involved: Flower arrays are raw buffers)."""
    if record is None:
        return {}
    if PACKED_ARRAY in record:
        index = json.loads(record[PACKED_INDEX].numpy().tobytes().decode())
        return unpack_arrays(record[PACKED_ARRAY].numpy(), index)
    return {k: v.numpy() for k, v in record.items()}


def client_sort_key(client_id: str) -> tuple[int, int, str]:
    """The one order of client ids, everywhere: participating clients as numbers ("2" <
    "10"), held-out clients "new-k" after them, other labels (e.g. "node-<id>") last."""
    if client_id.isdigit():
        return (0, int(client_id), "")
    if client_id.startswith("new-") and client_id[4:].isdigit():
        return (1, int(client_id[4:]), "")
    return (2, 0, client_id)


def encode_client_id(client_id: str) -> dict[str, int]:
    """Metrics can only hold numbers: participating clients "7" -> 7, new clients "new-2" ->
    new-client-index 2. Other names are carried in the config record of the reply."""
    if client_id.isdigit():
        return {CLIENT_INDEX: int(client_id)}
    if client_id.startswith("new-") and client_id[4:].isdigit():
        return {CLIENT_INDEX: -1, NEW_CLIENT_INDEX: int(client_id[4:])}
    raise ValueError(
        f"client id {client_id!r} must be a partition index like '3' or a held-out client like "
        "'new-0'"
    )


# every message names the client it is for: in a simulation with fewer SuperNodes than
# clients one node serves several (strategies/base.py: place_clients), and a node refuses a
# message for a client it does not serve (client/identity.py)
TARGET_CLIENT = "pflower-client"

# identification (QUERY) replies carry the size of a simulated federation, so the server can
# name the clients that have no SuperNode before any training
NUM_PARTITIONS = "num-partitions"


def decode_client_id(metrics: Mapping[str, object]) -> str:
    if CLIENT_INDEX not in metrics:
        raise KeyError(f"reply metrics carry no {CLIENT_INDEX!r}; is the client a pflower ClientApp?")
    idx = int(metrics[CLIENT_INDEX])  # type: ignore[arg-type]
    if idx >= 0:
        return str(idx)
    return f"new-{int(metrics[NEW_CLIENT_INDEX])}"  # type: ignore[arg-type]


def make_reply(msg: Message, arrays: Mapping[str, np.ndarray], metrics: Mapping[str, float],
               client_id: str, num_examples: int,
               extra: Mapping[str, ArrayRecord] | None = None) -> Message:
    """Build a reply with uploaded arrays, metrics and the stable client id."""
    content = RecordDict({ARRAYS_KEY: to_record(arrays), METRICS_KEY: _metric_record(metrics, client_id, num_examples)})
    for key, rec in (extra or {}).items():
        content[key] = rec
    return Message(content=content, reply_to=msg)


def add_evaluation(reply: Message, metrics: Mapping[str, float], client_id: str, num_examples: int) -> Message:
    """Attach an evaluation (metrics as an evaluate reply carries them) to a train reply."""
    reply.content[EVAL_METRICS_KEY] = _metric_record(metrics, client_id, num_examples)
    return reply


def _metric_record(metrics: Mapping[str, float], client_id: str, num_examples: int) -> MetricRecord:
    m = {k: float(v) for k, v in metrics.items()}
    m[NUM_EXAMPLES] = int(num_examples)
    m.update(encode_client_id(client_id))
    return MetricRecord(m)


def config_dict(record: ConfigRecord | None) -> dict[str, object]:
    return dict(record.items()) if record is not None else {}
