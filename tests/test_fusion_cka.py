"""Linear CKA (OHFL Eq. 1): identities, invariances, hand-computed values, and the layer cost matrix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hfl_components.fusion import cka_cost_matrix, layer_activations, linear_cka
from hfl_components.models.fusable import build_fusable

torch.set_num_threads(1)


def _rand(n, p, seed):
    return np.random.default_rng(seed).normal(size=(n, p))


def test_cka_of_itself_is_one():
    X = _rand(30, 12, 0)
    assert linear_cka(X, X) == pytest.approx(1.0, abs=1e-12)
    Xt = torch.randn(20, 3, 4, 4)  # conv-shaped activations are flattened per sample
    assert linear_cka(Xt, Xt) == pytest.approx(1.0, abs=1e-6)


def test_cka_invariant_to_orthogonal_transform_and_isotropic_scaling():
    X, Y = _rand(40, 10, 1), _rand(40, 7, 2) + 0.5 * _rand(40, 10, 1)[:, :7]
    base = linear_cka(X, Y)
    Q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(10, 10)))
    assert np.allclose(Q.T @ Q, np.eye(10))
    assert linear_cka(X @ Q, Y) == pytest.approx(base, rel=1e-10)
    for s in (3.7, 1e-3, 250.0, 1e-6):
        assert linear_cka(s * X, Y) == pytest.approx(base, rel=1e-10)
        assert linear_cka(X, s * Y) == pytest.approx(base, rel=1e-10)
    assert 0.0 < base < 1.0


def test_cka_hand_computed_cases():
    # 1 feature each: CKA is the squared Pearson correlation. x - mean = [-1, 0, 1], y - mean = [-1, 1, 0]:
    # (x.y)^2 / (|x|^2 |y|^2) = 1 / (2 * 2) = 1/4.
    assert linear_cka([[1.0], [2.0], [3.0]], [[1.0], [3.0], [2.0]]) == pytest.approx(0.25, abs=1e-12)
    # Eq. 1 in feature space on already-centred data: X rows (1,0),(0,1),(-1,0),(0,-1); Y = (1,1,-1,-1)^T.
    # Y^T X = (2, 2) -> ||.||^2 = 8;  X^T X = 2 I -> ||.||_F = 2 sqrt(2);  Y^T Y = 4 -> 4;  CKA = 8 / (8 sqrt 2).
    X = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]
    Y = [[1.0], [1.0], [-1.0], [-1.0]]
    assert linear_cka(X, Y) == pytest.approx(1 / np.sqrt(2), abs=1e-12)


def test_cka_guards_constant_layer_and_bad_input():
    X = _rand(10, 4, 5)
    assert linear_cka(np.ones((10, 4)), X) == 0.0
    with pytest.raises(ValueError):
        linear_cka(X, _rand(9, 4, 6))
    with pytest.raises(ValueError):
        linear_cka(np.full((10, 2), np.nan), X)


def test_layer_activations_and_cost_matrix():
    torch.manual_seed(0)
    spec = {"family": "cnn", "depth": "medium", "width": 0.1, "in_channels": 1, "num_classes": 2}
    m = build_fusable(spec)
    probe = torch.rand(12, 1, 16, 16)
    acts = layer_activations(m, probe)
    assert len(acts) == len(m.layers())
    with torch.no_grad():
        first = m.convs[0]((probe - m.INPUT_MEAN) / m.INPUT_STD)  # the model centres its input first
        logits = m(probe)
    assert torch.equal(acts[0], first.reshape(12, -1))  # pre-activation of the first conv
    assert torch.allclose(acts[-1], logits)
    assert all(a.dtype == torch.float32 and a.shape[0] == 12 for a in acts)
    C = cka_cost_matrix(m, m, probe)
    n_hidden = len(m.layers()) - 1
    assert C.shape == (n_hidden, n_hidden) and C.dtype == np.float64
    assert np.allclose(np.diag(C), 0.0, atol=1e-10)
    assert (C >= -1e-12).all() and (C <= 1 + 1e-12).all()
    deep = build_fusable({**spec, "depth": "deep"})
    assert cka_cost_matrix(m, deep, probe).shape == (n_hidden, len(deep.layers()) - 1)
