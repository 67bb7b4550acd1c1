"""FedBABU math (Oh, Kim and Yun, "FedBABU: Towards Enhanced Representation for Federated
Image Classification", ICLR 2022). Pure numpy/torch, no Flower import.

The model's parameters are split into the body theta_ext (every state-dict key that is not
the final classifier, BN parameters and buffers included) and the head theta_cls (the
final ``nn.Linear``). FedBABU fixes theta_cls at its random initialisation theta_G^0 for the
whole federated training and aggregates only the body:

    theta_ext^{k} = sum_{i in C^k} w_i theta_ext,i^k / sum_{i in C^k} w_i,
    w_i = n_i (sample-weighted, the paper's rule) or w_i = 1 (the authors' code).

The method's part that server and client both read is here too: ``FedBABUOptions`` (the
options of ``conf/strategy/fedbabu.yaml``) and the wire names ``HEAD_DIGEST_KEY`` and
``HEAD_STORED_METRIC``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from common.options import MethodOptions, check_choice, check_finite
from learning.params import NDArrays, weighted_mean


@dataclasses.dataclass(frozen=True)
class FedBABUOptions(MethodOptions):
    """FedBABU: how the fixed head is initialised (and the orthogonal init's gain)."""

    head_init: str
    head_gain: float

    def __post_init__(self) -> None:
        check_choice("head_init", self.head_init, ("orthogonal", "default"))
        check_finite("head_gain", self.head_gain, 0.0, strict=True)


# wire names, read by both sides: the server's head digest in the train config; the
# client's "head stored" metric
HEAD_DIGEST_KEY = "head-sha256"
HEAD_STORED_METRIC = "head_stored"


HEAD_INITS = ("orthogonal", "default")


def init_head(head: Mapping[str, np.ndarray], seed: int, mode: str = "orthogonal",
              gain: float = 1.0) -> NDArrays:
    """The head theta_cls^0, a deterministic function of (seed, shapes, mode).

    ``orthogonal`` (the paper, Sec. 5.1 / App. B): the weight matrix W (C x d) gets
    ``torch.nn.init.orthogonal_`` (rows orthonormal when C <= d, times ``gain``) drawn from a
    generator seeded with ``seed``; the bias is zero. ``default``: keep ``head`` as given
    (the seeded PyTorch default init of ``nn.Linear``, which the authors' federated code
    used). Keys are those of ``head`` (the ``*.weight`` 2-d key and an optional 1-d bias).
    """
    if mode not in HEAD_INITS:
        raise ValueError(f"strategy.head_init must be one of {', '.join(HEAD_INITS)}, got {mode!r}")
    out = {k: np.array(v, copy=True) for k, v in head.items()}
    if mode == "default":
        return out
    weights = [k for k, v in out.items() if np.ndim(v) == 2]
    if len(weights) != 1:
        raise ValueError(f"the head must have exactly one 2-d weight matrix, got keys {sorted(out)}")
    gen = torch.Generator().manual_seed(int(seed))
    w = torch.empty(out[weights[0]].shape, dtype=torch.float32)
    torch.nn.init.orthogonal_(w, gain=float(gain), generator=gen)
    out[weights[0]] = w.numpy().astype(out[weights[0]].dtype)
    for k, v in out.items():
        if np.ndim(v) == 1:
            out[k] = np.zeros_like(v)
    return out


def split_head(arrays: Mapping[str, np.ndarray], head_keys: Iterable[str]) -> tuple[NDArrays, NDArrays]:
    """(body, head) parts of a set of arrays."""
    head_set = set(head_keys)
    body = {k: v for k, v in arrays.items() if k not in head_set}
    head = {k: v for k, v in arrays.items() if k in head_set}
    return body, head


def average_body(uploads: list[Mapping[str, np.ndarray]], weights: list[float],
                 head_keys: Iterable[str]) -> NDArrays:
    """Weighted mean of the body tensors of the clients' uploads; head keys are ignored
    (the head is never aggregated). Every upload must carry the same body keys."""
    if not uploads:
        raise ValueError("average_body needs at least one upload")
    bodies = [split_head(u, head_keys)[0] for u in uploads]
    keys = set(bodies[0])
    for i, b in enumerate(bodies[1:], 1):
        if set(b) != keys:
            raise ValueError(f"upload {i} carries body keys {sorted(set(b) ^ keys)[:3]} that "
                             "upload 0 does not (or the reverse); all clients must upload the same body")
    return weighted_mean(bodies, list(weights))


def head_digest(head: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the head's names, dtypes, shapes and bytes (checks a client's stored
    head against the server's without sending it)."""
    h = hashlib.sha256()
    for k in sorted(head):
        a = np.ascontiguousarray(head[k])
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()
