"""Shared builders for the fusion tests: He-initialised fusable models and a no-grad forward pass."""
from __future__ import annotations

import torch

from hfl_components.models.fusable import build_fusable


def he_model(spec: dict, seed: int, bias_range: float | None = None) -> torch.nn.Module:
    """A fusable model of ``spec`` with He-normal weights (seeded), so that its outputs depend on the input through the
    whole depth; biases uniform in [-bias_range, bias_range] when given (non-zero biases), else the default init."""
    torch.manual_seed(seed)
    m = build_fusable(spec)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                torch.nn.init.kaiming_normal_(p, nonlinearity="relu")
            elif bias_range is not None:
                p.uniform_(-bias_range, bias_range)
    return m


def forward(spec: dict, state_dict: dict, x: torch.Tensor) -> torch.Tensor:
    """Logits (B, num_classes) of a fresh ``spec`` model loaded with ``state_dict``, eval mode, no grad."""
    m = build_fusable(spec)
    m.load_state_dict(state_dict)
    m.eval()
    with torch.no_grad():
        return m(x)
