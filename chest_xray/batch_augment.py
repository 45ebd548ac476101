"""Batch-level training augmentation: the ``train`` transforms' random flip + affine on a whole batch.

:func:`chest_xray.build_transforms` augments one image at a time with MONAI's ``RandFlipd`` (horizontal, p=0.5) and
``RandAffined`` (p=0.8, rotation uniform in +-10 degrees, translation uniform in +-6 % of the side per axis, bilinear,
zero padding). At 64-128 px that costs ~2-4 ms per image, almost all Python/metadata overhead, and with the site's
``num_workers=0`` it runs serially with the training step (``studies/speed/RESULTS.md``). Here the same
random parameters are drawn per image, but applied to the collated batch at once: flips by index reversal
(``Tensor.flip``) and one ``torch.nn.functional.affine_grid`` + ``grid_sample`` for the images that get an affine
(MONAI's ``AffineTransform`` layer was tried: its pixel-space convention does not map an integer translation to an
exact shift with ``align_corners=False``, so the normalised matrix is built here).

Conventions (tested in ``tests/test_batch_augment.py``): pixel coordinates ``x`` right, ``y`` down, centred on the
image centre; an image with angle ``a`` and shift ``(dy, dx)`` is resampled as ``out(p) = in(R(a) p - t)``, so
``a = +90 deg`` equals ``torch.rot90(x, 1, (-2, -1))`` and an integer shift ``(dy, dx)`` equals
``torch.roll(x, (dy, dx), (-2, -1))`` with the wrapped-in rows/columns set to 0.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

#: the per-image MONAI pipeline's parameters (chest_xray.transforms.build_transforms)
FLIP_PROB = 0.5
AFFINE_PROB = 0.8


def _ranges() -> tuple[float, float]:
    from .transforms import MAX_ROTATION_DEG, MAX_TRANSLATE_FRACTION

    return MAX_ROTATION_DEG, MAX_TRANSLATE_FRACTION


def sample_augment_params(n: int, height: int, width: int, *, generator: torch.Generator | None = None,
                          flip_prob: float = FLIP_PROB, affine_prob: float = AFFINE_PROB,
                          max_rotation_deg: float | None = None,
                          max_translate_fraction: float | None = None) -> dict[str, torch.Tensor]:
    """Draw per-image flip/affine parameters as MONAI's ``RandFlipd`` + ``RandAffined`` of the train transforms do.

    Args:
        n: number of images.
        height, width: image size in pixels (the translation range is ``max_translate_fraction`` x the side per
            axis, as ``translate_range=(f*S, f*S)`` of the per-image pipeline for square S x S images).
        generator: torch CPU generator; None = torch's global generator (seeded per round by ``train_local``).
        flip_prob: probability of a horizontal flip (0.5).
        affine_prob: probability of the affine (0.8); otherwise the image gets no rotation/translation.
        max_rotation_deg: rotation uniform in [-r, r] degrees (default ``MAX_ROTATION_DEG`` = 10).
        max_translate_fraction: shift uniform in [-f*side, f*side] pixels per axis (default 0.06).

    Returns:
        dict of CPU tensors: ``flip`` bool (n,), ``affine`` bool (n,), ``angle`` float64 (n,) radians (0 where no
        affine), ``shift`` float64 (n, 2) pixels ``(dy, dx)`` (0 where no affine).
    """
    rot, frac = _ranges()
    rot = rot if max_rotation_deg is None else float(max_rotation_deg)
    frac = frac if max_translate_fraction is None else float(max_translate_fraction)
    u = torch.rand(n, 5, generator=generator, dtype=torch.float64)
    flip = u[:, 0] < flip_prob
    affine = u[:, 1] < affine_prob
    angle = (2 * u[:, 2] - 1) * math.radians(rot)
    side = torch.tensor([float(height), float(width)], dtype=torch.float64)
    shift = (2 * u[:, 3:5] - 1) * frac * side
    angle = torch.where(affine, angle, torch.zeros_like(angle))
    shift = torch.where(affine[:, None], shift, torch.zeros_like(shift))
    return {"flip": flip, "affine": affine, "angle": angle, "shift": shift}


def affine_theta(angle: torch.Tensor, shift: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Normalised ``affine_grid`` matrices (n, 2, 3) for rotations ``angle`` (n,) radians and shifts (n, 2) pixels.

    In centred pixel coordinates p = (x, y) the output samples the input at ``R(angle) p - (dx, dy)``; with
    ``S = diag(W/2, H/2)`` (``align_corners=False``: normalised coordinate ``n = p / S``) the matrix is
    ``[S^-1 R S | -S^-1 t]``. Computed in float64.
    """
    a = torch.as_tensor(angle, dtype=torch.float64)
    t = torch.as_tensor(shift, dtype=torch.float64)
    c, s = torch.cos(a), torch.sin(a)
    h, w = float(height), float(width)
    theta = torch.zeros(a.shape[0], 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = c
    theta[:, 0, 1] = -s * h / w
    theta[:, 1, 0] = s * w / h
    theta[:, 1, 1] = c
    theta[:, 0, 2] = -t[:, 1] * 2 / w
    theta[:, 1, 2] = -t[:, 0] * 2 / h
    return theta


def apply_affine(images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Resample ``images`` (n, C, H, W) with normalised matrices ``theta`` (n, 2, 3): bilinear, zero padding,
    ``align_corners=False``; one ``affine_grid`` + ``grid_sample`` for the batch, on the images' device. float16 /
    bfloat16 images are resampled in float32 and cast back."""
    dtype = images.dtype
    x = images if dtype in (torch.float32, torch.float64) else images.float()
    grid = F.affine_grid(theta.to(device=x.device, dtype=x.dtype), list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.to(dtype)


def batch_augment(images: torch.Tensor, labels: torch.Tensor | Sequence[int] | None = None,
                  augment_classes: Sequence[int] | None = None, *, generator: torch.Generator | None = None,
                  params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The train transforms' flip + affine on a batch, per-image random parameters, only for chosen classes.

    Args:
        images: (B, C, H, W) float tensor (any device; C = 1 or 3; float16 allowed).
        labels: (B,) labels; with ``augment_classes`` only images of those classes are augmented.
        augment_classes: label indices to augment; None = every image (labels not needed).
        generator: CPU generator for :func:`sample_augment_params` (None = torch's global one). Parameters are
            drawn for all B images, so the draws do not depend on which classes are augmented or on the device.
        params: pre-drawn parameters (tests); overrides the draw.

    Returns:
        a new (B, C, H, W) tensor of the same dtype and device; images not augmented, and images with neither a
        flip nor a non-identity affine (angle and shift 0), are copied exactly (``grid_sample`` with an identity
        grid is exact only to float rounding, ~1e-7).

    Raises:
        ValueError: images not 4-D, or labels missing / of another length when ``augment_classes`` is given.
    """
    if images.ndim != 4:
        raise ValueError(f"batch_augment expects (B, C, H, W) images, got shape {tuple(images.shape)}")
    b, _, h, w = images.shape
    p = params if params is not None else sample_augment_params(b, h, w, generator=generator)
    sel = torch.ones(b, dtype=torch.bool)
    if augment_classes is not None:
        if labels is None or len(labels) != b:
            raise ValueError(f"batch_augment: {b} images need {b} labels to pick augment_classes")
        lab = torch.as_tensor(labels).reshape(-1).cpu()
        sel = torch.isin(lab, torch.as_tensor(list(augment_classes), dtype=lab.dtype))
    out = images.clone()
    flip = (p["flip"] & sel).nonzero().flatten()
    if flip.numel():
        idx = flip.to(images.device)
        out[idx] = out[idx].flip(-1)
    moved = (p["angle"] != 0) | (p["shift"] != 0).any(dim=1)  # identity parameters: no resampling, exact copy
    aff = (p["affine"] & sel & moved).nonzero().flatten()
    if aff.numel():
        idx = aff.to(images.device)
        out[idx] = apply_affine(out[idx], affine_theta(p["angle"][aff], p["shift"][aff], h, w))
    return out


class CachedTensorDataset(torch.utils.data.Dataset):
    """Cached images as one tensor, items ``{"image": (C, S, S), "label": int}`` (no per-item transform/copy).

    ``labels`` is a list of ints (``train_local``'s ``loader_labels`` reads it without iterating).

    Raises:
        ValueError: images not (N, C, H, W) or a label count other than N.
    """

    def __init__(self, images: torch.Tensor, labels: Sequence[int]):
        images = torch.as_tensor(images)
        if images.ndim != 4 or images.shape[0] != len(labels):
            raise ValueError(f"images must be (N, C, H, W) with N = {len(labels)} labels, got {tuple(images.shape)}")
        self.images = images
        self.labels = [int(v) for v in labels]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "label": self.labels[i]}


class BatchAugmentCollate:
    """DataLoader ``collate_fn``: collate, move the images to ``device``, then :func:`batch_augment` them.

    Args:
        augment_classes: classes to augment (None = all).
        device: where the batch is augmented (the site's training device; the loop's ``.to(device)`` is then a
            no-op); None = where the images are (CPU).
        generator: CPU generator for the parameters; None = torch's global generator.

    Returns (when called): ``{"image": (B, C, H, W) on device, "label": (B,) long}``.
    """

    def __init__(self, augment_classes: Sequence[int] | None = None, device: str | torch.device | None = None,
                 generator: torch.Generator | None = None):
        self.augment_classes = None if augment_classes is None else [int(c) for c in augment_classes]
        self.device = None if device is None else torch.device(device)
        self.generator = generator

    def __call__(self, items: list[Any]) -> dict:
        batch = torch.utils.data.default_collate(items)
        x, y = (batch["image"], batch["label"]) if isinstance(batch, dict) else (batch[0], batch[1])
        x = torch.as_tensor(x)
        if self.device is not None:
            x = x.to(self.device, non_blocking=True)
        y = torch.as_tensor(y, dtype=torch.long)
        if self.augment_classes is not None and not self.augment_classes:
            return {"image": x.clone(), "label": y}
        return {"image": batch_augment(x, y, self.augment_classes, generator=self.generator), "label": y}
