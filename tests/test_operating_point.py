"""The clinical operating point: temperature fit, the coarse histogram a site sends, and the pooled threshold the
server picks, against values computed by hand."""
from __future__ import annotations

import numpy as np
import pytest


def test_temperature_recovers_a_known_overconfidence_and_lowers_ece():
    from hfl_components.operating_point import apply_temperature, expected_calibration_error, fit_temperature

    rng = np.random.default_rng(0)
    n = 4000
    z = rng.normal(0, 1.5, n)  # true log-odds
    y = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(int)
    over = np.stack([np.zeros(n), 3.0 * z], 1)  # a model three times overconfident
    probs = np.exp(over - over.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    T = fit_temperature(probs, y)
    assert T == pytest.approx(3.0, rel=0.1)
    cal = apply_temperature(probs, T)
    assert expected_calibration_error(cal, y) < 0.5 * expected_calibration_error(probs, y)
    # ranking (hence AUC) unchanged; T = 1 is the identity
    assert np.array_equal(np.argsort(cal[:, 1]), np.argsort(probs[:, 1]))
    assert np.allclose(apply_temperature(probs, 1.0), probs, atol=1e-9)


def test_coarse_histogram_merges_bins_to_the_minimum_count_by_hand():
    from hfl_components.operating_point import coarse_histogram

    grid = [0, 0.25, 0.5, 0.75, 1.0]
    # negatives per fine bin: 3, 1, 0, 1 -> [0, .25): 3; [.25, 1]: 1 + 0 + 1 = 2 (the remainder joins the last bin)
    # positives per fine bin: 0, 1, 1, 4 -> [0, .25): 0 (empty, outside any bin); [.25, .75): 2; [.75, 1]: 4
    p = [0.1, 0.2, 0.05, 0.3, 0.9, 0.3, 0.6, 0.8, 0.85, 0.95, 1.0]
    y = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    h = coarse_histogram(p, y, grid, min_count=2)
    assert h["classes"]["0"] == {"edges": [0.0, 0.25, 1.0], "counts": [3, 2]}
    assert h["classes"]["1"] == {"edges": [0.0, 0.25, 0.75, 1.0], "counts": [0, 2, 4]}
    # every non-empty bin holds >= min_count images, whatever the scores
    rng = np.random.default_rng(1)
    for _ in range(20):
        h = coarse_histogram(rng.random(37), rng.integers(0, 2, 37), min_count=5)
        for c in h["classes"].values():
            assert sum(c["counts"]) < 5 or all(n == 0 or n >= 5 for n in c["counts"])
            assert len(c["edges"]) == len(c["counts"]) + 1 and c["edges"][0] == 0 and c["edges"][-1] == 1
    small = coarse_histogram([0.2, 0.9], [1, 1], min_count=5)["classes"]["1"]
    assert small == {"edges": [0.0, 1.0], "counts": [2]}  # too few for any bin: one bin over the grid
    with pytest.raises(ValueError, match="min_count"):
        coarse_histogram([0.5], [1], min_count=0)


HAND = [  # two sites' histograms (what they send)
    {"min_count": 2, "classes": {"1": {"edges": [0, 0.5, 0.75, 1], "counts": [2, 3, 5]},
                                 "0": {"edges": [0, 0.25, 0.5, 1], "counts": [6, 2, 2]}}},
    {"min_count": 2, "classes": {"1": {"edges": [0, 0.25, 0.75, 1], "counts": [1, 4, 5]},
                                 "0": {"edges": [0, 0.5, 1], "counts": [7, 3]}}},
]


@pytest.mark.parametrize("target,threshold,sens,spec,spec_hi", [
    # 20 positives. t = .75: 5 + 5 = 10 detected (0.50); t = .5: 8 + 5 = 13 (0.65; site B's [.25, .75) straddles);
    # t = .25: 8 + 9 = 17 (0.85); t = 0: 20 (1.0). Specificity (20 negatives), lower bound = cells entirely below t,
    # upper = cells starting below t: t = .25: A's [0, .25) 6 -> 0.30; plus B's straddling [0, .5) 7 -> 0.65.
    # t = .5: A 6 + 2, B 7 -> 0.75 both. t = .75: 0.75; upper: A 6 + 2 + 2, B 7 + 3 -> 1.0.
    (0.85, 0.25, 0.85, 0.30, 0.65),
    (0.65, 0.5, 0.65, 0.75, 0.75),
    (0.50, 0.75, 0.50, 0.75, 1.0),
])
def test_pooled_threshold_by_hand(target, threshold, sens, spec, spec_hi):
    from hfl_components.operating_point import pooled_threshold

    r = pooled_threshold(HAND, target)
    assert r["threshold"] == threshold and r["sensitivity"] == pytest.approx(sens) and r["unresolved"] is None
    assert r["specificity"] == pytest.approx(spec) and r["specificity_upper"] == pytest.approx(spec_hi)
    assert r["n_positive"] == 20 and r["n_negative"] == 20


def test_only_threshold_zero_is_no_operating_point():
    """Target 0.90 of HAND: only t = 0 keeps 18 of 20 positives (every cell of site B's [0, .25) and site A's
    [0, .5) would be missed above 0): no threshold, the reason names the sites and the cost."""
    from hfl_components.operating_point import describe, pooled_threshold

    r = pooled_threshold(HAND, 0.90, names=["site-a", "site-b"])
    assert r["threshold"] is None and r["candidate"] == 0.0 and r["sensitivity"] == 1.0
    assert "only threshold 0" in r["unresolved"] and "site-a, site-b" in r["unresolved"]
    assert "cost 3 of 20 positives" in r["unresolved"]  # at the next edge (.25): A's 2 and B's 1 are missed
    line = describe(r)
    assert line.startswith("operating point: NO federated threshold: only threshold 0") and "\n" not in line


def _sig(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, float)))


def test_histogram_threshold_on_the_log_odds_grid_against_a_pooled_threshold_by_hand():
    """Scores placed at known log-odds on the default grid (steps of 0.25 from -8 to 8), five per cell.
    Site A positives: 5 at z = -3.1 (cell [-3.25, -3)), 5 at -1.1 ([-1.25, -1)), 10 at 2.1 ([2, 2.25)); negatives:
    5 at -5.1 ([-5.25, -5)). Site B positives: 10 at 0.6 ([0.5, 0.75)); negatives: 6 at -0.9 ([-1, -0.75)).
    30 positives. Target 0.8 allows 6 misses: A's lowest cell (5) -> t = sigmoid(-1.25), sensitivity 25/30;
    specificity: A's 5 below, B's 6 above -> 5/11 (both bounds). Target 0.6 allows 12: both low cells of A (10) ->
    t = sigmoid(0.5), 20/30, every negative below -> 11/11. Target 0.9 allows 3: no cell -> t = sigmoid(-3.25)."""
    from hfl_components.operating_point import DEFAULT_GRID, coarse_histogram, pooled_threshold

    pa = _sig([-3.1] * 5 + [-1.1] * 5 + [2.1] * 10 + [-5.1] * 5)
    ya = [1] * 20 + [0] * 5
    pb = _sig([0.6] * 10 + [-0.9] * 6)
    yb = [1] * 10 + [0] * 6
    hs = [coarse_histogram(pa, ya), coarse_histogram(pb, yb)]
    grid = np.asarray(DEFAULT_GRID)
    assert all(set(c["edges"]) <= set(DEFAULT_GRID) for h in hs for c in h["classes"].values())
    assert len(grid) == 67 and grid[1] == pytest.approx(_sig(-8), rel=1e-5)
    for target, z, sens, spec in ((0.8, -1.25, 25 / 30, 5 / 11), (0.6, 0.5, 20 / 30, 1.0), (0.9, -3.25, 1.0, 5 / 11)):
        r = pooled_threshold(hs, target)
        assert r["threshold"] == pytest.approx(_sig(z), rel=1e-5), target
        assert r["sensitivity"] == pytest.approx(sens) and r["specificity"] == pytest.approx(spec)
        assert r["specificity_upper"] == pytest.approx(spec) and r["unresolved"] is None
        # the same rule on the raw pooled scores: the histogram's threshold never lies above it, and every pooled
        # validation positive it counts as detected is detected
        p, y = np.r_[pa, pb], np.r_[ya, yb]
        raw = max(t for t in p[y == 1] if (p[y == 1] >= t).mean() >= target)
        assert r["threshold"] <= raw and (p[y == 1] >= r["threshold"]).mean() >= sens


def test_a_threshold_below_every_negative_is_no_operating_point():
    """A weak model: every validation negative scores above the lowest positive; the threshold that keeps the
    target would call every image positive, so none is set (and describe says so in one line)."""
    from hfl_components.operating_point import coarse_histogram, federated_operating_point

    reps = {f"site-{i}": {"histogram": coarse_histogram(_sig([0.1, 0.5, 1, 1.5, 2, 2.5, 3, 3.5] + [1.2] * 6),
                                                        [1] * 8 + [0] * 6)} for i in (1, 2)}
    op = federated_operating_point(reps)
    assert op["threshold"] is None and op["candidate"] == pytest.approx(_sig(0.0), rel=1e-5)
    assert op["specificity_upper"] == 0.0 and "would call every image positive" in op["unresolved"]


def test_sites_with_too_few_positives_are_left_out_and_named():
    """A site with 3 validation positives sends one whole-grid cell (its count only): the former rule counted
    them as missed, which forced t = 0 (3 of 19 > 5 %); they are now left out of the pooled counts and named. With
    no site of >= 5 positives there is no threshold, and the reason says so."""
    from hfl_components.operating_point import coarse_histogram, describe, federated_operating_point

    big = {f"site-{i}": {"histogram": coarse_histogram(_sig([1.1, 2, 2, 3, 3, 4, 4, 5] + [-3.1] * 5),
                                                      [1] * 8 + [0] * 5)} for i in (1, 2)}
    small = {"site-3": {"histogram": coarse_histogram(_sig([-6, 2, 3, -3, -3]), [1, 1, 1, 0, 0])}}
    assert small["site-3"]["histogram"]["classes"]["1"] == {"edges": [0.0, 1.0], "counts": [3]}
    op = federated_operating_point({**big, **small})
    assert op["threshold"] == pytest.approx(_sig(1.0), rel=1e-5) and op["left_out"] == ["site-3"]
    assert op["n_positive"] == 16 and op["n_negative"] == 12 and op["sites"] == ["site-1", "site-2", "site-3"]
    assert "left out, fewer than 5 positives: site-3" in describe(op)
    none = federated_operating_point({f"s{i}": {"histogram": coarse_histogram(_sig([1, 2, 3, 4, -2]),
                                                                              [1, 1, 1, 1, 0])} for i in range(3)})
    assert none["threshold"] is None and none["n_positive"] == 0
    assert none["unresolved"].startswith("no site sent >= 5 validation positives")
    assert "s0, s1, s2" in none["unresolved"]
    assert federated_operating_point({"a": None}) is None


def test_privacy_no_cell_under_the_minimum_count_leaves_a_site():
    """Whatever the scores (ties, grid edges, exact 0 and 1, classes of 1..k-1 images): every cell is empty, holds
    >= k images, or is the one whole-grid cell of a class smaller than k (its count, no score); edges are points
    of the shared grid; the histogram holds counts and grid edges only."""
    from hfl_components.operating_point import DEFAULT_GRID, coarse_histogram, site_report

    rng = np.random.default_rng(3)
    grid = set(DEFAULT_GRID)
    for trial in range(60):
        n = int(rng.integers(1, 40))
        z = rng.choice([rng.normal(0, 4), -np.inf, np.inf, 0.25 * rng.integers(-40, 40)], n)
        p = np.nan_to_num(_sig(np.where(rng.random(n) < 0.7, rng.normal(0, 5, n), z)), nan=0.5)
        y = rng.integers(0, 2, n)
        k = int(rng.integers(2, 7))
        for c, cell in coarse_histogram(p, y, min_count=k)["classes"].items():
            counts, edges = cell["counts"], cell["edges"]
            total = int((y == int(c)).sum())
            assert sum(counts) == total and set(edges) <= grid and edges[0] == 0.0 and edges[-1] == 1.0
            assert all(m == 0 or m >= k for m in counts) or (counts == [total] and edges == [0.0, 1.0]), (trial, cell)
    rep = site_report(np.stack([1 - _sig([-2, 3, 4, 5, 6, 1]), _sig([-2, 3, 4, 5, 6, 1])], 1), [0, 1, 1, 1, 1, 1])
    h = rep["histogram"]["classes"]
    assert h["0"] == {"edges": [0.0, 1.0], "counts": [1]}  # one negative: its count, nothing about its score
    assert len(h["1"]["counts"]) <= 3 and max(h["1"]["counts"]) == 5


def test_the_former_uniform_grid_reaches_zero_where_the_log_odds_grid_does_not():
    """The lowest positive at p = 0.03 (a sharp calibrated model): on the former 0.05 grid its cell starts at 0,
    so only t = 0 reaches the target; on the log-odds grid the cell starts at sigmoid(-3.5) = 0.0293 and every
    negative below it (p <= 0.01) stays negative."""
    from hfl_components.operating_point import coarse_histogram, pooled_threshold

    p = np.r_[[0.03, 0.6, 0.9, 0.95, 0.99], [0.001, 0.002, 0.005, 0.01, 0.01]]
    y = [1] * 5 + [0] * 5
    uniform = tuple(np.round(np.linspace(0, 1, 21), 4))
    assert pooled_threshold([coarse_histogram(p, y, uniform)])["threshold"] is None
    r = pooled_threshold([coarse_histogram(p, y)])
    assert r["threshold"] == pytest.approx(_sig(-3.5), rel=1e-5) and r["specificity"] == 1.0


def test_small_sites_meet_the_target_on_new_images_in_a_simulation():
    """Six sites of the main job's validation sizes (5-6 negatives, 8-10 positives), calibrated binormal scores
    with d' ~ U(1.5, 3.5): the pooled rule sets a threshold in every replicate, and the true pooled sensitivity on
    2,000 new images per class and site reaches 0.90 in at least 95 % of replicates (the rule keeps every pooled
    validation positive, expected sensitivity >= 1 - 1/(P + 1) ~ 0.98)."""
    from hfl_components.operating_point import coarse_histogram, pooled_threshold

    rng = np.random.default_rng(7)
    prior, ok, none = np.log(0.62 / 0.38), 0, 0
    for _ in range(40):
        hs, new = [], []
        for _s in range(6):
            d = rng.uniform(1.5, 3.5)
            n0, n1 = int(rng.integers(5, 7)), int(rng.integers(8, 11))
            y = np.r_[np.zeros(n0, int), np.ones(n1, int)]
            hs.append(coarse_histogram(_sig(d * rng.normal(d * y, 1) - d * d / 2 + prior), y))
            new.append(_sig(d * rng.normal(d, 1, 2000) - d * d / 2 + prior))
        r = pooled_threshold(hs)
        none += r["threshold"] is None
        ok += r["threshold"] is not None and (np.concatenate(new) >= r["threshold"]).mean() >= 0.90
    assert none == 0 and ok >= 38


def test_site_rates_and_their_pooled_test_counts_by_hand():
    from hfl_components.operating_point import add_site_rates, site_rates_at, site_rates_line

    op = {"threshold": 0.5}
    a = site_rates_at(op, (np.array([0.6, 0.4, 0.7, 0.2]), np.array([1, 1, 0, 0])),
                      (np.array([0.9, 0.8, 0.1, 0.6]), np.array([1, 1, 1, 0])))
    assert a["sensitivity"] == 0.5 and a["specificity"] == 0.5 and a["test"]["sensitivity"] == pytest.approx(2 / 3)
    b = site_rates_at(op, (np.array([0.9, 0.1]), np.array([1, 0])), (np.array([0.55, 0.45, 0.2]), np.array([1, 0, 0])))
    rec = add_site_rates({"threshold": 0.5}, {"s1": {"operating_point": a}, "s2": {"operating_point": b},
                                              "s3": {}})
    # test: positives 3 + 1, detected 2 + 1; negatives 1 + 2, correct 0 + 2
    assert rec["test"] == {"sensitivity": 0.75, "specificity": pytest.approx(2 / 3), "n_positive": 4,
                           "n_negative": 3, "n_sites": 2}
    assert set(rec["site_sensitivity"]) == {"s1", "s2"}
    line = site_rates_line(rec)
    assert "pooled test sensitivity 0.75 of 4 positives" in line
    assert "s1 0.50 / 0.67" in line and "s2 1.00 / 1.00" in line
    assert site_rates_at({"threshold": None}, (np.array([0.5]), np.array([1])), None) == {"threshold": None}


def test_metrics_without_a_threshold_report_calibration_only():
    from hfl_components.operating_point import metrics_at_operating_point

    probs = np.array([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4], [0.1, 0.9]])
    r = metrics_at_operating_point(probs, [0, 1, 0, 1], {"temperature": 2.0, "threshold": None, "unresolved": "why"})
    assert r["threshold"] is None and r["unresolved"] == "why" and "sensitivity" not in r
    assert r["ece_before"] is not None and r["ece_after"] is not None


def test_pooled_threshold_meets_the_target_on_the_pooled_scores_and_site_values_differ():
    """Pooling histograms of simulated sites: the threshold's true pooled sensitivity (from the raw scores the
    server never sees) reaches the target; a site whose scores are shifted achieves less, and says so."""
    from hfl_components.operating_point import coarse_histogram, federated_operating_point, site_sensitivity

    rng = np.random.default_rng(0)
    sites = {}
    for k, shift in enumerate((0.0, 0.0, -0.25)):
        y = np.r_[np.zeros(100, int), np.ones(100, int)]
        p = np.clip(np.where(y == 1, rng.beta(8, 2, 200), rng.beta(2, 8, 200)) + shift, 0, 1)
        sites[f"site-{k}"] = (p, y)
    reps = {s: {"histogram": coarse_histogram(p, y, min_count=5)} for s, (p, y) in sites.items()}
    op = federated_operating_point(reps, target=0.95)
    allp = np.concatenate([p for p, _ in sites.values()])
    ally = np.concatenate([y for _, y in sites.values()])
    assert op["threshold"] >= 0.3 and site_sensitivity(allp, ally, op["threshold"])["sensitivity"] >= 0.95
    assert op["sensitivity"] <= site_sensitivity(allp, ally, op["threshold"])["sensitivity"]  # a lower bound
    own = {s: site_sensitivity(p, y, op["threshold"])["sensitivity"] for s, (p, y) in sites.items()}
    assert own["site-2"] < min(own["site-0"], own["site-1"])


def test_site_report_sends_only_the_histogram_and_scalars():
    from hfl_components.operating_point import DEFAULT_GRID, site_report

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 50)
    p1 = np.clip(0.3 * y + 0.5 * rng.random(50), 0.01, 0.99)
    rep = site_report(np.stack([1 - p1, p1], 1), y)
    assert set(rep) == {"temperature", "ece_before", "ece_after", "n_val", "histogram"}
    for c in rep["histogram"]["classes"].values():
        assert all(n == 0 or n >= 5 for n in c["counts"]) and set(c["edges"]) <= set(DEFAULT_GRID)


class _Runtime:
    """The few runtime methods the site side of the operating point uses, on fixed validation/test scores."""

    site = "site-1"

    def __init__(self, state_dir, scores):
        self.state_dir, self.scores, self.saved = state_dir, scores, []

    def evaluate(self, split, with_predictions=False):
        p, y = self.scores[split]
        return {"n": len(y), "_probs": [[1 - v, v] for v in p], "_labels": list(y)}

    def save_model(self, path, kind):
        self.saved.append((path.name, kind, dict(self.operating_point)))


def test_site_stores_the_federated_threshold_or_the_reason_there_is_none(tmp_path):
    """With T = 1 the calibrated scores are the raw ones. At t = 0.5: validation 1 of 2 positives and 1 of 2
    negatives right; test 2 of 3 positives, 0 of 1 negative. Without a threshold the model file carries the
    temperature and the server's reason, and nothing is scored."""
    import json

    from hfl_components.flare.site_methods import OPERATING_POINT_FILE, _apply_operating_point

    (tmp_path / OPERATING_POINT_FILE).write_text(json.dumps({"temperature": 1.0}))
    rt = _Runtime(tmp_path, {"val": ([0.6, 0.4, 0.7, 0.2], [1, 1, 0, 0]), "test": ([0.9, 0.8, 0.1, 0.6], [1, 1, 1, 0])})
    out = _apply_operating_point(rt, {"operating_point": {"threshold": 0.5, "target": 0.95}}, {})
    assert out["temperature"] == 1.0 and out["sensitivity"] == pytest.approx(0.5) and out["specificity"] == 0.5
    assert out["test"]["sensitivity"] == pytest.approx(2 / 3) and out["test"]["specificity"] == 0.0
    assert rt.saved[-1][:2] == ("deployed_model.pt", "deployed") and rt.saved[-1][2]["threshold"] == 0.5
    out = _apply_operating_point(rt, {"operating_point": {"threshold": None, "unresolved": "why not"}}, {})
    assert out == {"temperature": 1.0, "threshold": None}
    assert rt.saved[-1][2]["threshold"] is None and rt.saved[-1][2]["unresolved"] == "why not"


def test_predict_without_a_federated_threshold_says_why_in_one_line(data_root, tmp_path, capsys):
    from hfl_components.models import build_model, save_model_file
    from nvflare_jobs.evaluation import predict_files

    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}
    f = tmp_path / "m.pt"
    save_model_file(f, spec, build_model(spec).state_dict(), input_size=32, labels="binary", kind="deployed",
                    operating_point={"temperature": 1.5, "threshold": None, "unresolved": "no site sent >= 5 x"})
    files = sorted((data_root / "chest_xray_224" / "train" / "NORMAL").glob("*.jpeg"))[:2]
    capsys.readouterr()
    s = predict_files(f, [str(x) for x in files], tmp_path / "out.csv")
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(f) in err and "no site sent >= 5 x" in err and "argmax" in err
    assert s["threshold"] is None and s["calibrated"] is True and s["n_ok"] == 2


def test_run_summary_and_report_give_the_operating_point_in_one_line(capsys, tmp_path):
    from nvflare_jobs.report import operating_point_section
    from nvflare_jobs.results import print_summary

    unset = {"threshold": None, "unresolved": "only threshold 0 (every image positive) reaches it", "target": 0.95}
    m = {"method": "ohfl", "wall_time_s": 1.0, "sites": {}, "operating_point": unset}
    print_summary(m, tmp_path)
    out = [line for line in capsys.readouterr().out.splitlines() if "operating point" in line]
    assert out == ["operating point: NO federated threshold: only threshold 0 (every image positive) reaches it"]
    html = "".join(operating_point_section(m))
    assert "class='warn'" in html and "NO federated threshold" in html and "<table" not in html
    m["operating_point"] = {"threshold": 0.2, "target": 0.95, "sensitivity": 1.0, "specificity": 0.5,
                            "specificity_upper": 0.75, "n_positive": 16, "n_negative": 10, "n_sites": 2,
                            "min_count": 5, "left_out": [],
                            "site_sensitivity": {"s1": {"temperature": 1.2, "sensitivity": 1.0, "specificity": 0.6,
                                                        "test": {"sensitivity": 0.9, "specificity": 0.8}}},
                            "test": {"sensitivity": 0.9, "specificity": 0.8, "n_positive": 10}}
    print_summary(m, tmp_path)
    out = [line for line in capsys.readouterr().out.splitlines() if "operating point" in line or "at the thr" in line]
    assert out[0].startswith("operating point: threshold 0.2 on calibrated p(PNEUMONIA)")
    assert "specificity 0.50-0.75 of 10 negatives" in out[0] and "s1 1.00 / 0.90" in out[1]
    html = "".join(operating_point_section(m))
    assert "class='warn'" not in html and "<td >s1</td>" in html and "0.500–0.750" in html


def test_describe_reads_partial_records_of_older_runs():
    from hfl_components.operating_point import describe

    assert describe({"threshold": 0.4, "target": 0.95}).startswith("operating point: threshold 0.4 on calibrated")
    assert "every image positive" in describe({"threshold": 0.0, "target": 0.95})
    assert describe({"skipped": "no site"}) == "operating point: none: no site" and "none" in describe(None)


def test_per_site_table_csv_and_report_show_the_operating_point_and_acceptance(capsys, tmp_path):
    """make demo's per-site table and sites.csv put test sensitivity / specificity at each site's own operating
    point and the acceptance outcome beside AUC; the report shows the acceptance table with the refusal rate."""
    import csv

    from hfl_components.operating_point import acceptance_summary
    from nvflare_jobs.report import operating_point_section
    from nvflare_jobs.results import write_sites_csv
    from nvflare_jobs.results import print_summary

    r = {"value": 0.96, "lower": 0.91, "k": 24, "n": 25}
    outcomes = {"s1": {"outcome": "accepted", "deployed": "federated", "federated": {"sensitivity": r,
                       "specificity": r, "oof_seconds": 4.0}, "local": None,
                       "test": {"sensitivity": {"value": 0.9}, "specificity": {"value": 0.75}}},
                "s2": {"outcome": "refused: nothing deployed", "deployed": None, "federated": {}, "local": {},
                       "test": None}}
    sites = {s: {"model": {"family": "cnn", "depth": "shallow"}, "input_size": 32, "n_test": 10,
                 "test": {"accuracy": 0.8, "balanced_accuracy": 0.8, "auc": 0.85}, "acceptance": o}
             for s, o in outcomes.items()}
    m = {"method": "ohfl", "wall_time_s": 1.0, "sites": sites, "acceptance": acceptance_summary(outcomes),
         "operating_point": {"rule": "per-model", "sites": ["s1", "s2"]}}
    print_summary(m, tmp_path)
    out = capsys.readouterr().out.splitlines()
    head = next(line for line in out if line.startswith("site"))
    assert head.split()[-4:] == ["auc", "sens", "spec", "acceptance"]
    s1 = next(line for line in out if line.startswith("s1"))
    assert s1.split()[-4:] == ["0.850", "0.900", "0.750", "accepted"]
    s2 = next(line for line in out if line.startswith("s2"))
    assert s2.split()[-6:] == ["0.850", "-", "-", "refused:", "nothing", "deployed"]
    assert any("refusal rate 0.50" in line for line in out)
    write_sites_csv(tmp_path / "sites.csv", sites)
    rows = list(csv.DictReader((tmp_path / "sites.csv").open()))
    assert (rows[0]["op_sensitivity"], rows[0]["op_specificity"], rows[0]["acceptance"]) == ("0.9", "0.75", "accepted")
    assert (rows[1]["op_sensitivity"], rows[1]["acceptance"]) == ("", "refused: nothing deployed")
    html = "".join(operating_point_section(m))
    assert "Site acceptance check" in html and "class='warn'" in html and "0.960 (≥ 0.910)" in html


def test_report_calibration_and_training_population(tmp_path):
    """report.html: per-site ECE before / after and a reliability diagram of the acceptance data; the model card's
    training population, one sentence per deployed model file that records one (and none for a file without)."""
    from hfl_components.models import build_model, save_model_file
    from hfl_components.operating_point import reliability_bins
    from hfl_components.shift import KERMANY_POPULATION, build_reference, population_statement
    from nvflare_jobs.report import calibration_section, population_note

    rng = np.random.default_rng(0)
    p = rng.random(200)
    y = (rng.random(200) < p).astype(int)
    per = {"s1": {"ece_before": 0.12, "ece_after": 0.04, "reliability": reliability_bins(p, y)},
           "s2": {"ece_before": None, "ece_after": None, "reliability": None}}
    html = "".join(calibration_section(per))
    assert "<td>s1</td><td>0.120</td><td>0.040</td>" in html
    assert html.count("<img") == 1 and "<td>s2</td>" not in html
    assert calibration_section({"s2": per["s2"]}) == []

    spec = {"family": "cnn", "depth": "shallow", "in_channels": 1, "num_classes": 2}
    model = build_model(spec)
    (tmp_path / "models").mkdir()
    stats = rng.random((20, 4))
    facts = [{"format": "JPEG", "width": 1000 + 10 * i, "height": 800, "age_years": None, "manufacturer": None,
              "view": None} for i in range(20)]
    ref = build_reference(stats, facts, rng.random((20, 8)), population=KERMANY_POPULATION,
                          stat_names=[f"s{i}" for i in range(4)])
    save_model_file(tmp_path / "models" / "s1_deployed.pt", spec, model.state_dict(), input_size=32,
                    labels="binary", population=ref)
    save_model_file(tmp_path / "models" / "s2_deployed.pt", spec, model.state_dict(), input_size=32, labels="binary")
    note = "".join(population_note(tmp_path))
    assert "paediatric" in note and "one centre" in note and "s2" not in note
    assert population_statement(ref).replace("'", "&#x27;") in note
    assert population_note(tmp_path / "nothing") == []
