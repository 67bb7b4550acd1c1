"""FedBasis' server-side math (Chen et al., arXiv 2304.07882), numpy in, numpy out.

* :func:`kmeans`: Lloyd's algorithm with k-means++ seeding, for the warm start (Sec. 4.4:
  "cluster {theta_m} into K clusters and initialise the K bases with the centroids").
* :func:`seed_bases`: the K non-major bases from the clients' models at the end of the
  FedAvg warm-up: the K-means centroids, or K clients' models sampled without replacement.
* :func:`mean_pairwise_cosine` and :func:`mean_entropy`: the collapse diagnostics (bases
  becoming alike; coefficients becoming uniform, Sec. 4.2).

The method's part that server and client both read is here too: ``FedBasisOptions`` (the
options of ``conf/strategy/fedbasis.yaml``), the role rule :func:`fedbasis_roles` and the
wire name ``COEFF_METRIC``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from common.options import MethodOptions, check_choice, check_option
from common.roles import LOCAL, SHARED
from learning.params import NDArrays

if TYPE_CHECKING:
    from torch import nn


@dataclasses.dataclass(frozen=True)
class FedBasisOptions(MethodOptions):
    """FedBasis (Chen et al., arXiv 2304.07882): the basis model and its coordinate descent.

    ``num_bases`` K (besides the major basis when ``major``); one coefficient vector per unit
    of ``granularity``; per round ``coeff_epochs`` on the logits (bases frozen, lr
    ``coeff_lr``, null = train.lr), sharpening by ``sharpen_tau``, ``basis_epochs`` on the
    bases (logits frozen); FedAvg for the first ``warm_fraction`` of the rounds, then the
    bases are seeded from the clients' models by ``seed_bases`` (kmeans | sample); new
    clients learn their logits and, with ``personalize_head``, the classifier.
    """

    num_bases: int
    major: bool
    granularity: str
    coeff_epochs: int
    basis_epochs: int
    coeff_lr: float | None
    sharpen_tau: float
    warm_fraction: float
    seed_bases: str
    personalize_head: bool

    def __post_init__(self) -> None:
        check_option(self.num_bases >= 1, f"strategy.num_bases must be >= 1, got {self.num_bases}")
        check_choice("granularity", self.granularity, ("stage", "block", "layer"))
        check_option(self.coeff_epochs >= 0, f"strategy.coeff_epochs must be >= 0, got {self.coeff_epochs}")
        check_option(self.basis_epochs >= 0, f"strategy.basis_epochs must be >= 0, got {self.basis_epochs}")
        check_option(self.coeff_lr is None or self.coeff_lr > 0, f"strategy.coeff_lr must be > 0 or null, got {self.coeff_lr}")
        check_option(0 < self.sharpen_tau <= 1, f"strategy.sharpen_tau must be in (0, 1], got {self.sharpen_tau}")
        check_option(0 <= self.warm_fraction < 1, f"strategy.warm_fraction must be in [0, 1), got {self.warm_fraction}")
        check_choice("seed_bases", self.seed_bases, ("kmeans", "sample"))

    def not_private(self) -> str:
        """The end of a warm-up seeds the bases from the clients' own models (K-means over them,
        or K of them as they are): the server must see each one. Without a warm-up the bases
        start from K independent initialisations and every round is a mean per basis, which
        DP of the mean and secure aggregation can take (the coefficients stay on the client)."""
        if self.warm_fraction > 0:
            return (f"FedBasis seeds its bases from each client's own model at the end of its warm-up "
                    f"(strategy.warm_fraction={self.warm_fraction:g}, seed_bases={self.seed_bases}); set "
                    "strategy.warm_fraction=0 (K independently initialised bases, each averaged every round)")
        return ""


def fedbasis_roles(model: nn.Module) -> dict[str, str]:
    """FedBasis: the bases (and the major basis) shared, the combination logits local."""
    from learning.basis import COEFF_KEY

    if COEFF_KEY not in model.state_dict():
        raise ValueError(f"strategy fedbasis needs its basis model, got {type(model).__name__}")
    return {k: LOCAL if k == COEFF_KEY else SHARED for k in model.state_dict()}


# wire name, read by both sides: the learned coefficients' metrics, coeff/<unit>/<k>
COEFF_METRIC = "coeff/"


def flatten(arrays: Mapping[str, np.ndarray], keys: Sequence[str], dtype: type = np.float64) -> np.ndarray:
    """The named arrays as one vector (in ``keys`` order)."""
    return np.concatenate([np.asarray(arrays[k], dtype).ravel() for k in keys]) if keys else np.zeros(0, dtype)


CHUNK = 1 << 18   # columns of the points read at a time (n x CHUNK float64 temporaries)


def squared_distances(x: np.ndarray, centroids: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """``out[i, j] = ||x_i - c_j||^2`` (n x m, float64), summed over column chunks of ``x``
    converted to float64 one chunk at a time: memory beyond the inputs is n x ``chunk``
    numbers, never the n x m x d differences."""
    n, d = x.shape
    out = np.zeros((n, len(centroids)))
    for a in range(0, d, chunk):
        xa = np.asarray(x[:, a:a + chunk], np.float64)
        for j, c in enumerate(centroids):
            out[:, j] += ((xa - c[a:a + chunk]) ** 2).sum(1)
    return out


def cluster_means(x: np.ndarray, labels: np.ndarray, k: int, chunk: int = CHUNK,
                  out: np.ndarray | None = None) -> np.ndarray:
    """Each cluster's mean of the rows of ``x`` (k x d, float64), column chunk by chunk
    (into ``out`` when given)."""
    out = np.empty((k, x.shape[1])) if out is None else out
    for a in range(0, x.shape[1], chunk):
        xa = np.asarray(x[:, a:a + chunk], np.float64)
        for j in range(k):
            out[j, a:a + chunk] = xa[labels == j].mean(0)
    return out


def kmeans(points: np.ndarray, k: int, seed: int, iters: int = 100,
           chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """K-means of the rows of ``points`` (n x d): ``(centroids k x d float64, labels n)``.

    k-means++ seeding from ``seed``, then Lloyd iterations to a fixed point (every point
    nearest its own centroid, every centroid the mean of its points). A cluster that
    empties is re-seeded with the point farthest from its centroid. Needs n >= k.

    The points stay as given (float32 model vectors need not be copied to float64): the
    distances and means are taken over column chunks (:func:`squared_distances`,
    :func:`cluster_means`), so the memory beyond the inputs is the k float64 centroids
    plus a few n x ``chunk`` temporaries (80 ResNet-18 clients, K = 4: 0.4 GB + 0.5 GB,
    where the n x k x d differences were 29 GB, twice)."""
    x = np.asarray(points)
    n = len(x)
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= number of points, got k={k}, n={n}")
    rng = np.random.default_rng(seed)
    centroids = np.empty((k, x.shape[1]))
    centroids[0] = x[rng.integers(n)]
    d2 = squared_distances(x, centroids[:1], chunk)[:, 0]
    for j in range(1, k):
        total = float(d2.sum())
        centroids[j] = x[rng.choice(n, p=d2 / total)] if total > 0 else x[rng.integers(n)]
        d2 = np.minimum(d2, squared_distances(x, centroids[j:j + 1], chunk)[:, 0])
    labels = np.full(n, -1)
    for _ in range(iters):
        dist = squared_distances(x, centroids, chunk)
        new = dist.argmin(1)
        for j in range(k):
            if not np.any(new == j):                       # empty cluster: farthest point
                far = int(dist[np.arange(n), new].argmax())
                new[far] = j
        if np.array_equal(new, labels):
            break
        labels = new
        cluster_means(x, labels, k, chunk, out=centroids)   # in place: no second k x d copy
    return centroids, labels


def seed_bases(models: Sequence[NDArrays], k: int, method: str, seed: int) -> tuple[list[NDArrays], list[int]]:
    """K bases from the clients' models: ``(bases, assignment)``.

    ``kmeans``: the centroids of the models' floating tensors (other tensors from the first
    model), ``assignment[i]`` = model i's cluster. ``sample``: K models drawn without
    replacement, ``assignment`` = their indices. With fewer models than K, models are
    reused in turn (the bases then start equal and are told apart by training only)."""
    if not models:
        raise ValueError("no client models to seed the bases from")
    keys = list(models[0])
    floating = [key for key in keys if np.issubdtype(np.asarray(models[0][key]).dtype, np.floating)]
    if method == "sample":
        rng = np.random.default_rng(seed)
        order = list(rng.permutation(len(models)))
        picks = [int(order[i % len(order)]) for i in range(k)]
        return [{key: np.array(models[i][key], copy=True) for key in keys} for i in picks], picks
    if method != "kmeans":
        raise ValueError(f"unknown basis seeding {method!r}; valid: kmeans, sample")
    # the models' own precision (float32): one copy of the inputs, no float64 one
    dtype = np.result_type(*(np.asarray(models[0][key]).dtype for key in floating)) if floating else np.float64
    points = np.stack([flatten(m, floating, dtype) for m in models])
    kk = min(k, len(models))
    centroids, labels = kmeans(points, kk, seed)
    bases = []
    for j in range(k):
        vec, offset, basis = centroids[j % kk], 0, {}
        for key in keys:
            ref = np.asarray(models[0][key])
            if key in floating:
                basis[key] = vec[offset:offset + ref.size].reshape(ref.shape).astype(ref.dtype)
                offset += ref.size
            else:
                basis[key] = np.array(ref, copy=True)
        bases.append(basis)
    return bases, [int(v) for v in labels]


def mean_pairwise_cosine(vectors: Sequence[np.ndarray]) -> float:
    """Mean cosine similarity over all pairs i < j (1.0 = collapsed bases); nan for < 2."""
    if len(vectors) < 2:
        return float("nan")
    unit = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
    sims = [float(unit[i] @ unit[j]) for i in range(len(unit)) for j in range(i + 1, len(unit))]
    return float(np.mean(sims))


def mean_entropy(probabilities: np.ndarray) -> float:
    """Mean Shannon entropy (nats) of the coefficient vectors in the last axis (log K =
    uniform coefficients, the collapse Sec. 4.2 warns of; 0 = one basis per unit)."""
    p = np.clip(np.asarray(probabilities, np.float64), 1e-12, 1.0)
    return float(np.mean(-(p * np.log(p)).sum(-1)))


__all__ = ["kmeans", "seed_bases", "mean_pairwise_cosine", "mean_entropy", "flatten", "squared_distances",
           "cluster_means"]
