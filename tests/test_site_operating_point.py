"""The per-model operating point: intervals, threshold rule, efficiency, acceptance check, calibration and
out-of-fold scores, against values computed by hand or by an independent formula."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hfl_components import operating_point as opm


def _wilson(k, n, z):
    """The Wilson score interval by its textbook formula (Wilson 1927), independent of scipy."""
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return c - h, c + h


def test_intervals_by_hand():
    # Wilson 95 % for 8 / 10 (z = 1.959964) and the one-sided 95 % lower bound (z = 1.644854)
    lo, hi = opm.proportion_interval(8, 10, 0.95, "wilson")
    assert (lo, hi) == pytest.approx(_wilson(8, 10, 1.959964), abs=1e-5)
    assert (lo, hi) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert opm.lower_bound(8, 10, 0.95, "wilson") == pytest.approx(_wilson(8, 10, 1.644854)[0], abs=1e-5)
    # Clopper-Pearson 95 % for 8 / 10: beta quantiles, (0.4439, 0.9748); for 10 / 10 the lower end is 0.025^(1/10)
    assert opm.proportion_interval(8, 10, 0.95, "clopper-pearson") == pytest.approx((0.4439, 0.9748), abs=1e-4)
    assert opm.proportion_interval(10, 10, 0.95, "clopper-pearson")[0] == pytest.approx(0.025 ** 0.1, abs=1e-6)
    assert opm.lower_bound(10, 10, 0.95, "clopper-pearson") == pytest.approx(0.05 ** 0.1, abs=1e-6)
    assert opm.proportion_interval(0, 0) == (None, None)
    with pytest.raises(ValueError, match="interval method"):
        opm.proportion_interval(1, 2, method="normal")
    with pytest.raises(ValueError, match="outside"):
        opm.proportion_interval(3, 2)


# positives 0.2, 0.6, 0.7, 0.8, 0.9; negatives 0.1, 0.3, 0.65
P_HAND = np.array([0.2, 0.6, 0.7, 0.8, 0.9, 0.1, 0.3, 0.65])
Y_HAND = np.array([1, 1, 1, 1, 1, 0, 0, 0])


def test_threshold_by_hand():
    # target 0.8 of 5 positives: one may be missed (0.2); the threshold lies midway in logit between the lowest
    # positive kept (0.6) and the next lower score of any image (0.3)
    c = opm.choose_threshold(P_HAND, Y_HAND, target=0.8, floor=0.0)
    mid = 0.5 * (math.log(0.6 / 0.4) + math.log(0.3 / 0.7))
    assert c["misses_allowed"] == 1 and c["logit"] == pytest.approx(mid)
    assert c["threshold"] == pytest.approx(1 / (1 + math.exp(-mid)))
    r = opm.rates_at(P_HAND, Y_HAND, c["threshold"])
    assert r["sensitivity"]["k"] == 4 and r["specificity"]["k"] == 2 and r["specificity"]["n"] == 3
    # a floor of 0.5 on the one-sided Wilson bound: lower_bound(4, 5) = 0.4096 < 0.5 <= lower_bound(5, 5) = 0.6489,
    # so no miss is allowed: the threshold drops below 0.2 (midway to the negative at 0.1)
    assert opm.lower_bound(4, 5) < 0.5 <= opm.lower_bound(5, 5)
    c = opm.choose_threshold(P_HAND, Y_HAND, target=0.8, floor=0.5)
    assert c["misses_allowed"] == 0 and c["floor_reachable"]
    assert c["logit"] == pytest.approx(0.5 * (math.log(0.2 / 0.8) + math.log(0.1 / 0.9)))
    # a floor no count of 5 positives can reach: the target alone decides, and the rule says so
    c = opm.choose_threshold(P_HAND, Y_HAND, target=0.8, floor=0.9)
    assert c["misses_allowed"] == 1 and not c["floor_reachable"]
    assert opm.choose_threshold([0.3, 0.4], [0, 0])["threshold"] is None


def test_threshold_acts_on_calibrated_scores_invariance():
    """Choosing on calibrated p = sigmoid(a logit + b) gives the calibrated image of the raw threshold, so the same
    images are called positive whatever the (monotone affine-in-logit) calibration; predicting at argmax instead
    would change with b."""
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 300)
    z = rng.normal(2.0 * y, 1.0)
    znew = rng.normal(0.0, 2.0, 500)
    raw = opm.choose_threshold(opm._sigmoid(z), y)
    for a, b in ((0.3, 1.5), (4.0, -2.0), (1.0, 0.0)):
        cal = opm.choose_threshold(opm._sigmoid(a * z + b), y)
        assert cal["logit"] == pytest.approx(a * raw["logit"] + b, abs=1e-9)
        assert cal["misses_allowed"] == raw["misses_allowed"]
        assert np.array_equal(opm._sigmoid(a * znew + b) >= cal["threshold"], znew >= raw["logit"])
    # the operating point stores the threshold on calibrated p; calibrate() + threshold = the raw decision
    op = opm.site_operating_point(opm._sigmoid(z), y)
    pnew = opm._sigmoid(znew)
    called = opm.calibrate(np.stack([1 - pnew, pnew], 1), op)[:, 1] >= op["threshold"]
    raw_logit = (op["choice"]["logit"] - op["intercept"]) * op["temperature"]
    assert np.array_equal(called, znew >= raw_logit - 1e-9)


def test_roc_specificity_and_efficiency_by_hand():
    # 20 positives: one at 0.05, 19 at 0.50..0.95; 10 negatives at 0.00..0.45 and one at 0.55
    pos = np.r_[0.05, np.linspace(0.50, 0.95, 19)]
    neg = np.r_[np.linspace(0.0, 0.45, 10), 0.55]
    p = np.r_[pos, neg]
    y = np.r_[np.ones(20, int), np.zeros(11, int)]
    # sensitivity 0.95 allows 1 miss of 20: best threshold = 0.50, negatives below it 10 of 11
    assert opm.roc_specificity_at(p, y, 0.95) == pytest.approx(10 / 11)
    e = opm.operating_point_efficiency(p, y, threshold=0.02)  # every positive, 1 negative of 11 below
    assert e["sensitivity"] == 1.0 and e["specificity"] == pytest.approx(1 / 11)
    assert e["efficiency"] == pytest.approx((1 / 11) / (10 / 11)) and e["counted"]
    e = opm.operating_point_efficiency(p, y, threshold=0.6)  # misses 0.05, 0.50, 0.525, 0.55, 0.575: 15/20
    assert e["sensitivity"] == pytest.approx(0.75) and e["efficiency"] is None and not e["counted"]
    assert "below 0.93" in e["reason"]
    assert opm.operating_point_efficiency(p, np.ones_like(y), 0.5)["efficiency"] is None


def test_acceptance_check_outcomes():
    rng = np.random.default_rng(0)
    y = np.r_[np.ones(100, int), np.zeros(60, int)]
    p = opm._sigmoid(rng.normal(3.0 * y, 1.0))
    op = opm.site_operating_point(p, y)
    acc = op["acceptance"]
    assert acc["accepted"], acc["reason"]
    assert acc["sensitivity"]["lower"] >= 0.90 and acc["specificity"]["lower"] >= 0.50
    assert acc["reason"].startswith("accepted")
    # the lower bound, not the point estimate, meets the floor: 56 / 60 = 0.933 passes a floor of 0.93 only as a
    # point; its one-sided Wilson bound does not
    p56 = np.r_[np.full(100, 0.9), np.full(56, 0.1), np.full(4, 0.9)]
    hard = opm.acceptance_check(p56, y, 0.5, floors={"specificity": 0.93})
    assert hard["specificity"]["value"] == pytest.approx(56 / 60)
    assert hard["specificity"]["lower"] == pytest.approx(_wilson(56, 60, 1.644854)[0], abs=1e-5)
    assert not hard["accepted"] and "specificity lower bound" in hard["reason"]
    assert opm.acceptance_check(p56, y, 0.5, floors={"specificity": 0.85})["accepted"]
    # a model that calls every NORMAL image PNEUMONIA is refused and says so, whatever the floors
    deg = opm.acceptance_check(np.r_[np.full(100, 0.9), np.full(60, 0.8)], y, 0.5, floors={"specificity": 0.0})
    assert not deg["accepted"] and "calls almost every NORMAL image PNEUMONIA" in deg["reason"]
    deg = opm.acceptance_check(np.r_[np.full(100, 0.2), np.full(60, 0.1)], y, 0.5,
                               floors={"sensitivity": 0.0, "specificity": 0.0})
    assert not deg["accepted"] and "every PNEUMONIA image NORMAL" in deg["reason"]
    assert "no operating point" in opm.acceptance_check(p, y, None)["reason"]
    assert "both classes" in opm.acceptance_check(p[:100], y[:100], 0.5)["reason"]
    weak = opm.site_operating_point(opm._sigmoid(rng.normal(0.3 * y, 1.0)), y)  # AUC about 0.58
    assert not weak["acceptance"]["accepted"] and "specificity lower bound" in weak["acceptance"]["reason"]
    # what leaves the site: no scores, no threshold
    s = opm.summary_for_server(op)
    assert "threshold" not in s and s["accepted"] and set(s["sensitivity"]) == {"value", "k", "n", "ci_low",
                                                                               "ci_high", "lower"}


def test_calibration_does_not_collapse_on_a_separated_split_and_is_kept_only_when_it_helps():
    # 15 perfectly separated validation images: maximum likelihood runs the temperature to its bound 0.05
    y = np.r_[np.ones(9, int), np.zeros(6, int)]
    z = np.r_[np.linspace(0.5, 3, 9), np.linspace(-3, -0.2, 6)]
    p = opm._sigmoid(z)
    assert opm.fit_temperature(np.stack([1 - p, p], 1), y) == pytest.approx(0.05, rel=0.01)
    a, b = opm.fit_platt(z, y)
    assert 1.0 < a < 5.0 and abs(b) < 1.5  # the prior holds the slope away from the bound 20
    # a model three times overconfident on 600 images: the calibration is kept, lowers the ECE, T close to 3
    rng = np.random.default_rng(1)
    zt = rng.normal(0, 1.5, 600)
    yt = (rng.random(600) < opm._sigmoid(zt)).astype(int)
    c = opm.choose_calibration(opm._sigmoid(3 * zt), yt)
    assert c["kind"] == "platt" and c["temperature"] == pytest.approx(3.0, rel=0.2)
    assert c["ece_cv"] < c["ece_raw"]
    # an already calibrated model with an ECE no fit can lower: forced by scoring the identity (ece_raw = 0 bins)
    yc = np.r_[np.zeros(50, int), np.ones(50, int)]
    pc = np.r_[np.full(50, 0.0), np.full(50, 1.0)]
    k = opm.choose_calibration(pc, yc)
    assert k["ece_raw"] == pytest.approx(0.0, abs=1e-6) and k["kind"] == "none" and k["temperature"] == 1.0


def test_reliability_bins_by_hand():
    p = [0.05, 0.05, 0.15, 0.95, 0.95, 0.95, 0.95]
    y = [0, 1, 0, 1, 1, 1, 0]
    r = opm.reliability_bins(p, y, n_bins=10)
    assert r["count"] == [2, 1, 4] and r["observed"] == pytest.approx([0.5, 0.0, 0.75])
    assert r["mean_predicted"] == pytest.approx([0.05, 0.15, 0.95])
    # the diagram's ECE: |0.5 - 0.05| on 2 images, |0 - 0.15| on 1, |0.75 - 0.95| on 4
    assert r["ece"] == pytest.approx((2 * 0.45 + 0.15 + 4 * 0.2) / 7)
    assert opm.binary_ece([0.3, 0.3, 0.8], [0, 1, 1], n_bins=2) == pytest.approx((2 * 0.2 + 0.2) / 3)


def test_out_of_fold_scores_hold_each_image_out_once_and_keep_patients_together():
    y = np.array([0, 1] * 15)
    groups = np.repeat(np.arange(10), 3)
    seen = []

    def fit_predict(train, held):
        assert not set(train) & set(held)
        assert not set(groups[train]) & set(groups[held])  # a patient never on both sides
        seen.extend(held)
        return np.full(held.size, y[train].mean())

    s = opm.out_of_fold_scores(y, fit_predict, groups, k=5, seed=0)
    assert sorted(seen) == list(range(30)) and s.shape == (30,)
    with pytest.raises(ValueError, match="k >= 2"):
        opm.fold_assignment(y, groups, k=1)
    with pytest.raises(ValueError, match="scores for"):
        opm.out_of_fold_scores(y, lambda tr, he: np.zeros(1), groups)


def test_federation_estimate_and_shrinkage_by_hand():
    # two sites at logits 0 and 2, se 1 each: Q = 2, tau^2 = (Q - 1) / (2 - 1) = 1, mu = 1
    fed = opm.federation_estimate({"a": {"logit": 0.0, "se": 1.0}, "b": {"logit": 2.0, "se": 1.0},
                                   "c": {"logit": None, "se": None}})
    assert fed["mu"] == pytest.approx(1.0) and fed["tau2"] == pytest.approx(1.0) and fed["sites"] == ["a", "b"]
    # posterior mean of a site at 2 with se 1 under N(1, 1): 1.5; se 3: (2/9 + 1) / (1/9 + 1) = 1.1
    assert opm.shrink_threshold(2.0, 1.0, fed) == pytest.approx(1.5)
    assert opm.shrink_threshold(2.0, 3.0, fed) == pytest.approx((2 / 9 + 1) / (1 / 9 + 1))
    assert opm.shrink_threshold(2.0, 1.0, None) == 2.0
    assert opm.shrink_threshold(2.0, 1.0, {"mu": 0.3, "tau2": 0.0}) == 0.3
    assert opm.federation_estimate({"a": {"logit": 0.0, "se": 1.0}}) is None
    # applied at a site: never above its own threshold, and rescored on its acceptance data
    rng = np.random.default_rng(2)
    y = np.r_[np.ones(80, int), np.zeros(50, int)]
    p = opm._sigmoid(rng.normal(3.0 * y, 1.0))
    op = opm.site_operating_point(p, y)
    up = opm.apply_federation(op, p, y, {"mu": op["choice"]["logit"] + 5, "tau2": 0.0})
    down = opm.apply_federation(op, p, y, {"mu": op["choice"]["logit"] - 1, "tau2": 0.0})
    assert up["threshold"] == pytest.approx(op["threshold"]) and not up["federation"]["shrunk"]
    assert down["threshold"] < op["threshold"] and down["federation"]["shrunk"]
    assert down["rates"]["sensitivity"]["k"] >= op["rates"]["sensitivity"]["k"]


def test_reliability_diagram_png(tmp_path):
    from nvflare_jobs.plots import reliability_diagram

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    p = opm._sigmoid(rng.normal(2.0 * y - 1.0, 1.0))
    out = reliability_diagram(tmp_path / "rel.png", {"site-1": opm.reliability_bins(p, y), "empty": {}})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_header_record_is_json_and_reads_back_through_the_model_file(tmp_path):
    import json

    from hfl_components.models.files import read_model_header, save_model_file
    from hfl_components.models import build_model

    rng = np.random.default_rng(4)
    y = np.r_[np.ones(90, int), np.zeros(50, int)]
    p = opm._sigmoid(rng.normal(3.0 * y - 1.0, 1.2))
    op = opm.site_operating_point(p, y)
    json.dumps(op)  # every part JSON-safe
    rec = opm.header_record(op)
    spec = {"family": "cnn", "num_classes": 2}
    f = save_model_file(tmp_path / "m.pt", spec, build_model(spec).state_dict(), input_size=32, labels="binary",
                        operating_point=rec)
    back = read_model_header(f)["operating_point"]
    assert back["threshold"] == pytest.approx(op["threshold"]) and back["accepted"] == op["acceptance"]["accepted"]
    # the stored record decides as the site did on its acceptance scores
    called = opm.calibrate(np.stack([1 - p, p], 1), back)[:, 1] >= back["threshold"]
    assert int(called[y == 1].sum()) == op["rates"]["sensitivity"]["k"]
    line = opm.site_line("site-1", op)
    assert line.startswith("site-1: threshold") and ("ACCEPTED" in line or "REFUSED" in line) and "\n" not in line
