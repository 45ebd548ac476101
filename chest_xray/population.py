"""What the population-shift check reads from images and files (the data side of :mod:`hfl_components.shift`).

- :func:`image_statistics`: per-image pixel statistics of the model's input tensors (what the model sees, after
  squaring and min-max scaling): tone (mean, spread, quantiles, dark and bright shares, histogram entropy),
  sharpness (gradient energy) and the frame (how uniform the outer band is, and how it differs from the centre: an
  added border or collimation shows there).
- :func:`population_facts`: per-file facts: format and pixel geometry (:func:`chest_xray.file_facts.file_facts`)
  and, for DICOM, the patient's age (``PatientAge``), the ``Manufacturer`` and the ``ViewPosition``. The age is
  the one patient attribute read; it is turned into years and only ever summarised over a batch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

#: Names of the columns of :func:`image_statistics`, in order.
IMAGE_STATS = ("mean", "std", "p05", "p50", "p95", "dark_share", "bright_share", "entropy", "edge_energy",
               "border_std", "border_mean", "centre_minus_border")
#: Width of the outer band of :func:`image_statistics`' frame statistics, as a share of the side.
BORDER_FRACTION = 0.05
#: Pixel values below / above these (on the [0, 1] input scale) count as dark / bright.
DARK, BRIGHT = 0.05, 0.95
_AGE_UNITS = {"D": 1 / 365.25, "W": 7 / 365.25, "M": 1 / 12, "Y": 1.0}


def image_statistics(images) -> np.ndarray:
    """Pixel statistics of each image, (N, len(IMAGE_STATS)) float64, in the order of :data:`IMAGE_STATS`.

    ``images``: (N, H, W) or (N, 1, H, W) (a torch tensor or array) on the [0, 1] scale of the evaluation transform.
    ``p05`` / ``p50`` / ``p95``: pixel quantiles; ``dark_share`` / ``bright_share``: shares of pixels below
    :data:`DARK` / above :data:`BRIGHT`; ``entropy``: of a 32-bin histogram, in bits; ``edge_energy``: mean absolute
    difference of neighbouring pixels (both axes); ``border_std``: the mean over the four outer bands (width
    :data:`BORDER_FRACTION` of the side, at least one pixel) of each band's pixel standard deviation (0 for a
    uniform band); ``border_mean``: the mean of the four bands; ``centre_minus_border``: mean of the central half
    (in each axis) minus ``border_mean``.

    Raises:
        ValueError: not 3-d or 4-d with one channel, or images smaller than 4 x 4.
    """
    x = np.asarray(images.detach().cpu().numpy() if hasattr(images, "detach") else images, np.float64)
    if x.ndim == 4 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 3 or min(x.shape[1:]) < 4:
        raise ValueError(f"image_statistics takes (N, H, W) or (N, 1, H, W) images of at least 4 x 4, got {x.shape}")
    n, h, w = x.shape
    flat = x.reshape(n, -1)
    q = np.quantile(flat, [0.05, 0.5, 0.95], axis=1)
    bins = np.minimum((np.clip(flat, 0, 1) * 32).astype(int), 31)
    hist = np.stack([np.bincount(b, minlength=32) for b in bins]) / flat.shape[1]
    ent = -(hist * np.log2(np.where(hist > 0, hist, 1))).sum(1)
    edge = 0.5 * (np.abs(np.diff(x, axis=1)).mean((1, 2)) + np.abs(np.diff(x, axis=2)).mean((1, 2)))
    bh, bw = max(1, round(BORDER_FRACTION * h)), max(1, round(BORDER_FRACTION * w))
    bands = [x[:, :bh, :], x[:, -bh:, :], x[:, :, :bw], x[:, :, -bw:]]
    b_std = np.mean([b.reshape(n, -1).std(1) for b in bands], axis=0)
    b_mean = np.mean([b.reshape(n, -1).mean(1) for b in bands], axis=0)
    centre = x[:, h // 4: h - h // 4, w // 4: w - w // 4].reshape(n, -1).mean(1)
    return np.stack([flat.mean(1), flat.std(1), q[0], q[1], q[2], (flat < DARK).mean(1), (flat > BRIGHT).mean(1),
                     ent, edge, b_std, b_mean, centre - b_mean], axis=1)


def parse_age(value) -> float | None:
    """A DICOM Age String (``nnnD``, ``nnnW``, ``nnnM``, ``nnnY``; PS3.5 table 6.2-1) in years; None when absent or
    malformed."""
    s = str(value or "").strip().upper()
    if len(s) < 2 or s[-1] not in _AGE_UNITS or not s[:-1].isdigit():
        return None
    return int(s[:-1]) * _AGE_UNITS[s[-1]]


def population_facts(path: str | os.PathLike) -> dict[str, Any]:
    """The facts of one file the population check compares: ``format`` (``JPEG`` / ``PNG`` / ``DICOM``),
    ``width``, ``height`` (pixels, as stored), ``age_years`` (DICOM ``PatientAge``, else None), ``manufacturer``,
    ``view`` (DICOM ``ViewPosition``, upper case; None when absent or not DICOM).

    Raises:
        OSError / ValueError: the file cannot be read (as :func:`chest_xray.file_facts.file_facts`).
    """
    from chest_xray.file_facts import file_facts

    f = file_facts(path)
    out = {"format": f.get("format"), "width": f.get("width"), "height": f.get("height"), "age_years": None,
           "manufacturer": f.get("manufacturer"), "view": None}
    if f.get("format") == "DICOM":
        import pydicom

        ds = pydicom.dcmread(str(Path(path)), stop_before_pixels=True, force=True,
                             specific_tags=["PatientAge", "ViewPosition"])
        out["age_years"] = parse_age(ds.get("PatientAge"))
        out["view"] = str(ds.get("ViewPosition", "") or "").strip().upper() or None
    return out
