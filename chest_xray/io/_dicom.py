"""DICOM reader: decoding (decoder messages captured) and the grey-scale pipeline (modality LUT, VOI, inversion)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ._common import FATAL_DECODER_MESSAGES, ImageReadError, one_line, scale_to_unit, warnings_scope
from ._common import decoder_messages as _decoder_messages
from ._gdcm import decoder_failure, gdcm_extended_12_bit, needs_direct_gdcm
from ._grayscale import apply_lut, lut_length_note, padding_mask, polarity, voi_lut_bits
from ._dicom_header import (
    DIRECTORY_INDEX_REASON,
    read_dataset,
    decoder_problem,
    has_pixel_tag,
    import_pydicom,
    decoder_hint,
    header_facts,
    is_directory_index,
    rescale_problem,
    voi_problem,
)
from ._grayscale import modality_lut_problem, modality_transform  # the modality step (PS3.3 C.11.1)
from ._pixel_bytes import PixelBytesError, decode_as_colour, reconcile_syntax, stream_components


def read_dicom(p: Path, max_pixels: int) -> tuple[np.ndarray, dict[str, Any]]:
    """A DICOM file through the grey-scale pipeline (see :func:`chest_xray.io.read_image` for the contract)."""
    import_pydicom()
    ds = read_dataset(p)
    rows, cols, bits_stored, photometric = _check_geometry(p, ds, max_pixels)
    notes: list[dict[str, str]] = []
    raw, ts_name, decoder_said = _decode_pixels(p, ds, rows, cols, photometric, notes)
    pad, pad_note = padding_mask(ds, raw)
    notes += [pad_note] if pad_note else []
    out, voi, fallback = _grayscale(p, ds, raw, bits_stored, notes, pad)
    inverted, note = polarity(ds, photometric)
    notes += [note] if note else []
    if inverted:
        out = 1.0 - out
    if pad is not None:
        out = np.where(pad, 0.0, out)  # padding outside the radiograph is black, whatever the polarity
    meta = {
        "format": "DICOM",
        "original_height": rows,
        "original_width": cols,
        "height": int(out.shape[0]),
        "width": int(out.shape[1]),
        "bit_depth": int(bits_stored or raw.dtype.itemsize * 8),
        "mode": "DICOM",
        "photometric_interpretation": photometric,
        "draft": False,
        "modality": str(ds.get("Modality", "") or "").strip().upper(),
        **header_facts(ds),  # view_position (ViewPosition, else the View Code Sequence), view_code, ...
        "transfer_syntax": ts_name,
        "voi": voi,
        "voi_fallback": one_line(fallback) if fallback else None,
        "inverted": inverted,
        "decoder_warnings": one_line("; ".join(decoder_said)) if decoder_said else None,
        "grayscale_notes": notes,
    }
    return out.astype(np.float32, copy=False), meta


def _check_geometry(p: Path, ds, max_pixels: int) -> tuple[int, int, int, str]:
    """Stage 1: ``(rows, columns, bits stored, photometric interpretation)`` of a single-frame grey-scale image
    with pixel data, or :class:`ImageReadError` (no pixel data, invalid attribute, multi-frame, too large,
    colour)."""
    if is_directory_index(ds):
        raise ImageReadError(p, DIRECTORY_INDEX_REASON, "directory index")
    if not has_pixel_tag(ds):
        sop = str(ds.get("SOPClassUID", "")) and getattr(ds.SOPClassUID, "name", str(ds.SOPClassUID))
        raise ImageReadError(p, f"DICOM object has no pixel data (not an image; SOP class {sop or 'unknown'})",
                             "no pixel data")
    try:
        with warnings_scope():
            warnings.simplefilter("ignore")  # pydicom warns before it raises on an invalid IS/US value
            n_frames = int(ds.get("NumberOfFrames", 1) or 1)
            rows, cols = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
            samples = int(ds.get("SamplesPerPixel", 1) or 1)
            bits_stored = int(ds.get("BitsStored", 0) or 0)
    except (TypeError, ValueError) as e:
        raise ImageReadError(p, f"invalid DICOM attribute (Rows/Columns/NumberOfFrames/SamplesPerPixel/BitsStored): "
                             f"{e}", "invalid DICOM attribute") from None
    if n_frames > 1:
        raise ImageReadError(p, f"multi-frame DICOM ({n_frames} frames) is not a single radiograph", "multi-frame")
    if rows <= 0 or cols <= 0:
        raise ImageReadError(p, f"invalid DICOM dimensions {rows}x{cols}", "invalid DICOM attribute")
    if rows * cols > max_pixels:
        raise ImageReadError(
            p,
            f"image too large: {cols}x{rows} = {rows * cols:,} pixels exceeds the limit of {max_pixels:,} "
            "(decompression-bomb guard)",
            "too large",
        )
    photometric = str(ds.get("PhotometricInterpretation", "") or "").strip().upper()
    if samples == 1 and not photometric:
        raise ImageReadError(p, "Photometric Interpretation missing: cannot tell MONOCHROME1 (inverted) from "
                             "MONOCHROME2", "invalid DICOM attribute")
    if samples != 1 or photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise ImageReadError(p, f"colour DICOM ({photometric or 'unknown photometric'}) is not a radiograph",
                             "colour image")
    return rows, cols, bits_stored, photometric


def _decode_pixels(p: Path, ds, rows: int, cols: int, photometric: str = "MONOCHROME2",
                   notes: list[dict[str, str]] | None = None) -> tuple[np.ndarray, str, list[str]]:
    """Stage 2: ``(stored values (rows, cols), transfer syntax name, decoder messages)``; the decoder's messages
    are captured, and one that means missing or garbage data refuses the file. The bytes are decoded as what
    they are (:mod:`._pixel_bytes`): a transfer syntax that does not describe them, or a 3-component stream under
    a one-sample header, is followed by the bytes, with a note appended to ``notes``."""
    notes = [] if notes is None else notes
    try:
        mismatch = reconcile_syntax(ds, rows, cols)
    except PixelBytesError as e:
        raise ImageReadError(p, str(e), "invalid DICOM attribute") from None
    notes += [{"kind": "transfer syntax mismatch", "note": mismatch}] if mismatch else []
    why = decoder_problem(ds)
    if why:
        raise ImageReadError(p, why, "no decoder")
    tsyntax = ds.file_meta.get("TransferSyntaxUID")
    ts_name = getattr(tsyntax, "name", str(tsyntax))
    comps = stream_components(ds)
    if comps not in (None, 1) and (comps != 3 or needs_direct_gdcm(ds)):
        raise ImageReadError(p, f"the {ts_name} stream holds {comps} components but the header says Samples per "
                             f"Pixel 1 ({photometric}): not decoded", "invalid DICOM attribute")
    if comps == 3:
        notes.append({"kind": "colour stream in grey-scale header", "note": f"the {ts_name} stream holds 3 "
                      f"components but the header says Samples per Pixel 1 ({photometric}): decoded as colour and "
                      "read as its luma (BT.601)"})
    decoder_said: list[str] = []
    try:
        with warnings_scope(), _decoder_messages(decoder_said):
            warnings.simplefilter("ignore")  # pydicom warns about fixable header quirks; errors still raise
            raw = (decode_as_colour(ds) if comps == 3 else gdcm_extended_12_bit(ds, rows, cols)
                   if needs_direct_gdcm(ds) else ds.pixel_array)
    except Exception as e:  # noqa: BLE001 -- every decoder failure becomes one short line naming the syntax
        said = f" (decoder: {one_line('; '.join(decoder_said), 120)})" if decoder_said else ""
        reason, kind = decoder_failure(e, ts_name, decoder_hint(tsyntax))
        raise ImageReadError(p, reason + said, kind) from None
    fatal = [m for m in decoder_said if any(k in m.lower() for k in FATAL_DECODER_MESSAGES)]
    if fatal:
        raise ImageReadError(p, f"corrupt compressed pixel data ({ts_name}): the decoder reported "
                             f"{'; '.join(fatal)}", "corrupt or truncated")
    if raw.ndim != 2:
        # Number of Frames is 1 here: more values than Rows x Columns means the header does not describe the data
        raise ImageReadError(p, f"pixel data does not match Rows {rows} x Columns {cols} (decoded shape "
                             f"{tuple(raw.shape)}): invalid Rows / Columns", "invalid DICOM attribute")
    return raw, ts_name, decoder_said


def _grayscale(p: Path, ds, raw: np.ndarray, bits_stored: int, notes: list[dict[str, str]],
               pad: np.ndarray | None = None) -> tuple[np.ndarray, str, str | None]:
    """Stage 3, the DICOM grey-scale pipeline in the standard's order: modality LUT -> VOI LUT / window (the
    presentation step, the polarity, is the caller's). Returns ``(values in [0, 1], voi kind, the reason a VOI
    transform was ignored or None)``; a rule of :mod:`._grayscale` that changed the pixels appends to ``notes``."""
    from pydicom.pixels import apply_voi_lut

    why = rescale_problem(ds) or modality_lut_problem(ds)
    if why:
        raise ImageReadError(p, why, "invalid DICOM attribute")
    try:
        arr, modality_notes = modality_transform(ds, raw)
    except Exception as e:  # noqa: BLE001
        what = "Modality LUT Sequence" if ds.get("ModalityLUTSequence") else "Rescale Slope / Intercept"
        raise ImageReadError(p, f"invalid {what} ({type(e).__name__}: {e})", "invalid DICOM attribute") from None
    notes += modality_notes
    voi, fallback = "none", voi_problem(ds)
    if fallback is None:
        if ds.get("VOILUTSequence"):
            voi = "lut"
        elif ds.get("WindowCenter") is not None and ds.get("WindowWidth") is not None:
            voi = "window"
    out = None
    if voi != "none":
        try:
            with warnings_scope():
                warnings.simplefilter("ignore")
                if voi == "lut":
                    bits, lut_note = voi_lut_bits(ds.VOILUTSequence[0])
                    # by hand, always: pydicom read 8-bit LUTs 4x too dark, refused 8-bit entries packed one per byte
                    # and took a negative first mapped value written as US for a large positive one
                    windowed = apply_lut(arr, ds.VOILUTSequence[0])
                    lo, hi = 0.0, float(2**bits - 1)
                else:
                    windowed = apply_voi_lut(arr, ds, prefer_lut=False)
                    lo, hi = _window_output_range(ds, bits_stored or raw.dtype.itemsize * 8)
            out = scale_to_unit(windowed, lo, hi)
            notes += [n for n in (lut_note, lut_length_note(ds.VOILUTSequence[0])) if n] if voi == "lut" else []
        except Exception as e:  # noqa: BLE001 -- documented fallback below
            fallback, voi, out = f"VOI transform failed ({type(e).__name__}: {e})", "none", None
    if out is None:
        # no (usable) VOI transform: the modality-LUT output scaled to its own range (padding pixels left out)
        a = np.asarray(arr, dtype=np.float64)
        inside = a[~pad] if pad is not None else a
        out = scale_to_unit(a, float(inside.min()), float(inside.max()))
    return out, voi, fallback


def _window_output_range(ds, bits: int) -> tuple[float, float]:
    """Output range [y_min, y_max] of pydicom's ``apply_windowing`` for this dataset (PS3.3 C.11.2.1.2)."""
    if ds.get("ModalityLUTSequence"):
        return 0.0, float(2 ** int(ds.ModalityLUTSequence[0].LUTDescriptor[2]) - 1)
    if int(ds.get("PixelRepresentation", 0) or 0) == 0:
        y_min, y_max = 0.0, float(2**bits - 1)
    else:
        y_min, y_max = float(-(2 ** (bits - 1))), float(2 ** (bits - 1) - 1)
    slope, intercept = ds.get("RescaleSlope"), ds.get("RescaleIntercept")
    if slope is not None and intercept is not None:
        y_min, y_max = y_min * float(slope) + float(intercept), y_max * float(slope) + float(intercept)
    return min(y_min, y_max), max(y_min, y_max)
