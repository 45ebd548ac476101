"""DICOM parsing without pixels: reading a data set, its technical header, attribute checks and decoder look-up."""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ._common import (
    LATERAL_VIEWS,
    PROJECTION_MODALITIES,
    ImageReadError,
    WARNINGS_LOCK,
    warnings_scope,
    check_readable,
)


def import_pydicom():
    """``pydicom``, imported (the first time) under :data:`WARNINGS_LOCK`. Its import chain (pydicom.data ->
    requests -> urllib3) adds a warnings filter and then relies on it; in a scan thread, another thread's warnings
    scope could swap the filter list meanwhile, and urllib3's DependencyWarning about SOCKS was printed in the
    middle of `cxr-hfl site check` / a scan. Cheap after the first call."""
    with WARNINGS_LOCK:
        import pydicom
        import pydicom.pixels  # noqa: F401 -- the decoders' registry, imported with the rest
    return pydicom


def read_dataset(p: Path, stop_before_pixels: bool = False):
    """pydicom dataset of ``p``; a data set without the Part-10 header (no preamble, no ``DICM``) is read with
    ``force=True`` and accepted only when it holds an image (Rows, Columns) or a SOP Class UID."""
    pydicom = import_pydicom()
    from pydicom.errors import InvalidDicomError

    check_readable(p)
    try:
        with warnings_scope(record=True) as caught:
            warnings.simplefilter("always")  # recorded, not printed: a scan of a whole export stays readable
            ds = pydicom.dcmread(p, stop_before_pixels=stop_before_pixels)
        _check_complete(p, ds, caught)
        return ds
    except ImageReadError:
        raise
    except InvalidDicomError:
        pass
    except Exception as e:  # pydicom raises a wide range of errors on truncated files
        raise ImageReadError(p, f"cannot parse DICOM file ({type(e).__name__}: {e})", "corrupt or truncated") from None
    # no Part-10 header: a raw data set (what some PACS exports and old archives write) is read with force
    try:
        with warnings_scope(record=True) as caught:
            warnings.simplefilter("always")
            ds = pydicom.dcmread(p, stop_before_pixels=stop_before_pixels, force=True)
            looks_valid = ("Rows" in ds and "Columns" in ds) or "SOPClassUID" in ds
    except Exception:  # noqa: BLE001 -- random bytes: not DICOM at all
        looks_valid, ds = False, None
    if not looks_valid:
        raise ImageReadError(p, "not a valid DICOM file (no Part-10 header and no DICOM data set)", "not an image")
    _check_complete(p, ds, caught)
    _set_transfer_syntax(ds)
    return ds


def _check_complete(p: Path, ds, caught: list) -> None:
    """Raise when pydicom reached the end of the file inside an element (a truncated file: pydicom then returns a
    partial, often empty, data set with only a warning)."""
    for w in caught:
        msg = str(w.message)
        if "End of file reached" in msg or "ended unexpectedly" in msg:
            raise ImageReadError(p, f"truncated DICOM file ({msg.split(' found in file')[0]})",
                                 "corrupt or truncated")
    if len(ds) == 0:
        raise ImageReadError(p, "DICOM file holds no data elements (truncated?)", "corrupt or truncated")


def _set_transfer_syntax(ds) -> None:
    """Give a force-read data set (no file meta) the Transfer Syntax UID its encoding was read with."""
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

    meta = getattr(ds, "file_meta", None)
    if meta is None:
        meta = ds.file_meta = FileMetaDataset()
    if meta.get("TransferSyntaxUID"):
        return
    implicit, little = ds.original_encoding
    if implicit is None:
        implicit, little = True, True
    meta.TransferSyntaxUID = (ImplicitVRLittleEndian if implicit else
                              ExplicitVRLittleEndian if little else ExplicitVRBigEndian)


def dicom_header(path: str | os.PathLike) -> dict[str, Any]:
    """Technical header fields of a DICOM file, read without decoding pixels.

    Returns:
        dict with ``modality`` (str, "" if absent), ``rows``, ``columns`` (int, 0 if absent), ``voi_fallback``
        (why the VOI window/LUT will be ignored, see :func:`voi_problem`; None when it is usable),
        ``directory_index`` (True for a DICOMDIR) and the facts of :func:`header_facts` (``view_position``,
        ``view_code``, ``presentation_intent``, ``other_body_part``). No patient-identifying field is included.

    Raises:
        ImageReadError: not a parseable DICOM file, or Rows/Columns that are not integers.
    """
    p = Path(path)
    ds = read_dataset(p, stop_before_pixels=True)
    try:
        return {
            "modality": str(ds.get("Modality", "") or "").strip().upper(),
            "rows": int(ds.get("Rows", 0) or 0),
            "columns": int(ds.get("Columns", 0) or 0),
            "voi_fallback": voi_problem(ds),
            "directory_index": is_directory_index(ds),
            **header_facts(ds),
        }
    except (TypeError, ValueError) as e:
        raise ImageReadError(p, f"invalid DICOM attribute: {e}", "invalid DICOM attribute") from None


#: SOP classes of "For Processing" images, the raw detector signal (PS3.3 C.8.11.1.1.1): digital X-ray,
#: mammography and intra-oral.
FOR_PROCESSING_SOP_CLASSES = ("1.2.840.10008.5.1.4.1.1.1.1.1", "1.2.840.10008.5.1.4.1.1.1.2.1",
                              "1.2.840.10008.5.1.4.1.1.1.3.1")
#: View Code Sequence meanings (lower case, hyphens and spaces dropped; CID 4010 "DX View" as MIMIC-CXR and DX
#: modalities write them) and the ViewPosition they stand for. A meaning holding "lateral" that is not listed is
#: read as "LATERAL".
VIEW_CODE_MEANINGS = {"posteroanterior": "PA", "anteroposterior": "AP", "lateral": "LATERAL", "leftlateral": "LL",
                      "rightlateral": "RL", "lateromedial": "LATERAL", "mediolateral": "LATERAL"}
#: Words that make BodyPartExamined or a description a chest (English, German, French, Spanish, Portuguese,
#: Italian spellings and the usual abbreviations).
CHEST_WORDS = ("CHEST", "THORAX", "TORAX", "TÓRAX", "TORACE", "LUNG", "CXR", "RIB", "STERNUM")
#: Body-part words that, in a description without a chest word, say the film is of another part.
OTHER_BODY_PART_WORDS = ("SHOULDER", "ABDOMEN", "ABDOMINAL", "ANKLE", "KNEE", "HIP", "PELVIS", "HAND", "WRIST",
                         "ELBOW", "FOOT", "FEET", "SKULL", "HEAD", "SPINE", "CSPINE", "TSPINE", "LSPINE", "FEMUR",
                         "TIBIA", "FIBULA", "HUMERUS", "FOREARM", "FINGER", "TOE", "HEEL", "SINUS", "SINUSES",
                         "MANDIBLE", "CLAVICLE", "SCAPULA", "KUB", "LEG", "ARM", "BREAST", "DENTAL")
#: BodyPartExamined values that name no part (read as absent).
_NO_BODY_PART = ("", "UNKNOWN", "OTHER", "NONE", "NULL", "-", "N/A", "NA", "ANY")
_DESCRIPTIONS = ("StudyDescription", "SeriesDescription", "ProtocolName")


def header_facts(ds) -> dict[str, Any]:
    """What the header says the image is, beside its pixels.

    Returns:
        dict with ``view_position`` (ViewPosition, upper case; when it is absent or empty, the View Code
        Sequence's meaning as a ViewPosition via :data:`VIEW_CODE_MEANINGS`, "" when neither says), ``view_code``
        (the View Code Sequence meaning the view came from, or None), ``presentation_intent`` ("FOR PROCESSING",
        "FOR PRESENTATION" or "": Presentation Intent Type, else a For Processing SOP class) and
        ``other_body_part`` (e.g. "BodyPartExamined SHOULDER" or "StudyDescription names SHOULDER": the attribute
        and the body-part word only, never the description's text; None for a chest or when nothing is said).
    """
    view, code = str(ds.get("ViewPosition", "") or "").strip().upper(), None
    if not view:
        view, code = _view_from_code(ds)
    intent = " ".join(str(ds.get("PresentationIntentType", "") or "").replace("_", " ").upper().split())
    if not intent:
        meta = getattr(ds, "file_meta", None)
        sop = str(ds.get("SOPClassUID", "") or (meta.get("MediaStorageSOPClassUID", "") if meta else "") or "")
        intent = "FOR PROCESSING" if sop in FOR_PROCESSING_SOP_CLASSES else ""
    return {"view_position": view, "view_code": code, "presentation_intent": intent,
            "other_body_part": _other_body_part(ds)}


def _view_from_code(ds) -> tuple[str, str | None]:
    """``(ViewPosition-like value, code meaning)`` from the first View Code Sequence item, or ``("", None)``."""
    try:
        seq = ds.get("ViewCodeSequence")
        meaning = str(seq[0].get("CodeMeaning", "") or "").strip() if seq else ""
    except (TypeError, IndexError, AttributeError):
        return "", None
    key = "".join(c for c in meaning.lower() if c.isalpha())
    view = VIEW_CODE_MEANINGS.get(key) or ("LATERAL" if "lateral" in key else "")
    return view, (meaning if view else None)


def _words(text: str) -> set[str]:
    return set("".join(c if c.isalnum() else " " for c in text.upper()).split())


def _other_body_part(ds) -> str | None:
    bp = " ".join(str(ds.get("BodyPartExamined", "") or "").upper().split())
    if bp not in _NO_BODY_PART and not any(w in bp for w in CHEST_WORDS):
        return f"BodyPartExamined {bp}"
    for attr in _DESCRIPTIONS:  # also under a chest BodyPartExamined: a reader's default is often CHEST
        words = _words(str(ds.get(attr, "") or ""))
        if words & set(CHEST_WORDS) or any(w.startswith(("CHEST", "THORA")) for w in words):
            continue  # this description names the chest (another may still name another part)
        hit = [w for w in OTHER_BODY_PART_WORDS if w in words]
        if hit:
            return f"{attr} names {hit[0]}"
    return None


def _values(v) -> list:
    """A DICOM attribute value as a list (a multi-value is a list, a single value a one-item list)."""
    if v is None:
        return []
    if isinstance(v, (list, tuple)) or type(v).__name__ == "MultiValue":
        return list(v)
    return [v]


def _number(v) -> float | None:
    """``v`` as a finite float, or None (a decimal comma ``"15000,5"`` is not a DICOM number: None)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None


def voi_problem(ds) -> str | None:
    """Why this data set's VOI transform (VOI LUT Sequence or Window Center/Width) cannot be applied, or None.

    Checked (PS3.3 C.11.2.1.2): a VOI LUT Sequence item needs a three-value LUT Descriptor (bits 8..16) and LUT
    Data; Window Center and Window Width come together, with the same number of values, every value a finite
    number (DS: a decimal comma such as ``15000,5`` is not one), and the width used (the first, which the
    standard makes the default of several alternative windows) >= 1 for LINEAR (> 0 for LINEAR_EXACT / SIGMOID).

    Returns:
        a one-line reason naming the attribute, or None when the transform is valid or absent. When a reason is
        returned, :func:`read_image` ignores the VOI transform and scales the modality-LUT output to its own
        range (the documented fallback), recording the reason as ``meta["voi_fallback"]``.
    """
    lut = ds.get("VOILUTSequence")
    if lut:
        try:
            item = lut[0]
            desc = _values(item.get("LUTDescriptor"))
            if len(desc) != 3 or not 8 <= int(desc[2]) <= 16 or "LUTData" not in item:
                return "invalid VOI LUT Sequence (LUT Descriptor / LUT Data malformed)"
        except (TypeError, ValueError, IndexError, AttributeError):
            return "invalid VOI LUT Sequence (LUT Descriptor / LUT Data malformed)"
        return None
    wc, ww = ds.get("WindowCenter"), ds.get("WindowWidth")
    if wc is None and ww is None:
        return None
    if wc is None or ww is None or wc == "" or ww == "":
        return f"Window {'Width' if wc is not None and wc != '' else 'Center'} missing (Window Center and " \
               "Width come together)"
    centres, widths = _values(wc), _values(ww)
    if len(centres) != len(widths):
        return f"Window Center has {len(centres)} values but Window Width has {len(widths)}"
    for name, vals in (("Window Center", centres), ("Window Width", widths)):
        bad = [v for v in vals if _number(v) is None]
        if bad:
            return f"non-numeric {name} {str(bad[0])!r}"
    func = str(ds.get("VOILUTFunction", "LINEAR") or "LINEAR").strip().upper()
    if func not in ("LINEAR", "LINEAR_EXACT", "SIGMOID"):
        return f"unknown VOI LUT Function {func!r}"
    w0 = _number(widths[0])
    if func == "LINEAR" and w0 < 1:
        return f"Window Width {w0:g} < 1 (invalid for a LINEAR window)"
    if func != "LINEAR" and w0 <= 0:
        return f"Window Width {w0:g} <= 0 (invalid for {func})"
    return None


def rescale_problem(ds) -> str | None:
    """Why this data set's Rescale Slope / Intercept (the linear modality LUT, PS3.3 C.11.1) cannot be applied, or
    None: a value that is not one finite number (pydicom would skip it silently and the window would then be
    applied in the wrong units), or a slope of 0 (every pixel maps to one value: a blank image)."""
    if ds.get("ModalityLUTSequence"):
        return None
    for name in ("RescaleSlope", "RescaleIntercept"):
        v = ds.get(name)
        if v is None or v == "":
            continue
        vals = _values(v)
        if len(vals) != 1 or _number(vals[0]) is None:
            return f"invalid {name.replace('Rescale', 'Rescale ')} {str(v)!r} (not one number)"
    slope = ds.get("RescaleSlope")
    if slope is not None and slope != "" and _number(_values(slope)[0]) == 0:
        return "Rescale Slope 0 maps every pixel to one value (a blank image)"
    return None


def has_pixel_tag(ds) -> bool:
    """The data set holds Pixel Data, Float Pixel Data or Double Float Pixel Data (an image, not a report)."""
    return any(k in ds for k in ("PixelData", "FloatPixelData", "DoubleFloatPixelData"))


def dicom_skip(header: dict[str, Any], allow_any_modality: bool = False, allow_lateral: bool = False,
               keep_for_processing: bool = False, skip_other_body_parts: bool = False) -> tuple[str, str] | None:
    """Why a DICOM object is not a chest projection radiograph a site would train on, and the kind of skip; None
    when it should be used.

    Args:
        header: as returned by :func:`dicom_header`.
        allow_any_modality: accept modalities other than CR/DX/DR.
        allow_lateral: accept lateral views (ViewPosition, or the View Code Sequence when ViewPosition is empty).
        keep_for_processing: accept "For Processing" images (the raw detector signal; PS3.3 C.8.11.1.1.1). They
            are skipped by default: the radiograph is their "For Presentation" twin.
        skip_other_body_parts: skip images whose header names another body part (:func:`header_facts`). The
            attribute is unreliable, so by default they are kept and noted (:func:`header_notes`).

    Returns:
        ``(reason, kind)``: kind is "directory index", "not a projection radiograph", "for processing",
        "lateral view" or "other body part"; or None.
    """
    if header.get("directory_index"):
        return DIRECTORY_INDEX_REASON, "directory index"
    mod = header.get("modality", "")
    if not allow_any_modality and mod not in PROJECTION_MODALITIES:
        return (f"DICOM modality {mod or '(missing)'} is not a projection radiograph (CR/DX/DR)",
                "not a projection radiograph")
    if not keep_for_processing and header.get("presentation_intent") == "FOR PROCESSING":
        return ("For Processing image: the raw detector signal (Presentation Intent FOR PROCESSING), not the "
                "radiograph a viewer shows, which is its For Presentation twin (keep_for_processing keeps it)",
                "for processing")
    view = header.get("view_position", "")
    if not allow_lateral and view in LATERAL_VIEWS:
        code = header.get("view_code")
        said = f"View Code Sequence {code!r}, ViewPosition empty" if code else f"ViewPosition {view}"
        return f"lateral view ({said})", "lateral view"
    if skip_other_body_parts and header.get("other_body_part"):
        return (f"another body part, not a chest ({header['other_body_part']}; skip_other_body_parts)",
                "other body part")
    return None


def dicom_skip_reason(header: dict[str, Any], allow_any_modality: bool = False, allow_lateral: bool = False,
                      keep_for_processing: bool = False, skip_other_body_parts: bool = False) -> str | None:
    """The reason of :func:`dicom_skip` (same arguments), or None when the object should be used."""
    got = dicom_skip(header, allow_any_modality, allow_lateral, keep_for_processing, skip_other_body_parts)
    return got[0] if got else None


def header_notes(header: dict[str, Any]) -> list[dict[str, str]]:
    """Notes (``{"kind", "note"}``) for a DICOM object that is used although its header says something unusual:
    another body part (kind "other body part": the attribute is unreliable, so a note, not a skip) and a For
    Processing image kept (kind "for processing"). ``header``: :func:`dicom_header`'s dict or
    :func:`chest_xray.io.read_image`'s DICOM metadata."""
    out = []
    if header.get("other_body_part"):
        out.append({"kind": "other body part", "note": f"the header names another body part "
                    f"({header['other_body_part']}): kept (the attribute is unreliable); check the film, or set "
                    "skip_other_body_parts to skip such images"})
    if header.get("presentation_intent") == "FOR PROCESSING":
        out.append({"kind": "for processing", "note": "For Processing image (the raw detector signal) kept "
                    "(keep_for_processing)"})
    return out


#: The decoder package this project pins for compressed DICOM (JPEG Lossless, JPEG-LS, JPEG 2000, RLE).
DICOM_DECODER_HINT = "python-gdcm==3.2.6"
#: The decoders this project pins for High-Throughput JPEG 2000 (GDCM does not decode it): pydicom's pylibjpeg
#: plugin with OpenJPEG (both MIT).
HTJ2K_DECODER_HINT = "pylibjpeg==2.1.0 and pylibjpeg-openjpeg==2.6.0"
#: SOP Class UID of a DICOMDIR (Media Storage Directory Storage): an index of an export's files, never an image.
DIRECTORY_SOP_CLASS = "1.2.840.10008.1.3.10"
DIRECTORY_INDEX_REASON = "DICOMDIR: a DICOM directory index (it lists the export's files and holds no image)"


def decoder_hint(uid) -> str:
    """The pinned package(s) that decode transfer syntax ``uid``."""
    return HTJ2K_DECODER_HINT if str(uid).startswith("1.2.840.10008.1.2.4.20") else DICOM_DECODER_HINT


def is_directory_index(ds) -> bool:
    """A DICOMDIR: Media Storage Directory Storage SOP class, or a Directory Record Sequence."""
    meta = getattr(ds, "file_meta", None)
    sop = str((meta.get("MediaStorageSOPClassUID") if meta is not None else None) or ds.get("SOPClassUID", "") or "")
    return sop == DIRECTORY_SOP_CLASS or "DirectoryRecordSequence" in ds


def decoder_problem(ds) -> str | None:
    """Why pydicom has no usable decoder for this data set's transfer syntax, or None."""
    from pydicom.pixels import get_decoder

    uid = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    if not uid:
        return "no Transfer Syntax UID in the file meta information"
    name = getattr(uid, "name", str(uid))
    try:
        decoder = get_decoder(uid)
    except NotImplementedError:
        return f"unsupported transfer syntax {name} ({uid})"
    if not decoder.is_available:
        return f"no decoder installed for {name} (install {decoder_hint(uid)})"
    return None
