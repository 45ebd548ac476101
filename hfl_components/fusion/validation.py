"""Validation of an OHFL upload (the server checks every upload before fusing it)."""
from __future__ import annotations

import numbers

import numpy as np
import torch

from hfl_components.models.fusable import build_fusable
from hfl_components.models.registry import is_fusable


def validate_upload(spec, state_dict, n_samples) -> dict[str, torch.Tensor]:
    """Check one site's upload against the architecture its spec describes.

    Args:
        spec: fusable spec dict (family ``cnn``/``vgg11``, see :mod:`hfl_components.models.fusable`).
        state_dict: mapping key -> tensor / NumPy array (float), as produced by ``model.state_dict()``.
        n_samples: the site's positive integer training-sample count.

    Returns:
        dict key -> float32 CPU tensor (a cleaned copy of ``state_dict``).

    Raises:
        ValueError: with a message naming the problem: unknown / invalid spec, missing or unexpected keys, a shape
            that differs from the model rebuilt from the spec, a non-float or non-finite (NaN/Inf) tensor, or a
            non-positive / non-integer sample count.
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or int(n_samples) <= 0:
        raise ValueError(f"sample count must be a positive integer, got {n_samples!r}")
    if not isinstance(spec, dict) or not is_fusable(spec):
        fam = spec.get("family") if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"unknown model spec for OHFL fusion (family {fam!r}; expected cnn or vgg11)")
    try:
        expected = build_fusable(spec).state_dict()
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"invalid model spec: {e}") from e
    if not hasattr(state_dict, "keys"):
        raise ValueError(f"state dict must be a mapping, got {type(state_dict).__name__}")
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ValueError(f"state dict keys do not match the spec: missing {missing}, unexpected {extra}")
    out: dict[str, torch.Tensor] = {}
    for k, ref in expected.items():
        v = state_dict[k]
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(v)
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{k}: expected a tensor, got {type(v).__name__}")
        if tuple(v.shape) != tuple(ref.shape):
            raise ValueError(f"{k}: shape {tuple(v.shape)} does not match {tuple(ref.shape)} of the spec")
        if not torch.is_floating_point(v):
            raise ValueError(f"{k}: expected a float tensor, got {v.dtype}")
        if not torch.isfinite(v).all():
            raise ValueError(f"{k}: contains non-finite values (NaN/Inf)")
        out[k] = v.detach().to("cpu", torch.float32).clone()
    return out
