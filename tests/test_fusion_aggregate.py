"""Multi-model aggregation (OHFL Sec. 3.5, Algorithm 1; Sec. 4.3) and upload validation."""
from __future__ import annotations

import json
import math

import pytest
import torch

from hfl_components.fusion import SiteModel, aggregate_models, validate_upload
from hfl_components.fusion._arch import spec_signature
from hfl_components.models.fusable import build_fusable

torch.set_num_threads(1)

BASE = {"family": "cnn", "width": 0.1, "in_channels": 1, "num_classes": 2}
PROBE = torch.rand(16, 1, 16, 16, generator=torch.Generator().manual_seed(0))


def _site(name, depth, n, acc, seed, width=0.1):
    torch.manual_seed(seed)
    spec = {**BASE, "depth": depth, "width": width}
    return {"name": name, "spec": spec, "state_dict": build_fusable(spec).state_dict(), "n_samples": n,
            "val_acc": acc}


@pytest.fixture(scope="module")
def sites():
    # two sites per depth as in the paper (Sec. 4.3), widths differing inside the shallow pair
    return [_site("site-1", "shallow", 80, 0.80, 1), _site("site-2", "shallow", 90, 0.70, 2, width=0.15),
            _site("site-3", "medium", 100, 0.90, 3), _site("site-4", "medium", 110, 0.75, 4),
            _site("site-5", "deep", 120, 0.85, 5), _site("site-6", "deep", 130, 0.60, 6)]


def _check_result(spec, sd, rec, n_pairs):
    m = build_fusable(spec)
    m.load_state_dict(sd)  # keys and shapes fit the returned spec
    assert all(torch.isfinite(v).all() for v in sd.values())
    assert len(rec["pairs"]) == n_pairs
    assert set(rec["phase_seconds"]) == {"cka", "alignment", "ot", "averaging", "repair"}
    assert all(v >= 0 for v in rec["phase_seconds"].values())
    assert math.isclose(sum(p["seconds"]["ot"] for p in rec["pairs"]), rec["phase_seconds"]["ot"], rel_tol=1e-9)
    json.dumps(rec)  # the alignment record is saved as JSON by the job


def test_cid_yields_deepest_and_cdd_shallowest_architecture(sites):
    spec, sd, rec = aggregate_models(sites, "cid", probe=PROBE)
    assert spec_signature(spec) == spec_signature({**BASE, "depth": "deep"})
    _check_result(spec, sd, rec, 5)
    assert rec["groups"] == [["site-1", "site-2"], ["site-3", "site-4"], ["site-5", "site-6"]]
    # cross-depth steps go shallow -> deep, the running model is the source, weights are cumulative counts
    cross = rec["pairs"][3:]
    assert [p["balancing"] for p in cross] == ["insert_identity", "insert_identity"]
    assert (cross[0]["weight_src"], cross[0]["weight_tgt"]) == (170, 210)
    assert (cross[1]["weight_src"], cross[1]["weight_tgt"]) == (380, 250)
    assert all(p["cost"] is not None and p["layer_map"][0] == [0, 0] for p in cross)
    # the shallow group takes the architecture of its widest member
    assert rec["pairs"][0]["tgt"] == "site-2" and rec["pairs"][0]["src"] == "site-1"

    spec, sd, rec = aggregate_models(sites, "cdd", probe=PROBE)
    assert spec_signature(spec) == spec_signature({**BASE, "depth": "shallow"})
    assert spec["width"] == 0.15  # the widest shallow site
    _check_result(spec, sd, rec, 5)
    assert [p["balancing"] for p in rec["pairs"][3:]] == ["merge", "merge"]


def test_cia_targets_most_accurate_and_rand_averages_onto_base(sites):
    spec, sd, rec = aggregate_models(sites, "cia", probe=PROBE, weighting="half")
    assert rec["order"] == ["site-6", "site-2", "site-4", "site-1", "site-5", "site-3"]  # val_acc low -> high
    assert spec == sites[2]["spec"]  # site-3 is the most accurate
    assert all((p["weight_src"], p["weight_tgt"]) == (0.5, 0.5) for p in rec["pairs"])
    _check_result(spec, sd, rec, 5)

    spec, sd, rec = aggregate_models(sites, "rand", probe=PROBE, seed=3)
    base = next(s for s in sites if s["name"] == rec["base"])
    assert spec == base["spec"]
    assert all(p["tgt"] == base["name"] for p in rec["pairs"])
    _check_result(spec, sd, rec, 5)
    assert aggregate_models(sites, "rand", probe=PROBE, seed=3)[2]["base"] == rec["base"]


def test_cumulative_sample_weights_give_the_sample_weighted_mean():
    # one neuron per layer: every OT plan is 1x1, so fusion reduces to weighted averaging and the expected result
    # can be written down directly: the sample-weighted mean (samples) or ((a + b)/2 + c)/2 (half).
    spec = {**BASE, "stages": [[1], [1], [1]], "hidden": [1, 1]}
    ms = []
    for k, n in enumerate((10, 30, 60)):
        torch.manual_seed(k)
        ms.append(SiteModel(f"s{k}", spec, build_fusable(spec).state_dict(), n, 0.5))
    _, sd, _ = aggregate_models(ms, "cid")
    for key in sd:
        expect = sum(m.n_samples * m.state_dict[key] for m in ms) / 100
        assert torch.allclose(sd[key], expect, atol=1e-6), key
    _, sd, _ = aggregate_models(ms, "cia", weighting="half")
    for key in sd:
        a, b, c = (m.state_dict[key] for m in ms)
        assert torch.allclose(sd[key], ((a + b) / 2 + c) / 2, atol=1e-6), key


def test_rand_is_the_sample_weighted_mean_of_every_pairwise_fusion():
    """RAND with one neuron per layer (every OT plan 1x1: a pairwise fusion is the weighted average of its two
    parents) and unequal sample counts. ``samples``: every site ends with weight n_k / N, the base included (it enters
    each of its n - 1 pairs with n_base / (n - 1)); ``half``: each pair is (x_k + x_base) / 2 and the n - 1 results
    are averaged equally. Either differs from the last pairwise fusion alone and from an unweighted mean."""
    spec = {**BASE, "stages": [[1], [1], [1]], "hidden": [1, 1]}
    counts = (10, 30, 60, 100)
    from tests.fusion_helpers import he_model

    ms = [SiteModel(f"s{k}", spec, he_model(spec, 10 + k, bias_range=0.5).state_dict(), n, 0.5)
          for k, n in enumerate(counts)]  # non-zero biases: every parameter tells the weightings apart
    _, sd, rec = aggregate_models(ms, "rand", seed=1)
    base = next(m for m in ms if m.name == rec["base"])
    others = [m for m in ms if m is not base]
    assert len(rec["pairs"]) == 3
    for key in sd:
        expect = sum(m.n_samples * m.state_dict[key] for m in ms) / sum(counts)
        assert torch.allclose(sd[key], expect, atol=1e-6), key
        last = (others[-1].n_samples * others[-1].state_dict[key] + base.n_samples / 3 * base.state_dict[key]) / (
            others[-1].n_samples + base.n_samples / 3)
        assert not torch.allclose(sd[key], last, atol=1e-3), key  # not the last pairwise fusion alone
    _, sd, _ = aggregate_models(ms, "rand", seed=1, weighting="half")
    for key in sd:
        expect = sum((m.state_dict[key] + base.state_dict[key]) / 2 for m in others) / 3
        assert torch.allclose(sd[key], expect, atol=1e-6), key


def test_aggregate_rejects_bad_input(sites):
    with pytest.raises(ValueError, match="strategy"):
        aggregate_models(sites, "fedavg", probe=PROBE)
    with pytest.raises(ValueError, match="val_acc"):
        aggregate_models([{**sites[0], "val_acc": None}, sites[1]], "cia")
    with pytest.raises(ValueError, match="probe"):
        aggregate_models(sites[:1] + sites[4:5], "cid")  # different depths need CKA on a probe
    spec, sd, rec = aggregate_models(sites[:1], "cid")
    assert spec == sites[0]["spec"] and rec["pairs"] == []


def test_validate_upload_rejects_nan_and_shape_mismatch_and_the_job_completes(sites):
    good = sites[0]
    assert set(validate_upload(good["spec"], good["state_dict"], good["n_samples"])) == set(good["state_dict"])
    nan_sd = {k: v.clone() for k, v in sites[1]["state_dict"].items()}
    nan_sd["fcs.0.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="fcs.0.weight.*non-finite"):
        validate_upload(sites[1]["spec"], nan_sd, 90)
    wrong = {**sites[2]["spec"], "width": 0.2}  # spec says one width, weights have another
    with pytest.raises(ValueError, match="shape"):
        validate_upload(wrong, sites[2]["state_dict"], 100)
    with pytest.raises(ValueError, match="missing"):
        validate_upload(good["spec"], {k: v for k, v in good["state_dict"].items() if k != "classifier.bias"}, 5)
    with pytest.raises(ValueError, match="unexpected"):
        validate_upload(good["spec"], {**good["state_dict"], "extra.weight": torch.zeros(1)}, 5)
    with pytest.raises(ValueError, match="unknown model spec"):
        validate_upload({"family": "resnet18"}, good["state_dict"], 5)
    with pytest.raises(ValueError, match="invalid model spec"):
        validate_upload({**good["spec"], "depth": "huge"}, good["state_dict"], 5)
    for n in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="sample count"):
            validate_upload(good["spec"], good["state_dict"], n)
    # server side: bad uploads are excluded with a reason, the rest are fused
    uploads = [sites[0], {**sites[1], "state_dict": nan_sd}, {**sites[2], "spec": wrong}, sites[4], sites[5]]
    accepted, rejected = [], {}
    for u in uploads:
        try:
            accepted.append({**u, "state_dict": validate_upload(u["spec"], u["state_dict"], u["n_samples"])})
        except ValueError as e:
            rejected[u["name"]] = str(e)
    assert sorted(rejected) == ["site-2", "site-3"]
    spec, sd, rec = aggregate_models(accepted, "cid", probe=PROBE)
    assert spec_signature(spec) == spec_signature({**BASE, "depth": "deep"})
    assert rec["order"] == ["site-1", "site-5", "site-6"]
