"""Group merge (C2M3-style, ``fusion_order="group"``): K same-architecture models merged at once into one
cycle-consistent universe (``hfl_components.fusion.group_merge``), then pairwise across architectures."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from hfl_components.flare.options import OptionError
from hfl_components.fusion import aggregate_models, fuse_pair
from hfl_components.fusion.group_merge import match_group, merge_group
from hfl_components.models.fusable import resolve_fusable_spec
from tests.fusion_helpers import forward, he_model

torch.set_num_threads(1)
SPEC = {"family": "cnn", "depth": "medium", "width": 0.1, "in_channels": 1, "num_classes": 2}
X = torch.rand(8, 1, 32, 32, generator=torch.Generator().manual_seed(5))


def _layers(spec):
    """[(name, kind, is_output)] of the weight layers in forward order, from the resolved spec (written out here,
    not taken from the fusion code)."""
    r = resolve_fusable_spec(spec)
    out = [(f"convs.{i}", "conv", False) for i in range(sum(len(s) for s in r["stages"]))]
    out += [(f"fcs.{j}", "fc", False) for j in range(len(r["hidden"]))]
    return out + [("classifier", "fc", True)], r["pool"] ** 2


def _plant(spec, sd, seed):
    """A copy computing the same function: in every hidden layer new unit r is old unit perm[r] (rows permuted,
    the next layer's input columns permuted alike; at conv -> fc every channel's pool² columns move together).
    Returns (state dict, [perm per hidden layer])."""
    layers, pool2 = _layers(spec)
    g = torch.Generator().manual_seed(seed)
    out, perms, prev, prev_kind = {}, [], None, "conv"
    for name, kind, is_out in layers:
        w, b = sd[f"{name}.weight"].clone(), sd[f"{name}.bias"].clone()
        if prev is not None:
            cols = prev
            if kind == "fc" and prev_kind == "conv":
                cols = torch.tensor([int(c) * pool2 + q for c in prev for q in range(pool2)])
            w = w[:, cols]
        if not is_out:
            prev = torch.randperm(w.shape[0], generator=g)
            w, b = w[prev], b[prev]
            perms.append(prev.numpy())
        out[f"{name}.weight"], out[f"{name}.bias"] = w, b
        prev_kind = kind
    return out, perms


@pytest.fixture(scope="module")
def base():
    return he_model(SPEC, 0, bias_range=0.2).state_dict()


@pytest.mark.parametrize("metric", ["acts", "wts"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_permuted_copies_merge_back_to_the_model(base, k, metric):
    """k copies of one model, each with its hidden units randomly permuted: the universe is the first copy's
    labelling, every copy's matching is the inverse of its planted permutation, and the merge is the model."""
    planted = [_plant(SPEC, base, seed) for seed in range(k)]
    members = [(SPEC, sd) for sd, _ in planted]
    weights = [10.0 * (i + 1) for i in range(k)]
    spec, sd, rec = merge_group(members, weights, [X] * k, ground_metric=metric, repair="none")
    assert rec["converged"] and rec["changes"][-1] == 0
    for key in base:
        torch.testing.assert_close(sd[key], planted[0][0][key], rtol=0, atol=1e-6)
    torch.testing.assert_close(forward(spec, sd, X), forward(SPEC, base, X), rtol=0, atol=1e-5)
    perms, _ = match_group(members, weights, [X] * k, ground_metric=metric)
    for (_, p_planted), p_k in zip(planted, perms):
        for layer, (pp, pk) in enumerate(zip(p_planted, p_k)):
            # copy k's unit r is old unit pp[r]; copy 0's unit u is old unit planted[0][1][layer][u]
            want = np.array([int(np.flatnonzero(planted[0][1][layer] == pp[r])[0]) for r in range(len(pp))])
            assert np.array_equal(pk, want), layer


def _matching(perms, a, b, layer):
    """Unit i of model a -> the unit of model b matched to it through the universe."""
    inv_b = np.argsort(perms[b][layer])
    return inv_b[perms[a][layer]]


def test_cycle_consistency_on_a_planted_case_and_by_construction(base):
    planted = [_plant(SPEC, base, seed) for seed in (11, 12, 13)]
    perms, _ = match_group([(SPEC, sd) for sd, _ in planted], [1.0, 1.0, 1.0], [X] * 3)
    for layer in range(len(perms[0])):
        ab, bc, ac = (_matching(perms, 0, 1, layer), _matching(perms, 1, 2, layer), _matching(perms, 0, 2, layer))
        assert np.array_equal(bc[ab], ac)
        # the planted truth: unit r of A is old unit pa[r]; the unit of C holding old unit pa[r]
        pa, pc = planted[0][1][layer], planted[2][1][layer]
        truth = np.array([int(np.flatnonzero(pc == pa[r])[0]) for r in range(len(pa))])
        assert np.array_equal(ac, truth)
    # three independently drawn models: the matchings still compose (one universe)
    indep = [(SPEC, he_model(SPEC, s, bias_range=0.2).state_dict()) for s in (1, 2, 3)]
    perms, info = match_group(indep, [3.0, 1.0, 2.0], [X] * 3)
    assert info["converged"]
    for layer in range(len(perms[0])):
        ab, bc, ac = (_matching(perms, 0, 1, layer), _matching(perms, 1, 2, layer), _matching(perms, 0, 2, layer))
        assert np.array_equal(bc[ab], ac)


def test_order_invariance(base):
    """The planted group with another copy first gives the same function; aggregate_models with the uploads in a
    shuffled order gives the same global model (members are taken in name order)."""
    planted = [(SPEC, _plant(SPEC, base, seed)[0]) for seed in (21, 22, 23)]
    ref = forward(SPEC, merge_group(planted, [1.0, 2.0, 3.0], [X] * 3)[1], X)
    for order in ([2, 0, 1], [1, 2, 0]):
        sd = merge_group([planted[i] for i in order], [[1.0, 2.0, 3.0][i] for i in order], [X] * 3)[1]
        torch.testing.assert_close(forward(SPEC, sd, X), ref, rtol=0, atol=1e-5)
    sites = _sites()
    spec, sd, _ = aggregate_models(sites, probe=X, ground_metric="acts", repair="channel", fusion_order="group")
    shuffled = sites[:]
    random.Random(0).shuffle(shuffled)
    spec2, sd2, _ = aggregate_models(shuffled, probe=X, ground_metric="acts", repair="channel", fusion_order="group")
    assert spec2 == spec
    torch.testing.assert_close(forward(spec2, sd2, X), forward(spec, sd, X), rtol=0, atol=1e-6)


def test_a_group_of_one_is_unchanged(base):
    spec, sd, rec = merge_group([(SPEC, base)], [7.0], None, ground_metric="acts", repair="channel")
    assert spec == SPEC and rec["sweeps"] == 0
    assert all(torch.equal(sd[k], base[k]) for k in base)
    # every architecture alone: the group order fuses exactly as the pairwise order
    sites = [_site("a", "shallow", 50, 1), _site("b", "medium", 60, 2), _site("c", "deep", 70, 3)]
    kw = dict(probe=X, ground_metric="acts", repair="channel")
    _, sd_p, _ = aggregate_models(sites, **kw)
    _, sd_g, rec = aggregate_models(sites, fusion_order="group", **kw)
    assert rec["group_merges"] == [] and all(torch.equal(sd_p[k], sd_g[k]) for k in sd_p)


def test_weights_are_proportional_to_samples_on_a_hand_case(base):
    """Two models whose units already correspond (the second is the first plus a small perturbation): no unit moves,
    and the merge is the sample-weighted average 30 : 10 of the raw tensors."""
    g = torch.Generator().manual_seed(3)
    other = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    perms, _ = match_group([(SPEC, base), (SPEC, other)], [30, 10], [X, X])
    assert all(np.array_equal(p, np.arange(len(p))) for p in perms[1])
    for metric in ("acts", "wts"):
        _, sd, rec = merge_group([(SPEC, base), (SPEC, other)], [30, 10], [X, X], ground_metric=metric)
        assert rec["weights"] == [0.75, 0.25]
        for k in base:
            torch.testing.assert_close(sd[k], 0.75 * base[k] + 0.25 * other[k], rtol=0, atol=1e-7)
    # through aggregate_models: the sites' sample counts are the weights
    sites = [{"name": "s1", "spec": SPEC, "state_dict": base, "n_samples": 30},
             {"name": "s2", "spec": SPEC, "state_dict": other, "n_samples": 10}]
    _, sd, rec = aggregate_models(sites, probe=X, ground_metric="acts", fusion_order="group")
    assert rec["pairs"] == [] and rec["group_merges"][0]["members"] == ["s1", "s2"]
    for k in base:
        torch.testing.assert_close(sd[k], 0.75 * base[k] + 0.25 * other[k], rtol=0, atol=1e-7)


def _site(name, depth, n, seed, width=0.1):
    spec = {**SPEC, "depth": depth, "width": width}
    return {"name": name, "spec": spec, "state_dict": he_model(spec, seed, bias_range=0.2).state_dict(),
            "n_samples": n}


def _sites():
    """Three shallow sites of one architecture, one shallow of another width, one medium, one deep."""
    return [_site("site-1", "shallow", 40, 1), _site("site-2", "shallow", 50, 2), _site("site-3", "shallow", 60, 3),
            _site("site-4", "shallow", 70, 4, width=0.15), _site("site-5", "medium", 80, 5),
            _site("site-6", "deep", 90, 6)]


def test_group_order_merges_each_architecture_then_fuses_pairwise():
    sites = _sites()
    spec, sd, rec = aggregate_models(sites, probe=X, ground_metric="acts", repair="channel", fusion_order="group")
    assert spec == sites[5]["spec"]  # cid: the deepest architecture
    assert [m["members"] for m in rec["group_merges"]] == [["site-1", "site-2", "site-3"]]
    assert rec["group_merges"][0]["weights"] == pytest.approx([40 / 150, 50 / 150, 60 / 150])
    # the merged three fused into the wider shallow site, then shallow -> medium -> deep
    assert [(p["src"], p["tgt"]) for p in rec["pairs"]][0] == ("merge[site-1+site-2+site-3]", "site-4")
    assert (rec["pairs"][0]["weight_src"], rec["pairs"][0]["weight_tgt"]) == (150, 70)
    assert len(rec["pairs"]) == 3 and rec["fusion_order"] == "group"
    assert rec["groups"] == [["site-1", "site-2", "site-3", "site-4"], ["site-5"], ["site-6"]]
    assert all(torch.isfinite(v).all() for v in sd.values())
    json.dumps(rec)  # the job saves the record as JSON
    assert rec["probe_passes"] >= rec["group_merges"][0]["probe_passes"] == 3
    with pytest.raises(ValueError, match="strategy 'cia' has no such groups"):
        aggregate_models([{**s, "val_acc": 0.5} for s in sites], "cia", probe=X, fusion_order="group")


def test_two_models_of_one_architecture_give_the_pairwise_result():
    """K = 2: the matching is the pairwise assignment, so the group order changes nothing but rounding."""
    sites = [_site("a", "shallow", 50, 1), _site("b", "shallow", 70, 2), _site("c", "deep", 90, 3)]
    for kw in (dict(ground_metric="acts", repair="channel"), dict(ground_metric="wts", repair="none")):
        spec_p, sd_p, _ = aggregate_models(sites, probe=X, **kw)
        spec_g, sd_g, _ = aggregate_models(sites, probe=X, fusion_order="group", **kw)
        assert spec_p == spec_g
        torch.testing.assert_close(forward(spec_g, sd_g, X), forward(spec_p, sd_p, X), rtol=0, atol=1e-5)


def test_unknown_fusion_order_is_refused_in_one_line():
    from hfl_components.flare.catalogue import option_defaults, validate_options

    with pytest.raises(OptionError) as e:
        validate_options("ohfl", {"fusion_order": "bogus"}, require=False)
    msg = str(e.value)
    assert "fusion_order" in msg and "'bogus'" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="fusion_order must be one of .* got 'bogus'"):
        aggregate_models([_site("a", "shallow", 1, 1)], probe=X, fusion_order="bogus")
    assert option_defaults("ohfl")["fusion_order"] == "pairwise"
    # group with a strategy that has no depth groups: refused when the job starts, before any site trains
    from tests.fusion_helpers import ohfl_controller

    with pytest.raises(ValueError, match="fusion_order='group' .* strategy 'rand'"):
        ohfl_controller(strategy="rand", fusion_order="group", probe="generated").check_options()
    ohfl_controller(strategy="cdd", fusion_order="group", probe="generated").check_options()


def test_default_off_is_todays_pairwise_fusion_bit_for_bit():
    """No fusion_order (the default) equals the cid chain written out with fuse_pair: the same-depth pair fused
    into its first member by name (equal widths), then shallow -> deep; and the controller's default is pairwise."""
    from tests.fusion_helpers import ohfl_controller

    sites = [_site("a", "shallow", 50, 1), _site("b", "shallow", 70, 2), _site("c", "deep", 90, 3)]
    spec, sd, rec = aggregate_models(sites, probe=X, seed=0)
    a, b, c = ((s["spec"], s["state_dict"]) for s in sites)
    _, sd_ab, _ = fuse_pair(b, a, X, 70, 50, seed=0)
    _, sd_abc, _ = fuse_pair((a[0], sd_ab), c, X, 120, 90, seed=1)
    assert spec == c[0] and "group_merges" not in rec
    assert all(torch.equal(sd[k], sd_abc[k]) for k in sd)
    kw = dict(probe=X, ground_metric="acts", repair="channel")
    sd1, sd2 = aggregate_models(sites, **kw)[1], aggregate_models(sites, fusion_order="pairwise", **kw)[1]
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert ohfl_controller().fusion_order == "pairwise"


def test_the_study_arms_are_valid_variants_and_the_summary_reads_a_run(tmp_path):
    from nvflare_jobs.compare.plan import check_variant
    from studies.group_merge.run import ARMS, FULL_ARMS, futile, fusion_summary, summarise_seed

    assert all(check_variant(m) is None for m in (*ARMS.values(), *FULL_ARMS.values()))
    assert all(r.get("missing") for r in summarise_seed(tmp_path, 0, False)["arms"].values())
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"server_seconds": {"fusion_total": 4.5}}))
    rec = {"pairs": [{}, {}], "group_merges": [{"members": ["site-1", "site-2", "site-3"], "sweeps": 2,
                                                 "converged": True, "changes": [1, 0], "seconds": {}}]}
    (run / "alignment_record.json").write_text(json.dumps({"cnn": rec}))
    got = fusion_summary(run)
    assert got["fusion_total_s"] == 4.5 and got["pairwise_steps"] == 2
    assert got["group_merges"] == [{"members": ["site-1", "site-2", "site-3"], "sweeps": 2, "converged": True,
                                    "changes": [1, 0]}]
    assert futile({"arms": {"ohfl_group": {"auc": 0.879}, "ohfl": {"auc": 0.9}}})
    assert not futile({"arms": {"ohfl_group": {"auc": 0.881}, "ohfl": {"auc": 0.9}}})


def test_the_controller_passes_its_fusion_order_to_the_fusion(monkeypatch):
    import hfl_components.fusion as fusion
    from tests.fusion_helpers import ohfl_controller

    seen = {}

    def fake(models, **kw):
        seen.update(kw)
        return {}, {}, {}

    monkeypatch.setattr(fusion, "aggregate_models", fake)
    ctl = ohfl_controller(fusion_order="group", probe="generated")
    ctl._fuse_group([{"input_size": 32}], {32: X}, "cpu")
    assert seen["fusion_order"] == "group" and seen["strategy"] == "cid"
