"""The fast server fusion path against independent slow computations.

Each fast piece is compared with a computation that does not share its code: per-layer statistics from a
hand-written layer-by-layer forward pass (instead of hooks), layer-by-layer repair with one truncated forward pass
per layer after rewriting the weights (the previous implementation), dense plan products (instead of the sparse
scatter-add), fresh probe passes on the stored weights (instead of statistics cached from the repair pass), and
``torch.cdist`` on hand-computed float64 pre-activations (instead of the vectorised ``acts`` cost on cached
float32 activations).
"""
from __future__ import annotations

import numpy as np
import ot
import pytest
import torch

from hfl_components.fusion import aggregate_models, fuse_pair
from hfl_components.fusion.cka import centred_gram, cka_cost_matrix
from hfl_components.fusion.ot_fusion import acts_cost, ot_fuse_balanced, plan_t_matmul, solve_ot
from hfl_components.fusion.probe_stats import StatsCache, hidden_layer_stats
from hfl_components.fusion.repair import repair_channels, repair_scales
from hfl_components.models.fusable import build_fusable

torch.set_num_threads(1)
SPEC = {"family": "cnn", "depth": "medium", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _model(spec, seed):
    torch.manual_seed(seed)
    m = build_fusable(spec)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.05)  # non-zero biases: the per-channel means differ from zero
        m.classifier.weight.normal_(0, 0.1)
    return m.eval()


def _probe(n=12, size=32, seed=0):
    return torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _manual_preacts(m, x) -> list[torch.Tensor]:
    """Pre-activations of every hidden layer, written out layer by layer (no hooks), float64 for the reference."""
    x = (x.double() - m.INPUT_MEAN) / m.INPUT_STD
    out, i = [], 0
    for stage in m.stages:
        for _ in stage:
            conv = m.convs[i]
            y = torch.nn.functional.conv2d(x, conv.weight.double(), conv.bias.double(), padding=1)
            out.append(y)
            x = torch.relu(y)
            i += 1
        x = torch.nn.functional.max_pool2d(x, 2)
    x = torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, m.pool), 1)
    for fc in m.fcs:
        y = x @ fc.weight.double().T + fc.bias.double()
        out.append(y)
        x = torch.relu(y)
    return out


def test_one_hooked_pass_gives_every_layers_statistics():
    m, probe = _model(SPEC, 0), _probe()
    ref = _manual_preacts(m, probe)
    got = hidden_layer_stats(m, probe, ["stds", "channel", "gram_linear", "gram_pooled", "gram_debiased"])
    assert len(ref) == len(got["stds"]) == len(m.layers()) - 1
    for k, y in enumerate(ref):
        n = y.shape[0]
        flat = y.reshape(n, -1)
        assert got["stds"][k] == pytest.approx(float(flat.std()), rel=1e-5)
        ch = y.transpose(0, 1).reshape(y.shape[1], -1)
        assert torch.allclose(got["channel"][k][0], ch.mean(1), rtol=1e-5, atol=1e-6)
        assert torch.allclose(got["channel"][k][1], ch.std(1), rtol=1e-5, atol=1e-6)
        K = (flat @ flat.T).numpy()
        H = np.eye(n) - 1.0 / n
        np.testing.assert_allclose(got["gram_debiased"][k], K, rtol=1e-5, atol=1e-6 * np.abs(K).max())
        np.testing.assert_allclose(got["gram_linear"][k], H @ K @ H, rtol=1e-4, atol=1e-5 * np.abs(K).max())
        pooled = y.reshape(n, y.shape[1], -1).mean(2) if y.dim() == 4 else y
        Kp = (pooled @ pooled.T).numpy()
        np.testing.assert_allclose(got["gram_pooled"][k], H @ Kp @ H, rtol=1e-4, atol=1e-5 * np.abs(Kp).max())
    # the model is left as it was: default memory format, eval flag restored
    assert m.convs[1].weight.is_contiguous()


def test_cka_cost_matrix_matches_grams_of_manual_activations():
    a, b = _model(SPEC, 1), _model({**SPEC, "depth": "deep"}, 2)
    probe = _probe(16)
    ra, rb = _manual_preacts(a, probe), _manual_preacts(b, probe)
    want = np.array([[1.0 - _cka(x, y) for y in rb] for x in ra])
    np.testing.assert_allclose(cka_cost_matrix(a, b, probe), want, atol=1e-6)


def _cka(x, y) -> float:
    Kc, Lc = centred_gram(x.float()), centred_gram(y.float())
    return float(np.sum(Kc * Lc) / np.sqrt(np.sum(Kc * Kc) * np.sum(Lc * Lc)))


def _slow_repair_scales(spec, sd, goal, probe):
    """The previous layer-by-layer implementation: rescale layer k's weights, then a forward pass truncated at
    layer k+1 to measure its std."""
    m = build_fusable(spec)
    m.load_state_dict(sd)
    m.eval()
    scales = []
    for k, info in enumerate(m.layers()[:-1]):
        cur = float(_manual_preacts(m, probe)[k].std())
        s = min(max(goal[k] / cur, 0.01), 100.0)
        with torch.no_grad():
            info.module.weight.mul_(s)
            info.module.bias.mul_(s)
        scales.append(s)
    return m.state_dict(), scales


def test_one_pass_layer_repair_equals_layer_by_layer_repair():
    m, probe = _model(SPEC, 3), _probe(16, seed=3)
    g = np.random.default_rng(0)
    goal = [s * float(g.uniform(0.3, 3.0)) for s in hidden_layer_stats(m, probe, ["stds"])["stds"]]
    sd, scales = repair_scales(SPEC, m.state_dict(), goal, probe)
    ref_sd, ref_scales = _slow_repair_scales(SPEC, m.state_dict(), goal, probe)
    np.testing.assert_allclose(scales, ref_scales, rtol=1e-5)
    assert all(abs(s - 1.0) > 0.05 for s in scales[:2])  # the test exercises real rescaling
    for k in sd:
        assert torch.allclose(sd[k], ref_sd[k], rtol=1e-5, atol=1e-6 * float(ref_sd[k].abs().max())), k


def _slow_repair_channels(spec, sd, goals, probe, eps=1e-8):
    m = build_fusable(spec)
    m.load_state_dict(sd)
    m.eval()
    for k, info in enumerate(m.layers()[:-1]):
        y = _manual_preacts(m, probe)[k]
        ch = y.transpose(0, 1).reshape(y.shape[1], -1)
        mu, st = ch.mean(1), ch.std(1)
        mu_g, sd_g = goals[k]
        live = (st > eps) & (sd_g > eps)
        s = torch.where(live, (sd_g / st).clamp(0.01, 100.0), torch.ones_like(st))
        shift = torch.where(live, mu_g - s * mu, torch.zeros_like(mu))
        w, b = info.module.weight, info.module.bias
        with torch.no_grad():
            w.mul_(s.float().reshape(-1, *([1] * (w.dim() - 1))))
            b.copy_((s * b.double() + shift).float())
    return m.state_dict()


def test_one_pass_channel_repair_equals_layer_by_layer_repair():
    m, probe = _model(SPEC, 4), _probe(16, seed=4)
    g = torch.Generator().manual_seed(1)
    goals = [(mu + 0.1 * torch.randn(mu.shape, generator=g, dtype=torch.float64),
              st * (0.5 + torch.rand(st.shape, generator=g, dtype=torch.float64)))
             for mu, st in hidden_layer_stats(m, probe, ["channel"])["channel"]]
    sd, _ = repair_channels(SPEC, m.state_dict(), goals, probe)
    ref = _slow_repair_channels(SPEC, m.state_dict(), goals, probe)
    for k in sd:
        assert torch.allclose(sd[k], ref[k], rtol=1e-4, atol=1e-5 * float(ref[k].abs().max())), k


def test_square_exact_plan_is_a_permutation_of_minimal_cost():
    """Square exact OT (uniform marginals) is an assignment: the plan is P / n with the brute-force optimum's cost."""
    import itertools
    rng = np.random.default_rng(0)
    M = ot.dist(rng.normal(size=(6, 5)), rng.normal(size=(6, 5)), metric="euclidean")
    T, info = solve_ot(M, "emd")
    assert info["marginal_rel_err"] < 1e-12 and np.count_nonzero(T) == 6
    np.testing.assert_allclose(T[T > 0], 1 / 6)
    best = min(sum(M[i, p[i]] for i in range(6)) for p in itertools.permutations(range(6)))
    assert float((T * M).sum()) * 6 == pytest.approx(best, rel=1e-12)


def _cdist_acts(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """The pre-change ``acts`` cost: (n, C, H, W) maps pooled to the smaller side, (C, n·h·w) float64 rows, cdist."""
    if a.dim() == 4:
        side = min(a.shape[-1], b.shape[-1])
        a, b = (torch.nn.functional.adaptive_avg_pool2d(x, side) if x.shape[-1] != side else x for x in (a, b))
    xa = a.transpose(0, 1).reshape(a.shape[1], -1).double()
    xb = b.transpose(0, 1).reshape(b.shape[1], -1).double()
    return torch.cdist(xa, xb).numpy()


@pytest.mark.parametrize("size_tgt", [32, 64])
def test_acts_cost_of_cached_activations_equals_cdist_of_manual_preactivations(size_tgt):
    """The vectorised cost on the hooked pass's float32 activations (channels-last, cached) against cdist on
    float64 pre-activations written out layer by layer; at a larger target probe the conv maps are pooled."""
    ms, mt = _model(SPEC, 1), _model({**SPEC, "width": 0.5}, 2)
    x = _probe(12, 32, seed=3)
    xt = torch.nn.functional.interpolate(x, size=size_tgt, mode="bilinear", align_corners=False)
    got_s = hidden_layer_stats(ms, x, ["acts"])["acts"]
    got_t = hidden_layer_stats(mt, xt, ["acts"])["acts"]
    ref_s, ref_t = _manual_preacts(ms, x), _manual_preacts(mt, xt)
    assert len(got_s) == len(ref_s) == len(ms.layers()) - 1
    for k, (a, b, ra, rb) in enumerate(zip(got_s, got_t, ref_s, ref_t)):
        M, R = acts_cost(a, b), _cdist_acts(ra, rb)
        assert M.shape == (ra.shape[1], rb.shape[1]) and M.dtype == np.float64
        np.testing.assert_allclose(M, R, rtol=1e-5, atol=1e-6 * R.max(), err_msg=f"layer {k}")
    # exact float64 inputs: the expansion equals cdist to rounding
    a, b = ref_s[0], ref_t[0]
    np.testing.assert_allclose(acts_cost(a, b), _cdist_acts(a, b), rtol=1e-10)
    with pytest.raises(ValueError, match="same probe images"):
        acts_cost(got_s[0][:5], got_t[0])


def test_acts_fusion_recovers_a_permuted_copy_with_cached_activations():
    """'acts' OT on a neuron-permuted, slightly perturbed copy: the plans are the permutations (found from cached
    activations given by the caller and from the ones computed inside alike), so the fusion is the original."""
    from hfl_components.fusion._arch import layer_table
    m = _model(SPEC, 4)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    rows = layer_table(SPEC)
    perm_sd, perms, prev = {}, [], None
    g = torch.Generator().manual_seed(0)
    for r in rows:
        w, b = sd[f"{r.name}.weight"], sd[f"{r.name}.bias"]
        if prev is not None:
            if r.kind == "fc" and w.shape[1] != prev.numel():  # conv -> fc: channel-major flatten
                hw = w.shape[1] // prev.numel()
                idx = (prev[:, None] * hw + torch.arange(hw)[None]).reshape(-1)
                w = w[:, idx]
            else:
                w = w[:, prev]
        p = torch.arange(w.shape[0]) if r.is_output else torch.randperm(w.shape[0], generator=g)
        perm_sd[f"{r.name}.weight"], perm_sd[f"{r.name}.bias"] = w[p].clone(), b[p].clone()
        perms.append(p)
        prev = p
    x = _probe(16, 32, seed=7)
    mp = build_fusable(SPEC)
    mp.load_state_dict(perm_sd)
    acts_s = hidden_layer_stats(mp, x, ["acts"])["acts"]
    acts_t = hidden_layer_stats(m, x, ["acts"])["acts"]
    outs = []
    for given in (True, False):
        plans: list = []
        fused, recs, _ = ot_fuse_balanced(SPEC, perm_sd, SPEC, sd, 1.0, 3.0, ground_metric="acts", probe=x,
                                          plans=plans, acts_src=acts_s if given else None,
                                          acts_tgt=acts_t if given else None)
        for Tb, p in zip(plans, perms):  # source neuron i is target neuron p[i]
            assert torch.equal(Tb.argmax(1), p) and torch.allclose(Tb.sum(0), torch.ones(Tb.shape[1],
                                                                                         dtype=torch.float64))
        outs.append(fused)
    for k in sd:
        assert torch.allclose(outs[0][k], sd[k], rtol=1e-5, atol=1e-6), k
        assert torch.equal(outs[0][k], outs[1][k]), k


def test_sparse_plan_product_equals_dense_product():
    rng = np.random.default_rng(1)
    X = torch.from_numpy(rng.normal(size=(9, 4, 3, 3)))
    for M in (rng.random((9, 9)), rng.random((9, 5)), rng.random((9, 13))):
        T = torch.from_numpy(solve_ot(M, "emd")[0])
        assert torch.allclose(plan_t_matmul(T, X), torch.einsum("ij,i...->j...", T, X), rtol=1e-12, atol=0)
    T = torch.from_numpy(solve_ot(rng.random((9, 6)), "sinkhorn", reg=0.5)[0])  # dense plan: dense product
    assert torch.allclose(plan_t_matmul(T, X), torch.einsum("ij,i...->j...", T, X), rtol=1e-12, atol=0)


@pytest.mark.parametrize("repair,cka,metric", [("layer", "linear", "wts"), ("channel", "pooled", "wts"),
                                                ("layer", "linear", "acts")])
def test_aggregate_with_cached_statistics_equals_fresh_passes(repair, cka, metric):
    """aggregate_models reuses statistics (one pass per model, fused models' statistics from their repair pass);
    chaining fuse_pair with no reuse and a fresh cache per pair probes the stored weights every time."""
    depths = ["shallow", "shallow", "medium", "deep"]
    models = [{"name": f"site-{k + 1}", "spec": {**SPEC, "depth": d}, "n_samples": 10 + k,
               "state_dict": _model({**SPEC, "depth": d}, 10 + k).state_dict()} for k, d in enumerate(depths)]
    probe = _probe(16, seed=5)
    spec, sd, rec = aggregate_models(models, "cid", probe=probe, repair=repair, cka=cka, ground_metric=metric)
    assert set(rec["phase_seconds"]) == {"cka", "alignment", "ot", "averaging", "repair"}

    def pair(src, tgt):
        return fuse_pair(src[:2], tgt[:2], probe, src[2], tgt[2], repair=repair, cka=cka, reuse=False,
                         stats_cache=StatsCache(), ground_metric=metric)
    s = [(m["spec"], m["state_dict"], m["n_samples"]) for m in models]
    f12 = pair(s[1], s[0])  # same-depth group: site-2 into site-1, then the chain by depth
    f123 = pair((f12[0], f12[1], s[0][2] + s[1][2]), s[2])
    f = pair((f123[0], f123[1], s[0][2] + s[1][2] + s[2][2]), s[3])
    assert [p["layer_map"] for p in rec["pairs"]] == [r[2]["layer_map"] for r in (f12, f123, f)]
    np.testing.assert_allclose(rec["pairs"][2]["cost"], f[2]["cost"], atol=1e-6)
    for k in sd:
        assert torch.allclose(sd[k], f[1][k], rtol=1e-4, atol=1e-5 * float(f[1][k].abs().max())), k


def test_stats_cache_probes_each_model_once():
    models = [{"name": f"site-{k + 1}", "spec": SPEC, "n_samples": 10, "state_dict": _model(SPEC, 20 + k).state_dict()}
              for k in range(4)]
    _, _, rec = aggregate_models(models, "rand", probe=_probe(8), repair="layer")
    # rand: the base is the target of all 3 fusions; 3 sources + the base = 4 passes (not 6)
    assert rec["probe_passes"] == 4


def test_acts_metric_probes_each_model_once_and_keeps_no_activations():
    """cid with 'acts' and layer repair on 2 shallow + 2 deep models: one pass per site model (activations,
    repair statistics and Grams together) and one for each balanced source; the fused models' activations come
    from their repair passes. Consumed models' activations are dropped from the cache."""
    specs = [{**SPEC, "depth": d} for d in ("shallow", "shallow", "deep", "deep")]
    models = [{"name": f"site-{k + 1}", "spec": sp, "n_samples": 10, "state_dict": _model(sp, 30 + k).state_dict()}
              for k, sp in enumerate(specs)]
    import hfl_components.fusion.aggregate as agg
    seen: list = []
    orig = agg.StatsCache

    class Spy(orig):
        def __init__(self):
            super().__init__()
            seen.append(self)
    agg.StatsCache = Spy
    try:
        _, _, rec = aggregate_models(models, "cid", probe=_probe(8), repair="layer", ground_metric="acts")
    finally:
        agg.StatsCache = orig
    assert rec["probe_passes"] == 4 + 1  # four site models + the balanced (inserted-identity) shallow fusion
    assert not any("acts" in e[2] for e in seen[0]._entries.values())


# ------------------------------- blocked statistics, threaded OT, aggregation against the previous implementation

def _old_channel_stats(y):
    """The previous implementation: a float64 copy, transposed and flattened, then mean / std."""
    y = y.double()
    y = y.transpose(0, 1).reshape(y.shape[1], -1)
    return y.mean(1), y.std(1)


@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "fc"])
def test_blocked_channel_stats_equal_float64_reference(layout, monkeypatch):
    """Per-neuron mean/std from float64 blocks (7 rows a block here, so many blocks and a partial last one) equal
    numpy's float64 mean / unbiased std of each channel's values, gathered by hand."""
    import hfl_components.fusion.probe_stats as ps

    monkeypatch.setattr(ps, "BLOCK_ROWS", 7)
    g = torch.Generator().manual_seed(3)
    y = torch.randn(5, 4, 6, 6, generator=g) * torch.tensor([0.1, 1.0, 3.0, 0.0]).view(1, -1, 1, 1) + 2.0
    if layout == "channels_last":
        y = y.contiguous(memory_format=torch.channels_last)
    elif layout == "fc":
        y = y[:, :, 0, 0].contiguous()
    mu, sd = ps.channel_stats(y)
    arr = y.numpy().astype(np.float64)
    for c in range(y.shape[1]):
        vals = arr[:, c].ravel()
        assert mu[c].item() == pytest.approx(vals.mean(), rel=1e-13, abs=1e-15)
        assert sd[c].item() == pytest.approx(vals.std(ddof=1), rel=1e-12, abs=1e-15)
    assert sd[3].item() == 0.0  # a constant channel has std 0 exactly


@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "fc"])
def test_blocked_affine_equals_float64_product(layout, monkeypatch):
    """The repair's y·s + shift, block by block, keeps y's shape and memory format and equals the float64
    product rounded to float32 of the previous implementation."""
    import hfl_components.fusion.repair as rp

    monkeypatch.setattr(rp, "BLOCK_ROWS", 5)
    g = torch.Generator().manual_seed(4)
    y = torch.randn(3, 4, 5, 5, generator=g)
    if layout == "channels_last":
        y = y.contiguous(memory_format=torch.channels_last)
    elif layout == "fc":
        y = y[:, :, 0, 0].contiguous()
    s = torch.tensor([0.5, 2.0, 1.0, 3.3], dtype=torch.float64)
    c = torch.tensor([0.1, -1.0, 0.0, 7.25], dtype=torch.float64)
    z = rp._affine_per_neuron(y, s, c)
    view = (1, -1) + (1,) * (y.dim() - 2)
    ref = (y.double() * s.reshape(view) + c.reshape(view)).float()
    assert z.shape == y.shape and z.stride() == y.stride()
    assert torch.allclose(z, ref, rtol=1.2e-7, atol=0)
    # spot check by hand: element (0, 1, ...) is 2 y - 1
    assert z.reshape(y.shape[0], y.shape[1], -1)[0, 1, 0].item() == pytest.approx(
        2.0 * y.reshape(y.shape[0], y.shape[1], -1)[0, 1, 0].item() - 1.0, rel=1e-6)


def test_threaded_acts_ot_equals_sequential_and_keeps_warnings_per_layer(monkeypatch):
    """The 'acts' layers solved in 2 threads give the same fused weights and plans as one by one; a solver warning
    of one layer is reported in that layer's record only, and the warnings machinery is left as it was."""
    import warnings

    import hfl_components.fusion.ot_fusion as of

    spec = {**SPEC, "depth": "shallow"}
    a, b = _model(spec, 41), _model(spec, 42)
    probe = _probe(10, seed=2)
    acts_a = hidden_layer_stats(a, probe, ["acts"])["acts"]
    acts_b = hidden_layer_stats(b, probe, ["acts"])["acts"]

    def fuse():
        plans: list = []
        sd, recs, _ = ot_fuse_balanced(spec, a.state_dict(), spec, b.state_dict(), 1.0, 2.0, ground_metric="acts",
                                       probe=probe, plans=plans, acts_src=acts_a, acts_tgt=acts_b)
        return sd, recs, plans

    monkeypatch.setattr(of, "OT_WORKERS", 1)
    sd1, recs1, plans1 = fuse()
    monkeypatch.setattr(of, "OT_WORKERS", 2)
    sd2, recs2, plans2 = fuse()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert all(torch.equal(p, q) for p, q in zip(plans1, plans2)) and len(plans1) == len(recs1) - 1
    assert recs1 == recs2

    real_emd, n_tgt = of.ot.emd, acts_b[1].shape[1]

    def noisy_emd(a_, b_, M, **kw):  # a warning for the second hidden layer's problem only
        if M.shape[1] == n_tgt and M.shape == (acts_a[1].shape[1], n_tgt):
            warnings.warn("iteration cap reached (test)")
        return real_emd(a_, b_, M, **kw)

    filters_before, show_before = list(warnings.filters), warnings.showwarning
    monkeypatch.setattr(of.ot, "emd", noisy_emd)
    sd3, recs3, _ = fuse()
    assert list(warnings.filters) == filters_before and warnings.showwarning is show_before
    assert all(torch.equal(sd1[k], sd3[k]) for k in sd1)
    flagged = [r["layer"] for r in recs3 if any("iteration cap" in w for w in r.get("warnings", []))]
    shapes = [(acts_a[i].shape[1], acts_b[i].shape[1]) for i in range(len(acts_a))]
    assert flagged == [recs3[i]["layer"] for i, s in enumerate(shapes) if s == shapes[1]]


def test_aggregate_at_the_defaults_equals_the_previous_implementation(monkeypatch):
    """Old vs new on small models at the server defaults (cid, acts, channel repair, per-size probes): the
    previous channel statistics, the previous float64 repair product and sequential OT give the same fused
    model as this code up to float rounding (its logits on other images agree to 1e-5 relative)."""
    import hfl_components.fusion.ot_fusion as of
    import hfl_components.fusion.probe_stats as ps
    import hfl_components.fusion.repair as rp

    depths_sizes = [("shallow", 32), ("shallow", 32), ("medium", 48), ("deep", 64)]
    models = []
    for k, (d, size) in enumerate(depths_sizes):
        sp = {**SPEC, "depth": d}
        models.append({"name": f"site-{k + 1}", "spec": sp, "n_samples": 10 + k, "input_size": size,
                       "state_dict": _model(sp, 50 + k).state_dict()})
    base = _probe(12, 64, seed=6)
    probe = {s: torch.nn.functional.interpolate(base, size=(s, s), mode="bilinear", align_corners=False)
             for s in (32, 48, 64)}
    opts = dict(strategy="cid", ground_metric="acts", repair="channel", cka="linear")
    spec, new, _ = aggregate_models(models, probe=probe, **opts)

    def old_affine(y, s, c):
        view = (1, -1) + (1,) * (y.dim() - 2)
        return (y.double() * s.reshape(view) + c.reshape(view)).to(y.dtype)
    monkeypatch.setattr(ps, "channel_stats", _old_channel_stats)
    monkeypatch.setattr(rp, "_channel_stats", _old_channel_stats)
    monkeypatch.setattr(rp, "_affine_per_neuron", old_affine)
    monkeypatch.setattr(of, "OT_WORKERS", 1)
    spec_o, old, _ = aggregate_models(models, probe=probe, **opts)
    assert spec == spec_o
    for k in old:
        assert torch.allclose(new[k], old[k], rtol=1e-5, atol=1e-6 * float(old[k].abs().max())), k
    x = _probe(20, 64, seed=7)
    ma, mb = build_fusable(spec), build_fusable(spec)
    ma.load_state_dict(new)
    mb.load_state_dict(old)
    with torch.no_grad():
        la, lb = ma(x), mb(x)
    assert torch.allclose(la, lb, rtol=1e-5, atol=1e-5 * float(lb.abs().max()))
