"""Grad-CAM saliency (Selvaraju et al. 2017, arXiv:1610.02391) through MONAI's ``monai.visualize.GradCAM``, and
the share of saliency in the image's outer border band.

The border share is a crude number: a model that reads the lungs has most of its Grad-CAM mass inside the
thorax, one that reads black bands, labels or collimation edges has more of it near the border. Grad-CAM maps
are coarse (the last convolution's resolution, upsampled), so a share is only a hint. Under a uniform map the
share equals the band's area share, :func:`uniform_border_share`.
"""
from __future__ import annotations

import numpy as np
import torch

BORDER_BAND = 0.1  # the band's width as a fraction of the side, on every edge


def last_conv_layer(model: torch.nn.Module) -> str:
    """Dotted name of the model's last ``nn.Conv2d`` (Grad-CAM's target layer).

    Raises:
        ValueError: the model has no 2-D convolution.
    """
    name = None
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            name = n
    if name is None:
        raise ValueError("the model has no Conv2d layer for Grad-CAM")
    return name


def gradcam_maps(model: torch.nn.Module, X: torch.Tensor, class_idx: int = 1, layer: str | None = None) -> np.ndarray:
    """Grad-CAM maps (N, S, S) in [0, 1] for ``class_idx`` (default 1, PNEUMONIA) of images ``X`` (N, C, S, S),
    at the last convolution (or ``layer``); runs on the model's device. Each map is min-max scaled to [0, 1] with
    1 = most salient (:func:`minmax`; MONAI's default post-processing maps the maximum to 0)."""
    from monai.visualize import GradCAM

    dev = next(model.parameters()).device
    cam = GradCAM(nn_module=model, target_layers=layer or last_conv_layer(model), postprocessing=minmax)
    was = model.training
    model.eval()
    try:
        with torch.enable_grad():
            m = cam(x=X.to(dev).float().clone().requires_grad_(True), class_idx=class_idx)
    finally:
        model.train(was)
    m = m.detach().float().cpu().numpy()[:, 0]
    return np.nan_to_num(m, nan=0.0)


def minmax(x: torch.Tensor) -> torch.Tensor:
    """Each map of ``x`` (N, 1, H, W) scaled to [0, 1] (min -> 0, max -> 1); an all-equal map -> 0."""
    flat = x.reshape(x.shape[0], -1)
    lo, hi = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    return ((flat - lo) / span * (hi > lo)).reshape(x.shape)


def border_share(maps: np.ndarray, band: float = BORDER_BAND) -> np.ndarray:
    """Share (N,) of each map's total saliency (maps (N, H, W), non-negative) inside the outer band of width
    ``band`` x side on every edge; NaN for an all-zero map."""
    maps = np.clip(np.asarray(maps, np.float64), 0, None)
    n, h, w = maps.shape
    bh, bw = max(1, int(round(band * h))), max(1, int(round(band * w)))
    inner = maps[:, bh:h - bh, bw:w - bw].sum(axis=(1, 2))
    total = maps.sum(axis=(1, 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, 1.0 - inner / total, np.nan)


def uniform_border_share(band: float = BORDER_BAND) -> float:
    """The band's share of the image area: what :func:`border_share` gives for a uniform map."""
    return 1.0 - (1.0 - 2 * band) ** 2
