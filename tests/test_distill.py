"""Ensemble distillation on the server (hfl_components.fusion.distill / datafree, flare.distill_stage)."""
from __future__ import annotations

import csv
import math

import pytest
import torch
from torch import nn

from hfl_components.fusion.distill import (DistillConfig, Teacher, distill, distillation_loss, ensemble_probs,
                                           split_probe, teacher_weights)


# ------------------------------------------------------------------------------------------- teacher weighting
def test_teacher_weights_by_samples_score_and_equal_hand_cases():
    assert teacher_weights([100, 300]).tolist() == [0.25, 0.75]
    # AUC margins over chance 0.4, 0.2, 0 (at chance) and 0 (below): 2/3, 1/3, 0, 0
    w = teacher_weights(scores=[0.9, 0.7, 0.5, 0.3], mode="score")
    assert w.tolist() == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])
    assert teacher_weights(scores=[None, 0.75], mode="score").tolist() == [0.0, 1.0]  # missing = chance
    assert teacher_weights([5, 7, 9], mode="equal").tolist() == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError, match="above chance"):
        teacher_weights(scores=[0.5, 0.4], mode="score")
    with pytest.raises(ValueError, match="positive"):
        teacher_weights([10, 0])
    with pytest.raises(ValueError, match="weighting"):
        teacher_weights([1], mode="auc")


def test_ensemble_probs_weights_and_temperature_hand_case():
    a = torch.tensor([[0.0, 0.0]])                 # softmax: [1/2, 1/2]
    b = torch.tensor([[0.0, math.log(3.0)]])       # softmax: [1/4, 3/4]
    q = ensemble_probs([a, b], teacher_weights([100, 300]))
    assert q.tolist()[0] == pytest.approx([0.25 * 0.5 + 0.75 * 0.25, 0.25 * 0.5 + 0.75 * 0.75])
    # T = 2 halves the logits: b -> softmax([0, ln 3 / 2]) = [1, sqrt 3] / (1 + sqrt 3)
    r3 = math.sqrt(3.0)
    assert ensemble_probs([b], None, 2.0).tolist()[0] == pytest.approx([1 / (1 + r3), r3 / (1 + r3)])
    with pytest.raises(ValueError, match="weights"):
        ensemble_probs([a, b], [1.0])


def test_distillation_loss_is_t2_kl_and_zero_at_the_targets():
    q = torch.tensor([[0.25, 0.75]])
    z = torch.tensor([[0.0, 0.0]])
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert float(distillation_loss(z, q, 1.0)) == pytest.approx(kl)
    assert float(distillation_loss(z, q, 3.0)) == pytest.approx(9 * kl)  # student softmax(0/3) is still uniform
    assert float(distillation_loss(torch.log(q) * 2.0, q, 2.0)) == pytest.approx(0.0, abs=1e-6)


def test_split_probe_is_disjoint_and_covers():
    tr, va = split_probe(50, 0.2, seed=3)
    assert len(va) == 10 and len(tr) == 40 and set(tr.tolist()).isdisjoint(va.tolist())
    assert sorted(tr.tolist() + va.tolist()) == list(range(50))
    with pytest.raises(ValueError):
        split_probe(1, 0.5)


# ------------------------------------------------------------------------------------------- recovery
class _Linear(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 2)

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_distillation_recovers_the_teacher_function_same_architecture():
    """A softmax-linear teacher and a student of the same architecture: the distillation loss is convex in the
    student's weights with its minimum (0) at the teacher's logit difference, so the student must recover the
    teacher's function delta_t(x) = z_1 - z_0 on fresh inputs. Tolerance: a student that learned nothing
    (delta_s = 0) has RMS error >= std(delta_t) (its error is delta_t itself); we ask for under 10 % of that."""
    torch.manual_seed(0)
    d, s = 16, 4
    teacher = _Linear(d)
    with torch.no_grad():
        teacher.fc.weight.mul_(2.0)
    student = _Linear(d)
    with torch.no_grad():
        student.fc.weight.zero_()
        student.fc.bias.zero_()
    imgs = {s: torch.randn(400, 1, s, s)}  # centred inputs: a well-conditioned problem for SGD
    cfg = DistillConfig(steps=400, temperature=1.0, lr=0.2, batch_size=64, augment=False, eval_every=50,
                        patience=0)
    res = distill(student, [s], [Teacher("t", teacher, s)], imgs, config=cfg)
    x = torch.randn(500, 1, s, s)
    with torch.no_grad():
        dt = teacher(x)[:, 1] - teacher(x)[:, 0]
        ds = student(x)[:, 1] - student(x)[:, 0]
    rms = float(((ds - dt) ** 2).mean().sqrt())
    assert rms < 0.1 * float(dt.std())
    assert res.best_val_loss < 0.01 * res.initial_val_loss


def test_distill_keeps_the_initial_student_when_training_only_hurts_and_steps_zero_is_a_no_op():
    torch.manual_seed(1)
    t = _Linear(16)
    imgs = {4: torch.rand(60, 1, 4, 4)}
    st = _Linear(16)
    st.load_state_dict(t.state_dict())  # already the teacher: held-aside loss 0, nothing can improve it
    before = {k: v.clone() for k, v in st.state_dict().items()}
    res = distill(st, [4], [Teacher("t", t, 4)], imgs,
                  config=DistillConfig(steps=30, lr=5.0, augment=False, eval_every=10, patience=0))
    assert res.best_step == 0 and all(torch.equal(before[k], v) for k, v in st.state_dict().items())
    st2 = _Linear(16)
    before2 = {k: v.clone() for k, v in st2.state_dict().items()}
    r2 = distill(st2, [4], [Teacher("t", t, 4)], imgs, config=DistillConfig(steps=0))
    assert r2.steps_run == 0 and all(torch.equal(before2[k], v) for k, v in st2.state_dict().items())
    with pytest.raises(ValueError, match="input sizes"):
        distill(st2, [8], [Teacher("t", t, 4)], imgs, config=DistillConfig(steps=1))


def test_distill_cross_architecture_several_sizes_with_augmentation_runs_and_improves():
    from hfl_components.models import build_model

    torch.manual_seed(2)
    teachers = [Teacher("a", build_model({"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1,
                                          "num_classes": 2}), 16),
                Teacher("b", build_model({"family": "cnn", "depth": "deep", "width": 0.25, "in_channels": 1,
                                          "num_classes": 2}), 24)]
    for t in teachers:  # give the teachers non-trivial outputs
        with torch.no_grad():
            t.model.classifier.weight.mul_(50)
    student = build_model({"family": "resnet", "feature_dim": 8, "in_channels": 1, "num_classes": 2})
    imgs = {16: torch.rand(40, 1, 16, 16)}
    imgs[24] = torch.nn.functional.interpolate(imgs[16], size=(24, 24), mode="bilinear")
    res = distill(student, [16, 24], teachers, imgs, teacher_weights([10, 30]),
                  DistillConfig(steps=6, batch_size=8, eval_every=3, patience=0, augment=True))
    assert res.steps_run == 6 and res.sizes == [16, 24] and res.best_val_loss <= res.initial_val_loss


# ------------------------------------------------------------------------------------------- data-free (smoke)
def test_data_free_smoke():
    from hfl_components.fusion.datafree import DataFreeConfig, distill_data_free

    torch.manual_seed(0)
    t = Teacher("t", _Linear(64), 8)
    st = _Linear(64)
    before = st.fc.weight.detach().clone()
    rec = distill_data_free(st, [8], [t], config=DataFreeConfig(rounds=2, g_steps=1, s_steps=2, batch_size=4,
                                                                base_size=8, max_seconds=30))
    assert rec["rounds_run"] == 2 and rec["stopped"] == "budget" and not torch.equal(before, st.fc.weight)
    assert all(p.requires_grad for p in t.model.parameters())  # the teachers are left as they were


# ------------------------------------------------------------------------------------------- server stage
def _profile(families):
    return {f"site-{i + 1}": {"model": ({"family": f, "depth": "shallow", "width": 0.25, "in_channels": 1,
                                         "num_classes": 2} if f in ("cnn", "vgg11") else
                                        {"family": f, "feature_dim": 8, "in_channels": 1, "num_classes": 2}),
                              "input_size": 16} for i, f in enumerate(families)}


def test_a_site_whose_family_the_server_cannot_build_is_refused_before_training_naming_site_and_family():
    from nvflare_jobs.jobs import make_controller

    prof = _profile(["cnn", "densenet", "resnet"])
    prof["site-3"]["model"] = {"family": "vit_huge", "in_channels": 1, "num_classes": 2}
    with pytest.raises(ValueError, match=r"site site-3: the server cannot build model family 'vit_huge'"):
        make_controller("ohfl", prof, {"probe": "generated"})
    ctl = make_controller("ohfl", _profile(["cnn", "densenet"]), {"probe": "generated"})  # buildable: accepted
    assert set(ctl.site_specs) == {"site-1", "site-2"}


def test_no_probe_pool_and_no_data_free_is_refused_with_one_line_naming_the_option():
    from nvflare_jobs.jobs import make_controller

    with pytest.raises(ValueError, match=r"option 'data_free'") as e:
        make_controller("ohfl", _profile(["cnn", "cnn"]), {"probe": "none"})
    assert "\n" not in str(e.value)
    assert make_controller("ohfl", _profile(["cnn", "cnn"]), {"probe": "none", "data_free": True}).data_free
    assert make_controller("ohfl", _profile(["cnn", "cnn"]), {"probe": "none", "distill_steps": 0})


def test_architecture_groups_and_students():
    from hfl_components.flare import distill_stage as ds
    from hfl_components.models import build_model

    prof = _profile(["cnn", "cnn", "densenet", "densenet", "resnet"])
    prof["site-2"]["model"]["depth"] = "deep"
    specs = {s: c["model"] for s, c in prof.items()}
    specs["site-6"] = {"family": "resnet", "feature_dim": 16, "in_channels": 1, "num_classes": 2}  # another resnet
    groups = ds.architecture_groups(specs)
    assert groups["site-1"] == groups["site-2"] == "cnn" and groups["site-3"] == groups["site-4"] == "densenet"
    assert groups["site-5"] != groups["site-6"] and groups["site-5"].startswith("resnet-")
    uploads = {s: {"spec": specs[s], "state_dict": build_model(specs[s]).state_dict(), "n_samples": n,
                   "input_size": 16} for s, n in (("site-1", 5), ("site-2", 7), ("site-3", 9), ("site-4", 11))}
    assert ds.fusable_groups(groups, uploads) == {"cnn": ["site-1", "site-2"]}
    fused = {"cnn": (specs["site-2"], uploads["site-2"]["state_dict"])}
    st = ds.initial_students(groups, specs, uploads, fused)
    assert st["cnn"]["start"] == "fusion" and st["densenet"]["start"] == "site site-4"  # most samples
    assert st[groups["site-5"]]["start"] == "fresh" and st[groups["site-5"]]["state_dict"] is None


def _probe_csv(tmp_path, labels, name):
    from PIL import Image

    d = tmp_path / "imgs"
    d.mkdir(exist_ok=True)
    rows = []
    for i in range(12):
        f = d / f"p{i}.png"
        if not f.exists():
            g = torch.Generator().manual_seed(i)
            Image.fromarray((torch.rand(20, 24, generator=g) * 255).byte().numpy()).save(f)
        rows.append({"path": str(f), **({"label": labels[i]} if labels is not None else {})})
    p = tmp_path / name
    with p.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return p


def test_the_server_never_reads_probe_labels(tmp_path):
    """The same probe images listed with true-looking labels, with nonsense labels and without a label column:
    the server's probe and its distilled student are identical (the labels are never read)."""
    from hfl_components.models import build_model
    from nvflare_jobs.jobs import make_controller

    csvs = [_probe_csv(tmp_path, [i % 2 for i in range(12)], "a.csv"),
            _probe_csv(tmp_path, ["NOT A LABEL"] * 12, "b.csv"), _probe_csv(tmp_path, None, "c.csv")]
    prof = _profile(["cnn", "cnn"])
    specs = {s: c["model"] for s, c in prof.items()}
    torch.manual_seed(0)
    uploads = {s: {"spec": specs[s], "state_dict": build_model(specs[s]).state_dict(), "n_samples": 10,
                   "input_size": 16, "val_auc": 0.8} for s in specs}
    outs = []
    for c in csvs:
        ctl = make_controller("ohfl", prof, {"probe": str(c), "probe_size": 4, "distill_probe_size": 12,
                                             "distill_steps": 3})
        ctl.info = lambda *a, **k: None
        x, names, _ = ctl._load_probe(16)
        students = {"cnn": {"spec": specs["site-1"], "state_dict": uploads["site-1"]["state_dict"],
                            "start": "site site-1", "sites": ["site-1", "site-2"]}}
        rec = ctl._distill(students, uploads, {16: x}, torch.device("cpu"))
        outs.append((x, names, students["cnn"]["state_dict"], rec["cnn"]["steps_run"]))
    for x, names, sd, steps in outs[1:]:
        assert torch.equal(x, outs[0][0]) and names == outs[0][1] and steps == outs[0][3] == 3
        assert all(torch.equal(sd[k], outs[0][2][k]) for k in sd)


def test_server_data_free_option_smoke():
    """Data-free distillation through the server stage (no probe pool): runs within its round cap."""
    from hfl_components.models import build_model
    from nvflare_jobs.jobs import make_controller

    prof = _profile(["cnn", "cnn"])
    specs = {s: c["model"] for s, c in prof.items()}
    torch.manual_seed(0)
    uploads = {s: {"spec": specs[s], "state_dict": build_model(specs[s]).state_dict(), "n_samples": 10,
                   "input_size": 16} for s in specs}
    ctl = make_controller("ohfl", prof, {"probe": "none", "data_free": True, "data_free_rounds": 1})
    ctl.info = lambda *a, **k: None
    students = {"cnn": {"spec": specs["site-1"], "state_dict": dict(uploads["site-1"]["state_dict"]),
                        "start": "site site-1", "sites": ["site-1", "site-2"]}}
    rec = ctl._distill(students, uploads, {}, torch.device("cpu"))["cnn"]
    assert rec["mode"] == "data_free" and rec["rounds_run"] == 1 and rec["teachers"] == ["site-1", "site-2"]
    refs = ctl._references(uploads, {}, students)
    n = 4 * sum(v.numel() for v in uploads["site-1"]["state_dict"].values())
    assert refs["ensemble"]["bytes_down_per_site"] == 2 * n and refs["distilled"]["bytes_down_per_site"] == {"cnn": n}


def test_tune_distill_refuses_bad_input_with_one_line(tmp_path, capsys):
    from studies.distillation.tune_distill import main, parse_config

    assert parse_config("steps=100,augment=0,lr=0.001") == {"steps": 100, "augment": False, "lr": 0.001}
    with pytest.raises(ValueError, match="bogus"):
        parse_config("bogus=1")
    assert main(["--run", str(tmp_path / "nope"), "--data", str(tmp_path), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope" in err and "\n" not in err
