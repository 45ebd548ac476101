"""FedSAF / FedProto as an NVFlare job.

* Unit tests of the server workflow with the transport replaced by a fake ``send_model_and_wait``: a corrupted
  prototype upload is dropped for the round with a logged reason while the round completes on the other sites;
  global prototypes, effective rank and payload are checked against values computed here by hand.
* The nearest-local-prototype evaluation rule.
* A simulator run with three sites of three different backbones on a small real subset (slow, real data).
"""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
import torch
from nvflare_jobs.jobs import ENTRY_REF
from hfl_components.flare.inprocess import InProcessTransport

from tests.sim_helpers import assert_canonical, load_metrics, make_partition, make_profile, run_cli

torch.set_num_threads(1)

C, D = 3, 4


# ---------------------------------------------------------------------------------------------- fake transport
def transport(sites, answer):
    """The in-process federation with answers from ``answer(task, rnd, site, data)``; ``.sent`` keeps what the server
    sent."""
    return InProcessTransport(sites, lambda task, site, data: answer(task, data.current_round, site, data))


def _wire(ctl, tmp_path, fake):
    logs = {"info": [], "warning": []}
    fake.attach(ctl, tmp_path, info=logs["info"].append, warning=logs["warning"].append)
    return logs


def _eval_answer():
    return {}, {"test": {"accuracy": 0.5, "n": 4}, "val": {"accuracy": 0.5}}, {"status": "ok", "n_train": 10}


def _site_prototypes(site: str, rnd: int):
    rng = np.random.default_rng(zlib.crc32(f"{site}{rnd}".encode()))
    counts = {"site-1": [4, 3, 0], "site-2": [2, 5, 3], "site-3": [6, 1, 3]}[site]
    P = rng.normal(size=(C, D)).astype(np.float32)
    P[np.asarray(counts) == 0] = 0.0
    return P, np.asarray(counts, np.float32)


def test_bad_prototype_upload_is_dropped_with_reason_and_round_completes(tmp_path):
    from hfl_components.flare.controllers import FedSAFController

    uploads = {}

    def answer(task, rnd, site, data):
        if task == "evaluate":
            return _eval_answer()
        P, n = _site_prototypes(site, rnd)
        uploads[(site, rnd)] = (P, n)
        if site == "site-3" and rnd == 0:
            P = P.copy()
            P[1, 2] = np.nan  # corrupted upload
        if site == "site-3" and rnd == 1:
            P = P[:, :2]  # wrong feature dimension
        if site == "site-2" and rnd == 1:
            return {"prototypes": P, "counts": n}, {"val": {"accuracy": 0.4}}, {"status": "ok", "n_train": 99}
        return {"prototypes": P, "counts": n}, {"val": {"accuracy": 0.4}}, {"status": "ok", "n_train": int(n.sum())}

    ctl = FedSAFController(num_classes=C, feature_dim=D, num_rounds=3, min_sites=1,
                           task_config={"alignment": "gcsa", "lambda": 1.0, "gamma": 1.0},
                           entry_ref=ENTRY_REF)
    fake = transport(["site-1", "site-2", "site-3"], answer)
    logs = _wire(ctl, tmp_path, fake)
    ctl.run()

    rec = json.loads((tmp_path / "cxr_hfl_results" / "server_results.json").read_text())
    excl = rec["excluded"]
    assert sorted(excl) == ["site-2", "site-3"]
    assert [(e["round"], "non-finite" in e["reason"]) for e in excl["site-3"]][0] == (0, True)
    assert excl["site-3"][1]["round"] == 1 and "shape" in excl["site-3"][1]["reason"]
    assert excl["site-2"] == [{"round": 1, "task": "fedsaf_train",
                               "reason": excl["site-2"][0]["reason"]}] and "n_train" in excl["site-2"][0]["reason"]
    assert any("site-3 left out" in w and "non-finite" in w for w in logs["warning"])
    # every round completed: 3 training rounds + the final evaluation
    assert [r["task"] for r in rec["rounds"]] == ["fedsaf_train"] * 3 + ["evaluate"]
    assert sorted(rec["rounds"][0]["sites"]) == ["site-1", "site-2"]
    assert sorted(rec["rounds"][1]["sites"]) == ["site-1"]

    # round 0: nothing sent (supervised only); round 1: hand-computed weighted mean of site-1 and site-2 only
    assert fake.sent[0][2] == {}
    (P1, n1), (P2, n2) = uploads[("site-1", 0)], uploads[("site-2", 0)]
    expect = np.zeros((C, D))
    for c in range(C):
        tot = n1[c] + n2[c]
        expect[c] = (n1[c] * P1[c] + n2[c] * P2[c]) / tot
    np.testing.assert_allclose(fake.sent[1][2]["global_prototypes"], expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fake.sent[1][2]["global_mask"], [1, 1, 1])
    # round 2 broadcast = site-1's round-1 prototypes (the only usable upload); class 2 absent there
    P1b, n1b = uploads[("site-1", 1)]
    np.testing.assert_allclose(fake.sent[2][2]["global_prototypes"][:2], P1b[:2], rtol=1e-6)
    np.testing.assert_array_equal(fake.sent[2][2]["global_mask"], [1, 1, 0])

    # effective rank of the stacked present rows, by hand: exp(entropy of normalised singular values)
    def erank(M):
        s = np.linalg.svd(np.asarray(M, np.float64), compute_uv=False)
        p = s / s.sum()
        p = p[p > 0]
        return float(np.exp(-(p * np.log(p)).sum()))

    stacked0 = np.concatenate([P1[n1 > 0], P2[n2 > 0]])
    assert rec["effective_rank"][0] == pytest.approx(erank(stacked0), rel=1e-5)
    assert rec["effective_rank"][1] == pytest.approx(erank(P1b[n1b > 0]), rel=1e-5)
    assert all(1.0 <= e <= min(len(stacked0), D) + 1e-9 for e in rec["effective_rank"])
    assert any("effective rank" in m for m in logs["info"])

    # payload per site and round = theory (C*d + C float32 up; nothing down in round 0, C*d + C after)
    rows = rec["payload"]["per_round"]
    assert [r["down_per_site"] for r in rows] == [0, 4 * (C * D + C), 4 * (C * D + C)]
    assert rows[0]["up_per_site"]["site-1"] == 4 * (C * D + C)
    assert rows[0]["matches_theory"] and rows[2]["matches_theory"]


def test_fedsaf_binary_structural_alignment_is_reported(tmp_path):
    from hfl_components.flare.controllers import FedSAFController

    def answer(task, rnd, site, data):
        if task == "evaluate":
            return _eval_answer()
        P = np.eye(2, D, dtype=np.float32)
        return {"prototypes": P, "counts": np.asarray([3, 2], np.float32)}, {}, {"status": "ok", "n_train": 5}

    ctl = FedSAFController(num_classes=2, feature_dim=D, num_rounds=1, task_config={"alignment": "rcsa"})
    logs = _wire(ctl, tmp_path, transport(["site-1"], answer))
    ctl.run()
    assert any("2 classes" in w and "instance-level" in w for w in logs["warning"])


def test_make_controller_fedsaf_options():
    from nvflare_jobs.jobs import make_controller

    spec = {"family": "resnet", "feature_dim": 64, "in_channels": 1, "num_classes": 3}
    profile = {f"site-{i}": {"model": dict(spec)} for i in (1, 2, 3)}
    ctl = make_controller("fedproto", profile, {"rounds": 2, "alignment": "gcsa", "prototypes": "tgp"})
    assert ctl.method == ctl.record["method"] == "fedproto"
    assert ctl.task_config["alignment"] == "mse" and ctl.prototypes == "fedproto"
    assert ctl.task_config["eval"] == "head"
    ctl = make_controller("fedsaf", profile, {"alignment": "rcsa", "eval": "nearest-prototype"})
    assert ctl.task_config["eval"] == "nearest-prototype" and ctl.feature_dim == 64
    with pytest.raises(ValueError, match="nearest-global is not offered"):
        make_controller("fedsaf", profile, {"eval": "nearest-global"})
    with pytest.raises(ValueError, match="nearest-prototype"):
        make_controller("fedtopo", profile, {"eval": "nearest-prototype"})


def test_nearest_prototype_probabilities():
    from hfl_components.alignment.prototypes import nearest_prototype_probs as _nearest_prototype_probs

    P = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    counts = np.array([5, 3, 0])  # class 2 absent on this site: never predicted
    Z = np.array([[1.0, 0.0], [9.0, 1.0], [0.0, 9.0], [6.0, 0.0]])
    p = _nearest_prototype_probs(Z, P, counts)
    np.testing.assert_allclose(p.sum(1), 1.0)
    assert (p[:, 2] == 0).all()
    # the point at (0, 9) is nearest to the absent class's row but must go to the nearest *present* prototype
    assert p.argmax(1).tolist() == [0, 1, 0, 1]
    # softmax of -squared distances, by hand, for the first point
    d = np.array([1.0, 81.0])
    np.testing.assert_allclose(p[0, :2], np.exp(-d) / np.exp(-d).sum())


# ---------------------------------------------------------------------------------------------- simulator
@pytest.fixture(scope="module")
def partition3_subtype(data_root, tmp_path_factory):
    return make_partition(data_root, tmp_path_factory.mktemp("p3s"), 3, labels="subtype", max_images=240)


@pytest.mark.slow
def test_fedsaf_simulation_three_backbones(partition3_subtype, tmp_path):
    from nvflare_jobs.results import find_server_results

    profile = make_profile(partition3_subtype, tmp_path / "profile", "fedsaf", labels="subtype", sizes=(64,),
                           max_train_images=24, feature_dim=64)
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "fedsaf", "--profile", str(profile), "--rounds", "2", "--local-epochs", "1",
                "--alignment", "gcsa", "--eval", "nearest-prototype", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_metrics(run)
    sites = ["site-1", "site-2", "site-3"]
    assert_canonical(m, sites)
    assert m["method"] == "fedsaf" and m["labels"] == "subtype"
    families = [m["sites"][s]["model"]["family"] for s in sites]
    assert len(set(families)) == 3, families  # three different backbones
    assert all(m["sites"][s]["model"]["feature_dim"] == 64 for s in sites)
    for s in sites:
        t = m["sites"][s]["test"]
        assert np.asarray(t["confusion_matrix"]).shape == (3, 3)
        assert t["eval"] == "nearest-prototype"
    assert m["task_config"]["alignment"] == "gcsa" and m["task_config"]["eval"] == "nearest-prototype"
    assert not m["excluded_sites"]

    # per-round curves: two training rounds with a validation accuracy per site, then the final evaluation
    train_rounds = [x for x in m["rounds"] if x["task"] == "fedsaf_train"]
    assert [x["round"] for x in train_rounds] == [0, 1]
    for x in train_rounds:
        assert sorted(x["val_accuracy"]) == sites
        assert all(0.0 <= v <= 1.0 for v in x["val_accuracy"].values())

    # communication: C*d + C float32 numbers per site up every round; down nothing in round 0, then C*d + C
    per = 4 * (3 * 64 + 3)
    assert [x["bytes_up"] for x in train_rounds] == [3 * per, 3 * per]
    assert [x["bytes_down"] for x in train_rounds] == [0, 3 * per]
    assert m["bytes_uploaded"] == 2 * 3 * per and m["bytes_downloaded"] == 3 * per
    rows = m["payload"]["per_round"]
    assert [r["up_per_site"] for r in rows] == [{s: per for s in sites}] * 2
    assert [r["down_per_site"] for r in rows] == [0, per] and all(r["matches_theory"] for r in rows)

    # effective rank of the stacked prototypes each round, within [1, min(C * sites, d)]
    assert len(m["effective_rank"]) == 2
    assert all(1.0 <= e <= min(3 * 3, 64) for e in m["effective_rank"])

    # round 0 is supervised only; the alignment loss acts from round 1
    rec = json.loads(find_server_results(run / "workspace").read_text())
    flags = [{s: v["alignment_active"] for s, v in x["sites"].items()} for x in rec["rounds"][:2]]
    assert flags == [{s: False for s in sites}, {s: True for s in sites}]
    for name in ("round_curves.png", "effective_rank.png", "payload_per_round.png", "site_accuracy.png"):
        assert (run / name).stat().st_size > 1000, name
