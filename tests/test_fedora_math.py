"""Tests for strategies/fedora_math.py (FEDORA math, pure numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies.fedora_math import (
    CODE_TOP_K,
    data_subspace_basis,
    propagate,
    propagate_clients,
    propagate_many,
    row_normalize,
    selective_lambda,
    subspace_similarity,
)

try:  # independent reference for principal angles, if scipy is installed
    from scipy.linalg import subspace_angles as _scipy_subspace_angles
except ImportError:  # pragma: no cover - depends on the environment
    _scipy_subspace_angles = None


# ----------------------------------------------------------------- reference code
def iterative_propagation(theta, w, alpha, tol=1e-13, max_iter=100_000):
    """The paper's iteration, written as an obvious slow loop:
    theta_hat_k <- alpha / ((1 + alpha) D_kk) sum_k' w_kk' theta_hat_k' + theta_k / (1 + alpha).
    """
    num, dim = theta.shape
    a = alpha / (1.0 + alpha)
    deg = [sum(w[k][j] for j in range(num)) for k in range(num)]
    cur = theta.copy()
    for _ in range(max_iter):
        nxt = np.empty_like(cur)
        for k in range(num):
            acc = np.zeros(dim)
            for j in range(num):
                acc += w[k][j] * cur[j]
            nxt[k] = a * acc / deg[k] + (1.0 - a) * theta[k]
        if np.max(np.abs(nxt - cur)) < tol:
            return nxt
        cur = nxt
    raise AssertionError("iteration did not converge")


def _orth(rng, d, p):
    q, _ = np.linalg.qr(rng.standard_normal((d, p)))
    return q


def reference_cosines(u, v):
    """Cosines of the principal angles between span(u) and span(v), independently."""
    if _scipy_subspace_angles is not None:
        return np.sort(np.cos(_scipy_subspace_angles(u, v)))[::-1]
    # fallback: QR of both, singular values of Q_u^T Q_v, arccos in a loop, cos back
    qu, _ = np.linalg.qr(u)
    qv, _ = np.linalg.qr(v)
    sv = np.linalg.svd(qu.T @ qv, compute_uv=False)
    angles = [math.acos(min(1.0, max(-1.0, float(x)))) for x in sv]
    return np.array([math.cos(t) for t in angles])


def reference_similarity(bases, form, top_k, temperature=10.0):
    num = len(bases)
    s = np.zeros((num, num))
    for i in range(num):
        for j in range(num):
            if i != j:
                s[i, j] = reference_cosines(bases[i], bases[j]).sum()
    w = s if form == "paper" else np.exp(temperature * s)
    np.fill_diagonal(w, 0.0)
    if top_k is not None:
        out = np.zeros_like(w)
        for i in range(num):
            ranked = sorted((j for j in range(num) if j != i), key=lambda j: (-w[i, j], j))
            for j in ranked[:top_k]:
                out[i, j] = w[i, j]
        w = out
    return w


# ---------------------------------------------------------------------- propagate
@pytest.mark.parametrize(
    "num, dim, alpha, sparse",
    [(2, 5, 1.0, False), (2, 3, 4.0, False), (5, 7, 0.3, True), (36, 20, 4.0, False),
     (36, 10, 1.5, True)],
)
def test_propagate_matches_iteration(num, dim, alpha, sparse):
    rng = np.random.default_rng(num * 100 + dim)
    theta = rng.standard_normal((num, dim))
    w = rng.uniform(0.1, 2.0, size=(num, num))  # asymmetric on purpose
    np.fill_diagonal(w, 0.0)
    if sparse:  # top-2 style graph: every row keeps 2 neighbours
        keep = np.zeros_like(w, dtype=bool)
        for i in range(num):
            others = [j for j in range(num) if j != i]
            keep[i, rng.choice(others, size=min(2, num - 1), replace=False)] = True
        w = np.where(keep, w, 0.0)
    got = propagate(theta, w, alpha)
    want = iterative_propagation(theta, w, alpha)
    assert got.shape == theta.shape
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)


def test_propagate_closed_form_and_properties():
    rng = np.random.default_rng(0)
    num, alpha = 6, 2.0
    theta = rng.standard_normal((num, 4))
    w = rng.uniform(0, 1, (num, num))
    np.fill_diagonal(w, 0)
    a = alpha / (1 + alpha)
    p = w / w.sum(axis=1, keepdims=True)
    want = (1 - a) * np.linalg.inv(np.eye(num) - a * p) @ theta  # test-only inverse
    np.testing.assert_allclose(propagate(theta, w, alpha), want, atol=1e-12)
    # identical clients stay identical (P row-stochastic => constants are fixed points)
    same = np.tile(rng.standard_normal(4), (num, 1))
    np.testing.assert_allclose(propagate(same, w, alpha), same, atol=1e-12)
    # the result is invariant to a global rescaling of W
    np.testing.assert_allclose(propagate(theta, 7.5 * w, alpha), want, atol=1e-12)
    # small alpha -> own parameters; large alpha -> (stationary) consensus
    np.testing.assert_allclose(propagate(theta, w, 1e-9), theta, atol=1e-7)
    big = propagate(theta, w, 1e7)
    np.testing.assert_allclose(big, np.tile(big[0], (num, 1)), atol=1e-5)
    # float32 in -> float32 out
    assert propagate(theta.astype(np.float32), w, alpha).dtype == np.float32


def test_propagate_many_matches_per_tensor():
    rng = np.random.default_rng(1)
    num = 36
    w = subspace_similarity([_orth(rng, 12, 1) for _ in range(num)], form="code")
    thetas = {
        "conv.weight": rng.standard_normal((num, 3, 2, 2, 2)),
        "fc.bias": rng.standard_normal((num, 5)).astype(np.float32),
        "scalar": rng.standard_normal((num,)),
    }
    out = propagate_many(thetas, w, 4.0)
    assert list(out) == list(thetas)
    for name, arr in thetas.items():
        assert out[name].shape == arr.shape and out[name].dtype == arr.dtype
        flat = arr.reshape(num, -1).astype(np.float64)
        want = iterative_propagation(flat, w, 4.0).reshape(arr.shape)
        tol = 1e-5 if arr.dtype == np.float32 else 1e-9
        np.testing.assert_allclose(out[name], want, rtol=tol, atol=tol)


def test_propagate_clients_tensor_by_tensor_equals_the_iteration_per_client():
    """The strategy's path: K client dicts in, K propagated dicts out (no all-tensor stack)."""
    rng = np.random.default_rng(2)
    num = 7
    w = subspace_similarity([_orth(rng, 12, 1) for _ in range(num)], form="code")
    models = [{"conv.weight": rng.standard_normal((3, 2, 2)).astype(np.float32),
               "fc.bias": rng.standard_normal(5)} for _ in range(num)]
    out = propagate_clients(models, ["conv.weight", "fc.bias"], w, 4.0)
    assert len(out) == num
    for key in ("conv.weight", "fc.bias"):
        flat = np.stack([m[key].reshape(-1).astype(np.float64) for m in models])
        want = iterative_propagation(flat, w, 4.0)
        tol = 1e-5 if key == "conv.weight" else 1e-9
        for k in range(num):
            assert out[k][key].shape == models[k][key].shape and out[k][key].dtype == models[k][key].dtype
            np.testing.assert_allclose(out[k][key].reshape(-1), want[k], rtol=tol, atol=tol)
    bad = [dict(m) for m in models]
    bad[3]["fc.bias"] = np.full(5, np.nan)
    with pytest.raises(ValueError, match=r"fc.bias.*client row 3"):
        propagate_clients(bad, ["fc.bias"], w, 4.0)
    with pytest.raises(ValueError, match="non-floating"):
        propagate_clients([{"n": np.ones(2, np.int64)} for _ in range(num)], ["n"], w, 4.0)


def test_isolated_rows():
    theta = np.arange(6.0).reshape(3, 2)
    w = np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=float)
    with pytest.raises(ValueError, match="zero sum"):
        propagate(theta, w, 1.0)
    out = propagate(theta, w, 1.0, isolated="keep")
    np.testing.assert_allclose(out[2], theta[2])  # isolated client keeps its own
    np.testing.assert_allclose(out[:2], propagate(theta[:2], w[:2, :2], 1.0))
    np.testing.assert_allclose(row_normalize(w, isolated="keep").sum(axis=1), 1.0)


@pytest.mark.parametrize(
    "theta, w, alpha, match",
    [
        (np.ones(3), np.ones((3, 3)), 1.0, "2-D"),
        (np.ones((3, 2)), np.ones((3, 2)), 1.0, "square"),
        (np.ones((3, 2)), np.ones((2, 2)), 1.0, "K = 3"),
        (np.ones((3, 2)), -np.ones((3, 3)), 1.0, "non-negative"),
        (np.ones((3, 2)), np.full((3, 3), np.nan), 1.0, "NaN"),
        (np.ones((3, 2)), np.ones((3, 3)), 0.0, "alpha"),
        (np.ones((3, 2)), np.ones((3, 3)), -1.0, "alpha"),
        (np.ones((3, 2)), np.ones((3, 3)), float("inf"), "alpha"),
        (np.full((3, 2), np.inf), np.ones((3, 3)), 1.0, "theta"),
    ],
)
def test_propagate_bad_inputs(theta, w, alpha, match):
    with pytest.raises(ValueError, match=match):
        propagate(theta, w, alpha)


def test_propagate_many_bad_inputs():
    w = np.ones((2, 2)) - np.eye(2)
    with pytest.raises(ValueError, match="non-empty"):
        propagate_many({}, w, 1.0)
    with pytest.raises(ValueError, match="same number of clients"):
        propagate_many({"a": np.ones((2, 3)), "b": np.ones((3, 3))}, w, 1.0)
    with pytest.raises(ValueError, match="num_batches_tracked"):
        propagate_many({"n": np.ones((2,), dtype=np.int64)}, w, 1.0)


# ------------------------------------------------------------------------- basis
def test_basis_orthonormal_and_spans_top_directions():
    rng = np.random.default_rng(2)
    n, f, p = 400, 30, 3
    true = _orth(rng, f, p)
    scales = np.array([10.0, 6.0, 4.0])
    x = (rng.standard_normal((n, p)) * scales) @ true.T + 0.01 * rng.standard_normal((n, f))
    u = data_subspace_basis(x.reshape(n, 5, 6), rank=p)  # any trailing shape is flattened
    assert u.shape == (f, p)
    np.testing.assert_allclose(u.T @ u, np.eye(p), atol=1e-12)
    np.testing.assert_allclose(reference_cosines(u, true), 1.0, atol=1e-4)
    # rank 1 = the single dominant direction (right singular vector of X)
    u1 = data_subspace_basis(x, rank=1)
    v = np.linalg.svd(x, full_matrices=False)[2][0]
    assert abs(float(u1[:, 0] @ v)) == pytest.approx(1.0, abs=1e-10)
    # projection onto the basis keeps most of the energy, the rest is noise
    assert np.linalg.norm(x @ u) ** 2 / np.linalg.norm(x) ** 2 > 0.999
    # deterministic sign
    np.testing.assert_array_equal(u, data_subspace_basis(x, rank=p))


def test_basis_with_labels_appends_one_hot():
    rng = np.random.default_rng(3)
    n, f, c = 50, 8, 4
    x = rng.standard_normal((n, f))
    y = rng.integers(0, c, n)
    u = data_subspace_basis(x, rank=2, labels=y, num_classes=c)
    assert u.shape == (f + c, 2)
    np.testing.assert_allclose(u.T @ u, np.eye(2), atol=1e-12)
    onehot = np.eye(c)[y]
    v = np.linalg.svd(np.hstack([x, onehot]), full_matrices=False)[2][:2].T
    np.testing.assert_allclose(reference_cosines(u, v), 1.0, atol=1e-10)
    # with zero inputs only the label block carries data: all mass in the last c rows
    u0 = data_subspace_basis(np.zeros((n, f)), rank=1, labels=y, num_classes=c)
    np.testing.assert_allclose(u0[:f], 0.0, atol=1e-12)


@pytest.mark.parametrize(
    "x, rank, kwargs, match",
    [
        (np.ones(5), 1, {}, "at least 2 dimensions"),
        (np.ones((0, 3)), 1, {}, "no samples"),
        (np.ones((4, 3)), 4, {}, "exceeds min"),
        (np.ones((2, 9)), 3, {}, "exceeds min"),
        (np.ones((4, 3)), 0, {}, "rank must be >= 1"),
        (np.ones((4, 3)), 1.5, {}, "rank must be an integer"),
        (np.ones((4, 3)), 2, {}, "numerical rank"),
        (np.full((4, 3), np.nan), 1, {}, "NaN"),
        (np.ones((4, 3)), 1, {"labels": np.zeros(4, dtype=int)}, "num_classes is required"),
        (np.ones((4, 3)), 1, {"labels": np.zeros(3, dtype=int), "num_classes": 2}, "shape"),
        (np.ones((4, 3)), 1, {"labels": np.array([0, 1, 2, 3]), "num_classes": 3}, "lie in"),
        (np.ones((4, 3)), 1, {"labels": np.array([0, 1, -1, 0]), "num_classes": 3}, "lie in"),
        (np.ones((4, 3)), 1, {"labels": np.array([0.5, 1, 1, 0]), "num_classes": 3}, "integers"),
        (np.ones((4, 3)), 1, {"num_classes": 3}, "without labels"),
    ],
)
def test_basis_bad_inputs(x, rank, kwargs, match):
    with pytest.raises(ValueError, match=match):
        data_subspace_basis(x, rank, **kwargs)


# -------------------------------------------------------------------- similarity
@pytest.mark.parametrize("num, d, p", [(2, 6, 1), (5, 10, 3), (12, 20, 2)])
def test_similarity_paper_matches_principal_angles(num, d, p):
    rng = np.random.default_rng(num + d + p)
    bases = [_orth(rng, d, p) for _ in range(num)]
    w = subspace_similarity(bases)
    np.testing.assert_allclose(w, reference_similarity(bases, "paper", None), atol=1e-10)
    np.testing.assert_allclose(w, w.T)
    assert np.all(np.diag(w) == 0) and np.all(w >= 0) and np.all(w <= p + 1e-12)
    w_self = subspace_similarity(bases, self_loops=True)
    np.testing.assert_allclose(np.diag(w_self), p)
    # the sum of cosines is basis-invariant: rotate each basis within its span
    rotated = [b @ _orth(rng, p, p) for b in bases]
    np.testing.assert_allclose(subspace_similarity(rotated), w, atol=1e-10)


def test_similarity_identical_and_orthogonal():
    e = np.eye(6)
    bases = [e[:, :2], e[:, :2], e[:, 2:4], e[:, [0, 4]]]
    w = subspace_similarity(bases)
    assert w[0, 1] == pytest.approx(2.0)
    assert w[0, 2] == pytest.approx(0.0)
    assert w[0, 3] == pytest.approx(1.0)


@pytest.mark.parametrize("num, top_k", [(2, None), (6, None), (6, 1), (6, 3), (10, 5)])
def test_similarity_code_form(num, top_k):
    rng = np.random.default_rng(10 + num)
    bases = [_orth(rng, 15, 1) for _ in range(num)]
    w = subspace_similarity(bases, form="code", top_k=top_k)
    k_eff = CODE_TOP_K if top_k is None else top_k
    want = reference_similarity(bases, "code", min(k_eff, num - 1), temperature=10.0)
    np.testing.assert_allclose(w, want, rtol=1e-10)
    assert np.all(np.diag(w) == 0)
    assert np.all((w > 0).sum(axis=1) == min(k_eff, num - 1))
    assert np.all(w[w > 0] >= 1.0)  # exp(10 * s) >= 1
    # temperature is applied
    w2 = subspace_similarity(bases, form="code", top_k=num, temperature=2.0)
    np.testing.assert_allclose(w2, reference_similarity(bases, "code", None, 2.0), rtol=1e-10)


def test_similarity_paper_top_k_and_ties():
    e = np.eye(4)
    bases = [e[:, :1], e[:, :1], e[:, :1], e[:, 1:2]]
    w = subspace_similarity(bases, top_k=1)
    # row 0: clients 1 and 2 tie at 1.0 -> lower index kept
    np.testing.assert_allclose(w[0], [0, 1, 0, 0])
    np.testing.assert_allclose(w[2], [1, 0, 0, 0])


@pytest.mark.parametrize(
    "bases, kwargs, match",
    [
        ([], {}, "non-empty"),
        ([np.eye(3)[:, :1]], {"form": "bogus"}, "form"),
        ([np.ones((3, 1))], {}, "orthonormal"),
        ([np.eye(3)[:, :1], np.eye(4)[:, :1]], {}, "same number of rows"),
        ([np.ones(3)], {}, "shape"),
        ([np.eye(3)[:, :1], np.eye(3)[:, 1:2]], {"top_k": 0}, "top_k"),
        ([np.eye(3)[:, :1], np.eye(3)[:, 1:2]], {"form": "code", "temperature": 0}, "temperature"),
        ([np.eye(80)] * 2, {"form": "code"}, "overflows"),
    ],
)
def test_similarity_bad_inputs(bases, kwargs, match):
    with pytest.raises(ValueError, match=match):
        subspace_similarity(bases, **kwargs)


def test_end_to_end_pipeline():
    """Basis -> similarity -> propagation: clients of the same domain pull together."""
    rng = np.random.default_rng(4)
    domains = [_orth(rng, 20, 1)[:, 0] for _ in range(2)]
    bases = []
    for k in range(6):
        dom = domains[k % 2]
        x = rng.standard_normal((100, 1)) * 5 * dom + 0.1 * rng.standard_normal((100, 20))
        bases.append(data_subspace_basis(x, rank=1, labels=rng.integers(0, 3, 100),
                                         num_classes=3))
    w = subspace_similarity(bases, form="code")
    for i in range(6):  # top-2 neighbours are the two other clients of the same domain
        assert set(np.flatnonzero(w[i])) == {j for j in range(6) if j % 2 == i % 2 and j != i}
    theta = np.array([[float(k % 2)] for k in range(6)]) + 0.01 * rng.standard_normal((6, 1))
    out = propagate(theta, w, 4.0)
    assert np.all(np.abs(out - np.round(theta)) < 0.05)


# ------------------------------------------------------------------------ lambda
def test_selective_lambda_paper():
    assert selective_lambda(1.0, 0.4, eps=1e-8) == pytest.approx(0.6)  # propagated better
    assert selective_lambda(0.4, 1.0, eps=1e-8) == 1e-8  # negative transfer -> eps
    assert selective_lambda(0.5, 0.5, eps=1e-3) == 1e-3
    assert isinstance(selective_lambda(1.0, 0.4, 1e-8), float)


def test_selective_lambda_code():
    assert selective_lambda(1.0, 0.4, 1e-8, form="code") == pytest.approx(math.exp(0.3))
    assert selective_lambda(0.4, 1.0, 1e-8, form="code") == 0.0
    assert selective_lambda(0.5, 0.5, 1e-8, form="code") == 1.0  # diff = 0 -> exp(0)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((float("nan"), 1.0, 1e-8), {}, "val_loss_own"),
        ((1.0, float("inf"), 1e-8), {}, "val_loss_propagated"),
        ((1.0, 1.0, -1.0), {}, "eps"),
        ((1.0, 1.0, 1e-8), {"form": "bogus"}, "form"),
        (("a", 1.0, 1e-8), {}, "real number"),
        ((5000.0, 0.0, 1e-8), {"form": "code"}, "overflows"),
    ],
)
def test_selective_lambda_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        selective_lambda(*args, **kwargs)
