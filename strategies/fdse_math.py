"""Server-side math of FDSE (Wang et al., "Federated Domain Shift Eraser", CVPR 2025).

numpy and torch (numpy arrays or torch tensors in); no Flower import. The O(K^2 d) parts
(Gram matrices, mixing) run in torch on the aggregation device (the GPU when there is one,
``PFLOWER_AGG_DEVICE`` overrides), in the inputs' precision: float32 model tensors are
stacked once and multiplied in float32 (no float64 copies), float64 inputs stay float64;
only the K x K problems are solved in float64.

Contents
--------
* :func:`min_norm_weights` / :func:`min_norm_weights_batched` -- the MGDA min-norm
  quadratic program over the probability simplex (paper Sec. 4.3.1, Eq. 8)::

      u* = argmin_{u in simplex}  || sum_k u_k d_k ||^2 = argmin_u  u^T G u,   G = D D^T.

* :func:`consensus_update` / :func:`consensus_update_many` -- consensus-maximisation
  aggregation of the shared (DFE + head) tensors, layer-wise (Eq. 8)::

      dbar = mean_k ||delta_k||,   d_k = delta_k / ||delta_k||,   delta = dbar * sum_k u*_k d_k.

* :func:`attention_mix` / :func:`attention_mix_many` -- similarity-aware personalised
  aggregation of the DSE tensors (Sec. 4.3.2, Eq. 9)::

      theta_i_next = sum_j softmax_j( cos(theta_i, theta_j) / tau ) theta_j.

* :func:`layer_weights` -- the depth weights of the consistency regulariser (Eq. 7).

Solver (min-norm QP)
--------------------
All problems are reduced to their K x K Gram matrix first (cost O(K^2 d) once, computed
in chunks so memory stays O(K * chunk)); the QP itself is then K-dimensional and all
tensors' QPs are solved together, vectorised over the batch axis T:

* K = 1: ``u = [1]``; K = 2: exact closed form (clipped line minimisation).
* 3 <= K <= ``exact_max_k`` (default 8): exact enumeration of the supports (every face's
  KKT system, batched over tensors); the iterative solver below only runs if round-off
  leaves a gap above ``tol``.
* larger K: accelerated projected gradient (FISTA, step 1/L with L = 2 lambda_max(G), exact
  Euclidean projection onto the simplex, adaptive momentum restart). Every
  ``check_every`` iterations the support S = {k: u_k > 0} of the current iterate is
  "polished": the equality-constrained QP on S (KKT system ``G_SS u_S = nu 1, 1^T u_S = 1``)
  is solved exactly by least squares; the polished point is accepted if it is feasible
  and certifies optimality. This gives exact solutions (up to float64 round-off) as soon
  as FISTA has identified the optimal support, which in practice takes few iterations.

Stopping criterion and tolerance: the Frank-Wolfe duality gap of f(u) = u^T G u,

    gap(u) = grad f(u)^T u - min_i grad f(u)_i = 2 * (u^T G u - min_i (G u)_i)  >= f(u) - f*,

which is zero exactly at the KKT points ((G u)_i >= u^T G u for all i, with equality where
u_i > 0). A problem is converged when gap <= ``tol`` (absolute; the rows being unit
vectors, G has unit diagonal and f <= 1, so this is also a relative tolerance). Default
``tol = 1e-10``. If ``max_iter`` is reached first the best iterate is returned and a
``RuntimeWarning`` reports the largest remaining gap.

The method's part that server and client both read is here too: ``FDSEOptions`` (the options
of ``conf/strategy/fdse.yaml``) and the role rule :func:`fdse_roles`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.options import MethodOptions, check_choice, check_finite, check_option
from learning.params import stack_rows

if TYPE_CHECKING:
    from torch import nn


@dataclasses.dataclass(frozen=True)
class FDSEOptions(MethodOptions):
    """FDSE: consistency loss (lam, beta, form, first round), server rules (tau,
    consensus_tol, zero_policy) and unseen-domain adaptation (adapt_*)."""

    lam: float
    beta: float
    tau: float
    consistency_form: str
    consistency_from_round: int
    consensus_tol: float
    zero_policy: str
    adapt_epochs: int
    adapt_lr: float
    adapt_on: str
    evaluate: str

    def __post_init__(self) -> None:
        check_choice("evaluate", self.evaluate, ("trained", "aggregated"))
        check_finite("lam", self.lam, 0.0)
        check_finite("beta", self.beta)
        check_finite("tau", self.tau, 0.0, strict=True)
        check_choice("consistency_form", self.consistency_form, ("paper", "code"))
        check_finite("consensus_tol", self.consensus_tol, 0.0)
        check_choice("zero_policy", self.zero_policy, ("exclude", "include"))
        check_option(self.adapt_epochs >= 0, f"strategy.adapt_epochs must be >= 0, got {self.adapt_epochs}")
        check_finite("adapt_lr", self.adapt_lr, 0.0, strict=True)
        check_choice("adapt_on", self.adapt_on, ("train", "test"))


def fdse_roles(model: nn.Module) -> dict[str, str]:
    """FDSE: DFE and head shared, DSE personal, BN_DSE running statistics local."""
    from learning.fdse_model import dse_blocks, parameter_classes

    if not dse_blocks(model):
        raise ValueError(f"strategy fdse needs an FDSE model (model=fdse-alexnet or fdse-resnet18), "
                         f"got {type(model).__name__} without DSE blocks")
    return dict(parameter_classes(model))   # its classes are named as these roles


__all__ = [
    "min_norm_weights",
    "min_norm_weights_batched",
    "duality_gap",
    "gram_matrix",
    "consensus_update",
    "consensus_update_many",
    "attention_mix",
    "attention_mix_many",
    "layer_weights",
]

_DEFAULT_TOL = 1e-10
_DEFAULT_MAX_ITER = 20_000
_GRAM_CHUNK = 1 << 20  # elements per client per chunk when forming Gram matrices


# --------------------------------------------------------------------------- helpers
def _to_numpy(x: Any, name: str = "array") -> np.ndarray:
    """Convert numpy arrays, torch tensors, scalars and sequences to a float64 ndarray."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu().double().numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot convert to a float64 array ({exc})") from exc
    return arr


def _check_finite(arr: np.ndarray, name: str) -> None:
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values")


def _is_float_like(x: Any) -> bool:
    """True for floating numpy arrays / torch tensors (integer buffers are not mixed)."""
    if hasattr(x, "is_floating_point"):
        return bool(x.is_floating_point())
    return np.issubdtype(np.asarray(x).dtype, np.floating)


def _project_simplex(v: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Euclidean projection of each row of ``v`` ([T, K]) onto the probability simplex.

    Sort-based algorithm (Held et al. 1974; Duchi et al. 2008), vectorised over rows.
    Coordinates with ``mask == False`` are forced to zero.
    """
    if mask is not None:
        v = np.where(mask, v, -1e300)
    u = -np.sort(-v, axis=-1)
    css = np.cumsum(u, axis=-1) - 1.0
    ind = np.arange(1, v.shape[-1] + 1, dtype=np.float64)
    cond = u - css / ind > 0
    # rho = index of the last True (cond is True for a prefix); at least index 0
    rho = v.shape[-1] - 1 - np.argmax(cond[..., ::-1], axis=-1)
    theta = np.take_along_axis(css, rho[..., None], axis=-1) / (rho[..., None] + 1.0)
    w = np.maximum(v - theta, 0.0)
    if mask is not None:
        w = np.where(mask, w, 0.0)
    return w


def _gap_batched(grams: np.ndarray, w: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    gw = np.einsum("tij,tj->ti", grams, w)
    f = np.einsum("ti,ti->t", w, gw)
    if mask is not None:
        gw = np.where(mask, gw, np.inf)
    return 2.0 * (f - gw.min(axis=-1))


def duality_gap(gram: np.ndarray, weights: np.ndarray) -> float:
    """Frank-Wolfe duality gap ``2 (w^T G w - min_i (G w)_i)`` of the min-norm QP.

    Non-negative for ``w`` on the simplex, zero exactly at the optimum (KKT point), and an
    upper bound on ``f(w) - f*``.
    """
    g = _to_numpy(gram, "gram")
    w = _to_numpy(weights, "weights")
    if g.ndim != 2 or g.shape[0] != g.shape[1] or w.shape != (g.shape[0],):
        raise ValueError(f"duality_gap: need gram K x K and weights K, got {g.shape}, {w.shape}")
    return float(_gap_batched(g[None], w[None], None)[0])


def _polish(gram: np.ndarray, w: np.ndarray, mask: np.ndarray | None) -> np.ndarray | None:
    """Exact solve of the equality-constrained QP on the support of ``w``.

    Solves ``[[G_SS, 1], [1^T, 0]] [u; -nu] = [0; 1]`` (least squares, so singular G_SS is
    fine) and returns the full-length candidate, or None if it is infeasible.
    """
    support = np.flatnonzero(w > 0)
    if support.size == 0:
        return None
    s = support.size
    kkt = np.zeros((s + 1, s + 1))
    kkt[:s, :s] = gram[np.ix_(support, support)]
    kkt[:s, s] = 1.0
    kkt[s, :s] = 1.0
    rhs = np.zeros(s + 1)
    rhs[s] = 1.0
    sol, *_ = np.linalg.lstsq(kkt, rhs, rcond=None)
    u = sol[:s]
    if not np.all(np.isfinite(u)) or u.min() < -1e-9:
        return None
    u = np.maximum(u, 0.0)
    tot = u.sum()
    if tot <= 0:
        return None
    out = np.zeros_like(w)
    out[support] = u / tot
    if mask is not None and np.any(out[~mask] > 0):
        return None
    return out


def _two_point(g: np.ndarray) -> np.ndarray:
    """Closed-form minimiser of ||a d1 + (1-a) d2||^2 over a in [0, 1], batched [T,2,2]."""
    g11, g22, g12 = g[:, 0, 0], g[:, 1, 1], g[:, 0, 1]
    denom = g11 + g22 - 2.0 * g12  # = ||d1 - d2||^2 >= 0
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(denom > 1e-300, (g22 - g12) / denom, 0.5)
    a = np.clip(a, 0.0, 1.0)
    return np.stack([a, 1.0 - a], axis=-1)


def _enumerate_supports(g: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Exact min-norm weights for small K by enumerating every support S (batched over T).

    For each non-empty S (allowed by ``mask``) solve the KKT system of the QP restricted
    to the face of S, ``[[G_SS, 1], [1^T, 0]] [u; -nu] = [0; 1]`` (pseudo-inverse, so a
    singular ``G_SS`` is fine), keep the feasible (u >= 0) candidates and return the one
    with the smallest objective. Some optimal point lies in the relative interior of a
    face, where it solves that face's KKT system, so the minimum over faces is exact.
    Cost: 2^K - 1 batched (|S|+1)-dimensional solves.
    """
    t_count, k = g.shape[0], g.shape[1]
    best_f = np.full(t_count, np.inf)
    best_w = np.zeros((t_count, k))
    for bits in range(1, 1 << k):
        support = [i for i in range(k) if bits >> i & 1]
        s = len(support)
        allowed = np.ones(t_count, dtype=bool) if mask is None else mask[:, support].all(axis=1)
        if not allowed.any():
            continue
        kkt = np.zeros((t_count, s + 1, s + 1))
        kkt[:, :s, :s] = g[:, support][:, :, support]
        kkt[:, :s, s] = 1.0
        kkt[:, s, :s] = 1.0
        rhs = np.zeros(s + 1)
        rhs[s] = 1.0
        u = (np.linalg.pinv(kkt) @ rhs)[:, :s]
        total = u.sum(axis=1)
        ok = allowed & np.all(np.isfinite(u), axis=1) & (u.min(axis=1) >= -1e-12) & (total > 0.5)
        if not ok.any():
            continue
        u = np.maximum(u, 0.0) / np.where(total > 0, total, 1.0)[:, None]
        w = np.zeros((t_count, k))
        w[:, support] = u
        f = np.einsum("ti,tij,tj->t", w, g, w)
        better = ok & (f < best_f)
        best_f = np.where(better, f, best_f)
        best_w[better] = w[better]
    return best_w


# --------------------------------------------------------------------- min-norm QP
def min_norm_weights_batched(
    grams: np.ndarray,
    tol: float = _DEFAULT_TOL,
    max_iter: int = _DEFAULT_MAX_ITER,
    mask: np.ndarray | None = None,
    check_every: int = 10,
    exact_max_k: int = 8,
) -> np.ndarray:
    """Solve T independent min-norm QPs ``min_{w in simplex} w^T G_t w`` at once.

    Parameters
    ----------
    grams : [T, K, K] symmetric positive semi-definite Gram matrices ``G_t = D_t D_t^T``.
    tol : absolute tolerance on the duality gap ``2 (w^T G w - min_i (G w)_i)``.
    max_iter : maximum number of accelerated projected-gradient iterations.
    mask : optional [T, K] boolean array; ``False`` coordinates are fixed to weight 0
        (used to exclude zero updates). Every row must have at least one ``True``.
    check_every : how often (iterations) the gap is evaluated and the support polished.
    exact_max_k : for 3 <= K <= ``exact_max_k`` every support is enumerated (exact, and
        much faster than the iterative solver for the few clients of cross-silo FL);
        problems whose enumerated solution does not meet ``tol`` (round-off on
        ill-conditioned Grams) continue with the iterative solver from it.

    Returns
    -------
    [T, K] float64 weights, each row on the simplex (non-negative, sums to 1).

    See the module docstring for the method (closed form for K <= 2, FISTA + exact support
    polish otherwise) and the stopping rule.
    """
    g = _to_numpy(grams, "grams")
    if g.ndim != 3 or g.shape[1] != g.shape[2]:
        raise ValueError(f"min_norm_weights_batched: grams must be [T, K, K], got {g.shape}")
    _check_finite(g, "grams")
    t_count, k = g.shape[0], g.shape[1]
    if k == 0:
        raise ValueError("min_norm_weights_batched: K must be >= 1")
    if not (tol > 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a positive finite number, got {tol}")
    if max_iter < 1 or check_every < 1:
        raise ValueError("max_iter and check_every must be >= 1")
    if not np.allclose(
        g, np.swapaxes(g, 1, 2), atol=1e-8 * max(1.0, float(np.abs(g).max(initial=0)))
    ):
        raise ValueError("min_norm_weights_batched: Gram matrices must be symmetric")
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (t_count, k):
            raise ValueError(f"mask must have shape {(t_count, k)}, got {mask.shape}")
        if not np.all(mask.any(axis=1)):
            raise ValueError("mask: every problem needs at least one allowed coordinate")
        if mask.all():
            mask = None
    if t_count == 0:
        return np.zeros((0, k))
    g = 0.5 * (g + np.swapaxes(g, 1, 2))

    if k == 1:
        return np.ones((t_count, 1))
    if k == 2 and mask is None:
        return _two_point(g)

    # --- initial point: exact enumeration for small K, else uniform over allowed coordinates
    if k <= exact_max_k:
        w = _enumerate_supports(g, mask)
    else:
        w = np.ones((t_count, k)) if mask is None else mask.astype(np.float64)
        w /= w.sum(axis=1, keepdims=True)
    # Lipschitz constant of grad f = 2 G w: 2 * lambda_max(G)
    lmax = np.linalg.eigvalsh(g)[:, -1]
    step = 1.0 / (2.0 * np.maximum(lmax, 1e-12))

    best_w = w.copy()
    best_gap = _gap_batched(g, w, mask)
    done = best_gap <= tol
    y = w.copy()
    tk = np.ones(t_count)
    it = 0
    while not np.all(done) and it < max_iter:
        act = np.flatnonzero(~done)
        ga, ya, wa = g[act], y[act], w[act]
        ma = None if mask is None else mask[act]
        grad = 2.0 * np.einsum("tij,tj->ti", ga, ya)
        w_new = _project_simplex(ya - step[act, None] * grad, ma)
        t_new = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * tk[act] ** 2))
        # adaptive restart (O'Donoghue & Candes 2015): drop momentum if it points uphill
        restart = np.einsum("ti,ti->t", ya - w_new, w_new - wa) > 0
        beta = np.where(restart, 0.0, (tk[act] - 1.0) / t_new)
        y[act] = w_new + beta[:, None] * (w_new - wa)
        tk[act] = np.where(restart, 1.0, t_new)
        w[act] = w_new
        it += 1
        if it % check_every == 0 or it == max_iter:
            gap = _gap_batched(ga, w_new, ma)
            better = gap < best_gap[act]
            best_gap[act] = np.where(better, gap, best_gap[act])
            best_w[act] = np.where(better[:, None], w_new, best_w[act])
            for j, tid in enumerate(act):
                if best_gap[tid] <= tol:
                    done[tid] = True
                    continue
                cand = _polish(g[tid], w_new[j], None if mask is None else mask[tid])
                if cand is None:
                    continue
                cgap = float(
                    _gap_batched(
                        g[tid][None], cand[None], None if mask is None else mask[tid][None]
                    )[0]
                )
                if cgap < best_gap[tid]:
                    best_gap[tid], best_w[tid] = cgap, cand
                if cgap <= tol:
                    done[tid] = True
    if not np.all(done):
        warnings.warn(
            f"min_norm_weights: max_iter={max_iter} reached; largest duality gap "
            f"{float(best_gap.max()):.3e} > tol={tol:.1e}",
            RuntimeWarning,
            stacklevel=2,
        )
    return best_w


def min_norm_weights(
    directions: np.ndarray,
    tol: float = _DEFAULT_TOL,
    max_iter: int = _DEFAULT_MAX_ITER,
) -> np.ndarray:
    """MGDA min-norm weights (FDSE Eq. 8; Desideri 2012, Sener & Koltun 2018).

    Parameters
    ----------
    directions : K x d array whose rows are the (normally unit-length) directions d_k.
    tol : duality-gap tolerance (see module docstring).
    max_iter : iteration cap of the iterative solver (K >= 3).

    Returns
    -------
    K weights ``w`` on the simplex minimising ``|| w @ directions ||^2``.
    Optimality: ``(G w)_i >= w^T G w`` for all i, with equality where ``w_i > 0``
    (G = D D^T), up to ``tol``.
    """
    d = _to_numpy(directions, "directions")
    if d.ndim != 2:
        raise ValueError(f"min_norm_weights: directions must be K x d, got shape {d.shape}")
    if d.shape[0] == 0:
        raise ValueError("min_norm_weights: need at least one direction (K >= 1)")
    _check_finite(d, "directions")
    return min_norm_weights_batched((d @ d.T)[None], tol=tol, max_iter=max_iter)[0]


# ----------------------------------------------------------------- consensus update
def gram_matrix(vectors: Sequence[np.ndarray], chunk: int = _GRAM_CHUNK) -> np.ndarray:
    """K x K Gram matrix of K flat vectors, accumulated over chunks of the d axis.

    Memory is O(K * chunk) on top of the inputs, so hundreds of clients with large tensors
    are fine; computation is in float64.
    """
    k = len(vectors)
    if k == 0:
        raise ValueError("gram_matrix: need at least one vector")
    n = vectors[0].size
    if any(v.size != n for v in vectors):
        raise ValueError("gram_matrix: vectors have different sizes")
    gram = np.zeros((k, k))
    for start in range(0, max(n, 1), chunk):
        block = np.stack([np.asarray(v[start : start + chunk], dtype=np.float64) for v in vectors])
        gram += block @ block.T
    return gram


def _consensus_from_gram(
    raw_gram: np.ndarray, norms: np.ndarray, zero_policy: str
) -> tuple[np.ndarray, np.ndarray]:
    """Normalised Gram + mask from the raw Gram of the updates."""
    nz = norms > 0
    inv = np.where(nz, 1.0 / np.where(nz, norms, 1.0), 0.0)
    gram = raw_gram * inv[:, None] * inv[None, :]
    np.fill_diagonal(gram, nz.astype(np.float64))  # exact unit diagonal (zero for zero rows)
    if zero_policy == "exclude":
        mask = nz.copy()
        if not mask.any():
            mask[:] = True  # all updates zero: any weights give the zero update
    elif zero_policy == "include":
        mask = np.ones_like(nz)
    else:
        raise ValueError(f"zero_policy must be 'exclude' or 'include', got {zero_policy!r}")
    return gram, mask


def _rows_and_gram(values: Sequence[Any], name: str) -> tuple[torch.Tensor, tuple[int, ...], np.ndarray]:
    """K same-shape tensors as (K, d) rows on the aggregation device, their shape and their
    K x K Gram matrix ``X X^T`` (one matrix product, in the inputs' precision, returned in
    float64, symmetrised: one float32 product rounds its two triangles differently, ~2e-8 apart
    at K = 10, d = 1M, which the solvers' symmetry check would refuse). A client whose values
    are not finite is named: its Gram diagonal (sum of squares) is then not finite, so no extra
    pass over the data is needed."""
    if isinstance(values, np.ndarray) and values.ndim >= 1:
        values = list(values)
    if len(values) == 0:
        raise ValueError(f"{name}: need at least one client")
    shapes = [tuple(v.shape) if hasattr(v, "shape") else np.shape(v) for v in values]
    for i, shape in enumerate(shapes):
        if shape != shapes[0]:
            raise ValueError(f"{name}: client {i} has shape {shape}, expected {shapes[0]}")
    try:
        rows = stack_rows(list(values))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot convert to a floating array ({exc})") from exc
    gram = (rows @ rows.T).double().cpu().numpy()
    gram = 0.5 * (gram + gram.T)
    bad = np.flatnonzero(~np.isfinite(np.diag(gram)))
    if bad.size:
        raise ValueError(f"{name}[{int(bad[0])}] contains NaN or infinite values")
    return rows, shapes[0], gram


def _combine(rows: torch.Tensor, norms: np.ndarray, w: np.ndarray) -> torch.Tensor:
    """``mean_k ||delta_k|| * sum_k w_k delta_k / ||delta_k||`` as one (1 x K)(K x d) product."""
    nz = (norms > 0) & (w > 0)
    coef = np.where(nz, w / np.where(nz, norms, 1.0), 0.0) * float(norms.mean())
    return torch.as_tensor(coef, dtype=rows.dtype, device=rows.device) @ rows


def consensus_update(
    updates: Sequence[np.ndarray],
    tol: float = _DEFAULT_TOL,
    max_iter: int = _DEFAULT_MAX_ITER,
    zero_policy: str = "exclude",
    return_weights: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Consensus-maximisation aggregate of K same-shape updates (FDSE Eq. 8).

    ``delta_k`` = client k's update (its local tensor minus the global tensor it received).
    ``d_k = delta_k / ||delta_k||``, ``u = min_norm_weights(d)``, and the returned update is
    ``mean_k ||delta_k|| * sum_k u_k d_k`` (same shape as the inputs; float64 for float64
    inputs, float32 otherwise). The new global tensor is ``old + update``.

    Zero updates (``||delta_k|| = 0``) have no direction. ``zero_policy="exclude"`` (default)
    leaves them out of the min-norm problem (weight 0) while their norm 0 still counts in the
    mean norm; ``"include"`` keeps them as zero directions as the authors' code does
    (``delta / (||delta|| + 1e-8)``), in which case the min-norm point is 0 and so is the
    update. If all updates are zero the result is zero. No NaN is produced in either case.

    Returns the update, or ``(update, weights)`` if ``return_weights``.
    """
    out, weights = consensus_update_many([{"u": u} for u in updates], tol=tol, max_iter=max_iter,
                                         zero_policy=zero_policy, return_weights=True)
    return (out["u"], weights["u"]) if return_weights else out["u"]


def consensus_update_many(
    updates_per_client: Sequence[Mapping[str, Any]],
    tol: float = _DEFAULT_TOL,
    max_iter: int = _DEFAULT_MAX_ITER,
    zero_policy: str = "exclude",
    return_weights: bool = False,
) -> dict[str, np.ndarray] | tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Layer-wise (per tensor) :func:`consensus_update` over dicts of tensors.

    Parameters
    ----------
    updates_per_client : K dicts with identical keys and per-key identical shapes;
        values are client updates (local minus received global), numpy or torch.
    tol, max_iter, zero_policy : as in :func:`consensus_update`.
    return_weights : also return ``{key: weights[K]}``.

    Per tensor the K updates are stacked once and their K x K Gram matrix is one matrix
    product; all tensors' QPs are then solved in one batched call
    (:func:`min_norm_weights_batched`) and each update is one (1 x K)(K x d) product.
    Returns ``{key: update}`` (arrays of the original shapes, in the inputs' precision).
    """
    if len(updates_per_client) == 0:
        raise ValueError("consensus_update_many: need at least one client")
    keys = list(updates_per_client[0].keys())
    for i, d in enumerate(updates_per_client):
        if set(d.keys()) != set(keys):
            raise ValueError(f"consensus_update_many: client {i} has different keys")
    if not keys:
        return ({}, {}) if return_weights else {}
    prepared = {}
    grams, masks = [], []
    for key in keys:
        rows, shape, raw = _rows_and_gram([d[key] for d in updates_per_client], f"update[{key!r}]")
        norms = np.sqrt(np.maximum(np.diag(raw), 0.0))
        gram, mask = _consensus_from_gram(raw, norms, zero_policy)
        prepared[key] = (rows, shape, norms)
        grams.append(gram)
        masks.append(mask)
    weights = min_norm_weights_batched(
        np.stack(grams), tol=tol, max_iter=max_iter, mask=np.stack(masks)
    )
    out, wdict = {}, {}
    for key, w in zip(keys, weights, strict=True):
        rows, shape, norms = prepared.pop(key)
        out[key] = _combine(rows, norms, w).cpu().numpy().reshape(shape)
        wdict[key] = w
    return (out, wdict) if return_weights else out


# -------------------------------------------------------------------- attention mix
def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def _check_tau(tau: float) -> float:
    tau = float(tau)
    if not (tau > 0 and math.isfinite(tau)):
        raise ValueError(f"attention_mix: tau must be positive and finite, got {tau}")
    return tau


def _attention_rows(rows: torch.Tensor, gram: np.ndarray, tau: float) -> torch.Tensor:
    """``softmax(cos / tau) @ rows`` with the cosines read off the Gram matrix (a zero row
    has cosine 0 with every row, itself included); the K x K softmax in float64."""
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    inv = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1.0), 0.0)
    attn = _softmax(gram * inv[:, None] * inv[None, :] / tau, axis=1)
    return torch.as_tensor(attn, dtype=rows.dtype, device=rows.device) @ rows


def attention_mix(params: np.ndarray, tau: float) -> np.ndarray:
    """Similarity-aware personalised aggregation (FDSE Eq. 9).

    ``Q = K = rows of params normalised to unit length``, ``V = params``; returns
    ``softmax(Q K^T / tau) V`` with the softmax taken row-wise, i.e. row i is
    ``sum_j softmax_j(cos(p_i, p_j) / tau) p_j`` (self included). A zero row has cosine 0
    with every row (itself included). Input K x d, output K x d (float64 for float64 input,
    float32 otherwise).
    """
    if getattr(params, "ndim", np.ndim(params)) != 2 or len(params) == 0:
        raise ValueError(f"attention_mix: params must be K x d with K >= 1, got {np.shape(params)}")
    tau = _check_tau(tau)
    rows, _, gram = _rows_and_gram(list(params), "params")
    return _attention_rows(rows, gram, tau).cpu().numpy()


def attention_mix_many(
    params_per_client: Sequence[Mapping[str, Any]], tau: float
) -> list[dict[str, np.ndarray]]:
    """Per-tensor :func:`attention_mix` over K dicts with identical keys and shapes.

    Each tensor is stacked to a K x d matrix once; the cosines come from its Gram matrix and
    the mix is one (K x K)(K x d) product. Non-floating tensors (e.g.
    ``num_batches_tracked``) are not mixed: each client keeps its own value. Returns K dicts
    of numpy arrays (mixed tensors in the inputs' precision).
    """
    if len(params_per_client) == 0:
        raise ValueError("attention_mix_many: need at least one client")
    tau = _check_tau(tau)
    keys = list(params_per_client[0].keys())
    for i, d in enumerate(params_per_client):
        if set(d.keys()) != set(keys):
            raise ValueError(f"attention_mix_many: client {i} has different keys")
    out: list[dict[str, np.ndarray]] = [{} for _ in params_per_client]
    for key in keys:
        vals = [d[key] for d in params_per_client]
        if not all(_is_float_like(v) for v in vals):
            for i, v in enumerate(vals):
                out[i][key] = v.detach().cpu().numpy() if hasattr(v, "detach") else np.array(v)
            continue
        rows, shape, gram = _rows_and_gram(vals, f"attention_mix_many: {key!r}")
        mixed = _attention_rows(rows, gram, tau).cpu().numpy()
        for i in range(len(vals)):
            out[i][key] = mixed[i].reshape(shape)
    return out


# ------------------------------------------------------------------- layer weights
def layer_weights(num_layers: int, beta: float) -> np.ndarray:
    """Depth weights of the consistency regulariser (FDSE Eq. 7).

    ``w_l = exp(beta * l) / sum_{l'=1..L} exp(beta * l')`` for ``l = 1..L`` (L = number of
    DSE modules, ordered input -> output). The authors' code indexes ``l = 0..L-1``; softmax
    is shift invariant, so the weights are identical.
    """
    if isinstance(num_layers, bool) or int(num_layers) != num_layers or num_layers < 1:
        raise ValueError(f"layer_weights: num_layers must be a positive integer, got {num_layers}")
    beta = float(beta)
    if not math.isfinite(beta):
        raise ValueError(f"layer_weights: beta must be finite, got {beta}")
    return _softmax(beta * np.arange(1, int(num_layers) + 1, dtype=np.float64))
