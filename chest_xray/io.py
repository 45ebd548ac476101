"""Reading chest X-ray files (JPEG, PNG, DICOM) into float32 grayscale arrays in [0, 1].

One entry point, :func:`read_image`, and one error type, :class:`ImageReadError`. DICOM objects go through
pydicom's grayscale pipeline in the order the standard prescribes (modality LUT, then VOI LUT or window, then the
MONOCHROME1 inversion); nothing patient-identifying ever leaves this module: the metadata returned is technical
only, and the one patient-level value a site needs for grouping, :func:`dicom_patient_id`, is a salted hash.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import struct
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

#: Largest image (rows x columns) any reader will decode. A 4,300 x 3,500 detector image is 15 MP; 50 MP leaves
#: ample room while refusing decompression bombs (Pillow itself only *warns* at 89 MP).
MAX_PIXELS = 50_000_000

#: File suffixes the readers accept (lower case). Anything else is reported as unsupported by the scanner.
PIL_SUFFIXES = (".jpeg", ".jpg", ".png")
DICOM_SUFFIXES = (".dcm", ".dicom")
SUPPORTED_SUFFIXES = PIL_SUFFIXES + DICOM_SUFFIXES

#: DICOM modalities that are projection radiographs (computed / digital radiography).
PROJECTION_MODALITIES = ("CR", "DX", "DR")
#: ViewPosition values that are lateral (not PA/AP) projections.
LATERAL_VIEWS = ("LL", "RL", "LAT", "LATERAL", "LLD", "RLD", "RLO", "LLO")

#: Environment variable holding the site-local salt for DICOM patient-id hashing.
SALT_ENV = "CXR_PATIENT_SALT"


#: Categories of :attr:`ImageReadError.kind` (and of the scan report's ``skipped_by_reason`` counts).
READ_ERROR_KINDS = (
    "missing file", "not a regular file", "empty file", "not an image", "corrupt or truncated", "too large",
    "multi-frame", "no pixel data", "colour image", "no decoder", "invalid DICOM attribute", "unreadable",
)


def _one_line(text: str, limit: int = 300) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed to one space, cut to ``limit`` chars."""
    t = " ".join(str(text).split())
    return t if len(t) <= limit else t[: limit - 3] + "..."


class ImageReadError(Exception):
    """A file could not be read as a chest X-ray image.

    Attributes:
        path: the file, as given (a non-UTF-8 name keeps its bytes as surrogate escapes, as ``os.fsdecode``).
        reason: what went wrong, in words, on one line (never contains patient-identifying DICOM fields).
        kind: the category of the problem, one of :data:`READ_ERROR_KINDS` (scan reports count skips by it).
    """

    def __init__(self, path: str | os.PathLike, reason: str, kind: str = "unreadable"):
        self.path = os.fsdecode(path) if isinstance(path, bytes) else str(path)
        self.reason = _one_line(reason)
        self.kind = kind
        super().__init__(f"{self.path!s}: {self.reason}")

    def __reduce__(self):  # picklable across DataLoader workers
        return (type(self), (self.path, self.reason, self.kind))


def check_readable(path: str | os.PathLike) -> None:
    """Open ``path`` for reading once, so that a file the process may not read is named as such.

    Raises:
        ImageReadError: kind ``"unreadable"``, e.g. "cannot open file (Permission denied)".
    """
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ImageReadError(path, f"cannot open file ({e.strerror or e})", "unreadable") from None


def sniff_dicom(path: Path) -> bool:
    """A file (whatever its suffix) is DICOM when it has the Part-10 ``DICM`` marker at byte 128."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:132] == b"DICM"


def _is_dicom(path: Path) -> bool:
    return path.suffix.lower() in DICOM_SUFFIXES or sniff_dicom(path)


def read_image(
    path: str | os.PathLike, target_size: int | None = None, *, max_pixels: int = MAX_PIXELS
) -> tuple[np.ndarray, dict[str, Any]]:
    """Read a JPEG, PNG or DICOM chest X-ray into a grayscale float32 array.

    Args:
        path: the file. DICOM is recognised by the suffix ``.dcm``/``.dicom`` or the ``DICM`` preamble marker;
            everything else goes through Pillow.
        target_size: the longest side (pixels) the caller will resize to, or None. Only a decoding hint: when the
            image's longest side is at least twice ``target_size``, JPEGs are decoded in draft mode at a reduced
            scale (1/2, 1/4 or 1/8) whose longest side is still >= ``target_size``. The caller does the exact
            resize. DICOM and PNG are always decoded at full size.
        max_pixels: refuse images with more than this many pixels (rows x columns, read from the header before
            any pixel is decoded): the explicit decompression-bomb guard.

    Returns:
        ``(image, meta)``: ``image`` is float32 of shape (H, W) with values in [0, 1] (H, W = decoded rows and
        columns, upright: a JPEG/PNG's EXIF Orientation is applied first, otherwise the file's own orientation,
        never transposed); ``meta`` is a dict with technical fields only: ``format`` ("JPEG", "PNG", "MPO",
        "DICOM", ...), ``original_height``/``original_width`` (pixels, from the header, upright),
        ``height``/``width`` (decoded, smaller than the original only in draft mode), ``bit_depth``
        (bits per stored sample), ``mode`` (Pillow mode, or "DICOM"), ``photometric_interpretation``
        ("MONOCHROME1"/"MONOCHROME2" for DICOM, "MONOCHROME2" for grayscale Pillow modes, else the Pillow mode),
        ``draft`` (bool). Pillow formats add ``exif_orientation`` (1..8, 1 = upright or absent). DICOM adds
        ``modality``, ``view_position``, ``transfer_syntax``, ``voi`` ("lut", "window" or "none"),
        ``voi_fallback`` (why an invalid VOI window/LUT was ignored and the modality-LUT output scaled to its own
        range, see :func:`voi_problem`; None when not needed), ``inverted`` and ``decoder_warnings`` (what the
        compressed-pixel decoder reported without failing, e.g. libjpeg's "N extraneous bytes before marker
        0xd9", one line; None when silent: the decoder's messages are captured, never printed). A JPEG whose other MPF images are
        only previews is read as its primary image.

    Raises:
        ImageReadError: the only exception raised (any error from pydicom, Pillow or a decoder is converted):
            the file is missing, unreadable, empty, not a supported image, truncated or corrupt (for compressed
            DICOM also when the decoder only *warns* that data is missing: premature end, bad Huffman code), larger
            than ``max_pixels``, a
            true multi-frame stack, or a DICOM object that is colour, has no pixel data, invalid Rows/Columns, or
            a transfer syntax no installed decoder handles. The message is one line and starts with the path;
            ``kind`` is one of :data:`READ_ERROR_KINDS`.
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
                raise ImageReadError(p, f"broken symbolic link (its target {os.readlink(p)} does not exist)",
                                     "missing file") from None
            raise ImageReadError(p, f"cannot open file ({e.strerror or e})", "missing file") from None
        if not p.is_file():
            raise ImageReadError(p, "not a regular file", "not a regular file")
        if size == 0:
            raise ImageReadError(p, "empty file (0 bytes)", "empty file")
        check_readable(p)
        if _is_dicom(p):
            return _read_dicom(p, max_pixels)
        return _read_pil(p, target_size, max_pixels)
    except ImageReadError:
        raise
    except MemoryError:
        raise ImageReadError(p, "out of memory while decoding (image too large?)", "too large") from None
    except Exception as e:  # noqa: BLE001 -- the contract: nothing but ImageReadError leaves read_image
        raise ImageReadError(p, f"cannot read image ({type(e).__name__}: {e})", "unreadable") from None


# ---------------------------------------------------------------------------------------------------------------
# Pillow (JPEG, PNG)

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

#: ``warnings.catch_warnings`` swaps the process-wide filter list (and, with ``record=True``, ``showwarning``): two
#: threads inside it at once can record each other's warnings or leave a filter behind when they leave out of
#: order (Python < 3.14). Every warnings scope in this module holds this lock.
_WARNINGS_LOCK = threading.RLock()


@contextmanager
def _warnings_scope(record: bool = False):
    """``warnings.catch_warnings(record=record)`` held under :data:`_WARNINGS_LOCK`, so that a scan verifying files
    in threads (:func:`chest_xray.dataset.scan_dataset`) attributes each warning to its own file and leaves the
    filters as it found them. Yields the list of caught warnings (``record=True``) or None."""
    with _WARNINGS_LOCK, warnings.catch_warnings(record=record) as caught:
        yield caught


def _read_pil(p: Path, target_size: int | None, max_pixels: int) -> tuple[np.ndarray, dict[str, Any]]:
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with _warnings_scope():
            # never let Pillow's bomb check degrade to a warning; our own guard below gives the clear error
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(p)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageReadError(p, f"image too large (decompression-bomb guard): {e}", "too large") from None
    except UnidentifiedImageError:
        raise ImageReadError(p, "not a recognised image format (JPEG, PNG or DICOM expected)", "not an image") from None
    except (OSError, ValueError, SyntaxError, struct.error, EOFError) as e:
        raise ImageReadError(p, f"cannot open image: {e}", "corrupt or truncated") from None
    with img:
        fmt = img.format or "UNKNOWN"
        width, height = img.size
        mode0 = img.mode
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
                with _warnings_scope():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    img.load()
            upright = img
            if orientation != 1:
                # the EXIF orientation applies before anything else reads the pixels (draft scaling commutes)
                upright = ImageOps.exif_transpose(img)
            arr, bit_depth = _pil_to_gray(upright)
        except (OSError, ValueError, SyntaxError, struct.error, EOFError, Image.DecompressionBombWarning) as e:
            raise ImageReadError(p, f"corrupt or truncated {fmt} data: {e}", "corrupt or truncated") from None
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
    return arr, meta


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


# ---------------------------------------------------------------------------------------------------------------
# DICOM


def _import_pydicom():
    """``pydicom``, imported (the first time) under :data:`_WARNINGS_LOCK`. Its import chain (pydicom.data ->
    requests -> urllib3) adds a warnings filter and then relies on it; in a scan thread, another thread's warnings
    scope could swap the filter list meanwhile, and urllib3's DependencyWarning about SOCKS was printed in the
    middle of `cxr-hfl site check` / a scan. Cheap after the first call."""
    with _WARNINGS_LOCK:
        import pydicom
        import pydicom.pixels  # noqa: F401 -- the decoders' registry, imported with the rest
    return pydicom


def _dcmread(p: Path, stop_before_pixels: bool = False):
    """pydicom dataset of ``p``; a data set without the Part-10 header (no preamble, no ``DICM``) is read with
    ``force=True`` and accepted only when it holds an image (Rows, Columns) or a SOP Class UID."""
    pydicom = _import_pydicom()
    from pydicom.errors import InvalidDicomError

    check_readable(p)
    try:
        with _warnings_scope(record=True) as caught:
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
        with _warnings_scope(record=True) as caught:
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
        dict with ``modality`` (str, "" if absent), ``view_position`` (str), ``rows``, ``columns`` (int, 0 if
        absent), ``voi_fallback`` (why the VOI window/LUT will be ignored, see :func:`voi_problem`; None when it
        is usable). No patient-identifying field is included.

    Raises:
        ImageReadError: not a parseable DICOM file, or Rows/Columns that are not integers.
    """
    p = Path(path)
    ds = _dcmread(p, stop_before_pixels=True)
    try:
        return {
            "modality": str(ds.get("Modality", "") or "").strip().upper(),
            "view_position": str(ds.get("ViewPosition", "") or "").strip().upper(),
            "rows": int(ds.get("Rows", 0) or 0),
            "columns": int(ds.get("Columns", 0) or 0),
            "voi_fallback": voi_problem(ds),
        }
    except (TypeError, ValueError) as e:
        raise ImageReadError(p, f"invalid DICOM attribute: {e}", "invalid DICOM attribute") from None


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


def _has_pixel_tag(ds) -> bool:
    return any(k in ds for k in ("PixelData", "FloatPixelData", "DoubleFloatPixelData"))


def dicom_skip_reason(header: dict[str, Any], allow_any_modality: bool = False, allow_lateral: bool = False):
    """Why a DICOM object is not a chest projection radiograph a site would train on, or None.

    Args:
        header: as returned by :func:`dicom_header`.
        allow_any_modality: accept modalities other than CR/DX/DR.
        allow_lateral: accept lateral ViewPosition values.

    Returns:
        a reason string, or None when the object should be used.
    """
    mod = header.get("modality", "")
    if not allow_any_modality and mod not in PROJECTION_MODALITIES:
        return f"DICOM modality {mod or '(missing)'} is not a projection radiograph (CR/DX/DR)"
    if not allow_lateral and header.get("view_position", "") in LATERAL_VIEWS:
        return f"lateral view (ViewPosition {header['view_position']})"
    return None


#: The decoder package this project pins for compressed DICOM (JPEG Lossless, JPEG-LS, JPEG 2000, RLE).
DICOM_DECODER_HINT = "python-gdcm==3.2.6"


def _decoder_problem(ds) -> str | None:
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
        return f"no decoder installed for {name} (install {DICOM_DECODER_HINT})"
    return None


def _read_dicom(p: Path, max_pixels: int) -> tuple[np.ndarray, dict[str, Any]]:
    _import_pydicom()
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    ds = _dcmread(p)
    if not _has_pixel_tag(ds):
        sop = str(ds.get("SOPClassUID", "")) and getattr(ds.SOPClassUID, "name", str(ds.SOPClassUID))
        raise ImageReadError(p, f"DICOM object has no pixel data (not an image; SOP class {sop or 'unknown'})",
                             "no pixel data")
    try:
        with _warnings_scope():
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
    why = _decoder_problem(ds)
    if why:
        raise ImageReadError(p, why, "no decoder")
    tsyntax = ds.file_meta.get("TransferSyntaxUID")
    ts_name = getattr(tsyntax, "name", str(tsyntax))
    decoder_said: list[str] = []
    try:
        with _warnings_scope(), _decoder_messages(decoder_said):
            warnings.simplefilter("ignore")  # pydicom warns about fixable header quirks; errors still raise
            raw = ds.pixel_array
    except Exception as e:  # noqa: BLE001 -- every decoder failure becomes one line naming the syntax
        said = f" (decoder: {'; '.join(decoder_said)})" if decoder_said else ""
        raise ImageReadError(p, f"cannot decode DICOM pixel data ({ts_name}){said}: {type(e).__name__}: {e}",
                             "corrupt or truncated") from None
    fatal = [m for m in decoder_said if any(k in m.lower() for k in _FATAL_DECODER_MESSAGES)]
    if fatal:
        raise ImageReadError(p, f"corrupt compressed pixel data ({ts_name}): the decoder reported "
                             f"{'; '.join(fatal)}", "corrupt or truncated")
    if raw.ndim != 2:
        # Number of Frames is 1 here: more values than Rows x Columns means the header does not describe the data
        raise ImageReadError(p, f"pixel data does not match Rows {rows} x Columns {cols} (decoded shape "
                             f"{tuple(raw.shape)}): invalid Rows / Columns", "invalid DICOM attribute")
    # DICOM grayscale pipeline, in the standard's order: modality LUT -> VOI LUT / window -> presentation
    why = rescale_problem(ds)
    if why:
        raise ImageReadError(p, why, "invalid DICOM attribute")
    try:
        arr = apply_modality_lut(raw, ds)
    except Exception as e:  # noqa: BLE001
        raise ImageReadError(p, f"invalid modality LUT / Rescale Slope, Intercept ({type(e).__name__}: {e})",
                             "invalid DICOM attribute") from None
    voi, fallback = "none", voi_problem(ds)
    if fallback is None:
        if ds.get("VOILUTSequence"):
            voi = "lut"
        elif ds.get("WindowCenter") is not None and ds.get("WindowWidth") is not None:
            voi = "window"
    out = None
    if voi != "none":
        try:
            with _warnings_scope():
                warnings.simplefilter("ignore")
                if voi == "lut":
                    windowed = apply_voi_lut(arr, ds)
                    lo, hi = 0.0, float(2 ** int(ds.VOILUTSequence[0].LUTDescriptor[2]) - 1)
                else:
                    windowed = apply_voi_lut(arr, ds, prefer_lut=False)
                    lo, hi = _window_output_range(ds, bits_stored or raw.dtype.itemsize * 8)
            out = _scale(windowed, lo, hi)
        except Exception as e:  # noqa: BLE001 -- documented fallback below
            fallback, voi, out = f"VOI transform failed ({type(e).__name__}: {e})", "none", None
    if out is None:
        # no (usable) VOI transform: the modality-LUT output scaled to its own range
        a = np.asarray(arr, dtype=np.float64)
        out = _scale(a, float(a.min()), float(a.max()))
    inverted = photometric == "MONOCHROME1"
    if inverted:
        out = 1.0 - out
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
        "view_position": str(ds.get("ViewPosition", "") or "").strip().upper(),
        "transfer_syntax": ts_name,
        "voi": voi,
        "voi_fallback": _one_line(fallback) if fallback else None,
        "inverted": inverted,
        "decoder_warnings": _one_line("; ".join(decoder_said)) if decoder_said else None,
    }
    return out.astype(np.float32, copy=False), meta


#: libjpeg messages (lower case) that mean part of the image is missing or garbage: the file is refused. Other
#: libjpeg warnings (e.g. "N extraneous bytes before marker 0xd9", common in real exports and harmless to the
#: pixels) are kept in ``meta["decoder_warnings"]``.
_FATAL_DECODER_MESSAGES = ("premature end", "bad huffman", "corrupt jpeg data: found marker", "huffman table")
#: Words (lower case) of the lines libjpeg / OpenJPEG / CharLS (inside GDCM or Pillow) write straight to the
#: C-level stderr while decoding; a captured line holding none of them is passed on to stderr unchanged.
_DECODER_MESSAGE_WORDS = ("jpeg", "huffman", "marker", "sof ", "bogus", "quantization", "j2k", "jp2", "codestream",
                          "tile", "premature end", "gdcm", "warning:", "error:")


_FD2_LOCK = threading.Lock()


class _decoder_messages:
    """Context manager: while decoding, what C libraries write to file descriptor 2 (libjpeg's "Corrupt JPEG data:
    ..." lines, which name no file) is captured; decoder messages are appended to ``into`` (one line each) and
    any other text written meanwhile (another thread's log line) is passed on to stderr unchanged. File descriptor
    2 is process-wide: a lock makes concurrent decodes in threads take turns, so that none restores another's
    redirection."""

    def __init__(self, into: list[str]):
        self.into = into

    def __enter__(self):
        import sys
        import tempfile

        _FD2_LOCK.acquire()
        self.tmp = None
        try:
            sys.stderr.flush()
            self.tmp = tempfile.TemporaryFile()
            self.saved = os.dup(2)
            os.dup2(self.tmp.fileno(), 2)
        except (OSError, ValueError, AttributeError):  # no usable fd 2 (embedded interpreter): do not capture
            if self.tmp is not None:
                self.tmp.close()
            self.tmp = None
        return self

    def __exit__(self, *exc):
        if self.tmp is None:
            _FD2_LOCK.release()
            return False
        try:
            os.dup2(self.saved, 2)
            os.close(self.saved)
        finally:
            _FD2_LOCK.release()
        self.tmp.seek(0)
        text = self.tmp.read().decode("utf-8", errors="replace")
        self.tmp.close()
        other = []
        for line in text.splitlines():
            if any(w in line.lower() for w in _DECODER_MESSAGE_WORDS):
                self.into.append(_one_line(line, 200))
            elif line.strip():
                other.append(line)
        if other:
            os.write(2, ("\n".join(other) + "\n").encode("utf-8", errors="replace"))
        return False


def _scale(a, lo: float, hi: float) -> np.ndarray:
    """``(a - lo) / (hi - lo)`` clipped to [0, 1]; zeros when ``hi <= lo`` (a constant image)."""
    a = np.asarray(a, dtype=np.float64)
    if hi <= lo:
        return np.zeros(a.shape, np.float32)
    return np.clip((a - lo) / (hi - lo), 0.0, 1.0)


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


class PatientSaltError(OSError):
    """The site-local patient salt file cannot be read or created (the message names the file and the way out)."""


#: Threads of one scan (:func:`chest_xray.dataset.scan_dataset`) may ask for the salt at the same moment.
_SALT_LOCK = threading.Lock()


def site_salt(salt: str | None = None) -> str:
    """The site-local salt for hashing DICOM patient IDs.

    Order: the ``salt`` argument, else ``$CXR_PATIENT_SALT``, else a random salt created once and kept in
    ``~/.config/cxr-hfl/patient_salt`` (``$XDG_CONFIG_HOME`` if set; mode 0600) so hashes are stable on this
    machine. The salt never leaves the site; ids hashed with different salts cannot be linked. Creating it is
    safe when threads or processes ask at once: the file appears with its content (written aside, then
    hard-linked), so every caller gets the same salt and none sees an empty file.

    Raises:
        PatientSaltError: the salt file cannot be read or created (e.g. a read-only home); the message names the
            file and says to set ``$CXR_PATIENT_SALT`` or ``$XDG_CONFIG_HOME``.
    """
    if salt:
        return salt
    env = os.environ.get(SALT_ENV)
    if env:
        return env
    f = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "cxr-hfl" / "patient_salt"
    with _SALT_LOCK:
        try:
            value = f.read_text().strip()
            if value:
                return value
        except FileNotFoundError:
            pass
        except OSError as e:
            raise PatientSaltError(f"cannot read the patient salt file {f} ({e.strerror or e}); set "
                                   f"${SALT_ENV} or $XDG_CONFIG_HOME") from None
        value = secrets.token_hex(16)
        tmp = f.with_name(f".patient_salt.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            f.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(value)
            try:
                os.link(tmp, f)  # atomic and exclusive: another process's salt, once there, wins
            except FileExistsError:
                existing = f.read_text().strip()
                if existing:
                    return existing
                os.replace(tmp, f)  # an empty file left by an interrupted older version: replaced
        except OSError as e:
            raise PatientSaltError(f"cannot create the patient salt file {f} ({e.strerror or e}); set "
                                   f"${SALT_ENV} or $XDG_CONFIG_HOME to a writable folder") from None
        finally:
            tmp.unlink(missing_ok=True)
        return value


def dicom_patient_id(path: str | os.PathLike, salt: str | None = None) -> str | None:
    """Salted hash of a DICOM file's PatientID, for grouping a patient's images inside one site.

    Args:
        path: a DICOM file.
        salt: site-local secret; see :func:`site_salt` for the fallbacks.

    Returns:
        ``"dcm-" + sha256(salt + PatientID)[:16]``, or None when the file has no PatientID. The raw PatientID is
        never returned or logged.

    Raises:
        ImageReadError: not a parseable DICOM file.
    """
    ds = _dcmread(Path(path), stop_before_pixels=True)
    pid = str(ds.get("PatientID", "") or "").strip()
    if not pid:
        return None
    digest = hashlib.sha256((site_salt(salt) + "\x00" + pid).encode("utf-8")).hexdigest()
    return "dcm-" + digest[:16]
