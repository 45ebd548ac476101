"""FENS distilled at the site (option ``fens_distill_epochs``): the soft-target loss on hand cases, a student moving
toward a fixed teacher's soft targets, and the in-process federation in which each site deploys its own distilled
model and no longer keeps the ensemble (every peer model) in its state; option off = FENS's ensemble deployed."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hfl_components.models import load_model_file
from hfl_components.training.site_distill import distil_student, soft_target_loss, teacher_logits

torch.set_num_threads(1)


def test_soft_target_loss_hand_cases():
    s = torch.tensor([[0.0, 0.0]])
    y = torch.tensor([0])
    # equal logits: KL = 0, only the CE of a 50/50 prediction (log 2) weighted 1 - alpha
    assert float(soft_target_loss(s, s.clone(), y, 2.0, 0.5)) == pytest.approx(0.5 * math.log(2))
    # teacher (T=1) probabilities (e/(1+e), 1/(1+e)) against a uniform student: KL = sum q log(2 q)
    t = torch.tensor([[1.0, 0.0]])
    q = torch.softmax(t, 1)[0]
    kl = float((q * (2 * q).log()).sum())
    assert float(soft_target_loss(s, t, y, 1.0, 1.0)) == pytest.approx(kl, rel=1e-6)
    # T^2 scaling: at T=2 the soft term is 4 * KL of the softened distributions
    q2 = torch.softmax(t / 2, 1)[0]
    assert float(soft_target_loss(s, t, y, 2.0, 1.0)) == pytest.approx(4 * float((q2 * (2 * q2).log()).sum()), rel=1e-6)
    with pytest.raises(ValueError, match="do not match"):
        soft_target_loss(s, torch.zeros(1, 3), y, 1.0, 0.5)
    with pytest.raises(ValueError, match="temperature"):
        soft_target_loss(s, t, y, 0.0, 0.5)


def test_a_student_moves_toward_a_fixed_teachers_soft_targets():
    """Teacher: a fixed linear map; student: another linear map. Pure soft-target distillation (alpha 1) lowers the
    student's KL to the teacher's softened outputs, and the labels (set against the teacher) play no part."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 2, 2, generator=g)
    teacher = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    student = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    with torch.no_grad():
        teacher[1].weight.copy_(torch.tensor([[2.0, -1.0, 0.5, 0.0], [-2.0, 1.0, -0.5, 0.0]]))
        teacher[1].bias.zero_()
        student[1].weight.zero_()
        student[1].bias.zero_()
    t = teacher_logits(teacher, x, batch_size=10)
    assert t.shape == (64, 2) and torch.allclose(t, teacher(x))
    y = 1 - t.argmax(1)  # labels opposite to the teacher: with alpha 1 they must not matter

    def kl():
        with torch.no_grad():
            return float(soft_target_loss(student(x), t, y, 2.0, 1.0))

    before = kl()
    hist = distil_student(student, x, t, y, epochs=30, lr=0.5, momentum=0.0, batch_size=16, temperature=2.0,
                          alpha=1.0, seed=0)
    assert len(hist) == 30 and kl() < 0.1 * before
    agree = float((student(x).argmax(1) == t.argmax(1)).float().mean())
    assert agree > 0.9
    assert distil_student(student, x, t, y, epochs=0, lr=0.1) == []
    with pytest.raises(ValueError, match="must match"):
        distil_student(student, x[:3], t, y, epochs=1, lr=0.1)


def _run_fens(tmp_path, **opts):
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller
    from tests.test_inprocess import _site

    profile = {"site-1": _site(tmp_path, "site-1", 24), "site-2": {**_site(tmp_path, "site-2", 20), "input_size": 24}}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    ctl = make_controller("fens", profile, {"rounds": 1, "local_epochs": 1, "seed": 0, "fens_holdout": 0.3,
                                            "fens_epochs": 1, **opts})
    t = InProcessTransport(runtimes, runtime_answer(runtimes, raise_errors=True))
    t.attach(ctl, tmp_path / "server", info=lambda m: None, warning=lambda m: None)
    ctl.run()
    return runtimes


def test_option_on_each_site_deploys_its_own_distilled_model_and_drops_the_ensemble(tmp_path):
    from hfl_components.flare.catalogue import option_defaults
    from hfl_components.flare.controllers.fens import OUTPUTS_FILE

    assert option_defaults("fens")["fens_distill_epochs"] == 0  # off by default
    runtimes = _run_fens(tmp_path, fens_distill_epochs=1)
    for s, rt in runtimes.items():
        local, hl = load_model_file(rt.state_dir / "local_model.pt")
        for f in ("deployed_model.pt", "model.pt"):  # neither the state nor the deployed file holds a peer model
            dep, h = load_model_file(rt.state_dir / f)
            assert h["spec"]["family"] != "fens" and h["spec"] == hl["spec"]
            assert not any(k.startswith("members.") for k in dep.state_dict())
            assert h["input_size"] == hl["input_size"]
        assert not (rt.state_dir / OUTPUTS_FILE).exists()
        assert any(not torch.equal(v, local.state_dict()[k]) for k, v in dep.state_dict().items()
                   if v.is_floating_point())  # it trained


def test_option_off_deploys_the_fens_ensemble_as_before(tmp_path):
    runtimes = _run_fens(tmp_path)
    for rt in runtimes.values():
        dep, h = load_model_file(rt.state_dir / "deployed_model.pt")
        assert h["spec"]["family"] == "fens" and any(k.startswith("members.") for k in dep.state_dict())


def test_the_option_is_refused_under_dp_before_any_training_naming_the_site():
    from types import SimpleNamespace

    from hfl_components.flare.controllers.fens import fens_local

    rt = SimpleNamespace(site="site-3", dp_spec=object(), hold_out=lambda f: pytest.fail("trained before refusing"))
    with pytest.raises(ValueError, match="site site-3: fens_distill_epochs > 0 is not supported under the site"):
        fens_local(rt, {}, {"task_config": {"fens_distill_epochs": 2, "fens_holdout": 0.1}})
