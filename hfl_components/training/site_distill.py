"""Distil a frozen teacher (e.g. a FENS ensemble) into one student model on a site's own images.

FENS (Allouah et al. 2024, "Revisiting Ensembling in One-Shot Federated Learning", arXiv:2411.07182) deploys the
ensemble of every site's model plus a learned aggregator. Distilling that ensemble at the site (Hinton et al. 2015,
"Distilling the Knowledge in a Neural Network", arXiv:1503.02531) leaves the site one model of its own
architecture to deploy. The teacher's logits are computed once (:func:`teacher_logits`); the student is trained on
soft targets at temperature T plus, with weight ``1 - alpha``, the labels' cross-entropy (:func:`distil_student`).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hfl_components.fusion.distill import distillation_loss


@torch.no_grad()
def teacher_logits(teacher: nn.Module, images: torch.Tensor, batch_size: int = 64,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The frozen teacher's logits, in eval mode, batch by batch.

    Args:
        teacher: maps (B, C_in, S, S) images to (B, K) logits.
        images: (N, C_in, S, S) float images at the teacher's input size.
        batch_size: images per forward pass (>= 1).
        device: where the forward passes run.

    Returns:
        (N, K) float32 logits on the CPU.

    Raises:
        ValueError: ``images`` is not 4-D or ``batch_size`` < 1.
    """
    if images.dim() != 4 or batch_size < 1:
        raise ValueError(f"images must be (N, C, S, S) and batch_size >= 1, got {tuple(images.shape)}, {batch_size}")
    was = teacher.training
    teacher.eval()
    out = [teacher(images[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(images), batch_size)]
    teacher.train(was)
    return torch.cat(out) if out else torch.zeros(0, 0)


def soft_target_loss(student_logits: torch.Tensor, teacher_logits_: torch.Tensor, labels: torch.Tensor,
                     temperature: float, alpha: float) -> torch.Tensor:
    """``alpha * T^2 * KL(softmax(t / T) || softmax(s / T)) + (1 - alpha) * CE(s, y)``, batch mean (Hinton et al.
    2015, Sec. 2: the ``T^2`` keeps the soft term's gradient scale independent of T).

    Args:
        student_logits: (B, K); teacher_logits_: (B, K); labels: (B,) class indices.
        temperature: T > 0. alpha: weight of the soft term in [0, 1].

    Returns:
        scalar tensor (nats).

    Raises:
        ValueError: shapes differ, T <= 0 or alpha outside [0, 1].
    """
    if student_logits.shape != teacher_logits_.shape or labels.shape != student_logits.shape[:1]:
        raise ValueError(f"student {tuple(student_logits.shape)}, teacher {tuple(teacher_logits_.shape)} and labels "
                         f"{tuple(labels.shape)} do not match")
    if not temperature > 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"temperature must be > 0 and alpha in [0, 1], got {temperature}, {alpha}")
    soft = distillation_loss(student_logits, F.softmax(teacher_logits_ / temperature, dim=1), temperature)
    return alpha * soft + (1.0 - alpha) * F.cross_entropy(student_logits, labels)


def distil_student(student: nn.Module, images: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor,
                   epochs: int, lr: float, momentum: float = 0.9, batch_size: int = 16, temperature: float = 2.0,
                   alpha: float = 0.5, seed: int = 0, device: torch.device | str = "cpu") -> list[dict]:
    """Train ``student`` in place on fixed teacher logits with :func:`soft_target_loss` (SGD, shuffled mini-batches).

    Args:
        student: maps (B, C_in, S, S) to (B, K) logits; trained in train mode, left in eval mode.
        images: (N, C_in, S, S) at the student's input size; targets: (N, K) teacher logits of the same images (in
            the same order; the teacher may have seen them at another size); labels: (N,) class indices.
        epochs: passes over the N images (0: nothing is trained). lr, momentum: SGD's. batch_size: >= 1.
        temperature, alpha: as :func:`soft_target_loss`. seed: the shuffling's seed.

    Returns:
        one ``{"epoch", "loss"}`` per epoch (mean batch loss).

    Raises:
        ValueError: N differs between images, targets and labels; epochs < 0; batch_size < 1; as
            :func:`soft_target_loss`.
    """
    n = len(images)
    if len(targets) != n or len(labels) != n or epochs < 0 or batch_size < 1:
        raise ValueError(f"images ({n}), targets ({len(targets)}) and labels ({len(labels)}) must match; epochs >= 0 "
                         f"and batch_size >= 1, got {epochs}, {batch_size}")
    g = torch.Generator().manual_seed(int(seed))
    opt = torch.optim.SGD(student.parameters(), lr=float(lr), momentum=float(momentum))
    hist = []
    student.train()
    for ep in range(int(epochs)):
        losses = []
        for idx in _batches(torch.randperm(n, generator=g), batch_size):
            if len(idx) < 2 <= n:  # a last batch of one image: BatchNorm cannot train on it
                continue
            loss = soft_target_loss(student(images[idx].to(device)), targets[idx].to(device),
                                    labels[idx].to(device), temperature, alpha)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        hist.append({"epoch": ep + 1, "loss": sum(losses) / max(1, len(losses))})
    student.eval()
    return hist


def _batches(order: torch.Tensor, size: int) -> Iterable[torch.Tensor]:
    for i in range(0, len(order), size):
        yield order[i:i + size]
