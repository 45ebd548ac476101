"""Decoding that pydicom's plugins refuse but the installed GDCM handles, and decoder failures in one short line.

pydicom's GDCM plugin refuses JPEG Extended (Process 2 & 4) with 12-bit samples (a guard for old GDCM versions),
and its Pillow plugin cannot read 12-bit JPEG; the pinned GDCM decodes such a frame correctly (its IJG 12-bit
libjpeg). :func:`gdcm_extended_12_bit` hands the frame to GDCM directly, as pydicom's plugin would for 8 bits.
"""
from __future__ import annotations

import re

import numpy as np

from ._common import one_line

#: JPEG Extended (Process 2 & 4).
JPEG_EXTENDED = "1.2.840.10008.1.2.4.51"
#: Words (lower case) of a plugin's message that mean "this decoder does not handle this data" (not corruption).
_UNSUPPORTED_WORDS = ("does not support", "not supported", "unsupported", "no module named", "is not available")


def needs_direct_gdcm(ds) -> bool:
    """A 12-bit (9..12 bits stored) JPEG Extended data set, and GDCM is importable."""
    uid = str(ds.file_meta.get("TransferSyntaxUID", "")) if hasattr(ds, "file_meta") else ""
    if uid != JPEG_EXTENDED or not 8 < int(ds.get("BitsStored", 8) or 8) <= 12:
        return False
    try:
        import gdcm  # noqa: F401
    except ImportError:
        return False
    return True


def frame_image(frame: bytes, rows: int, cols: int, photometric, transfer_syntax):
    """A ``gdcm.Image`` of one encapsulated frame: ``frame`` (the codestream's bytes) as the only fragment of the
    Pixel Data, ``cols`` x ``rows`` samples, GDCM's photometric type ``photometric`` and transfer syntax constant
    ``transfer_syntax``. The caller sets the pixel format and reads ``GetBuffer()``."""
    import gdcm

    fragment = gdcm.Fragment()
    fragment.SetByteStringValue(frame)
    fragments = gdcm.SequenceOfFragments.New()
    fragments.AddFragment(fragment)
    elem = gdcm.DataElement(gdcm.Tag(0x7FE0, 0x0010))
    elem.SetValue(fragments.__ref__())
    img = gdcm.Image()
    img.SetNumberOfDimensions(2)
    img.SetDimensions((cols, rows, 1))
    img.SetDataElement(elem)
    img.SetPhotometricInterpretation(gdcm.PhotometricInterpretation(photometric))
    img.SetTransferSyntax(gdcm.TransferSyntax(transfer_syntax))
    return img


def gdcm_extended_12_bit(ds, rows: int, cols: int) -> np.ndarray:
    """Stored values (rows, cols) of a single-frame 12-bit JPEG Extended data set, decoded by GDCM.

    Raises:
        RuntimeError: GDCM could not decode the frame (empty output).
    """
    import gdcm
    from pydicom.encaps import generate_frames

    frame = next(generate_frames(ds.PixelData, number_of_frames=1))
    pi = gdcm.PhotometricInterpretation.GetPIType(str(ds.PhotometricInterpretation))
    img = frame_image(frame, rows, cols, pi, gdcm.TransferSyntax.JPEGExtendedProcess2_4)
    bits, signed = int(ds.BitsStored), int(ds.get("PixelRepresentation", 0) or 0)
    img.SetPixelFormat(gdcm.PixelFormat(1, 16, bits, bits - 1, signed))
    buf = img.GetBuffer().encode("utf-8", "surrogateescape")
    if len(buf) < rows * cols * 2:
        raise RuntimeError(f"GDCM returned {len(buf)} bytes for {rows} x {cols} 16-bit samples")
    return np.frombuffer(buf[: rows * cols * 2], "<i2" if signed else "<u2").reshape(rows, cols)


def decoder_failure(e: Exception, ts_name: str, hint: str) -> tuple[str, str]:
    """``(reason, kind)`` for a decoder exception, on one short line.

    pydicom lists every plugin's error on its own line ("Unable to decode as exceptions were raised by all
    available plugins: gdcm: ...; pillow: ..."); the reason keeps the first plugin's, cut to 120 characters. When
    every plugin says it does not handle the data, the kind is "no decoder" and the reason names ``hint``;
    otherwise it is "corrupt or truncated".
    """
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines()[1:] if ln.strip()] if "all available plugins" in text else []
    if lines and all(any(w in ln.lower() for w in _UNSUPPORTED_WORDS) for ln in lines):
        return (f"no installed decoder handles this {ts_name} data ({one_line(lines[0], 120)}; "
                f"decoders this project pins: {hint})", "no decoder")
    short = re.search(r"pixel data is less than expected \((\d+) vs (\d+) bytes\)", text)
    if short:  # an uncompressed file cut short (pydicom's words are a paragraph)
        return f"truncated DICOM file: the pixel data hold {short[1]} of {short[2]} bytes", "corrupt or truncated"
    first = lines[0] if lines else f"{type(e).__name__}: {text}"
    return f"cannot decode DICOM pixel data ({ts_name}): {one_line(first, 120)}", "corrupt or truncated"
