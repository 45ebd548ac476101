"""Screening of JPEG/PNG files before inference: is this plausibly a chest radiograph? (The DICOM twin,
:func:`chest_xray.io.dicom_skip_reason`, judges a DICOM object from its header.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np

#: Screening skips images whose shorter side is below this many pixels: no chest radiograph is that small (the
#: models' smallest input size is 32 px, and a thumbnail or icon carries no diagnostic detail).
MIN_IMAGE_SIDE = 64
#: Screening skips colour images: per pixel, the channel spread is max(R, G, B) - min(R, G, B) on a 0-255
#: scale (0 for a greyscale radiograph saved as RGB; every JPEG/PNG in the shared data set has 0). An image is
#: "colourful" when its mean spread exceeds MAX_MEAN_COLOUR_SPREAD, or more than MAX_COLOUR_PIXEL_FRACTION of its
#: pixels have a spread above COLOUR_PIXEL_SPREAD (a chart of coloured lines on white: ~1.7 %; a red arrow or
#: label burnt into a radiograph stays well under 1 %). Measured on a 256-px thumbnail.
MAX_MEAN_COLOUR_SPREAD = 8.0
COLOUR_PIXEL_SPREAD = 40
MAX_COLOUR_PIXEL_FRACTION = 0.01


def screen_image(path: str | Path) -> str | None:
    """Why a JPEG/PNG is not a plausible chest radiograph (too small, or colourful), or None.

    Unreadable files return None here: the image reader then gives its own reason. DICOM is not screened here
    (its Modality / ViewPosition / size are checked from the header).
    """
    from PIL import Image

    try:
        with Image.open(path) as img:
            w, h = img.size
            if min(w, h) < MIN_IMAGE_SIDE:
                return (f"image too small to be a chest radiograph: {w}x{h} px (shorter side under "
                        f"{MIN_IMAGE_SIDE} px)")
            if img.mode in ("L", "LA", "1", "I", "F") or img.mode.startswith("I;16"):
                return None
            if img.format == "JPEG":
                img.draft("RGB", (256, 256))
            rgb = img.convert("RGB")
            rgb.thumbnail((256, 256))
            a = np.asarray(rgb, dtype=np.int16)
    except Exception:  # noqa: BLE001 -- left to the reader, which names the problem
        return None
    spread = a.max(axis=2) - a.min(axis=2)
    mean, frac = float(spread.mean()), float((spread > COLOUR_PIXEL_SPREAD).mean())
    if mean > MAX_MEAN_COLOUR_SPREAD or frac > MAX_COLOUR_PIXEL_FRACTION:
        return (f"colour image, not a greyscale radiograph (mean channel spread {mean:.1f}/255, "
                f"{100 * frac:.1f}% strongly coloured pixels; limits {MAX_MEAN_COLOUR_SPREAD:g} and "
                f"{100 * MAX_COLOUR_PIXEL_FRACTION:g}%)")
    return None
