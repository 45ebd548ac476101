"""Ingestion, second pass: damaged JPEGs, duplicate images and leaks, anonymised patient ids, grey-scale header
quirks, DICOM directory indexes, HTJ2K and macOS file names. Every case is built in ``tmp_path`` from the shared
real images by :mod:`tests.ingestion_kinds`; nothing enters the repository.

Values are derived independently of the reader: the source file's own decode, the stored values through a LUT by
hand, the uncompressed reference, bytes copied on purpose, a PatientID written on purpose.
"""
from __future__ import annotations

import csv
import json
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from chest_xray import ImageReadError, partition_records, read_image, scan_dataset
from tests import ingestion_kinds as K
from tests.test_ingestion_field import _real_jpegs


def _names(entries) -> dict[str, str]:
    return {Path(e["path"]).name: e["kind"] for e in entries}


# ------------------------------------------------------------------------------------------ corrupt plain JPEG
def test_plain_jpeg_cut_short_or_bit_flipped_is_refused_by_name(data_root, tmp_path):
    """Pillow read these as garbage with no error (libjpeg only warns); the same stream in DICOM was refused."""
    src = _real_jpegs(data_root, "NORMAL", 1, subset="chest_xray_original")[0]
    cut = K.truncated_jpeg(src, tmp_path / "cut.jpeg")
    flip = K.bit_flipped_jpeg(src, tmp_path / "flip.jpeg", seed=0)
    extra = tmp_path / "extra.jpeg"  # harmless: 16 bytes before the end marker, same pixels
    data = src.read_bytes()
    extra.write_bytes(data[:-2] + b"\x00" * 16 + data[-2:])
    for f in (cut, flip):
        with pytest.raises(ImageReadError) as ei:
            read_image(f)
        assert ei.value.kind == "corrupt or truncated" and "premature end" in ei.value.reason
        assert str(f) in str(ei.value) and len(ei.value.reason) < 150
    ref, _ = read_image(src)
    img, meta = read_image(extra)
    assert np.array_equal(img, ref) and "extraneous bytes" in meta["decoder_warnings"]
    assert read_image(src)[1]["decoder_warnings"] is None
    root = tmp_path / "d"
    for cls, f in (("NORMAL", cut), ("PNEUMONIA", flip), ("NORMAL", src), ("PNEUMONIA", extra)):
        (root / cls).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, root / cls / f.name)
    recs, rep = scan_dataset(root)
    assert sorted(Path(r["path"]).name for r in recs) == sorted([src.name, "extra.jpeg"])
    assert _names(rep["skipped"]) == {"cut.jpeg": "corrupt or truncated", "flip.jpeg": "corrupt or truncated"}
    assert any(f["text"].startswith("skipped: corrupt or truncated: 2 file(s)") for f in rep["findings"])


# ----------------------------------------------------------------------------------------- content-hash index
def test_duplicates_grouped_contradictions_skipped_and_split_leaks_counted(data_root, tmp_path):
    n = _real_jpegs(data_root, "NORMAL", 6)
    p = _real_jpegs(data_root, "PNEUMONIA", 6)
    root = tmp_path / "export"
    for split, cls, files in (("train", "NORMAL", n[:4]), ("train", "PNEUMONIA", p[:4]), ("test", "NORMAL", n[4:]),
                              ("test", "PNEUMONIA", p[4:])):
        (root / split / cls).mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy(f, root / split / cls / f.name)
    shutil.copy(n[0], root / "train" / "NORMAL" / "IM-9001-0001-reexport.jpeg")  # same bytes, new "patient"
    shutil.copy(n[1], root / "test" / "NORMAL" / "IM-9002-0001.jpeg")  # same bytes in train and test
    shutil.copy(p[0], root / "train" / "NORMAL" / "IM-9003-0001.jpeg")  # same bytes under NORMAL and PNEUMONIA
    recs, rep = scan_dataset(root)
    by = {Path(r["path"]).name: r for r in recs}
    assert by["IM-9001-0001-reexport.jpeg"]["patient_id"] == by[n[0].name]["patient_id"]
    assert by["IM-9002-0001.jpeg"]["patient_id"] == by[n[1].name]["patient_id"]
    assert _names(rep["skipped"]) == {p[0].name: "contradictory labels", "IM-9003-0001.jpeg": "contradictory labels"}
    d = rep["duplicates"]
    assert (d["exact_groups"], d["exact_images"], d["contradictory_groups"], d["across_splits"]) == (2, 4, 1, 1)
    assert by[n[0].name]["sha256"] == by["IM-9001-0001-reexport.jpeg"]["sha256"]
    texts = [f["text"] for f in rep["findings"]]
    assert any(t.startswith("exact duplicates: 2 group(s) of 4 images") for t in texts)
    assert any(t.startswith("contradictory labels: 1 group(s)") and "IM-9003-0001.jpeg" in t for t in texts)
    assert any(t.startswith("duplicates across splits: 1 group(s)") for t in texts)
    for seed in range(5):  # never split: the twins share site and split under every seed
        res = partition_records(recs, 2, "dirichlet", alpha=0.5, seed=seed, min_per_site=1)
        where = {Path(r["path"]).name: (s, r["split"]) for s, rows in res.sites.items() for r in rows}
        assert where[n[0].name] == where["IM-9001-0001-reexport.jpeg"]
        assert where[n[1].name] == where["IM-9002-0001.jpeg"]


def test_near_duplicates_are_grouped_only_when_asked_and_distinct_images_are_not(data_root, tmp_path):
    files = _real_jpegs(data_root, "NORMAL", 20, subset="chest_xray_original")
    root = tmp_path / "d" / "NORMAL"
    root.mkdir(parents=True)
    for f in files:
        shutil.copy(f, root / f.name)
    K.reencoded_jpeg(files[0], root / "IM-9100-0001-reexport.jpeg", quality=40, scale=0.5)
    recs, rep = scan_dataset(tmp_path / "d")  # found and reported either way (partition names those that cross)
    by = {Path(r["path"]).name: r["patient_id"] for r in recs}
    assert rep["duplicates"]["near_pairs"] == 1 and not rep["duplicates"]["near_grouped"]
    assert by["IM-9100-0001-reexport.jpeg"] != by[files[0].name] and len(rep["near_pairs"]) == 1
    recs, rep = scan_dataset(tmp_path / "d", near_duplicates=True)
    by = {Path(r["path"]).name: r["patient_id"] for r in recs}
    assert rep["duplicates"]["near_pairs"] == 1  # only the re-export: 20 distinct radiographs give no pair
    assert by["IM-9100-0001-reexport.jpeg"] == by[files[0].name]


# ---------------------------------------------------------------------------------- untrusted patient ids
def test_constant_or_implausible_patient_id_is_not_trusted_for_grouping(ingestion_cases, data_root, tmp_path):
    nat = K.native_dicom(ingestion_cases)
    n, p = _real_jpegs(data_root, "NORMAL", 8), _real_jpegs(data_root, "PNEUMONIA", 8)
    root = tmp_path / "d"
    (root / "NORMAL").mkdir(parents=True)
    (root / "PNEUMONIA").mkdir()
    for k, src in enumerate(n[:3] + p[:3]):  # "ANONYMOUS" everywhere; two images share a study
        cls = "NORMAL" if k < 3 else "PNEUMONIA"
        K.dicom_from_jpeg(nat, src, root / cls / f"anon{k}.dcm", PatientID="ANONYMOUS",
                          StudyInstanceUID="1.2.3.1" if k in (0, 1) else f"1.2.3.{k + 10}")
    for k, src in enumerate(n[3:8] + p[3:8]):  # one real-looking id on 5 NORMAL and 5 PNEUMONIA images
        K.dicom_from_jpeg(nat, src, root / ("NORMAL" if k < 5 else "PNEUMONIA") / f"shared{k}.dcm",
                          PatientID="P-0077", StudyInstanceUID="1.2.3.99")
    recs, rep = scan_dataset(root, salt="s")
    pid = {Path(r["path"]).name: r["patient_id"] for r in recs}
    assert len(recs) == 16 and pid["anon0.dcm"] == pid["anon1.dcm"]  # the study tells them together
    assert len({pid[f"anon{k}.dcm"] for k in range(6)}) == 5
    assert len({pid[f"shared{k}.dcm"] for k in range(10)}) == 10  # the study is as implausible: one per image
    ids = rep["patient_ids"]
    assert (ids["untrusted_ids"], ids["images"], ids["by_study"], ids["per_image"]) == (2, 16, 6, 10)
    text = next(f["text"] for f in rep["findings"] if f["kind"] == "untrusted patient id")
    assert "a placeholder value: 1" in text and "each of two classes: 1" in text
    assert "ANONYMOUS" not in json.dumps(rep) and "P-0077" not in json.dumps(rep)


# -------------------------------------------------------------------------------------- grey-scale attributes
def test_voi_lut_descriptor_16_bit_with_12_bit_data_is_scaled_by_the_data(ingestion_cases, tmp_path):
    import pydicom

    f, lut = K.voi_lut_16_bit_descriptor(K.native_dicom(ingestion_cases), tmp_path / "agfa.dcm")
    img, meta = read_image(f)
    stored = pydicom.dcmread(f).pixel_array
    expected = lut[np.clip(stored, 0, 4095)] / 4095.0  # the LUT by hand, scaled by its 12-bit data
    np.testing.assert_allclose(img, expected, atol=1e-6)
    assert meta["voi"] == "lut" and [n["kind"] for n in meta["grayscale_notes"]] == ["VOI LUT rescaled"]
    assert "16-bit" in meta["grayscale_notes"][0]["note"] and "12-bit" in meta["grayscale_notes"][0]["note"]


@pytest.mark.parametrize("descriptor, vr, rescaled", [([4096, 0, 12], "US", False), ([4096, 0, 16], "OW", True),
                                                       ([0, 0, 16], "OW", True), ([4096, 0, 8], "US", True),
                                                       ([3000, 1000, 16], "US", True)])
def test_voi_lut_read_by_its_data_whatever_the_descriptor_says(ingestion_cases, tmp_path, descriptor, vr, rescaled):
    """65536 entries (descriptor 0), OW words, a descriptor narrower than the data (pydicom overflowed and the LUT
    was dropped), a first mapped value of 1000: the LUT applied by hand, scaled by its data's 12 bits."""
    import pydicom

    f, data = K.voi_lut(K.native_dicom(ingestion_cases), tmp_path / "lut.dcm", descriptor, vr)
    img, meta = read_image(f)
    stored = pydicom.dcmread(f).pixel_array.astype(np.int64)
    expected = data[np.clip(stored - descriptor[1], 0, len(data) - 1)] / 4095.0
    np.testing.assert_allclose(img, expected, atol=1e-6)
    assert meta["voi"] == "lut" and bool(meta["grayscale_notes"]) == rescaled


def test_presentation_lut_shape_inverse_rule(ingestion_cases, tmp_path):
    nat = K.native_dicom(ingestion_cases)
    plain, _ = read_image(nat)
    m2, meta = read_image(K.presentation_inverse(nat, tmp_path / "m2.dcm"))
    np.testing.assert_allclose(m2, 1.0 - plain, atol=1e-6)
    assert meta["inverted"] and meta["grayscale_notes"][0]["kind"] == "polarity contradiction"
    m1, meta1 = read_image(K.presentation_inverse(nat, tmp_path / "m1.dcm", photometric="MONOCHROME1"))
    np.testing.assert_allclose(m1, 1.0 - plain, atol=1e-6)  # consistent pair: inverted once, never twice
    assert meta1["grayscale_notes"] == []


def test_pixel_padding_is_left_out_of_the_range_and_shown_black(ingestion_cases, tmp_path):
    import pydicom

    f = K.padded(K.native_dicom(ingestion_cases), tmp_path / "pad.dcm", border=24, value=0)
    img, meta = read_image(f)
    a = pydicom.dcmread(f).pixel_array.astype(np.float64)
    pad = a == 0
    lo, hi = a[~pad].min(), a[~pad].max()  # the fallback range of the radiograph itself, by hand
    expected = np.where(pad, 0.0, (a - lo) / (hi - lo))
    np.testing.assert_allclose(img, expected, atol=1e-6)
    assert [n["kind"] for n in meta["grayscale_notes"]] == ["pixel padding"]
    assert f"{int(pad.sum())} pixels" in meta["grayscale_notes"][0]["note"]


# ------------------------------------------------------------------------------------------- decoders
def test_jpeg_extended_12_bit_is_decoded_by_gdcm(ingestion_cases, tmp_path, monkeypatch):
    nat = K.native_dicom(ingestion_cases)
    f = K.jpeg_extended_12_bit(nat, tmp_path / "ext12.dcm", quality=95)
    img, meta = read_image(f)
    ref, _ = read_image(nat)
    assert meta["transfer_syntax"] == "JPEG Extended (Process 2 and 4)" and img.shape == ref.shape
    diff = np.abs(img.astype(np.float64) - ref)
    assert diff.max() < 16 / 4093 and diff.mean() < 2 / 4093  # lossy at quality 95: a few 12-bit units
    import chest_xray.io._dicom as dicom_reader

    monkeypatch.setattr(dicom_reader, "needs_direct_gdcm", lambda ds: False)  # as pydicom's plugins alone do
    with pytest.raises(ImageReadError) as ei:
        read_image(f)
    assert ei.value.kind == "no decoder" and "no installed decoder" in ei.value.reason
    assert len(ei.value.reason) < 260 and "\n" not in ei.value.reason


def test_htj2k_decodes_and_its_hint_names_a_decoder_that_handles_it(ingestion_cases, tmp_path, monkeypatch):
    import pydicom
    from pydicom.pixels import get_decoder
    from pydicom.uid import HTJ2KLossless

    nat = K.native_dicom(ingestion_cases)
    f = K.htj2k(nat, tmp_path / "ht.dcm")
    img, meta = read_image(f)
    assert meta["transfer_syntax"].startswith("High-Throughput JPEG 2000")
    np.testing.assert_array_equal(img, read_image(nat)[0])  # lossless
    assert pydicom.dcmread(f).file_meta.TransferSyntaxUID == HTJ2KLossless
    monkeypatch.setattr(get_decoder(HTJ2KLossless), "_available", {})  # as if pylibjpeg were absent
    with pytest.raises(ImageReadError) as ei:
        read_image(f)
    assert ei.value.kind == "no decoder" and "pylibjpeg-openjpeg" in ei.value.reason
    assert "python-gdcm" not in ei.value.reason


def test_dicomdir_in_a_class_folder_is_a_directory_index(ingestion_cases, data_root, tmp_path):
    root = tmp_path / "d"
    (root / "NORMAL").mkdir(parents=True)
    (root / "PNEUMONIA").mkdir()
    K.dicomdir(K.native_dicom(ingestion_cases), root / "PNEUMONIA")
    shutil.copy(root / "PNEUMONIA" / "DICOMDIR", root / "DICOMDIR")  # the export's own index, beside the classes
    shutil.copy(K.native_dicom(ingestion_cases), root / "PNEUMONIA" / "IMG0001")
    shutil.copy(_real_jpegs(data_root, "NORMAL", 1)[0], root / "NORMAL" / "n.jpeg")
    recs, rep = scan_dataset(root)
    assert sorted(Path(r["path"]).name for r in recs) == ["IMG0001", "n.jpeg"]
    assert sorted((str(Path(s["path"]).relative_to(root)), s["kind"]) for s in rep["skipped"]) == [
        ("DICOMDIR", "directory index"), ("PNEUMONIA/DICOMDIR", "directory index")]
    with pytest.raises(ImageReadError) as ei:
        read_image(root / "PNEUMONIA" / "DICOMDIR")
    assert ei.value.kind == "directory index"


# ------------------------------------------------------------------------------------------- file names
def test_nfd_file_names_match_an_nfc_manifest(data_root, tmp_path):
    from chest_xray.partition import read_site_manifest

    src = _real_jpegs(data_root, "NORMAL", 2) + _real_jpegs(data_root, "PNEUMONIA", 2)
    names = ["Röntgen_1.jpeg", "Säugling_2.jpeg", "Lungenentzündung_3.jpeg", "plain_4.jpeg"]
    folder = tmp_path / K.nfd_name("Bilder_März")
    folder.mkdir()
    for f, name in zip(src, names):
        shutil.copy(f, folder / K.nfd_name(name))
    rows = [f"Bilder_März/{name},{'NORMAL' if k < 2 else 'PNEUMONIA'}" for k, name in enumerate(names)]
    m = tmp_path / "m.csv"
    m.write_text("path,label\n" + "\n".join(unicodedata.normalize("NFC", r) for r in rows) + "\n", encoding="utf-8")
    recs, rep = scan_dataset(m)
    assert len(recs) == 4 and rep["skipped"] == []
    assert all(Path(r["path"]).exists() for r in recs)
    notes = [n for n in rep["notes"] if n["kind"] == "name normalisation"]
    assert len(notes) == 4 and "NFD on disk, NFC in the manifest" in notes[0]["note"]
    site = tmp_path / "site.csv"
    site.write_text("path,label,split\n" + "\n".join(f"{unicodedata.normalize('NFC', r.split(',')[0])},0,train"
                                                     for r in rows) + "\n", encoding="utf-8")
    assert all(Path(r["path"]).exists() for r in read_site_manifest(site))


# --------------------------------------------------------------------------------- every kind: partition, site check
def test_partition_and_site_check_on_a_folder_holding_every_kind(ingestion_cases, data_root, tmp_path, capsys):
    import yaml

    from nvflare_jobs.cli import main
    from nvflare_jobs.site_check import check_site, format_report

    root = tmp_path / "export"
    want = K.every_kind(root, ingestion_cases, data_root)
    out = tmp_path / "part"
    assert main(["partition", "--data", str(root), "--sites", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    rep = json.loads((out / "scan_report.json").read_text())
    assert _names(rep["skipped"]) == {k: v for k, v in want.items() if v != "kept"}
    with open(out / "sites" / "site-1.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(Path(r["path"]).name for r in rows) == sorted(k for k, v in want.items() if v == "kept")
    pid = {Path(r["path"]).name: r["patient_id"] for r in rows}
    assert sum(v == pid["IM-9999-0001-reexport.jpeg"] for v in pid.values()) == 2  # with its twin, no other
    assert len({pid[f"anon_{k}.dcm"] for k in range(6)}) == 6
    kinds = ("exact duplicates", "contradictory labels", "untrusted patient id", "VOI LUT rescaled",
             "polarity contradiction", "pixel padding", "skipped: corrupt or truncated", "skipped: directory index")
    lines = [ln for ln in err.splitlines() if ln.startswith("finding: ")]
    for kind in kinds[:6]:
        assert sum(ln.startswith(f"finding: {kind}: ") for ln in lines) == 1, (kind, lines)
    head = next(ln for ln in err.splitlines() if ln.startswith("skipped 5 file(s) ("))  # skips: counted, listed
    assert "corrupt or truncated 2" in head and "directory index 1" in head and "contradictory labels 2" in head
    assert "ANONYMOUS" not in err and "SYN-c08" not in err
    # the NFC-typed manifest of the same folder
    assert main(["partition", "--data", str(root / "manifest.csv"), "--sites", "1", "--out", str(tmp_path / "m")]) == 0
    assert "finding: name normalisation: 1 manifest row(s)" in capsys.readouterr().err
    # site check on the partition's manifest prints the same findings, one line each
    cfg = tmp_path / "site-1.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"manifest": str(out / "sites" / "site-1.csv")},
                                   "model": {"family": "cnn", "depth": "shallow"}}))
    screen = format_report(check_site(cfg))
    shown = [ln.strip() for ln in screen.splitlines() if ln.strip().startswith("finding: ")]
    for kind in kinds:
        hit = [ln for ln in shown if ln.startswith((f"finding: {kind}: ", f"finding: at scan: {kind}: "))]
        assert len(hit) == 1, (kind, shown)
    assert "ANONYMOUS" not in screen and "SYN-c08" not in screen
