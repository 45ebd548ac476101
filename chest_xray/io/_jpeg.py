"""The frame header of a JPEG file, read before any decoder sees it, and the JPEG processes Pillow cannot decode.

A raw frame exported from a JPEG Lossless DICOM (Process 14, ``SOF3``) or a 12-bit JPEG Extended frame (``SOF1``,
12-bit samples) is often saved as ``.jpg``. Pillow and libjpeg-turbo read neither: Pillow calls the 12-bit file
"cut short", and libjpeg-turbo's strict decode (simplejpeg) of an 8-bit lossless frame crashes the process
(jfolz/simplejpeg#29; pydicom#813, cgohlke/imagecodecs#27). The frame header (ITU-T T.81 B.2.2) says which
process the file uses, so :func:`jpeg_frame` reads it first and :func:`read_gdcm_frame` decodes such a frame with
GDCM (its own lossless and 12-bit libjpeg), the decoder DICOM viewers use for the same bytes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ._common import FATAL_DECODER_MESSAGES, ImageReadError, decoder_messages, one_line
from ._gdcm import frame_image

#: Start-of-frame markers (T.81 Table B.1) by the process they announce.
SOF_PROCESSES = {
    0xC0: "baseline", 0xC1: "extended", 0xC2: "progressive", 0xC3: "lossless",
    0xC5: "hierarchical", 0xC6: "hierarchical", 0xC7: "hierarchical",
    0xC9: "extended", 0xCA: "progressive", 0xCB: "lossless",
    0xCD: "hierarchical", 0xCE: "hierarchical", 0xCF: "hierarchical",
}
#: Processes that Pillow / libjpeg-turbo decode (8-bit samples only).
PIL_PROCESSES = ("baseline", "extended", "progressive")
#: Bytes of header read at most while looking for the frame header (EXIF and ICC segments come first).
_MAX_HEADER = 1 << 20


def jpeg_frame(path: str | Path) -> dict[str, Any] | None:
    """The frame header of a JPEG file: ``{"marker", "process", "precision", "rows", "columns", "components"}``
    (``precision`` in bits per sample; ``process`` a value of :data:`SOF_PROCESSES`).

    Returns None when the file does not start with a JPEG SOI marker, or when no frame header comes before the
    first scan or the file's end (a file cut short in its header): the caller's decoder then reports it.
    """
    try:
        with open(path, "rb") as fh:
            if fh.read(2) != b"\xff\xd8":
                return None
            return _scan_markers(fh)
    except OSError:
        return None


def _scan_markers(fh) -> dict[str, Any] | None:
    """Walk the marker segments from after SOI to the first SOF (returned) or SOS / EOI / end of data (None)."""
    pos = 2
    while pos < _MAX_HEADER:
        head = fh.read(2)
        if len(head) < 2:
            return None
        if head[0] != 0xFF:
            return None
        marker = head[1]
        if marker == 0xFF:  # fill byte before a marker
            fh.seek(-1, 1)
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # TEM / RSTn: no length
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or SOS before any frame header
            return None
        size = fh.read(2)
        if len(size) < 2:
            return None
        length = int.from_bytes(size, "big")
        if marker in SOF_PROCESSES:
            body = fh.read(6)
            if len(body) < 6 or length < 8:
                return None
            return {"marker": marker, "process": SOF_PROCESSES[marker], "precision": body[0],
                    "rows": int.from_bytes(body[1:3], "big"), "columns": int.from_bytes(body[3:5], "big"),
                    "components": body[5]}
        if length < 2:
            return None
        fh.seek(length - 2, 1)
        pos += 2 + length
    return None


def pil_decodes(frame: dict[str, Any] | None) -> bool:
    """Whether Pillow (libjpeg-turbo, 8-bit) decodes a file with this frame header; True when there is none (not a
    JPEG, or one cut short: Pillow then names the problem)."""
    return frame is None or (frame["process"] in PIL_PROCESSES and frame["precision"] == 8)


def gdcm_problem(frame: dict[str, Any]) -> str | None:
    """Why GDCM cannot decode a frame Pillow does not (None when it can): a hierarchical process, a colour frame,
    a precision outside 2..16 bits, or GDCM not installed."""
    what = _describe(frame)
    if frame["process"] == "hierarchical":
        return f"hierarchical JPEG ({what}) not supported"
    if frame["components"] != 1:
        return f"{what} with {frame['components']} colour components not supported (grey-scale expected)"
    if frame["process"] == "lossless" and not 2 <= frame["precision"] <= 16:
        return f"{what}: a precision of {frame['precision']} bits is invalid (2..16)"
    if frame["process"] == "progressive":
        return f"{what} not supported (12-bit progressive)"
    if frame["process"] != "lossless" and frame["precision"] != 12:
        return f"{what}: a precision of {frame['precision']} bits is invalid (8 or 12)"
    if frame["marker"] in (0xC9, 0xCA, 0xCB):
        return f"arithmetic-coded {what} not supported"
    try:
        import gdcm  # noqa: F401
    except ImportError:
        kind = "lossless JPEG" if frame["process"] == "lossless" else "12-bit JPEG"
        return f"{kind} not supported ({what}; install python-gdcm, pinned in pyproject.toml, to read it)"
    return None


def _describe(frame: dict[str, Any]) -> str:
    return (f"{frame['process']} JPEG (SOF{frame['marker'] - 0xC0}, {frame['precision']}-bit, "
            f"{frame['columns']} x {frame['rows']})")


def read_gdcm_frame(p: Path, frame: dict[str, Any], max_pixels: int) -> tuple[np.ndarray, dict[str, Any]]:
    """A lossless (SOF3) or 12-bit (SOF1) grey-scale JPEG file decoded by GDCM: ``(image, meta)`` as
    :func:`chest_xray.read_image` returns them (stored values / (2^precision - 1), float32 (H, W) in [0, 1]).

    Raises:
        ImageReadError: kind "no decoder" (:func:`gdcm_problem`), "too large", or "corrupt or truncated" (GDCM
            returned less than the frame's samples).
    """
    why = gdcm_problem(frame)
    if why:
        raise ImageReadError(p, why, "no decoder")
    rows, cols, bits = frame["rows"], frame["columns"], frame["precision"]
    if rows <= 0 or cols <= 0:
        raise ImageReadError(p, f"invalid dimensions {cols}x{rows} in the JPEG frame header", "corrupt or truncated")
    if rows * cols > max_pixels:
        raise ImageReadError(p, f"image too large: {cols}x{rows} = {rows * cols:,} pixels exceeds the limit of "
                                f"{max_pixels:,} (decompression-bomb guard)", "too large")
    said: list[str] = []
    with decoder_messages(said):  # libjpeg's warnings inside GDCM go to fd 2 and name no file
        stored = _gdcm_decode(p.read_bytes(), rows, cols, bits, frame["process"] == "lossless")
    fatal = [m for m in said if any(k in m.lower() for k in FATAL_DECODER_MESSAGES)]
    if stored is None or fatal:
        how = f"the decoder reported {'; '.join(fatal or said)}" if (fatal or said) else "GDCM could not decode it"
        raise ImageReadError(p, f"corrupt {_describe(frame)}: {how}", "corrupt or truncated")
    arr = (stored.astype(np.float32) / float((1 << bits) - 1)).clip(0.0, 1.0)
    meta = {"format": "JPEG", "original_height": rows, "original_width": cols, "height": rows, "width": cols,
            "bit_depth": int(bits), "mode": "L" if bits <= 8 else "I;16", "photometric_interpretation": "MONOCHROME2",
            "draft": False, "exif_orientation": 1, "decoder_warnings": one_line("; ".join(said), 200) or None,
            "jpeg_process": frame["process"]}
    return arr, meta


def _gdcm_decode(data: bytes, rows: int, cols: int, bits: int, lossless: bool) -> np.ndarray | None:
    """Stored values (rows, cols) of one grey-scale JPEG frame, or None when GDCM returns too few bytes."""
    import gdcm

    ts = gdcm.TransferSyntax.JPEGLosslessProcess14 if lossless else gdcm.TransferSyntax.JPEGExtendedProcess2_4
    img = frame_image(data, rows, cols, gdcm.PhotometricInterpretation.MONOCHROME2, ts)
    alloc = 8 if bits <= 8 else 16
    img.SetPixelFormat(gdcm.PixelFormat(1, alloc, bits, bits - 1, 0))
    buf = img.GetBuffer()
    n = rows * cols * alloc // 8
    if buf is None:
        return None
    buf = buf.encode("utf-8", "surrogateescape")
    if len(buf) < n:
        return None
    return np.frombuffer(buf[:n], "u1" if alloc == 8 else "<u2").reshape(rows, cols)
