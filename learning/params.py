"""Model state <-> numpy arrays (the unit every aggregation rule works on)."""

from __future__ import annotations

import os
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


def aggregation_device() -> torch.device:
    """Where server-side aggregation runs: the GPU when there is one (``PFLOWER_AGG_DEVICE``
    overrides, e.g. ``cpu``)."""
    name = os.environ.get("PFLOWER_AGG_DEVICE", "")
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def weighted_mean(arrays_list: list[NDArrays], weights: list[float],
                  device: torch.device | None = None) -> NDArrays:
    """Per-key weighted mean: sum_k w_k a_k / sum_k w_k (FedAvg).

    One pass over the inputs: each float32 tensor is accumulated in place in float32
    (``acc += w_k * a_k``, no stacked copy; rounding error about K * 6e-8 relative; float16
    too), float64 ones in float64, on :func:`aggregation_device`. Integer buffers (e.g. BN's
    num_batches_tracked) are averaged in float64 and rounded back to their dtype."""
    if not arrays_list:
        raise ValueError("weighted_mean needs at least one set of arrays")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    w = w / w.sum()
    device = device or aggregation_device()
    out: NDArrays = {}
    for key in arrays_list[0]:
        first = np.asarray(arrays_list[0][key])
        dtype = first.dtype
        floating = bool(np.issubdtype(dtype, np.floating))
        acc_dtype = torch.float32 if floating and dtype.itemsize <= 4 else torch.float64
        acc = torch.zeros(first.shape, dtype=acc_dtype, device=device)
        for a, wk in zip(arrays_list, w, strict=True):
            t = torch.as_tensor(np.asarray(a[key]))
            acc.add_(t.to(device=device, dtype=acc_dtype, non_blocking=True), alpha=float(wk))
        mean = acc.cpu().numpy()
        out[key] = mean.astype(dtype, copy=False) if floating else np.rint(mean).astype(dtype)
    return out


class RunningMean:
    """The FedAvg mean sum_k w_k a_k / sum_k w_k, folded in one client at a time.

    Why: :func:`weighted_mean` needs the K clients' arrays at once, so a server that waits for
    a round's K replies before averaging holds K models (80 FedBasis clients x 5 ResNet-18
    bases: 18 GB of replies, twice that parsed). Folded in as each reply arrives, the round
    holds one float64 accumulator per tensor (on :func:`aggregation_device`) and the replies
    in flight. The sum is in arrival order in float64 and rounded once to each tensor's dtype,
    so it agrees with :func:`weighted_mean` (client order, float32) to float32 precision, not
    bit for bit. Integer buffers are averaged and rounded back, as there."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or aggregation_device()
        self.sums: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.total = 0.0
        self.count = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one client's arrays in with weight ``weight`` (its sample count, or 1)."""
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"a client's weight must be finite and >= 0, got {weight}")
        if self.count and set(arrays) != set(self.sums):
            raise ValueError(f"a client's arrays {sorted(set(arrays) ^ set(self.sums))[:3]} differ from the "
                             "first client's; every client of a mean uploads the same tensors")
        for key, value in arrays.items():   # every check before the first add: a refusal changes nothing
            if key in self.sums and tuple(self.sums[key].shape) != np.shape(value):
                raise ValueError(f"array {key!r} has shape {np.shape(value)}, the first client's "
                                 f"{tuple(self.sums[key].shape)}")
        for key, value in arrays.items():
            a = np.asarray(value)
            if key not in self.sums:
                self.sums[key] = torch.zeros(a.shape, dtype=torch.float64, device=self.device)
                self.dtypes[key] = a.dtype
            # one float64 copy of one tensor at a time (also takes Flower's read-only arrays)
            self.sums[key].add_(torch.from_numpy(np.array(a, dtype=np.float64)).to(self.device), alpha=weight)
        self.total += float(weight)
        self.count += 1

    def result(self) -> NDArrays:
        """The mean, each tensor in the dtype it arrived in."""
        if self.total <= 0:
            raise ValueError(f"a mean needs a positive total weight, got {self.total} over {self.count} clients")
        out: NDArrays = {}
        for key, acc in self.sums.items():
            mean = (acc / self.total).cpu().numpy()
            dtype = self.dtypes[key]
            out[key] = mean.astype(dtype) if np.issubdtype(dtype, np.floating) else np.rint(mean).astype(dtype)
        return out


def float_dtype_of(values: Iterable[object]) -> torch.dtype:
    """The dtype a rule computes K clients' tensors in: float64 if any input is float64,
    float32 otherwise (float16/bfloat16 and integer inputs are widened to float32)."""
    for v in values:
        dt = v.dtype if isinstance(v, torch.Tensor) else np.asarray(v).dtype
        if dt in (torch.float64, np.float64):
            return torch.float64
    return torch.float32


def stack_rows(values: list[object], device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """K same-size arrays or tensors as one (K, d) tensor of rows (flattened), on ``device``
    (default :func:`aggregation_device`), in ``dtype`` (default :func:`float_dtype_of`).

    The one copy a K x K rule needs (a matrix product wants its operand contiguous);
    numpy inputs are wrapped without a copy first. Sizes are checked by the caller."""
    device = device or aggregation_device()
    dtype = dtype or float_dtype_of(values)
    k = len(values)
    first = values[0]
    size = int(first.numel()) if isinstance(first, torch.Tensor) else int(np.asarray(first).size)
    out = torch.empty((k, size), dtype=dtype, device=device)
    host = out.numpy() if device.type == "cpu" else None
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            out[i].copy_(v.detach().reshape(-1), non_blocking=True)
        elif host is not None:  # numpy into numpy: also takes read-only arrays (Flower's records)
            np.copyto(host[i], np.asarray(v).reshape(-1), casting="unsafe")
        else:
            out[i].copy_(torch.from_numpy(np.array(v, copy=not np.asarray(v).flags.writeable)).reshape(-1))
    return out
