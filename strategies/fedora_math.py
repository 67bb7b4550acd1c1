"""Pure numpy math for FEDORA (federated parameter propagation).

Paper: J. Wu, W. Bao, E. Ainsworth, J. He, "Personalized Federated Learning with
Parameter Propagation", KDD 2023. Authors' code: github.com/junwu6/FEDORA
(``main_fedora.py``, ``models/ClientUpdate.py``). This module is our own code; it only
follows the maths. No Flower import: the strategy and the client trainer call it.

Pipeline
--------
0. Preprocessing (once). Client k computes an orthonormal basis ``U_k`` (d x p) of the
   subspace its data spans in feature space: truncated SVD ``X_k = A S U_k^T`` of the
   n x d matrix of flattened inputs (optionally with one-hot labels appended, as the
   authors' code does, with p = 1), see :func:`data_subspace_basis`. Only ``U_k`` is
   uploaded. The server computes the principal angles ``zeta_i`` between every pair of
   subspaces (their cosines are the singular values of ``U_k^T U_k'``) and the
   similarity ``w_kk' = sum_i cos(zeta_i)`` (paper), or ``exp(10 * sum_i cos)`` keeping
   the top-2 neighbours per row (authors' code), see :func:`subspace_similarity`.
1. Client update: ``min_theta  L_k(theta) + lambda_k ||theta - theta_hat_k||^2`` with the
   selective ``lambda_k`` of :func:`selective_lambda`.
2. Server update (propagation): ``Theta_hat = (1 - a) (I - a D^-1 W)^-1 Theta`` with
   ``a = alpha / (1 + alpha)``, the fixed point of
   ``theta_hat_k <- a / D_kk * sum_k' w_kk' theta_hat_k' + (1 - a) theta_k``,
   see :func:`propagate` and :func:`propagate_many`.

The method's part that server and client both read is here too: ``FEDORAOptions`` (the
options of ``conf/strategy/fedora.yaml``) and the wire names ``BASIS_RECORD``,
``BASIS_ARRAY`` and ``NEED_BASIS_KEY``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from common.options import MethodOptions, check_choice, check_finite, check_option
from learning.params import aggregation_device


@dataclasses.dataclass(frozen=True)
class FEDORAOptions(MethodOptions):
    """FEDORA: propagation strength, similarity form, data-subspace basis, selective lambda."""

    alpha: float
    similarity: str
    top_k: int | None
    temperature: float
    self_loops: bool
    basis_rank: int
    basis_labels: bool
    lambda_form: str
    eps: float
    lambda_max: float | str | None
    basis_inputs: str
    penalty: str
    lambda_bn: str = "stored"

    def __post_init__(self) -> None:
        check_choice("basis_inputs", self.basis_inputs, ("unit", "normalised"))
        check_choice("lambda_bn", self.lambda_bn, ("stored", "own"))
        check_choice("penalty", self.penalty, ("loss", "decoupled"))
        check_option(self.lambda_max is None or self.lambda_max == "auto"
                     or (isinstance(self.lambda_max, int | float) and not isinstance(self.lambda_max, bool)
                         and math.isfinite(self.lambda_max) and self.lambda_max > 0),
                     f"strategy.lambda_max must be auto, a number > 0 or null (unbounded), got {self.lambda_max!r}")
        check_finite("alpha", self.alpha, 0.0, strict=True)
        check_choice("similarity", self.similarity, ("paper", "code"))
        check_option(self.top_k is None or self.top_k >= 1, f"strategy.top_k must be >= 1 or null, got {self.top_k}")
        check_finite("temperature", self.temperature)
        check_option(self.basis_rank >= 1, f"strategy.basis_rank must be >= 1, got {self.basis_rank}")
        check_choice("lambda_form", self.lambda_form, ("paper", "code"))
        check_finite("eps", self.eps, 0.0)


# wire names, read by both sides: the extra record carrying a client's basis and the array
# in it; the train-config key listing (comma-separated) the clients whose basis the server lacks
BASIS_RECORD = "basis"
BASIS_ARRAY = "u"
NEED_BASIS_KEY = "fedora-need-basis"


__all__ = [
    "SIMILARITY_FORMS",
    "LAMBDA_FORMS",
    "CODE_TOP_K",
    "CODE_TEMPERATURE",
    "data_subspace_basis",
    "subspace_similarity",
    "row_normalize",
    "propagate",
    "propagate_many",
    "selective_lambda",
]

SIMILARITY_FORMS = ("paper", "code")
LAMBDA_FORMS = ("paper", "code")
#: Neighbours kept per row by the authors' code (``torch.topk(similarity[i], 2)``).
CODE_TOP_K = 2
#: Temperature used by the authors' code (``torch.exp(sim * 10)``).
CODE_TEMPERATURE = 10.0

_ORTHO_ATOL = 1e-4  # loose enough for bases shipped as float32


# --------------------------------------------------------------------------- basis
def data_subspace_basis(
    x: np.ndarray,
    rank: int,
    labels: np.ndarray | None = None,
    num_classes: int | None = None,
) -> np.ndarray:
    """Orthonormal basis of the feature-space subspace spanned by a client's data.

    ``x`` (n samples x any shape) is flattened to the n x f matrix ``X``. If ``labels``
    are given, their one-hot encoding (n x ``num_classes``, entries 0/1) is appended as
    extra features, giving n x (f + C): this is what the authors' code does
    (``x = cat([x, eye(C)[y]], dim=1)``). The data are *not* centred (neither the paper,
    ``X_k = U_k Sigma_k V_k^T``, nor the code, ``torch.svd_lowrank(x.t(), q=1)`` with no
    mean, centre them).

    With the economy SVD ``X = A diag(s) V^T`` (singular values in decreasing order) the
    result is ``V[:, :rank]``: the top-``rank`` right singular vectors of ``X``, i.e. the
    top-``rank`` left singular vectors of ``X^T`` (the code's ``u_s``), an orthonormal
    f' x ``rank`` matrix that spans the ``rank`` dominant directions of the data in
    feature space. The sign of each column is fixed (largest-magnitude entry positive)
    so that the result is deterministic; the subspace does not depend on it.

    Parameters
    ----------
    x : array of shape (n, ...) with n >= 1 samples; finite real values.
    rank : p, the number of basis vectors, 1 <= p <= min(n, f'). Paper: small p;
        authors' code: 1.
    labels : optional integer class labels of shape (n,), values in [0, num_classes).
    num_classes : number of classes C; required when ``labels`` is given (every client
        must use the same C so that all bases live in the same space).

    Returns
    -------
    float64 array of shape (f', rank), f' = f (+ C with labels), with orthonormal
    columns.

    Raises
    ------
    ValueError
        on bad shapes, non-finite values, bad labels, a rank outside
        [1, min(n, f')], or data whose numerical rank is below ``rank``.
    """
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(
            f"x must have shape (n_samples, ...) with at least 2 dimensions, got shape {x.shape}"
        )
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_) or np.iscomplexobj(x):
        raise ValueError(f"x must be a real numeric array, got dtype {x.dtype}")
    n = x.shape[0]
    if n < 1:
        raise ValueError("x has no samples (n = 0)")
    mat = x.reshape(n, -1).astype(np.float64, copy=False)
    if mat.shape[1] < 1:
        raise ValueError(f"x has no features per sample (shape {x.shape})")
    if not np.all(np.isfinite(mat)):
        raise ValueError("x contains NaN or infinite values")

    if labels is not None:
        if num_classes is None:
            raise ValueError(
                "num_classes is required when labels are given (all clients must append "
                "one-hot labels of the same width)"
            )
        _check_int(num_classes, "num_classes", minimum=1)
        y = np.asarray(labels)
        if y.shape != (n,):
            raise ValueError(f"labels must have shape ({n},) to match x, got {y.shape}")
        if y.dtype.kind not in "iu":
            if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
                y = y.astype(np.int64)
            else:
                raise ValueError(f"labels must be integers, got dtype {y.dtype}")
        if n and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(
                f"labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]"
            )
        onehot = np.zeros((n, int(num_classes)), dtype=np.float64)
        onehot[np.arange(n), y.astype(np.int64)] = 1.0
        mat = np.concatenate([mat, onehot], axis=1)
    elif num_classes is not None:
        raise ValueError("num_classes was given without labels")

    _check_int(rank, "rank", minimum=1)
    f = mat.shape[1]
    if rank > min(n, f):
        raise ValueError(
            f"rank={rank} exceeds min(n_samples, n_features) = min({n}, {f}) = {min(n, f)}"
        )

    _, s, vt = np.linalg.svd(mat, full_matrices=False)
    tol = s[0] * max(n, f) * np.finfo(np.float64).eps if s.size else 0.0
    if s[rank - 1] <= tol:
        numerical_rank = int(np.sum(s > tol))
        raise ValueError(
            f"rank={rank} exceeds the numerical rank of the data ({numerical_rank}): "
            "the requested subspace is not determined by the data"
        )
    basis = vt[:rank].T.copy()  # f' x p
    # deterministic sign: largest-magnitude entry of every column positive
    idx = np.argmax(np.abs(basis), axis=0)
    signs = np.sign(basis[idx, np.arange(rank)])
    signs[signs == 0] = 1.0
    return basis * signs


# ---------------------------------------------------------------------- similarity
def subspace_similarity(
    bases: Sequence[np.ndarray],
    form: str = "paper",
    top_k: int | None = None,
    temperature: float = CODE_TEMPERATURE,
    *,
    self_loops: bool = False,
) -> np.ndarray:
    """K x K similarity between clients' data subspaces (FEDORA, step 0).

    For orthonormal bases ``U_i`` (d x p_i), the cosines of the principal angles between
    span(U_i) and span(U_j) are the singular values of ``U_i^T U_j`` (min(p_i, p_j) of
    them, clipped to [0, 1]). Let ``s_ij`` be their sum (in [0, min(p_i, p_j)]).

    Forms:
        ``"paper"``: ``w_ij = s_ij = sum_l cos(zeta_l^{ij})`` (paper, Step 0 (iii)).
        ``"code"``: ``w_ij = exp(temperature * s_ij)`` (authors' code: temperature 10,
        ``sim = torch.norm(cospa, 1); sim = torch.exp(sim * 10)``).

    Diagonal (self-loops): by default ``w_ii = 0``. The authors' code fills only i != j
    (the matrix starts at zero) and, since every off-diagonal ``exp(.) >= 1 > 0``, its
    top-k never selects the client itself. The paper does not give ``w_kk``: the
    graph term ``w_kk' ||theta_hat_k - theta_hat_k'||^2`` vanishes for k' = k, and the
    closed form ``(1 - a)(I - a D^-1 W)^-1`` is the label-propagation form of Zhou et al.
    (2004), whose affinity matrix has a zero diagonal; the client's own parameters
    already enter through the ``(1 - a) theta_k`` term. ``self_loops=True`` instead puts
    the formula's value for i = j on the diagonal (``p_i`` for "paper",
    ``exp(temperature * p_i)`` for "code"), kept in addition to the top-k neighbours.

    Top-k: if ``top_k`` is set, each row keeps only its ``top_k`` largest off-diagonal
    entries (others set to 0; ties broken by the lower client index); the result is then
    in general not symmetric (as in the authors' code). ``top_k=None`` means: keep all
    neighbours for "paper", and the authors' value ``CODE_TOP_K = 2`` for "code". A
    ``top_k >= K - 1`` keeps every neighbour.

    Parameters
    ----------
    bases : K >= 1 arrays of shape (d, p_k), each with orthonormal columns (same d).
    form : "paper" (default) or "code".
    top_k : neighbours kept per row (>= 1), or None (see above).
    temperature : the code form's temperature (> 0); ignored by "paper".
    self_loops : put the i = i value on the diagonal (default False, see above).

    Returns
    -------
    float64 array of shape (K, K) with non-negative entries.

    Raises
    ------
    ValueError
        on an unknown form, mismatched or non-orthonormal bases, or bad
        top_k / temperature.
    """
    if form not in SIMILARITY_FORMS:
        raise ValueError(f"form must be one of {SIMILARITY_FORMS}, got {form!r}")
    if isinstance(bases, np.ndarray) and bases.ndim == 3:
        bases = list(bases)
    if not isinstance(bases, Sequence) or len(bases) == 0:
        raise ValueError("bases must be a non-empty list of (d, p) arrays")
    mats = []
    for k, u in enumerate(bases):
        u = np.asarray(u, dtype=np.float64)
        if u.ndim != 2 or u.shape[1] < 1 or u.shape[0] < u.shape[1]:
            raise ValueError(
                f"bases[{k}] must have shape (d, p) with 1 <= p <= d, got {u.shape}"
            )
        if not np.all(np.isfinite(u)):
            raise ValueError(f"bases[{k}] contains NaN or infinite values")
        gram = u.T @ u
        err = float(np.max(np.abs(gram - np.eye(u.shape[1]))))
        if err > _ORTHO_ATOL:
            raise ValueError(
                f"bases[{k}] does not have orthonormal columns (max |U^T U - I| = {err:.2e})"
            )
        mats.append(u)
    d = mats[0].shape[0]
    for k, u in enumerate(mats):
        if u.shape[0] != d:
            raise ValueError(
                f"all bases must have the same number of rows d; bases[0] has {d}, "
                f"bases[{k}] has {u.shape[0]}"
            )
    if form == "code":
        if not (isinstance(temperature, (int, float, np.floating, np.integer))
                and math.isfinite(float(temperature)) and float(temperature) > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if top_k is None:
            top_k = CODE_TOP_K
    if top_k is not None:
        _check_int(top_k, "top_k", minimum=1)

    num = len(mats)
    s = np.zeros((num, num), dtype=np.float64)
    for i in range(num):
        for j in range(i + 1, num):
            cos = np.linalg.svd(mats[i].T @ mats[j], compute_uv=False)
            s[i, j] = s[j, i] = float(np.sum(np.clip(cos, 0.0, 1.0)))
    self_vals = np.array([float(u.shape[1]) for u in mats])

    if form == "paper":
        w = s
        diag = self_vals
    else:
        with np.errstate(over="ignore"):
            w = np.exp(float(temperature) * s)
            diag = np.exp(float(temperature) * self_vals)
        if not (np.all(np.isfinite(w)) and (not self_loops or np.all(np.isfinite(diag)))):
            raise ValueError(
                f"exp(temperature * sum of cosines) overflows float64 (temperature="
                f"{temperature}, max p = {int(self_vals.max())}); lower the temperature or rank"
            )
    np.fill_diagonal(w, 0.0)

    if top_k is not None and top_k < num - 1:
        keep = np.zeros_like(w, dtype=bool)
        for i in range(num):
            others = np.array([j for j in range(num) if j != i])
            # stable sort on -w: ties go to the lower index
            order = others[np.argsort(-w[i, others], kind="stable")]
            keep[i, order[:top_k]] = True
        w = np.where(keep, w, 0.0)

    if self_loops:
        w[np.diag_indices(num)] = diag
    return w


# --------------------------------------------------------------------- propagation
def row_normalize(w: np.ndarray, isolated: str = "error") -> np.ndarray:
    """Return ``P = D^-1 W`` with ``D = diag(row sums of W)`` (rows of P sum to 1).

    ``isolated`` says what to do with a row of W that sums to 0 (a client with no
    neighbours): "error" (default) raises ValueError; "keep" gives that client a
    self-loop (``P_kk = 1``), so that propagation returns its own parameters unchanged
    (``theta_hat_k = theta_k``). (The authors' ``normalize_adj`` would leave the row at 0,
    which shrinks ``theta_hat_k`` to ``(1 - a) theta_k``; their top-k graph never has such
    a row.)
    """
    w = _check_w(w)
    if isolated not in ("error", "keep"):
        raise ValueError(f"isolated must be 'error' or 'keep', got {isolated!r}")
    rows = w.sum(axis=1)
    zero = rows <= 0.0
    if np.any(zero):
        if isolated == "error":
            raise ValueError(
                "similarity rows with zero sum (clients with no neighbours): "
                f"{np.flatnonzero(zero).tolist()}; D^-1 W is undefined. Use a graph "
                "where every client has a neighbour, or isolated='keep'"
            )
        w = w.copy()
        w[zero, zero] = 1.0
        rows = w.sum(axis=1)
    return w / rows[:, None]


def propagate(
    theta: np.ndarray, w: np.ndarray, alpha: float, *, isolated: str = "error"
) -> np.ndarray:
    """Federated parameter propagation (FEDORA server update, closed form).

    Solves ``min_{Theta_hat} sum_k ||theta_k - theta_hat_k||^2
    + alpha/2 sum_{k,k'} (w_kk'/D_kk) ||theta_hat_k - theta_hat_k'||^2`` through the
    fixed point of the paper's iteration

        ``theta_hat_k <- alpha / ((1 + alpha) D_kk) sum_k' w_kk' theta_hat_k'
        + 1 / (1 + alpha) theta_k``,

    i.e. ``Theta_hat = (1 - a) (I - a P)^-1 Theta`` with ``a = alpha / (1 + alpha)``,
    ``P = D^-1 W``, ``D = diag(row sums of W)``. Since P is row-stochastic and
    0 < a < 1, ``I - a P`` is strictly diagonally dominant, hence invertible and well
    conditioned (cond <= (1 + a)/(1 - a)); the K x K operator :func:`propagation_matrix` is
    solved for once in float64 and applied to all columns as one matrix product.
    Note: the authors' code hard-codes ``a = 0.8`` (``pa = 0.8``), i.e. ``alpha = 4``.

    Parameters
    ----------
    theta : (K, d) array, row k = client k's uploaded personalised parameters.
    w : (K, K) non-negative similarity matrix (need not be symmetric).
    alpha : propagation strength, a finite number > 0.
    isolated : handling of zero-sum rows of ``w``, see :func:`row_normalize`.

    Returns
    -------
    (K, d) array ``Theta_hat``, in theta's floating dtype (float64 for integer input).
    """
    theta = np.asarray(theta)
    if theta.ndim != 2:
        raise ValueError(f"theta must be a 2-D (K, d) array, got shape {theta.shape}")
    if not np.issubdtype(theta.dtype, np.floating):
        if np.issubdtype(theta.dtype, np.integer) or theta.dtype == np.bool_:
            theta = theta.astype(np.float64)
        else:
            raise ValueError(f"theta must be a real array, got dtype {theta.dtype}")
    mixing = propagation_matrix(w, alpha, theta.shape[0], isolated)
    return _mix(mixing, theta, "theta")


def propagate_many(
    thetas: Mapping[str, np.ndarray],
    w: np.ndarray,
    alpha: float,
    *,
    isolated: str = "error",
) -> dict[str, np.ndarray]:
    """:func:`propagate` applied to several tensors with one K x K operator.

    Each value is a (K, ...) array (client k's tensor in row k). The K x K propagation
    matrix ``M = (1 - a)(I - a D^-1 W)^-1`` is formed once (float64 solve; the system is
    well conditioned: cond <= (1 + a)/(1 - a)); each tensor is then one (K x K)(K x d)
    product in its own precision (float32 stays float32, no stacked or float64 copy of
    the model), on the aggregation device (the GPU when there is one). Only floating
    tensors are accepted: leave integer buffers (e.g. BatchNorm ``num_batches_tracked``) out.

    Parameters
    ----------
    thetas : name -> (K, ...) floating array; all with the same K.
    w : (K, K) non-negative similarity matrix.
    alpha : propagation strength (> 0).
    isolated : handling of zero-sum rows of ``w``, see :func:`row_normalize`.

    Returns
    -------
    dict name -> propagated array with the input's shape and dtype (same key order).
    """
    if not isinstance(thetas, Mapping) or len(thetas) == 0:
        raise ValueError("thetas must be a non-empty mapping name -> (K, ...) array")
    arrays: dict[str, np.ndarray] = {}
    num = None
    for name, value in thetas.items():
        arr = np.asarray(value)
        if arr.ndim < 1:
            raise ValueError(f"thetas[{name!r}] must have shape (K, ...), got a scalar")
        if not np.issubdtype(arr.dtype, np.floating):
            raise ValueError(
                f"thetas[{name!r}] has non-floating dtype {arr.dtype}; propagate only "
                "floating tensors (exclude counters such as num_batches_tracked)"
            )
        if num is None:
            num = arr.shape[0]
        elif arr.shape[0] != num:
            raise ValueError(
                f"all tensors must have the same number of clients K in axis 0; got "
                f"{num} and {arr.shape[0]} (thetas[{name!r}])"
            )
        arrays[name] = arr
    assert num is not None
    mixing = propagation_matrix(w, alpha, num, isolated)
    return {name: _mix(mixing, arr, f"thetas[{name!r}]") for name, arr in arrays.items()}


def propagate_clients(
    models: Sequence[Mapping[str, np.ndarray]],
    keys: Sequence[str],
    w: np.ndarray,
    alpha: float,
    *,
    isolated: str = "error",
) -> list[dict[str, np.ndarray]]:
    """:func:`propagate_many` over K client models (dicts), one tensor at a time.

    Why: stacking every tensor of every client first holds a second K x d copy of all the
    models on the host (8.5 GB at K = 100, d = 11.2M, docs/benchmarks.md (b)); here only one
    tensor's K x d_key stack exists at a time, beside the K propagated models returned.
    Returns, for each client in order, ``keys`` -> its propagated tensor (input dtype and shape).
    """
    mixing = propagation_matrix(w, alpha, len(models), isolated)
    out: list[dict[str, np.ndarray]] = [{} for _ in models]
    for key in keys:
        arr = np.stack([np.asarray(m[key]) for m in models])
        if not np.issubdtype(arr.dtype, np.floating):
            raise ValueError(f"models[*][{key!r}] has non-floating dtype {arr.dtype}; propagate only "
                             "floating tensors (exclude counters such as num_batches_tracked)")
        mixed = _mix(mixing, arr, f"models[*][{key!r}]")
        del arr
        for i in range(len(models)):
            out[i][key] = mixed[i]
    return out


def propagation_matrix(w: np.ndarray, alpha: float, num: int, isolated: str = "error") -> np.ndarray:
    """The K x K operator ``M = (1 - a)(I - a D^-1 W)^-1`` (a = alpha / (1 + alpha)) with
    ``Theta_hat = M Theta``: the inverse of :func:`_propagation_system`, float64. Its
    entries are non-negative and its rows sum to 1 (a convex mix of the clients)."""
    return np.linalg.solve(_propagation_system(w, alpha, num, isolated), np.eye(num))


def _mix(mixing: np.ndarray, arr: np.ndarray, name: str) -> np.ndarray:
    """``mixing @ arr.reshape(K, -1)`` in arr's precision (at least float32) on the
    aggregation device, returned with arr's shape and dtype. A client row with NaN or
    infinite values is named (its float64 row sum is then not finite; one pass)."""
    flat = np.ascontiguousarray(arr).reshape(arr.shape[0], -1)
    rows = torch.from_numpy(flat if flat.flags.writeable else flat.copy())
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    rows = rows.to(device=aggregation_device(), dtype=dtype)
    bad = np.flatnonzero(~np.isfinite(rows.sum(dim=1, dtype=torch.float64).cpu().numpy()))
    if bad.size:
        raise ValueError(f"{name} contains NaN or infinite values (client row {int(bad[0])})")
    out = torch.as_tensor(mixing, dtype=dtype, device=rows.device) @ rows
    return out.cpu().numpy().reshape(arr.shape).astype(arr.dtype, copy=False)


# ------------------------------------------------------------------------- lambda
def selective_lambda(
    val_loss_own: float, val_loss_propagated: float, eps: float = 1e-8, form: str = "paper"
) -> float:
    """Selective regularisation weight ``lambda_k`` of the FEDORA client update.

    ``diff = L_val(theta_k) - L_val(theta_hat_k)``: the client's own (personalised)
    model's validation loss minus that of the propagated model it received. ``diff > 0``
    means the propagated knowledge generalises better, so the client is pulled towards
    it; otherwise (negative transfer) it trains (almost) purely locally.

    Forms:
        ``"paper"``: ``lambda_k = max(eps, diff)`` (slides/paper, eps = 1e-8).
        ``"code"``: ``0 if diff < 0 else exp(diff / 2)`` (authors' ``main_fedora.py``:
        ``lam = local_loss - global_loss`` with ``local_loss`` the loss of ``w_locals``
        (own model) and ``global_loss`` that of ``w_globals`` (the propagated model),
        both on the validation loader; so diff = 0 gives 1, not 0). ``eps`` is unused.
        Note the code's losses are *sums* of per-batch mean losses over the validation
        loader, so its diff scales with the number of validation batches; pass the
        losses in the scale you want to reproduce.

    Parameters
    ----------
    val_loss_own : validation loss of the client's own model theta_k (finite).
    val_loss_propagated : validation loss of the propagated model theta_hat_k (finite).
    eps : floor of the paper form (finite, >= 0).
    form : "paper" (default) or "code".

    Returns
    -------
    lambda_k as a Python float (>= eps for "paper", >= 0 for "code").
    """
    if form not in LAMBDA_FORMS:
        raise ValueError(f"form must be one of {LAMBDA_FORMS}, got {form!r}")
    own = _check_real(val_loss_own, "val_loss_own")
    prop = _check_real(val_loss_propagated, "val_loss_propagated")
    eps = _check_real(eps, "eps")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    diff = own - prop
    if form == "paper":
        return float(max(eps, diff))
    if diff < 0:
        return 0.0
    try:
        return float(math.exp(diff / 2.0))
    except OverflowError as exc:
        raise ValueError(
            f"exp(diff / 2) overflows for diff = {diff}; are the losses on a sane scale?"
        ) from exc


# ------------------------------------------------------------------------ helpers
def _check_int(value: object, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_real(value: object, name: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a real number, got {value!r}") from exc
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def _check_w(w: np.ndarray, num: int | None = None) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"w must be a square (K, K) matrix, got shape {w.shape}")
    if num is not None and w.shape[0] != num:
        raise ValueError(f"w is {w.shape[0]} x {w.shape[1]} but theta has K = {num} rows")
    if not (np.issubdtype(w.dtype, np.number) or w.dtype == np.bool_) or np.iscomplexobj(w):
        raise ValueError(f"w must be a real matrix, got dtype {w.dtype}")
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)):
        raise ValueError("w contains NaN or infinite values")
    if np.any(w < 0):
        raise ValueError("w must be non-negative")
    return w


def _propagation_system(w: np.ndarray, alpha: float, num: int, isolated: str) -> np.ndarray:
    """The K x K system matrix ``(I - a D^-1 W) / (1 - a)``, so that
    ``Theta_hat = solve(system, Theta)``."""
    alpha_f = _check_real(alpha, "alpha")
    if alpha_f <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha_f}")
    if num < 1:
        raise ValueError("theta has no clients (K = 0)")
    w = _check_w(w, num)
    p = row_normalize(w, isolated=isolated)
    # with a = alpha / (1 + alpha): (I - a P) / (1 - a) = (1 + alpha) I - alpha P
    # (this form avoids dividing by 1 - a ~ 0 for large alpha)
    return (1.0 + alpha_f) * np.eye(num) - alpha_f * p
