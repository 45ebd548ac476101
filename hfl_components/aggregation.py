"""Server-side parameter averaging for the homogeneous FedAvg baseline (McMahan et al., 2017, Algorithm 1)."""
from __future__ import annotations

import numpy as np


def weighted_average(states: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """Sample-weighted mean of same-architecture parameter dicts: sum_k (n_k / sum n) * w_k.

    Args:
        states: K dicts {key: ndarray}, identical keys and shapes.
        weights: K non-negative weights (the sites' training sample counts), not all zero.

    Returns:
        {key: float32 ndarray} of the same shapes.

    Raises:
        ValueError: empty input, mismatched keys/shapes, or invalid weights.
    """
    if not states:
        raise ValueError("weighted_average: no parameter sets to average")
    if len(states) != len(weights):
        raise ValueError(f"weighted_average: {len(states)} parameter sets but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weighted_average: weights must be finite, >= 0 and not all zero, got {weights}")
    w = w / w.sum()
    keys = list(states[0])
    out = {}
    for k in keys:
        arrs = []
        for i, s in enumerate(states):
            if k not in s:
                raise ValueError(f"weighted_average: parameter set {i} lacks key {k!r}")
            a = np.asarray(s[k], dtype=np.float64)
            if a.shape != np.shape(states[0][k]):
                raise ValueError(f"weighted_average: key {k!r} has shape {a.shape} in set {i}, "
                                 f"expected {np.shape(states[0][k])}")
            arrs.append(a)
        out[k] = sum(wi * a for wi, a in zip(w, arrs)).astype(np.float32)
    for i, s in enumerate(states):
        extra = set(s) - set(keys)
        if extra:
            raise ValueError(f"weighted_average: parameter set {i} has unexpected keys {sorted(extra)[:3]}")
    return out
