"""Gram-matrix primitives shared by :mod:`.cka` and :mod:`.probe_stats` (OHFL Sec. 3.1, Eq. 1).

Kept in their own module so that ``cka`` (the CKA estimators) and ``probe_stats`` (the one-pass hooked statistics)
both import them without importing each other. Gram matrices are float64 n x n; activations stay float32.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

_REL_EPS = 1e-10  # ||HKH||_F <= _REL_EPS ||K||_F: the layer is constant across the probe
_CHUNK = 1 << 16  # columns per float64 Gram chunk (bounds the float64 copy of wide conv activations)
CKA_KINDS = ("linear", "debiased", "pooled")


def centre_gram(K: np.ndarray) -> np.ndarray:
    """H K H of a raw Gram matrix (float64 n x n), zeroed when the layer is constant across the probe
    (||HKH||_F <= 1e-10 ||K||_F); the centring step of :func:`centred_gram`."""
    # explicit double centring: H K H = K - row means - column means + grand mean
    Kc = K - K.mean(axis=0, keepdims=True) - K.mean(axis=1, keepdims=True) + K.mean()
    # a layer constant across the probe leaves only rounding noise after centring: zero it (scale-free guard)
    if not np.linalg.norm(Kc) > _REL_EPS * np.linalg.norm(K):
        Kc = np.zeros_like(Kc)
    return Kc


def check_probe(model: nn.Module, probe) -> torch.Tensor:
    """The probe batch as float32 (n, C, S, S), checked against ``model``.

    Raises:
        ValueError: not a 4-d float tensor, fewer than 2 images, or a channel count other than the model's first
            convolution's.
    """
    if not isinstance(probe, torch.Tensor) or probe.dim() != 4:
        raise ValueError("probe must be a float tensor of shape (n, in_channels, S, S)")
    if not torch.is_floating_point(probe):
        raise ValueError(f"probe must be a float tensor, got {probe.dtype}")
    if probe.shape[0] < 2:
        raise ValueError(f"probe needs at least 2 images, got {probe.shape[0]}")
    c_in = model.convs[0].in_channels if hasattr(model, "convs") else None
    if c_in is not None and probe.shape[1] != c_in:
        raise ValueError(f"probe has {probe.shape[1]} channels, the model expects {c_in}")
    return probe.to(torch.float32)


def raw_gram(t: torch.Tensor) -> np.ndarray:
    """The raw linear Gram matrix K = t tᵀ (float64 n x n, not centred) of activations ``t`` (n x p, any float
    dtype), summed over float64 blocks of :data:`_CHUNK` columns."""
    n, p = t.shape
    K = torch.zeros((n, n), dtype=torch.float64)
    for start in range(0, p, _CHUNK):
        c = t[:, start:start + _CHUNK].to(torch.float64)
        K += c @ c.T
    return K.numpy()
