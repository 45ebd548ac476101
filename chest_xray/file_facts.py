"""File-level facts of an image file: what the acquisition and the export left in the file, not the picture.

:func:`file_facts` reads a JPEG/PNG header (Pillow, no pixel decode) or a DICOM header (pydicom,
``stop_before_pixels``) and returns only technical facts: ``width``, ``height`` (pixels), ``aspect`` (width /
height), ``area`` (megapixels), ``mode`` (Pillow mode, or the DICOM photometric interpretation), ``bit_depth``
(bits per sample; DICOM ``BitsStored``), ``file_kb`` (file size in KiB), ``format`` (``JPEG`` / ``PNG`` /
``DICOM``) and, for DICOM, ``photometric`` and ``manufacturer`` where present (``None`` where the optional tag is
absent). The reader never touches a patient, study or institution field: the DICOM tags read are listed in
:data:`DICOM_TAGS`, and nothing else from the data set is copied.

These facts are what a shortcut audit compares a model against (a model that predicts the label no better than
the file's size or shape may be reading the acquisition rather than the lungs), and what ``site check`` uses to
warn that a site's labels are predictable from its files alone.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: Numeric facts (model features as they are) and categorical facts (one-hot encoded by the audit).
NUMERIC_FACTS = ("width", "height", "aspect", "area", "bit_depth", "file_kb")
CATEGORICAL_FACTS = ("mode", "format", "photometric", "manufacturer")
#: Facts that describe the image geometry (reported "not applicable" together when every image shares them).
GEOMETRIC_FACTS = ("width", "height", "aspect", "area")
#: The only DICOM attributes read (keywords); no patient / study / institution attribute is among them.
DICOM_TAGS = ("Rows", "Columns", "BitsStored", "BitsAllocated", "PhotometricInterpretation", "Manufacturer",
              "SamplesPerPixel")

_PIL_BITS = {"1": 1, "L": 8, "P": 8, "RGB": 8, "RGBA": 8, "CMYK": 8, "YCbCr": 8, "LA": 8, "I;16": 16,
             "I;16B": 16, "I;16L": 16, "I": 32, "F": 32}


def file_facts(path: str | os.PathLike) -> dict[str, Any]:
    """Technical facts of one image file (see the module docstring for the keys and units).

    Raises:
        OSError: the file cannot be read. ValueError: neither a readable image header nor a DICOM file.
    """
    from chest_xray.io import DICOM_SUFFIXES, sniff_dicom

    p = Path(path)
    size_kb = p.stat().st_size / 1024.0
    if p.suffix.lower() in DICOM_SUFFIXES or sniff_dicom(p):
        return _dicom_facts(p, size_kb)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(p) as im:
            w, h = im.size
            mode, fmt = im.mode, (im.format or p.suffix.lstrip(".").upper())
    except UnidentifiedImageError as e:
        raise ValueError(f"{p}: not a readable image ({e})") from None
    return _facts(w, h, mode, _PIL_BITS.get(mode), size_kb, fmt.upper(), None, None)


def _dicom_facts(p: Path, size_kb: float) -> dict[str, Any]:
    from chest_xray.io import read_dataset

    ds = read_dataset(p, stop_before_pixels=True)
    got = {k: ds.get(k) for k in DICOM_TAGS}  # DataElement values only; nothing else leaves this function

    def text(v):
        s = str(v or "").strip()
        return s or None

    def num(v):
        try:
            return int(v) if v is not None and str(v).strip() != "" else None
        except (TypeError, ValueError):
            return None

    w, h = num(got["Columns"]) or 0, num(got["Rows"]) or 0
    photometric = text(got["PhotometricInterpretation"])
    bits = num(got["BitsStored"]) or num(got["BitsAllocated"])
    return _facts(w, h, photometric, bits, size_kb, "DICOM", photometric, text(got["Manufacturer"]))


def _facts(w, h, mode, bits, size_kb, fmt, photometric, manufacturer) -> dict[str, Any]:
    return {"width": int(w), "height": int(h), "aspect": (w / h) if h else None,
            "area": w * h / 1e6, "mode": mode, "bit_depth": bits, "file_kb": round(float(size_kb), 3),
            "format": fmt, "photometric": photometric, "manufacturer": manufacturer}


def facts_for(paths: list[str | os.PathLike]) -> tuple[list[dict[str, Any] | None], list[str]]:
    """:func:`file_facts` of every path, in order; ``None`` for a file that cannot be read, with one line each in
    the second list (``"<path>: <reason>"``)."""
    out: list[dict[str, Any] | None] = []
    problems: list[str] = []
    for p in paths:
        try:
            out.append(file_facts(p))
        except Exception as e:  # noqa: BLE001 -- one unreadable header is reported, never fatal
            reason = getattr(e, "reason", None) or str(e).splitlines()[0] if str(e) else type(e).__name__
            out.append(None)
            problems.append(f"{p}: {reason}")
    return out, problems
