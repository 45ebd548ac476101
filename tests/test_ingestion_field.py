"""Field-hardened ingestion: every kind of hospital-export input that the reader got wrong, built from
the shared real images (``../shared/cases/ingestion`` and ``../shared/data``). Files of other kinds are made in
``tmp_path`` by editing those real images (pydicom / Pillow); nothing is written into the repository.

Each test checks a value derived independently of the reader: the stored pixel values of a reference file, the
modality-LUT output scaled by hand, Pillow's own decode of a frame, exact bytes of a file name.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from chest_xray import ImageReadError, read_image, scan_dataset
from chest_xray.io import READ_ERROR_KINDS, dicom_header

REF_NATIVE = "jpeg_lossless_sv1_reference_native.dcm"  # CR PA 12-bit MONOCHROME2, 489 x 461, no VOI window
WINDOW_ZERO = "window_width_zero.dcm"  # CR PA 15-bit MONOCHROME1, WindowCenter 15000, WindowWidth 0


# ----------------------------------------------------------------------------------------------------- helpers
def _real_jpegs(data_root: Path, cls: str = "NORMAL", n: int = 4, subset: str = "chest_xray_224") -> list[Path]:
    d = data_root / subset / "train" / cls
    files = sorted(d.glob("*.jpeg"))[:n]
    if len(files) < n:
        pytest.skip(f"real images not found in {d}")
    return files


def _edit_dicom(src: Path, dest: Path, **attrs) -> Path:
    """Copy of a real DICOM file with attributes set (value None deletes the attribute)."""
    import pydicom

    ds = pydicom.dcmread(src)
    for k, v in attrs.items():
        if v is None:
            if k in ds:
                delattr(ds, k)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pydicom warns on the invalid values we write on purpose
                setattr(ds, k, v)
    ds.save_as(dest)
    return dest


def _patch_bytes(path: Path, old: bytes, new: bytes) -> Path:
    """Replace one occurrence of ``old`` by ``new`` (same length) in a file: writes values pydicom would refuse
    (e.g. a decimal comma in a DS), as a misbehaving modality does."""
    data = path.read_bytes()
    assert len(old) == len(new) and data.count(old) == 1, (old, data.count(old))
    path.write_bytes(data.replace(old, new))
    return path


def _fallback_image(path: Path) -> np.ndarray:
    """The documented VOI fallback, computed by hand: stored values x RescaleSlope + RescaleIntercept, scaled to
    their own [min, max], inverted for MONOCHROME1."""
    import pydicom

    ds = pydicom.dcmread(path)
    a = ds.pixel_array.astype(np.float64) * float(ds.get("RescaleSlope", 1) or 1) + float(
        ds.get("RescaleIntercept", 0) or 0)
    a = (a - a.min()) / (a.max() - a.min())
    return 1.0 - a if ds.PhotometricInterpretation == "MONOCHROME1" else a


def _assert_one_line_naming(err: ImageReadError, path: Path) -> None:
    msg = str(err)
    assert str(path) in msg and "\n" not in msg and "\r" not in msg, msg
    assert err.kind in READ_ERROR_KINDS, err.kind


# ============================================================================== 1. malformed DICOM attributes
def test_window_width_zero_case_falls_back_to_modality_range(ingestion_cases, tmp_path):
    f = ingestion_cases / WINDOW_ZERO
    img, meta = read_image(f)
    assert img.shape == (489, 461) and meta["voi"] == "none" and meta["inverted"]
    assert "Window Width" in meta["voi_fallback"] and "0" in meta["voi_fallback"]
    np.testing.assert_allclose(img, _fallback_image(f), atol=1e-6)
    assert dicom_header(f)["voi_fallback"] == meta["voi_fallback"]
    # the same file with a valid window is windowed, and the result differs (so the fallback is really taken)
    good, gmeta = read_image(_edit_dicom(f, tmp_path / "valid.dcm", WindowWidth="30000"))
    assert gmeta["voi"] == "window" and gmeta["voi_fallback"] is None
    assert np.abs(good - img).max() > 0.05


@pytest.mark.parametrize("kind", ["decimal comma", "non-numeric", "mismatched counts", "negative width",
                                  "multi-valued with width 0 first", "centre without width"])
def test_broken_voi_windows_fall_back_with_reason(ingestion_cases, tmp_path, kind):
    src = ingestion_cases / WINDOW_ZERO
    f = tmp_path / "w.dcm"
    if kind == "decimal comma":  # pydicom keeps "15000,5" as a str
        _patch_bytes(_edit_dicom(src, f, WindowWidth="30000.5"), b"30000.5", b"30000,5")
        attr = "Window Width"
    elif kind == "non-numeric":
        _patch_bytes(_edit_dicom(src, f, WindowCenter="12345.6"), b"12345.6", b"unknown")
        attr = "Window Center"
    elif kind == "mismatched counts":
        _edit_dicom(src, f, WindowCenter=[15000, 14000], WindowWidth=[30000])
        attr = "Window Center has 2 values"
    elif kind == "negative width":
        _edit_dicom(src, f, WindowWidth="-5")
        attr = "Window Width"
    elif kind == "multi-valued with width 0 first":
        _edit_dicom(src, f, WindowCenter=[15000, 14000], WindowWidth=[0, 20000])
        attr = "Window Width"
    else:
        _edit_dicom(src, f, WindowWidth=None)
        attr = "Window Width missing"
    img, meta = read_image(f)
    assert meta["voi"] == "none" and attr in meta["voi_fallback"], meta["voi_fallback"]
    assert "\n" not in meta["voi_fallback"]
    np.testing.assert_allclose(img, _fallback_image(f), atol=1e-6)


def test_multi_valued_window_uses_the_first_window(ingestion_cases, tmp_path):
    """Several Window Center/Width pairs with equal counts are alternatives (PS3.3 C.11.2.1.2), the first being
    the default: valid, windowed exactly as the first pair alone."""
    src = ingestion_cases / WINDOW_ZERO
    multi, mm = read_image(_edit_dicom(src, tmp_path / "m.dcm", WindowCenter=[15000, 9000],
                                       WindowWidth=[30000, 2000]))
    single, _ = read_image(_edit_dicom(src, tmp_path / "s.dcm", WindowCenter="15000", WindowWidth="30000"))
    other, _ = read_image(_edit_dicom(src, tmp_path / "o.dcm", WindowCenter="9000", WindowWidth="2000"))
    assert mm["voi"] == "window" and mm["voi_fallback"] is None
    np.testing.assert_array_equal(multi, single)
    assert np.abs(multi - other).max() > 0.1


def test_scan_lists_voi_fallback_and_keeps_every_image(ingestion_cases, data_root, tmp_path):
    root = tmp_path / "root"
    (root / "NORMAL").mkdir(parents=True)
    (root / "PNEUMONIA").mkdir()
    shutil.copy(ingestion_cases / WINDOW_ZERO, root / "NORMAL" / "wz.dcm")
    for f in _real_jpegs(data_root, "NORMAL", 2) + _real_jpegs(data_root, "PNEUMONIA", 2):
        shutil.copy(f, root / f.parent.name / f.name)
    for verify in (False, True):
        recs, rep = scan_dataset(root, verify=verify)
        assert rep["n_records"] == 5 and rep["skipped"] == []
        wz = [r for r in recs if r["path"].endswith("wz.dcm")][0]
        assert (wz["width"], wz["height"]) == (461, 489)
        assert [n["path"] for n in rep["notes"]] == [wz["path"]]
        assert "Window Width" in rep["notes"][0]["note"] and rep["notes"][0]["kind"] == "voi fallback"


def test_non_numeric_frame_count_is_an_image_read_error(ingestion_cases, tmp_path):
    f = _patch_bytes(_edit_dicom(ingestion_cases / REF_NATIVE, tmp_path / "frames.dcm", NumberOfFrames="987654"),
                     b"987654", b"twelve")  # an IS that is not a number
    with pytest.raises(ImageReadError) as ei:
        read_image(f)
    _assert_one_line_naming(ei.value, f)
    assert ei.value.kind == "invalid DICOM attribute"


# ============================================================================== 2. compressed DICOM decoders
def test_jpeg_lossless_sv1_equals_native_reference(ingestion_cases):
    import pydicom

    comp, ref = ingestion_cases / "jpeg_lossless_sv1.dcm", ingestion_cases / REF_NATIVE
    a, b = pydicom.dcmread(comp).pixel_array, pydicom.dcmread(ref).pixel_array
    assert a.shape == b.shape == (489, 461)
    assert int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max()) == 0
    img, meta = read_image(comp)
    img_ref, _ = read_image(ref)
    assert "Process 14" in meta["transfer_syntax"] and meta["bit_depth"] == 12
    assert float(np.abs(img - img_ref).max()) == 0.0


@pytest.mark.parametrize("name", ["MR_small_jpeg_ls_lossless.dcm", "MR_small_jp2klossless.dcm",
                                  "MR_small_RLE.dcm"])
def test_pydicom_bundled_compressed_files_equal_their_uncompressed_twin(name):
    import pydicom
    from pydicom.data import get_testdata_file

    comp, ref = get_testdata_file(name), get_testdata_file("MR_small.dcm")
    if comp is None or ref is None:
        pytest.skip(f"pydicom's bundled test file {name} or MR_small.dcm is not installed")
    a, b = pydicom.dcmread(comp).pixel_array, pydicom.dcmread(ref).pixel_array
    assert a.shape == b.shape == (64, 64)
    assert int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max()) == 0
    img, meta = read_image(comp)
    img_ref, _ = read_image(ref)
    assert meta["transfer_syntax"] != "Explicit VR Little Endian"
    np.testing.assert_array_equal(img, img_ref)


def test_decoders_come_from_python_gdcm_not_gpl_libjpeg():
    """The pinned decoder is python-gdcm (BSD/Apache); pylibjpeg-libjpeg (GPL-3.0) must not be what decodes."""
    import importlib.metadata
    import importlib.util

    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEG2000Lossless, JPEGLosslessSV1, JPEGLSLossless

    assert importlib.metadata.version("python-gdcm") == "3.2.6"
    for uid in (JPEGLosslessSV1, JPEGLSLossless, JPEG2000Lossless):
        assert "gdcm" in get_decoder(uid).available_plugins, uid.name
    assert importlib.util.find_spec("libjpeg") is None, "pylibjpeg-libjpeg (GPL-3.0) is installed"


def test_missing_decoder_gives_one_line_reason(ingestion_cases, monkeypatch):
    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEGLosslessSV1

    monkeypatch.setattr(get_decoder(JPEGLosslessSV1), "_available", {})  # as if python-gdcm were absent
    f = ingestion_cases / "jpeg_lossless_sv1.dcm"
    with pytest.raises(ImageReadError) as ei:
        read_image(f)
    _assert_one_line_naming(ei.value, f)
    assert ei.value.kind == "no decoder" and "python-gdcm==3.2.6" in str(ei.value) and "Process 14" in str(ei.value)


# ========================================================================= already right: keep them tested
def test_signed_high_bit_garbage_big_endian_and_headerless_equal_the_reference(ingestion_cases, tmp_path):
    import pydicom
    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import write_dataset
    from pydicom.uid import ExplicitVRBigEndian

    src = ingestion_cases / REF_NATIVE
    raw = pydicom.dcmread(src).pixel_array  # uint16, 12 bits stored
    ref, _ = read_image(src)
    made = {}
    # signed 12-bit: the same image stored as value - 2048 with PixelRepresentation 1
    ds = pydicom.dcmread(src)
    ds.PixelRepresentation = 1
    ds.PixelData = (raw.astype(np.int32) - 2048).astype(np.int16).tobytes()
    ds.save_as(made.setdefault("signed", tmp_path / "signed.dcm"))
    # high-bit garbage: random values in bits 12..15, which BitsStored 12 / HighBit 11 says to ignore
    ds = pydicom.dcmread(src)
    noise = np.random.default_rng(0).integers(1, 16, raw.shape).astype(np.uint16) << 12
    ds.PixelData = (raw | noise).astype(np.uint16).tobytes()
    ds.save_as(made.setdefault("garbage", tmp_path / "garbage.dcm"))
    # Explicit VR Big Endian (retired, still in old archives)
    ds = pydicom.dcmread(src)
    ds.PixelData = raw.astype(">u2").tobytes()
    ds.file_meta.TransferSyntaxUID = ExplicitVRBigEndian
    pydicom.dcmwrite(made.setdefault("big endian", tmp_path / "be.dcm"), ds, implicit_vr=False,
                     little_endian=False, force_encoding=True)
    # no Part-10 header (no preamble, no DICM, no file meta): a bare data set, explicit and implicit VR
    for implicit in (False, True):
        ds = pydicom.dcmread(src)
        del ds.file_meta
        fp = DicomBytesIO()
        fp.is_little_endian, fp.is_implicit_VR = True, implicit
        write_dataset(fp, ds)
        f = made.setdefault(f"headerless implicit={implicit}", tmp_path / f"headerless_{implicit}.dcm")
        f.write_bytes(fp.getvalue())
        assert f.read_bytes()[128:132] != b"DICM"
    for kind, f in made.items():
        img, meta = read_image(f)
        assert float(np.abs(img - ref).max()) == 0.0, kind
    assert read_image(made["big endian"])[1]["transfer_syntax"] == "Explicit VR Big Endian"
    assert read_image(made["headerless implicit=True"])[1]["transfer_syntax"] == "Implicit VR Little Endian"
    assert dicom_header(made["headerless implicit=False"])["modality"] == "CR"
    # the check is not vacuous: the signed file read as unsigned would differ
    ds = pydicom.dcmread(made["signed"])
    ds.PixelRepresentation = 0
    ds.save_as(tmp_path / "signed_as_unsigned.dcm")
    assert np.abs(read_image(tmp_path / "signed_as_unsigned.dcm")[0] - ref).max() > 0.1


def test_jpeg2000_lossless_made_from_real_cr_equals_reference(ingestion_cases, tmp_path):
    import io

    import pydicom
    from PIL import features
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEG2000Lossless

    if not features.check("jpg_2000"):
        pytest.skip("this Pillow has no JPEG 2000 encoder (openjpeg)")
    src = ingestion_cases / REF_NATIVE
    ds = pydicom.dcmread(src)
    buf = io.BytesIO()
    Image.fromarray(ds.pixel_array.astype(np.uint16)).save(buf, format="JPEG2000", irreversible=False,
                                                          no_jp2=True)
    ds.PixelData = encapsulate([buf.getvalue()])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = JPEG2000Lossless
    f = tmp_path / "j2k.dcm"
    ds.save_as(f)
    img, meta = read_image(f)
    assert meta["transfer_syntax"].startswith("JPEG 2000")
    assert float(np.abs(img - read_image(src)[0]).max()) == 0.0


# ==================================================================================== 3. EXIF orientation
def test_exif_orientation_6_reads_upright(ingestion_cases, tmp_path):
    img, meta = read_image(ingestion_cases / "exif_orientation_6.jpeg")
    ref, _ = read_image(ingestion_cases / "exif_orientation_6_reference_upright.png")
    with Image.open(ingestion_cases / "exif_orientation_6.jpeg") as im:
        assert im.size == (1152, 1422)  # stored sideways
    assert img.shape == ref.shape == (1152, 1422)
    assert (meta["width"], meta["height"], meta["original_width"], meta["original_height"]) == (1422, 1152) * 2
    assert meta["exif_orientation"] == 6
    # equal up to JPEG re-encoding noise; the wrong rotation direction (180 degrees off) is far away
    assert float(np.abs(img - ref).mean()) < 0.005
    assert float(np.abs(img - ref[::-1, ::-1]).mean()) > 0.1
    # draft decoding (large JPEG, small target) keeps the orientation and the upright original size
    small, smeta = read_image(ingestion_cases / "exif_orientation_6.jpeg", target_size=256)
    assert smeta["draft"] and small.shape[1] > small.shape[0]
    assert (smeta["original_width"], smeta["original_height"]) == (1422, 1152)


def test_scan_records_upright_size(ingestion_cases, tmp_path):
    root = tmp_path / "root"
    (root / "NORMAL").mkdir(parents=True)
    (root / "PNEUMONIA").mkdir()
    shutil.copy(ingestion_cases / "exif_orientation_6.jpeg", root / "NORMAL" / "IM-9000-0001.jpeg")
    shutil.copy(ingestion_cases / "exif_orientation_6_reference_upright.png", root / "PNEUMONIA" / "x.png")
    for verify in (False, True):
        recs, _ = scan_dataset(root, verify=verify)
        assert [(r["width"], r["height"]) for r in recs] == [(1422, 1152)] * 2, verify


def test_eval_transform_applies_exif_orientation(ingestion_cases):
    """``predict`` and evaluation read through ``build_transforms(.., "eval")`` -> ``read_image``."""
    from chest_xray import build_transforms

    tf = build_transforms(64, "eval")
    x = tf({"image": str(ingestion_cases / "exif_orientation_6.jpeg"), "label": 0})["image"]
    r = tf({"image": str(ingestion_cases / "exif_orientation_6_reference_upright.png"), "label": 0})["image"]
    assert tuple(x.shape) == tuple(r.shape)
    assert float((x - r).abs().mean()) < 0.02
    assert float((x - r.flip(-1).flip(-2)).abs().mean()) > 0.1


# ========================================================================= 4. MPF preview vs true multi-frame
def test_jpeg_with_preview_frame_reads_primary_image(ingestion_cases):
    f = ingestion_cases / "jpeg_with_preview_frame.jpeg"
    img, meta = read_image(f)
    assert img.shape == (1152, 1422) and (meta["width"], meta["height"]) == (1422, 1152)
    with Image.open(f) as im:
        assert im.n_frames == 2  # Pillow: an MPO with the preview as frame 2
        im.seek(0)
        primary = np.asarray(im.convert("L"), dtype=np.float32) / 255.0
    np.testing.assert_allclose(img, primary, atol=1e-6)


def test_true_multi_frame_stacks_are_refused(ingestion_cases, data_root, tmp_path):
    import pydicom

    a, b = (Image.open(f) for f in _real_jpegs(data_root, "NORMAL", 2, "chest_xray_original"))
    b = b.convert(a.mode).resize(a.size)
    stacks = {"mpo": tmp_path / "stereo.jpeg", "tiff": tmp_path / "stack.tif", "gif": tmp_path / "anim.png"}
    # a fresh copy per writer (Pillow's MPO writer leaves state on the image that its TIFF writer trips on)
    a.copy().save(stacks["mpo"], format="MPO", save_all=True, append_images=[b.copy()])
    a.copy().save(stacks["tiff"], format="TIFF", save_all=True, append_images=[b.copy()])
    a.convert("L").save(stacks["gif"], format="GIF", save_all=True, append_images=[b.convert("L")])
    ds = pydicom.dcmread(ingestion_cases / REF_NATIVE)
    ds.NumberOfFrames = 2
    ds.PixelData = ds.PixelData * 2
    stacks["dicom"] = tmp_path / "two_frames.dcm"
    ds.save_as(stacks["dicom"])
    for kind, f in stacks.items():
        with pytest.raises(ImageReadError) as ei:
            read_image(f)
        _assert_one_line_naming(ei.value, f)
        assert ei.value.kind == "multi-frame" and "2 frames" in ei.value.reason, kind


# ========================================================================================= 5. CSV manifests
@pytest.mark.parametrize("variant", ["plain", "bom", "crlf", "semicolon", "bom+crlf+semicolon"])
def test_spreadsheet_csv_manifests(data_root, tmp_path, variant):
    files = _real_jpegs(data_root, "NORMAL", 2) + _real_jpegs(data_root, "PNEUMONIA", 2)
    for f in files:
        shutil.copy(f, tmp_path / f.name)
    delim = ";" if "semicolon" in variant else ","
    eol = "\r\n" if "crlf" in variant else "\n"
    lines = [delim.join(["path", "label", "patient_id"])]
    lines += [delim.join([f.name, f.parent.name, f"p{i // 2}"]) for i, f in enumerate(files)]
    text = eol.join(lines) + eol
    data = ("\ufeff" if "bom" in variant else "").encode() + text.encode()
    (tmp_path / "m.csv").write_bytes(data)
    recs, rep = scan_dataset(tmp_path / "m.csv")
    assert rep["layout"] == "manifest" and rep["skipped"] == []
    assert [(Path(r["path"]).name, r["label"], r["patient_id"]) for r in recs] == sorted(
        (f.name, 0 if f.parent.name == "NORMAL" else 1, f"p{i // 2}") for i, f in enumerate(files))


# ========================================================================================= 6. linked roots
def test_symlinked_subfolder_cycle_and_parent_link(data_root, tmp_path):
    n = _real_jpegs(data_root, "NORMAL", 3)
    p = _real_jpegs(data_root, "PNEUMONIA", 1)
    root = tmp_path / "root"
    (root / "NORMAL").mkdir(parents=True)
    (root / "PNEUMONIA").mkdir()
    shutil.copy(n[0], root / "NORMAL" / n[0].name)
    shutil.copy(p[0], root / "PNEUMONIA" / p[0].name)
    batch = tmp_path / "second_export"  # a class folder holding a link to another export's folder
    batch.mkdir()
    for f in n[1:]:
        shutil.copy(f, batch / f.name)
    os.symlink(batch, root / "NORMAL" / "batch2")
    os.symlink(root / "NORMAL", batch / "loop")  # a cycle back into the class folder
    os.symlink("..", batch / "up")  # up to tmp_path, which holds root/PNEUMONIA: must not become NORMAL
    recs, rep = scan_dataset(root)
    got = {os.path.relpath(r["path"], root): r["label"] for r in recs}
    assert got == {f"NORMAL/{n[0].name}": 0, f"NORMAL/batch2/{n[1].name}": 0, f"NORMAL/batch2/{n[2].name}": 0,
                   f"PNEUMONIA/{p[0].name}": 1}
    cycles = {os.path.relpath(s["path"], root) for s in rep["skipped"] if s["kind"] == "symbolic-link cycle"}
    assert cycles == {"NORMAL/batch2/loop", "NORMAL/batch2/up"}
    assert rep["skipped_by_reason"] == {"symbolic-link cycle": 2}


def test_hugging_face_cache_layout_keeps_link_paths_and_names(data_root, ingestion_cases, tmp_path):
    """snapshots/<rev>/train/<CLASS>/<name>.jpeg -> ../../../../blobs/<sha256> (suffix-less), as the HF hub cache,
    git-annex and DataLad lay data out: type, subtype label and patient id come from the link name."""
    import hashlib

    cache = tmp_path / "datasets--x--cxr"
    blobs = cache / "blobs"
    blobs.mkdir(parents=True)
    snap = cache / "snapshots" / "0123abcd"
    srcs = {"NORMAL": _real_jpegs(data_root, "NORMAL", 2),
            "PNEUMONIA": [f for f in sorted((data_root / "chest_xray_224/train/PNEUMONIA").glob("*virus*.jpeg"))[:1]]
            + [f for f in sorted((data_root / "chest_xray_224/train/PNEUMONIA").glob("*bacteria*.jpeg"))[:1]]}
    srcs["NORMAL"].append(ingestion_cases / REF_NATIVE)  # a DICOM blob: no suffix, no way to tell but the link
    links = {}
    for cls, files in srcs.items():
        (snap / "train" / cls).mkdir(parents=True)
        for i, f in enumerate(files):
            blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy(f, blob)
            name = f.name if f.suffix == ".jpeg" else "IM-7000-0001.dcm"
            link = snap / "train" / cls / name
            os.symlink(os.path.relpath(blob, link.parent), link)
            links[str(link)] = (cls, name)
    recs, rep = scan_dataset(snap, labels="subtype")
    assert rep["layout"] == "kaggle" and rep["skipped"] == []
    assert {r["path"] for r in recs} == set(links)  # link paths, never the blob paths
    for r in recs:
        cls, name = links[r["path"]]
        want = 0 if cls == "NORMAL" else (2 if "virus" in name else 1)
        assert r["label"] == want, name
        if name.endswith(".jpeg"):  # Kermany names: personN_virus_M / IM-XXXX-YYYY
            want_pid = name.split("_")[0] if name.startswith("person") else "-".join(name.split("-")[:2])
            assert r["patient_id"] == want_pid, name
    dcm = [r for r in recs if r["path"].endswith(".dcm")][0]
    assert (dcm["width"], dcm["height"]) == (461, 489)


# ======================================================================================= 7. non-UTF-8 names
def test_cp1252_file_name_keeps_exact_bytes_through_partition(data_root, tmp_path):
    from chest_xray import partition_records, write_partition
    from chest_xray.partition import read_site_manifest

    root = tmp_path / "root"
    files = {"NORMAL": _real_jpegs(data_root, "NORMAL", 6), "PNEUMONIA": _real_jpegs(data_root, "PNEUMONIA", 6)}
    raw_name = b"IM-0999-0001-Radiograf\xeda t\xf3rax.jpeg"  # cp1252 bytes from a Windows zip: not UTF-8
    for cls, fs in files.items():
        (root / cls).mkdir(parents=True)
        for f in fs:
            shutil.copy(f, root / cls / f.name)
    raw_path = os.fsencode(root / "NORMAL") + b"/" + raw_name
    shutil.copy(files["NORMAL"][0], raw_path)
    recs, rep = scan_dataset(root)
    assert rep["n_records"] == 13 and rep["skipped"] == []
    odd = [r for r in recs if os.fsencode(r["path"]) == raw_path]
    # the copy holds the same bytes as its source, so the content-hash index puts it with that patient
    twin = next(r for r in recs if r["path"] == str(root / "NORMAL" / files["NORMAL"][0].name))
    assert len(odd) == 1 and odd[0]["patient_id"] == twin["patient_id"] == "IM-0115"
    assert rep["duplicates"]["exact_groups"] == 1
    res = partition_records(recs, 2, "width", seed=0)
    out = tmp_path / "part"
    write_partition(res, out, scan_report=rep)
    blobs = b"".join(p.read_bytes() for p in sorted((out / "sites").glob("*.csv")))
    assert blobs.count(raw_path) == 1  # the exact bytes, not a replacement character
    back = [r for s in sorted((out / "sites").glob("*.csv")) for r in read_site_manifest(s)]
    assert len(back) == 13
    hit = [r for r in back if os.fsencode(r["path"]) == raw_path][0]
    np.testing.assert_array_equal(read_image(hit["path"])[0], read_image(files["NORMAL"][0])[0])
    json.loads((out / "scan_report.json").read_text())
    # an OHFL probe CSV in the same format is read back with the same bytes
    from hfl_components.flare.probe import list_probe_files

    probe = [f for s in sorted((out / "sites").glob("*.csv")) for f in list_probe_files(s)]
    assert sum(os.fsencode(f) == raw_path for f in probe) == 1


# ===================================================================================== atomic partition write
def test_partition_write_is_atomic(data_root, tmp_path, monkeypatch):
    import chest_xray.partition as part

    root = tmp_path / "root"
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        for f in _real_jpegs(data_root, cls, 6):
            shutil.copy(f, root / cls / f.name)
    recs, rep = scan_dataset(root)
    res3 = part.partition_records(recs, 3, "width", seed=0)
    res2 = part.partition_records(recs, 2, "width", seed=1)
    real_write = part._write_rows
    calls = []

    def failing(path, rows):  # the disk fills up while the second site CSV is written
        calls.append(path)
        real_write(path, rows[: len(rows) // 2])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(part, "_write_rows", failing)
    with pytest.raises(OSError):
        part.write_partition(res3, fresh)
    assert not fresh.exists() and sorted(os.listdir(tmp_path)) == ["root"]  # no temp folder left either
    monkeypatch.setattr(part, "_write_rows", real_write)
    old = tmp_path / "old"
    part.write_partition(res3, old, scan_report=rep)
    assert (os.stat(old).st_mode & 0o777) == (0o777 & ~_umask())
    before = {str(p.relative_to(old)): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    assert "sites/site-3.csv" in before
    calls.clear()
    monkeypatch.setattr(part, "_write_rows", failing)
    with pytest.raises(OSError):
        part.write_partition(res2, old)
    after = {str(p.relative_to(old)): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    assert after == before  # the earlier partition is untouched, byte for byte
    assert sorted(os.listdir(tmp_path)) == ["old", "root"]
    monkeypatch.setattr(part, "_write_rows", real_write)
    part.write_partition(res2, old)  # a later success replaces it whole: no stale site-3, no stale report
    assert sorted(p.name for p in (old / "sites").iterdir()) == ["site-1.csv", "site-2.csv"]
    assert not (old / "scan_report.json").exists()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# =========================================================================================== junk files
def test_os_and_archive_junk_is_listed_not_read(data_root, tmp_path):
    n = _real_jpegs(data_root, "NORMAL", 1)[0]
    root = tmp_path / "root"
    (root / "NORMAL").mkdir(parents=True)
    (root / "PNEUMONIA").mkdir()
    shutil.copy(n, root / "NORMAL" / n.name)
    shutil.copy(_real_jpegs(data_root, "PNEUMONIA", 1)[0], root / "PNEUMONIA" / "person1_bacteria_1.jpeg")
    (root / "NORMAL" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0" + b"\0" * 60)
    (root / "NORMAL" / "desktop.ini").write_bytes(b"[.ShellClassInfo]\r\n")
    (root / "NORMAL" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    shutil.copy(n, root / "NORMAL" / f"._{n.name}")  # even a readable image under a resource-fork name
    (root / "NORMAL" / "__MACOSX").mkdir()
    shutil.copy(n, root / "NORMAL" / "__MACOSX" / n.name)
    recs, rep = scan_dataset(root)
    assert sorted(Path(r["path"]).name for r in recs) == sorted([n.name, "person1_bacteria_1.jpeg"])
    junk = sorted(Path(s["path"]).name for s in rep["skipped"] if s["kind"] == "junk")
    assert junk == sorted([".DS_Store", f"._{n.name}", "Thumbs.db", "__MACOSX", "desktop.ini"])
    assert rep["skipped_by_reason"] == {"junk": 5}


# ===================================================================================== robustness of read_image
def test_read_image_raises_only_image_read_error_naming_the_file(ingestion_cases, data_root, tmp_path):
    jpeg = _real_jpegs(data_root, "NORMAL", 1)[0].read_bytes()
    sources = {"jpeg": jpeg, "png": (ingestion_cases / "exif_orientation_6_reference_upright.png").read_bytes(),
               "dcm": (ingestion_cases / REF_NATIVE).read_bytes(),
               "sv1.dcm": (ingestion_cases / "jpeg_lossless_sv1.dcm").read_bytes(),
               "mpo.jpeg": (ingestion_cases / "jpeg_with_preview_frame.jpeg").read_bytes()}
    rng = np.random.default_rng(0)
    bad: dict[str, bytes] = {}
    for suffix, data in sources.items():
        for frac in (0.002, 0.05, 0.5, 0.9):
            bad[f"trunc{frac}.{suffix}"] = data[: int(len(data) * frac)]
    for suffix in ("jpeg", "png", "dcm", "jpg"):
        bad[f"random.{suffix}"] = rng.bytes(4096)
        bad[f"empty.{suffix}"] = b""
    bad["text.dcm"] = b"PatientName: nobody\n" * 20
    bad["png_named.dcm"] = sources["png"]  # wrong suffix: a PNG where DICOM is expected
    bad["dicm_marker_only.jpeg"] = b"\0" * 128 + b"DICM" + rng.bytes(64)
    paths = []
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    (tmp_path / "folder.jpeg").mkdir()
    os.symlink(tmp_path / "gone.jpeg", tmp_path / "dangling.jpeg")
    paths += [tmp_path / "folder.jpeg", tmp_path / "missing.png", tmp_path / "dangling.jpeg"]
    kinds = {}
    for f in paths:
        with pytest.raises(ImageReadError) as ei:
            read_image(f)
        _assert_one_line_naming(ei.value, f)
        kinds[f.name] = ei.value.kind
    assert kinds["empty.png"] == "empty file" and kinds["missing.png"] == "missing file"
    assert kinds["folder.jpeg"] == "not a regular file" and kinds["random.png"] == "not an image"
    assert kinds["trunc0.5.sv1.dcm"] == "corrupt or truncated" and kinds["trunc0.5.jpeg"] == "corrupt or truncated"
    # a correct file under a wrong suffix is still read by its content
    (tmp_path / "jpeg_named.png").write_bytes(jpeg)
    (tmp_path / "dicom_named.jpeg").write_bytes(sources["dcm"])
    assert read_image(tmp_path / "jpeg_named.png")[1]["format"] == "JPEG"
    assert read_image(tmp_path / "dicom_named.jpeg")[1]["format"] == "DICOM"


# ============================================================================ end to end: cxr-hfl partition
def test_cli_partition_on_a_mixed_export(ingestion_cases, data_root, tmp_path, capsys):
    """Good real images plus one of each bad kind: every good image is partitioned, every bad file is listed in
    scan_report.json with its reason, and ``inspect`` prints the skipped counts by reason."""
    import pydicom

    from nvflare_jobs.cli import main

    root = tmp_path / "export"
    good: set[str] = set()
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        for f in _real_jpegs(data_root, cls, 10):
            shutil.copy(f, root / cls / f.name)
            good.add(str(root / cls / f.name))
    n_dir, p_dir = root / "NORMAL", root / "PNEUMONIA"

    def add_good(src: Path, dest: Path | bytes) -> None:
        shutil.copy(src, dest)
        good.add(os.fsdecode(dest))

    # field cases that must now be read
    add_good(ingestion_cases / "exif_orientation_6.jpeg", n_dir / "IM-8000-0001.jpeg")
    add_good(ingestion_cases / "jpeg_with_preview_frame.jpeg", n_dir / "IM-8001-0001.jpeg")
    add_good(ingestion_cases / "jpeg_lossless_sv1.dcm", p_dir / "sv1.dcm")
    add_good(ingestion_cases / WINDOW_ZERO, p_dir / "window_zero.dcm")
    add_good(_real_jpegs(data_root, "NORMAL", 11)[-1], os.fsencode(n_dir) + b"/IM-8002-0001-\xe9.jpeg")
    linked = tmp_path / "linked"
    linked.mkdir()
    add_good(_real_jpegs(data_root, "PNEUMONIA", 11)[-1], linked / "person8003_virus_1.jpeg")
    os.symlink(linked, p_dir / "linked")
    good.discard(str(linked / "person8003_virus_1.jpeg"))
    good.add(str(p_dir / "linked" / "person8003_virus_1.jpeg"))
    # one of each bad kind
    bad: dict[str, str] = {}  # path -> expected kind

    def add_bad(path: Path, data: bytes | None, kind: str) -> None:
        if data is not None:
            path.write_bytes(data)
        bad[str(path)] = kind

    jpeg = _real_jpegs(data_root, "NORMAL", 1)[0].read_bytes()
    add_bad(n_dir / "truncated.jpeg", jpeg[: len(jpeg) // 3], "corrupt or truncated")
    add_bad(n_dir / "empty.png", b"", "empty file")
    add_bad(n_dir / "random.png", np.random.default_rng(0).bytes(3000), "not an image")
    add_bad(n_dir / "notes.txt", b"export log\n", "unsupported file type")
    add_bad(n_dir / "Thumbs.db", b"\xd0\xcf\x11\xe0", "junk")
    add_bad(n_dir / "desktop.ini", b"[.ShellClassInfo]\r\n", "junk")
    add_bad(n_dir / ".DS_Store", b"\0\0\0\1Bud1", "junk")
    add_bad(n_dir / "._IM-8000-0001.jpeg", jpeg, "junk")
    (n_dir / "__MACOSX").mkdir()
    shutil.copy(n_dir / "IM-8000-0001.jpeg", n_dir / "__MACOSX" / "IM-8000-0001.jpeg")
    add_bad(n_dir / "__MACOSX", None, "junk")
    os.symlink(n_dir / "gone.jpeg", n_dir / "dangling.jpeg")
    add_bad(n_dir / "dangling.jpeg", None, "broken symbolic link")
    os.symlink(n_dir, linked / "loop")
    add_bad(p_dir / "linked" / "loop", None, "symbolic-link cycle")
    a = Image.open(_real_jpegs(data_root, "NORMAL", 2)[0])
    a.save(p_dir / "stereo.jpeg", format="MPO", save_all=True, append_images=[a.rotate(1)])
    add_bad(p_dir / "stereo.jpeg", None, "multi-frame")
    ds = pydicom.dcmread(ingestion_cases / REF_NATIVE)
    ds.NumberOfFrames, ds.PixelData = 2, ds.PixelData * 2
    ds.save_as(p_dir / "two_frames.dcm")
    add_bad(p_dir / "two_frames.dcm", None, "multi-frame")
    ds = pydicom.dcmread(ingestion_cases / REF_NATIVE)
    ds.ViewPosition = "LL"
    ds.save_as(p_dir / "lateral.dcm")
    add_bad(p_dir / "lateral.dcm", None, "lateral view")
    sv1 = (ingestion_cases / "jpeg_lossless_sv1.dcm").read_bytes()
    add_bad(p_dir / "truncated_sv1.dcm", sv1[: len(sv1) // 2], "corrupt or truncated")
    _patch_bytes(_edit_dicom(ingestion_cases / WINDOW_ZERO, p_dir / "bad_rows.dcm", Rows=489), b"\x28\x00\x10\x00"
                 b"US\x02\x00\xe9\x01", b"\x28\x00\x10\x00US\x02\x00\x00\x00")
    add_bad(p_dir / "bad_rows.dcm", None, "invalid DICOM attribute")

    out = tmp_path / "part"
    assert main(["partition", "--data", str(root), "--sites", "2", "--scheme", "width", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "skipped" in err and "Window Width" in err  # the VOI fallback is noted
    rows = []
    for s in sorted((out / "sites").glob("*.csv")):
        with open(s, newline="", encoding="utf-8", errors="surrogateescape") as fh:
            rows += list(csv.DictReader(fh))
    assert sorted(r["path"] for r in rows) == sorted(good)
    report = json.loads((out / "scan_report.json").read_text())
    listed = {s["path"]: s for s in report["skipped"]}
    assert set(listed) == set(bad)
    for path, kind in bad.items():
        assert listed[path]["kind"] == kind and listed[path]["reason"], (path, listed[path])
    want_counts: dict[str, int] = {}
    for k in bad.values():
        want_counts[k] = want_counts.get(k, 0) + 1
    assert report["skipped_by_reason"] == want_counts
    info = json.loads((out / "partition.json").read_text())
    assert info["n_skipped"] == len(bad) and info["skipped_by_reason"] == want_counts
    assert main(["inspect", str(out), "--png", str(tmp_path / "i.png")]) == 0
    text = capsys.readouterr().out
    assert f"skipped files: {len(bad)} (" in text and "junk 5" in text and "multi-frame 2" in text
