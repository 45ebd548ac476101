"""OT neuron alignment and fusion (OHFL Sec. 3.3–3.4): permuted copies fuse back to the original function (emd exactly,
Sinkhorn closely) while naive averaging does not; duplicated-neuron (2x width) copies fuse back exactly; a model fused
with its own depth-balanced copy is unchanged; the solvers respect their marginals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hfl_components.fusion import OTMarginalError, fuse_pair, insert_identity_layers, solve_ot
from hfl_components.models.fusable import build_fusable, explicit_spec, resolve_fusable_spec
from tests.fusion_helpers import forward, he_model

torch.set_num_threads(1)

SPEC = {"family": "cnn", "depth": "medium", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _hidden(spec):
    m = build_fusable(spec)
    return m, m.layers(), resolve_fusable_spec(spec)["pool"] ** 2


def _expand_in(w: torch.Tensor, idx: torch.Tensor, kind: str, prev_kind: str, pool2: int) -> torch.Tensor:
    """Select/reorder input columns of w by a channel index (expanded over pool positions at conv->fc)."""
    if kind == "fc" and prev_kind == "conv":
        cols = (idx[:, None] * pool2 + torch.arange(pool2)[None, :]).reshape(-1)
        return w[:, cols]
    return w[:, idx]


def permuted_copy(spec, sd, seed=0):
    """Same function, hidden neurons of every layer randomly permuted (consistently in the next layer)."""
    _, layers, pool2 = _hidden(spec)
    g = torch.Generator().manual_seed(seed)
    out, prev, prev_kind = {}, None, "conv"
    for info in layers:
        w, b = sd[f"{info.name}.weight"], sd[f"{info.name}.bias"]
        if prev is not None:
            w = _expand_in(w, prev, info.kind, prev_kind, pool2)
        if not info.is_output:
            perm = torch.randperm(w.shape[0], generator=g)
            w, b, prev = w[perm], b[perm], perm
        out[f"{info.name}.weight"], out[f"{info.name}.bias"] = w.clone(), b.clone()
        prev_kind = info.kind
    return out


def duplicated_copy(spec, sd):
    """2x-wide copy: every hidden neuron duplicated (i and i + n), outgoing weights halved: the same function."""
    _, layers, pool2 = _hidden(spec)
    out, prev_n, prev_kind = {}, None, "conv"
    for info in layers:
        w, b = sd[f"{info.name}.weight"], sd[f"{info.name}.bias"]
        if prev_n is not None:
            idx = torch.cat([torch.arange(prev_n), torch.arange(prev_n)])
            w = _expand_in(w, idx, info.kind, prev_kind, pool2) / 2
        if not info.is_output:
            prev_n = w.shape[0]
            w, b = torch.cat([w, w]), torch.cat([b, b])
        out[f"{info.name}.weight"], out[f"{info.name}.bias"] = w.clone(), b.clone()
        prev_kind = info.kind
    r = resolve_fusable_spec(spec)
    wide = explicit_spec(spec, stages=[[2 * c for c in s] for s in r["stages"]], hidden=[2 * h for h in r["hidden"]])
    return wide, out


@pytest.fixture(scope="module")
def base():
    m = he_model(SPEC, 0, bias_range=0.2)
    x = torch.rand(16, 1, 32, 32)
    return m.state_dict(), x, forward(SPEC, m.state_dict(), x)


def test_helpers_build_function_preserving_copies(base):
    sd, x, ref = base
    assert (forward(SPEC, permuted_copy(SPEC, sd), x) - ref).abs().max() < 1e-5
    wide, wsd = duplicated_copy(SPEC, sd)
    assert (forward(wide, wsd, x) - ref).abs().max() < 1e-5


def test_permuted_copy_fuses_back_exactly_with_emd_but_naive_average_does_not(base):
    sd, x, ref = base
    psd = permuted_copy(SPEC, sd, seed=1)
    naive = {k: (sd[k] + psd[k]) / 2 for k in sd}
    naive_err = (forward(SPEC, naive, x) - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert naive_err > 0.2 * scale, (naive_err, scale)
    for src, tgt in (((SPEC, psd), (SPEC, sd)), ((SPEC, sd), (SPEC, psd))):
        spec, fused, rec = fuse_pair(src, tgt, None, 0.5, 0.5, ot_solver="emd")
        for k in fused:  # the result is the target itself
            assert torch.allclose(fused[k], tgt[1][k], atol=1e-6), k
        assert (forward(spec, fused, x) - ref).abs().max().item() < 1e-5
        assert rec["balancing"] == "none" and set(rec["seconds"]) == {"cka", "alignment", "ot", "averaging", "repair"}


def test_permuted_copy_fuses_back_closely_with_sinkhorn(base):
    sd, x, ref = base
    psd = permuted_copy(SPEC, sd, seed=2)
    spec, fused, rec = fuse_pair((SPEC, psd), (SPEC, sd), None, 0.5, 0.5, ot_solver="sinkhorn")
    err = (forward(spec, fused, x) - ref).abs().max().item()
    assert err < 1e-2 * ref.abs().max().item(), err
    assert all(r["marginal_rel_err"] <= 1e-3 for r in rec["layers"] if r["plan"] == "ot")


def test_permuted_copy_fuses_back_with_activation_ground_metric(base):
    sd, x, ref = base
    psd = permuted_copy(SPEC, sd, seed=3)
    spec, fused, _ = fuse_pair((SPEC, psd), (SPEC, sd), x, 0.3, 0.7, ground_metric="acts")
    assert (forward(spec, fused, x) - ref).abs().max().item() < 1e-5


def test_duplicated_neurons_fuse_back_without_changing_the_function(base):
    sd, x, ref = base
    wide, wsd = duplicated_copy(SPEC, sd)
    # wide source onto the narrow original: the original function, shape of the target
    spec, fused, _ = fuse_pair((wide, wsd), (SPEC, sd), None, 0.5, 0.5)
    assert spec == SPEC
    assert (forward(spec, fused, x) - ref).abs().max().item() < 1e-5
    # narrow original onto its wide copy: the wide copy's function (and weights)
    spec, fused, _ = fuse_pair((SPEC, sd), (wide, wsd), None, 0.5, 0.5)
    assert (forward(spec, fused, x) - ref).abs().max().item() < 1e-5
    for k in fused:
        assert torch.allclose(fused[k], wsd[k], atol=1e-6), k
    # with the permuted wide copy as well (duplicates no longer adjacent)
    pw = permuted_copy(wide, wsd, seed=4)
    spec, fused, _ = fuse_pair((wide, pw), (SPEC, sd), None, 1.0, 3.0, ot_solver="emd")
    assert (forward(spec, fused, x) - ref).abs().max().item() < 1e-5


def test_model_fused_with_its_depth_balanced_copy_is_unchanged(base):
    sd, x, ref = base
    deep = {**SPEC, "depth": "deep"}
    pairs = [(0, 0), (1, 1), (2, 3), (3, 4), (4, 5), (5, 6), (6, 8)]  # medium -> deep
    bal_spec, bal_sd = insert_identity_layers(SPEC, sd, pairs, deep)
    bal_sd = permuted_copy(bal_spec, bal_sd, seed=5)
    probe = torch.rand(24, 1, 32, 32)
    # shallow source into the deep copy (CKA alignment, identity insertion): the deep copy's function
    spec, fused, rec = fuse_pair((SPEC, sd), (bal_spec, bal_sd), probe, 0.5, 0.5)
    assert rec["balancing"] == "insert_identity" and rec["layer_map"] == [list(p) for p in pairs]
    assert (forward(spec, fused, x) - ref).abs().max().item() < 1e-5
    # deep copy into the shallow original (merging identities): the original
    spec, fused, rec = fuse_pair((bal_spec, bal_sd), (SPEC, sd), probe, 0.5, 0.5)
    assert rec["balancing"] == "merge" and spec == SPEC
    assert (forward(spec, fused, x) - ref).abs().max().item() < 1e-5
    assert np.asarray(rec["cost"]).shape == (9, 7)


def test_solvers_respect_marginals_on_unnormalised_costs():
    rng = np.random.default_rng(0)
    M = 1000.0 * rng.random((30, 45))  # exp(-M/0.01) would underflow without normalisation
    for solver in ("emd", "sinkhorn"):
        T, info = solve_ot(M, solver=solver)
        assert T.shape == (30, 45)
        assert np.allclose(T.sum(1), 1 / 30, rtol=1e-3) and np.allclose(T.sum(0), 1 / 45, rtol=1e-3)
        assert info["cost_scale"] == pytest.approx(M.max())
    with pytest.raises(OTMarginalError):
        solve_ot(M, solver="sinkhorn", num_itermax=1, marginal_rtol=1e-9)
    with pytest.raises(ValueError):
        solve_ot(np.array([[np.nan]]))
    with pytest.raises(ValueError):
        solve_ot(M, solver="greedy")
