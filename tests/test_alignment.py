"""Tests for hfl_components.alignment (FedSAF, ../shared/papers/000_b46201db80f6d43c.txt, Sec. III).

Expected values are derived independently (NumPy/SciPy re-implementations, hand-computed means, the paper's
propositions) rather than by calling the code under test twice.
"""
import math
import warnings

import numpy as np
import pytest
import torch
from scipy.linalg import orthogonal_procrustes
from scipy.spatial.distance import pdist

from hfl_components.alignment import (
    FedSAFAuxLoss,
    aggregate_fedproto,
    batch_prototypes,
    coordinate_decomposition,
    coordinate_loss,
    effective_rank,
    fixed_hypersphere_prototypes,
    local_prototypes,
    structural_loss,
    train_tgp_prototypes,
    validate_prototype_upload,
)

torch.set_num_threads(1)


def _orth(d, rng):
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def _np_gcsa(P, Q):
    n = P.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    KP, KQ = H @ P @ P.T @ H, H @ Q @ Q.T @ H
    return 1 - (KP * KQ).sum() / (np.linalg.norm(KP) * np.linalg.norm(KQ))


def _np_rcsa(P, Q):
    a = pdist(P / np.linalg.norm(P, axis=1, keepdims=True), "sqeuclidean")
    b = pdist(Q / np.linalg.norm(Q, axis=1, keepdims=True), "sqeuclidean")
    return 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


T = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731


# ---------------------------------------------------------------- structural losses: propositions and values
@pytest.mark.parametrize("seed", range(5))
def test_prop2_gcsa_invariant_to_similarity_and_translation(seed):
    rng = np.random.default_rng(seed)
    n, d = 6, 5
    P = rng.standard_normal((n, d))
    alpha = rng.uniform(0.2, 5.0)
    R = _orth(d, rng)
    b = rng.standard_normal(d) * 3
    Q = alpha * P @ R + b[None, :]
    assert abs(float(structural_loss(T(P), T(Q), "gcsa"))) < 1e-10
    # coordinate losses see the transformation
    assert float(structural_loss(T(P), T(Q), "mse")) > 1.0
    assert float(structural_loss(T(P), T(Q), "cosine")) > 0.1


def test_gcsa_allows_different_feature_dims():
    rng = np.random.default_rng(1)
    P = rng.standard_normal((5, 4))
    U = np.linalg.qr(rng.standard_normal((7, 4)))[0].T  # (4, 7) orthonormal rows: isometric embedding into 7-d
    Q = 2.0 * P @ U + 1.0
    assert abs(float(structural_loss(T(P), T(Q), "gcsa"))) < 1e-10
    assert abs(float(structural_loss(T(P), T(Q), "rcsa")) - _np_rcsa(P, Q)) < 1e-10
    with pytest.raises(ValueError):
        structural_loss(T(P), T(Q), "mse")


@pytest.mark.parametrize("seed", range(5))
def test_prop3_rcsa_invariant_to_rotation(seed):
    rng = np.random.default_rng(100 + seed)
    P = rng.standard_normal((7, 6))
    Q = P @ _orth(6, rng)
    assert abs(float(structural_loss(T(P), T(Q), "rcsa"))) < 1e-10
    assert float(structural_loss(T(P), T(Q), "mse")) > 1.0
    assert float(structural_loss(T(P), T(Q), "cosine")) > 0.1


def test_rcsa_penalises_translation_but_gcsa_does_not():  # Remark 1
    rng = np.random.default_rng(3)
    P = rng.standard_normal((6, 4))
    Q = P + 5.0 * rng.standard_normal(4)[None, :]
    assert float(structural_loss(T(P), T(Q), "rcsa")) > 1e-3
    assert abs(float(structural_loss(T(P), T(Q), "gcsa"))) < 1e-10


def test_structural_values_match_numpy_reference():
    rng = np.random.default_rng(4)
    P, Q = rng.standard_normal((8, 5)), rng.standard_normal((8, 3))
    assert float(structural_loss(T(P), T(Q), "gcsa")) == pytest.approx(_np_gcsa(P, Q), abs=1e-10)
    assert float(structural_loss(T(P), T(Q), "rcsa")) == pytest.approx(_np_rcsa(P, Q), abs=1e-10)
    assert 0.05 < _np_gcsa(P, Q) <= 2


def test_coordinate_losses_hand_values():
    z = T([[1.0, 0.0], [0.0, 2.0]])
    t = T([[0.0, 0.0], [0.0, -2.0]])
    # Eq. 6: squared L2 summed over features, averaged over rows: (1 + 16) / 2
    assert float(coordinate_loss(z, t, "mse")) == pytest.approx(8.5)
    assert float(structural_loss(z, t, "mse")) == pytest.approx(8.5)
    # cosine: row 1 has a zero target -> cos 0 -> 1; row 2 opposite -> 2; mean 1.5
    assert float(coordinate_loss(z, t, "cosine")) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        structural_loss(z, t, "l1")


@pytest.mark.parametrize("kind", ["gcsa", "rcsa", "mse", "cosine"])
def test_degenerate_levels_are_zero_not_nan(kind):
    structural = kind in ("gcsa", "rcsa")
    one = structural_loss(T([[1.0, 2.0]]), T([[3.0, 2.0]]), kind)
    # one row: structural kinds contribute 0; coordinate kinds are defined (||(-2, 0)||^2 = 4; 1 - cos)
    expected = 0.0 if structural else (4.0 if kind == "mse" else 1 - 7 / math.sqrt(5 * 13))
    assert float(one) == pytest.approx(expected)
    assert float(structural_loss(torch.zeros(0, 4), torch.zeros(0, 4), kind)) == 0.0
    # identical target rows (single-class instance level): structural cosine undefined -> 0, never NaN
    torch.manual_seed(0)
    z = torch.randn(5, 4, requires_grad=True)
    same = torch.ones(5, 4) * torch.randn(4)
    val = structural_loss(z, same, kind)
    assert torch.isfinite(val)
    val.backward()
    assert torch.isfinite(z.grad).all()
    if structural:
        assert float(val.detach()) == 0.0
    # two rows: GCSA and RCSA are constant (PITFALLS: C = 2)
    if structural:
        assert abs(float(structural_loss(torch.randn(2, 4), torch.randn(2, 4), kind))) < 1e-6


# ---------------------------------------------------------------- Proposition 1
@pytest.mark.parametrize("seed", range(4))
def test_prop1_decomposition_adds_up(seed):
    rng = np.random.default_rng(200 + seed)
    Z, P = rng.standard_normal((9, 4)), rng.standard_normal((9, 4))
    l_coord, l_shape, l_rigid = (float(v) for v in coordinate_decomposition(T(Z), T(P)))
    Zh = Z / np.linalg.norm(Z, axis=1, keepdims=True)
    Ph = P / np.linalg.norm(P, axis=1, keepdims=True)
    assert l_coord == pytest.approx(((Zh - Ph) ** 2).sum(), abs=1e-10)
    R, _ = orthogonal_procrustes(Ph, Zh)  # independent Procrustes solver
    assert l_shape == pytest.approx(((Zh - Ph @ R) ** 2).sum(), abs=1e-9)
    assert l_shape + l_rigid == pytest.approx(l_coord, abs=1e-10)
    assert l_rigid >= -1e-12
    assert l_shape <= l_coord + 1e-12


def test_prop1_pure_rotation_is_all_rigid():
    rng = np.random.default_rng(7)
    P = rng.standard_normal((6, 5))
    Z = P @ _orth(5, rng)
    l_coord, l_shape, l_rigid = (float(v) for v in coordinate_decomposition(T(Z), T(P)))
    assert l_shape == pytest.approx(0.0, abs=1e-10)
    assert l_rigid == pytest.approx(l_coord, abs=1e-10)
    assert l_coord > 0.5
    zero = coordinate_decomposition(T(P), T(P))
    assert all(abs(float(v)) < 1e-10 for v in zero)


# ---------------------------------------------------------------- batch prototypes and the aux loss
def test_batch_prototypes_hand_values_and_gradient():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 0, 2])
    P, n = batch_prototypes(z, y, 4)
    assert torch.allclose(P, torch.tensor([[2.0, 3.0], [0, 0], [10.0, 0.0], [0, 0]]))
    assert n.tolist() == [2, 0, 1, 0]
    P.sum().backward()
    assert torch.allclose(z.grad, torch.tensor([[0.5, 0.5], [0.5, 0.5], [1.0, 1.0]]))
    with pytest.raises(ValueError):
        batch_prototypes(z, torch.tensor([0, 5, 1]), 4)


def test_aux_loss_round0_is_zero():
    z = torch.randn(6, 3, requires_grad=True)
    out = FedSAFAuxLoss(None, "gcsa")(z, torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2]))
    assert float(out.detach()) == 0.0
    out.backward()  # attached to the graph


@pytest.mark.parametrize("kind", ["gcsa", "rcsa", "mse", "cosine"])
def test_aux_loss_equals_two_level_definition(kind):
    rng = np.random.default_rng(11)
    C, d = 4, 5
    Pg = rng.standard_normal((C, d))
    z = rng.standard_normal((10, d))
    y = np.array([0, 0, 1, 1, 1, 2, 3, 3, 0, 2])
    mask = np.array([True, True, False, True])  # class 2 missing from the global set
    lam, gamma = 0.7, 1.9
    got = float(FedSAFAuxLoss(T(Pg), kind, lam=lam, gamma=gamma, global_mask=mask)(T(z), None, torch.tensor(y)))
    cls = [0, 1, 3]
    Pb = np.stack([z[y == c].mean(0) for c in cls])
    keep = mask[y]
    zi, zt = z[keep], Pg[y[keep]]
    if kind == "gcsa":
        lp, li = _np_gcsa(Pb, Pg[cls]), _np_gcsa(zi, zt)
    elif kind == "rcsa":
        lp, li = _np_rcsa(Pb, Pg[cls]), _np_rcsa(zi, zt)
    elif kind == "mse":
        lp, li = ((Pb - Pg[cls]) ** 2).sum(1).mean(), ((zi - zt) ** 2).sum(1).mean()
    else:
        cos = lambda a, b: (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)  # noqa: E731
        lp, li = (1 - cos(Pb, Pg[cls])).mean(), (1 - cos(zi, zt)).mean()
    assert got == pytest.approx(lam * lp + gamma * li, rel=1e-9, abs=1e-12)


def test_aux_loss_default_mask_skips_zero_rows():
    Pg, mask = aggregate_fedproto([T([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])], [[3, 0, 2]])
    rng = np.random.default_rng(0)
    z = T(rng.standard_normal((6, 2)))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    a = FedSAFAuxLoss(Pg, "cosine")(z, None, y)
    b = FedSAFAuxLoss(Pg, "cosine", global_mask=mask)(z, None, y)
    assert float(a) == pytest.approx(float(b))
    assert mask.tolist() == [True, False, True]


def test_aux_loss_gcsa_invariant_to_global_basis():
    rng = np.random.default_rng(5)
    Pg = rng.standard_normal((3, 4))
    Pg2 = 3.0 * Pg @ _orth(4, rng) + rng.standard_normal(4)
    z = T(rng.standard_normal((9, 4)))
    y = torch.tensor([0, 1, 2] * 3)
    a = float(FedSAFAuxLoss(T(Pg), "gcsa")(z, None, y))
    b = float(FedSAFAuxLoss(T(Pg2), "gcsa")(z, None, y))
    assert a == pytest.approx(b, abs=1e-10)
    assert a > 0.01


@pytest.mark.parametrize("kind", ["gcsa", "rcsa", "mse", "cosine"])
@pytest.mark.parametrize("labels", [[0, 1, 2, 2], [1, 1, 1, 1], [2], [0, 1]])
def test_aux_loss_finite_with_tiny_classes(kind, labels):
    torch.manual_seed(0)
    Pg = torch.randn(3, 8)
    z = torch.randn(len(labels), 8, requires_grad=True)
    out = FedSAFAuxLoss(Pg, kind)(z, torch.randn(len(labels), 3), torch.tensor(labels))
    assert torch.isfinite(out)
    out.backward()
    assert torch.isfinite(z.grad).all()
    if kind in ("gcsa", "rcsa") and len(set(labels)) == 1:
        assert float(out.detach()) == 0.0


@pytest.mark.parametrize("kind", ["gcsa", "rcsa", "mse", "cosine"])
def test_gradients_flow_into_a_model(kind):
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    x = torch.randn(12, 6)
    y = torch.tensor([0, 1, 2] * 4)
    loss = FedSAFAuxLoss(torch.randn(3, 5), kind)(net(x), None, y)
    loss.backward()
    g = net[0].weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_binary_structural_warns():
    with pytest.warns(UserWarning, match="2 classes"):
        FedSAFAuxLoss(torch.randn(2, 4), "gcsa")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FedSAFAuxLoss(torch.randn(2, 4), "mse")


# ---------------------------------------------------------------- prototypes
def test_local_prototypes_class_means_and_counts():
    Z = np.array([[1.0, 1.0], [3.0, 3.0], [0.0, 6.0]])
    P, n = local_prototypes(Z, np.array([2, 2, 0]), 3)
    assert np.allclose(P.numpy(), [[0, 6], [0, 0], [2, 2]])
    assert n.tolist() == [1, 0, 2] and n.dtype == torch.int64


def test_fedproto_weighted_mean_with_missing_classes():
    P1 = [[1.0, 0.0], [9.0, 9.0], [2.0, 2.0], [0.0, 0.0]]  # class 1 absent (row is garbage, must be ignored)
    P2 = [[3.0, 3.0], [4.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    P3 = [[0.0, 6.0], [0.0, 4.0], [5.0, -1.0], [0.0, 0.0]]
    n1, n2, n3 = [2, 0, 1, 0], [1, 3, 0, 0], [1, 1, 3, 0]
    Pg, mask = aggregate_fedproto([T(P1), T(P2), T(P3)], [n1, n2, n3])
    expected = np.array([
        [(2 * 1 + 1 * 3 + 0) / 4, (0 + 3 + 6) / 4],   # class 0: weights 2, 1, 1
        [(3 * 4 + 0) / 4, (0 + 4) / 4],               # class 1: weights 0, 3, 1
        [(2 + 15) / 4, (2 - 3) / 4],                  # class 2: weights 1, 0, 3
        [0.0, 0.0],                                   # class 3: nobody
    ])
    assert np.allclose(Pg.numpy(), expected)
    assert mask.tolist() == [True, True, True, False]
    with pytest.raises(ValueError):
        aggregate_fedproto([T(P1)], [[-1, 0, 1, 0]])


def test_fixed_hypersphere_prototypes_are_spread():
    P = fixed_hypersphere_prototypes(3, 16, seed=2).double()
    G = P @ P.T
    assert torch.allclose(G.diagonal(), torch.ones(3, dtype=torch.float64), atol=1e-6)
    off = G[~torch.eye(3, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -0.5), atol=1e-6)  # simplex: -1/(C-1)
    assert torch.equal(P, fixed_hypersphere_prototypes(3, 16, seed=2).double())
    assert not torch.equal(P, fixed_hypersphere_prototypes(3, 16, seed=3).double())
    H = fixed_hypersphere_prototypes(6, 2, seed=0).double()  # C > d: best is a hexagon, max cos 0.5
    Gh = H @ H.T
    assert torch.allclose(Gh.diagonal(), torch.ones(6, dtype=torch.float64), atol=1e-6)
    assert Gh[~torch.eye(6, dtype=torch.bool)].max() < 0.6


def test_tgp_prototypes_fit_uploads_with_margin():
    rng = np.random.default_rng(0)
    centres = np.array([[5.0, 0.0], [0.0, 5.0], [-5.0, 0.0]])
    ups, cnts = [], []
    for k in range(3):
        ups.append(T(centres + 0.3 * rng.standard_normal((3, 2))))
        cnts.append([10, 5, 0] if k == 0 else [3, 4, 7])
    P, mask = train_tgp_prototypes(ups, cnts, C=3, d=2, margin=1.0, steps=200, seed=0)
    assert P.shape == (3, 2) and mask.tolist() == [True, True, True]
    for U, n in zip(ups, cnts):
        for c in range(3):
            if n[c] > 0:
                dist = torch.linalg.norm(P.double() - U[c], dim=1)
                assert int(dist.argmin()) == c
                assert float(dist[c]) + 1.0 < float(torch.cat([dist[:c], dist[c + 1:]]).min())
    P2, _ = train_tgp_prototypes(ups, cnts, C=3, d=2, margin=1.0, steps=200, seed=0)
    assert torch.equal(P, P2)
    _, m = train_tgp_prototypes([ups[0]], [[1, 0, 0]], C=3, d=2, steps=5, init=torch.zeros(3, 2))
    assert m.tolist() == [True, False, False]


def test_effective_rank():
    assert effective_rank(torch.eye(4)) == pytest.approx(4.0)
    assert effective_rank(torch.outer(torch.arange(1.0, 6.0), torch.ones(3))) == pytest.approx(1.0, abs=1e-6)
    assert effective_rank(torch.zeros(3, 3)) == 0.0
    s = np.array([3.0, 1.0])
    p = s / s.sum()
    assert effective_rank(torch.diag(T(s))) == pytest.approx(math.exp(-(p * np.log(p)).sum()))


def test_validate_prototype_upload():
    P = np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]])
    validate_prototype_upload(P, [4, 0, 2], 3, 2)
    validate_prototype_upload(T(P), torch.tensor([4, 0, 2]), 3, 2)
    bad = [
        (P[:2], [4, 0], "shape"),
        (P, [4, 0], "counts shape"),
        (np.where(P == 1.0, np.nan, P), [4, 0, 2], "non-finite"),
        (P, [4, 0, -2], "non-negative"),
        (P, [4, 0, 2.5], "integers"),
        (P * 0, [0, 0, 0], "no class present"),
        (P + 1, [4, 0, 2], "count 0"),
        (P, [4, 0, np.inf], "non-finite"),
    ]
    for p, n, reason in bad:
        with pytest.raises(ValueError, match=reason):
            validate_prototype_upload(p, n, 3, 2)
