"""Screening of JPEG/PNG files before inference: is this plausibly a chest radiograph? (The DICOM twin,
:func:`chest_xray.io.dicom_skip_reason`, judges a DICOM object from its header.) And :func:`dicom_manifest_screen`:
what the DICOM headers of a site's manifest say that a scan would have skipped or noted (``site check``)."""
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


#: File names listed per warning line of :func:`dicom_manifest_screen`.
MAX_NAMED = 3


def _named(paths: list[str], details: list[str] | None = None) -> str:
    shown = [Path(p).name + (f" ({d})" if d else "") for p, d in zip(paths, details or [None] * len(paths))]
    more = f" and {len(paths) - MAX_NAMED} more" if len(paths) > MAX_NAMED else ""
    return ", ".join(shown[:MAX_NAMED]) + more


def dicom_manifest_screen(paths: list[str], metas: list, keep_for_processing: bool = False,
                          skip_other_body_parts: bool = False) -> tuple[list[str], list[dict[str, str]]]:
    """What the DICOM headers of a site's manifest say, by the rules a scan applies (:func:`chest_xray.io.dicom_skip`).

    Args:
        paths: the manifest's files. metas: per file, :func:`chest_xray.read_image`'s metadata (None: unreadable).
        keep_for_processing, skip_other_body_parts: the site's options (``site check`` reads them from the site
            config).

    Returns:
        ``(warnings, notes)``: one warning line per kind of image a scan would have skipped but the manifest lists
        (For Processing images unless kept, lateral views read from ViewPosition or the View Code Sequence, another
        body part when ``skip_other_body_parts``), naming the first files; and the notes (``{"path", "note",
        "kind"}``, :func:`chest_xray.io.header_notes`) of the images kept although their header is unusual.
    """
    from .io import LATERAL_VIEWS, header_notes

    for_processing, lateral, other, notes = [], [], [], []
    for path, m in zip(paths, metas):
        if not m or m.get("format") != "DICOM":
            continue
        if m.get("presentation_intent") == "FOR PROCESSING" and not keep_for_processing:
            for_processing.append(path)
        elif m.get("view_position") in LATERAL_VIEWS:
            lateral.append((path, m.get("view_code") and f"View Code Sequence {m['view_code']!r}"
                            or f"ViewPosition {m['view_position']}"))
        elif m.get("other_body_part") and skip_other_body_parts:
            other.append((path, m["other_body_part"]))
        else:
            notes += [{"path": str(path), **n} for n in header_notes(m)]
    warnings = []
    if for_processing:
        warnings.append(f"{len(for_processing)} For Processing image(s) in the manifest (the raw detector signal, "
                        f"not the radiograph; a scan skips them): {_named(for_processing)}; remove them, or set "
                        "keep_for_processing: true to train on them")
    if lateral:
        warnings.append(f"{len(lateral)} lateral view(s) in the manifest (a scan skips them unless --allow-lateral; "
                        f"they train as if frontal): {_named(*map(list, zip(*lateral)))}")
    if other:
        warnings.append(f"{len(other)} image(s) of another body part in the manifest (skip_other_body_parts: true; "
                        f"a scan with it skips them): {_named(*map(list, zip(*other)))}")
    return warnings, notes

