"""Activation-scale repair of fused models (hfl_components.fusion.repair)."""
from __future__ import annotations

import pytest
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


def _scaled(m, factor):
    """``m``'s state dict with the first hidden layer's weight and bias times ``factor``: every hidden layer's
    pre-activation statistics change (ReLU is positively homogeneous), the model stays a different parent."""
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    first = next(k for k in sd if k.endswith(".weight"))
    sd[first] *= factor
    sd[first.replace(".weight", ".bias")] *= factor
    return sd


def test_repair_goals_weight_source_and_target_by_their_own_fusion_weights():
    """Unequal fusion weights (3 : 1) and parents with different statistics: the repaired model's statistics are
    0.75 x the source's + 0.25 x the target's, layer by layer ("layer" mode: each layer's std; "channel" mode, REPAIR:
    each neuron's mean and std, whose averages over a layer's neurons are the parents' averages weighted the same
    way, since the column-normalised OT plan between equal-width layers is doubly stochastic). Swapping the weights
    would give 0.25 / 0.75."""
    from hfl_components.fusion.repair import hidden_channel_stats

    probe = torch.rand(32, 1, 32, 32, generator=torch.Generator().manual_seed(6))
    src, tgt = _random_model(30), _random_model(31)
    sd_src = _scaled(src, 3.0)
    src.load_state_dict(sd_src)
    ws, wt = 0.75, 0.25
    s_std, t_std = hidden_stds(src, probe), hidden_stds(tgt, probe)
    assert all(abs(a - b) / b > 0.2 for a, b in zip(s_std, t_std))  # the parents differ in every layer
    spec, sd, _ = fuse_pair((SPEC, sd_src), (SPEC, tgt.state_dict()), probe, 3, 1, repair="layer")
    out = build_model(spec)
    out.load_state_dict(sd)
    for got, a, b in zip(hidden_stds(out, probe), s_std, t_std):
        assert abs(got - (ws * a + wt * b)) / (ws * a + wt * b) < 1e-4
    spec, sd, _ = fuse_pair((SPEC, sd_src), (SPEC, tgt.state_dict()), probe, 3, 1, repair="channel")
    out = build_model(spec)
    out.load_state_dict(sd)
    for (mf, sf), (ms, ss), (mt, st) in zip(hidden_channel_stats(out, probe), hidden_channel_stats(src, probe),
                                            hidden_channel_stats(tgt, probe)):
        assert float(sf.mean()) == pytest.approx(ws * float(ss.mean()) + wt * float(st.mean()), rel=1e-3)
        assert float(mf.mean()) == pytest.approx(ws * float(ms.mean()) + wt * float(mt.mean()), abs=1e-3 * float(
            st.mean()))
