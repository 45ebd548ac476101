"""The one entry point, :func:`read_image`: file checks, then the Pillow or the DICOM reader."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np

from ._common import MAX_PIXELS, ImageReadError, is_dicom_file, check_readable
from ._dicom import read_dicom
from ._jpeg import jpeg_frame, pil_decodes, read_gdcm_frame
from ._pil import read_pil


def read_image(
    path: str | os.PathLike, target_size: int | None = None, *, max_pixels: int = MAX_PIXELS,
    check_entropy: bool = True,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Read a JPEG, PNG or DICOM chest X-ray into a grayscale float32 array.

    Args:
        path: the file. DICOM is recognised by the suffix ``.dcm``/``.dicom`` or the ``DICM`` preamble marker;
            everything else goes through Pillow, except a JPEG whose frame header announces a process Pillow cannot
            decode (lossless SOF3, 12-bit samples: the raw frames of DICOM exports saved as ``.jpg``), which GDCM
            decodes, or which is refused with kind "no decoder" (e.g. "lossless JPEG not supported" without GDCM).
        target_size: the longest side (pixels) the caller will resize to, or None. Only a decoding hint: when the
            image's longest side is at least twice ``target_size``, JPEGs are decoded in draft mode at a reduced
            scale (1/2, 1/4 or 1/8) whose longest side is still >= ``target_size``. The caller does the exact
            resize. DICOM and PNG are always decoded at full size.
        max_pixels: refuse images with more than this many pixels (rows x columns, read from the header before
            any pixel is decoded): the explicit decompression-bomb guard.
        check_entropy: JPEGs are decoded a second time by a strict decoder that reports libjpeg's warnings
            (:func:`chest_xray.io.jpeg_entropy_problem`), so that a file cut short or with corrupt entropy data is
            refused as the DICOM path refuses it. False skips that second decode (training reads files that the
            scan and ``site check`` already verified).

    Returns:
        ``(image, meta)``: ``image`` is float32 of shape (H, W) with values in [0, 1] (H, W = decoded rows and
        columns, upright: a JPEG/PNG's EXIF Orientation is applied first, otherwise the file's own orientation,
        never transposed); ``meta`` is a dict with technical fields only: ``format`` ("JPEG", "PNG", "MPO",
        "DICOM", ...), ``original_height``/``original_width`` (pixels, from the header, upright),
        ``height``/``width`` (decoded, smaller than the original only in draft mode), ``bit_depth``
        (bits per stored sample), ``mode`` (Pillow mode, or "DICOM"), ``photometric_interpretation``
        ("MONOCHROME1"/"MONOCHROME2" for DICOM, "MONOCHROME2" for grayscale Pillow modes, else the Pillow mode),
        ``draft`` (bool). Pillow formats add ``exif_orientation`` (1..8, 1 = upright or absent); JPEGs add
        ``decoder_warnings`` (a harmless libjpeg warning, one line, or None). DICOM adds ``modality``,
        ``view_position``, ``view_code``, ``presentation_intent``, ``other_body_part`` (see
        :func:`chest_xray.io.header_facts`), ``transfer_syntax``, ``voi`` ("lut", "window" or "none"), ``voi_fallback`` (why an
        invalid VOI window/LUT was ignored and the modality-LUT output scaled to its own range, see
        :func:`voi_problem`; None when not needed), ``inverted``, ``decoder_warnings`` (what the compressed-pixel
        decoder reported without failing, e.g. libjpeg's "N extraneous bytes before marker 0xd9", one line; None
        when silent: the decoder's messages are captured, never printed) and ``grayscale_notes`` (list of
        ``{"kind", "note"}``: every unusual step of the grey-scale pipeline that changed the pixels, e.g. a VOI LUT
        rescaled to its data's range or a Photometric Interpretation / Presentation LUT Shape contradiction; see
        :mod:`chest_xray.io._grayscale` for the rules; also a Transfer Syntax that did not describe the Pixel Data
        or a 3-component stream under a one-sample header, decoded as the bytes are, see
        :mod:`chest_xray.io._pixel_bytes`). A JPEG whose other MPF images are only previews is read as
        its primary image.

    Raises:
        ImageReadError: the only exception raised (any error from pydicom, Pillow or a decoder is converted):
            the file is missing, unreadable, empty, not a supported image, truncated or corrupt (for compressed
            DICOM and for JPEG also when the decoder only *warns* that data is missing: premature end, bad
            Huffman code), larger than ``max_pixels``, a true multi-frame stack, a DICOM directory index
            (DICOMDIR), or a DICOM object that is colour, has no pixel data, invalid Rows/Columns, or a transfer
            syntax no installed decoder handles (kind "no decoder", with the package that would decode it). The
            message is one line and starts with the path; ``kind`` is one of :data:`READ_ERROR_KINDS`.
    """
    try:
        p = Path(os.fsdecode(path))
    except TypeError:
        raise ImageReadError(str(path), f"not a file path ({type(path).__name__})", "missing file") from None
    try:
        try:
            size = p.stat().st_size
        except OSError as e:
            if p.is_symlink():
                what = ("a symbolic-link loop" if e.errno == errno.ELOOP else "does not exist")
                raise ImageReadError(p, f"broken symbolic link (its target {os.readlink(p)}: {what})",
                                     "missing file") from None
            raise ImageReadError(p, f"cannot open file ({e.strerror or e})", "missing file") from None
        if not p.is_file():
            raise ImageReadError(p, "not a regular file", "not a regular file")
        if size == 0:
            raise ImageReadError(p, "empty file (0 bytes)", "empty file")
        check_readable(p)
        if is_dicom_file(p):
            return read_dicom(p, max_pixels)
        frame = jpeg_frame(p)  # the frame header first: lossless / 12-bit frames never reach libjpeg-turbo
        if not pil_decodes(frame):
            return read_gdcm_frame(p, frame, max_pixels)
        return read_pil(p, target_size, max_pixels, check_entropy)
    except ImageReadError:
        raise
    except MemoryError:
        raise ImageReadError(p, "out of memory while decoding (image too large?)", "too large") from None
    except Exception as e:  # noqa: BLE001 -- the contract: nothing but ImageReadError leaves read_image
        raise ImageReadError(p, f"cannot read image ({type(e).__name__}: {e})", "unreadable") from None
