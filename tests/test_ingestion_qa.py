"""Ingestion QA beyond the field cases: hospital-export inputs a first-time user tried that were lost, mislabelled or
mis-explained. Every file is built in ``tmp_path`` from the shared real images; nothing enters the repository.

Each test checks a value derived independently of the scanner: the known class counts of the files copied, the
PatientID written into a DICOM copy, the exact rows of a hand-written manifest.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chest_xray import ImageReadError, detect_layout, read_image, scan_dataset
from tests.test_ingestion_field import _edit_dicom, _patch_bytes, _real_jpegs

REPO = Path(__file__).resolve().parents[1]


def _rg1(data_root: Path) -> Path:
    f = data_root / "dicom" / "RG1_UNCR.dcm"
    if not f.is_file():
        pytest.skip(f"real DICOM not found: {f}")
    return f


# ------------------------------------------------------------------------ class folders in any case, strays
def test_class_and_split_folders_match_in_any_case_and_unlabelled_images_are_listed(data_root, tmp_path):
    """A Linux export with ``train/Normal``, ``train/pneumonia`` and ``Test/NORMAL`` lost the lower-case classes
    without a word (whole PNEUMONIA class gone); an image in an unknown class folder (COVID) or loose in a split
    folder was not listed either."""
    normal = _real_jpegs(data_root, "NORMAL", 4)
    pneu = _real_jpegs(data_root, "PNEUMONIA", 4)
    root = tmp_path / "export"
    for d, files in ((root / "train" / "Normal", normal[:2]), (root / "train" / "pneumonia", pneu[:3]),
                     (root / "Test" / "NORMAL", normal[2:3]), (root / "train" / "COVID", pneu[3:])):
        d.mkdir(parents=True)
        for f in files:
            shutil.copy(f, d / f.name)
    shutil.copy(normal[3], root / "train" / normal[3].name)  # loose in a split folder
    (root / "README.txt").write_text("export of 2026-11-30\n")  # documentation: not listed
    (root / "MANIFEST.csv").write_text("file,label\n")

    assert detect_layout(root) == "kaggle"
    recs, rep = scan_dataset(root, verify=False)
    assert rep["per_class"] == {"NORMAL": 3, "PNEUMONIA": 3}
    assert {Path(r["path"]).name for r in recs} == {f.name for f in normal[:3] + pneu[:3]}
    skipped = {s["path"]: s for s in rep["skipped"]}
    assert set(skipped) == {str(root / "train" / "COVID"), str(root / "train" / normal[3].name)}
    assert all(s["kind"] == "not in a class folder" for s in skipped.values())
    assert "COVID" in skipped[str(root / "train" / "COVID")]["reason"]
    assert rep["n_files"] == 6 + 2

    flat = tmp_path / "flat"
    for d, files in ((flat / "normal", normal[:2]), (flat / "Pneumonia", pneu[:2])):
        d.mkdir(parents=True)
        for f in files:
            shutil.copy(f, d / f.name)
    assert detect_layout(flat) == "classes"
    _, rep = scan_dataset(flat, verify=False)
    assert rep["per_class"] == {"NORMAL": 2, "PNEUMONIA": 2} and rep["skipped"] == []


# ------------------------------------------------------------------ DICOM whatever its name: checks + patient id
def test_dicom_named_like_a_jpeg_gets_dicom_checks_and_its_patient_id(data_root, tmp_path):
    """A DICOM object saved as ``.jpg`` / ``.png`` (or under a UID name) was read, but as a non-DICOM file: its
    PatientID was ignored (a patient's images could land in train and test) and a lateral view was kept."""
    src = _rg1(data_root)
    d = tmp_path / "d" / "PNEUMONIA"
    d.mkdir(parents=True)
    _edit_dicom(src, d / "a.dcm", PatientID="QA-PATIENT-7")
    _edit_dicom(src, d / "b.jpg", PatientID="QA-PATIENT-7")
    _edit_dicom(src, d / "1.2.840.99.7", PatientID="QA-PATIENT-7")  # UID name: suffix ".7"
    _edit_dicom(src, d / "c.png", PatientID="QA-PATIENT-8", ViewPosition="LL")
    for f in _real_jpegs(data_root, "NORMAL", 1):
        (tmp_path / "d" / "NORMAL").mkdir()
        shutil.copy(f, tmp_path / "d" / "NORMAL" / f.name)
    recs, rep = scan_dataset(tmp_path / "d", verify=False, salt="s")
    by = {Path(r["path"]).name: r for r in recs if r["label"] == 1}
    assert set(by) == {"a.dcm", "b.jpg", "1.2.840.99.7"}
    assert len({r["patient_id"] for r in by.values()}) == 1 and by["a.dcm"]["patient_id"].startswith("dcm-")
    assert [(Path(s["path"]).name, s["kind"]) for s in rep["skipped"]] == [("c.png", "lateral view")]


# ---------------------------------------------------------------------------- manifest rows: dup, conflict
def test_manifest_duplicate_conflicting_empty_and_folder_rows_are_listed(data_root, tmp_path):
    """A manifest listing a file twice trained on it twice; a file listed as NORMAL and as PNEUMONIA was used with
    both labels; an empty path or a folder was called an 'unsupported file type'."""
    n = _real_jpegs(data_root, "NORMAL", 3)
    p = _real_jpegs(data_root, "PNEUMONIA", 2)
    lines = ["path,label", f"{n[0]},normal", f"{n[1]},NORMAL", f"{p[0]},Pneumonia", f"{n[0]},NORMAL",
             f"{n[2]},NORMAL", f"{p[1]},PNEUMONIA", f"{n[2]},PNEUMONIA", ",NORMAL", f"{n[0].parent},NORMAL"]
    m = tmp_path / "m.csv"
    m.write_text("\n".join(lines) + "\n")
    recs, rep = scan_dataset(m, verify=False)
    assert sorted((r["path"], r["label"]) for r in recs) == sorted(
        [(str(n[0]), 0), (str(n[1]), 0), (str(p[0]), 1), (str(p[1]), 1)])
    got = sorted((s["kind"], s["reason"].split(":")[0]) for s in rep["skipped"])
    assert got == sorted([("duplicate manifest row", "manifest line 5"), ("conflicting labels", "manifest line 6"),
                          ("conflicting labels", "manifest line 8"), ("manifest row", "manifest line 9"),
                          ("not a regular file", "a folder, not an image file")])
    dup = next(s for s in rep["skipped"] if s["kind"] == "duplicate manifest row")
    assert dup["path"] == str(n[0]) and "line 2" in dup["reason"]
    for conf in (s for s in rep["skipped"] if s["kind"] == "conflicting labels"):
        assert conf["path"] == str(n[2]) and "NORMAL, PNEUMONIA" in conf["reason"]
    assert rep["n_files"] == len(lines) - 1


def test_a_manifest_label_given_as_index_and_as_name_of_one_class_is_a_duplicate_not_a_conflict(data_root, tmp_path):
    """``0`` and ``NORMAL`` (and, binary, ``1`` / ``PNEUMONIA``; subtype, ``1`` / ``PNEUMONIA`` of a
    ``_bacteria_`` file) name one class: the file is used once with its class and the later row is a duplicate
    saying so; ``0`` and ``PNEUMONIA`` stay a conflict, and so does ``2`` (VIRAL) for a bacteria file."""
    n = _real_jpegs(data_root, "NORMAL", 2)
    p = _real_jpegs(data_root, "PNEUMONIA", 1)  # person1000_bacteria_2931.jpeg: BACTERIAL under subtype
    assert "_bacteria_" in p[0].name
    m = tmp_path / "m.csv"
    m.write_text("\n".join(["path,label", f"{n[0]},0", f"{n[0]},NORMAL", f"{p[0]},PNEUMONIA", f"{p[0]},1",
                            f"{n[1]},0", f"{n[1]},PNEUMONIA"]) + "\n")
    recs, rep = scan_dataset(m, verify=False)
    assert sorted((r["path"], r["label"]) for r in recs) == sorted([(str(n[0]), 0), (str(p[0]), 1)])
    got = sorted((Path(s["path"]).name, s["kind"], s["reason"]) for s in rep["skipped"])
    assert got == sorted([
        (n[0].name, "duplicate manifest row", "manifest line 3: duplicate of line 2 (same file; labels 0 and NORMAL "
                                              "name one class)"),
        (p[0].name, "duplicate manifest row", "manifest line 5: duplicate of line 4 (same file; labels PNEUMONIA "
                                              "and 1 name one class)"),
        (n[1].name, "conflicting labels", "manifest line 6: the file is listed with conflicting labels (0, "
                                          "PNEUMONIA); none is used"),
        (n[1].name, "conflicting labels", "manifest line 7: the file is listed with conflicting labels (0, "
                                          "PNEUMONIA); none is used")])
    m.write_text("\n".join(["path,label", f"{p[0]},PNEUMONIA", f"{p[0]},1", f"{n[0]},2", f"{n[0]},VIRAL"]) + "\n")
    recs, rep = scan_dataset(m, labels="subtype", verify=False)
    assert sorted((r["path"], r["label"]) for r in recs) == sorted([(str(p[0]), 1), (str(n[0]), 2)])
    assert sorted(s["kind"] for s in rep["skipped"]) == ["duplicate manifest row", "duplicate manifest row"]
    m.write_text("\n".join(["path,label", f"{p[0]},2", f"{p[0]},PNEUMONIA"]) + "\n")
    recs, rep = scan_dataset(m, labels="subtype", verify=False)
    assert recs == [] and [s["kind"] for s in rep["skipped"]] == ["conflicting labels", "conflicting labels"]



@pytest.mark.parametrize("rows", [("NORMAL", "COVID"), ("COVID", "NORMAL"), ("0", "5"), ("5", "NORMAL", "1")])
def test_a_label_of_no_class_beside_a_valid_row_of_the_file_is_refused_not_a_conflict(data_root, tmp_path, rows):
    """A file listed once as ``COVID`` (or ``5`` under binary) is refused by name (LabelError, exit 2 in partition);
    listed as ``COVID`` and also as ``NORMAL`` it was called a label conflict and skipped, exit 0. The unknown
    label is the refusal either way, in whichever row it is."""
    from chest_xray.dataset import LabelError

    n = _real_jpegs(data_root, "NORMAL", 2)
    m = tmp_path / "m.csv"
    m.write_text("\n".join(["path,label", f"{n[1]},0", *(f"{n[0]},{r}" for r in rows)]) + "\n")
    bad = next(r for r in rows if r in ("COVID", "5"))
    with pytest.raises(LabelError, match=rf"1 file\(s\) have a label .*{n[0].name}.*\b{bad}\b"):
        scan_dataset(m, verify=False)


# ------------------------------------------------------------------------------- DICOM attribute problems
def test_dicom_attribute_problems_are_named_not_misfiled(data_root, tmp_path):
    """Missing Photometric Interpretation was called a 'colour DICOM'; Rows that do not match the pixel data were
    called 'multi-frame'; a Rescale Slope of 0 gave an all-white image that was trained on; a Rescale Slope with a
    decimal comma was silently ignored."""
    src = _rg1(data_root)
    cases = {
        "nophoto.dcm": (_edit_dicom(src, tmp_path / "nophoto.dcm", PhotometricInterpretation=None),
                        "Photometric Interpretation missing"),
        "rows.dcm": (_edit_dicom(src, tmp_path / "rows.dcm", Rows=10), "does not match Rows 10"),
        "slope0.dcm": (_edit_dicom(src, tmp_path / "slope0.dcm", RescaleSlope="0", RescaleIntercept="0"),
                       "Rescale Slope 0"),
        "comma.dcm": (_patch_bytes(_edit_dicom(src, tmp_path / "comma.dcm", RescaleSlope="7.25",
                                               RescaleIntercept="0"), b"7.25", b"7,25"), "'7,25'"),
    }
    for name, (path, words) in cases.items():
        with pytest.raises(ImageReadError) as ei:
            read_image(path)
        assert ei.value.kind == "invalid DICOM attribute", (name, ei.value.kind, ei.value.reason)
        assert words in ei.value.reason and str(path) in str(ei.value), (name, str(ei.value))
    # a valid slope still reads (values: the stored pixels x 2, scaled; the same picture as slope 1)
    a1, _ = read_image(_edit_dicom(src, tmp_path / "s1.dcm", RescaleSlope="1", RescaleIntercept="0",
                                   WindowCenter=None, WindowWidth=None))
    a2, _ = read_image(_edit_dicom(src, tmp_path / "s2.dcm", RescaleSlope="2", RescaleIntercept="0",
                                   WindowCenter=None, WindowWidth=None))
    assert float(abs(a1 - a2).max()) < 1e-6


# ------------------------------------------------------------------------------------------- permissions
_READ_UNREADABLE = """
import sys
from chest_xray import ImageReadError, read_image, scan_dataset
try:
    read_image(sys.argv[1])
except ImageReadError as e:
    print("READ", e.kind, "|", e.reason)
for verify in (True, False):
    _, rep = scan_dataset(sys.argv[2], verify=verify)
    print("SCAN", [(s["kind"], s["reason"]) for s in rep["skipped"]])
"""


def test_unreadable_file_is_named_unreadable_not_corrupt(data_root, tmp_path):
    """A file the process may not read (mode 000) was listed as 'corrupt or truncated' with a Python errno text."""
    root = tmp_path / "d"
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        for f in _real_jpegs(data_root, cls, 1):
            shutil.copy(f, root / cls / f.name)
    locked = root / "NORMAL" / "locked.jpeg"
    shutil.copy(_real_jpegs(data_root, "NORMAL", 2)[1], locked)
    os.chmod(locked, 0)
    os.chmod(tmp_path, 0o755)
    cmd = [sys.executable, "-c", _READ_UNREADABLE, str(locked), str(root)]
    if os.geteuid() == 0:  # root reads mode-000 files: drop the capabilities that allow it
        setpriv = shutil.which("setpriv")
        if not setpriv:
            pytest.skip("running as root without setpriv: cannot make a file unreadable")
        caps = "-dac_override,-dac_read_search"
        cmd = [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", *cmd]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "READ unreadable | cannot open file (Permission denied)" in r.stdout, r.stdout
    want = "SCAN [('unreadable', 'cannot open file (Permission denied)')]"
    assert r.stdout.count(want) == 2, r.stdout


# ----------------------------------------------------------------------- predict: DICOM exported without suffix
def test_predict_collects_dicom_files_without_an_image_suffix(data_root, tmp_path):
    """``cxr-hfl predict --data folder`` skipped, without a word, DICOM files named as PACS and CD exports name
    them (``IM000001``, a UID), while ``partition`` read them."""
    from nvflare_jobs.evaluation import collect_files

    src = _rg1(data_root)
    d = tmp_path / "scans" / "SE0001"
    d.mkdir(parents=True)
    shutil.copy(src, d / "IM000001")
    shutil.copy(src, d / "1.2.840.99.8")
    (d / "notes").write_text("not an image\n")
    jpg = _real_jpegs(data_root, "NORMAL", 1)[0]
    shutil.copy(jpg, tmp_path / "scans" / "a.jpeg")
    got = [f.relative_to(tmp_path / "scans").as_posix() for f in collect_files([str(tmp_path / "scans")])]
    assert got == ["SE0001/1.2.840.99.8", "SE0001/IM000001", "a.jpeg"]


# ------------------------------------------------------------------------------- inspect on edited folders
def test_inspect_on_hand_edited_partition_folders(data_root, tmp_path, capsys):
    """``inspect`` gave a traceback for a partition.json without seed or with class_names null, counted a row
    whose label is outside the classes in no class (silently), and for ``--png FOLDER`` wrote FOLDER.png beside
    the folder while printing 'chart -> FOLDER'."""
    import json

    from nvflare_jobs.cli import main
    from tests.sim_helpers import make_partition

    part = make_partition(data_root, tmp_path / "p", 2, max_images=24)
    charts = tmp_path / "charts"
    charts.mkdir()
    assert main(["inspect", str(part), "--png", str(charts)]) == 0
    assert (charts / "inspect.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "charts.png").exists()
    assert main(["inspect", str(part), "--png", str(tmp_path / "chart")]) == 0  # no suffix: exactly that path
    assert (tmp_path / "chart").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    doc = json.loads((part / "partition.json").read_text())
    (part / "partition.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "seed"}))
    assert main(["inspect", str(part)]) == 0
    capsys.readouterr()
    (part / "partition.json").write_text(json.dumps({**doc, "class_names": None}))
    assert main(["inspect", str(part)]) == 2
    assert "class_names" in capsys.readouterr().err

    (part / "partition.json").write_text(json.dumps(doc))
    site = part / "sites" / "site-1.csv"
    lines = site.read_text().splitlines()
    cells = lines[1].split(",")
    cells[1] = "7"
    site.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert main(["inspect", str(part)]) == 2
    err = capsys.readouterr().err
    assert f"{site}:2: label 7" in err and "Traceback" not in err


# --------------------------------------------------------------------- every bad label at once, one-line listing
def test_every_unusable_manifest_label_is_named_in_one_error(data_root, tmp_path, capsys):
    """A manifest with several unusable labels stopped at the first one, so each fix cost a full rerun."""
    from nvflare_jobs.cli import main

    n = _real_jpegs(data_root, "NORMAL", 6)
    rows = ["path,label", f"{n[0]},NORMAL", f"{n[1]},cat", f"{n[2]},", f"{n[3]},Normal", f"{n[4]},7",
            f"{n[5]},EDEMA"]
    m = tmp_path / "m.csv"
    m.write_text("\n".join(rows) + "\n")
    assert main(["partition", "--data", str(m), "--sites", "1", "--out", str(tmp_path / "p"), "--no-verify"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "4 file(s) have a label that cannot be used" in err, err
    assert all(str(f) in err for f in (n[1], n[2], n[4])) and "and 1 more" in err
    assert not (tmp_path / "p").exists()


def test_skipped_file_listing_stays_one_line_per_file(data_root, tmp_path, capsys):
    """A skipped file whose name holds a newline split the partition's listing over two lines."""
    from nvflare_jobs.cli import main

    root = tmp_path / "d"
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        for f in _real_jpegs(data_root, cls, 3):
            shutil.copy(f, root / cls / f.name)
    (root / "NORMAL" / "two\nlines.jpeg").write_bytes(b"not a jpeg")
    assert main(["partition", "--data", str(root), "--sites", "1", "--out", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err.splitlines()
    listed = [line for line in err if "lines.jpeg" in line]
    assert listed == [f"  {root / 'NORMAL'}/two\\nlines.jpeg: not a recognised image format (JPEG, PNG or DICOM "
                      "expected)"], err


# ------------------------------------------------------------------- compressed DICOM that the decoder only warns on
def _jpeg_baseline_dicom_with_frame(data_root: Path, dest: Path, edit) -> Path:
    """Copy of the real JPEG Baseline CR with its JPEG frame edited (re-encapsulated, so the DICOM is valid)."""
    import pydicom
    from pydicom.encaps import encapsulate, generate_fragments

    src = data_root / "dicom" / "1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819.dcm"
    if not src.is_file():
        pytest.skip(f"real DICOM not found: {src}")
    ds = pydicom.dcmread(src)
    frame = b"".join(generate_fragments(ds.PixelData))
    frame = frame[: frame.rfind(b"\xff\xd9") + 2]  # without the even-length pad byte
    ds.PixelData = encapsulate([edit(frame)])
    ds.save_as(dest)
    return src


def test_truncated_jpeg_in_dicom_is_refused_and_decoder_noise_is_captured(data_root, tmp_path, capfd):
    """A JPEG Baseline DICOM whose JPEG stream stops at 60 % decoded 'OK' (the rest of the image grey) because
    libjpeg only warns; its warning went straight to the terminal naming no file. A harmless warning (extra bytes
    before the end marker: the pixels are identical) is kept as a note, not printed."""
    cut = tmp_path / "cut.dcm"
    src = _jpeg_baseline_dicom_with_frame(data_root, cut, lambda f: f[: int(len(f) * 0.6)] + b"\xff\xd9")
    extra = tmp_path / "extra.dcm"
    _jpeg_baseline_dicom_with_frame(data_root, extra, lambda f: f[:-2] + b"\x00" * 16 + f[-2:])
    capfd.readouterr()
    with pytest.raises(ImageReadError) as ei:
        read_image(cut)
    assert ei.value.kind == "corrupt or truncated" and "premature end of data segment" in ei.value.reason
    ref, _ = read_image(src)
    img, meta = read_image(extra)
    assert np_max_abs(img - ref) == 0.0
    assert meta["decoder_warnings"].startswith("Corrupt JPEG data: ")
    assert meta["decoder_warnings"].endswith(" extraneous bytes before marker 0xd9")
    out = capfd.readouterr()
    assert "JPEG" not in out.err and "JPEG" not in out.out, out

    root = tmp_path / "d"
    (root / "PNEUMONIA").mkdir(parents=True)
    (root / "NORMAL").mkdir()
    shutil.copy(cut, root / "PNEUMONIA" / "cut.dcm")
    shutil.copy(extra, root / "PNEUMONIA" / "extra.dcm")
    shutil.copy(_real_jpegs(data_root, "NORMAL", 1)[0], root / "NORMAL" / "n.jpeg")
    recs, rep = scan_dataset(root)
    assert sorted(Path(r["path"]).name for r in recs) == ["extra.dcm", "n.jpeg"]
    assert [(Path(s["path"]).name, s["kind"]) for s in rep["skipped"]] == [("cut.dcm", "corrupt or truncated")]
    assert [(Path(n["path"]).name, n["kind"]) for n in rep["notes"]] == [("extra.dcm", "decoder warning")]


def np_max_abs(a) -> float:
    import numpy as np

    return float(np.abs(a).max())


# ----------------------------------------------------------------------- predict: symbolic links like partition
def test_predict_follows_linked_folders_once_and_never_leaves_the_input(data_root, tmp_path):
    """``predict --data folder`` silently skipped images in a symbolically linked sub-folder (which ``partition``
    reads), and must not follow a link up to a parent folder (that would predict files outside the input)."""
    import csv

    import torch

    from hfl_components.models import build_model
    from nvflare_jobs.evaluation import predict_files

    a, b, c = _real_jpegs(data_root, "NORMAL", 3)
    (tmp_path / "real").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "in").mkdir()
    shutil.copy(a, tmp_path / "in" / "a.jpeg")
    shutil.copy(b, tmp_path / "real" / "b.jpeg")
    shutil.copy(c, tmp_path / "outside" / "c.jpeg")
    (tmp_path / "in" / "linked").symlink_to("../real")
    (tmp_path / "in" / "up").symlink_to("..")
    spec = {"family": "cnn", "depth": "shallow", "width": 1.0, "in_channels": 1, "num_classes": 2}
    torch.manual_seed(0)
    from hfl_components.models import save_model_file

    save_model_file(tmp_path / "m.pt", spec, build_model(spec).state_dict(), input_size=32, labels="binary")
    s = predict_files(tmp_path / "m.pt", [str(tmp_path / "in")], tmp_path / "p.csv")
    rows = {r["path"]: r for r in csv.DictReader((tmp_path / "p.csv").open())}
    assert set(rows) == {str(tmp_path / "in" / "a.jpeg"), str(tmp_path / "in" / "linked" / "b.jpeg"),
                         str(tmp_path / "in" / "up")}
    assert rows[str(tmp_path / "in" / "linked" / "b.jpeg")]["status"] == "ok"
    assert rows[str(tmp_path / "in" / "up")]["status"] == "skipped" and "not followed" in rows[
        str(tmp_path / "in" / "up")]["reason"]
    assert (s["n_ok"], s["n_skipped"]) == (2, 1)


# ----------------------------------------------------------------------------- hand-written site manifests
def test_hand_written_site_manifest_with_the_columns_the_readme_names(data_root, tmp_path):
    """The README's site manifest is ``path,label,split[,patient_id,width,height]``, but a hand-written one without
    the optional columns was refused ('manifest lacks columns'); a split written 'Train' gave the site no training
    images without a word; an unknown split or an empty path was kept."""
    from chest_xray import read_site_manifest

    n = _real_jpegs(data_root, "NORMAL", 2)
    m = tmp_path / "site.csv"
    m.write_text(f"path,label,split\n{n[0]},0,Train\n{n[1].name},1,TEST\n")
    rows = read_site_manifest(m)
    assert rows == [
        {"path": str(n[0]), "label": 0, "split": "train", "patient_id": n[0].name.split("-0001")[0], "width": 0,
         "height": 0},
        {"path": str(tmp_path / n[1].name), "label": 1, "split": "test", "patient_id": n[1].name.split("-0001")[0],
         "width": 0, "height": 0}]
    m.write_text(f"path,label,split\n{n[0]},0,training\n")
    with pytest.raises(ValueError, match=r"site.csv:2: .*split 'training'"):
        read_site_manifest(m)
    m.write_text("path,label,split\n,0,train\n")
    with pytest.raises(ValueError, match=r"site.csv:2: .*empty path"):
        read_site_manifest(m)
    m.write_text(f"path,label\n{n[0]},0\n")
    with pytest.raises(ValueError, match=r"lacks columns \['split'\]"):
        read_site_manifest(m)


def test_header_only_scan_names_a_decompression_bomb_too_large(data_root, tmp_path):
    """With ``--no-verify`` a 20000 x 20000 PNG (a few kB on disk) was listed as 'corrupt or truncated'; an
    8000 x 8000 one (over our 50 MP limit, under Pillow's error limit) printed Pillow's warning."""
    import warnings

    from PIL import Image

    root = tmp_path / "d"
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        for f in _real_jpegs(data_root, cls, 1):
            shutil.copy(f, root / cls / f.name)
    Image.new("L", (20000, 20000)).save(root / "NORMAL" / "bomb.png")
    Image.new("L", (8000, 8000)).save(root / "NORMAL" / "big.png")
    for verify in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            recs, rep = scan_dataset(root, verify=verify)
        assert len(recs) == 2
        assert {Path(s["path"]).name: s["kind"] for s in rep["skipped"]} == {"bomb.png": "too large",
                                                                              "big.png": "too large"}


def test_decoder_message_capture_is_safe_across_threads(data_root, tmp_path):
    """The capture redirects the process-wide file descriptor 2; decodes in threads must take turns, or one thread
    restores another's redirection and stderr ends in a deleted temporary file."""
    from concurrent.futures import ThreadPoolExecutor

    cut, extra = tmp_path / "cut.dcm", tmp_path / "extra.dcm"
    _jpeg_baseline_dicom_with_frame(data_root, cut, lambda f: f[: int(len(f) * 0.6)] + b"\xff\xd9")
    _jpeg_baseline_dicom_with_frame(data_root, extra, lambda f: f[:-2] + b"\x00" * 16 + f[-2:])
    before = os.fstat(2)

    def kind(p):
        try:
            return "ok" if read_image(p)[1]["decoder_warnings"] else "silent"
        except ImageReadError as e:
            return e.kind

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(kind, [cut, extra] * 8))
    assert got == ["corrupt or truncated", "ok"] * 8
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
