"""Pillow reader (JPEG, PNG): EXIF orientation, MPF previews, draft decoding, grey-scale conversion."""
from __future__ import annotations

import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ._common import (
    FATAL_DECODER_MESSAGES,
    MAX_PIXELS,
    ImageReadError,
    warnings_scope,
    check_readable,
    image_signature,
    one_line,
)
from ._jpeg import gdcm_problem, jpeg_frame, pil_decodes

_GRAY_MODES = {"L": 8, "I;16": 16, "I;16L": 16, "I;16B": 16, "I;16N": 16, "I": 32, "F": 32, "1": 1, "LA": 8}


#: EXIF Orientation values (TIFF/EXIF tag 0x0112) that swap width and height (90/270-degree rotations).
EXIF_SWAPS_AXES = (5, 6, 7, 8)
#: MPF (CIPA DC-007) image types that are previews of the primary image, not further radiographs.
_MPF_PREVIEW_TYPES = ("Large Thumbnail",)


def exif_orientation(img) -> int:
    """EXIF Orientation (1..8) of an open Pillow image; 1 (upright) when absent or unreadable."""
    try:
        value = int(img.getexif().get(0x0112, 1) or 1)
    except Exception:  # noqa: BLE001 -- malformed EXIF: treat as absent
        return 1
    return value if 1 <= value <= 8 else 1


def _true_frames(img) -> int:
    """Number of frames that are separate images (1 for a JPEG whose other MPF entries are only previews)."""
    n = int(getattr(img, "n_frames", 1) or 1)
    if n <= 1 or img.format != "MPO":
        return n
    try:
        entries = img.mpinfo[0xB002]
        types = [str(e["Attribute"]["MPType"]) for e in entries]
    except Exception:  # noqa: BLE001 -- no readable MP index: count every frame
        return n
    extra = [t for t in types[1:] if not t.startswith(_MPF_PREVIEW_TYPES)]
    return 1 + len(extra)


#: Formats whose ``load()`` never runs Pillow's decompression-bomb check (Pillow 13: the check runs in
#: ``Image.open`` for them), so decoding them needs no warnings filter.
_LOAD_WITHOUT_BOMB_CHECK = ("JPEG", "PNG")


def _open_pil(p: Path):
    """``PIL.Image.open(p)`` with its errors as :class:`ImageReadError` (decompression bombs never a warning)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings_scope():
            # never let Pillow's bomb check degrade to a warning; our own guard below gives the clear error
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(p)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageReadError(p, f"image too large (decompression-bomb guard): {e}", "too large") from None
    except UnidentifiedImageError:
        fmt = image_signature(p)  # a JPEG / PNG start marker, then too little to identify: cut short
        if fmt:
            raise ImageReadError(p, f"{fmt} file cut short in its header", "corrupt or truncated") from None
        raise ImageReadError(p, "not a recognised image format (JPEG, PNG or DICOM expected)", "not an image") from None
    except (OSError, ValueError, SyntaxError, struct.error, EOFError) as e:
        raise ImageReadError(p, f"cannot open image: {e}", "corrupt or truncated") from None


def _refuse_unreadable_shape(p: Path, img, max_pixels: int) -> None:
    """Refuse (ImageReadError naming ``p``) an opened image with no pixels, more than ``max_pixels`` pixels (the
    decompression-bomb guard) or more than one true frame."""
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageReadError(p, f"invalid dimensions {width}x{height}", "corrupt or truncated")
    if width * height > max_pixels:
        raise ImageReadError(
            p,
            f"image too large: {width}x{height} = {width * height:,} pixels exceeds the limit of "
            f"{max_pixels:,} (decompression-bomb guard)",
            "too large",
        )
    n_frames = _true_frames(img)
    if n_frames > 1:
        raise ImageReadError(p, f"multi-frame image ({n_frames} frames) is not a single radiograph",
                             "multi-frame")


def read_pil(p: Path, target_size: int | None, max_pixels: int, check_entropy: bool = True
             ) -> tuple[np.ndarray, dict[str, Any]]:
    """A JPEG / PNG / other Pillow image as a grey-scale array and its metadata (the reader behind
    :func:`chest_xray.io.read_image` for non-DICOM files). Large JPEGs are draft-decoded near ``target_size``;
    EXIF orientation is applied; a JPEG's entropy-coded data is checked once more (:func:`jpeg_entropy_problem`)
    when ``check_entropy``.

    Raises:
        ImageReadError: the file cannot be opened or decoded, is too large, has no pixels or several frames.
    """
    from PIL import Image, ImageOps

    img = _open_pil(p)
    with img:
        fmt = img.format or "UNKNOWN"
        width, height = img.size
        mode0 = img.mode
        _refuse_unreadable_shape(p, img, max_pixels)
        # an MPO's primary image is frame 0; Pillow reads it as a plain JPEG from here on
        orientation = exif_orientation(img)
        draft = False
        if fmt in ("JPEG", "MPO") and target_size and max(width, height) >= 2 * int(target_size):
            scale = int(target_size) / max(width, height)
            req = (max(1, int(np.ceil(width * scale))), max(1, int(np.ceil(height * scale))))
            res = img.draft("L" if mode0 in ("L", "RGB") else mode0, req)
            draft = res is not None and img.size != (width, height)
        try:
            if fmt in _LOAD_WITHOUT_BOMB_CHECK:
                img.load()  # no warnings scope (and no lock): decodes in scan threads run side by side
            else:
                with warnings_scope():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    img.load()
            upright = img
            if orientation != 1:
                # the EXIF orientation applies before anything else reads the pixels (draft scaling commutes)
                upright = ImageOps.exif_transpose(img)
            arr, bit_depth = _pil_to_gray(upright)
        except (OSError, ValueError, SyntaxError, struct.error, EOFError, Image.DecompressionBombWarning) as e:
            raise ImageReadError(p, f"corrupt or truncated {fmt} data: {e}", "corrupt or truncated") from None
    said = None
    if fmt in ("JPEG", "MPO") and check_entropy:
        fatal, said = jpeg_entropy_problem(p)
        if fatal:
            raise ImageReadError(p, f"corrupt JPEG data: the decoder reported {fatal!r}", "corrupt or truncated")
    if orientation in EXIF_SWAPS_AXES:
        width, height = height, width
    h, w = arr.shape
    meta = {
        "format": fmt,
        "original_height": int(height),
        "original_width": int(width),
        "height": int(h),
        "width": int(w),
        "bit_depth": int(bit_depth),
        "mode": mode0,
        "photometric_interpretation": "MONOCHROME2" if mode0 in _GRAY_MODES else mode0,
        "draft": bool(draft),
        "exif_orientation": int(orientation),
    }
    if fmt in ("JPEG", "MPO"):
        meta["decoder_warnings"] = said
    return arr, meta


def jpeg_entropy_problem(p: Path) -> tuple[str | None, str | None]:
    """``(fatal, harmless)``: what libjpeg says about a JPEG file's entropy-coded data, decoded a second time.

    Pillow drops libjpeg's warnings (python-pillow/Pillow#9106): a JPEG cut short by an interrupted copy (an EOI
    marker after the cut) or with flipped bits decodes "fine", the missing part grey. The file is therefore decoded
    once more by libjpeg-turbo through ``simplejpeg`` in strict mode (at 1/8 scale: the whole entropy-coded data
    is still decoded, only the inverse DCT is reduced), which raises on the first warning. A warning that means
    missing or garbage data (:data:`FATAL_DECODER_MESSAGES`: premature end, bad Huffman code, ...) is ``fatal``;
    "N extraneous bytes before marker" (harmless, common in real exports) is ``harmless``; anything else (a
    colour space the strict decoder does not convert) leaves Pillow's decode standing. Flipped bits that keep the
    Huffman stream valid cannot be detected this way (no checksum exists in JPEG). Without ``simplejpeg``
    installed, and for a frame Pillow does not decode (:func:`chest_xray.io._jpeg.pil_decodes`: lossless or
    12-bit, which crash the strict decoder), nothing is checked: ``(None, None)``.
    """
    try:
        import simplejpeg
    except ImportError:  # pinned in pyproject.toml; without it the check is skipped
        return None, None
    if not pil_decodes(jpeg_frame(p)):  # a lossless or 12-bit frame crashes libjpeg-turbo's strict decode
        return None, None
    try:
        simplejpeg.decode_jpeg(p.read_bytes(), colorspace="GRAY", min_factor=8, min_height=1, min_width=1,
                               strict=True)
    except ValueError as e:
        msg = one_line(str(e), 200)
        if any(k in msg.lower() for k in FATAL_DECODER_MESSAGES):
            return msg, None
        return None, (msg if "extraneous bytes" in msg.lower() else None)
    except OSError:
        return None, None
    return None, None


def _pil_to_gray(img) -> tuple[np.ndarray, int]:
    """Pillow image -> (float32 (H, W) in [0, 1], bits per sample of the stored data)."""
    mode = img.mode
    if mode.startswith("I;16"):
        a = np.asarray(img).astype(np.float32)  # uint16 kept exactly until this single scaling step
        return np.clip(a / 65535.0, 0.0, 1.0), 16
    if mode == "I":
        a = np.asarray(img, dtype=np.int64)
        if a.size and a.min() >= 0 and a.max() <= 65535:
            return (a.astype(np.float32) / 65535.0), 16
        return _minmax(a.astype(np.float64)), 32
    if mode == "F":
        return _minmax(np.asarray(img, dtype=np.float64)), 32
    if mode == "L":
        return np.asarray(img, dtype=np.float32) / 255.0, 8
    if mode in ("RGBA", "LA", "PA"):
        img = img.convert("RGBA" if mode != "LA" else "LA")
        # alpha: composite onto black, so transparent padding reads as background
        if img.mode == "LA":
            a = np.asarray(img, dtype=np.float32) / 255.0
            return a[..., 0] * a[..., 1], 8
        a = np.asarray(img.convert("RGBA"), dtype=np.float32) / 255.0
        gray = 0.299 * a[..., 0] + 0.587 * a[..., 1] + 0.114 * a[..., 2]
        return np.clip(gray * a[..., 3], 0.0, 1.0).astype(np.float32), 8
    if mode == "P" and "transparency" in img.info:
        return _pil_to_gray(img.convert("RGBA"))
    # RGB, P, CMYK, YCbCr, 1, ...: Pillow's ITU-R 601-2 luma conversion
    return np.asarray(img.convert("L"), dtype=np.float32) / 255.0, 8


def _minmax(a: np.ndarray) -> np.ndarray:
    lo, hi = float(np.min(a)), float(np.max(a))
    if hi <= lo:
        return np.zeros(a.shape, dtype=np.float32)
    return ((a - lo) / (hi - lo)).astype(np.float32)



def pil_size(path: Path) -> tuple[int, int]:
    """Upright (EXIF-oriented) width and height in pixels of a JPEG / PNG, from the header alone.

    Raises:
        ImageReadError: empty, missing, unreadable, not an image, cut short in its header, or more than
            :data:`MAX_PIXELS` pixels.
    """
    from PIL import Image, UnidentifiedImageError

    frame = jpeg_frame(path)
    if not pil_decodes(frame):  # a lossless / 12-bit JPEG frame: its size from the frame header, as GDCM reads it
        if why := gdcm_problem(frame):
            raise ImageReadError(path, why, "no decoder")
        w, h = frame["columns"], frame["rows"]
        if w * h > MAX_PIXELS:
            raise ImageReadError(path, f"image too large: {w}x{h} exceeds {MAX_PIXELS:,} pixels", "too large")
        return w, h
    try:
        if path.stat().st_size == 0:
            raise ImageReadError(path, "empty file (0 bytes)", "empty file")
        check_readable(path)
        with warnings_scope():  # thread-safe catch_warnings (scans run files in threads)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own guard below names the size
            with Image.open(path) as img:
                w, h = img.size
                if exif_orientation(img) in EXIF_SWAPS_AXES:
                    w, h = h, w
    except ImageReadError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageReadError(path, f"image too large (decompression-bomb guard): {e}", "too large") from None
    except UnidentifiedImageError:
        if image_signature(path):  # a JPEG / PNG start marker, then too little to identify: cut short
            raise ImageReadError(path, f"{image_signature(path)} file cut short in its header",
                                 "corrupt or truncated") from None
        raise ImageReadError(path, "not a recognised image format (JPEG, PNG or DICOM expected)",
                             "not an image") from None
    except FileNotFoundError as e:
        raise ImageReadError(path, f"cannot open file ({e.strerror or e})", "missing file") from None
    except Exception as e:  # noqa: BLE001
        raise ImageReadError(path, f"cannot open image: {e}", "corrupt or truncated") from None
    if w * h > MAX_PIXELS:
        raise ImageReadError(path, f"image too large: {w}x{h} exceeds {MAX_PIXELS:,} pixels", "too large")
    return w, h
