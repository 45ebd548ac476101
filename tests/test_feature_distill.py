"""Feature distillation beside the logits (similarity-preserving KD, Tung & Mori 2019): the loss on hand cases, its
invariances, the teachers' layers at their own input sizes, weight 0 as today's loop, and the OHFL option's checks
and round trip through a method-option string."""
from __future__ import annotations

import math

import pytest
import torch

from hfl_components.fusion.distill import DistillConfig, FeatureDistill, Teacher, distill
from hfl_components.fusion.feature_distill import (FEATURE_LAYERS, FEATURES, FeatureTargets, layer_plan,
                                                   model_layers, similarity_loss, similarity_matrix,
                                                   target_similarity)

CNN = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _model(spec, seed):
    from hfl_components.models import build_model

    torch.manual_seed(seed)
    m = build_model(spec)
    with torch.no_grad():  # the class layer starts at zero: give every model some logits
        m.classifier.weight.normal_(0.0, 1.0)
    return m.eval()


# ------------------------------------------------------------------------------------------- the loss
def test_hand_computed_3x3_gram_and_loss():
    """Q = [[1, 0], [0, 1], [1, 1]]: G = Q Qᵀ = [[1, 0, 1], [0, 1, 1], [1, 1, 2]], row norms sqrt 2, sqrt 2, sqrt 6.
    Target from P = [[1, 0], [1, 0], [0, 1]]: G = [[1, 1, 0], [1, 1, 0], [0, 0, 1]], row norms sqrt 2, sqrt 2, 1.
    Squared row differences: 1, 1 and 1/6 + 1/6 + (2/sqrt 6 - 1)² = 2 - 4/sqrt 6; loss = (4 - 4/sqrt 6) / 9."""
    r2, r6 = math.sqrt(2.0), math.sqrt(6.0)
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    p = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    want_q = [[1 / r2, 0.0, 1 / r2], [0.0, 1 / r2, 1 / r2], [1 / r6, 1 / r6, 2 / r6]]
    want_p = [[1 / r2, 1 / r2, 0.0], [1 / r2, 1 / r2, 0.0], [0.0, 0.0, 1.0]]
    assert torch.allclose(similarity_matrix(q), torch.tensor(want_q, dtype=torch.float64))
    assert torch.allclose(similarity_matrix(p), torch.tensor(want_p, dtype=torch.float64))
    loss = similarity_loss(q, torch.tensor(want_p, dtype=torch.float64))
    assert float(loss) == pytest.approx((4.0 - 4.0 / r6) / 9.0, rel=1e-12)


def test_target_is_the_weighted_average_of_the_teachers_normalised_grams():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # G̃ = I
    b = torch.tensor([[1.0], [1.0]])  # G = [[1, 1], [1, 1]], G̃ = all 1/sqrt 2 (a width of 1: widths differ)
    r = 1 / math.sqrt(2.0)
    t = target_similarity([a, b], [0.25, 0.75])
    assert t.dtype == torch.float32
    assert torch.allclose(t, torch.tensor([[0.25 + 0.75 * r, 0.75 * r], [0.75 * r, 0.25 + 0.75 * r]]))
    assert torch.allclose(target_similarity([a, b]), target_similarity([a, b], [0.5, 0.5]))


def test_loss_is_zero_under_rotation_permutation_and_scale_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    teacher = torch.relu(torch.randn(12, 5, generator=g, dtype=torch.float64))
    rot, _ = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))  # an orthogonal matrix
    perm = torch.eye(5, dtype=torch.float64)[torch.randperm(5, generator=g)]
    target = target_similarity([teacher]).double()
    for student in (teacher @ rot, teacher @ perm, 7.5 * teacher, 0.01 * (teacher @ perm) @ rot):
        assert float(similarity_loss(student, target)) < 1e-12
    # a wider student holding the teacher's features in some of its channels, zeros elsewhere
    wide = torch.cat([teacher @ perm, torch.zeros(12, 3, dtype=torch.float64)], 1)
    assert float(similarity_loss(wide, target)) < 1e-12
    other = torch.relu(torch.randn(12, 5, generator=g, dtype=torch.float64))
    assert float(similarity_loss(other, target)) > 1e-3
    # an anisotropic scale of the channels changes which images look alike: not invariant
    assert float(similarity_loss(teacher * torch.tensor([10.0, 1, 1, 1, 0.1], dtype=torch.float64), target)) > 1e-4


@pytest.mark.parametrize("call, match", [
    (lambda: similarity_matrix(torch.ones(3)), "feature dimension"),
    (lambda: similarity_loss(torch.ones(3, 2), torch.ones(2, 2)), r"\(3, 3\)"),
    (lambda: target_similarity([]), "at least one teacher"),
    (lambda: target_similarity([torch.ones(3, 2), torch.ones(4, 2)]), "same images"),
    (lambda: target_similarity([torch.ones(3, 2)], [0.5, 0.5]), "1 teachers need 1 weights"),
    (lambda: FeatureDistill(-1.0, "penultimate").check(), "weight"),
    (lambda: FeatureDistill(float("inf"), "penultimate").check(), "weight"),
    (lambda: FeatureDistill(1.0, "conv3").check(), "layer must be one of"),
    (lambda: layer_plan(_model(CNN, 0), [], "conv3"), "layer must be one of"),
])
def test_bad_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------- the loop
def test_teachers_give_their_layer_at_their_own_input_size():
    hetero = {"family": "hetero_cnn", "width": 0.25, "feature_dim": 8, "in_channels": 1, "num_classes": 2}
    ta, tb = _model(CNN, 1), _model(hetero, 2)
    g = torch.Generator().manual_seed(3)
    imgs = {16: torch.rand(10, 1, 16, 16, generator=g), 24: torch.rand(10, 1, 24, 24, generator=g)}
    teachers = [Teacher("a", ta, 16), Teacher("b", tb, 24)]
    plan = layer_plan(_model(CNN, 0), teachers, "penultimate")
    assert plan["student"] == {FEATURES: [(0, FEATURES), (1, FEATURES)]}
    ft = FeatureTargets(teachers, plan, imgs, batch=4)
    with torch.no_grad():
        assert torch.allclose(ft.cache[(0, FEATURES)], ta.features(imgs[16]), rtol=1e-5, atol=1e-5)
        assert torch.allclose(ft.cache[(1, FEATURES)], tb.features(imgs[24]), rtol=1e-5, atol=1e-5)
    assert ft.dims() == {f"0:{FEATURES}": ta.classifier.in_features, f"1:{FEATURES}": 8}  # two widths
    with pytest.raises(ValueError, match="input size 24"):
        FeatureTargets([teachers[1]], {"layer": "penultimate", "student": {FEATURES: [(0, FEATURES)]}},
                       {16: imgs[16]})


def test_model_layers_are_the_hidden_pre_activations_and_the_logits_of_one_pass():
    m = _model(CNN, 1)
    x = torch.rand(5, 1, 16, 16, generator=torch.Generator().manual_seed(6))
    hidden = m.layers()[:-1]
    conv = next(k for k, r in enumerate(hidden) if r.kind == "conv")
    fc = len(hidden) - 1  # the last hidden layer is an fc layer
    got, logits = model_layers(m, x, [conv, fc])
    seen = {}
    hs = [hidden[k].module.register_forward_hook(lambda _m, _i, out, k=k: seen.__setitem__(k, out.detach()))
          for k in (conv, fc)]
    with torch.no_grad():
        want_logits = m(x)
    for h in hs:
        h.remove()
    assert torch.allclose(logits, want_logits)
    assert torch.allclose(got[conv], seen[conv].mean(dim=(2, 3)))  # a conv layer: its channel means (5, C)
    assert torch.allclose(got[fc], seen[fc])
    f, z = model_layers(m, x, [FEATURES])
    assert torch.allclose(z, want_logits, atol=1e-6) and f[FEATURES].shape == (5, m.classifier.in_features)
    with pytest.raises(ValueError, match="int keys only"):
        model_layers(m, x, [FEATURES, 0])


def test_aligned_plan_pairs_the_layers_ohfls_alignment_pairs():
    """A teacher of the student's own architecture: the CKA + DP alignment is the identity map (every hidden layer
    with itself: equal layouts give the identity, layer_alignment.align_layers), so each student layer is taught by
    the same layer of that teacher. A non-fusable teacher pairs its features with the student's last hidden layer;
    a non-fusable student falls back to the penultimate plan."""
    hetero = {"family": "hetero_cnn", "width": 0.25, "feature_dim": 8, "in_channels": 1, "num_classes": 2}
    student = _model(CNN, 0)
    n_hidden = len(student.layers()) - 1
    imgs = {16: torch.rand(20, 1, 16, 16, generator=torch.Generator().manual_seed(7))}
    teachers = [Teacher("same", _model(CNN, 1), 16), Teacher("other", _model(hetero, 2), 16)]
    plan = layer_plan(student, teachers, "aligned", imgs, student_size=16)
    assert plan["how"][0] == "aligned" and plan["how"][1].startswith("last layers")
    want = {j: [(0, j)] for j in range(n_hidden)}
    want[n_hidden - 1] = [(0, n_hidden - 1), (1, FEATURES)]
    assert plan["student"] == want
    fallback = layer_plan(_model(hetero, 3), teachers, "aligned", imgs, student_size=16)
    assert fallback["student"] == {FEATURES: [(0, FEATURES), (1, FEATURES)]}
    # the loss of a student equal to its only teacher is 0 at every aligned layer
    ft = FeatureTargets(teachers[:1], layer_plan(student, teachers[:1], "aligned", imgs, 16), imgs)
    twin = Teacher("twin", _model(CNN, 0), 16)
    ft_twin = FeatureTargets([twin], layer_plan(student, [twin], "aligned", imgs, 16), imgs)
    idx = torch.arange(8)
    with torch.no_grad():
        layers, _ = model_layers(student, imgs[16][:8], ft_twin.student_keys)
        assert float(ft_twin.loss(layers, idx)) < 1e-10
        layers, _ = model_layers(student, imgs[16][:8], ft.student_keys)
        assert float(ft.loss(layers, idx)) > 1e-6


def _tiny_case():
    teachers = [Teacher("a", _model(CNN, 1), 16), Teacher("b", _model(CNN, 2), 16)]
    imgs = {16: torch.rand(24, 1, 16, 16, generator=torch.Generator().manual_seed(4))}
    cfg = DistillConfig(steps=6, batch_size=8, eval_every=3, patience=0, seed=5)
    return teachers, imgs, cfg


def _run(features, teachers, imgs, cfg):
    student = _model(CNN, 0)
    res = distill(student, [16], teachers, imgs, weights=[0.25, 0.75], config=cfg, features=features)
    return student.state_dict(), res.as_dict()


def test_weight_zero_is_todays_loop_bit_for_bit_and_a_positive_weight_changes_the_student():
    teachers, imgs, cfg = _tiny_case()
    base_sd, base_rec = _run(None, teachers, imgs, cfg)
    zero_sd, zero_rec = _run(FeatureDistill(0.0, "penultimate"), teachers, imgs, cfg)
    assert all(torch.equal(base_sd[k], zero_sd[k]) for k in base_sd)
    assert "feature" not in zero_rec and zero_rec["val_loss"] == base_rec["val_loss"]
    on_sd, on_rec = _run(FeatureDistill(3000.0, "penultimate"), teachers, imgs, cfg)
    assert any(not torch.equal(base_sd[k], on_sd[k]) for k in base_sd)
    f = on_rec["feature"]
    assert f["weight"] == 3000.0 and f["layer"] == "penultimate" and f["how"] == {"a": "features", "b": "features"}
    assert f["teacher_dims"] == {f"{k}:{FEATURES}": t.model.classifier.in_features for k, t in enumerate(teachers)}
    assert [s for s, _ in f["train_loss"]] == [3, 6] and all(v >= 0 for _, v in f["train_loss"])
    al_sd, al_rec = _run(FeatureDistill(3000.0, "aligned"), teachers, imgs, cfg)
    n_hidden = len(teachers[0].model.layers()) - 1  # both teachers share the student's architecture: identity maps
    assert al_rec["feature"]["how"] == {"a": "aligned", "b": "aligned"}
    assert al_rec["feature"]["plan"] == {str(j): [["a", str(j)], ["b", str(j)]] for j in range(n_hidden)}
    assert any(not torch.equal(al_sd[k], on_sd[k]) for k in base_sd)
    with pytest.raises(ValueError, match="augment"):
        distill(_model(CNN, 0), [16], teachers, imgs, config=DistillConfig(steps=2, augment=True),
                features=FeatureDistill(1.0, "penultimate"))


def test_server_stage_weight_zero_equals_the_logit_only_loop():
    """``distil_groups`` at feature weight 0 gives the student ``distill`` gives without a feature argument."""
    from hfl_components.flare.distill_stage import distil_groups
    from hfl_components.fusion.distill import teacher_weights

    teachers, imgs, _ = _tiny_case()
    uploads = {t.name: {"spec": dict(CNN), "state_dict": {k: v.clone() for k, v in t.model.state_dict().items()},
                        "n_samples": n, "input_size": 16} for t, n in zip(teachers, (10, 30))}
    student_sd = {k: v.clone() for k, v in _model(CNN, 0).state_dict().items()}
    common = dict(steps=4, temperature=2.0, weighting="samples", augment=False, data_free=False, data_free_rounds=0,
                  in_channels=1, seed=0, max_seconds=None, teacher="average", feature_layer="penultimate")

    def students():
        return {"cnn": {"spec": dict(CNN), "state_dict": dict(student_sd), "start": "site a", "sites": ["a", "b"]}}
    st0 = students()
    rec0 = distil_groups(st0, uploads, imgs, "cpu", feature_weight=0.0, **common)["cnn"]
    m = _model(CNN, 0)
    m.load_state_dict(student_sd)
    distill(m, [16], teachers, imgs, teacher_weights([10, 30]), DistillConfig(steps=4, temperature=2.0, seed=0))
    assert all(torch.equal(st0["cnn"]["state_dict"][k], m.state_dict()[k]) for k in student_sd)
    assert "feature" not in rec0
    st1 = students()
    rec1 = distil_groups(st1, uploads, imgs, "cpu", feature_weight=50.0, **common)["cnn"]
    assert rec1["feature"]["weight"] == 50.0
    with pytest.raises(ValueError, match="distill_feature_weight"):
        distil_groups(students(), uploads, imgs, "cpu", feature_weight=-1.0, **common)


# ------------------------------------------------------------------------------------------- the option
def test_the_three_statements_of_the_layer_choices_agree_and_the_default_is_off():
    from hfl_components.flare import catalogue, distill_stage

    opts = {o.key: o for o in catalogue.entry("ohfl").options}
    assert opts["distill_feature_layer"].choices == FEATURE_LAYERS == distill_stage.FEATURE_LAYERS
    assert catalogue.option_defaults("ohfl")["distill_feature_weight"] == 0.0
    assert catalogue.option_defaults("ohfl")["distill_feature_layer"] == "penultimate"


@pytest.mark.parametrize("given, key", [({"distill_feature_weight": -0.5}, "distill_feature_weight"),
                                        ({"distill_feature_weight": "nan"}, "distill_feature_weight"),
                                        ({"distill_feature_layer": "conv3"}, "distill_feature_layer")])
def test_a_bad_value_is_refused_with_one_line_naming_the_option(given, key):
    from hfl_components.flare import catalogue
    from nvflare_jobs.compare import check_variant

    with pytest.raises(ValueError) as e:
        catalogue.validate_options("ohfl", given, require=False)
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)
    (k, v), = given.items()
    msg = check_variant(f"ohfl:{k}={v}")
    assert msg is not None and f"'{key}'" in msg and "\n" not in msg


@pytest.mark.parametrize("data_free, augment, match", [(True, False, "'data_free'"),
                                                        (False, True, "'distill_augment'")])
def test_a_positive_weight_is_refused_where_it_cannot_run(data_free, augment, match):
    from hfl_components.flare.distill_stage import check_feature

    with pytest.raises(ValueError, match=f"'distill_feature_weight'.*{match}"):
        check_feature(1.0, "penultimate", data_free, augment)
    check_feature(0.0, "penultimate", data_free, augment)  # weight 0 (the default) needs nothing


def test_the_option_round_trips_through_a_method_option_string():
    from nvflare_jobs.compare import check_variant, split_variant
    from nvflare_jobs.spec import resolve

    name, extra = split_variant("ohfl:distill_feature_weight=3000")
    assert (name, extra) == ("ohfl", {"distill_feature_weight": "3000"})
    assert check_variant("ohfl:distill_feature_weight=3000") is None
    o = resolve(name, extra).options
    assert o["distill_feature_weight"] == 3000.0 and o["distill_feature_layer"] == "penultimate"
    assert resolve("ohfl", {}).options["distill_feature_weight"] == 0.0
    name, extra = split_variant("ohfl:distill_feature_weight=0.5:distill_feature_layer=aligned")
    o = resolve(name, extra).options
    assert o["distill_feature_weight"] == 0.5 and o["distill_feature_layer"] == "aligned"
    assert check_variant("ohfl:distill_feature_weight=1:data_free") is not None  # refused together, one line


# ------------------------------------------------------------------------------------------- the study's driver
def test_study_driver_reuses_fedavg_only_when_the_default_arm_reproduces(tmp_path, monkeypatch):
    from studies.feature_distill import run

    ref = {"per_site_auc": {"site-1_deployed": 0.9, "site-2_deployed": 0.8}, "auc": 0.85}
    assert run.reproduces({"per_site_auc": {"site-1_deployed": 0.9 + 5e-7, "site-2_deployed": 0.8}}, ref)
    assert not run.reproduces({"per_site_auc": {"site-1_deployed": 0.901, "site-2_deployed": 0.8}}, ref)
    assert not run.reproduces({"per_site_auc": {"site-1_deployed": 0.9}}, ref)
    assert not run.reproduces({"missing": True}, ref)
    rows = {"ohfl": {"auc": 0.85, "per_site_auc": dict(ref["per_site_auc"])}, "ohfl_feature": {"auc": 0.88},
            "fedavg": {"missing": True}}
    monkeypatch.setattr(run, "summarise_arm", lambda path: dict(rows[next(a for a, m in run.ARMS.items()
                                                                             if path.name == m)]))
    monkeypatch.setattr(run, "levers_arm", lambda seed, arm: {"ohfl": ref, "fedavg": {"auc": 0.86}}[arm])
    res = run.summarise_seed(tmp_path, 0)
    assert res["default_reproduces_levers"] and res["arms"]["fedavg"]["source"].startswith("studies/levers")
    assert res["arms"]["ohfl_feature"]["minus_fedavg"] == pytest.approx(0.02)
    assert res["arms"]["ohfl_feature"]["minus_ohfl"] == pytest.approx(0.03)
    rows["ohfl"]["per_site_auc"]["site-2_deployed"] = 0.7  # the default arm no longer reproduces: no FedAvg reused
    res = run.summarise_seed(tmp_path, 0)
    assert not res["default_reproduces_levers"] and "minus_fedavg" not in res["arms"]["ohfl_feature"]
    assert res["arms"]["fedavg"]["source"].startswith("missing")
