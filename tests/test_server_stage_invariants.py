"""The server stage's distillation computes what its definition says, however it is scheduled.

``distill`` labels the probe with the teachers once and trains the student in channels-last layout; the definition
(FedDF, Lin et al. 2020, arXiv:2006.07242, Algorithm 1 server part) queries the teachers on every step's batch.
The two must give the same student (within float32 rounding: the layouts sum in different orders), query each
teacher once per image whatever the step count, and leave every model in the layout it came in.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hfl_components.fusion.distill import DistillConfig, Teacher, distill, distillation_loss, ensemble_probs


class _Counting(nn.Module):
    """A teacher that counts the images it is asked about."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net, self.images = net, 0

    def forward(self, x):
        self.images += int(x.shape[0])
        return self.net(x)


def _net(seed: int, size: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 2))


def _per_step_reference(student, teachers, images, weights, cfg, size):
    """The definition: every step queries the teachers on that step's batch (no cache, contiguous layout); the
    batch order is distill's (a fresh permutation per pass from ``seed + 1``), nothing held aside."""
    n = images[size].shape[0]
    g = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.SGD(student.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps)
    step = 0
    while step < cfg.steps:
        order = torch.randperm(n, generator=g)
        for i in range(0, n - cfg.batch_size + 1, cfg.batch_size):
            if step == cfg.steps:
                break
            idx = order[i:i + cfg.batch_size]
            with torch.no_grad():
                q = ensemble_probs([t.model(images[t.input_size][idx]) for t in teachers], weights, cfg.temperature)
            student.train()
            loss = distillation_loss(student(images[size][idx]), q, cfg.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
    return student


def test_teachers_labelled_once_give_the_student_of_per_step_teachers():
    torch.manual_seed(0)
    images = {8: torch.rand(40, 1, 8, 8)}
    images[12] = nn.functional.interpolate(images[8], size=(12, 12), mode="bilinear", align_corners=False)
    teachers = [Teacher(f"t{k}", _Counting(_net(10 + k, s)).eval(), s) for k, s in enumerate((8, 12, 8))]
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    cfg = DistillConfig(steps=14, temperature=2.0, lr=0.2, momentum=0.9, batch_size=8, val_fraction=0.0,
                        eval_every=5, patience=0, seed=3)
    start = _net(1, 8)
    cached = copy.deepcopy(start)
    res = distill(cached, [8], teachers, images, weights, cfg)
    assert res.steps_run == 14 and res.stopped == "budget"
    # each teacher saw every probe image exactly once, although the student took 14 steps of 8 images
    assert [t.model.images for t in teachers] == [40, 40, 40]
    ref = _per_step_reference(copy.deepcopy(start), teachers, images, weights, cfg, 8)
    moved = 0.0
    for (k, a), b, s in zip(cached.state_dict().items(), ref.state_dict().values(), start.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{k} differs from the per-step definition")
        moved = max(moved, float((a - s).abs().max()))
    assert moved > 1e-3  # the student did train: the agreement is not two untouched copies
    # every model is left in the layout it came in
    assert all(p.is_contiguous() for p in cached.parameters())
    assert all(p.is_contiguous() for t in teachers for p in t.model.parameters())


def test_the_step_budget_has_one_owner_the_catalogue():
    """The distillation library states no step budget of its own: the main job's is the catalogue option
    ``distill_steps``, which the server passes."""
    with pytest.raises(TypeError):
        DistillConfig()
    with pytest.raises(ValueError, match="distill_steps"):
        distill(_net(0, 8), [8], [Teacher("t", _net(1, 8), 8)], {8: torch.rand(4, 1, 8, 8)})


def test_the_data_free_round_budget_has_one_owner_the_catalogue():
    """The data-free distillation states no round budget of its own: the main job's is the catalogue option
    ``data_free_rounds``, which the server passes (a config without it cannot be made; no config is refused by
    name)."""
    from hfl_components.fusion.datafree import DataFreeConfig, distill_data_free

    with pytest.raises(TypeError):
        DataFreeConfig()
    with pytest.raises(ValueError, match="data_free_rounds"):
        distill_data_free(_net(0, 8), [8], [Teacher("t", _net(1, 8), 8)])
    assert DataFreeConfig(rounds=3).rounds == 3
