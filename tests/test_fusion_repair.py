"""Activation-scale repair of fused models (hfl_components.fusion.repair)."""
from __future__ import annotations

import torch

from hfl_components.fusion import fuse_pair
from hfl_components.fusion.repair import hidden_stds, repair_scales
from hfl_components.models import build_model

torch.set_num_threads(1)
SPEC = {"family": "cnn", "depth": "medium", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _random_model(seed):
    torch.manual_seed(seed)
    m = build_model(SPEC)
    with torch.no_grad():
        m.classifier.weight.normal_(0, 0.1)  # the class layer starts at zero; give it a function to compare
    return m


def test_repair_matches_requested_stds_layer_by_layer():
    probe = torch.rand(32, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    m = _random_model(0)
    before = hidden_stds(m, probe)
    goal = [2.0 * s for s in before[:3]] + [0.5 * s for s in before[3:]]
    sd, scales = repair_scales(SPEC, m.state_dict(), goal, probe)
    m2 = build_model(SPEC)
    m2.load_state_dict(sd)
    after = hidden_stds(m2, probe)
    for a, g in zip(after, goal):
        assert abs(a - g) / g < 1e-4
    assert abs(scales[0] - 2.0) < 1e-6  # the first layer sees the raw input: exactly the requested factor


def test_repair_keeps_exact_recovery_of_a_permuted_copy():
    probe = torch.rand(16, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    m = _random_model(3)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    perm = torch.randperm(sd["fcs.0.weight"].shape[0], generator=torch.Generator().manual_seed(4))
    sd["fcs.0.weight"], sd["fcs.0.bias"] = sd["fcs.0.weight"][perm], sd["fcs.0.bias"][perm]
    sd["fcs.1.weight"] = sd["fcs.1.weight"][:, perm]
    spec, fused, rec = fuse_pair((SPEC, sd), (SPEC, m.state_dict()), probe, 1, 1, repair=True)
    assert all(abs(s - 1.0) < 1e-6 for s in rec["repair_scales"])
    out = build_model(spec)
    out.load_state_dict(fused)
    with torch.no_grad():
        assert torch.allclose(out(probe), m(probe), atol=1e-5)


def test_repair_restores_spread_that_averaging_two_unrelated_models_loses():
    probe = torch.rand(32, 1, 32, 32, generator=torch.Generator().manual_seed(5))
    a, b = _random_model(10), _random_model(11)
    parents = [0.5 * (x + y) for x, y in zip(hidden_stds(a, probe), hidden_stds(b, probe))]
    spec, plain, _ = fuse_pair((SPEC, a.state_dict()), (SPEC, b.state_dict()), probe, 1, 1, repair=False)
    spec, fixed, rec = fuse_pair((SPEC, a.state_dict()), (SPEC, b.state_dict()), probe, 1, 1, repair=True)
    mp, mf = build_model(spec), build_model(spec)
    mp.load_state_dict(plain)
    mf.load_state_dict(fixed)
    assert hidden_stds(mp, probe)[-1] < 0.9 * parents[-1]  # plain averaging shrinks the deepest layer's spread
    for got, want in zip(hidden_stds(mf, probe), parents):
        assert abs(got - want) / want < 1e-4
