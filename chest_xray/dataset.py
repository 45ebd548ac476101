"""Scanning a data root into records: labels, patient ids and image sizes, with a report of skipped files.

Three layouts are understood:

- Kaggle: ``ROOT/{train,val,test}/{NORMAL,PNEUMONIA}/*`` (the original split is ignored; sites re-split);
- class folders: ``ROOT/NORMAL/``, ``ROOT/PNEUMONIA/`` (and, for the subtype scheme, optionally
  ``ROOT/BACTERIAL/``, ``ROOT/VIRAL/``);
- a CSV manifest (``ROOT`` is the ``.csv`` file) with columns ``path`` (relative to the CSV's folder, or absolute)
  and ``label`` (a class name or an integer index), optionally ``patient_id``.
"""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Any

from .io import (
    DICOM_SUFFIXES,
    SUPPORTED_SUFFIXES,
    ImageReadError,
    dicom_header,
    dicom_patient_id,
    dicom_skip_reason,
    read_image,
)

from .labels import CLASS_NAMES  # class names per label scheme; owner: chest_xray.labels

_SPLIT_DIRS = ("train", "val", "test")
_KERMANY_PATIENT = re.compile(r"^(NORMAL2-IM-\d+|IM-\d+|person\d+)", re.IGNORECASE)
_SUBTYPE = re.compile(r"_(bacteria|virus)_", re.IGNORECASE)


class LabelError(ValueError):
    """A file's label cannot be determined under the requested scheme (the message names the file)."""


def patient_id_from_name(path: str | os.PathLike) -> str:
    """Patient id from a Kermany file name, else the file stem (each such image is its own patient).

    ``person1003_virus_1685.jpeg`` -> ``person1003``; ``IM-0656-0001-0002.jpeg`` -> ``IM-0656``;
    ``NORMAL2-IM-0383-0001.jpeg`` -> ``NORMAL2-IM-0383``.
    """
    stem = Path(path).stem
    m = _KERMANY_PATIENT.match(stem)
    return m.group(1) if m else stem


def label_index(class_name: str, path: str | os.PathLike, labels: str = "binary") -> int:
    """Integer label of a file under a label scheme.

    Args:
        class_name: the file's class as given by its folder or manifest: NORMAL / PNEUMONIA (any case), or
            BACTERIAL / VIRAL, or an integer index as a string.
        path: the file; under ``subtype`` a PNEUMONIA image's subtype comes from its Kermany name
            (``personN_bacteria_M`` / ``personN_virus_M``).
        labels: ``"binary"`` (NORMAL=0, PNEUMONIA=1) or ``"subtype"`` (NORMAL=0, BACTERIAL=1, VIRAL=2).

    Raises:
        LabelError: unknown class name or index, or a PNEUMONIA file without a recognisable subtype.
        ValueError: unknown label scheme.
    """
    if labels not in CLASS_NAMES:
        raise ValueError(f"unknown label scheme {labels!r}; expected one of {sorted(CLASS_NAMES)}")
    names = CLASS_NAMES[labels]
    c = str(class_name).strip().upper()
    if c.lstrip("-").isdigit():
        k = int(c)
        if not 0 <= k < len(names):
            raise LabelError(f"{path}: label index {k} out of range for the {labels} scheme {names}")
        return k
    if labels == "binary":
        if c in ("BACTERIAL", "VIRAL", "BACTERIA", "VIRUS"):
            return 1
        if c in names:
            return names.index(c)
        raise LabelError(f"{path}: unknown class {class_name!r} for the binary scheme {names}")
    # subtype
    if c in ("BACTERIA", "VIRUS"):
        c = {"BACTERIA": "BACTERIAL", "VIRUS": "VIRAL"}[c]
    if c in names:
        return names.index(c)
    if c == "PNEUMONIA":
        m = _SUBTYPE.search(Path(path).name)
        if not m:
            raise LabelError(
                f"{path}: PNEUMONIA image without a subtype in its name (expected personN_bacteria_M or "
                "personN_virus_M) under the subtype scheme"
            )
        return names.index("BACTERIAL" if m.group(1).lower() == "bacteria" else "VIRAL")
    raise LabelError(f"{path}: unknown class {class_name!r} for the subtype scheme {names}")


def detect_layout(root: str | os.PathLike) -> str:
    """``"manifest"``, ``"classes"`` or ``"kaggle"``.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: ``root`` is none of the three layouts.
    """
    r = Path(root)
    if not r.exists():
        raise FileNotFoundError(f"{r}: data root does not exist")
    if r.is_file():
        if r.suffix.lower() == ".csv":
            return "manifest"
        raise ValueError(f"{r}: a data root file must be a CSV manifest")
    known = set(CLASS_NAMES["binary"] + CLASS_NAMES["subtype"])
    if any((r / c).is_dir() for c in known):
        return "classes"
    if any((r / s / c).is_dir() for s in _SPLIT_DIRS for c in known):
        return "kaggle"
    raise ValueError(
        f"{r}: unrecognised data root; expected {{train,val,test}}/{{NORMAL,PNEUMONIA}}/, NORMAL/ and PNEUMONIA/, "
        "or a CSV manifest with path,label[,patient_id] columns"
    )


def _iter_candidates(root: Path, layout: str) -> list[tuple[Path, str, str | None]]:
    """(file, class name, manifest patient id or None), sorted by path."""
    known = CLASS_NAMES["binary"] + CLASS_NAMES["subtype"][1:]
    out: list[tuple[Path, str, str | None]] = []
    if layout == "manifest":
        with open(root, newline="") as fh:
            reader = csv.DictReader(fh)
            cols = set(reader.fieldnames or [])
            if not {"path", "label"} <= cols:
                raise ValueError(f"{root}: manifest needs columns path and label (has {sorted(cols)})")
            for row in reader:
                p = Path(row["path"])
                if not p.is_absolute():
                    p = root.parent / p
                pid = (row.get("patient_id") or "").strip() or None
                out.append((p, row["label"], pid))
        return sorted(out, key=lambda t: str(t[0]))
    dirs = [root] if layout == "classes" else [root / s for s in _SPLIT_DIRS]
    for d in dirs:
        for c in known:
            cd = d / c
            if cd.is_dir():
                for f in cd.rglob("*"):
                    if f.is_file() and not f.name.startswith("."):
                        out.append((f, c, None))
    return sorted(out, key=lambda t: str(t[0]))


def scan_dataset(
    root: str | os.PathLike,
    labels: str = "binary",
    *,
    verify: bool = True,
    salt: str | None = None,
    allow_any_modality: bool = False,
    allow_lateral: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Scan a data root into one record per usable image.

    Args:
        root: a Kaggle-layout folder, a class-folder layout, or a CSV manifest file (see the module docstring).
        labels: label scheme, ``"binary"`` or ``"subtype"`` (see :data:`CLASS_NAMES`).
        verify: decode every image (JPEGs in 1/8-scale draft mode, ~3 ms each) so that truncated or corrupt files
            are caught here rather than in training; with False only the header is read (sizes, DICOM tags).
        salt: site-local salt for DICOM patient-id hashing (see :func:`chest_xray.io.site_salt`).
        allow_any_modality: keep DICOM objects whose Modality is not CR/DX/DR.
        allow_lateral: keep DICOM objects with a lateral ViewPosition.

    Returns:
        ``(records, report)``. ``records`` is a list sorted by path of dicts ``path`` (absolute str), ``label``
        (int index into ``CLASS_NAMES[labels]``), ``patient_id`` (str: manifest value, else Kermany name prefix,
        else salted DICOM PatientID hash, else the file stem), ``width``, ``height`` (int pixels, original).
        ``report`` is a JSON-safe dict: ``root``, ``layout``, ``labels``, ``class_names``, ``n_files``,
        ``n_records``, ``per_class`` (name -> count), ``n_patients``, ``skipped`` (list of ``{"path", "reason"}``).

    Raises:
        FileNotFoundError, ValueError: the root is missing or not a recognised layout, or the label scheme is
            unknown.
        LabelError: a file's label cannot be determined (e.g. a PNEUMONIA file without subtype under
            ``subtype``); a labelling problem is a data-set error, not a file to skip silently.
    """
    if labels not in CLASS_NAMES:
        raise ValueError(f"unknown label scheme {labels!r}; expected one of {sorted(CLASS_NAMES)}")
    r = Path(root).resolve()
    layout = detect_layout(r)
    candidates = _iter_candidates(r, layout)
    records: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    for path, cls, pid in candidates:
        path = path.resolve()
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            skipped.append({"path": str(path), "reason": f"unsupported file type {path.suffix or '(none)'}"})
            continue
        label = label_index(cls, path, labels)
        try:
            if path.suffix.lower() in DICOM_SUFFIXES:
                hdr = dicom_header(path)
                why = dicom_skip_reason(hdr, allow_any_modality, allow_lateral)
                if why:
                    skipped.append({"path": str(path), "reason": why})
                    continue
                width, height = hdr["columns"], hdr["rows"]
                if verify:
                    _, meta = read_image(path)
                    width, height = meta["original_width"], meta["original_height"]
                pid = pid or dicom_patient_id(path, salt) or path.stem
            else:
                width, height = _pil_size(path) if not verify else _verified_size(path)
                pid = pid or patient_id_from_name(path)
        except ImageReadError as e:
            skipped.append({"path": str(path), "reason": e.reason})
            continue
        records.append(
            {"path": str(path), "label": label, "patient_id": str(pid), "width": int(width), "height": int(height)}
        )
    names = CLASS_NAMES[labels]
    report = {
        "root": str(r),
        "layout": layout,
        "labels": labels,
        "class_names": list(names),
        "n_files": len(candidates),
        "n_records": len(records),
        "per_class": {n: sum(1 for x in records if x["label"] == k) for k, n in enumerate(names)},
        "n_patients": len({x["patient_id"] for x in records}),
        "skipped": skipped,
    }
    return records, report


def _verified_size(path: Path) -> tuple[int, int]:
    _, meta = read_image(path, target_size=1)  # smallest draft scale: a full but cheap decode
    return meta["original_width"], meta["original_height"]


def _pil_size(path: Path) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    from .io import MAX_PIXELS

    if path.stat().st_size == 0:
        raise ImageReadError(path, "empty file (0 bytes)")
    try:
        with Image.open(path) as img:
            w, h = img.size
    except UnidentifiedImageError:
        raise ImageReadError(path, "not a recognised image format (JPEG, PNG or DICOM expected)") from None
    except Exception as e:
        raise ImageReadError(path, f"cannot open image: {e}") from None
    if w * h > MAX_PIXELS:
        raise ImageReadError(path, f"image too large: {w}x{h} exceeds {MAX_PIXELS:,} pixels")
    return w, h
