"""Invariants of behaviour that a plausible one-line slip would break, each checked against a value computed here by
hand (not through the function under test):

* distillation teachers label the probe at their own input size, not the largest one;
* class weights reach the FENS aggregator's loss and move the fitted aggregator where the weighted cross-entropy's
  optimum says;
* a decision at the operating point thresholds *calibrated* p(positive) (temperature != 1);
* what a site sends for the operating point is the histogram of its *calibrated* validation p(positive).

Every case builds its own data (no ../shared/data) and runs in about a second.
"""
from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

torch.set_num_threads(1)
CNN = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _calibrate_by_hand(p1, T: float) -> np.ndarray:
    """Binary temperature scaling (Guo et al. 2017) written out: sigmoid(logit(p) / T)."""
    p1 = np.asarray(p1, np.float64)
    return _sigmoid(np.log(p1 / (1.0 - p1)) / T)


def _kl(q, p) -> float:
    q, p = np.asarray(q, np.float64), np.asarray(p, np.float64)
    return float((q * np.log(q / p)).sum())


# =============================================================================== teachers at their own input size
class _PixelSumTeacher(nn.Module):
    """Logits (0, c * sum of the image's pixels / 64): the same picture at 16 px and at 32 px sums to values four
    times apart, so this teacher's answer depends on the size it is shown."""

    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x):
        s = self.c * x.sum(dim=(1, 2, 3)) / 64.0
        return torch.stack([torch.zeros_like(s), s], dim=1)


class _BiasStudent(nn.Module):
    """Logits = a learnable (2,) bias whatever the image: its softened probabilities can match any one target."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return self.b.expand(x.shape[0], 2)


def test_distillation_teachers_label_the_probe_at_their_own_input_size():
    """Two teachers, at 16 px and 32 px, on a probe of identical constant images (value 0.5): by hand the 16 px
    teacher (c = 0.5) sees a pixel sum of 128, logits (0, 1.0), the 32 px teacher (c = 0.1) a sum of 512, logits
    (0, 0.8). With T = 2 and weights 0.6, 0.4 the target is q = 0.6 softmax((0, 0.5)) + 0.4 softmax((0, 0.4)); a
    student starting at logits 0 has held-aside loss T^2 KL(q || (1/2, 1/2)), and after training its softened
    probabilities reach q. Labelled at the largest size, the 16 px teacher would say (0, 4.0) instead."""
    from hfl_components.fusion.distill import DistillConfig, Teacher, distill

    T, w = 2.0, [0.6, 0.4]
    probe = {16: torch.full((20, 1, 16, 16), 0.5), 32: torch.full((20, 1, 32, 32), 0.5)}
    teachers = [Teacher("small", _PixelSumTeacher(0.5), 16), Teacher("large", _PixelSumTeacher(0.1), 32)]

    def target(z_small, z_large):
        soft = lambda z: np.exp(np.array([0.0, z]) / T) / np.exp(np.array([0.0, z]) / T).sum()  # noqa: E731
        return w[0] * soft(z_small) + w[1] * soft(z_large)
    q = target(0.5 * 128 / 64, 0.1 * 512 / 64)
    q_largest = target(0.5 * 512 / 64, 0.1 * 512 / 64)  # what the slip would teach
    assert abs(q[1] - q_largest[1]) > 0.1

    student = _BiasStudent()
    res = distill(student, [16], teachers, probe, torch.tensor(w),
                  DistillConfig(steps=80, temperature=T, lr=0.5, momentum=0.0, batch_size=8, eval_every=40,
                                patience=0, val_fraction=0.2))
    assert res.initial_val_loss == pytest.approx(T ** 2 * _kl(q, [0.5, 0.5]), rel=1e-5)
    learnt = torch.softmax(student.b.detach().double() / T, 0).numpy()
    assert learnt == pytest.approx(q, abs=2e-3)


def test_server_stage_teachers_are_built_at_their_uploads_input_sizes():
    """The server's distillation stage from uploads (two CNN sites at 16 px and 32 px): the student's held-aside loss
    before training equals, by hand, T^2 KL(q || student) averaged over the student's sizes, where q is the
    sample-weighted mean of each teacher run on the probe at *its upload's* size. Probe: one random 16 px image
    repeated, and its 2x nearest-neighbour enlargement at 32 px, so every probe image has the same target."""
    from hfl_components.flare.distill_stage import distil_groups
    from hfl_components.models import build_model

    T = 2.0
    torch.manual_seed(0)
    uploads = {}
    for site, size, n in (("site-a", 16, 30), ("site-b", 32, 10)):
        m = build_model(CNN)
        with torch.no_grad():
            m.classifier.weight.normal_(0.0, 0.1)  # the family starts at 0: teachers whose answers differ
        uploads[site] = {"spec": dict(CNN), "state_dict": {k: v.clone() for k, v in m.state_dict().items()},
                         "n_samples": n, "input_size": size}
    img16 = torch.rand(1, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    probe = {16: img16.repeat(10, 1, 1, 1),
             32: torch.nn.functional.interpolate(img16, scale_factor=2, mode="nearest").repeat(10, 1, 1, 1)}
    student_sd = {k: v.clone() for k, v in uploads["site-a"]["state_dict"].items()}

    def run(sd, x):
        m = build_model(CNN)
        m.load_state_dict(sd)
        with torch.no_grad():
            return m.eval()(x[:1]).double()[0]

    def soft(z):
        return torch.softmax(z / T, 0).numpy()
    w = np.array([30, 10]) / 40.0
    q = w[0] * soft(run(uploads["site-a"]["state_dict"], probe[16])) + \
        w[1] * soft(run(uploads["site-b"]["state_dict"], probe[32]))
    q_largest = w[0] * soft(run(uploads["site-a"]["state_dict"], probe[32])) + \
        w[1] * soft(run(uploads["site-b"]["state_dict"], probe[32]))
    want = np.mean([T ** 2 * _kl(q, soft(run(student_sd, probe[s]))) for s in (16, 32)])
    slip = np.mean([T ** 2 * _kl(q_largest, soft(run(student_sd, probe[s]))) for s in (16, 32)])
    assert abs(want - slip) > 0.05 * want

    students = {"cnn": {"spec": dict(CNN), "state_dict": student_sd, "start": "site site-a",
                        "sites": ["site-a", "site-b"]}}
    recs = distil_groups(students, uploads, probe, "cpu", steps=1, temperature=T, weighting="samples",
                         augment=False, data_free=False, data_free_rounds=0, in_channels=1, seed=0, max_seconds=None,
                         teacher="average", feature_weight=0.0, feature_layer="penultimate")
    assert recs["cnn"]["sizes"] == [16, 32]
    assert recs["cnn"]["initial_val_loss"] == pytest.approx(want, rel=1e-4)


# =============================================================================== class weights in the FENS aggregator
def _uninformative_outputs(n0: int, n1: int):
    """Members' log-probabilities that say nothing (1/2, 1/2 for every image) and labels with n0 zeros, n1 ones:
    the aggregator can only learn a constant, and the (weighted) cross-entropy's minimiser is known by hand."""
    z = np.full((n0 + n1, 2, 2), math.log(0.5), np.float32)
    y = np.r_[np.zeros(n0, np.int64), np.ones(n1, np.int64)]
    return z, y


def _p1(agg, z) -> float:
    with torch.no_grad():
        return float(torch.softmax(agg(torch.as_tensor(z[:1])), 1)[0, 1])


def test_class_weights_move_the_fitted_fens_aggregator_to_the_weighted_optimum():
    """80 negatives, 20 positives, constant inputs, one batch of all rows. Cross-entropy with class weights
    (w0, w1) is minimised by the constant p1 = w1 n1 / (w0 n0 + w1 n1): plain 20/100 = 0.2; weights (1, 3):
    60/140 = 3/7. (One full batch: PyTorch's weighted mean divides each batch by its own weight sum, which shifts
    the optimum of small batches.)"""
    from hfl_components.models.ensemble import Aggregator
    from hfl_components.training.aggregator import train_aggregator

    z, y = _uninformative_outputs(80, 20)
    fitted = {}
    for name, cw in (("plain", None), ("weighted", torch.tensor([1.0, 3.0]))):
        torch.manual_seed(0)
        agg = Aggregator(2, 2, "linear", residual=False)
        train_aggregator(agg, z, y, epochs=200, lr=0.05, batch_size=100, seed=0, class_weights=cw)
        fitted[name] = _p1(agg, z)
    assert fitted["plain"] == pytest.approx(0.2, abs=0.01)
    assert fitted["weighted"] == pytest.approx(3 / 7, abs=0.01)


def test_a_fens_site_with_balanced_class_weights_fits_its_aggregator_to_balanced_classes(tmp_path):
    """The site handler of one aggregator round, on cached member outputs that say nothing (80 negatives, 20
    positives): with the site config's ``class_weights: balanced`` (weights N / (2 n_c) = 0.625, 2.5) the weighted
    optimum is p1 = 2.5 * 20 / (0.625 * 80 + 2.5 * 20) = 1/2; without it, 0.2 (one batch of all rows)."""
    from hfl_components.flare.controllers.fens import OUTPUTS_FILE, fens_aggregate
    from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
    from hfl_components.models import build_model
    from hfl_components.models.ensemble import ensemble_spec

    z, y = _uninformative_outputs(80, 20)
    spec = ensemble_spec([CNN, CNN], [16, 16], 2, "linear", residual=False)
    fitted = {}
    for mode in (None, "balanced"):
        folder = tmp_path / str(mode)
        folder.mkdir()
        np.savez(folder / OUTPUTS_FILE, z=z, y=y)
        torch.manual_seed(0)
        model = build_model(spec)
        start = {GLOBAL_PREFIX + k: v for k, v in to_numpy_state(model.aggregator.state_dict()).items()}
        rt = SimpleNamespace(site="site-1", model=model, spec=spec, state_dir=folder, num_classes=2, labels="binary",
                             cfg={"class_weights": mode, "batch_size": 100, "seed": 0, "input_size": 16},
                             hold_out=lambda f: None, save_state=lambda deployed=False: None, n_train=lambda: 0,
                             dp_spec=None, dp_session=lambda key, n, epochs: None, released_count=lambda n: n,
                             dp_record=lambda: {"dp": False})  # a site without dp
        meta = {"task_config": {"fens_holdout": 0.1, "fens_epochs": 200, "fens_lr": 0.05}, "ensemble_spec": spec,
                "round": 1}
        params, _, out_meta = fens_aggregate(rt, start, meta)
        agg = build_model(spec).aggregator
        agg.load_state_dict({k: torch.as_tensor(v) for k, v in from_numpy_state(
            {GLOBAL_PREFIX + k: v for k, v in params.items()}, GLOBAL_PREFIX).items()})
        fitted[mode] = _p1(agg.eval(), z)
        assert out_meta["NUM_STEPS_CURRENT_ROUND"] == 100
    assert fitted[None] == pytest.approx(0.2, abs=0.01)
    assert fitted["balanced"] == pytest.approx(0.5, abs=0.01)


# =============================================================================== decisions on calibrated p
# Raw p(positive) and the same at T = 3 by hand (sigmoid(logit / 3)), threshold 0.75:
#   positives 0.99 -> 0.822 (kept), 0.95 -> 0.727, 0.90 -> 0.675, 0.60 -> 0.534: calibrated sensitivity 1/4, raw 3/4
#   negatives 0.10 -> 0.325, 0.80 -> 0.613, 0.30 -> 0.432: calibrated specificity 3/3, raw 2/3
RAW_POS, RAW_NEG, T3, THR = [0.99, 0.95, 0.90, 0.60], [0.10, 0.80, 0.30], 3.0, 0.75


def test_hand_case_calibrated_and_raw_decisions_differ():
    cal_pos, cal_neg = _calibrate_by_hand(RAW_POS, T3), _calibrate_by_hand(RAW_NEG, T3)
    assert (cal_pos >= THR).tolist() == [True, False, False, False]
    assert (cal_neg >= THR).tolist() == [False, False, False]
    assert (np.array(RAW_POS) >= THR).sum() == 3 and (np.array(RAW_NEG) >= THR).sum() == 1


def test_operating_point_metrics_threshold_calibrated_p():
    from hfl_components.operating_point import metrics_at_operating_point

    p1 = np.array(RAW_POS + RAW_NEG)
    y = np.array([1] * 4 + [0] * 3)
    r = metrics_at_operating_point(np.stack([1 - p1, p1], 1), y, {"temperature": T3, "threshold": THR}, n_boot=0)
    assert r["sensitivity"]["value"] == pytest.approx(1 / 4) and r["specificity"]["value"] == pytest.approx(1.0)


class _Runtime:
    """The runtime methods a site's side of the operating point calls, on fixed validation/test scores."""

    site = "site-1"

    def __init__(self, state_dir, scores):
        self.state_dir, self.scores = state_dir, scores

    def evaluate(self, split, with_predictions=False):
        p, y = self.scores[split]
        return {"n": len(y), "_probs": [[1 - v, v] for v in p], "_labels": list(y)}

    def save_model(self, path, kind):
        pass


def test_a_site_scores_its_own_rates_at_the_federated_threshold_on_calibrated_p(tmp_path):
    """The site fitted T = 3 earlier; at the federated threshold its validation (the hand case) and test (the hand
    case's negatives as positives and vice versa) rates are those of calibrated p."""
    from hfl_components.flare.site_methods import OPERATING_POINT_FILE, _apply_operating_point

    (tmp_path / OPERATING_POINT_FILE).write_text(json.dumps({"temperature": T3}))
    rt = _Runtime(tmp_path, {"val": (RAW_POS + RAW_NEG, [1] * 4 + [0] * 3),
                             "test": (RAW_NEG + RAW_POS, [1] * 3 + [0] * 4)})
    out = _apply_operating_point(rt, {"operating_point": {"threshold": THR, "target": 0.95}}, {})
    assert out["temperature"] == T3
    assert out["sensitivity"] == pytest.approx(1 / 4) and out["specificity"] == pytest.approx(1.0)
    # test: positives 0.10, 0.80, 0.30 -> none kept; negatives 0.99 ... 0.60 -> 3 of 4 below THR
    assert out["test"]["sensitivity"] == pytest.approx(0.0) and out["test"]["specificity"] == pytest.approx(3 / 4)


def test_predict_thresholds_the_calibrated_probability(tmp_path):
    """A deployed binary model whose output ignores the image (classifier weights 0, bias (0, 3)): raw p(PNEUMONIA)
    = sigmoid(3) = 0.953 >= 0.8, calibrated at T = 3 sigmoid(1) = 0.731 < 0.8. The file's federated threshold 0.8
    must act on the calibrated value: NORMAL, with p_PNEUMONIA 0.731 written."""
    from PIL import Image

    from hfl_components.models import build_model, save_model_file
    from nvflare_jobs.evaluation import predict_files

    torch.manual_seed(0)
    model = build_model(CNN)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([0.0, 3.0]))
    f = tmp_path / "deployed.pt"
    save_model_file(f, CNN, model.state_dict(), input_size=32, labels="binary", kind="deployed",
                    operating_point={"temperature": 3.0, "threshold": 0.8, "target": 0.95})
    img = tmp_path / "xray.png"
    Image.fromarray((np.random.default_rng(0).random((96, 80)) * 255).astype(np.uint8), mode="L").save(img)
    s = predict_files(f, [str(img)], tmp_path / "out.csv")
    assert s["n_ok"] == 1 and s["calibrated"] is True
    with open(tmp_path / "out.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    names = [k[2:] for k in row if k.startswith("p_")]
    pos = names[1]
    assert float(row[f"p_{pos}"]) == pytest.approx(float(_sigmoid(1.0)), abs=1e-4)
    assert row["predicted"] == names[0]


# =============================================================================== what a site sends is calibrated
def _overconfident_validation(n: int = 300, seed: int = 0):
    """Labels with true risk sigmoid(z), z ~ N(0, 1.5^2), and a model reporting sigmoid(3 z): overconfident, so
    the fitted temperature is about 3."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 1.5, n)
    y = (rng.random(n) < _sigmoid(z)).astype(int)
    p1 = np.clip(_sigmoid(3 * z), 1e-6, 1 - 1e-6)
    return np.stack([1 - p1, p1], 1), y


def _nll_minimising_temperature(p1, y) -> float:
    """The temperature by hand: the minimiser of the binary negative log-likelihood of sigmoid(logit(p) / T) over a
    fine grid of log T (the product fits it by a bounded scalar search, to 1e-4 in log T)."""
    logit = np.log(p1 / (1 - p1))
    Ts = np.exp(np.linspace(np.log(0.5), np.log(10), 4001))
    c = _sigmoid(logit[None] / Ts[:, None])
    nll = -(y * np.log(c) + (1 - y) * np.log(1 - c)).mean(axis=1)
    return float(Ts[nll.argmin()])


def _expected_histogram(rep: dict, probs, y):
    """The histogram of calibrated p at the temperature the site reports, and the one of raw p (which must differ)."""
    from hfl_components.operating_point import coarse_histogram

    cal = _calibrate_by_hand(probs[:, 1], rep["temperature"])
    return coarse_histogram(cal, y), coarse_histogram(probs[:, 1], y)


def test_site_report_sends_the_histogram_of_calibrated_p():
    from hfl_components.operating_point import site_report

    probs, y = _overconfident_validation()
    rep = site_report(probs, y)
    assert rep["temperature"] == pytest.approx(_nll_minimising_temperature(probs[:, 1], y), rel=2e-3)
    assert rep["temperature"] > 2.0
    want, raw = _expected_histogram(rep, probs, y)
    assert want != raw
    assert rep["histogram"] == want


def test_what_a_deployed_site_sends_for_the_operating_point_is_calibrated(tmp_path):
    """The site's final step (OHFL's deployed model, validation predictions in hand): the report it returns, which
    leaves the site, holds the histogram of calibrated p and no per-image score."""
    from hfl_components.flare.controllers.ohfl_site import _operating_point_report

    probs, y = _overconfident_validation(seed=1)
    val = {"n": len(y), "_probs": probs.tolist(), "_labels": y.tolist()}
    rep = _operating_point_report(SimpleNamespace(state_dir=tmp_path, site="site-1"), val)
    want, raw = _expected_histogram(rep, probs, y)
    assert want != raw and rep["histogram"] == want
    assert "_probs" not in val and "_labels" not in val
