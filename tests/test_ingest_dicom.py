"""DICOM ingestion, fourth pass: files whose header does not describe their pixels, and headers that say what the
file is not (a raw For Processing image, a lateral coded only in the View Code Sequence, another body part).

- A grey-scale header (Samples per Pixel 1) over a 3-component JPEG stream: the stream governs (luma).
- A Transfer Syntax that does not describe the Pixel Data (native over encapsulated, compressed over a bare
  stream or over native pixels, JPEG Lossless over a DCT stream): the bytes are decoded as what they are.
- A Modality LUT Sequence whose LUT Descriptor says 12 bits: applied by hand, as the standard maps it.

Every input is built in ``tmp_path`` from the real radiographs of ``../shared/data/dicom`` and the field cases.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests import ingestion_kinds as K

BASELINE = "1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819.dcm"  # CR PA, 8-bit JPEG Baseline, MONO2
MONO1_BASELINE = "Fake_MONOHR1.dcm"  # the same kind, MONOCHROME1


def _real(data_root: Path, name: str) -> Path:
    f = data_root / "dicom" / name
    if not f.is_file():
        pytest.skip(f"real DICOM not found: {f}")
    return f


def _write(ds, ts: str, dest: Path) -> Path:
    """``ds`` written with Transfer Syntax ``ts`` in its file meta whatever its Pixel Data hold (pydicom refuses to
    write such a file, as a converter that gets it wrong does not): the data set explicit VR little endian."""
    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import write_dataset, write_file_meta_info
    from pydicom.uid import UID

    meta = ds.file_meta
    meta.TransferSyntaxUID = UID(ts)
    head, body = DicomBytesIO(), DicomBytesIO()
    for fp in (head, body):
        fp.is_little_endian, fp.is_implicit_VR = True, False
    write_file_meta_info(head, meta, enforce_standard=True)
    write_dataset(body, ds)
    dest.write_bytes(b"\0" * 128 + b"DICM" + head.getvalue() + body.getvalue())
    return dest


def _stream(a: np.ndarray, **save) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", **save)
    return buf.getvalue()


def _with_pixels(src: Path, data: bytes, encapsulated: bool):
    import pydicom
    from pydicom.encaps import encapsulate

    ds = pydicom.dcmread(src)
    ds.PixelData = encapsulate([data]) if encapsulated else data + (b"\0" if len(data) % 2 else b"")
    ds["PixelData"].VR = "OB"
    ds["PixelData"].is_undefined_length = encapsulated
    return ds


# ------------------------------------------------------------------------ 3-component stream, grey-scale header
@pytest.mark.parametrize("name", [BASELINE, MONO1_BASELINE])
def test_a_three_component_stream_under_a_grey_header_is_read_as_its_luma(data_root, tmp_path, name):
    """A converter wrote the grey radiograph as a colour (YCbCr) JPEG but kept Samples per Pixel 1 / MONOCHROMEx.
    Decoded as one component the pixels were scrambled (correlation ~0.1 with the picture)."""
    import pydicom

    from chest_xray import read_image

    src = _real(data_root, name)
    grey = pydicom.dcmread(src).pixel_array  # the real radiograph, uint8 (rows, cols)
    stream = _stream(np.repeat(grey[..., None], 3, axis=2), quality=95)
    assert stream[stream.find(b"\xff\xc0") + 9] == 3  # the frame header says 3 components
    f = _write(_with_pixels(src, stream, True), "1.2.840.10008.1.2.4.50", tmp_path / "colour_stream.dcm")
    img, meta = read_image(f)
    want = grey / 255.0
    if meta["photometric_interpretation"] == "MONOCHROME1":
        want = 1.0 - want
    diff = np.abs(np.asarray(img, np.float64) - want)
    assert img.shape == grey.shape and diff.mean() < 1.5 / 255 and diff.max() < 24 / 255  # JPEG q95 of the picture
    assert [n["kind"] for n in meta["grayscale_notes"]] == ["colour stream in grey-scale header"]
    assert "3 components" in meta["grayscale_notes"][0]["note"]


def test_a_grey_header_over_a_two_component_stream_is_refused_naming_the_mismatch(data_root, tmp_path):
    import pydicom

    from chest_xray import ImageReadError, read_image

    src = _real(data_root, BASELINE)
    stream = bytearray(_stream(pydicom.dcmread(src).pixel_array, quality=95))
    stream[stream.find(b"\xff\xc0") + 9] = 2  # Nf: a stream no grey-scale or colour reading fits
    f = _write(_with_pixels(src, bytes(stream), True), "1.2.840.10008.1.2.4.50", tmp_path / "two.dcm")
    with pytest.raises(ImageReadError) as e:
        read_image(f)
    assert str(f) in str(e.value) and "2 components" in e.value.reason and "Samples per Pixel 1" in e.value.reason


# ---------------------------------------------------------------------- Transfer Syntax vs. what the bytes are
def _lossless_frame(cases: Path) -> bytes:
    import pydicom
    from pydicom.encaps import generate_frames

    ds = pydicom.dcmread(cases / "jpeg_lossless_sv1.dcm")
    return next(generate_frames(ds.PixelData, number_of_frames=1))


@pytest.mark.parametrize("variant", ["native syntax, encapsulated lossless", "lossless syntax, bare stream",
                                     "lossless syntax, native pixels", "lossless syntax, bare stream, odd pad"])
def test_a_transfer_syntax_that_does_not_describe_the_pixels_is_decoded_as_the_bytes_are(
        ingestion_cases, tmp_path, variant):
    """The field case's 12-bit CR: every variant must equal its native reference exactly (today "truncated" or
    "Found unexpected tag ... instead of (FFFE,E000)")."""
    import pydicom

    from chest_xray import read_image

    nat = K.native_dicom(ingestion_cases)
    ref_img, _ = read_image(nat)
    frame = _lossless_frame(ingestion_cases)
    if variant == "native syntax, encapsulated lossless":
        ds, ts = _with_pixels(nat, frame, True), "1.2.840.10008.1.2.1"
    elif variant.startswith("lossless syntax, bare stream"):
        ds, ts = _with_pixels(nat, frame + (b"\0" if "pad" in variant else b""), False), "1.2.840.10008.1.2.4.70"
    else:
        ds, ts = pydicom.dcmread(nat), "1.2.840.10008.1.2.4.70"
    f = _write(ds, ts, tmp_path / "mismatch.dcm")
    img, meta = read_image(f)
    assert np.array_equal(img, ref_img)
    notes = [n for n in meta["grayscale_notes"] if n["kind"] == "transfer syntax mismatch"]
    assert len(notes) == 1 and "does not describe the Pixel Data" in notes[0]["note"]


@pytest.mark.parametrize("ts, encapsulated", [("1.2.840.10008.1.2.4.70", True), ("1.2.840.10008.1.2.1", False),
                                              ("1.2.840.10008.1.2.4.57", False)])
def test_a_dct_stream_under_a_lossless_or_native_syntax_is_decoded_as_a_dct_stream(data_root, tmp_path, ts,
                                                                                    encapsulated):
    """The real JPEG Baseline radiograph's own stream, relabelled: read equal to the correctly labelled file."""
    import pydicom
    from pydicom.encaps import generate_frames

    from chest_xray import read_image

    src = _real(data_root, BASELINE)
    want, _ = read_image(src)
    frame = next(generate_frames(pydicom.dcmread(src).PixelData, number_of_frames=1))
    f = _write(_with_pixels(src, frame, encapsulated), ts, tmp_path / "relabelled.dcm")
    img, meta = read_image(f)
    assert np.array_equal(img, want)
    assert any("DCT JPEG stream" in n["note"] for n in meta["grayscale_notes"])


def test_a_stream_no_syntax_reads_is_refused_naming_the_mismatch(data_root, tmp_path):
    """A progressive JPEG (no DICOM transfer syntax in use reads it) inside a native-syntax file."""
    import pydicom

    from chest_xray import ImageReadError, read_image

    src = _real(data_root, BASELINE)
    stream = _stream(pydicom.dcmread(src).pixel_array, quality=90, progressive=True)
    f = _write(_with_pixels(src, stream, True), "1.2.840.10008.1.2.1", tmp_path / "progressive.dcm")
    with pytest.raises(ImageReadError) as e:
        read_image(f)
    assert "does not describe the Pixel Data" in e.value.reason and "progressive" in e.value.reason
    assert "truncated" not in e.value.reason


def test_a_native_file_cut_short_is_still_truncated(ingestion_cases, tmp_path):
    """The byte rules do not swallow a real truncation: native bytes short of Rows x Columns stay refused."""
    import pydicom

    from chest_xray import ImageReadError, read_image

    ds = pydicom.dcmread(K.native_dicom(ingestion_cases))
    ds.PixelData = ds.PixelData[: len(ds.PixelData) // 2]
    f = _write(ds, "1.2.840.10008.1.2.1", tmp_path / "short.dcm")
    with pytest.raises(ImageReadError) as e:
        read_image(f)
    assert e.value.kind == "corrupt or truncated"


# ---------------------------------------------------------------------------------------- Modality LUT Sequence
def _with_modality_lut(src: Path, dest: Path, descriptor, lut: np.ndarray, vr: str = "OW", **attrs) -> Path:
    import pydicom
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    ds = pydicom.dcmread(src)
    for k, v in attrs.items():
        setattr(ds, k, v)
    item = Dataset()
    item.LUTDescriptor = list(descriptor)
    item.ModalityLUTType = "US"
    item.LUTData = lut.astype(np.uint16).tobytes() if vr == "OW" else [int(x) for x in lut]
    item["LUTData"].VR = vr
    ds.ModalityLUTSequence = Sequence([item])
    ds.save_as(dest)
    return dest


def _lut_by_hand(raw: np.ndarray, first: int, lut: np.ndarray) -> np.ndarray:
    """PS3.3 C.11.1 then the no-VOI rule: the LUT output (values below the first mapped value take the first
    entry, above the last the last) scaled to its own range."""
    v = lut[np.clip(raw.astype(np.int64) - first, 0, len(lut) - 1)].astype(np.float64)
    return (v - v.min()) / (v.max() - v.min())


@pytest.mark.parametrize("vr", ["OW", "US"])
def test_a_12_bit_modality_lut_descriptor_is_applied_by_hand(ingestion_cases, tmp_path, vr):
    """LUT Descriptor [4096, 0, 12] (pydicom: "data type 'uint12' not understood"): the square-root curve applied
    to the real CR's stored values, equal to the standard's mapping by hand."""
    import pydicom

    from chest_xray import read_image

    nat = K.native_dicom(ingestion_cases)
    raw = pydicom.dcmread(nat).pixel_array
    lut = np.round(np.sqrt(np.arange(4096) / 4095.0) * 4095).astype(np.int64)
    img, meta = read_image(_with_modality_lut(nat, tmp_path / "mlut12.dcm", [4096, 0, 12], lut, vr))
    assert np.abs(np.asarray(img, np.float64) - _lut_by_hand(raw, 0, lut)).max() < 1e-6
    assert any("12-bit entries" in n["note"] for n in meta["grayscale_notes"] if n["kind"] == "modality LUT")


def test_a_modality_lut_beside_a_rescale_wins_and_the_rescale_is_noted(ingestion_cases, tmp_path):
    """The standard allows a LUT or a rescale, not both: the LUT is applied (first mapped value 100: stored values
    below take the first entry), the rescale named as ignored."""
    import pydicom

    from chest_xray import read_image

    nat = K.native_dicom(ingestion_cases)
    raw = pydicom.dcmread(nat).pixel_array
    lut = np.round(np.linspace(0, 65535, 3000)).astype(np.int64)  # 16-bit entries over stored values 100..3099
    f = _with_modality_lut(nat, tmp_path / "both.dcm", [3000, 100, 16], lut, "OW", RescaleSlope=2,
                           RescaleIntercept=-1000)
    img, meta = read_image(f)
    assert np.abs(np.asarray(img, np.float64) - _lut_by_hand(raw, 100, lut)).max() < 1e-6
    assert any("rescale ignored" in n["note"] for n in meta["grayscale_notes"])


def test_a_malformed_modality_lut_is_refused_naming_the_sequence_not_the_rescale(ingestion_cases, tmp_path):
    from chest_xray import ImageReadError, read_image

    nat = K.native_dicom(ingestion_cases)
    f = _with_modality_lut(nat, tmp_path / "bad.dcm", [4096, 0, 24], np.arange(4096), "OW")
    with pytest.raises(ImageReadError) as e:
        read_image(f)
    assert "Modality LUT Sequence" in e.value.reason and "LUT Descriptor" in e.value.reason
    assert "Rescale" not in e.value.reason and e.value.kind == "invalid DICOM attribute"


# ------------------------------------------------- For Processing, View Code Sequence laterals, other body parts
DX_FOR_PROCESSING = "1.2.840.10008.5.1.4.1.1.1.1.1"
DX_FOR_PRESENTATION = "1.2.840.10008.5.1.4.1.1.1.1"


def _code(meaning: str):
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    item = Dataset()
    item.CodeValue, item.CodingSchemeDesignator, item.CodeMeaning = "R-10000", "SRT", meaning
    return Sequence([item])


def _header_variant(src: Path, dest: Path, drop: tuple[str, ...] = (), **attrs) -> Path:
    import pydicom

    ds = pydicom.dcmread(src)
    for k in drop:
        if k in ds:
            delattr(ds, k)
    for k, v in attrs.items():
        setattr(ds, k, v)
    if "SOPClassUID" in attrs:
        ds.file_meta.MediaStorageSOPClassUID = attrs["SOPClassUID"]
    ds.save_as(dest)
    return dest


#: file name -> (class folder, header changes, what a default scan does: "kept" or a skip kind)
HEADER_KINDS = {
    "dx_for_processing.dcm": ("NORMAL", dict(Modality="DX", PresentationIntentType="FOR PROCESSING",
                                             SOPClassUID=DX_FOR_PROCESSING), "for processing"),
    "dx_for_presentation.dcm": ("NORMAL", dict(Modality="DX", PresentationIntentType="FOR PRESENTATION",
                                               SOPClassUID=DX_FOR_PRESENTATION), "kept"),
    "dx_processing_sop_only.dcm": ("PNEUMONIA", dict(Modality="DX", SOPClassUID=DX_FOR_PROCESSING), "for processing"),
    "left_lateral_code.dcm": ("NORMAL", dict(ViewPosition="", ViewCodeSequence=_code("left lateral")),
                              "lateral view"),
    "lateral_code_no_view.dcm": ("PNEUMONIA", dict(drop=("ViewPosition",), ViewCodeSequence=_code("lateral")),
                                 "lateral view"),
    "pa_code.dcm": ("PNEUMONIA", dict(ViewPosition="", ViewCodeSequence=_code("postero-anterior")), "kept"),
    "shoulder.dcm": ("NORMAL", dict(BodyPartExamined="SHOULDER"), "kept"),
    "abdomen.dcm": ("PNEUMONIA", dict(BodyPartExamined="ABDOMEN"), "kept"),
    "shoulder_description.dcm": ("NORMAL", dict(BodyPartExamined="CHEST", StudyDescription="SHOULDER 2 VIEWS"),
                                 "kept"),
}
OTHER_PARTS = {"shoulder.dcm", "abdomen.dcm", "shoulder_description.dcm"}
FOR_PROCESSING = {"dx_for_processing.dcm", "dx_processing_sop_only.dcm"}


def _header_export(root: Path, ingestion_cases: Path, data_root: Path) -> Path:
    import shutil

    nat = K.native_dicom(ingestion_cases)
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        jpegs = sorted((data_root / "chest_xray_224" / "train" / cls).glob("*.jpeg"))[:12]
        if len(jpegs) < 12:
            pytest.skip("real JPEGs not found")
        for f in jpegs:
            shutil.copy(f, root / cls / f.name)
    for k, (name, (cls, attrs, _)) in enumerate(HEADER_KINDS.items()):
        attrs = dict(attrs)
        drop = attrs.pop("drop", ())
        _header_variant(nat, root / cls / name, drop, PatientID=f"SYN-H{k:02d}", **attrs)
    return root


def test_header_facts_read_the_view_code_sequence_the_intent_and_the_body_part(ingestion_cases, tmp_path):
    from chest_xray.io import dicom_header, dicom_skip

    nat = K.native_dicom(ingestion_cases)
    h = dicom_header(_header_variant(nat, tmp_path / "a.dcm", ViewPosition="", ViewCodeSequence=_code("left lateral")))
    assert (h["view_position"], h["view_code"]) == ("LL", "left lateral")
    assert dicom_skip(h) == ("lateral view (View Code Sequence 'left lateral', ViewPosition empty)", "lateral view")
    assert dicom_skip(h, allow_lateral=True) is None
    h = dicom_header(_header_variant(nat, tmp_path / "b.dcm", ViewPosition="AP", ViewCodeSequence=_code("lateral")))
    assert h["view_position"] == "AP" and h["view_code"] is None  # ViewPosition, when present, is the view
    cases = {  # header changes -> other_body_part
        (("BodyPartExamined", "CHESTABDOMEN"),): None,
        (("BodyPartExamined", "UNKNOWN"),): None,
        (("BodyPartExamined", "ANKLE"),): "BodyPartExamined ANKLE",
        (("BodyPartExamined", ""), ("ProtocolName", "KNEE LAT")): "ProtocolName names KNEE",
        (("BodyPartExamined", "CHEST"), ("StudyDescription", "CHEST PA AND SHOULDER")): None,
        (("BodyPartExamined", "THORAX"), ("SeriesDescription", "Hand 2 views")): "SeriesDescription names HAND",
    }
    for k, (attrs, want) in enumerate(cases.items()):
        h = dicom_header(_header_variant(nat, tmp_path / f"c{k}.dcm", **dict(attrs)))
        assert h["other_body_part"] == want, attrs


def test_a_default_scan_skips_for_processing_and_code_sequence_laterals_and_notes_other_body_parts(
        ingestion_cases, data_root, tmp_path):
    """Today both twins train, the laterals train as frontal films and the shoulder / abdomen films pass silently."""
    from chest_xray import scan_dataset

    root = _header_export(tmp_path / "export", ingestion_cases, data_root)
    records, rep = scan_dataset(root, workers=1)
    kept = {Path(r["path"]).name for r in records}
    skipped = {Path(s["path"]).name: s for s in rep["skipped"]}
    for name, (_, _, want) in HEADER_KINDS.items():
        if want == "kept":
            assert name in kept, name
        else:
            assert skipped[name]["kind"] == want, (name, skipped.get(name))
    assert "For Processing" in skipped["dx_for_processing.dcm"]["reason"]
    assert "View Code Sequence 'lateral'" in skipped["lateral_code_no_view.dcm"]["reason"]
    noted = {Path(n["path"]).name for n in rep["notes"] if n["kind"] == "other body part"}
    assert noted == OTHER_PARTS
    assert [f["count"] for f in rep["findings"] if f["kind"] == "other body part"] == [3]


def test_site_options_keep_for_processing_and_skip_other_body_parts_reach_the_scan(ingestion_cases, data_root,
                                                                                   tmp_path, capsys):
    from nvflare_jobs.cli import main

    root = _header_export(tmp_path / "export", ingestion_cases, data_root)
    out = tmp_path / "part"
    assert main(["partition", "--data", str(root), "--sites", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert any(ln.startswith("finding: other body part: 3 image(s)") for ln in err.splitlines()), err
    assert "for processing 2" in err
    assert main(["partition", "--data", str(root), "--sites", "1", "--out", str(tmp_path / "p2"),
                 "--keep-for-processing", "--skip-other-body-parts"]) == 0
    import json

    rep = json.loads((tmp_path / "p2" / "scan_report.json").read_text())
    skipped = {Path(s["path"]).name: s["kind"] for s in rep["skipped"]}
    assert {n for n, k in skipped.items() if k == "other body part"} == OTHER_PARTS
    assert not FOR_PROCESSING & set(skipped)


def test_site_check_warns_about_for_processing_laterals_and_notes_other_body_parts(ingestion_cases, data_root,
                                                                                   tmp_path):
    """A manifest written by hand (no partition) lists every header kind: site check said OK."""
    import yaml

    from nvflare_jobs.site_check import check_site, format_report

    root = _header_export(tmp_path / "export", ingestion_cases, data_root)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    man = tmp_path / "site.csv"
    man.write_text("path,label,split\n" + "".join(f"{p},{int(p.parent.name == 'PNEUMONIA')},{('train', 'val', 'test')[k % 3]}\n"
                                                  for k, p in enumerate(files)))
    cfg = tmp_path / "site-1.yaml"
    for keep in (False, True):
        cfg.write_text(yaml.safe_dump({"data": {"manifest": str(man)}, "model": {"family": "cnn", "depth": "shallow"},
                                       "keep_for_processing": keep}))
        rep = check_site(cfg)
        screen = format_report(rep)
        fp = [w for w in rep["warnings"] if "For Processing" in w]
        assert len(fp) == (0 if keep else 1), rep["warnings"]
        assert keep or ("dx_for_processing.dcm" in fp[0] and "dx_processing_sop_only.dcm" in fp[0])
        lat = [w for w in rep["warnings"] if "lateral view" in w]
        assert len(lat) == 1 and "left_lateral_code.dcm" in lat[0] and "lateral_code_no_view.dcm" in lat[0]
        line = [ln for ln in screen.splitlines() if "finding: other body part: 3 image(s)" in ln]
        assert len(line) == 1, screen
        assert ("finding: for processing: 2 image(s)" in screen) == keep
    cfg.write_text(yaml.safe_dump({"data": {"manifest": str(man)}, "model": {"family": "cnn", "depth": "shallow"},
                                   "skip_other_body_parts": True}))
    rep = check_site(cfg)
    other = [w for w in rep["warnings"] if "another body part" in w]
    assert len(other) == 1 and all(n in other[0] for n in ("shoulder.dcm", "abdomen.dcm", "BodyPartExamined SHOULDER"))


@pytest.mark.parametrize("ts", ["1.2.840.10008.1.2.1", "1.2.840.10008.1.2.4.70"])
def test_broken_encapsulation_under_any_syntax_is_one_line_naming_the_file(ingestion_cases, tmp_path, ts):
    """An Item tag, then an item length past the end of the data: refused in one line, never a crash."""
    import pydicom

    from chest_xray import ImageReadError, read_image

    ds = pydicom.dcmread(K.native_dicom(ingestion_cases))
    ds.PixelData = b"\xfe\xff\x00\xe0" + (10**6).to_bytes(4, "little") + b"\x00" * 1000
    ds["PixelData"].VR = "OB"
    f = _write(ds, ts, tmp_path / "broken.dcm")
    with pytest.raises(ImageReadError) as e:
        read_image(f)
    assert str(e.value).startswith(str(f)) and "\n" not in str(e.value)
    assert e.value.kind in ("corrupt or truncated", "invalid DICOM attribute")


@pytest.mark.parametrize("codec", ["jpeg2000", "rle"])
def test_other_codecs_under_a_native_syntax_are_recognised_by_their_own_markers(ingestion_cases, tmp_path, codec):
    """A JPEG 2000 code-stream (SOC/SIZ markers) or an RLE stream (its 64-byte segment header) encapsulated under
    Explicit VR Little Endian: decoded losslessly, equal to the native reference."""
    import pydicom
    from pydicom.uid import RLELossless

    from chest_xray import read_image

    nat = K.native_dicom(ingestion_cases)
    ref, _ = read_image(nat)
    if codec == "jpeg2000":
        ds = pydicom.dcmread(K.htj2k(nat, tmp_path / "j2k.dcm"))
    else:
        ds = pydicom.dcmread(nat)
        ds.compress(RLELossless)
    f = _write(ds, "1.2.840.10008.1.2.1", tmp_path / f"{codec}_under_native.dcm")
    img, meta = read_image(f)
    assert np.array_equal(img, ref)
    assert any(n["kind"] == "transfer syntax mismatch" for n in meta["grayscale_notes"])
