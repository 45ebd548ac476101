"""The learned (stacked) teacher of OHFL's distillation: the stacker on hand cases, its cross-fitting, the probe's
labels, the option's refusals, and the server stage distilling the stacker's targets."""
from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from hfl_components.fusion.stacking import (cross_fitted_logits, fit_stacker, stacked_targets, stacker_logits,
                                            stacking_features, stratified_folds)


def _auc(y, s):
    from hfl_components.training.metrics import compute_metrics

    p = np.stack([1 - s, s], 1)
    return compute_metrics(np.asarray(y), p, 2)["auc"]


def _two_teachers(n=400, seed=0):
    """Teacher A's log-odds = 3 (2y - 1) + N(0, 1) (informative); teacher B's = N(0, 3) (noise)."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < 0.5).long()
    a = 3.0 * (2 * y - 1).double() + torch.randn(n, generator=g, dtype=torch.float64)
    b = 3.0 * torch.randn(n, generator=g, dtype=torch.float64)
    z = torch.stack([torch.stack([-a / 2, a / 2], 1), torch.stack([-b / 2, b / 2], 1)])  # (2, n, 2)
    return z, y


def test_features_centred_log_probabilities_invariant_to_logit_shift():
    z = torch.tensor([[[0.0, 2.0], [1.0, -1.0]], [[3.0, 3.0], [0.0, 1.0]]])  # (K=2, N=2, C=2)
    x = stacking_features(z)
    assert x.shape == (2, 4)
    # teacher 0, image 0: log-odds 2 -> centred log-probabilities (-1, +1)
    assert x[0, :2].tolist() == pytest.approx([-1.0, 1.0])
    assert x[0, 2:].tolist() == pytest.approx([0.0, 0.0])
    assert torch.allclose(stacking_features(z + 5.0), x)


def test_stacker_recovers_the_informative_teacher_when_the_other_is_noise():
    z, y = _two_teachers()
    w, _ = fit_stacker(stacking_features(z), y, 2)
    # binary: the stacker's log-odds weight on teacher k is the difference of its two columns' class weights
    weight = [float((w[2 * k + 1, 1] - w[2 * k + 1, 0]) - (w[2 * k, 1] - w[2 * k, 0])) for k in range(2)]
    assert weight[0] > 0.5 and abs(weight[1]) < 0.1 * weight[0]
    oof = torch.softmax(cross_fitted_logits(z, y), -1)[:, 1].numpy()
    avg = torch.softmax(z, -1).mean(0)[:, 1].numpy()  # the plain average of the two teachers' probabilities
    auc_a = _auc(y, torch.softmax(z[0], -1)[:, 1].numpy())
    assert _auc(y, oof) > _auc(y, avg) + 0.03
    assert _auc(y, oof) == pytest.approx(auc_a, abs=0.01)


def test_a_calibrated_teacher_is_left_as_it_is():
    """Labels drawn from the teacher's own probabilities: the fitted stacker's log-odds are the teacher's."""
    g = torch.Generator().manual_seed(3)
    d = 2.0 * torch.randn(20000, generator=g, dtype=torch.float64)
    y = (torch.rand(20000, generator=g, dtype=torch.float64) < torch.sigmoid(d)).long()
    z = torch.stack([-d / 2, d / 2], 1)[None]
    x = stacking_features(z)
    w, b = fit_stacker(x, y, 2, l2=0.0)
    out = stacker_logits(x, w, b)
    slope = np.polyfit(d.numpy(), (out[:, 1] - out[:, 0]).numpy(), 1)[0]
    assert slope == pytest.approx(1.0, abs=0.05)


def test_cross_fitting_never_fits_an_image_to_its_own_label():
    z, y = _two_teachers(n=60, seed=1)
    folds = stratified_folds(y, 5, seed=0)
    base = cross_fitted_logits(z, y, folds)
    flipped = y.clone()
    flipped[7] = 1 - flipped[7]
    again = cross_fitted_logits(z, flipped, folds)
    assert torch.allclose(again[7], base[7])  # image 7's own label is not an input of its logits
    others = folds != folds[7]
    assert not torch.allclose(again[others], base[others])  # ... but it is one of the other folds'


def test_stratified_folds_deal_every_class_evenly():
    y = torch.tensor([0] * 10 + [1] * 25)
    f = stratified_folds(y, 5, seed=2)
    for k in range(5):
        assert int(((f == k) & (y == 0)).sum()) == 2
        assert int(((f == k) & (y == 1)).sum()) == 5


def test_stacked_targets_are_probabilities_softened_by_the_temperature():
    z, y = _two_teachers(n=50)
    q1 = stacked_targets(z, y, temperature=1.0)
    q2 = stacked_targets(z, y, temperature=2.0)
    assert q1.dtype == torch.float32 and torch.allclose(q1.sum(1), torch.ones(50))
    # the same logits halved: a softer target, ordered the same way
    assert (torch.abs(q2[:, 1] - 0.5) <= torch.abs(q1[:, 1] - 0.5) + 1e-6).all()


@pytest.mark.parametrize("call, match", [
    (lambda: fit_stacker(torch.zeros(4, 2), [1, 1, 1, 1], 2), "two classes"),
    (lambda: fit_stacker(torch.zeros(4, 2), [0, 1, 2, 1], 2), "labels must lie"),
    (lambda: stacking_features(torch.zeros(2, 3)), "K x"),
    (lambda: stacking_features(torch.full((1, 2, 2), float("nan"))), "NaN"),
    (lambda: cross_fitted_logits(torch.zeros(1, 4, 2), [0, 1, 0], 2), "need 4 labels|4 images need"),
    (lambda: stratified_folds([0, 1], 3), "folds"),
    (lambda: stacked_targets(torch.zeros(1, 4, 2), [0, 1, 0, 1], temperature=0.0), "temperature"),
])
def test_bad_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------- the server stage
def test_probe_labels_follow_the_batch_order(tmp_path):
    from hfl_components.flare.distill_stage import probe_labels

    f = tmp_path / "probe.csv"
    with f.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        w.writerows([["/x/train/NORMAL/a.jpeg", "NORMAL"], ["/x/train/PNEUMONIA/b.jpeg", "PNEUMONIA"]])
    assert probe_labels(f, ["b.jpeg", "a.jpeg", "b.jpeg"], "binary") == [1, 0, 1]
    with pytest.raises(ValueError, match="c.jpeg"):
        probe_labels(f, ["c.jpeg"], "binary")
    with pytest.raises(ValueError, match="no labels|carries no labels"):
        probe_labels(tmp_path, ["a.jpeg"], "binary")
    g = tmp_path / "nolabel.csv"
    g.write_text("path\n/x/a.jpeg\n")
    with pytest.raises(ValueError, match="'label' column"):
        probe_labels(g, ["a.jpeg"], "binary")


def test_committed_probe_part_labels(data_root):
    from chest_xray.splits import split_rows
    from hfl_components.flare.distill_stage import probe_labels

    rows = split_rows("probe")[:5]
    names = [r["path"].rsplit("/", 1)[-1] for r in rows]
    assert probe_labels(data_root / "chest_xray_224", names, "binary") == [
        0 if r["label"] == "NORMAL" else 1 for r in rows]


@pytest.mark.parametrize("probe, data_free, augment, match", [
    ("generated", False, False, "'probe'"), ("none", True, False, "data_free"), ("p.csv", False, True, "augment")])
def test_stacked_teacher_refused_where_it_cannot_be_fitted(probe, data_free, augment, match):
    from hfl_components.flare.distill_stage import check_teacher

    with pytest.raises(ValueError, match=match):
        check_teacher("stacked", probe, data_free, augment)
    check_teacher("average", probe, False, augment)  # today's teacher: nothing new is required
    with pytest.raises(ValueError, match="distill_teacher"):
        check_teacher("median", "p.csv", False, False)


def test_catalogue_default_is_the_average_teacher():
    from hfl_components.flare import catalogue

    assert catalogue.option_defaults("ohfl")["distill_teacher"] == "average"
    with pytest.raises(ValueError):
        catalogue.validate_options("ohfl", {"distill_teacher": "median"}, require=False)


def test_server_stage_distils_the_stackers_targets():
    """Two CNN teachers on 20 probe images: the stacked run's first held-aside loss is the KL of the student to the
    cross-fitted stacker's targets, computed here from the teachers' logits, not to the average's."""
    from hfl_components.flare.distill_stage import STACKER, distil_groups
    from hfl_components.fusion.distill import distillation_loss, split_probe
    from hfl_components.models import build_model

    cnn = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}
    torch.manual_seed(0)
    uploads = {}
    for site, n in (("site-a", 30), ("site-b", 10)):
        m = build_model(cnn)
        with torch.no_grad():
            m.classifier.weight.normal_(0.0, 1.0)
        uploads[site] = {"spec": dict(cnn), "state_dict": {k: v.clone() for k, v in m.state_dict().items()},
                         "n_samples": n, "input_size": 16}
    probe = {16: torch.rand(20, 1, 16, 16, generator=torch.Generator().manual_seed(1))}
    labels = [0, 1] * 10
    T = 2.0

    def logits(site, x):
        m = build_model(cnn)
        m.load_state_dict(uploads[site]["state_dict"])
        with torch.no_grad():
            return m.eval()(x)

    z = torch.stack([logits(s, probe[16]) for s in sorted(uploads)])
    q = stacked_targets(z, labels, T, STACKER["folds"], STACKER["l2"], seed=0)
    _, val_idx = split_probe(20, 0.2, seed=0)
    student_sd = {k: v.clone() for k, v in uploads["site-a"]["state_dict"].items()}
    m = build_model(cnn)
    m.load_state_dict(student_sd)
    avg = 0.75 * torch.softmax(z[0] / T, -1) + 0.25 * torch.softmax(z[1] / T, -1)  # samples 30 : 10
    with torch.no_grad():
        want = float(distillation_loss(m.eval()(probe[16][val_idx]), q[val_idx], T))
        slip = float(distillation_loss(m.eval()(probe[16][val_idx]), avg[val_idx], T))
    assert abs(want - slip) > 0.05 * want
    students = {"cnn": {"spec": dict(cnn), "state_dict": student_sd, "start": "site site-a",
                        "sites": ["site-a", "site-b"]}}
    common = dict(steps=1, temperature=T, weighting="samples", augment=False, data_free=False, data_free_rounds=0,
                  in_channels=1, seed=0, max_seconds=None, feature_weight=0.0, feature_layer="penultimate")
    recs = distil_groups(students, uploads, probe, "cpu", teacher="stacked", labels=labels, **common)
    rec = recs["cnn"]
    assert rec["teacher"] == "stacked" and rec["stacker"]["n"] == 20
    assert rec["initial_val_loss"] == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match="stacked needs"):
        distil_groups(students, uploads, probe, "cpu", teacher="stacked", labels=None, **common)
