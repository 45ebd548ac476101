"""Per-site preprocessing with MONAI: load, make square (stretch by default), scale, augment chosen classes.

The pipeline is a MONAI ``Compose`` of dictionary transforms on keys ``image`` (a file path in, a float32
tensor (1, S, S) out) and ``label`` (int). How a non-square image becomes S x S is the ``aspect`` choice
(:data:`ASPECTS`): ``stretch`` (the default: resize H x W -> S x S, ignoring the aspect ratio, as the third-party
``chest_xray_224`` images were made), ``letterbox`` (longer side -> S, zero padding to a square; the padded share
differs between classes on Kermany and is a shortcut) or ``crop`` (central square, then resize).
Its deterministic prefix (decode, make square, scale) is cached by
:func:`make_site_dataset` (``CacheDataset`` in memory or ``PersistentDataset`` on disk), so later epochs do not
decode the 2,000-px JPEGs again; the random suffix (flip, rotation, translation) runs every epoch and only for
the samples whose label is in ``augment_classes``. This per-image ``train`` pipeline is the sites' default
(site-config ``augment: monai``); ``augment: batch`` (opt-in) trains on the eval-mode cache with the same
flip + affine applied per collated batch (:mod:`chest_xray.batch_augment`).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
import torch
from monai.data import CacheDataset, PersistentDataset, get_track_meta, set_track_meta
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    Lambdad,
    RandAffined,
    RandFlipd,
    Randomizable,
    ResizeWithPadOrCropd,
    Resized,
    ScaleIntensityd,
    Transform,
)

from . import ASPECTS, DEFAULT_ASPECT
from .io import read_image

MODES = ("train", "eval")
#: Augmentation ranges: rotation up to +-10 degrees, translation up to +-6 % of the side, horizontal flip p=0.5.
MAX_ROTATION_DEG = 10.0
MAX_TRANSLATE_FRACTION = 0.06


def _load(path: str | os.PathLike, target_size: int | None = None) -> np.ndarray:
    """``read_image`` as a transform function: path -> float32 (H, W) in [0, 1] (JPEG draft-decoded when large)."""
    return read_image(path, target_size=target_size, check_entropy=False)[0]  # verified at scan and site check


class ApplyToClassesd(Randomizable, Transform):
    """Apply a (random) dictionary transform only to samples whose label is in ``classes``.

    Args:
        transform: the transform to apply, typically a ``Compose`` of MONAI random dictionary transforms.
        classes: label indices to transform, or None for every class; other samples pass through unchanged
            (same object).
        label_key: dictionary key holding the int label.

    Being ``Randomizable``, it marks the end of the cacheable prefix for MONAI's cache datasets, and
    ``set_random_state`` seeds the wrapped transform.

    The wrapped transform runs with MONAI's metadata tracking off (``monai.data.set_track_meta(False)``, restored
    afterwards): the pipeline hands it a plain tensor and converts its output back to one, so the ``MetaTensor``
    that ``RandFlipd`` / ``RandAffined`` would build and carry is never read. The pixels are bitwise the same
    (``tests/test_data_transforms.py``) and, with ``RandAffined``'s cached sampling grid (``cache_grid``, the
    output being always s x s), one image's flip + affine is much cheaper (timings:
    ``studies/augmentation/RESULTS.md``).
    """

    def __init__(self, transform: Compose, classes: Sequence[int] | None, label_key: str = "label"):
        self.transform = transform
        self.classes = None if classes is None else frozenset(int(c) for c in classes)
        self.label_key = label_key

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None):
        super().set_random_state(seed, state)
        if isinstance(self.transform, Randomizable):
            self.transform.set_random_state(seed, state)
        return self

    def randomize(self, data: Any) -> None:  # the wrapped transform draws its own parameters
        return None

    def __call__(self, data: Mapping[Hashable, Any]) -> Mapping[Hashable, Any]:
        if self.classes is None or int(data[self.label_key]) in self.classes:
            tracking = get_track_meta()
            set_track_meta(False)
            try:
                return self.transform(dict(data))
            finally:
                set_track_meta(tracking)
        return data


def _center_square(img: np.ndarray) -> np.ndarray:
    """The central min(H, W) x min(H, W) square of a (C, H, W) array (the longer dimension trimmed evenly)."""
    h, w = img.shape[-2:]
    m = min(h, w)
    top, left = (h - m) // 2, (w - m) // 2
    return img[..., top:top + m, left:left + m]


def build_transforms(input_size: int, mode: str, augment_classes: Sequence[int] | None = None,
                     aspect: str = DEFAULT_ASPECT) -> Compose:
    """MONAI ``Compose`` of dictionary transforms for one site's input size.

    Steps (keys ``image``, ``label``): ``Lambdad`` calling :func:`chest_xray.read_image` (path -> (H, W), JPEG draft
    decode at >= ``input_size`` on the longer side for ``letterbox``, >= 2 x ``input_size`` otherwise so that the
    shorter side of images up to 2:1 is not upsampled), ``EnsureChannelFirstd`` -> (1, H, W), then by ``aspect``:
    ``stretch``: ``Resized((S, S), mode="area")``, every pixel row and column kept, no padding;
    ``letterbox``: ``Resized(size_mode="longest", mode="area")`` so the longer side is S and the aspect ratio is
    kept, then ``ResizeWithPadOrCropd`` to (S, S) with zero padding split evenly on both sides of the shorter
    dimension; ``crop``: the central min(H, W) square (:func:`_center_square`), then ``Resized((S, S),
    mode="area")``. Then ``ScaleIntensityd`` to [0, 1] (per image min-max; padding stays 0), ``EnsureTyped`` -> float32 ``torch.Tensor``.
    In ``train`` mode followed by :class:`ApplyToClassesd` wrapping ``RandFlipd`` (horizontal, p=0.5) and
    ``RandAffined`` (p=0.8: rotation up to +-10 degrees, translation up to +-6 % of the side, zero padding), then
    ``EnsureTyped`` again.

    Args:
        input_size: S, the site's square input side in pixels (>= 8).
        mode: ``"train"`` or ``"eval"`` (eval is fully deterministic).
        augment_classes: label indices to augment in train mode; None = every class, ``[]`` = none (pass
            :func:`default_augment_classes` for the OHFL minority rule); ignored in eval mode.
        aspect: one of :data:`ASPECTS` (default ``stretch``). Sites, the server's probe and ``evaluate`` must use
            the same choice: a model trained on letterboxed Kermany images learns the padding share (by itself it
            separates the classes of ``chest_xray_original``; ``docs/decisions.md``) and fails on unpadded images.

    Returns:
        the ``Compose``; applied to ``{"image": path, "label": int}`` it gives ``{"image": FloatTensor (1, S, S)
        in [0, 1], "label": int}``.

    Raises:
        ValueError: unknown mode or aspect, or input_size < 8.
        RuntimeError: when applied to an unreadable file; MONAI wraps every transform error, and the
            ``__cause__`` is the :class:`chest_xray.ImageReadError` naming the file.
    """
    if mode not in MODES:
        raise ValueError(f"unknown transform mode {mode!r}; expected one of {MODES}")
    s = int(input_size)
    if s < 8:
        raise ValueError(f"input_size must be >= 8, got {input_size}")
    if aspect not in ASPECTS:
        raise ValueError(f"unknown aspect {aspect!r}; expected one of {ASPECTS}")
    if aspect == "letterbox":
        square = [Resized(keys="image", spatial_size=s, size_mode="longest", mode="area"),
                  ResizeWithPadOrCropd(keys="image", spatial_size=(s, s), mode="constant")]
    else:
        square = [Resized(keys="image", spatial_size=(s, s), mode="area")]
        if aspect == "crop":
            square.insert(0, Lambdad(keys="image", func=_center_square))
    steps: list = [
        Lambdad(keys="image", func=partial(_load, target_size=s if aspect == "letterbox" else 2 * s)),
        EnsureChannelFirstd(keys="image", channel_dim="no_channel"),
        *square,
        ScaleIntensityd(keys="image", minv=0.0, maxv=1.0),
        EnsureTyped(keys="image", data_type="tensor", dtype=torch.float32, track_meta=False),
    ]
    if mode == "train":
        shift = MAX_TRANSLATE_FRACTION * s
        augment = Compose(
            [
                RandFlipd(keys="image", prob=0.5, spatial_axis=1),
                RandAffined(
                    keys="image",
                    prob=0.8,
                    rotate_range=math.radians(MAX_ROTATION_DEG),
                    translate_range=(shift, shift),
                    mode="bilinear",
                    padding_mode="zeros",
                    # the output size is fixed (s x s), so MONAI may keep the identity sampling grid between calls
                    spatial_size=(s, s),
                    cache_grid=True,
                ),
            ]
        )
        steps.append(ApplyToClassesd(augment, augment_classes))
        steps.append(EnsureTyped(keys="image", data_type="tensor", dtype=torch.float32, track_meta=False))
    return Compose(steps)


def default_augment_classes(train_rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Classes with fewer training images than the largest class (OHFL: NORMAL on the full binary data).

    Args:
        train_rows: rows with an int ``label`` (only the training split should be passed).

    Returns:
        sorted label indices k with 0 < n_k < max_j n_j; empty when all present classes are equally large.
    """
    counts = Counter(int(r["label"]) for r in train_rows)
    if not counts:
        return []
    top = max(counts.values())
    return sorted(k for k, n in counts.items() if n < top)


def resolve_augment_classes(setting: str | Sequence[int] | None, train_rows: Sequence[Mapping[str, Any]],
                            num_classes: int) -> list[int]:
    """The label indices a site augments for its site-config ``augment_classes`` value: ``"auto"`` ->
    :func:`default_augment_classes` of ``train_rows``, ``"all"`` or None -> ``0..num_classes-1`` (None means every
    class, as everywhere in this package), a list -> itself (``[]``: none). Returns a sorted list without
    duplicates."""
    if setting == "auto":
        return default_augment_classes(train_rows)
    if setting == "all" or setting is None:
        return list(range(int(num_classes)))
    return sorted({int(k) for k in setting})


def make_site_dataset(
    rows: Sequence[Mapping[str, Any]],
    input_size: int,
    mode: str,
    augment_classes: Sequence[int] | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    seed: int | None = None,
    cache_workers: int = 1,
    aspect: str = DEFAULT_ASPECT,
) -> torch.utils.data.Dataset:
    """A cached torch Dataset of one site's images at its input size.

    Args:
        rows: manifest rows (``path``, ``label`` int; other keys ignored), e.g. one split of
            :func:`chest_xray.read_site_manifest`.
        input_size: S, the square side in pixels.
        mode: ``"train"`` (class-restricted augmentation) or ``"eval"``.
        augment_classes: classes to augment in train mode; None = every class, ``[]`` = none (pass
            :func:`default_augment_classes` of the training rows for the OHFL minority rule).
        cache_dir: None -> ``CacheDataset`` (decoded, resized images held in memory: N x S^2 x 4 bytes);
            a folder -> ``PersistentDataset`` under ``cache_dir/s<S>-<aspect>`` (survives restarts; keyed by path
            and label; the aspect is in the folder name so a cache of another geometry is never reused).
        seed: seeds the augmentation random state (reproducible epochs); None leaves MONAI's default.
        cache_workers: threads used to fill the in-memory cache.
        aspect: how images are made square, see :func:`build_transforms` (default ``stretch``).

    Returns:
        a Dataset whose items are ``{"image": FloatTensor (1, S, S) in [0, 1], "label": int}``.

    Raises:
        RuntimeError: an image cannot be read (in-memory caching decodes every image up front); its ``__cause__``
            is the :class:`chest_xray.ImageReadError` naming the file. Scan with :func:`chest_xray.scan_dataset`
            first: it skips unreadable files.
    """
    data = [{"image": str(r["path"]), "label": int(r["label"])} for r in rows]
    transform = build_transforms(input_size, mode, augment_classes, aspect=aspect)
    if seed is not None:
        transform.set_random_state(seed=seed)
    if cache_dir is not None:
        d = Path(cache_dir) / f"s{int(input_size)}-{aspect}"
        d.mkdir(parents=True, exist_ok=True)
        return PersistentDataset(data, transform, cache_dir=d)
    return CacheDataset(data, transform, cache_rate=1.0, num_workers=cache_workers, progress=False)


class TensorAugmentDataset(torch.utils.data.Dataset):
    """Training images held as one cached tensor, augmented with cheap tensor operations.

    ``images`` are the eval-mode tensors of :func:`make_site_dataset` (``(N, 1, S, S)`` in [0, 1]); an item of a
    class in ``augment_classes`` is flipped horizontally with probability 0.5 and shifted by a random integer number
    of pixels, up to ``shift`` x S in each direction, with zero fill (the translation part of the MONAI ``train``
    pipeline, without its rotation). About 0.05 ms an image instead of about 6 ms for the MONAI ``RandAffined``
    path, which made augmentation cost more than the model at 64 px. Random draws use torch's global generator
    (seeded per round by :func:`hfl_components.training.train_local`).

    Raises:
        ValueError: images not (N, 1, S, S) or labels of another length.
    """

    def __init__(self, images: torch.Tensor, labels: Sequence[int], augment_classes: Sequence[int] | None = None,
                 shift: float = 0.06):
        images = torch.as_tensor(images, dtype=torch.float32)
        if images.ndim != 4 or images.shape[0] != len(labels):
            raise ValueError(f"images must be (N, C, S, S) with N = {len(labels)} labels, got {tuple(images.shape)}")
        self.images = images
        self.labels = [int(v) for v in labels]
        self.augment = set(range(max(self.labels) + 1) if augment_classes is None else map(int, augment_classes))
        self.max_shift = int(round(shift * images.shape[-1]))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        x = self.images[i]
        y = self.labels[i]
        if y in self.augment:
            if torch.rand(()) < 0.5:
                x = torch.flip(x, dims=(-1,))
            m = self.max_shift
            if m > 0:
                dy, dx = (int(v) for v in torch.randint(-m, m + 1, (2,)))
                x = torch.roll(x, shifts=(dy, dx), dims=(-2, -1))
                if dy > 0:
                    x[..., :dy, :] = 0
                elif dy < 0:
                    x[..., dy:, :] = 0
                if dx > 0:
                    x[..., :, :dx] = 0
                elif dx < 0:
                    x[..., :, dx:] = 0
        return {"image": x, "label": y}
