"""Perturbation probes: label-irrelevant changes of an image and how far they move a model's p(PNEUMONIA).

A radiograph does not become more or less pneumonic when it is mirrored, framed by a black band, or exported
with a different tone curve. A model whose p(PNEUMONIA) moves with such a change reads the change, typically
because the training pipeline tied it to a label (e.g. augmenting only the minority class: a flipped or
black-bordered image was always NORMAL in training). The probes, each applied to images (N, 1, S, S) in [0, 1] as
the evaluation transform gives them:

- ``flip``: horizontal mirror (the training augmentation's flip);
- ``shift``: translation by :data:`SHIFT_FRACTION` of the side along both axes at once (the training
  augmentation's per-axis maximum), zero fill: the content moves up-left, black bands at the right and bottom;
- ``contrast``: a tone-curve change ``x -> x ** GAMMA`` (:data:`GAMMA`). A linear brightness/contrast change is
  undone by the per-image min-max scaling of the evaluation transform; a gamma change is not, and
  ``GAMMA`` = 0.8 is within the spread of display LUTs between scanners and exports;
- ``aspect``: the image cut to its centred square before resizing, against the model's own way of squaring it
  (stretch). It needs a fresh decode, so it is computed by the caller; not applicable when every image is square.

Reported per probe: the mean over images of Δp = p(PNEUMONIA | perturbed) - p(PNEUMONIA | original) with a 95 %
CI (binary labels: Δp(NORMAL) = -Δp). Flagged when ``|mean| > TOLERANCE`` and the CI excludes 0: a label-irrelevant
change that moves the average prediction by more than :data:`TOLERANCE` (5 percentage points), the bound used by
the project's shortcut study for "no shortcut".
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from hfl_components.audit.intervals import mean_ci

PROBES = ("flip", "shift", "contrast", "aspect")
TOLERANCE = 0.05
SHIFT_FRACTION = 0.06
GAMMA = 0.8


def perturb(X: torch.Tensor, name: str) -> torch.Tensor:
    """``X`` (N, C, S, S) perturbed by the probe ``name`` (``flip`` / ``shift`` / ``contrast``); same shape.

    Raises:
        ValueError: unknown name (``aspect`` needs a decode of the files, see the module docstring).
    """
    if name == "flip":
        return torch.flip(X, dims=[-1])
    if name == "shift":
        t = 2 * SHIFT_FRACTION  # in normalised [-1, 1] coordinates
        theta = torch.tensor([[1.0, 0.0, t], [0.0, 1.0, t]], dtype=X.dtype, device=X.device).expand(X.shape[0], 2, 3)
        grid = F.affine_grid(theta, list(X.shape), align_corners=False)
        return F.grid_sample(X, grid, padding_mode="zeros", align_corners=False)
    if name == "contrast":
        return X.clamp(min=0.0) ** GAMMA
    raise ValueError(f"unknown probe {name!r}; tensor probes: flip, shift, contrast")


def probe_change(p_orig, p_pert, n_boot: int = 1000, seed: int = 0, tolerance: float = TOLERANCE) -> dict:
    """Mean change of p(PNEUMONIA) (N,) -> (N,) with a 95 % CI and the flag (see the module docstring).

    Returns ``{"mean_change", "ci_low", "ci_high", "n", "flagged", "tolerance"}``.
    """
    d = np.asarray(p_pert, np.float64) - np.asarray(p_orig, np.float64)
    c = mean_ci(d, n_boot=n_boot, seed=seed)
    flagged = (c["mean"] is not None and abs(c["mean"]) > tolerance
               and not (c["ci_low"] <= 0.0 <= c["ci_high"]))
    return {"mean_change": c["mean"], "ci_low": c["ci_low"], "ci_high": c["ci_high"], "n": c["n"],
            "flagged": bool(flagged), "tolerance": float(tolerance)}


@torch.no_grad()
def p_pneumonia(model: torch.nn.Module, X: torch.Tensor, batch: int = 128) -> np.ndarray:
    """p(PNEUMONIA) (N,) of ``model`` on ``X`` (N, C, S, S): 1 - p(class 0), so that a subtype model (NORMAL,
    BACTERIAL, VIRAL) is read as binary. Runs on the model's device."""
    dev = next(model.parameters()).device
    out = []
    for i in range(0, len(X), batch):
        p = torch.softmax(model(X[i:i + batch].to(dev)), dim=1)
        out.append((1.0 - p[:, 0]).float().cpu())
    return torch.cat(out).numpy().astype(np.float64) if out else np.zeros(0)


def all_square(sizes, tol: float = 0.01) -> bool:
    """True when every (width, height) is square within ``tol`` (relative): the aspect probe is not applicable."""
    return all(h and abs(w / h - 1.0) <= tol for w, h in sizes)


def balanced_subsample(y, n: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of a seeded, class-balanced subsample of at most ``n`` of the labels ``y`` (N,): up to
    ``n // K`` per class of the K classes present; a class with fewer images gives all of them and the others are not
    topped up (the subsample stays balanced as far as the data allow)."""
    y = np.asarray(y)
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    per = max(1, int(n) // max(1, len(classes)))
    idx = [rng.permutation(np.flatnonzero(y == c))[:per] for c in classes]
    return np.sort(np.concatenate(idx)) if idx else np.zeros(0, int)


def ci_halfwidth_bound(n: int, sd: float = 0.1) -> float:
    """Half-width of a normal 95 % CI of a mean change over ``n`` images whose per-image changes have standard
    deviation ``sd``: 1.96 sd / sqrt(n) (documentation of the subsample size, not used in the intervals)."""
    return 1.96 * sd / math.sqrt(max(1, n))
