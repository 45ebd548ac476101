"""Generator of the second-pass ingestion kinds, built at test time from the shared real images.

Every function writes into a folder the test owns (``tmp_path``) and returns what it wrote; nothing is committed.
Sources: the Kermany JPEGs of ``chest_xray_224`` / ``chest_xray_original`` and the field case
``jpeg_lossless_sv1_reference_native.dcm`` (CR PA, 12-bit MONOCHROME2, 489 x 461, no VOI window). Every patient
field written is synthetic.
"""
from __future__ import annotations

import shutil
import unicodedata
import warnings
from pathlib import Path

import numpy as np
import pytest

NATIVE = "jpeg_lossless_sv1_reference_native.dcm"


def native_dicom(cases: Path) -> Path:
    f = cases / NATIVE
    if not f.is_file():
        pytest.skip(f"field case not found: {f}")
    return f


# ------------------------------------------------------------------------------------------------ plain JPEGs
def truncated_jpeg(src: Path, dest: Path, keep: float = 0.6) -> Path:
    """An interrupted copy: the first ``keep`` of the file, then an EOI marker appended (so the file 'ends')."""
    data = src.read_bytes()
    dest.write_bytes(data[: int(len(data) * keep)] + b"\xff\xd9")
    return dest


def bit_flipped_jpeg(src: Path, dest: Path, n: int = 3, seed: int = 0) -> Path:
    """``n`` bits flipped inside the entropy-coded data (after the start-of-scan header), at seeded positions."""
    data = bytearray(src.read_bytes())
    sos = data.find(b"\xff\xda")
    start = sos + 4 + int.from_bytes(data[sos + 2: sos + 4], "big")
    rng = np.random.default_rng(seed)
    for pos in rng.integers(start + 64, len(data) - 64, n):
        if data[pos] in (0xFF, 0x00) or data[pos - 1] == 0xFF:
            pos += 2  # never make or break a marker: only entropy bits
        data[pos] ^= 1 << int(rng.integers(8))
    dest.write_bytes(bytes(data))
    return dest


def reencoded_jpeg(src: Path, dest: Path, quality: int = 50, scale: float = 1.0) -> Path:
    """The same radiograph re-exported: decoded and encoded again (other bytes, near-identical pixels)."""
    from PIL import Image

    with Image.open(src) as im:
        g = im.convert("L")
        if scale != 1.0:
            g = g.resize((round(g.width * scale), round(g.height * scale)), Image.Resampling.LANCZOS)
        g.save(dest, "JPEG", quality=quality)
    return dest


def nfd_name(name: str) -> str:
    return unicodedata.normalize("NFD", name)


# ------------------------------------------------------------------------------------------------ DICOM kinds
def _load(src: Path):
    import pydicom

    return pydicom.dcmread(src)


def _save(ds, dest: Path, **attrs) -> Path:
    for k, v in attrs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            setattr(ds, k, v)
    ds.save_as(dest)
    return dest


def dicom_from_jpeg(template: Path, jpeg: Path, dest: Path, **attrs) -> Path:
    """A 12-bit CR DICOM (the native case's header) holding a Kermany JPEG's pixels (8-bit values x 16)."""
    from PIL import Image

    ds = _load(template)
    with Image.open(jpeg) as im:
        a = (np.asarray(im.convert("L"), dtype=np.uint16) * 16).astype(np.uint16)
    ds.Rows, ds.Columns = a.shape
    ds.PixelData = a.tobytes()
    return _save(ds, dest, **attrs)


def voi_lut_16_bit_descriptor(src: Path, dest: Path) -> tuple[Path, np.ndarray]:
    """The native case with a VOI LUT whose descriptor says 16 bits while its data are 12-bit (a square-root
    curve over 0..4095, as an Agfa CR writes). Returns the file and the LUT data."""
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    ds = _load(src)
    lut = np.round(np.sqrt(np.arange(4096) / 4095.0) * 4095).astype(np.uint16)
    item = Dataset()
    item.LUTDescriptor = [4096, 0, 16]
    item.LUTData = lut.tolist()
    item["LUTData"].VR = "US"
    ds.VOILUTSequence = Sequence([item])
    return _save(ds, dest), lut


def voi_lut(src: Path, dest: Path, descriptor: list[int], vr: str = "US") -> tuple[Path, np.ndarray]:
    """The native case with a VOI LUT of the given descriptor (entries: the square-root curve over 0..4095,
    padded with 4095 or cut to the descriptor's count) written as US values or OW words."""
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    ds = _load(src)
    n = descriptor[0] or 65536
    curve = np.round(np.sqrt(np.arange(4096) / 4095.0) * 4095).astype(np.uint16)
    data = np.concatenate([curve, np.full(max(0, n - 4096), 4095, np.uint16)])[:n]
    item = Dataset()
    item.LUTDescriptor = list(descriptor)
    item.LUTData = data.tobytes() if vr == "OW" else data.tolist()
    item["LUTData"].VR = vr
    ds.VOILUTSequence = Sequence([item])
    return _save(ds, dest), data


def presentation_inverse(src: Path, dest: Path, photometric: str = "MONOCHROME2") -> Path:
    return _save(_load(src), dest, PresentationLUTShape="INVERSE", PhotometricInterpretation=photometric)


def padded(src: Path, dest: Path, border: int = 24, value: int = 0) -> Path:
    """The native case with a collimator border of ``border`` pixels set to ``value`` and declared as the Pixel
    Padding Value (as DX detectors write the area outside the exposed field)."""
    ds = _load(src)
    a = ds.pixel_array.copy()
    a[:border], a[-border:], a[:, :border], a[:, -border:] = value, value, value, value
    ds.PixelData = a.tobytes()
    ds.PixelPaddingValue = value
    ds["PixelPaddingValue"].VR = "US"  # unsigned data (Pixel Representation 0)
    return _save(ds, dest)


def jpeg_extended_12_bit(src: Path, dest: Path, quality: int = 95) -> Path:
    """The native 12-bit case lossy-compressed as JPEG Extended (Process 2 & 4) by GDCM's encoder."""
    import gdcm

    r = gdcm.ImageReader()
    r.SetFileName(str(src))
    assert r.Read(), src
    change = gdcm.ImageChangeTransferSyntax()
    change.SetTransferSyntax(gdcm.TransferSyntax(gdcm.TransferSyntax.JPEGExtendedProcess2_4))
    change.SetInput(r.GetImage())
    codec = gdcm.JPEGCodec()
    codec.SetLossless(False)
    codec.SetQuality(quality)
    change.SetUserCodec(codec)
    assert change.Change()
    w = gdcm.ImageWriter()
    w.SetFileName(str(dest))
    w.SetFile(r.GetFile())
    w.SetImage(change.GetOutput())
    assert w.Write()
    return dest


def htj2k(src: Path, dest: Path) -> Path:
    """The native case as a lossless JPEG 2000 code-stream under the HTJ2K Lossless transfer syntax (Part 15
    decoders read Part 1 code-streams; no HT encoder is installed)."""
    import openjpeg
    from pydicom.encaps import encapsulate
    from pydicom.uid import HTJ2KLossless

    ds = _load(src)
    stream = openjpeg.encode(ds.pixel_array, bits_stored=int(ds.BitsStored), photometric_interpretation=2,
                             use_mct=False, codec_format=0)
    ds.PixelData = encapsulate([stream])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = HTJ2KLossless
    ds.save_as(dest, enforce_file_format=True)
    return dest


def dicomdir(src: Path, folder: Path) -> Path:
    """A DICOMDIR (directory index) written by pydicom's File-set writer for one copy of ``src``; returns the
    DICOMDIR file (the indexed copy is removed, as exports that are copied class by class lose it)."""
    from pydicom.fileset import FileSet

    work = folder / "_fileset"
    fs = FileSet()
    ds = _load(src)
    for k, v in (("StudyDate", "20260101"), ("StudyTime", "120000"), ("StudyID", "1"), ("SeriesNumber", 1),
                 ("InstanceNumber", 1), ("PatientName", "SYNTHETIC^DICOMDIR")):
        if k not in ds:
            setattr(ds, k, v)
    fs.add(ds)
    fs.write(work)
    out = folder / "DICOMDIR"
    shutil.copy(work / "DICOMDIR", out)
    shutil.rmtree(work)
    return out


# ------------------------------------------------------------------------------------------- every kind at once
NFD_NAME = nfd_name("Röntgen_Thorax_Säugling.jpeg")  # as macOS writes it (decomposed umlauts)


def every_kind(root: Path, cases: Path, data_root: Path) -> dict[str, str]:
    """A class-folder export holding every second-pass kind, plus ``root/manifest.csv`` listing the kept and
    skipped images with NFC-typed names. Returns file name -> what a scan must do: ``"kept"`` or a skip kind."""
    nat = native_dicom(cases)
    small = data_root / "chest_xray_224" / "train"
    n_jpegs = sorted((small / "NORMAL").glob("*.jpeg"))
    p_jpegs = sorted((small / "PNEUMONIA").glob("*.jpeg"))
    if len(n_jpegs) < 12 or len(p_jpegs) < 12:
        pytest.skip(f"real images not found in {small}")
    big = sorted((data_root / "chest_xray_original" / "train" / "NORMAL").glob("*.jpeg"))[:1]
    if not big:
        pytest.skip("chest_xray_original not found")
    n, p = root / "NORMAL", root / "PNEUMONIA"
    n.mkdir(parents=True)
    p.mkdir(parents=True)
    want: dict[str, str] = {}
    for f in n_jpegs[:4]:
        shutil.copy(f, n / f.name)
        want[f.name] = "kept"
    for f in p_jpegs[:4]:
        shutil.copy(f, p / f.name)
        want[f.name] = "kept"
    truncated_jpeg(big[0], n / "interrupted_copy.jpeg")
    bit_flipped_jpeg(big[0], p / "flipped_bits.jpeg", seed=0)
    want.update({"interrupted_copy.jpeg": "corrupt or truncated", "flipped_bits.jpeg": "corrupt or truncated"})
    shutil.copy(n_jpegs[4], n / n_jpegs[4].name)  # the same bytes under both classes
    shutil.copy(n_jpegs[4], p / "same_bytes_other_class.jpeg")
    want.update({n_jpegs[4].name: "contradictory labels", "same_bytes_other_class.jpeg": "contradictory labels"})
    shutil.copy(n_jpegs[5], n / n_jpegs[5].name)  # a re-export under a new accession number: same bytes
    shutil.copy(n_jpegs[5], n / "IM-9999-0001-reexport.jpeg")
    want.update({n_jpegs[5].name: "kept", "IM-9999-0001-reexport.jpeg": "kept"})
    for k, src in enumerate(n_jpegs[6:9] + p_jpegs[6:9]):  # an anonymiser's constant PatientID
        cls = n if k < 3 else p
        dicom_from_jpeg(nat, src, cls / f"anon_{k}.dcm", PatientID="ANONYMOUS", StudyInstanceUID=f"1.2.3.{k}")
        want[f"anon_{k}.dcm"] = "kept"
    voi_lut_16_bit_descriptor(nat, p / "agfa_voi_lut.dcm")
    presentation_inverse(nat, n / "mono2_inverse.dcm")
    padded(nat, n / "collimator_padding.dcm")
    jpeg_extended_12_bit(nat, p / "jpeg_extended_12bit.dcm")
    htj2k(nat, n / "htj2k.dcm")
    dicomdir(nat, p)
    want.update({"agfa_voi_lut.dcm": "kept", "mono2_inverse.dcm": "kept", "collimator_padding.dcm": "kept", "jpeg_extended_12bit.dcm": "kept",
                 "htj2k.dcm": "kept", "DICOMDIR": "directory index"})
    shutil.copy(n_jpegs[9], n / NFD_NAME)
    want[NFD_NAME] = "kept"
    rows = ["path,label"] + [f"{d.name}/{unicodedata.normalize('NFC', f.name)},{d.name}"
                             for d in (n, p) for f in sorted(d.iterdir()) if f.name != "DICOMDIR"]
    (root / "manifest.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return want
