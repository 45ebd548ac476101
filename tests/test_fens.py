"""FENS (Allouah et al., NeurIPS 2024, arXiv:2411.07182): the aggregator's maths on hand cases, the deployed ensemble
model (shapes, member sizes, model files), the FedAvg of aggregator weights, compare's epoch plan, and one small
simulator run end to end (slow)."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from hfl_components.models import build_model, load_model_file, save_model_file
from hfl_components.models.ensemble import Aggregator, ensemble_spec, resolve_ensemble_spec
from hfl_components.models.registry import resolve_spec
from hfl_components.training.aggregator import train_aggregator

torch.set_num_threads(1)
CNN = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _pick_one_case(n: int, M: int = 4, C: int = 2, good: int = 2, seed: int = 0):
    """Members' log-probabilities where member ``good`` is always right (0.9 on the true class) and the others are
    noise (random probabilities, independent of the label): (z (n, M, C), y (n,))."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=g)
    p = torch.softmax(2.0 * torch.randn(n, M, C, generator=g), dim=2)
    p[:, good] = 0.1 / (C - 1)
    p[torch.arange(n), good, y] = 0.9
    return p.log(), y


def _accuracy(agg, z, y) -> float:
    with torch.no_grad():
        return float((agg(z).argmax(1) == y).float().mean())


@pytest.mark.parametrize("kind,residual", [("mlp", False), ("mlp", True), ("linear", False)])
def test_aggregator_learns_to_pick_the_one_correct_site_model(kind, residual):
    z, y = _pick_one_case(512)
    zt, yt = _pick_one_case(2000, seed=1)
    # the averaged-probability ensemble is misled by the noisy members; the correct member alone is always right
    ens = (torch.logsumexp(zt, 1) - math.log(zt.shape[1])).argmax(1)
    ens_acc = float((ens == yt).float().mean())
    assert ens_acc < 0.97 and float((zt[:, 2].argmax(1) == yt).float().mean()) == 1.0
    torch.manual_seed(0)
    agg = Aggregator(4, 2, kind, hidden=16, residual=residual)
    hist = train_aggregator(agg, z, y, epochs=30, lr=0.02, batch_size=32, seed=0)
    assert len(hist) == 30 and hist[-1]["loss"] < hist[0]["loss"]
    assert _accuracy(agg, zt, yt) >= 0.99 > ens_acc  # reaches the correct member's accuracy on new draws


def test_residual_aggregator_starts_as_the_averaged_ensemble_and_shapes():
    z, _ = _pick_one_case(7, M=3, C=3)
    agg = Aggregator(3, 3, "mlp", hidden=5, residual=True)
    out = agg(z)
    assert out.shape == (7, 3)
    expect = torch.log(torch.exp(z).mean(dim=1))  # log of the averaged probabilities
    assert torch.allclose(torch.softmax(out, 1), torch.softmax(expect, 1), atol=1e-6)
    with pytest.raises(ValueError, match=r"\(B, 3, 3\)"):
        agg(z[:, :2])
    with pytest.raises(ValueError, match="aggregator must be one of"):
        Aggregator(3, 3, "tree")


def test_zero_epochs_trains_nothing_and_bad_inputs_are_refused():
    agg = Aggregator(2, 2, "linear", residual=False)
    before = {k: v.clone() for k, v in agg.state_dict().items()}
    assert train_aggregator(agg, torch.zeros(4, 2, 2), torch.zeros(4, dtype=torch.long), epochs=0) == []
    assert all(torch.equal(before[k], v) for k, v in agg.state_dict().items())
    with pytest.raises(ValueError, match=r"z \(N, M, C\)"):
        train_aggregator(agg, torch.zeros(4, 4), torch.zeros(4, dtype=torch.long), epochs=1)


def test_fedavg_of_aggregators_is_the_count_weighted_mean_and_federated_training_reaches_the_pick():
    """Two sites hold the pick-one case with skewed labels (80 % / 20 % of each class); FENS's server averages their
    aggregators weighted by the held-out counts (FedAvg's weighted_average): checked by hand, then the federated
    aggregator reaches the correct member's accuracy."""
    from hfl_components.aggregation import weighted_average
    from hfl_components.flare.messages import to_numpy_state

    z, y = _pick_one_case(600)
    at_a = torch.rand(600, generator=torch.Generator().manual_seed(2)) < torch.where(y == 0, 0.8, 0.2)
    sites = [(z[at_a], y[at_a]), (z[~at_a], y[~at_a])]
    torch.manual_seed(0)
    glob = to_numpy_state(Aggregator(4, 2, "mlp", 16, residual=True).state_dict())
    a = {k: np.full_like(v, 1.0) for k, v in glob.items()}
    b = {k: np.full_like(v, 4.0) for k, v in glob.items()}
    avg = weighted_average([a, b], [3.0, 1.0])
    assert all(np.allclose(v, 1.75) for v in avg.values())  # (3 * 1 + 1 * 4) / 4
    for rnd in range(8):
        ups, counts = [], []
        for i, (zs, ys) in enumerate(sites):
            agg = Aggregator(4, 2, "mlp", 16, residual=True)
            agg.load_state_dict({k: torch.as_tensor(v) for k, v in glob.items()})
            train_aggregator(agg, zs, ys, epochs=3, lr=0.02, batch_size=32, seed=rnd * 10 + i)
            ups.append(to_numpy_state(agg.state_dict()))
            counts.append(len(ys))
        glob = weighted_average(ups, counts)
    final = Aggregator(4, 2, "mlp", 16, residual=True)
    final.load_state_dict({k: torch.as_tensor(v) for k, v in glob.items()})
    zt, yt = _pick_one_case(2000, seed=1)
    assert _accuracy(final, zt, yt) >= 0.99


def test_ensemble_model_forward_member_sizes_and_model_file(tmp_path):
    """The deployed model: features = members' log-probabilities (B, M, C), each member at its own size, head =
    the aggregator; saved and loaded as a model file with the same outputs; members frozen."""
    spec = ensemble_spec([CNN, {**CNN, "depth": "medium"}], [16, 24], 2, "mlp", 8, True)
    torch.manual_seed(0)
    model = build_model(spec).eval()
    x = torch.rand(3, 1, 20, 20)
    z = model.features(x)
    assert z.shape == (3, 2, 2) and torch.allclose(z.exp().sum(2), torch.ones(3, 2), atol=1e-5)
    m0 = model.members[0]
    x16 = torch.nn.functional.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False, antialias=True)
    assert torch.allclose(z[:, 0], torch.log_softmax(m0(x16), 1), atol=1e-5)  # member 0 saw 16 px
    out = model(x)
    assert out.shape == (3, 2) and torch.allclose(out, model.head(z))
    assert not any(p.requires_grad for p in model.members.parameters())
    model.train()
    assert not model.members.training and model.aggregator.training
    f = save_model_file(tmp_path / "site-1_deployed.pt", spec, model.state_dict(), input_size=20, labels="binary",
                        kind="deployed")
    loaded, header = load_model_file(f)
    assert header["spec"]["family"] == "fens"
    assert torch.allclose(loaded(x), model.eval()(x), atol=1e-6)


def test_ensemble_spec_errors_name_the_problem():
    with pytest.raises(ValueError, match="non-empty list 'members'"):
        resolve_ensemble_spec({"family": "fens", "members": []}, resolve_spec)
    with pytest.raises(ValueError, match="not another ensemble"):
        resolve_ensemble_spec({"family": "fens", "members": [{"family": "fens"}]}, resolve_spec)
    with pytest.raises(ValueError, match=r"\[2, 3\] classes"):
        resolve_ensemble_spec({"family": "fens", "members": [CNN, {**CNN, "num_classes": 3}]}, resolve_spec)
    with pytest.raises(ValueError, match="member_sizes"):
        resolve_ensemble_spec({"family": "fens", "members": [CNN], "member_sizes": [16, 32]}, resolve_spec)
    with pytest.raises(ValueError, match="unknown key"):
        resolve_ensemble_spec({"family": "fens", "members": [CNN], "depth": "deep"}, resolve_spec)


def test_a_site_config_cannot_train_the_ensemble_family(tmp_path):
    from hfl_components.flare.site_config import SiteConfigError, _model_section

    with pytest.raises(SiteConfigError, match="'fens' is not a site model"):
        _model_section({"model": {"family": "fens", "members": [CNN]}}, "site-1", tmp_path / "site-1.yaml",
                       "binary")


def test_holdout_split_is_stratified_disjoint_and_left_out_of_training(tmp_path):
    from hfl_components.flare.site_tasks import HOLDOUT, SiteRuntime

    rt = SiteRuntime.__new__(SiteRuntime)  # only the row bookkeeping, no data pipeline
    rt.cfg, rt.site, rt.labels, rt._loaders, rt._holdout = {"seed": 0}, "site-1", "binary", {}, 0.0
    rt._rows = [{"path": f"{c}/{i}.png", "label": c, "split": "train"} for c in (0, 1) for i in range(20 + 20 * c)]
    rt._rows.append({"path": "v.png", "label": 0, "split": "val"})
    assert len(rt.rows("train")) == 60 and rt.rows(HOLDOUT) == []
    rt.hold_out(0.1)
    held, train = rt.rows(HOLDOUT), rt.rows("train")
    assert len(held) == 6 and len(train) == 54
    assert {r["path"] for r in held}.isdisjoint(r["path"] for r in train)
    assert sorted(r["label"] for r in held) == [0, 0, 1, 1, 1, 1]  # 1/3 : 2/3 as in the training split
    with pytest.raises(ValueError, match="site-1"):
        rt.hold_out(1.0)


def test_bad_fens_options_are_refused_in_one_line_naming_the_option():
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve as check

    for opts, word in (({"fens_holdout": 1.5}, "fens_holdout"), ({"fens_aggregator": "tree"}, "fens_aggregator"),
                       ({"fens_hidden": 0}, "fens_hidden"), ({"fens_lr": -1}, "fens_lr")):
        with pytest.raises(SimulateError, match=word) as e:
            check("fens", opts)
        assert "\n" not in str(e.value)
    assert check("fens", {}).fens_holdout == 0.1


def test_a_site_that_missed_the_site_models_says_so_by_name(tmp_path):
    from types import SimpleNamespace

    from hfl_components.flare.controllers.fens import fens_aggregate

    rt = SimpleNamespace(site="site-7", model=None, spec=None, state_dir=tmp_path, hold_out=lambda f: None)
    meta = {"task_config": {"fens_holdout": 0.1}, "ensemble_spec": ensemble_spec([CNN], [64], 2)}
    with pytest.raises(ValueError, match="site site-7: no FENS ensemble kept"):
        fens_aggregate(rt, {"global.net.0.weight": np.zeros((32, 2), np.float32)}, meta)


def _args(**kw):
    from nvflare_jobs.compare import CompareOptions

    return CompareOptions(**{"out": "runs/x", "labels": "binary", **kw})


def test_compare_plan_gives_fens_the_local_epochs_plus_aggregator_epochs():
    from nvflare_jobs.compare.plan import BudgetError, budget_lines, epoch_plan, simulate_options

    ohfl, fens = epoch_plan("ohfl", _args()), epoch_plan("fens", _args())
    assert fens["total_epochs_per_site"] == ohfl["total_epochs_per_site"] == 30
    assert fens["local_epochs"] == ohfl["local_epochs"] == 20
    assert fens["rounds"] * fens["aggregator_epochs"] == ohfl["finetune_epochs"] == 10
    assert epoch_plan("fens", _args(rounds=10))["aggregator_epochs"] == 1
    with pytest.raises(BudgetError, match="does not divide"):
        epoch_plan("fens", _args(rounds=3))
    line = next(x for x in budget_lines({"fens": fens}, False) if x.startswith("fens"))
    assert "20 local epochs" in line and "aggregator epochs = 30 epochs per site" in line
    opts = simulate_options("fens", __import__("pathlib").Path("D"), 0, _args(labels="binary", max_train_images=None,
                                                                               batch_size=None))
    assert opts["rounds"] == fens["rounds"] and opts["fens_epochs"] == fens["aggregator_epochs"]


def test_export_summary_counts_every_site_model_and_the_aggregator():
    from hfl_components.flare.controllers.fens import FENSController
    from hfl_components.models import count_parameters

    profile = {"site-1": {"model": CNN}, "site-2": {"model": {**CNN, "depth": "medium"}}}
    from nvflare_jobs.spec import resolve

    text = FENSController.payload_summary(profile, resolve("fens", {"rounds": 3, "fens_hidden": 8}).job_options(None))
    members = 4 * sum(count_parameters(build_model(c["model"])) for c in profile.values())
    agg = 4 * count_parameters(Aggregator(2, 2, "mlp", 8))
    assert f"({members} bytes per site, 2 models)" in text and f"({agg} bytes per round)" in text
    assert "each of 3 rounds" in text


@pytest.mark.slow
def test_fens_simulation_end_to_end(data_root, tmp_path):
    """Three sites, 1 local epoch, 2 aggregator rounds x 1 epoch: every site deploys the same ensemble of the three
    uploads; the bytes match the site models sent once and the aggregator every round; evaluate scores it."""
    from tests.sim_helpers import assert_canonical, load_metrics, make_partition, make_profile, run_cli

    part = make_partition(data_root, tmp_path / "p", 3)
    profile = make_profile(part, tmp_path / "profile", "fens", sizes=(32, 48))
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "fens", "--profile", str(profile), "--rounds", "2", "--fens-epochs", "1",
                "--local-epochs", "1", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_metrics(run)
    sites = ["site-1", "site-2", "site-3"]
    assert_canonical(m, sites)
    f = m["fens"]
    assert f["members"] == sites and f["rounds"] == 2
    assert m["payload"]["down_per_site"]["total"] == f["site_models_bytes"] + 3 * f["aggregator_bytes"]
    assert m["bytes_downloaded"] == 3 * m["payload"]["down_per_site"]["total"]
    up = m["payload"]["up_per_site"]
    assert m["bytes_uploaded"] == sum(up["own_model_once"].values()) + 3 * 2 * f["aggregator_bytes"]
    assert {"bundle", "aggregation"} <= set(m["server_seconds"]) and "fens" in m["references"]
    sizes = [m["sites"][s]["input_size"] for s in sites]
    assert f["member_sizes"] == sizes and len(set(sizes)) == 2
    outs = [load_model_file(run / "models" / f"{s}_deployed.pt") for s in sites]
    # every site deploys the ensemble of the three uploads, fed at its largest member's size
    assert all(h["spec"]["family"] == "fens" and h["input_size"] == max(sizes) for _, h in outs)
    x = torch.rand(2, 1, max(sizes), max(sizes))
    assert all(torch.allclose(outs[0][0](x), mod(x), atol=1e-5) for mod, _ in outs)  # one shared ensemble
    z = outs[0][0].features(x)  # its members are the sites' uploaded local models, in site order, each at its size
    for i, (s, size) in enumerate(zip(sites, sizes)):
        local, _ = load_model_file(run / "models" / f"{s}_local.pt")
        xs = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
        assert torch.allclose(z[:, i], torch.log_softmax(local(xs), 1), atol=1e-5)
    r = run_cli("evaluate", "--run", str(run), "--data", str(data_root / "chest_xray_224"), "--part", "tuning",
                "--max-images", "24", "--n-boot", "0", "--no-audit")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    summ = json.loads(next((run / "external").glob("*/summary.json")).read_text())["models"]
    assert summ["ensemble"]["members"] == [f"{s}_local" for s in sites]  # the uploads' averaged probabilities
    assert summ["global"]["input_size"] == max(sizes) and f"global_{max(sizes)}px" in summ  # scored once, at it
    assert summ["global"]["gap_to_ensemble_auc"] == pytest.approx(summ["ensemble"]["auc"] - summ["global"]["auc"])
    assert all(summ[f"{s}_deployed"]["auc"] is not None for s in sites)


def test_fens_federation_in_process_sends_every_model_and_averages_the_aggregator(tmp_path):
    """The real controller and site handlers on two SiteRuntimes at 16 and 24 px (tiny synthetic images): the task
    sequence, the site models sent once (first aggregator round only), each round's global aggregator = the
    held-out-count-weighted mean of the last round's uploads (computed here from what the sites sent), the final
    one installed at every site, and the global model file = uploads + final aggregator at the largest size."""
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.messages import GLOBAL_PREFIX
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller
    from tests.test_inprocess import _site

    profile = {"site-1": _site(tmp_path, "site-1", 24), "site-2": {**_site(tmp_path, "site-2", 20), "input_size": 24}}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    real, seen = runtime_answer(runtimes, raise_errors=True), []

    def answer(task, site, data):
        out = real(task, site, data)
        seen.append((task, site, data.current_round, out))
        return out

    ctl = make_controller("fens", profile, {"rounds": 2, "local_epochs": 1, "seed": 0, "fens_holdout": 0.3,
                                            "fens_epochs": 1})
    t = InProcessTransport(runtimes, answer)
    t.attach(ctl, tmp_path / "server", info=lambda m: None, warning=lambda m: None)
    ctl.run()
    assert [(c[0], c[1]) for c in t.sent] == [("fens_local", 0), ("fens_aggregate", 1), ("fens_aggregate", 2),
                                              ("fens_aggregate", 3), ("evaluate", 3)]
    ups = {site: o[0] for task, site, _, o in seen if task == "fens_local"}
    members = {k for k in t.sent[1][2] if k.startswith("member.")}
    assert members == {f"member.{i}.{k}" for i, s in enumerate(ups) for k in ups[s]}  # every model, to every site
    assert all(np.array_equal(t.sent[1][2][f"member.{i}.{k}"], v) for i, s in enumerate(ups) for k, v in ups[s].items())
    assert not any(k.startswith("member.") for k in t.sent[2][2]) and t.sent[3][3]["install_only"]
    for rnd in (1, 2):  # the next message's global aggregator is the count-weighted mean of this round's answers
        answers = [o for task, _, r, o in seen if task == "fens_aggregate" and r == rnd]
        n = [o[2]["NUM_STEPS_CURRENT_ROUND"] for o in answers]
        for k in answers[0][0]:
            want = sum(c * o[0][k] for c, o in zip(n, answers)) / sum(n)
            np.testing.assert_allclose(t.sent[rnd + 1][2][GLOBAL_PREFIX + k], want, rtol=1e-5, atol=1e-7)
    assert n == [len(runtimes[s].rows(runtimes[s].HOLDOUT)) for s in profile] and min(n) >= 1
    glob, header = load_model_file(tmp_path / "server" / "cxr_hfl_results" / "global_model.pt")
    assert header["input_size"] == 24 and header["spec"]["member_sizes"] == [16, 24]
    final = {k: torch.as_tensor(v) for k, v in t.sent[3][2].items()}
    for k, v in glob.aggregator.state_dict().items():
        assert torch.allclose(v, final[GLOBAL_PREFIX + k])
    for s, rt in runtimes.items():  # every site deploys that model
        dep, h = load_model_file(rt.state_dir / "deployed_model.pt")
        assert h["input_size"] == 24 and all(torch.equal(v, glob.state_dict()[k]) for k, v in dep.state_dict().items())
    pay = ctl.record["payload"]["down_per_site"]
    assert ctl.record["bytes_downloaded"] == 2 * pay["total"] and set(ctl.record["sites"]) == set(profile)
