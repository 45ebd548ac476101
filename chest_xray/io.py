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
import warnings
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


class ImageReadError(Exception):
    """A file could not be read as a chest X-ray image.

    Attributes:
        path: the file, as given.
        reason: what went wrong, in words (never contains patient-identifying DICOM fields).
    """

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def _is_dicom(path: Path) -> bool:
    if path.suffix.lower() in DICOM_SUFFIXES:
        return True
    try:
        with open(path, "rb") as fh:
            head = fh.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:132] == b"DICM"


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
        columns, in the file's own orientation, i.e. never transposed); ``meta`` is a dict with technical fields
        only: ``format`` ("JPEG", "PNG", "DICOM", ...), ``original_height``/``original_width`` (pixels, from the
        header), ``height``/``width`` (decoded, smaller than the original only in draft mode), ``bit_depth``
        (bits per stored sample), ``mode`` (Pillow mode, or "DICOM"), ``photometric_interpretation``
        ("MONOCHROME1"/"MONOCHROME2" for DICOM, "MONOCHROME2" for grayscale Pillow modes, else the Pillow mode),
        ``draft`` (bool). DICOM adds ``modality``, ``view_position``, ``transfer_syntax``, ``voi`` ("lut",
        "window" or "none") and ``inverted``.

    Raises:
        ImageReadError: the file is missing, empty, not a supported image, truncated or corrupt, larger than
            ``max_pixels``, or a DICOM object that is multi-frame, colour, or has no pixel data. The message starts
            with the path.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise ImageReadError(p, f"cannot open file ({e.strerror or e})") from None
    if not p.is_file():
        raise ImageReadError(p, "not a regular file")
    if size == 0:
        raise ImageReadError(p, "empty file (0 bytes)")
    if _is_dicom(p):
        return _read_dicom(p, max_pixels)
    return _read_pil(p, target_size, max_pixels)


# ---------------------------------------------------------------------------------------------------------------
# Pillow (JPEG, PNG)

_GRAY_MODES = {"L": 8, "I;16": 16, "I;16L": 16, "I;16B": 16, "I;16N": 16, "I": 32, "F": 32, "1": 1, "LA": 8}


def _read_pil(p: Path, target_size: int | None, max_pixels: int) -> tuple[np.ndarray, dict[str, Any]]:
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # never let Pillow's bomb check degrade to a warning; our own guard below gives the clear error
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(p)
    except Image.DecompressionBombError as e:
        raise ImageReadError(p, f"image too large (decompression-bomb guard): {e}") from None
    except Image.DecompressionBombWarning as e:
        raise ImageReadError(p, f"image too large (decompression-bomb guard): {e}") from None
    except UnidentifiedImageError:
        raise ImageReadError(p, "not a recognised image format (JPEG, PNG or DICOM expected)") from None
    except OSError as e:
        raise ImageReadError(p, f"cannot open image: {e}") from None
    with img:
        fmt = img.format or "UNKNOWN"
        width, height = img.size
        mode0 = img.mode
        if width <= 0 or height <= 0:
            raise ImageReadError(p, f"invalid dimensions {width}x{height}")
        if width * height > max_pixels:
            raise ImageReadError(
                p,
                f"image too large: {width}x{height} = {width * height:,} pixels exceeds the limit of "
                f"{max_pixels:,} (decompression-bomb guard)",
            )
        if getattr(img, "n_frames", 1) > 1:
            raise ImageReadError(p, f"multi-frame image ({img.n_frames} frames) is not a single radiograph")
        draft = False
        if fmt == "JPEG" and target_size and max(width, height) >= 2 * int(target_size):
            scale = int(target_size) / max(width, height)
            req = (max(1, int(np.ceil(width * scale))), max(1, int(np.ceil(height * scale))))
            res = img.draft("L" if mode0 in ("L", "RGB") else mode0, req)
            draft = res is not None and img.size != (width, height)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img.load()
            arr, bit_depth = _pil_to_gray(img)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning) as e:
            raise ImageReadError(p, f"corrupt or truncated {fmt} data: {e}") from None
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


def _dcmread(p: Path, stop_before_pixels: bool = False):
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        return pydicom.dcmread(p, stop_before_pixels=stop_before_pixels)
    except InvalidDicomError:
        raise ImageReadError(p, "not a valid DICOM file") from None
    except Exception as e:  # pydicom raises a wide range of errors on truncated files
        raise ImageReadError(p, f"cannot parse DICOM file ({type(e).__name__})") from None


def dicom_header(path: str | os.PathLike) -> dict[str, Any]:
    """Technical header fields of a DICOM file, read without decoding pixels.

    Returns:
        dict with ``modality`` (str, "" if absent), ``view_position`` (str), ``rows``, ``columns`` (int, 0 if
        absent). No patient-identifying field is included.

    Raises:
        ImageReadError: not a parseable DICOM file.
    """
    p = Path(path)
    ds = _dcmread(p, stop_before_pixels=True)
    return {
        "modality": str(ds.get("Modality", "") or "").upper(),
        "view_position": str(ds.get("ViewPosition", "") or "").upper(),
        "rows": int(ds.get("Rows", 0) or 0),
        "columns": int(ds.get("Columns", 0) or 0),
    }


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


def _read_dicom(p: Path, max_pixels: int) -> tuple[np.ndarray, dict[str, Any]]:
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    ds = _dcmread(p)
    if not _has_pixel_tag(ds):
        sop = str(ds.get("SOPClassUID", "")) and getattr(ds.SOPClassUID, "name", str(ds.SOPClassUID))
        raise ImageReadError(p, f"DICOM object has no pixel data (not an image; SOP class {sop or 'unknown'})")
    n_frames = int(ds.get("NumberOfFrames", 1) or 1)
    if n_frames > 1:
        raise ImageReadError(p, f"multi-frame DICOM ({n_frames} frames) is not a single radiograph")
    rows, cols = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
    if rows <= 0 or cols <= 0:
        raise ImageReadError(p, f"invalid DICOM dimensions {rows}x{cols}")
    if rows * cols > max_pixels:
        raise ImageReadError(
            p,
            f"image too large: {cols}x{rows} = {rows * cols:,} pixels exceeds the limit of {max_pixels:,} "
            "(decompression-bomb guard)",
        )
    photometric = str(ds.get("PhotometricInterpretation", "") or "").upper()
    if int(ds.get("SamplesPerPixel", 1) or 1) != 1 or photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise ImageReadError(p, f"colour DICOM ({photometric or 'unknown photometric'}) is not a radiograph")
    tsyntax = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    try:
        raw = ds.pixel_array
    except Exception as e:
        raise ImageReadError(
            p, f"cannot decode DICOM pixel data ({getattr(tsyntax, 'name', tsyntax)}): {type(e).__name__}: {e}"
        ) from None
    if raw.ndim != 2:
        raise ImageReadError(p, f"unexpected DICOM pixel array shape {raw.shape}")
    # DICOM grayscale pipeline, in the standard's order: modality LUT -> VOI LUT / window -> presentation
    arr = apply_modality_lut(raw, ds)
    voi = "none"
    if ds.get("VOILUTSequence"):
        voi = "lut"
    elif ds.get("WindowCenter") is not None and ds.get("WindowWidth") is not None:
        voi = "window"
    if voi == "lut":
        arr = apply_voi_lut(arr, ds)
        bits = int(ds.VOILUTSequence[0].LUTDescriptor[2])
        lo, hi = 0.0, float(2**bits - 1)
    elif voi == "window":
        arr = apply_voi_lut(arr, ds, prefer_lut=False)
        lo, hi = _window_output_range(ds)
    else:
        arr = np.asarray(arr, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
    arr = np.asarray(arr, dtype=np.float64)
    out = np.zeros(arr.shape, np.float32) if hi <= lo else np.clip((arr - lo) / (hi - lo), 0.0, 1.0)
    inverted = photometric == "MONOCHROME1"
    if inverted:
        out = 1.0 - out
    meta = {
        "format": "DICOM",
        "original_height": rows,
        "original_width": cols,
        "height": int(out.shape[0]),
        "width": int(out.shape[1]),
        "bit_depth": int(ds.get("BitsStored", raw.dtype.itemsize * 8)),
        "mode": "DICOM",
        "photometric_interpretation": photometric,
        "draft": False,
        "modality": str(ds.get("Modality", "") or "").upper(),
        "view_position": str(ds.get("ViewPosition", "") or "").upper(),
        "transfer_syntax": getattr(tsyntax, "name", str(tsyntax) if tsyntax else ""),
        "voi": voi,
        "inverted": inverted,
    }
    return out.astype(np.float32, copy=False), meta


def _window_output_range(ds) -> tuple[float, float]:
    """Output range [y_min, y_max] of pydicom's ``apply_windowing`` for this dataset (PS3.3 C.11.2.1.2)."""
    if ds.get("ModalityLUTSequence"):
        return 0.0, float(2 ** int(ds.ModalityLUTSequence[0].LUTDescriptor[2]) - 1)
    bits = int(ds.BitsStored)
    if int(ds.get("PixelRepresentation", 0)) == 0:
        y_min, y_max = 0.0, float(2**bits - 1)
    else:
        y_min, y_max = float(-(2 ** (bits - 1))), float(2 ** (bits - 1) - 1)
    slope, intercept = ds.get("RescaleSlope"), ds.get("RescaleIntercept")
    if slope is not None and intercept is not None:
        y_min, y_max = y_min * float(slope) + float(intercept), y_max * float(slope) + float(intercept)
    return min(y_min, y_max), max(y_min, y_max)


def site_salt(salt: str | None = None) -> str:
    """The site-local salt for hashing DICOM PatientIDs.

    Order: the ``salt`` argument, else ``$CXR_PATIENT_SALT``, else a random salt created once and kept in
    ``~/.config/cxr-hfl/patient_salt`` (mode 0600) so hashes are stable on this machine. The salt never leaves
    the site; ids hashed with different salts cannot be linked.
    """
    if salt:
        return salt
    env = os.environ.get(SALT_ENV)
    if env:
        return env
    f = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "cxr-hfl" / "patient_salt"
    try:
        return f.read_text().strip()
    except OSError:
        pass
    f.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(16)
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value)
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
