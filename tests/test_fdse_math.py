"""Tests of strategies/fdse_math.py against slow, obvious reference computations."""

import itertools
import warnings

import numpy as np
import pytest
import torch

from strategies.fdse_math import (
    attention_mix,
    attention_mix_many,
    consensus_update,
    consensus_update_many,
    duality_gap,
    layer_weights,
    min_norm_weights,
    min_norm_weights_batched,
)

KKT_TOL = 1e-8


def unit_rows(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force_min_norm(directions):
    """Exact QP by enumerating every support S and solving its KKT equality system."""
    gram = directions @ directions.T
    k = gram.shape[0]
    best_w, best_f = None, np.inf
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            s = list(support)
            a = np.zeros((size + 1, size + 1))
            a[:size, :size] = gram[np.ix_(s, s)]
            a[:size, size] = 1.0
            a[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            sol = np.linalg.lstsq(a, rhs, rcond=None)[0][:size]
            if sol.min() < -1e-12 or abs(sol.sum() - 1) > 1e-9:
                continue
            w = np.zeros(k)
            w[s] = np.maximum(sol, 0)
            w /= w.sum()
            f = w @ gram @ w
            if f < best_f - 1e-15:
                best_w, best_f = w, f
    return best_w, best_f


def assert_kkt(gram, w, tol=KKT_TOL):
    assert np.all(w >= 0)
    assert abs(w.sum() - 1) < 1e-12
    gw = gram @ w
    f = w @ gw
    assert np.all(gw >= f - tol), (gw.min(), f)
    assert np.all(np.abs(gw[w > 1e-12] - f) <= tol)


def slow_consensus(updates):
    norms = [np.sqrt(sum(float(x) ** 2 for x in u.ravel())) for u in updates]
    dirs = np.stack([u.ravel() / n for u, n in zip(updates, norms, strict=True)])
    w, _ = brute_force_min_norm(dirs)
    comb = np.zeros(dirs.shape[1])
    for k in range(len(updates)):
        comb += w[k] * dirs[k]
    return (sum(norms) / len(norms)) * comb.reshape(updates[0].shape), w


# ---------------------------------------------------------------- min_norm_weights
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k,d", [(2, 5), (3, 3), (4, 10), (5, 3), (6, 8), (7, 2)])
def test_min_norm_matches_brute_force(seed, k, d):
    rng = np.random.default_rng(seed * 100 + k * 10 + d)
    dirs = unit_rows(rng.normal(size=(k, d)) + rng.normal(size=d) * rng.uniform(0, 2))
    w = min_norm_weights(dirs)
    w_ref, f_ref = brute_force_min_norm(dirs)
    f = w @ dirs @ dirs.T @ w
    assert f == pytest.approx(f_ref, abs=1e-10)
    assert_kkt(dirs @ dirs.T, w)
    assert duality_gap(dirs @ dirs.T, w) <= 1e-10
    if k <= d:  # Gram non-singular -> unique minimiser
        np.testing.assert_allclose(w, w_ref, atol=1e-7)


def test_k2_closed_form_and_nearly_opposite():
    rng = np.random.default_rng(1)
    for _ in range(20):
        dirs = unit_rows(rng.normal(size=(2, 6)))
        w = min_norm_weights(dirs)
        grid = np.linspace(0, 1, 100001)[:, None]
        vals = np.sum((grid * dirs[0] + (1 - grid) * dirs[1]) ** 2, axis=1)
        assert w @ dirs @ dirs.T @ w <= vals.min() + 1e-12
    # nearly opposite directions: min-norm point is (almost) the midpoint, weights ~ 1/2
    d1 = unit_rows(rng.normal(size=(1, 50)))[0]
    d2 = -d1 + 1e-6 * rng.normal(size=50)
    dirs = unit_rows(np.stack([d1, d2]))
    w = min_norm_weights(dirs)
    np.testing.assert_allclose(w, [0.5, 0.5], atol=1e-4)
    assert_kkt(dirs @ dirs.T, w)
    # exactly opposite / identical directions
    np.testing.assert_allclose(min_norm_weights(np.stack([d1, -d1])), [0.5, 0.5])
    w = min_norm_weights(np.stack([d1, d1]))
    assert w.sum() == pytest.approx(1) and np.all(w >= 0)


def test_k1_and_degenerate():
    assert min_norm_weights(np.array([[0.6, 0.8]])).tolist() == [1.0]
    rng = np.random.default_rng(2)
    d = unit_rows(rng.normal(size=(1, 4)))
    dirs = np.repeat(d, 5, axis=0)  # all identical
    w = min_norm_weights(dirs)
    assert w.sum() == pytest.approx(1) and np.all(w >= 0)
    assert_kkt(dirs @ dirs.T, w)


@pytest.mark.parametrize("k,d", [(50, 2000), (200, 30), (300, 500)])
def test_min_norm_scales_and_satisfies_kkt(k, d):
    rng = np.random.default_rng(k + d)
    dirs = unit_rows(rng.normal(size=(k, d)) + 0.3 * rng.normal(size=d))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = min_norm_weights(dirs)
    gram = dirs @ dirs.T
    assert duality_gap(gram, w) <= 1e-10
    assert_kkt(gram, w)


def test_batched_matches_single_and_respects_mask():
    rng = np.random.default_rng(3)
    dirs = [unit_rows(rng.normal(size=(5, 4)) + rng.normal(size=4)) for _ in range(7)]
    grams = np.stack([d @ d.T for d in dirs])
    wb = min_norm_weights_batched(grams)
    for g, d, w in zip(grams, dirs, wb, strict=True):
        assert (w @ g @ w) == pytest.approx(
            min_norm_weights(d) @ g @ min_norm_weights(d), abs=1e-10
        )
        assert_kkt(g, w)
    mask = np.ones((7, 5), dtype=bool)
    mask[:, 0] = False
    wm = min_norm_weights_batched(grams, mask=mask)
    assert np.all(wm[:, 0] == 0)
    for g, d, w in zip(grams, dirs, wm, strict=True):
        _, f_ref = brute_force_min_norm(d[1:])
        assert w @ g @ w == pytest.approx(f_ref, abs=1e-10)


def test_min_norm_validation():
    with pytest.raises(ValueError):
        min_norm_weights(np.ones(3))
    with pytest.raises(ValueError):
        min_norm_weights(np.array([[np.nan, 1.0], [0.0, 1.0]]))
    with pytest.raises(ValueError):
        min_norm_weights(np.zeros((0, 3)))
    with pytest.raises(ValueError):
        min_norm_weights_batched(np.ones((2, 3, 4)))
    with pytest.raises(ValueError):
        min_norm_weights_batched(np.array([[[1.0, 0.5], [0.0, 1.0]]]))  # not symmetric
    with pytest.raises(ValueError):
        min_norm_weights_batched(np.eye(3)[None], mask=np.zeros((1, 3), dtype=bool))


# --------------------------------------------------------------- consensus_update
@pytest.mark.parametrize("k", [2, 3, 5])
def test_consensus_update_matches_slow(k):
    rng = np.random.default_rng(k)
    updates = [rng.normal(size=(3, 4)) * rng.uniform(0.1, 5) + 0.5 for _ in range(k)]
    got, w = consensus_update(updates, return_weights=True)
    ref, w_ref = slow_consensus(updates)
    np.testing.assert_allclose(got, ref, atol=1e-8)
    assert got.shape == (3, 4) and got.dtype == np.float64
    # MGDA property (paper, below Eq. 8): no client's update is opposed
    for u in updates:
        assert float(np.sum(got * u)) >= -1e-10


def test_consensus_nearly_opposite_updates():
    rng = np.random.default_rng(7)
    u1 = rng.normal(size=20)
    u2 = -2.0 * u1 + 1e-4 * rng.normal(size=20)
    got = consensus_update([u1, u2])
    ref, _ = slow_consensus([u1, u2])
    np.testing.assert_allclose(got, ref, atol=1e-9)
    assert np.linalg.norm(got) < 1e-3 * np.linalg.norm(u1)
    assert np.all(np.isfinite(got))


def test_consensus_zero_updates_no_nan():
    rng = np.random.default_rng(8)
    u1, u2 = rng.normal(size=5), rng.normal(size=5)
    zero = np.zeros(5)
    got = consensus_update([u1, zero, u2])
    ref, _ = slow_consensus([u1, u2])
    # zero update excluded from the QP but its norm 0 counts in the mean norm
    np.testing.assert_allclose(got, ref * (2 / 3), atol=1e-9)
    got_inc = consensus_update([u1, zero, u2], zero_policy="include")
    np.testing.assert_allclose(got_inc, 0.0, atol=1e-12)
    np.testing.assert_array_equal(consensus_update([zero, zero]), zero)
    np.testing.assert_array_equal(consensus_update_many([{"a": zero}, {"a": zero}])["a"], zero)


def test_consensus_update_many_matches_per_tensor_and_accepts_torch():
    rng = np.random.default_rng(9)
    clients = [
        {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=4), "s": rng.normal(size=(1,))}
        for _ in range(4)
    ]
    out, weights = consensus_update_many(clients, return_weights=True)
    for key in ("w", "b", "s"):
        ref, _ = slow_consensus([c[key] for c in clients])
        np.testing.assert_allclose(out[key], ref, atol=1e-8)
        assert weights[key].shape == (4,)
    torch_clients = [
        {k: torch.tensor(v, dtype=torch.float32) for k, v in c.items()} for c in clients
    ]
    out_t = consensus_update_many(torch_clients)
    for key in out:
        np.testing.assert_allclose(out_t[key], out[key], atol=1e-5)
    with pytest.raises(ValueError):
        consensus_update_many([{"w": np.ones(3)}, {"w": np.ones(4)}])
    with pytest.raises(ValueError):
        consensus_update_many([{"w": np.ones(3)}, {"v": np.ones(3)}])
    with pytest.raises(ValueError):
        consensus_update([np.ones(3), np.array([1.0, np.nan, 0.0])])
    with pytest.raises(ValueError):
        consensus_update([])


# ------------------------------------------------------------------ attention_mix
def slow_attention(params, tau):
    k = params.shape[0]
    out = np.zeros_like(params)
    for i in range(k):
        logits = []
        for j in range(k):
            ni, nj = np.linalg.norm(params[i]), np.linalg.norm(params[j])
            cos = 0.0 if ni == 0 or nj == 0 else float(params[i] @ params[j]) / (ni * nj)
            logits.append(cos / tau)
        e = [np.exp(v) for v in logits]
        for j in range(k):
            out[i] += e[j] / sum(e) * params[j]
    return out


@pytest.mark.parametrize("k,tau", [(1, 0.5), (2, 0.5), (5, 0.1), (8, 0.01), (4, 10.0)])
def test_attention_mix_matches_slow(k, tau):
    rng = np.random.default_rng(k)
    p = rng.normal(size=(k, 7))
    np.testing.assert_allclose(attention_mix(p, tau), slow_attention(p, tau), atol=1e-12)


def test_attention_mix_zero_rows_and_limits():
    rng = np.random.default_rng(11)
    p = rng.normal(size=(4, 3))
    p[2] = 0.0
    got = attention_mix(p, 0.5)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, slow_attention(p, 0.5), atol=1e-12)
    # large tau -> plain average; tiny tau with distinct directions -> (near) identity
    np.testing.assert_allclose(attention_mix(p, 1e9), np.tile(p.mean(0), (4, 1)), atol=1e-6)
    q = np.eye(3)
    np.testing.assert_allclose(attention_mix(q, 1e-3), q, atol=1e-12)
    with pytest.raises(ValueError):
        attention_mix(p, 0.0)
    with pytest.raises(ValueError):
        attention_mix(np.ones(3), 0.5)
    with pytest.raises(ValueError):
        attention_mix(np.array([[np.inf, 1.0]]), 0.5)


def test_attention_mix_many():
    rng = np.random.default_rng(12)
    clients = [
        {"w": rng.normal(size=(2, 3)), "n": np.array(5 + i, dtype=np.int64)} for i in range(3)
    ]
    out = attention_mix_many(clients, 0.5)
    ref = slow_attention(np.stack([c["w"].ravel() for c in clients]), 0.5)
    for i, o in enumerate(out):
        np.testing.assert_allclose(o["w"], ref[i].reshape(2, 3), atol=1e-12)
        assert int(o["n"]) == 5 + i  # integer tensors are not mixed
    tclients = [{"w": torch.tensor(c["w"])} for c in clients]
    np.testing.assert_allclose(attention_mix_many(tclients, 0.5)[1]["w"], out[1]["w"], atol=1e-12)
    with pytest.raises(ValueError):
        attention_mix_many([{"w": np.ones(2)}, {"w": np.ones(3)}], 0.5)


# ------------------------------------------------------------------ layer_weights
def test_layer_weights():
    for L, beta in [(1, 0.3), (7, 0.001), (7, 0.05), (4, -2.0), (5, 0.0)]:
        w = layer_weights(L, beta)
        ref = np.array([np.exp(beta * j) for j in range(1, L + 1)])
        np.testing.assert_allclose(w, ref / ref.sum(), rtol=1e-12)
        # authors' code indexes l = 0..L-1: identical after normalisation
        ref0 = np.array([np.exp(beta * j) for j in range(L)])
        np.testing.assert_allclose(w, ref0 / ref0.sum(), rtol=1e-12)
    assert np.all(np.diff(layer_weights(5, 0.5)) > 0)
    with pytest.raises(ValueError):
        layer_weights(0, 0.1)
    with pytest.raises(ValueError):
        layer_weights(3, float("nan"))


@pytest.mark.parametrize("k", [3, 5, 8])
def test_support_enumeration_matches_iterative_solver(k):
    """The exact small-K path (support enumeration) and the iterative path agree."""
    rng = np.random.default_rng(k)
    dirs = [unit_rows(rng.normal(size=(k, 6)) + 0.5 * rng.normal(size=6)) for _ in range(4)]
    grams = np.stack([d @ d.T for d in dirs])
    exact = min_norm_weights_batched(grams)
    iterative = min_norm_weights_batched(grams, exact_max_k=0)
    for g, we, wi, d in zip(grams, exact, iterative, dirs, strict=True):
        assert_kkt(g, we)
        assert we @ g @ we == pytest.approx(wi @ g @ wi, abs=1e-10)
        assert we @ g @ we == pytest.approx(brute_force_min_norm(d)[1], abs=1e-10)


def test_float32_gram_rounding_asymmetry_is_not_a_bad_input() -> None:
    """X X^T in float32 is one matrix product whose blocks round differently: for K = 10
    random updates of d = 1M its two triangles differ by ~2e-8 while the cosines themselves
    are ~1e-3, so the symmetry check refused it ("Gram matrices must be symmetric", found by
    bench (b)). The Gram matrix is symmetrised; the weights are those of the float64 Gram up to
    the float32 products' rounding (~3e-4 here: the cosines are ~1e-3 and carry ~1e-5 error)."""
    rng = np.random.default_rng(0)
    updates = [{"w": rng.standard_normal(1_000_000).astype(np.float32)} for _ in range(10)]
    _, weights = consensus_update_many(updates, tol=1e-12, return_weights=True)
    unit = np.stack([u["w"].astype(np.float64) / np.linalg.norm(u["w"].astype(np.float64)) for u in updates])
    assert abs(weights["w"].sum() - 1.0) < 1e-9 and (weights["w"] >= 0).all()
    np.testing.assert_allclose(weights["w"], min_norm_weights(unit @ unit.T, tol=1e-12), atol=1e-3)
