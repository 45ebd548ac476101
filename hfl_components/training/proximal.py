"""FedProx's proximal term (Li et al., 2020, "Federated Optimization in Heterogeneous Networks", arXiv:1812.06127,
Sec. 3, Eq. 2): a site minimises ``h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2``, its local loss plus a penalty on
the distance from the global model ``w^t`` it received, so that local training on skewed data drifts less. The
server is FedAvg's; ``mu = 0`` is FedAvg exactly.

Plain torch, no federation: :class:`ProximalTerm` plugs into :func:`hfl_components.training.train_local` as its
``aux_loss`` and sees the model it penalises.
"""
from __future__ import annotations

from typing import Mapping

import torch


def proximal_penalty(params: list[torch.Tensor], anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """``mu/2 * sum_i ||params_i - anchor_i||^2`` (a scalar tensor on the first parameter's device; differentiable
    in ``params``, not in ``anchor``).

    Args:
        params: the trained tensors (any shapes).
        anchor: the global model's tensors, the same shapes in the same order.
        mu: the proximal weight (>= 0).

    Raises:
        ValueError: different lengths or shapes, or ``mu`` negative / not finite.
    """
    if not 0 <= float(mu) < float("inf"):
        raise ValueError(f"FedProx: mu must be a finite number >= 0, got {mu}")
    if len(params) != len(anchor):
        raise ValueError(f"FedProx: {len(params)} parameters but {len(anchor)} anchor tensors")
    total = None
    for p, a in zip(params, anchor):
        if p.shape != a.shape:
            raise ValueError(f"FedProx: parameter of shape {tuple(p.shape)} against anchor {tuple(a.shape)}")
        sq = (p.float() - a.detach().to(p.device, torch.float32)).pow(2).sum()
        total = sq if total is None else total + sq
    if total is None:
        return torch.zeros(())
    return 0.5 * float(mu) * total


class ProximalTerm:
    """FedProx's ``mu/2 ||w - w^t||^2`` as a :func:`~hfl_components.training.train_local` auxiliary loss.

    It holds the model being trained and a frozen copy of its parameters at construction (``w^t``: build it right
    after loading the global model), and ignores the batch (``z``, ``logits``, ``y``).

    Args:
        model: the module that will be trained (its trainable parameters are penalised).
        mu: the proximal weight (>= 0; 0 gives FedAvg's local objective).
        anchor: ``{parameter name: tensor}`` of ``w^t`` (default: the model's parameters now).

    Raises:
        ValueError: ``mu`` negative or not finite; an anchor missing a parameter or of another shape.
    """

    def __init__(self, model: torch.nn.Module, mu: float, anchor: Mapping[str, torch.Tensor] | None = None):
        if not 0 <= float(mu) < float("inf"):
            raise ValueError(f"FedProx: mu must be a finite number >= 0, got {mu}")
        self.mu = float(mu)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if anchor is not None:
            missing = [n for n, _ in named if n not in anchor]
            if missing:
                raise ValueError(f"FedProx: the anchor lacks parameter(s) {missing[:3]}")
        self.params = [p for _, p in named]
        self.anchor = [(anchor[n] if anchor is not None else p).detach().clone() for n, p in named]
        self.last: dict = {}

    def __call__(self, z: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = proximal_penalty(self.params, self.anchor, self.mu)
        self.last = {"proximal": float(loss.detach())}
        return loss
