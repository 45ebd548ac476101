"""FedTopo as an NVFlare job.

* Unit tests of the server workflow with the transport replaced by a fake ``send_model_and_wait``: a bad topology
  upload is dropped for the round with a logged reason while the round completes; the aggregation of the remaining
  uploads, EMA/retention, payload and the no-top-q report are checked against values computed here by hand.
* A simulator run with three sites of three different backbones on a small real subset (slow, real data).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nvflare_jobs.jobs import ENTRY_REF
from tests.sim_helpers import assert_canonical, load_metrics, make_partition, make_profile, run_cli
from tests.test_sim_fedsaf import _eval_answer, _wire, transport

torch.set_num_threads(1)

C = 3


def _sym(a, b, c):
    return np.array([[1.0, a, b], [a, 1.0, c], [b, c, 1.0]], np.float32)


UPLOADS = {  # (R_k, counts) per site; site-2 lacks class 2
    "site-1": (_sym(0.8, 0.4, 0.6), np.array([10, 4, 6], np.float32)),
    "site-2": (np.array([[1.0, 0.2, 0.0], [0.2, 1.0, 0.0], [0.0, 0.0, 0.0]], np.float32),
               np.array([3, 12, 0], np.float32)),
}


def _hand_round(R_prev, S_prev, ups, rho=0.7, reliability=True):
    """Eq. 4-8 written out independently: harmonic weights, weighted mean, off-diagonal-normalised S, EMA."""
    num, W, obs = np.zeros((C, C)), np.zeros((C, C)), np.zeros((C, C), bool)
    for R, n in ups:
        for a in range(C):
            for b in range(C):
                if n[a] > 0 and n[b] > 0:
                    w = n[a] * n[b] / (n[a] + n[b]) if reliability else 1.0
                    num[a, b] += w * R[a, b]
                    W[a, b] += w
                    obs[a, b] = True
    Rt = np.where(obs, num / np.where(W > 0, W, 1), 0)
    if reliability:
        top = max(W[a, b] for a in range(C) for b in range(C) if a != b and obs[a, b])
        S_round = np.minimum(W / top, 1.0)
    else:
        S_round = obs.astype(float)
    R = np.where(obs, rho * R_prev + (1 - rho) * Rt, R_prev)
    S = np.where(obs, S_round, S_prev)
    return R, S


def test_bad_topology_upload_is_dropped_with_reason_and_round_completes(tmp_path):
    from hfl_components.flare.controllers import FedTopoController

    def answer(task, rnd, site, data):
        if task == "evaluate":
            return _eval_answer()
        if site == "site-3":
            if rnd == 0:  # asymmetric relation matrix
                return {"R": _sym(0.5, 0.5, 0.5) + np.triu(np.full((C, C), 0.3, np.float32), 1),
                        "counts": np.array([5, 5, 5], np.float32)}, {}, {"status": "ok"}
            # unit diagonal claims class 2 is present, the counts say it is not
            return {"R": _sym(0.5, 0.5, 0.5), "counts": np.array([5, 5, 0], np.float32)}, {}, {"status": "ok"}
        R, n = UPLOADS[site]
        if site == "site-2" and rnd == 1:
            return {}, {}, {"status": "error", "error": "site site-2: task fedtopo_train failed: disk full"}
        return {"R": R, "counts": n}, {"val": {"accuracy": 0.5}, "D_r": 0.1, "D_rs": 0.05}, {"status": "ok"}

    ctl = FedTopoController(num_classes=C, rho=0.7, num_rounds=2, min_sites=1,
                            task_config={"top_q": 3, "warmup": 1, "lambda": 1.0, "gamma": 1.0, "ablate": []},
                            entry_ref=ENTRY_REF)  # the job builder gives it: the upload checks
    fake = transport(["site-1", "site-2", "site-3"], answer)
    logs = _wire(ctl, tmp_path, fake)
    ctl.run()
    rec = json.loads((tmp_path / "cxr_hfl_results" / "server_results.json").read_text())

    assert [r["task"] for r in rec["rounds"]] == ["fedtopo_train", "fedtopo_train", "evaluate"]
    reasons = {(e["round"]): e["reason"] for e in rec["excluded"]["site-3"]}
    assert "not symmetric" in reasons[0] and "diagonal of R" in reasons[1]
    assert "disk full" in rec["excluded"]["site-2"][0]["reason"]
    assert sum("site-3 left out" in w for w in logs["warning"]) == 2

    # the first broadcast is Algorithm 1's initial state; then the hand-computed aggregate of the good uploads
    np.testing.assert_array_equal(fake.sent[0][2]["R_global"], np.eye(C))
    np.testing.assert_array_equal(fake.sent[0][2]["S_global"], np.zeros((C, C)))
    R1, S1 = _hand_round(np.eye(C), np.zeros((C, C)), [UPLOADS["site-1"], UPLOADS["site-2"]])
    np.testing.assert_allclose(fake.sent[1][2]["R_global"], R1, atol=1e-6)
    np.testing.assert_allclose(fake.sent[1][2]["S_global"], S1, atol=1e-6)
    R2, S2 = _hand_round(R1, S1, [UPLOADS["site-1"]])  # round 1: only site-1 usable
    np.testing.assert_allclose(rec["R_global"], R2, atol=1e-6)
    np.testing.assert_allclose(rec["S_global"], S2, atol=1e-6)
    assert [h["warmup"] for h in rec["topology_history"]] == [True, False]
    assert rec["topology_history"][1]["sites"] == ["site-1"]

    # payload per site and round: C*C + C float32 up, 2*C*C down
    for row in rec["payload"]["per_round"]:
        assert row["down_per_site"] == 4 * 2 * C * C == 72
        assert row["up_per_site"]["site-1"] == 4 * (C * C + C) == 48
        assert row["matches_theory"]


def test_no_topq_noop_and_server_ablations_are_reported(tmp_path):
    from hfl_components.flare.controllers import FedTopoController
    from nvflare_jobs.jobs import make_controller

    spec = {"family": "densenet", "feature_dim": 64, "in_channels": 1, "num_classes": 3}
    profile = {f"site-{i}": {"model": dict(spec)} for i in (1, 2)}
    ctl = make_controller("fedtopo", profile, {"rounds": 2, "ablate": ["no_topq", "no_ema", "no_reliability"],
                                               "top_q": 3, "warmup": 0, "noisy_counts": 2.0})
    assert isinstance(ctl, FedTopoController)
    assert ctl.task_config["ablate"] == ["no_ema", "no_reliability", "no_topq"]
    assert ctl.task_config["noisy_counts"] == 2.0
    with pytest.raises(ValueError, match="unknown ablation"):
        make_controller("fedtopo", profile, {"ablate": ["no_such_thing"]})

    def answer(task, rnd, site, data):
        if task == "evaluate":
            return _eval_answer()
        R, n = UPLOADS[site]
        return {"R": R, "counts": n}, {}, {"status": "ok"}

    fake = transport(["site-1", "site-2"], answer)
    logs = _wire(ctl, tmp_path, fake)
    ctl.run()
    rec = json.loads((tmp_path / "cxr_hfl_results" / "server_results.json").read_text())
    assert any("no_topq is identical to the default" in n for n in rec["notes"])
    assert any("no_topq is identical" in w for w in logs["warning"])
    # no_ema (rho = 0) and no_reliability (plain mean, S = 1 on observed pairs), by hand
    ups = [UPLOADS["site-1"], UPLOADS["site-2"]]
    R1, S1 = _hand_round(np.eye(C), np.zeros((C, C)), ups, rho=0.0, reliability=False)
    np.testing.assert_allclose(fake.sent[1][2]["R_global"], R1, atol=1e-6)
    np.testing.assert_allclose(fake.sent[1][2]["S_global"], S1, atol=1e-6)
    assert R1[0, 1] == pytest.approx((0.8 + 0.2) / 2) and R1[0, 2] == pytest.approx(0.4)


# ---------------------------------------------------------------------------------------------- simulator
@pytest.fixture(scope="module")
def partition3_subtype(data_root, tmp_path_factory):
    return make_partition(data_root, tmp_path_factory.mktemp("p3t"), 3, labels="subtype", max_images=240)


@pytest.mark.slow
def test_fedtopo_simulation_three_backbones(partition3_subtype, tmp_path):
    from nvflare_jobs.results import find_server_results

    profile = make_profile(partition3_subtype, tmp_path / "profile", "fedtopo", labels="subtype", sizes=(64,),
                           max_train_images=24, feature_dim=64)
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "fedtopo", "--profile", str(profile), "--rounds", "2", "--local-epochs", "1",
                "--warmup", "1", "--ablate", "no_topq", "--noisy-counts", "2", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_metrics(run)
    sites = ["site-1", "site-2", "site-3"]
    assert_canonical(m, sites)
    assert m["method"] == "fedtopo" and m["labels"] == "subtype"
    families = [m["sites"][s]["model"]["family"] for s in sites]
    assert len(set(families)) == 3, families
    assert not m["excluded_sites"]  # noisy counts keep every upload valid

    # payload per site per round equals the theory: C^2 + C float32 up, 2 C^2 down (C = 3)
    up, down = 4 * (C * C + C), 4 * 2 * C * C
    train_rounds = [x for x in m["rounds"] if x["task"] == "fedtopo_train"]
    assert [x["round"] for x in train_rounds] == [0, 1]
    assert all(x["bytes_up"] == 3 * up and x["bytes_down"] == 3 * down for x in train_rounds)
    assert m["bytes_uploaded"] == 2 * 3 * up and m["bytes_downloaded"] == 2 * 3 * down
    for row in m["payload"]["per_round"]:
        assert row["up_per_site"] == {s: up for s in sites} and row["down_per_site"] == down
        assert row["matches_theory"]

    # per-round curves and per-site diagnostics D^r / D^rs
    for x in train_rounds:
        assert sorted(x["val_accuracy"]) == sites
        assert sorted(x["diagnostics"]) == sites
        for d in x["diagnostics"].values():
            assert 0.0 <= d["D_rs"] <= d["D_r"] <= 1.0
    # round 0 is diagnosed against the initial state (R = I, S = 0): D^rs = 0 exactly
    assert all(d["D_rs"] == 0.0 for d in train_rounds[0]["diagnostics"].values())

    # after round 0 the EMA from R_0 = I gives R(c, c') = 0.3 * R~ <= 0.3 off the diagonal and 1 on it
    R1 = np.asarray(m["topology_history"][0]["R"])
    assert np.allclose(np.diag(R1), 1.0) and (R1[~np.eye(C, dtype=bool)] <= 0.3 + 1e-9).all()
    Rg, Sg = np.asarray(m["R_global"]), np.asarray(m["S_global"])
    for M in (Rg, Sg):
        assert M.shape == (C, C) and np.allclose(M, M.T) and M.min() >= 0 and M.max() <= 1
    assert [h["warmup"] for h in m["topology_history"]] == [True, False]
    assert any("no_topq is identical to the default" in n for n in m["notes"])

    rec = json.loads(find_server_results(run / "workspace").read_text())
    site_metrics = [x["sites"] for x in rec["rounds"][:2]]
    assert [{s: v["warmup"] for s, v in sm.items()} for sm in site_metrics] == [
        {s: True for s in sites}, {s: False for s in sites}]
    assert all(v["q_effective"] == C - 1 and not v["topq_active"] for sm in site_metrics for v in sm.values())
    for name in ("R_global.png", "S_global.png", "round_curves.png", "payload_per_round.png",
                 "topology_diagnostics.png"):
        assert (run / name).stat().st_size > 1000, name
