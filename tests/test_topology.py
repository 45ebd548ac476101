"""Tests for hfl_components.topology (FedTopo, ../shared/papers/002_fb7c67fce2254bf3.txt, Sec. IV).

Expected values are hand-computed from Eq. 3–13 and 25–26 (see the arithmetic in the comments).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hfl_components.topology import (
    TopologyAblation,
    TopologyLoss,
    aggregate_round,
    aggregate_topology,
    initial_topology,
    is_warmup_round,
    local_guidance,
    local_relation_topology,
    noisy_counts,
    topology_guidance,
    topology_guided_loss,
    topology_inconsistency,
    validate_topology_upload,
)

torch.set_num_threads(1)


def _orth(d, rng):
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


# ---------------------------------------------------------------- local topology (Eq. 2–3)
def test_local_topology_hand_values_and_mask():
    # class means: c0 = (1, 0), c1 = (0, 2), c2 = (-3, 0); class 3 absent
    Z = np.array([[2.0, 0.0], [0.0, 0.0], [0.0, 2.0], [-3.0, 1.0], [-3.0, -1.0]])
    y = np.array([0, 0, 1, 2, 2])
    R, present, counts = local_relation_topology(Z, y, 4)
    expected = np.array([
        [1.0, 0.5, 0.0, 0.0],   # cos(c0, c1) = 0 -> 0.5; cos(c0, c2) = -1 -> 0
        [0.5, 1.0, 0.5, 0.0],
        [0.0, 0.5, 1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],   # absent class: masked to 0, diagonal too
    ])
    assert np.allclose(R, expected, atol=1e-12)
    assert present.tolist() == [True, True, True, False]
    assert counts.tolist() == [2, 1, 2, 0]


def test_local_topology_unit_diagonal_symmetric_and_invariant():
    rng = np.random.default_rng(0)
    C, d = 5, 7
    y = np.arange(60) % 4  # class 4 absent
    Z = rng.standard_normal((60, d)) + 3.0 * np.eye(C, d)[y] + 1.0
    R, present, _ = local_relation_topology(torch.tensor(Z), torch.tensor(y), C)
    assert np.allclose(np.diag(R)[:4], 1.0) and R[4, 4] == 0.0
    assert np.array_equal(R, R.T)
    assert R.min() >= 0.0 and R.max() <= 1.0
    # Prop. 1 of the paper: rotate and scale the feature space -> same R, different prototypes
    Z2 = 3.7 * Z @ _orth(d, rng)
    R2, present2, _ = local_relation_topology(Z2, y, C)
    assert np.allclose(R, R2, atol=1e-12) and np.array_equal(present, present2)
    p1 = np.stack([Z[y == c].mean(0) for c in range(4)])
    p2 = np.stack([Z2[y == c].mean(0) for c in range(4)])
    assert np.abs(p1 - p2).max() > 0.5


# ---------------------------------------------------------------- aggregation (Eq. 4–8)
def _sites():
    # entries involving a site's absent class hold garbage (0.99, 0.77): the observation mask must ignore them
    # site A: classes 0, 1 (class 2 absent); site B: classes 0, 2; site C: all three
    R_A = np.array([[1.0, 0.8, 0.99], [0.8, 1.0, 0.99], [0.99, 0.99, 0.99]])
    R_B = np.array([[1.0, 0.77, 0.4], [0.77, 0.77, 0.77], [0.4, 0.77, 1.0]])
    R_C = np.array([[1.0, 0.5, 0.6], [0.5, 1.0, 0.9], [0.6, 0.9, 1.0]])
    n = [np.array([10, 10, 0]), np.array([2, 0, 6]), np.array([4, 4, 4])]
    return [R_A, R_B, R_C], n


def test_aggregate_round_hand_computed():
    Rs, ns = _sites()
    R_t, W, observed = aggregate_round(Rs, ns)
    # Eq. 5: w = n n' / (n + n'); (0,1): A 100/20 = 5, C 16/8 = 2; (0,2): B 12/8 = 1.5, C 2; (1,2): C 2
    assert W[0, 1] == pytest.approx(7.0) and W[0, 2] == pytest.approx(3.5) and W[1, 2] == pytest.approx(2.0)
    assert W[0, 0] == pytest.approx(5 + 1 + 2) and W[2, 2] == pytest.approx(3 + 2)
    assert R_t[0, 1] == pytest.approx((5 * 0.8 + 2 * 0.5) / 7)
    assert R_t[0, 2] == pytest.approx((1.5 * 0.4 + 2 * 0.6) / 3.5)
    assert R_t[1, 2] == pytest.approx(0.9)
    assert np.allclose(np.diag(R_t), 1.0)
    assert observed.all()
    # no reliability: plain average over the sites observing each pair
    R_p, W_p, _ = aggregate_round(Rs, ns, reliability=False)
    assert R_p[0, 1] == pytest.approx((0.8 + 0.5) / 2) and R_p[0, 2] == pytest.approx((0.4 + 0.6) / 2)
    assert W_p[0, 1] == 2 and W_p[1, 2] == 1 and W_p[0, 0] == 3


def test_aggregate_topology_first_round_reliability_and_ema():
    Rs, ns = _sites()
    R0, S0 = initial_topology(3)
    assert np.array_equal(R0, np.eye(3)) and np.array_equal(S0, np.zeros((3, 3)))
    R1, S1 = aggregate_topology(Rs, ns, R0, S0, rho=0.7)
    # Eq. 8 from the identity: off-diagonal 0.3 * R~, diagonal 0.7 + 0.3 = 1
    assert R1[0, 1] == pytest.approx(0.3 * 5 / 7) and R1[0, 2] == pytest.approx(0.3 * 1.8 / 3.5)
    assert R1[1, 2] == pytest.approx(0.3 * 0.9) and np.allclose(np.diag(R1), 1.0)
    # Eq. 7 with the best-supported off-diagonal pair (0,1): 7
    assert S1[0, 1] == pytest.approx(1.0) and S1[0, 2] == pytest.approx(0.5) and S1[1, 2] == pytest.approx(2 / 7)
    assert S1[0, 0] == 1.0 and S1[1, 1] == pytest.approx(1.0) and S1[2, 2] == pytest.approx(5 / 7)  # diagonal clipped to <= 1
    assert np.array_equal(R1, R1.T) and np.array_equal(S1, S1.T)


def test_aggregate_topology_retains_unobserved_pairs():
    Rs, ns = _sites()
    R1, S1 = aggregate_topology(Rs, ns, *initial_topology(3), rho=0.7)
    # round 2: only site A uploads -> (0,2), (1,2), (2,2) unobserved
    R2, S2 = aggregate_topology([Rs[0]], [ns[0]], R1, S1, rho=0.7)
    assert R2[0, 1] == pytest.approx(0.7 * R1[0, 1] + 0.3 * 0.8)
    assert R2[0, 2] == R1[0, 2] and R2[1, 2] == R1[1, 2] and R2[2, 2] == R1[2, 2]
    assert S2[0, 1] == pytest.approx(1.0) and S2[0, 2] == S1[0, 2] and S2[1, 2] == S1[1, 2]
    _, S2_literal = aggregate_topology([Rs[0]], [ns[0]], R1, S1, rho=0.7, retain_reliability=False)
    assert S2_literal[0, 2] == 0.0 and S2_literal[0, 1] == pytest.approx(1.0)
    # no EMA (rho = 0): observed pairs take this round's value, unobserved pairs are still kept
    R3, _ = aggregate_topology([Rs[0]], [ns[0]], R1, S1, rho=0.0)
    assert R3[0, 1] == pytest.approx(0.8) and R3[0, 2] == R1[0, 2]


def test_aggregate_topology_class_never_observed_and_no_reliability():
    R_A = np.array([[1.0, 0.6, 0.0], [0.6, 1.0, 0.0], [0.0, 0.0, 0.0]])
    R_B = np.array([[1.0, 0.2, 0.0], [0.2, 1.0, 0.0], [0.0, 0.0, 0.0]])
    n = [[3, 1, 0], [5, 5, 0]]
    R, S = aggregate_topology([R_A, R_B], n, *initial_topology(3), rho=0.5, reliability=False)
    assert R[0, 1] == pytest.approx(0.5 * 0 + 0.5 * 0.4)  # plain average 0.4
    assert R[2, 2] == 1.0 and R[0, 2] == 0.0  # class 2 never observed: identity kept
    assert np.array_equal(S, np.array([[1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=float))
    # with reliability: w_A = 3/4, w_B = 25/10 -> (0.75*0.6 + 2.5*0.2) / 3.25
    R, S = aggregate_topology([R_A, R_B], n, *initial_topology(3), rho=0.0)
    assert R[0, 1] == pytest.approx((0.75 * 0.6 + 2.5 * 0.2) / 3.25)
    assert S[0, 1] == pytest.approx(1.0) and S[2, 2] == 0.0
    # only single-class sites: no off-diagonal support at all
    R1 = np.diag([1.0, 0.0, 0.0])
    R, S = aggregate_topology([R1], [[4, 0, 0]], *initial_topology(3))
    assert np.array_equal(S, np.diag([1.0, 0.0, 0.0])) and np.array_equal(R, np.eye(3))
    with pytest.raises(ValueError):
        aggregate_topology([R_A], [n[0]], *initial_topology(3), rho=1.0)


# ---------------------------------------------------------------- loss (Eq. 9–13)
def _ce(o, y):
    o = np.asarray(o, dtype=np.float64)
    return float(np.mean([np.log(np.exp(r).sum()) - r[t] for r, t in zip(o, y)]))


def test_zero_reliability_gives_one_plus_lambda_ce():
    torch.manual_seed(0)
    logits = torch.randn(8, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    R = np.full((4, 4), 0.9)
    S = np.zeros((4, 4))
    ce = _ce(logits.numpy(), y.numpy())
    lam = 0.6
    full = topology_guided_loss(logits, y, R, S, np.ones(4, bool), lam=lam)
    assert float(full) == pytest.approx((1 + lam) * ce, rel=1e-6)
    aux = TopologyLoss(R, S, np.ones(4, bool), lam=lam, warmup_active=False)(None, logits, y)
    assert float(aux) + ce == pytest.approx((1 + lam) * ce, rel=1e-6)


def test_warmup_equals_ce():
    logits = torch.randn(5, 3, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1])
    loss_fn = TopologyLoss(np.ones((3, 3)), np.ones((3, 3)), np.ones(3, bool), warmup_active=True)
    aux = loss_fn(torch.randn(5, 2), logits, y)
    assert float(aux.detach()) == 0.0
    total = F.cross_entropy(logits, y) + aux
    assert float(total.detach()) == pytest.approx(_ce(logits.detach().numpy(), y.numpy()), rel=1e-6)
    total.backward()
    assert is_warmup_round(0) and is_warmup_round(2) and not is_warmup_round(3)


def test_topq_picks_highest_present_negatives_and_clips():
    C = 5
    R = np.eye(C)
    R[0] = R[:, 0] = [1.0, 0.3, 0.9, 0.99, 0.6]
    S = np.ones((C, C))
    S[0, 2] = S[2, 0] = 0.5  # A_0 = [1, 0.3, 0.45, 0.99, 0.6]
    present = np.array([True, True, True, False, True])  # class 3 (highest score) absent locally
    y = torch.tensor([0])
    B = topology_guidance(y, R, S, present, q=2)
    assert np.allclose(B.numpy(), [[0, 0, 0.45, 0, 0.6]])
    B_all = topology_guidance(y, R, S, present, q=10)  # clipped to C-1 = 4: all 3 present negatives
    assert np.allclose(B_all.numpy(), [[0, 0.3, 0.45, 0, 0.6]])
    assert np.allclose(topology_guidance(y, R, S, present, q=None).numpy(), B_all.numpy())
    B_nomask = topology_guidance(y, R, S, present, q=2, use_mask=False)  # ablation: absent class 3 allowed
    assert np.allclose(B_nomask.numpy(), [[0, 0, 0, 0.99, 0.6]])
    # the loss uses o' = o + gamma * B on the selected negatives only
    logits = torch.tensor([[2.0, 0.5, 0.1, -1.0, 0.3]], dtype=torch.float64)
    lam, gamma = 0.5, 2.0
    o_mod = logits.numpy() + gamma * np.array([[0, 0, 0.45, 0, 0.6]])
    loss = TopologyLoss(R, S, present, lam=lam, gamma=gamma, q=2, warmup_active=False)
    assert float(loss(None, logits, y)) == pytest.approx(lam * _ce(o_mod, [0]), rel=1e-6)
    assert float(topology_guided_loss(logits, y, R, S, present, lam, gamma, q=2)) == pytest.approx(
        _ce(logits.numpy(), [0]) + lam * _ce(o_mod, [0]), rel=1e-6)
    assert loss.q_effective == 2 and loss.topq_active
    big = TopologyLoss(R, S, present, q=7, warmup_active=False)
    assert big.q_effective == 4 and not big.topq_active


def test_topq_with_fewer_candidates_than_q_and_gradient():
    R = np.array([[1.0, 0.8, 0.5], [0.8, 1.0, 0.7], [0.5, 0.7, 1.0]])
    S = np.ones((3, 3))
    present = np.array([True, True, False])
    y = torch.tensor([0, 1, 1])
    B = topology_guidance(y, R, S, present, q=3)
    assert np.allclose(B.numpy(), [[0, 0.8, 0], [0.8, 0, 0], [0.8, 0, 0]])
    logits = torch.randn(3, 3, requires_grad=True)
    TopologyLoss(R, S, present, warmup_active=False)(None, logits, y).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        TopologyLoss(R, S, None)


def test_binary_reduces_to_single_negative():
    R = np.array([[1.0, 0.7], [0.7, 1.0]])
    S = np.array([[1.0, 0.5], [0.5, 1.0]])
    B = topology_guidance(torch.tensor([0, 1]), R, S, np.ones(2, bool), q=3)
    assert np.allclose(B.numpy(), [[0, 0.35], [0.35, 0]])


# ---------------------------------------------------------------- noisy counts, diagnostics, validation
def test_noisy_counts_keep_presence():
    counts = np.array([50, 0, 3, 0, 1])
    present = counts > 0
    for seed in range(20):
        noisy = noisy_counts(counts, present, scale=10.0, seed=seed)
        assert np.array_equal(noisy > 0, present)
        assert (noisy[present] >= 1).all() and np.all(noisy == np.round(noisy))
        assert noisy[1] == 0 and noisy[3] == 0
    assert np.array_equal(noisy_counts(counts, present, 2.0, seed=1), noisy_counts(counts, present, 2.0, seed=1))
    assert np.array_equal(noisy_counts(counts, present, 0.0), counts)
    assert not np.array_equal(noisy_counts(counts, present, 10.0, seed=0), counts)
    with pytest.raises(ValueError):
        noisy_counts(counts, np.array([True, True, True, False, True]), 1.0)
    with pytest.raises(ValueError):
        noisy_counts(counts, present, -1.0)


def test_topology_inconsistency_hand_values():
    R_k = np.array([[1.0, 0.6, 0.0], [0.6, 1.0, 0.0], [0.0, 0.0, 0.0]])
    R_g = np.array([[1.0, 0.4, 0.9], [0.4, 1.0, 0.2], [0.9, 0.2, 1.0]])
    S_g = np.array([[1.0, 0.5, 1.0], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    D_r, D_rs = topology_inconsistency(R_k, [True, True, False], R_g, S_g)
    assert D_r == pytest.approx(0.2) and D_rs == pytest.approx(0.1)  # only pair (0,1) is in Omega_k
    R_k3 = np.array([[1.0, 0.6, 0.5], [0.6, 1.0, 0.5], [0.5, 0.5, 1.0]])
    D_r, D_rs = topology_inconsistency(R_k3, [True] * 3, R_g, S_g)
    assert D_r == pytest.approx((0.2 + 0.4 + 0.3) / 3) and D_rs == pytest.approx((0.1 + 0.4 + 0.3) / 3)
    assert topology_inconsistency(R_k, [True, False, False], R_g, S_g) == (None, None)


def test_validate_topology_upload():
    R = np.array([[1.0, 0.3, 0.0], [0.3, 1.0, 0.0], [0.0, 0.0, 0.0]])
    validate_topology_upload(R, [3, 4, 0], 3)
    validate_topology_upload(torch.tensor(R), torch.tensor([3, 4, 0]), 3)
    validate_topology_upload(R + 1e-9 * np.eye(3), [3.0, 4.0, 0.0], 3)
    cases = [
        (R[:2, :2], [3, 4, 0], "shape"),
        (R, [3, 4], "counts shape"),
        (np.where(R == 0.3, np.nan, R), [3, 4, 0], "non-finite"),
        (R * 1.5, [3, 4, 0], r"outside \[0, 1\]"),
        (R - 0.5, [3, 4, 0], r"outside \[0, 1\]"),
        (np.triu(R), [3, 4, 0], "symmetric"),
        (R, [3, -4, 0], "non-negative"),
        (R, [3, np.nan, 0], "non-finite"),
        ([["a"] * 3] * 3, [3, 4, 0], "numeric"),
    ]
    for r, n, reason in cases:
        with pytest.raises(ValueError, match=reason):
            validate_topology_upload(r, n, 3)
    # a site's real upload passes
    rng = np.random.default_rng(0)
    R_k, present, counts = local_relation_topology(rng.standard_normal((30, 8)), np.arange(30) % 2, 3)
    validate_topology_upload(R_k, noisy_counts(counts, present, 3.0, seed=0), 3)


def test_ablation_switches():
    a = TopologyAblation.from_names(["no_ema", "no_topq"])
    assert a.no_ema and a.no_topq and not a.no_reliability
    assert a.rho(0.7) == 0.0 and TopologyAblation().rho(0.7) == 0.7
    assert a.q(3, 10) == 9 and TopologyAblation().q(3, 10) == 3
    assert TopologyAblation.topq_is_noop(3, 3) and not TopologyAblation.topq_is_noop(3, 10)
    with pytest.raises(ValueError):
        TopologyAblation.from_names(["no_such_thing"])
    R_k = np.array([[1.0, 0.6, 0.0], [0.6, 1.0, 0.0], [0.0, 0.0, 0.0]])
    R, S = local_guidance(R_k, [True, True, False])
    assert np.array_equal(R, R_k) and np.array_equal(S, [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
