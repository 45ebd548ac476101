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
    MapTransform,
    RandAffined,
    RandFlipd,
    Randomizable,
    RandomizableTransform,
    ResizeWithPadOrCropd,
    Resized,
    ScaleIntensityd,
    Transform,
)

from .aspect import ASPECTS, DEFAULT_ASPECT
from .io import read_image

MODES = ("train", "eval")
#: Augmentation ranges: rotation up to +-10 degrees, translation up to +-6 % of the side, horizontal flip p=0.5.
MAX_ROTATION_DEG = 10.0
MAX_TRANSLATE_FRACTION = 0.06
#: The site-config ``augment`` value that adds border augmentation (:class:`RandBandPadd`) to the per-image
#: MONAI pipeline (``build_transforms(..., border_augment=True)``).
AUGMENT_BORDER = "border"
#: Band colours of the border augmentation and the border probe, on the [0, 1] scale of the scaled image.
BAND_VALUES = {"black": 0.0, "grey": 0.5, "white": 1.0}
#: Border augmentation: probability per image, and the range of each band's width as a share of its side.
BORDER_PROB = 0.5
BORDER_FRACTION_RANGE = (0.02, 0.12)
#: The site-config ``augment`` value of dense border augmentation: most images of every class framed, wider bands,
#: most often on all four sides, in black / grey / white or any grey level (:data:`BORDER_PROFILES`).
AUGMENT_BORDER_DENSE = "border_dense"
#: The site-config ``augment`` value of dense border augmentation in the file: the bands of ``border_dense`` added to
#: the decoded image before squaring, resizing and the per-image intensity scaling, in the image's own grey scale,
#: where the border probe (``build_transforms(raw_band=...)``) adds its bands (:data:`RAW_BORDER_PROFILES`).
AUGMENT_BORDER_RAW = "border_raw"
#: ``augment`` value -> :class:`RandBandPadd` arguments: probability per image, width range as a share of the side,
#: probability of each side carrying a band, and whether one colour draw in len(values) + 1 is any grey in [0, 1].
BORDER_PROFILES = {
    AUGMENT_BORDER: {"prob": BORDER_PROB, "fraction_range": BORDER_FRACTION_RANGE, "side_prob": 0.5,
                     "uniform_values": False},
    AUGMENT_BORDER_DENSE: {"prob": 0.8, "fraction_range": (0.02, 0.20), "side_prob": 0.75, "uniform_values": True},
}
#: The site-config ``augment`` value of the random zoom-out: the border probe's own frame (``raw_band``: bands of
#: one share f of each side on all four sides of the decoded image, the image kept at its size, so the film shrinks
#: by 1 - 2f about its centre with its aspect kept) at a random f in :data:`ZOOM_OUT_FRACTION_RANGE`, filled with
#: the image's darkest level (the probe's black band), on every class, before squaring and intensity scaling.
AUGMENT_ZOOM_OUT = "zoom_out"
#: Zoom-out: share f of each side taken by the frame, uniform in this range (the probe's f = 0.06 is its top: the
#: film shrinks to 0.88-1.0 of each side), and the probability per image.
ZOOM_OUT_FRACTION_RANGE = (0.0, 0.06)
ZOOM_OUT_PROB = 0.8
#: ``augment`` values whose bands are added to the decoded image (before squaring and intensity scaling), each
#: with its :class:`RandBandPadd` arguments (``border_raw``: those of ``border_dense``).
RAW_BORDER_PROFILES = {
    AUGMENT_BORDER_RAW: BORDER_PROFILES[AUGMENT_BORDER_DENSE],
    AUGMENT_ZOOM_OUT: {"prob": ZOOM_OUT_PROB, "fraction_range": ZOOM_OUT_FRACTION_RANGE, "side_prob": 1.0,
                       "uniform_values": False, "values": (BAND_VALUES["black"],), "symmetric": True},
}
#: Every ``augment`` value that adds random bands (``build_transforms(border_augment=...)``).
BORDER_AUGMENTS = (*BORDER_PROFILES, *RAW_BORDER_PROFILES)
#: Inference-time band crop: a row / column is part of a uniform band when its pixels' standard deviation is below
#: this (on [0, 1]) and its mean within it of the outermost row's; at most this share of a side is cropped.
UNIFORM_TOLERANCE = 0.02
MAX_CROP_FRACTION = 0.25


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


def add_bands(img, widths: Sequence[int], value: float, keep_size: bool = True):
    """Frame an image with uniform bands, as an export or a scanner adds a border: pad (C, H, W) (or (H, W)) with
    the constant ``value`` by ``widths`` = (top, bottom, left, right) pixels, then, with ``keep_size``, resize back
    to (H, W) (area averaging), so the content shrinks and the bands take their share of the side. Deterministic;
    the same widths and value give the same output. Accepts a numpy array or a torch tensor and returns the same
    kind (float32).

    Raises:
        ValueError: a negative width, or bands that leave no content (keep_size: widths >= the side).
    """
    t, b, l, r = (int(w) for w in widths)
    if min(t, b, l, r) < 0:
        raise ValueError(f"band widths must be >= 0, got {tuple(widths)}")
    is_np = not isinstance(img, torch.Tensor)
    x = torch.as_tensor(np.asarray(img) if is_np else img, dtype=torch.float32)
    two_d = x.ndim == 2
    if two_d:
        x = x[None]
    h, w = x.shape[-2:]
    if keep_size and (t + b >= h or l + r >= w):
        raise ValueError(f"bands of {tuple(widths)} px leave no content in a {h} x {w} image")
    if not keep_size:
        out = torch.nn.functional.pad(x, (l, r, t, b), value=float(value))
    else:  # shrink the content into the inner box and frame it: padding, then resizing back, without the blur
        out = torch.full_like(x, float(value))
        out[..., t:h - b, l:w - r] = torch.nn.functional.interpolate(x[None], size=(h - t - b, w - l - r),
                                                                     mode="area")[0]
    if two_d:
        out = out[0]
    return out.numpy() if is_np else out


class BandPad(Transform):
    """Deterministic: :func:`add_bands` with fixed ``widths`` (top, bottom, left, right) in pixels and ``value``."""

    def __init__(self, widths: Sequence[int], value: float, keep_size: bool = True):
        self.widths, self.value, self.keep_size = tuple(int(w) for w in widths), float(value), keep_size

    def __call__(self, img):
        return add_bands(img, self.widths, self.value, self.keep_size)


class RandBandPad(RandomizableTransform):
    """Border augmentation (array transform, channel first): with probability ``prob`` frame the image with bands of
    one colour drawn from ``values`` (default black, grey and white, :data:`BAND_VALUES`; with ``uniform_values``
    one draw in len(values) + 1 is instead a uniform grey in [0, 1]), on a random non-empty set of sides (each side
    with probability ``side_prob``, default 1/2), each band's width a uniform share of its side in
    ``fraction_range``; the image keeps its size (:func:`add_bands`). Applied to every class, this teaches the
    model that a frame says nothing about the label (the shortcut of augmenting only the minority class: a black
    border meant NORMAL). As MONAI's ``RandFlip`` wraps ``Flip``: :meth:`randomize` draws the parameters
    (``self.params``: ``{"widths", "value"}`` or None), a deterministic :class:`BandPad` applies them. With
    ``image_scale`` the drawn value is mapped onto the image's own [min, max] (:func:`image_level`), as the border
    probe colours its bands on a decoded image; without it, it is used as is (an image already scaled to [0, 1]).
    With ``symmetric`` one share f in ``fraction_range`` is drawn for all four sides (``side_prob`` unused): bands
    of round(f H) rows at the top and bottom and round(f W) columns at the left and right, i.e. a zoom-out about the
    centre by 1 - 2f that keeps the aspect to a pixel; with ``image_scale`` and value 0 this is exactly the border
    probe's frame (``build_transforms(raw_band=(f, 0))``) at a random f.
    """

    def __init__(self, prob: float = BORDER_PROB, fraction_range: tuple[float, float] = BORDER_FRACTION_RANGE,
                 values: Sequence[float] = tuple(BAND_VALUES.values()), side_prob: float = 0.5,
                 uniform_values: bool = False, image_scale: bool = False, symmetric: bool = False):
        RandomizableTransform.__init__(self, prob)
        lo, hi = fraction_range
        if not 0 <= lo <= hi < 0.5:
            raise ValueError(f"fraction_range must satisfy 0 <= low <= high < 0.5, got {fraction_range}")
        if not values:
            raise ValueError("values must name at least one band colour")
        if not 0 < side_prob <= 1:
            raise ValueError(f"side_prob must be in (0, 1], got {side_prob}")
        self.fraction_range = (float(lo), float(hi))
        self.values = tuple(float(v) for v in values)
        self.side_prob, self.uniform_values = float(side_prob), bool(uniform_values)
        self.image_scale, self.symmetric = bool(image_scale), bool(symmetric)
        self.params: dict | None = None

    def randomize(self, data: Any = None, shape: Sequence[int] | None = None) -> None:
        """Draw whether to frame and, if so, the sides, widths (for an image of ``shape`` (..., H, W)) and colour."""
        super().randomize(None)
        if not self._do_transform or shape is None:
            self.params = None
            return
        h, w = int(shape[-2]), int(shape[-1])
        if self.symmetric:  # one share for every side: a centred zoom-out, the aspect kept
            sides = np.ones(4, bool)
            frac = np.full(4, self.R.uniform(*self.fraction_range))
        else:
            sides = self.R.rand(4) < self.side_prob
            if not sides.any():
                sides[self.R.randint(4)] = True
            frac = self.R.uniform(*self.fraction_range, size=4)
        widths = [int(round(f * (h if i < 2 else w))) if on else 0 for i, (f, on) in enumerate(zip(frac, sides))]
        k = self.R.randint(len(self.values) + int(self.uniform_values))
        value = self.values[k] if k < len(self.values) else float(self.R.uniform(0.0, 1.0))
        self.params = {"widths": widths, "value": value}

    def __call__(self, img, randomize: bool = True):
        if randomize:
            self.randomize(None, tuple(img.shape))
        if not self.params:
            return img
        value = image_level(img, self.params["value"]) if self.image_scale else self.params["value"]
        return BandPad(self.params["widths"], value)(img)


class RandBandPadd(Randomizable, MapTransform):
    """Dictionary version of :class:`RandBandPad`: one draw per sample, applied to every key in ``keys``."""

    def __init__(self, keys, prob: float = BORDER_PROB, fraction_range: tuple[float, float] = BORDER_FRACTION_RANGE,
                 values: Sequence[float] = tuple(BAND_VALUES.values()), allow_missing_keys: bool = False,
                 side_prob: float = 0.5, uniform_values: bool = False, image_scale: bool = False,
                 symmetric: bool = False):
        MapTransform.__init__(self, keys, allow_missing_keys)
        self.padder = RandBandPad(prob, fraction_range, values, side_prob, uniform_values, image_scale, symmetric)

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None):
        super().set_random_state(seed, state)
        self.padder.set_random_state(seed, state)
        return self

    def randomize(self, data: Any = None) -> None:
        return None

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        first = True
        for key in self.key_iterator(d):
            if first:
                self.padder.randomize(None, tuple(d[key].shape))
                first = False
            d[key] = self.padder(d[key], randomize=False)
        return d


def uniform_band_widths(img, tolerance: float = UNIFORM_TOLERANCE,
                        max_fraction: float = MAX_CROP_FRACTION) -> tuple[int, int, int, int]:
    """Widths (top, bottom, left, right) in pixels of the uniform bands framing an image (H, W) or (1, H, W): on
    each side, the run of outer rows (columns) whose pixels have a standard deviation below ``tolerance`` and a
    mean within ``tolerance`` of the outermost one's, at most ``max_fraction`` of the side. A radiograph's own
    content is never that flat, so the run stops at the film."""
    x = np.asarray(img, np.float64)
    x = x.reshape(x.shape[-2:])
    h, w = x.shape
    lim = (int(max_fraction * h), int(max_fraction * w))

    def run(lines, limit):
        if not len(lines):
            return 0
        first = lines[0].mean()
        n = 0
        for ln in lines[:limit]:
            if ln.std() >= tolerance or abs(ln.mean() - first) >= tolerance:
                break
            n += 1
        return n
    return run(x, lim[0]), run(x[::-1], lim[0]), run(x.T, lim[1]), run(x.T[::-1], lim[1])


def crop_uniform_bands(img, tolerance: float = UNIFORM_TOLERANCE, max_fraction: float = MAX_CROP_FRACTION):
    """An image (..., H, W) without the uniform bands framing it (:func:`uniform_band_widths`, measured on the
    first channel); deterministic; the same kind of array back. Defence in depth at inference: a border a site's
    export adds is removed before the image is made square."""
    t, b, l, r = uniform_band_widths(np.asarray(img)[(0,) * (np.ndim(img) - 2)], tolerance, max_fraction)
    h, w = img.shape[-2:]
    return img[..., t:h - b, l:w - r]


def _center_square(img: np.ndarray) -> np.ndarray:
    """The central min(H, W) x min(H, W) square of a (C, H, W) array (the longer dimension trimmed evenly)."""
    h, w = img.shape[-2:]
    m = min(h, w)
    top, left = (h - m) // 2, (w - m) // 2
    return img[..., top:top + m, left:left + m]


def build_transforms(input_size: int, mode: str, augment_classes: Sequence[int] | None = None,
                     aspect: str = DEFAULT_ASPECT, *, border_augment: bool | str = False, crop_bands: bool = False,
                     raw_band: tuple[float, float] | None = None) -> Compose:
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
        border_augment: train mode only: frame images of *every* class with random black / grey / white bands
            (:class:`RandBandPadd`, before flip and affine): True or ``"border"`` (site-config ``augment: border``,
            probability :data:`BORDER_PROB`), ``"border_dense"`` (``augment: border_dense``), the arguments of
            :data:`BORDER_PROFILES`; ``"border_raw"`` (``augment: border_raw``): the ``border_dense`` draws added
            instead to the decoded image before squaring (after ``crop_bands``), in its own grey scale, so that
            the resize and the per-image intensity scaling see the band, exactly where ``raw_band`` adds the
            probe's (:data:`RAW_BORDER_PROFILES`; the in-memory cache then holds decoded images); ``"zoom_out"``
            (``augment: zoom_out``): at the same place, the probe's own frame at a random share of each side
            (:data:`ZOOM_OUT_FRACTION_RANGE`, probability :data:`ZOOM_OUT_PROB`, the image's darkest level): a
            centred zoom-out of the film, aspect kept; False: none.
            Not restricted to ``augment_classes``: a frame on one class only is a label cue.
        crop_bands: remove uniform bands framing the decoded image (:func:`crop_uniform_bands`) before squaring,
            in both modes (defence in depth at inference; not the fix of a border shortcut).
        raw_band: ``(fraction, value)``: add bands of ``fraction`` of each side and colour ``value`` to the
            decoded image before squaring (:func:`add_bands`, size kept), i.e. a border in the file: the border
            probe on the raw pipeline. None: no band.

    Returns:
        the ``Compose``; applied to ``{"image": path, "label": int}`` it gives ``{"image": FloatTensor (1, S, S)
        in [0, 1], "label": int}``.

    Raises:
        ValueError: unknown mode, aspect or border_augment profile, or input_size < 8.
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
    border = AUGMENT_BORDER if border_augment is True else border_augment or None
    if border is not None and border not in BORDER_AUGMENTS:
        raise ValueError(f"unknown border_augment {border_augment!r}; expected one of {BORDER_AUGMENTS}")
    if aspect == "letterbox":
        square = [Resized(keys="image", spatial_size=s, size_mode="longest", mode="area"),
                  ResizeWithPadOrCropd(keys="image", spatial_size=(s, s), mode="constant")]
    else:
        square = [Resized(keys="image", spatial_size=(s, s), mode="area")]
        if aspect == "crop":
            square.insert(0, Lambdad(keys="image", func=_center_square))
    raw: list = []
    if raw_band is not None:
        frac, value = float(raw_band[0]), float(raw_band[1])
        raw.append(Lambdad(keys="image", func=partial(_frame, fraction=frac, value=value)))
    if crop_bands:
        raw.append(Lambdad(keys="image", func=crop_uniform_bands))
    if mode == "train" and border in RAW_BORDER_PROFILES:  # every class, in the file: before squaring and scaling
        raw.append(RandBandPadd(keys="image", image_scale=True, **RAW_BORDER_PROFILES[border]))
    steps: list = [
        Lambdad(keys="image", func=partial(_load, target_size=s if aspect == "letterbox" else 2 * s)),
        EnsureChannelFirstd(keys="image", channel_dim="no_channel"),
        *raw,
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
        if border in BORDER_PROFILES:  # every class: a frame on one class only would be a label cue
            steps.append(RandBandPadd(keys="image", **BORDER_PROFILES[border]))
        steps.append(ApplyToClassesd(augment, augment_classes))
        steps.append(EnsureTyped(keys="image", data_type="tensor", dtype=torch.float32, track_meta=False))
    return Compose(steps)


def image_level(img, value: float) -> float:
    """``value`` in [0, 1] mapped onto the image's own grey scale [min, max]: 0 -> its darkest level, 1 -> its
    brightest (a numpy array or a torch tensor of any shape)."""
    x = np.asarray(img, np.float32) if not isinstance(img, torch.Tensor) else img.float()
    lo, hi = float(x.min()), float(x.max())
    return lo + float(value) * (hi - lo)


def _frame(img, fraction: float, value: float):
    """:func:`add_bands` of ``fraction`` of each side on all four sides, in the image's own grey scale: ``value``
    in [0, 1] is mapped onto the image's [min, max] so that black / white are its darkest / brightest level."""
    x = np.asarray(img, np.float32)
    h, w = x.shape[-2:]
    t, l = int(round(fraction * h)), int(round(fraction * w))
    return add_bands(x, (t, t, l, l), image_level(x, value))


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
    border_augment: bool | str = False,
    crop_bands: bool = False,
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
            and label; the aspect is in the folder name so a cache of another geometry is never reused; a train
            pipeline whose augmentation acts on the decoded image, ``border_raw`` / ``zoom_out``, caches the decoded
            image under its own folder ``...-<augment>``, never the squared one of another pipeline).
        seed: seeds the augmentation random state (reproducible epochs); None leaves MONAI's default.
        cache_workers: threads used to fill the in-memory cache.
        aspect: how images are made square, see :func:`build_transforms` (default ``stretch``).
        border_augment, crop_bands: see :func:`build_transforms` (the cache folder name carries ``-cropbands``).

    Returns:
        a Dataset whose items are ``{"image": FloatTensor (1, S, S) in [0, 1], "label": int}``.

    Raises:
        RuntimeError: an image cannot be read (in-memory caching decodes every image up front); its ``__cause__``
            is the :class:`chest_xray.ImageReadError` naming the file. Scan with :func:`chest_xray.scan_dataset`
            first: it skips unreadable files.
    """
    data = [{"image": str(r["path"]), "label": int(r["label"])} for r in rows]
    transform = build_transforms(input_size, mode, augment_classes, aspect=aspect, border_augment=border_augment,
                                 crop_bands=crop_bands)
    if seed is not None:
        transform.set_random_state(seed=seed)
    if cache_dir is not None:
        raw = f"-{border_augment}" if mode == "train" and border_augment in RAW_BORDER_PROFILES else ""
        d = Path(cache_dir) / f"s{int(input_size)}-{aspect}{'-cropbands' if crop_bands else ''}{raw}"
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
