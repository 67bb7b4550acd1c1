"""Model state <-> numpy arrays (the unit every aggregation rule works on)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn

NDArrays = dict[str, np.ndarray]


def get_arrays(model: nn.Module, keys: Iterable[str] | Callable[[str], bool] | None = None) -> NDArrays:
    """Copy the model's state (parameters and buffers) as numpy arrays, optionally a subset."""
    state = model.state_dict()
    if keys is None:
        select = state.keys()
    elif callable(keys):
        select = [k for k in state if keys(k)]
    else:
        select = list(keys)
    return {k: state[k].detach().cpu().numpy().copy() for k in select}


def set_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Load a (partial) set of arrays into the model, checking names and shapes."""
    state = model.state_dict()
    unknown = [k for k in arrays if k not in state]
    if unknown:
        raise KeyError(f"arrays {unknown[:5]} are not in the model (is the model config the same "
                       "on server and clients?)")
    for k, v in arrays.items():
        v = np.asarray(v)
        if state[k].ndim == 0 and v.shape == (1,):  # Flower ships 0-d arrays as shape (1,)
            v = v.reshape(())
        if tuple(state[k].shape) != tuple(np.shape(v)):
            raise ValueError(f"array {k!r} has shape {np.shape(v)}, the model expects {tuple(state[k].shape)}")
        state[k].copy_(torch.as_tensor(np.asarray(v), dtype=state[k].dtype))


def num_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def is_float(a: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def weighted_mean(arrays_list: list[NDArrays], weights: list[float]) -> NDArrays:
    """Per-key weighted mean: sum_k w_k a_k / sum_k w_k (FedAvg). Integer buffers (e.g. BN's
    num_batches_tracked) are averaged and rounded back to their dtype."""
    if not arrays_list:
        raise ValueError("weighted_mean needs at least one set of arrays")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    w = w / w.sum()
    out: NDArrays = {}
    for key in arrays_list[0]:
        stacked = np.stack([np.asarray(a[key], dtype=np.float64) for a in arrays_list])
        mean = np.tensordot(w, stacked, axes=1)
        dtype = np.asarray(arrays_list[0][key]).dtype
        out[key] = (np.rint(mean) if not np.issubdtype(dtype, np.floating) else mean).astype(dtype)
    return out
