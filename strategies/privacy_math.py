"""Client-level differential privacy of a mean (DP-FedAvg): the pure math, no Flower.

McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018
(DP-FedAvg), with the server adding the noise (central DP, a trusted server):

    Delta_k  = a_k - s_k                       client k's shared update (s_k: what it was sent)
    Delta_k' = Delta_k * min(1, C / ||Delta_k||_2)         clipped (all its shared float tensors together)
    s'       = s + (1/m) sum_k Delta_k' + N(0, (z C / m)^2 I)

The sum of the clipped updates changes by at most C in L2 when one client is added or removed,
so noise of std ``z C`` on the sum (``z C / m`` on the mean of ``m`` replies) is a Gaussian
mechanism of noise multiplier ``z``; sampling and composition over rounds are accounted by
Flower's ``RdpAccountant`` (``strategies/privacy.py``). Integer tensors (BatchNorm's batch
counters) are not released: the server keeps what it sent. A BatchNorm running variance made
negative by the noise is set to 0 (post-processing, which costs no privacy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from learning.params import NDArrays, is_float

# state-dict key suffixes of quantities that must stay >= 0 after noise (post-processing)
NON_NEGATIVE_SUFFIXES = ("running_var",)


def update_norm(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                keys: Iterable[str]) -> float:
    """||a - s||_2 over ``keys`` together (float64)."""
    total = 0.0
    for k in keys:
        d = np.asarray(arrays[k], dtype=np.float64) - np.asarray(reference[k], dtype=np.float64)
        total += float(np.dot(d.ravel(), d.ravel()))
    return float(np.sqrt(total))


def clip_update(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                keys: Iterable[str], clip_norm: float) -> tuple[NDArrays, float]:
    """``s + (a - s) * min(1, C / ||a - s||)`` on the float ``keys`` (the rest of ``arrays``
    untouched; an integer key among ``keys`` is replaced by the reference's value); returns
    the clipped arrays and the norm before clipping."""
    keys = list(keys)
    floats = [k for k in keys if is_float(np.asarray(reference[k]))]
    norm = update_norm(arrays, reference, floats)
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    out: NDArrays = dict(arrays)
    for k in keys:
        ref = np.asarray(reference[k])
        if k not in floats:
            out[k] = ref.copy()
        elif scale < 1.0:
            delta = np.asarray(arrays[k], dtype=np.float64) - ref.astype(np.float64)
            out[k] = (ref.astype(np.float64) + delta * scale).astype(ref.dtype)
    return out, norm


def noise_std(noise_multiplier: float, clip_norm: float, replies: int) -> float:
    """The std of the Gaussian noise on the mean of ``replies`` clipped updates: z C / m."""
    if replies < 1:
        raise ValueError("the noise of a mean needs at least one reply")
    return noise_multiplier * clip_norm / replies


def add_noise(arrays: Mapping[str, np.ndarray], keys: Iterable[str], std: float,
              rng: np.random.Generator) -> NDArrays:
    """``arrays`` with N(0, std^2) added to every float tensor of ``keys`` (drawn in float64,
    in the order of ``keys``); a running variance is kept >= 0."""
    out: NDArrays = dict(arrays)
    for k in keys:
        a = np.asarray(arrays[k])
        if not is_float(a):
            continue
        noisy = a.astype(np.float64) + rng.normal(0.0, std, size=a.shape)
        if k.endswith(NON_NEGATIVE_SUFFIXES):
            noisy = np.maximum(noisy, 0.0)
        out[k] = noisy.astype(a.dtype)
    return out
