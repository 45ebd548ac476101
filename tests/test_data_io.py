"""read_image: real DICOM files, Pillow modes, JPEG draft mode, bad inputs."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from chest_xray import ImageReadError, dicom_patient_id, read_image
from chest_xray.io import dicom_header, dicom_skip_reason

MONO2 = "1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819.dcm"


@pytest.fixture(scope="module")
def dicom_dir(data_root):
    d = data_root / "dicom"
    if not (d / "RG1_UNCR.dcm").is_file():
        pytest.skip(f"DICOM test files not found in {d}")
    return d


# --------------------------------------------------------------------------------------------- real DICOM files


def test_monochrome1_reads_as_inverse_of_monochrome2(dicom_dir):
    import pydicom

    inv, meta1 = read_image(dicom_dir / "Fake_MONOHR1.dcm")
    ref, meta2 = read_image(dicom_dir / MONO2)
    assert inv.shape == ref.shape == (1024, 1024)
    assert inv.dtype == np.float32 and 0.0 <= inv.min() and inv.max() <= 1.0
    assert meta1["photometric_interpretation"] == "MONOCHROME1" and meta1["inverted"]
    assert meta2["photometric_interpretation"] == "MONOCHROME2" and not meta2["inverted"]
    assert meta2["transfer_syntax"].startswith("JPEG Baseline")  # decoded through Pillow's handler
    raw1 = pydicom.dcmread(dicom_dir / "Fake_MONOHR1.dcm").pixel_array.astype(float).ravel()
    raw2 = pydicom.dcmread(dicom_dir / MONO2).pixel_array.astype(float).ravel()
    assert np.corrcoef(raw1, raw2)[0, 1] > 0.99
    assert np.corrcoef(inv.ravel(), ref.ravel())[0, 1] < -0.99


def test_rg1_monochrome1_window_orientation_and_anatomy(dicom_dir):
    img, meta = read_image(dicom_dir / "RG1_UNCR.dcm")
    assert img.shape == (1955, 1841)  # portrait: rows x columns, not transposed
    assert meta["original_height"] == 1955 and meta["original_width"] == 1841
    assert meta["bit_depth"] == 15 and meta["voi"] == "window" and meta["inverted"]
    # 15-bit precision kept: far more than 256 distinct levels
    assert np.unique(img[::4, ::4]).size > 1000
    right_lung = img[586:687, 552:653].mean()
    left_lung = img[782:883, 1289:1390].mean()
    mediastinum = img[782:883, 920:1021].mean()
    assert right_lung <= mediastinum - 0.3, (right_lung, mediastinum)
    assert left_lung <= mediastinum - 0.3, (left_lung, mediastinum)


def test_dicom_meta_and_patient_id_carry_no_patient_fields(dicom_dir):
    import pydicom

    for f in sorted(dicom_dir.glob("*.dcm")):
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        secrets_ = [str(ds.get(k, "")) for k in ("PatientName", "PatientID", "PatientBirthDate", "StudyDate")]
        secrets_ = [s for s in secrets_ if len(s) >= 3]
        _, meta = read_image(f)
        text = repr(meta) + repr(dicom_header(f))
        pid = dicom_patient_id(f, salt="site-secret")
        for s in secrets_:
            assert s not in text and (pid is None or s not in pid)
        assert set(meta) <= {"format", "original_height", "original_width", "height", "width", "bit_depth", "mode",
                             "photometric_interpretation", "draft", "modality", "view_position",
                             "transfer_syntax", "voi", "voi_fallback", "inverted", "decoder_warnings",
                             "grayscale_notes", "view_code", "presentation_intent", "other_body_part"}
        if pid is not None:
            assert pid.startswith("dcm-")
            assert dicom_patient_id(f, salt="site-secret") == pid
            assert dicom_patient_id(f, salt="other-site") != pid


def test_dicom_skip_reasons():
    assert dicom_skip_reason({"modality": "CR", "view_position": "PA"}) is None
    assert dicom_skip_reason({"modality": "DX", "view_position": "AP"}) is None
    assert "modality CT" in dicom_skip_reason({"modality": "CT", "view_position": ""})
    assert "lateral" in dicom_skip_reason({"modality": "DX", "view_position": "LL"})
    assert dicom_skip_reason({"modality": "DX", "view_position": "LL"}, allow_lateral=True) is None
    assert dicom_skip_reason({"modality": "MR", "view_position": ""}, allow_any_modality=True) is None


# --------------------------------------------------------------------------------------------- synthetic DICOM


def write_dicom(path, rows=8, cols=8, pixels=True, photometric="MONOCHROME2", modality="DX", frames=None, **extra):
    """A minimal uncompressed DICOM file (16-bit unsigned)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1.1"  # Digital X-Ray Image Storage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = modality
    ds.PatientName = "Doe^Jane"
    ds.PatientID = "SECRET-12345"
    ds.Rows, ds.Columns = rows, cols
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    if frames:
        ds.NumberOfFrames = frames
    for k, v in extra.items():
        setattr(ds, k, v)
    if pixels:
        n = rows * cols * (frames or 1)
        arr = (np.arange(n) % 4096).astype(np.uint16)
        ds.PixelData = arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def test_synthetic_dicom_modality_lut_window_and_12bit(tmp_path):
    f = write_dicom(tmp_path / "a.dcm", rows=64, cols=64, RescaleSlope=2, RescaleIntercept=-100)
    img, meta = read_image(f)
    assert img.shape == (64, 64) and meta["voi"] == "none" and meta["bit_depth"] == 12
    assert img.min() == 0.0 and img.max() == 1.0
    assert np.unique(img).size == 4096  # no 8-bit squeeze
    g = write_dicom(tmp_path / "w.dcm", rows=64, cols=64, WindowCenter=2048, WindowWidth=1024)
    w, meta = read_image(g)
    assert meta["voi"] == "window"
    raw = (np.arange(64 * 64) % 4096).reshape(64, 64)
    assert np.all(w[raw < 1536] == 0.0) and np.all(w[raw >= 2560] == 1.0)


def test_dicom_without_pixel_data(tmp_path):
    f = write_dicom(tmp_path / "sr.dcm", pixels=False)
    with pytest.raises(ImageReadError, match="no pixel data") as e:
        read_image(f)
    assert str(f) in str(e.value) and "SECRET" not in str(e.value) and "Doe" not in str(e.value)


def test_dicom_multiframe_refused(tmp_path):
    f = write_dicom(tmp_path / "mf.dcm", frames=3)
    with pytest.raises(ImageReadError, match="multi-frame"):
        read_image(f)


def test_dicom_huge_dimension_header(tmp_path):
    import pydicom

    f = write_dicom(tmp_path / "big.dcm", rows=4, cols=4)
    ds = pydicom.dcmread(f)
    ds.Rows = ds.Columns = 60000  # header claims 3.6 gigapixels over 32 bytes: refused before any decode
    ds.save_as(f, enforce_file_format=True)
    with pytest.raises(ImageReadError, match="too large") as e:
        read_image(f)
    assert str(f) in str(e.value)


# --------------------------------------------------------------------------------------------- Pillow modes


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA", "P", "CMYK"])
def test_pillow_modes_become_grayscale(tmp_path, mode):
    rgb = Image.new("RGB", (40, 20), (200, 200, 200))
    rgb.paste((20, 20, 20), (0, 0, 10, 20))  # dark left quarter
    img = rgb.convert(mode)
    suffix = ".jpg" if mode == "CMYK" else ".png"
    f = tmp_path / f"x{suffix}"
    img.save(f)
    arr, meta = read_image(f)
    assert arr.shape == (20, 40) and arr.dtype == np.float32
    assert meta["mode"] == mode and meta["original_width"] == 40
    assert 0.0 <= arr.min() and arr.max() <= 1.0
    assert arr[:, :8].mean() < 0.2 and arr[:, 14:].mean() > 0.6


def test_16bit_png_keeps_precision(tmp_path):
    a = (np.arange(32 * 64, dtype=np.uint32) * 31 % 65536).astype(np.uint16).reshape(32, 64)
    f = tmp_path / "x16.png"
    Image.fromarray(a).save(f)
    arr, meta = read_image(f)
    assert meta["bit_depth"] == 16 and meta["mode"].startswith("I;16")
    np.testing.assert_array_equal(np.rint(arr.astype(np.float64) * 65535).astype(np.uint16), a)


def test_mode_I_image(tmp_path):
    a = (np.arange(16 * 16, dtype=np.int32) * 200).reshape(16, 16)
    f = tmp_path / "x.tif"
    Image.fromarray(a).save(f)
    arr, meta = read_image(f)
    assert meta["mode"] == "I" and arr.shape == (16, 16)
    np.testing.assert_allclose(arr, a / 65535.0, atol=1e-6)


def test_jpeg_draft_mode_decodes_smaller(tmp_path):
    rng = np.random.default_rng(0)
    a = (rng.random((600, 800)) * 255).astype(np.uint8)
    f = tmp_path / "big.jpeg"
    Image.fromarray(a).save(f, quality=80)
    full, m_full = read_image(f)
    small, m_small = read_image(f, target_size=64)
    assert full.shape == (600, 800) and not m_full["draft"]
    assert m_small["draft"] and m_small["original_width"] == 800
    assert max(small.shape) >= 64 and small.shape[1] < 800
    # a target close to the image size does not draft
    assert not read_image(f, target_size=500)[1]["draft"]


# --------------------------------------------------------------------------------------------- bad inputs


def test_zero_byte_file(tmp_path):
    f = tmp_path / "empty.jpeg"
    f.write_bytes(b"")
    with pytest.raises(ImageReadError, match="empty") as e:
        read_image(f)
    assert e.value.path == str(f) and str(f) in str(e.value)


def test_truncated_jpeg(tmp_path):
    rng = np.random.default_rng(1)
    g = tmp_path / "good.jpeg"
    Image.fromarray((rng.random((256, 256)) * 255).astype(np.uint8)).save(g, quality=90)
    f = tmp_path / "truncated.jpeg"
    f.write_bytes(g.read_bytes()[: g.stat().st_size // 2])
    with pytest.raises(ImageReadError, match="truncated") as e:
        read_image(f)
    assert str(f) in str(e.value)
    with pytest.raises(ImageReadError):
        read_image(f, target_size=32)  # draft decode also notices


def test_text_file_named_jpeg(tmp_path):
    f = tmp_path / "notes.jpeg"
    f.write_text("this is not an image\n")
    with pytest.raises(ImageReadError, match="not a recognised image") as e:
        read_image(f)
    assert str(f) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ImageReadError, match="cannot open"):
        read_image(tmp_path / "nope.png")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def test_huge_dimension_png_header(tmp_path):
    f = tmp_path / "bomb.png"
    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)  # 10 gigapixels, 8-bit gray
    f.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                  + _png_chunk(b"IEND", b""))
    with pytest.raises(ImageReadError, match="too large") as e:
        read_image(f)
    assert str(f) in str(e.value) and "decompression-bomb" in str(e.value)


def test_explicit_pixel_limit(tmp_path):
    f = tmp_path / "ok.png"
    Image.new("L", (100, 100)).save(f)
    read_image(f)
    with pytest.raises(ImageReadError, match="exceeds the limit"):
        read_image(f, max_pixels=5000)
