"""Fusion options: debiased / pooled CKA, per-neuron (REPAIR) repair, per-size probes, shared (nested)
initialisation really shared, the deployment gate, and ``simulate --paper``."""
from __future__ import annotations

from tests.fusion_helpers import ohfl_controller

import argparse

import numpy as np
import json

import pytest
import torch

from hfl_components.fusion import aggregate_models, fuse_pair
from hfl_components.fusion.cka import cka_cost_matrix, debiased_cka_from_grams, linear_cka, unbiased_hsic
from hfl_components.models.fusable import build_fusable, shared_init_state
from tests.fusion_helpers import forward, he_model
from tests.test_fusion_ot import permuted_copy

torch.set_num_threads(1)
SPEC = {"family": "cnn", "depth": "medium", "width": 0.25, "in_channels": 1, "num_classes": 2}


# ------------------------------------------------------------------------------------------------ CKA
def test_unbiased_hsic_matches_its_definition_on_a_hand_sized_case():
    rng = np.random.default_rng(0)
    X, Y = rng.normal(size=(6, 3)), rng.normal(size=(6, 2))
    K, L = X @ X.T, Y @ Y.T
    n = 6
    Kt, Lt = K - np.diag(np.diag(K)), L - np.diag(np.diag(L))
    one = np.ones(n)
    want = (np.trace(Kt @ Lt) + (one @ Kt @ one) * (one @ Lt @ one) / ((n - 1) * (n - 2))
            - 2 / (n - 2) * one @ Kt @ Lt @ one) / (n * (n - 3))
    assert unbiased_hsic(K, L) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="at least 4"):
        unbiased_hsic(K[:3, :3], L[:3, :3])


def test_debiased_cka_does_not_saturate_on_independent_features():
    """Independent non-negative features (post-ReLU-like) on 64 images: linear CKA reports high similarity,
    debiased CKA about 0; identical features give 1 for both."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 500, generator=g).abs()
    Y = torch.randn(64, 500, generator=g).abs()
    K, L = (X @ X.T).double().numpy(), (Y @ Y.T).double().numpy()
    assert linear_cka(X, Y) > 0.8
    assert debiased_cka_from_grams(K, L) < 0.05
    assert debiased_cka_from_grams(K, K) == pytest.approx(1.0)


def test_cost_matrix_kinds_and_per_model_probe_sizes():
    m = he_model(SPEC, 0, bias_range=0.2)
    x64 = torch.rand(12, 1, 64, 64)
    x32 = torch.nn.functional.avg_pool2d(x64, 2)
    for kind in ("linear", "debiased", "pooled"):
        C = cka_cost_matrix(m, m, x64, kind=kind)
        assert np.allclose(np.diag(C), 0.0, atol=1e-9), kind
    # the same model fed the same images at two sizes: its fc layers see nearly the same thing
    C = cka_cost_matrix(m, m, x64, x32)
    assert C.shape == (len(m.layers()) - 1,) * 2
    with pytest.raises(ValueError, match="same images"):
        cka_cost_matrix(m, m, x64, x32[:5])
    with pytest.raises(ValueError, match="cka must be"):
        cka_cost_matrix(m, m, x64, kind="rbf")


# ------------------------------------------------------------------------------------------------ repair
def test_channel_repair_sets_every_neurons_mean_and_std():
    from hfl_components.fusion.repair import hidden_channel_stats, repair_channels

    m = he_model(SPEC, 1, bias_range=0.2)
    probe = torch.rand(16, 1, 32, 32)
    stats = hidden_channel_stats(m, probe)
    g = torch.Generator().manual_seed(0)
    goals = [(mu + torch.randn(mu.shape, generator=g, dtype=torch.float64) * 0.1,
              sd * (0.5 + torch.rand(sd.shape, generator=g, dtype=torch.float64))) for mu, sd in stats]
    sd, _ = repair_channels(SPEC, m.state_dict(), goals, probe)
    m2 = build_fusable(SPEC)
    m2.load_state_dict(sd)
    for (mu, s), (gm, gs) in zip(hidden_channel_stats(m2, probe), goals):
        live = s > 1e-6
        assert torch.allclose(mu[live], gm[live], atol=1e-4)
        assert torch.allclose(s[live], gs[live], rtol=1e-4)


@pytest.mark.parametrize("repair", ["none", "layer", "channel"])
@pytest.mark.parametrize("ground_metric", ["wts", "acts"])
def test_permuted_copy_fuses_back_with_every_repair_and_per_size_probes(repair, ground_metric):
    """wts: exact even when the two copies are probed at different sizes (repair measures all three models on the
    target's probe). acts at different sizes compares pooled activations of different resolutions, which need not
    single out the permutation, so there both copies sit at one size (still through the per-size probe dict)."""
    torch.manual_seed(0)
    m = he_model(SPEC, 0, bias_range=0.2)
    sd = m.state_dict()
    x = torch.rand(16, 1, 64, 64)
    probes = {64: x, 32: torch.nn.functional.avg_pool2d(x, 2)}
    models = [{"name": "a", "spec": SPEC, "state_dict": sd, "n_samples": 3,
               "input_size": 32 if ground_metric == "wts" else 64},
              {"name": "b", "spec": SPEC, "state_dict": permuted_copy(SPEC, sd, 5), "n_samples": 1, "input_size": 64}]
    spec, fused, rec = aggregate_models(models, probe=probes, repair=repair, ground_metric=ground_metric)
    assert rec["probe_sizes"] == [32, 64] and rec["repair"] == repair
    for xs in probes.values():
        assert (forward(spec, fused, xs) - forward(SPEC, sd, xs)).abs().max() < 1e-4
    with pytest.raises(ValueError, match="no probe fits"):
        aggregate_models([dict(models[0], input_size=96), models[1]], probe=probes)


def test_channel_repair_restores_per_neuron_spread_of_two_unrelated_models():
    a, b = he_model(SPEC, 1, bias_range=0.2), he_model(SPEC, 2, bias_range=0.2)
    probe = torch.rand(16, 1, 32, 32)
    from hfl_components.fusion.repair import hidden_channel_stats

    _, plain, _ = fuse_pair((SPEC, a.state_dict()), (SPEC, b.state_dict()), probe, 1, 1, repair="none")
    _, fixed, _ = fuse_pair((SPEC, a.state_dict()), (SPEC, b.state_dict()), probe, 1, 1, repair="channel")

    def mean_std(sd):
        m = build_fusable(SPEC)
        m.load_state_dict(sd)
        return hidden_channel_stats(m, probe)[-1][1].mean().item()
    parents = 0.5 * (hidden_channel_stats(a, probe)[-1][1].mean() + hidden_channel_stats(b, probe)[-1][1].mean())
    assert mean_std(plain) < 0.9 * parents.item()
    assert mean_std(fixed) == pytest.approx(parents.item(), rel=0.05)


# ------------------------------------------------------------------------------------------------ shared init
def _runtime(tmp_path, site, spec, seed=0):
    from hfl_components.flare.site_tasks import SiteRuntime

    cfg = {"site": site, "threads": 1, "seed": seed, "data": {"labels": "binary", "manifest": "unused.csv"},
           "model": spec, "input_size": 32}
    return SiteRuntime(cfg, tmp_path / site)


def test_shared_initialisation_is_really_shared_and_nested(tmp_path):
    wide = {"family": "cnn", "depth": "deep", "width": 1.0, "in_channels": 1, "num_classes": 2}
    half = dict(wide, width=0.5)
    # two sites of one architecture with different names and site seeds: identical weights under "shared" ...
    a = _runtime(tmp_path, "site-1", wide, seed=3).ensure_own_model("shared", 7).state_dict()
    b = _runtime(tmp_path, "site-2", wide, seed=9).ensure_own_model("shared", 7).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # ... and different ones under the per-site default
    c = _runtime(tmp_path, "site-3", wide).ensure_own_model().state_dict()
    d = _runtime(tmp_path, "site-4", wide).ensure_own_model().state_dict()
    assert not torch.equal(c["convs.0.weight"], d["convs.0.weight"])
    # a half-width site starts as the leading half of the wide site's channels (He-rescaled by sqrt(fan-in ratio))
    h = _runtime(tmp_path, "site-5", half).ensure_own_model("shared", 7).state_dict()
    assert torch.allclose(h["convs.1.weight"], a["convs.1.weight"][:8, :4] * np.sqrt(2))
    assert torch.equal(h["convs.0.weight"], a["convs.0.weight"][:4])  # 1 input channel: same fan-in
    pool2 = 16
    w_wide = a["fcs.0.weight"].reshape(1000, 32, pool2)[:500, :16].reshape(500, -1)
    assert torch.allclose(h["fcs.0.weight"], w_wide * np.sqrt(2))
    assert torch.equal(h["fcs.0.bias"], a["fcs.0.bias"][:500])
    assert torch.equal(shared_init_state(wide, 7)["fcs.1.weight"], a["fcs.1.weight"])
    with pytest.raises(ValueError, match="unknown initialisation"):
        _runtime(tmp_path, "site-6", wide).ensure_own_model("random")


def test_simulate_options_reach_the_controller_and_the_sites():
    from nvflare_jobs.jobs import build_job
    from nvflare_jobs.runner import job_options

    args = _parse(["--init", "shared", "--no-gate", "--repair", "channel", "--cka", "debiased", "--probe-at", "own",
                   "--probe", "generated", "--seed", "4"])
    opts = job_options(args, None, None)
    profile = {f"site-{i}": {"model": {"family": "cnn", "depth": d, "in_channels": 1, "num_classes": 2},
                             "input_size": 64} for i, d in ((1, "shallow"), (2, "deep"))}
    job = build_job("ohfl", profile, opts)
    ctl = _controller(job)
    assert ctl.task_config["init"] == "shared" and ctl.task_config["init_seed"] == 4
    assert ctl.task_config["gate"] is False
    assert (ctl.repair, ctl.cka, ctl.probe_at) == ("channel", "debiased", "own")


def _controller(job):
    from hfl_components.flare.controllers import OHFLController

    found = []

    def walk(o, depth=0):
        if isinstance(o, OHFLController):
            found.append(o)
        elif depth < 4 and hasattr(o, "__dict__"):
            for v in vars(o).values():
                for w in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]):
                    walk(w, depth + 1)
    walk(job)
    assert found, "no OHFL controller in the job"
    return found[0]


def _parse(extra):
    from nvflare_jobs.commands.simulate import cli_spec

    return cli_spec(["--method", "ohfl", *extra])


def test_paper_flag_sets_the_papers_pipeline_and_rejects_conflicts():
    from hfl_components.flare import catalogue

    a = _parse(["--paper"])
    assert (a.ot, a.ground_metric, a.repair, a.cka, a.probe_at, a.init, a.gate) == (
        "sinkhorn", "wts", "none", "linear", "largest", "site", False)
    assert (a.local_epochs, a.finetune_epochs, a.strategy, a.alignment) == (20, 50, "cid", "cka")
    d = _parse([])
    assert dict(d.options) == {o.key: o.default for o in catalogue.entry("ohfl").options}
    for bad in (["--ot", "emd"], ["--repair", "layer"], ["--finetune-epochs", "10"], ["--strategy", "cdd"]):
        with pytest.raises(SystemExit, match="--paper"):
            _parse(["--paper", *bad])
    # the message names the flags as typed (a boolean option as --gate / --no-gate, not "--gate True")
    with pytest.raises(SystemExit, match=r"^cxr-hfl: --paper runs the paper's pipeline \(--no-gate\); drop --gate$"):
        _parse(["--paper", "--gate"])
    with pytest.raises(SystemExit, match=r"\(--repair none\); drop --repair layer$"):
        _parse(["--paper", "--repair", "layer"])
    n = _parse(["--no-repair"])
    assert n.repair == "none"


# ------------------------------------------------------------------------------------------------ gate
class _TensorRuntime:
    """The pieces of SiteRuntime that ohfl_finetune uses, over in-memory tensors (no image files)."""

    def __init__(self, tmp_path, x, y):
        from hfl_components.flare.site_tasks import SiteRuntime

        self.rt = SiteRuntime({"site": "site-1", "threads": 1, "seed": 0, "input_size": 32, "batch_size": 8,
                               "lr": 0.01, "momentum": 0.9, "finetune_lr": 0.001, "finetune_epochs": 0,
                               "class_weights": None, "data": {"labels": "binary", "manifest": "unused.csv"},
                               "model": SPEC}, tmp_path)
        ds = torch.utils.data.TensorDataset(x, y)
        self.rt.loader = lambda split, input_size=None, train_mode=None: torch.utils.data.DataLoader(ds, batch_size=8)
        self.rt.n_train = lambda: len(y)


def _separable(n=40):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 2
    x = torch.rand(n, 1, 32, 32, generator=g) * 0.2 + y[:, None, None, None] * 0.8
    return x, y


def _good_model():
    """A model whose class-1 logit rises with image brightness: separates _separable perfectly."""
    m = he_model(SPEC, 0, bias_range=0.2)
    with torch.no_grad():
        for info in m.layers():
            info.module.weight.abs_()
            info.module.bias.zero_()
        m.classifier.weight.copy_(torch.tensor([[-1.0], [1.0]]).expand_as(m.classifier.weight) * 0.01)
    return m


def _runtime_with_rows(tmp_path, x, y):
    t = _TensorRuntime(tmp_path, x, y)
    t.rt.rows = lambda split: [{"label": int(v), "path": f"img{i}.png", "patient_id": f"p{i}"} for i, v in enumerate(y)]
    return t.rt


def test_acceptance_gate_outcomes_by_hand():
    """The federated candidate is deployed when it passes; a refused site keeps its local model when that passes,
    else deploys nothing; what is summarised holds no score per image."""
    from hfl_components.flare.controllers.ohfl_site import acceptance_gate, deployed_header
    from hfl_components.operating_point import site_operating_point

    y = np.r_[np.zeros(60, int), np.ones(60, int)]
    good = {"op": site_operating_point(np.r_[np.linspace(0.01, 0.4, 60), np.linspace(0.6, 0.99, 60)], y),
            "oof_seconds": 1.0, "n_acceptance": 120}
    const = {"op": site_operating_point(np.full(120, 0.7), y), "oof_seconds": 2.0, "n_acceptance": 120}
    assert good["op"]["acceptance"]["accepted"] and not const["op"]["acceptance"]["accepted"]
    g = acceptance_gate(good, None)
    assert (g["deployed"], g["adopted"], g["acceptance"]["outcome"]) == ("federated", True, "accepted")
    g = acceptance_gate(const, good)
    assert (g["deployed"], g["adopted"], g["acceptance"]["outcome"]) == ("local", False, "refused: kept the local model")
    assert g["acceptance"]["local"]["oof_seconds"] == 1.0 and g["acceptance"]["federated"]["oof_seconds"] == 2.0
    g = acceptance_gate(const, const)
    assert g["deployed"] is None and g["acceptance"]["outcome"] == "refused: nothing deployed"
    h = deployed_header(const["op"], g)
    assert h["threshold"] is None and h["accepted"] is False and "acceptance check" in h["unresolved"]
    h = deployed_header(good["op"], acceptance_gate(good, None))
    assert h["threshold"] == pytest.approx(good["op"]["threshold"]) and h["accepted"] is True
    def longest_list(v):  # counts and bounds only: no list of per-image values leaves the site
        if isinstance(v, dict):
            return max([longest_list(w) for w in v.values()] or [0])
        if isinstance(v, (list, tuple)):
            return max([len(v)] + [longest_list(w) for w in v])
        return 0
    summary = acceptance_gate(const, good)["acceptance"]
    json.dumps(summary)
    assert longest_list(summary) < 10


def test_ohfl_finetune_deploys_by_the_acceptance_check(tmp_path, monkeypatch):
    """Hand case in process: a model that separates the site's images perfectly passes the check and is deployed
    with its operating point in the file header; a constant model is refused, the local model (its out-of-fold
    repetitions start from the state _initial_state gives) replaces it when that passes, and nothing is deployed
    (threshold None, the reason stored) when neither passes."""
    from hfl_components.flare.controllers import ohfl_site
    from hfl_components.flare.messages import GLOBAL_PREFIX, to_numpy_state
    from hfl_components.models import load_model_file, save_model_file

    x, y = _separable(120)
    good, useless = _good_model(), build_fusable(SPEC)  # zero class layer: constant output
    tc = {"finetune_epochs": 0, "local_epochs": 0, "gate": True, "init": "site"}
    cases = ((good, useless, useless, "federated"), (useless, good, good, "local"), (useless, useless, useless, None))
    for fed, local, local_init, want in cases:
        rt = _runtime_with_rows(tmp_path / f"{want}", x, y)
        save_model_file(rt.state_dir / "local_model.pt", SPEC, local.state_dict(), input_size=16, labels="binary")
        monkeypatch.setattr(ohfl_site, "_initial_state", lambda rt, spec, meta, s=local_init.state_dict(): s)
        _, metrics, _ = ohfl_site.ohfl_finetune(rt, to_numpy_state(fed.state_dict(), GLOBAL_PREFIX),
                                                {"global_spec": SPEC, "task_config": tc})
        gate = metrics["gate"]
        assert gate["deployed"] == want, gate["reason"]
        assert metrics["acceptance"]["outcome"] == {"federated": "accepted", "local": "refused: kept the local model",
                                                    None: "refused: nothing deployed"}[want]
        assert (metrics["acceptance"]["local"] is None) is (want == "federated")
        assert metrics["operating_point"] is None and "_probs" not in metrics["val"]
        model, head = load_model_file(rt.state_dir / "deployed_model.pt")
        op = head["operating_point"]
        assert op["deployed"] == want and op["rule"] == "per-model"
        if want is None:
            assert op["threshold"] is None and "acceptance check" in op["unresolved"]
            assert metrics["acceptance"]["test"] is None
        else:
            assert 0.0 < op["threshold"] < 1.0 and op["accepted"] is True
            src = fed if want == "federated" else local
            assert all(torch.equal(model.state_dict()[k], v) for k, v in src.state_dict().items())
            assert op["sensitivity"]["n"] == 60 + 60 and op["specificity"]["n"] == 60 + 60  # 120 oof + 120 val
            test = metrics["acceptance"]["test"]  # the separable images: every test image right at the threshold
            assert test["sensitivity"]["value"] == 1.0 and test["specificity"]["value"] == 1.0
    with pytest.raises(ValueError, match="lacks option 'gate'"):
        ohfl_site.ohfl_finetune(_runtime_with_rows(tmp_path / "none", x, y), to_numpy_state(good.state_dict(), GLOBAL_PREFIX),
                                {"global_spec": SPEC, "task_config": {"finetune_epochs": 0}})
    # the gate off: the federated model is deployed whatever it scores, with the pooled-histogram report
    rt = _runtime_with_rows(tmp_path / "off", x, y)
    save_model_file(rt.state_dir / "local_model.pt", SPEC, good.state_dict(), input_size=16, labels="binary")
    _, metrics, _ = ohfl_site.ohfl_finetune(rt, to_numpy_state(useless.state_dict(), GLOBAL_PREFIX),
                                            {"global_spec": SPEC, "task_config": {"finetune_epochs": 0, "gate": False}})
    assert metrics["gate"] is None and metrics["val"]["auc"] == pytest.approx(0.5)


def test_controller_counts_adopting_sites(monkeypatch, tmp_path):
    from tests.test_fusion_rung0 import _fl
    from hfl_components.flare.messages import to_numpy_state

    sd = to_numpy_state(he_model(SPEC, 0, bias_range=0.2).state_dict())
    ctl = ohfl_controller(probe="generated", min_sites=1, probe_size=8)
    monkeypatch.setattr(ctl, "get_run_dir", lambda: str(tmp_path))
    gates = {"site-1": True, "site-2": False, "site-3": True}

    def fake_send(task_name, data, **kw):
        if task_name == "ohfl_train":
            return [_fl(sd, {"status": "ok", "spec": SPEC, "n_train": 5, "input_size": 32, "client_name": s})
                    for s in gates]
        if task_name == "ohfl_finetune":
            return [_fl({}, {"status": "ok", "client_name": s}, {"gate": {"adopted": a, "reason": "r"}})
                    for s, a in gates.items()]
        return [_fl({}, {"status": "ok", "client_name": s}) for s in gates]

    monkeypatch.setattr(ctl, "send_model_and_wait", fake_send)
    ctl.run_method()
    assert ctl.record["gate"] == {"adopted": 2, "sites": 3, "adopted_sites": ["site-1", "site-3"],
                                  "kept_local": ["site-2"]}
    assert ctl.record["sites"]["site-2"]["gate"]["adopted"] is False


def test_controller_records_the_acceptance_outcomes_and_refusal_rate(monkeypatch, tmp_path):
    """Each site's acceptance outcome goes into the run record (per site and as the catalogue's ``acceptance``
    field, with the refusal rate: a refused site counts once whatever it deploys); no federated threshold is sent
    when the sites set their own."""
    from tests.test_fusion_rung0 import _fl
    from hfl_components.flare.catalogue import summarise_acceptance
    from hfl_components.flare.messages import to_numpy_state

    sd = to_numpy_state(he_model(SPEC, 0, bias_range=0.2).state_dict())
    ctl = ohfl_controller(probe="generated", min_sites=1, probe_size=8)
    monkeypatch.setattr(ctl, "get_run_dir", lambda: str(tmp_path))
    deployed = {"site-1": "federated", "site-2": "local", "site-3": None, "site-4": "federated"}
    outcome = {"federated": "accepted", "local": "refused: kept the local model", None: "refused: nothing deployed"}
    rate = {"value": 0.95, "lower": 0.91, "k": 19, "n": 20}
    sent = []

    def fake_send(task_name, data, **kw):
        sent.append((task_name, dict(data.meta or {})))
        if task_name == "ohfl_train":
            return [_fl(sd, {"status": "ok", "spec": SPEC, "n_train": 5, "input_size": 32, "client_name": s})
                    for s in deployed]
        if task_name == "ohfl_finetune":
            return [_fl({}, {"status": "ok", "client_name": s}, {
                "gate": {"adopted": d == "federated", "deployed": d, "reason": "r"},
                "acceptance": {"outcome": outcome[d], "deployed": d,
                               "federated": {"sensitivity": rate, "specificity": rate, "oof_seconds": 2.0},
                               "local": None if d == "federated" else {"sensitivity": rate, "specificity": rate,
                                                                       "oof_seconds": 3.0},
                               "test": None}}) for s, d in deployed.items()]
        return [_fl({}, {"status": "ok", "client_name": s}) for s in deployed]

    monkeypatch.setattr(ctl, "send_model_and_wait", fake_send)
    ctl.run_method()
    acc = ctl.record["acceptance"]
    assert (acc["sites"], acc["accepted"], acc["refused"]) == (4, 2, ["site-2", "site-3"])
    assert acc["kept_local"] == ["site-2"] and acc["nothing_deployed"] == ["site-3"]
    assert acc["refusal_rate"] == 0.5 and acc["oof_seconds"] == 4 * 2.0 + 2 * 3.0
    assert acc["per_site"]["site-2"]["sensitivity"] == {"value": 0.95, "lower": 0.91}
    assert ctl.record["sites"]["site-3"]["acceptance"]["outcome"] == "refused: nothing deployed"
    assert ctl.record["operating_point"]["rule"] == "per-model"
    assert "operating_point" not in sent[-1][1]  # the final evaluation carries no federated threshold
    line = summarise_acceptance(acc)
    assert "2 of 4" in line and "refusal rate 0.50" in line and "site-3" in line
