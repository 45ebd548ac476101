"""What a DICOM object's Pixel Data bytes are, whatever its Transfer Syntax says, and what its compressed stream
holds, whatever its image attributes say.

Two kinds of export get these wrong, and viewers read the files anyway:

- **A Transfer Syntax that does not describe the Pixel Data** (PS3.5 A.4: encapsulated data begin with an Item tag
  (FFFE,E000); a JPEG stream with its SOI marker FFD8; native data hold exactly Rows x Columns x Samples x
  Bits Allocated / 8 bytes). A native syntax over encapsulated data, a compressed syntax over a bare (not
  encapsulated) stream or over native pixels, or a JPEG Lossless syntax over a baseline stream: the bytes are
  recognised and decoded as what they are (:func:`reconcile_syntax`), with a note naming the mismatch; bytes that
  are none of these are left to the decoder, which refuses them as today (truncated or corrupt).
- **A grey-scale header over a 3-component stream** (Samples per Pixel 1, MONOCHROME2, while the JPEG frame header
  says 3 components; PS3.5 8.2.1 makes the stream's component count agree with Samples per Pixel): decoding it as
  one component scrambles the pixels. The stream governs (:func:`stream_components`): it is decoded as colour and
  read as its luma (ITU-R BT.601, the Y of YCbCr, which for a grey picture saved as colour is the picture).
"""
from __future__ import annotations

import numpy as np

#: The Item tag (FFFE,E000) as little-endian bytes: the first four bytes of encapsulated Pixel Data.
ITEM_TAG = b"\xfe\xff\x00\xe0"
JPEG_SOI = b"\xff\xd8"
J2K_SOC_SIZ = b"\xff\x4f\xff\x51"
JP2_SIGNATURE = b"\x00\x00\x00\x0cjP  \r\n\x87\n"

#: Transfer syntaxes that read the same kind of stream (a DCT stream of 8 bits is valid JPEG Extended; both JPEG
#: Lossless syntaxes read any first-order predictor; JPEG-LS and JPEG 2000 decoders read their whole family).
_FAMILIES = (
    {"1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.51"},
    {"1.2.840.10008.1.2.4.57", "1.2.840.10008.1.2.4.70"},
    {"1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.4.81"},
    {"1.2.840.10008.1.2.4.90", "1.2.840.10008.1.2.4.91", "1.2.840.10008.1.2.4.92", "1.2.840.10008.1.2.4.93",
     "1.2.840.10008.1.2.4.201", "1.2.840.10008.1.2.4.202", "1.2.840.10008.1.2.4.203"},
    {"1.2.840.10008.1.2.5"},
)
_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xF7}


class PixelBytesError(ValueError):
    """The Pixel Data hold something no installed decoder reads under any transfer syntax (one line, the
    mismatch named)."""


def _jpeg_info(stream: bytes) -> dict | None:
    """``{"sof", "precision", "rows", "columns", "components", "ss"}`` from a JPEG stream's frame and first scan
    header (``ss``: the scan's Ss, the lossless predictor or the JPEG-LS NEAR value), or None when ``stream`` is
    not a JPEG stream or its headers are cut short."""
    if not stream.startswith(JPEG_SOI):
        return None
    info: dict = {}
    i, n = 2, len(stream)
    while i + 4 <= n:
        if stream[i] != 0xFF:
            return info or None
        m = stream[i + 1]
        if m == 0xFF:  # fill byte
            i += 1
            continue
        if m in (0x01,) or 0xD0 <= m <= 0xD7:
            i += 2
            continue
        length = int.from_bytes(stream[i + 2: i + 4], "big")
        seg = stream[i + 4: i + 2 + length]
        if m in _SOF_MARKERS and len(seg) >= 6:
            info.update(sof=m, precision=seg[0], rows=int.from_bytes(seg[1:3], "big"),
                        columns=int.from_bytes(seg[3:5], "big"), components=seg[5])
        elif m == 0xDA:  # start of scan: Ns, Ns x (Cs, Td/Ta), Ss, Se, Ah/Al
            ns = seg[0] if seg else 0
            if len(seg) > 1 + 2 * ns:
                info["ss"] = seg[1 + 2 * ns]
            return info or None
        i += 2 + length
    return info or None


def stream_syntax(stream: bytes) -> tuple[str | None, str, int | None]:
    """What a compressed frame is: ``(transfer syntax UID that reads it or None, description, components or
    None)``.

    JPEG is told by its frame marker (SOF0 8-bit: Baseline; SOF0 12-bit / SOF1: Extended; SOF3: Lossless, SV1 when
    the predictor is 1; SOF55: JPEG-LS, near-lossless when NEAR > 0); JPEG 2000 by its SOC/SIZ markers or JP2
    signature; RLE by its 64-byte segment header (PS3.5 G.3.1). A progressive or hierarchical JPEG has no
    transfer syntax here (UID None).
    """
    info = _jpeg_info(stream)
    if info and "sof" in info:
        sof, comps = info["sof"], info.get("components")
        if sof == 0xC0:
            uid = "1.2.840.10008.1.2.4.50" if info["precision"] <= 8 else "1.2.840.10008.1.2.4.51"
            return uid, f"a {info['precision']}-bit DCT JPEG stream (SOF0)", comps
        if sof == 0xC1:
            return "1.2.840.10008.1.2.4.51", f"a {info['precision']}-bit DCT JPEG stream (SOF1)", comps
        if sof == 0xC3:
            uid = "1.2.840.10008.1.2.4.70" if info.get("ss") == 1 else "1.2.840.10008.1.2.4.57"
            return uid, f"a {info['precision']}-bit lossless JPEG stream (SOF3)", comps
        if sof == 0xF7:
            uid = "1.2.840.10008.1.2.4.80" if not info.get("ss") else "1.2.840.10008.1.2.4.81"
            return uid, "a JPEG-LS stream (SOF55)", comps
        return None, f"a progressive or hierarchical JPEG stream (SOF{sof - 0xC0})", comps
    if stream.startswith(JPEG_SOI):
        return None, "a JPEG stream without a readable frame header", None
    if stream.startswith(J2K_SOC_SIZ):
        comps = int.from_bytes(stream[40:42], "big") if len(stream) >= 42 else None
        return "1.2.840.10008.1.2.4.91", "a JPEG 2000 code-stream", comps
    if stream.startswith(JP2_SIGNATURE):
        return "1.2.840.10008.1.2.4.91", "a JP2 (JPEG 2000) file", None
    if len(stream) >= 64:
        offsets = np.frombuffer(stream[:64], "<u4")
        k = int(offsets[0])
        if 1 <= k <= 15 and offsets[1] == 64 and not offsets[k + 1:].any() and np.all(np.diff(offsets[1:k + 1]) > 0):
            return "1.2.840.10008.1.2.5", "an RLE stream", None
    return None, "bytes of no known compressed format", None


def _same_family(a: str, b: str) -> bool:
    return a == b or any(a in f and b in f for f in _FAMILIES)


def _first_frame(data: bytes) -> bytes:
    from pydicom.encaps import generate_frames

    return next(generate_frames(data, number_of_frames=1))


def native_length(ds, rows: int, cols: int) -> int:
    """Bytes of one native frame: Rows x Columns x Samples per Pixel x ceil(Bits Allocated / 8)."""
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    return rows * cols * samples * -(-int(ds.get("BitsAllocated", 16) or 16) // 8)


def pixel_bytes_kind(data: bytes, rows: int, cols: int, expected: int) -> str:
    """``"encapsulated"`` (an Item tag first), ``"stream"`` (a bare JPEG / JPEG 2000 stream whose header fits Rows x
    Columns, or any such stream that is not exactly the native length), ``"native"`` (exactly ``expected`` bytes,
    or one more: the even-length pad) or ``"unknown"``."""
    if data[:4] == ITEM_TAG:
        return "encapsulated"
    info = _jpeg_info(data[:65536])
    if info and (info.get("rows"), info.get("columns")) == (rows, cols):
        return "stream"
    if len(data) in (expected, expected + 1):
        return "native"
    if data.startswith((JPEG_SOI, J2K_SOC_SIZ, JP2_SIGNATURE)):
        return "stream"
    return "unknown"


def reconcile_syntax(ds, rows: int, cols: int) -> str | None:
    """Make the data set's Transfer Syntax UID (in memory) describe its Pixel Data, by the rule in the module
    docstring; ``ds.PixelData`` is encapsulated when it held a bare stream.

    Returns:
        a one-line note naming the mismatch and what the bytes were decoded as, or None when the syntax already
        describes the bytes (or the bytes are of no recognisable kind: the decoder then names the problem).

    Raises:
        PixelBytesError: the bytes are a compressed stream that no transfer syntax here reads (a progressive JPEG
            under a native syntax, say); the message names the syntax and what the bytes are.
    """
    from pydicom.uid import UID, ExplicitVRLittleEndian

    if "PixelData" not in ds or not hasattr(ds, "file_meta") or not ds.file_meta.get("TransferSyntaxUID"):
        return None
    ts = UID(str(ds.file_meta.TransferSyntaxUID))
    if ts == "1.2.840.10008.1.2.1.99":  # deflated data set: the pixel bytes are native once inflated
        return None
    data = ds.PixelData
    kind = pixel_bytes_kind(data, rows, cols, native_length(ds, rows, cols))
    said = f"Transfer Syntax {ts.name} ({ts}) does not describe the Pixel Data"
    if kind == "native" and ts.is_compressed:
        if not ts.is_little_endian or ts.is_implicit_VR:
            return None
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        return f"{said}: they are native (uncompressed) pixels of exactly Rows x Columns; decoded as such"
    if kind not in ("encapsulated", "stream"):
        return None
    try:
        frame = _first_frame(data) if kind == "encapsulated" else data
    except Exception:  # noqa: BLE001 -- broken encapsulation: the decoder names it, as for any such file
        return None
    uid, what, _ = stream_syntax(frame[:65536] if kind == "stream" else frame)
    if ts.is_compressed and kind == "encapsulated" and (uid is None or _same_family(str(ts), uid)):
        return None  # as declared (or of no kind we could name better: the declared decoder reports)
    where = "encapsulated" if kind == "encapsulated" else "a bare (not encapsulated) stream"
    if uid is None:
        raise PixelBytesError(f"{said}: they are {where}, {what}, which no installed decoder reads")
    if kind == "stream":
        from pydicom.encaps import encapsulate

        ds.PixelData = encapsulate([data])
        ds["PixelData"].VR = "OB"
        ds["PixelData"].is_undefined_length = True
    ds.file_meta.TransferSyntaxUID = UID(uid)
    return f"{said}: they are {where}, {what}; decoded as {UID(uid).name}"


def stream_components(ds) -> int | None:
    """Components of the first compressed frame as its own header says (JPEG SOF Nf, JPEG 2000 Csiz), or None
    (native data, RLE, or a header that cannot be read)."""
    ts = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    if not ts or not getattr(ts, "is_compressed", False) or "PixelData" not in ds:
        return None
    try:
        frame = _first_frame(ds.PixelData)
    except Exception:  # noqa: BLE001 -- the decoder names broken encapsulation
        return None
    return stream_syntax(frame[:65536])[2]


def luma(rgb: np.ndarray) -> np.ndarray:
    """Luma Y (ITU-R BT.601: 0.299 R + 0.587 G + 0.114 B) of an RGB array (rows, cols, 3), rounded, in the input's
    integer type: pydicom's RGB -> YBR_FULL conversion for 8-bit samples, the same weights by hand above 8 bits."""
    from pydicom.pixels import convert_color_space

    if rgb.dtype == np.uint8:
        return convert_color_space(rgb, "RGB", "YBR_FULL")[..., 0]
    y = np.rint(np.asarray(rgb, np.float64) @ np.array([0.299, 0.587, 0.114]))
    info = np.iinfo(rgb.dtype)
    return np.clip(y, info.min, info.max).astype(rgb.dtype)


def decode_as_colour(ds) -> np.ndarray:
    """Stored values (rows, cols) of a single-frame data set whose header says one sample per pixel while its
    stream holds three: decoded by pydicom as 3 samples (YBR_FULL_422 for a DCT stream, RGB otherwise; pydicom
    converts to RGB and follows the stream's own colour markers) and read as luma (:func:`luma`). The three
    attributes are set for the decode only; ``ds`` leaves as it came."""
    from pydicom.pixels import pixel_array

    dct = str(ds.file_meta.TransferSyntaxUID) in ("1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.51")
    keys = ("SamplesPerPixel", "PlanarConfiguration", "PhotometricInterpretation")
    saved = {k: ds[k].value if k in ds else None for k in keys}
    try:
        ds.SamplesPerPixel, ds.PlanarConfiguration = 3, 0
        ds.PhotometricInterpretation = "YBR_FULL_422" if dct else "RGB"
        rgb = pixel_array(ds)
    finally:
        for k, v in saved.items():
            if v is None:
                del ds[k]
            else:
                setattr(ds, k, v)
    if rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise PixelBytesError(f"the 3-component stream decoded to shape {tuple(rgb.shape)}")
    return luma(rgb)
