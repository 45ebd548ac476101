"""scan_dataset: layouts, label schemes, patient ids, scan report of skipped files."""
from __future__ import annotations

import csv
import zlib

import numpy as np
import pytest
from PIL import Image

from chest_xray import CLASS_NAMES, LabelError, detect_layout, label_index, patient_id_from_name, scan_dataset

from tests.test_data_io import write_dicom


def _jpeg(path, w=40, h=30, value=128):
    """A flat grey image, with two corner blocks set from the file's path so that no two files hold the same bytes
    (same bytes under two classes are contradictory duplicates, skipped by the scan)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    a = np.full((h, w), value, np.uint8)
    crc = zlib.crc32(str(path).encode())
    a[:8, :8], a[8:16, :8] = crc % 256, (crc >> 8) % 256
    Image.fromarray(a).save(path)
    return path


def test_patient_ids_from_kermany_names():
    assert patient_id_from_name("/x/person1003_virus_1685.jpeg") == "person1003"
    assert patient_id_from_name("person7_bacteria_29.jpeg") == "person7"
    assert patient_id_from_name("IM-0656-0001-0002.jpeg") == "IM-0656"
    assert patient_id_from_name("NORMAL2-IM-0383-0001.jpeg") == "NORMAL2-IM-0383"
    assert patient_id_from_name("scan_42.png") == "scan_42"


def test_label_schemes():
    assert label_index("NORMAL", "a.jpeg") == 0
    assert label_index("pneumonia", "person1_virus_2.jpeg") == 1
    assert label_index("PNEUMONIA", "person1_bacteria_2.jpeg", "subtype") == 1
    assert label_index("PNEUMONIA", "person1_virus_2.jpeg", "subtype") == 2
    assert label_index("NORMAL", "IM-0001-0001.jpeg", "subtype") == 0
    assert label_index("VIRAL", "x.png", "subtype") == 2
    assert label_index("1", "x.png") == 1
    with pytest.raises(LabelError, match="x.jpeg.*subtype"):
        label_index("PNEUMONIA", "x.jpeg", "subtype")
    with pytest.raises(LabelError, match="unknown class"):
        label_index("EDEMA", "y.png")
    with pytest.raises(ValueError, match="label scheme"):
        label_index("NORMAL", "y.png", "ternary")


def test_kaggle_layout_with_bad_files_reported(tmp_path):
    _jpeg(tmp_path / "train/NORMAL/IM-0001-0001.jpeg", 50, 40)
    _jpeg(tmp_path / "train/NORMAL/IM-0001-0002.jpeg", 60, 40)
    _jpeg(tmp_path / "val/PNEUMONIA/person3_virus_7.jpeg", 70, 40)
    _jpeg(tmp_path / "test/PNEUMONIA/person4_bacteria_9.jpeg", 80, 40)
    (tmp_path / "train/NORMAL/broken.jpeg").write_text("not an image")
    (tmp_path / "train/NORMAL/empty.jpeg").write_bytes(b"")
    (tmp_path / "train/NORMAL/notes.txt").write_text("hello")
    (tmp_path / "train/NORMAL/.DS_Store").write_bytes(b"\x00")
    assert detect_layout(tmp_path) == "kaggle"
    recs, rep = scan_dataset(tmp_path)
    assert [r["label"] for r in recs] == [1, 0, 0, 1]  # sorted by path: test/, train/, val/
    assert {r["patient_id"] for r in recs} == {"IM-0001", "person3", "person4"}
    by_name = {r["path"].rsplit("/", 1)[1]: r for r in recs}
    assert by_name["IM-0001-0002.jpeg"]["width"] == 60 and by_name["IM-0001-0002.jpeg"]["height"] == 40
    assert all(r["path"].startswith("/") for r in recs)
    reasons = {s["path"].rsplit("/", 1)[1]: s["reason"] for s in rep["skipped"]}
    assert set(reasons) == {"broken.jpeg", "empty.jpeg", "notes.txt", ".DS_Store"}
    assert "empty" in reasons["empty.jpeg"] and "unsupported" in reasons["notes.txt"]
    assert "junk" in reasons[".DS_Store"]
    assert rep["skipped_by_reason"] == {"empty file": 1, "junk": 1, "not an image": 1, "unsupported file type": 1}
    assert rep["n_records"] == 4 and rep["per_class"] == {"NORMAL": 2, "PNEUMONIA": 2} and rep["n_patients"] == 3
    recs_s, rep_s = scan_dataset(tmp_path, labels="subtype")
    assert sorted(r["label"] for r in recs_s) == [0, 0, 1, 2]
    assert rep_s["class_names"] == CLASS_NAMES["subtype"]


def test_subtype_unknown_is_an_error(tmp_path):
    _jpeg(tmp_path / "PNEUMONIA/patient9.jpeg")
    _jpeg(tmp_path / "NORMAL/a.jpeg")
    recs, _ = scan_dataset(tmp_path, labels="binary")
    assert len(recs) == 2
    with pytest.raises(LabelError, match="patient9.jpeg"):
        scan_dataset(tmp_path, labels="subtype")


def test_class_folders_and_dicom_patient_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("CXR_PATIENT_SALT", "test-salt")
    _jpeg(tmp_path / "NORMAL/n1.png")
    write_dicom(tmp_path / "PNEUMONIA/p1.dcm", rows=16, cols=24)
    write_dicom(tmp_path / "PNEUMONIA/p2.dcm", rows=16, cols=24)  # same PatientID -> same patient
    write_dicom(tmp_path / "PNEUMONIA/ct.dcm", modality="CT")
    write_dicom(tmp_path / "PNEUMONIA/lat.dcm", ViewPosition="LL")
    write_dicom(tmp_path / "PNEUMONIA/sr.dcm", pixels=False)
    assert detect_layout(tmp_path) == "classes"
    recs, rep = scan_dataset(tmp_path)
    names = {r["path"].rsplit("/", 1)[1]: r for r in recs}
    assert set(names) == {"n1.png", "p1.dcm", "p2.dcm"}
    assert names["p1.dcm"]["patient_id"] == names["p2.dcm"]["patient_id"]
    assert names["p1.dcm"]["patient_id"].startswith("dcm-") and "SECRET" not in names["p1.dcm"]["patient_id"]
    assert (names["p1.dcm"]["width"], names["p1.dcm"]["height"]) == (24, 16)
    reasons = {s["path"].rsplit("/", 1)[1]: s["reason"] for s in rep["skipped"]}
    assert "modality CT" in reasons["ct.dcm"] and "lateral" in reasons["lat.dcm"]
    assert "no pixel data" in reasons["sr.dcm"]
    assert "SECRET" not in repr(rep) and "Doe" not in repr(rep)
    recs2, _ = scan_dataset(tmp_path, allow_lateral=True, allow_any_modality=True)
    assert len(recs2) == 5


def test_csv_manifest(tmp_path):
    _jpeg(tmp_path / "img/a.jpeg")
    _jpeg(tmp_path / "img/b.jpeg")
    _jpeg(tmp_path / "img/c.jpeg")
    m = tmp_path / "list.csv"
    with open(m, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "patient_id"])
        w.writerows([["img/a.jpeg", "NORMAL", "p1"], ["img/b.jpeg", "1", "p1"], ["img/c.jpeg", "PNEUMONIA", ""],
                     ["img/missing.jpeg", "NORMAL", "p2"]])
    assert detect_layout(m) == "manifest"
    recs, rep = scan_dataset(m)
    assert [(r["label"], r["patient_id"]) for r in recs] == [(0, "p1"), (1, "p1"), (1, "c")]
    assert [s["path"].rsplit("/", 1)[1] for s in rep["skipped"]] == ["missing.jpeg"]
    bad = tmp_path / "bad.csv"
    bad.write_text("file,class\nx,y\n")
    with pytest.raises(ValueError, match="path and label"):
        scan_dataset(bad)


def test_unrecognised_root(tmp_path):
    with pytest.raises(ValueError, match="unrecognised data root"):
        scan_dataset(tmp_path)
    with pytest.raises(FileNotFoundError):
        scan_dataset(tmp_path / "missing")


def test_real_original_dataset(data_root):
    root = data_root / "chest_xray_original"
    if not root.is_dir():
        pytest.skip(f"{root} missing")
    recs, rep = scan_dataset(root, labels="subtype", verify=False)
    assert rep["layout"] == "kaggle" and not rep["skipped"]
    assert rep["per_class"] == {"NORMAL": 330, "BACTERIAL": 260, "VIRAL": 260}
    assert rep["n_patients"] == 774
    widths = [r["width"] for r in recs]
    assert min(widths) == 437 and max(widths) == 2890


def test_threaded_scan_matches_one_file_after_the_other(tmp_path, monkeypatch):
    """workers=4 verifies files in threads: same records, report (skips, notes, counts) and label error as
    workers=1, and the process-wide warnings filters are left as they were."""
    import warnings

    monkeypatch.setenv("CXR_PATIENT_SALT", "test-salt")
    rng = np.random.default_rng(0)
    for i in range(12):  # noise, so that a cut file misses real entropy-coded data
        for cls, pid in (("NORMAL", f"IM-{i:04d}-0001"), ("PNEUMONIA", f"person{i}_virus_{i}")):
            p = tmp_path / "train" / cls / f"{pid}.jpeg"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (64 + i, 80), dtype=np.uint8)).save(p, quality=90)
    good = (tmp_path / "train/NORMAL/IM-0003-0001.jpeg").read_bytes()
    (tmp_path / "train/NORMAL/IM-0100-0001.jpeg").write_bytes(good[: len(good) // 2])  # truncated JPEG
    (tmp_path / "train/PNEUMONIA/person200_bacteria_1.jpeg").write_bytes(b"")  # 0 bytes
    (tmp_path / "test/PNEUMONIA").mkdir(parents=True)
    write_dicom(tmp_path / "test/PNEUMONIA/person300_virus_2.dcm", rows=16, cols=24)
    write_dicom(tmp_path / "test/PNEUMONIA/person301_virus_3.dcm", ViewPosition="LL")
    _jpeg(tmp_path / "test/PNEUMONIA/patient9.jpeg")  # no bacteria / virus: a label error under "subtype"
    one = scan_dataset(tmp_path, workers=1)
    filters = list(warnings.filters)  # after the first scan: a decoder plugin's first import may add its own
    four = scan_dataset(tmp_path, workers=4)
    assert four == one
    recs, rep = one
    assert rep["n_records"] == 26 and len(recs) == 26  # 24 good JPEGs + one DICOM + patient9 (fine under binary)
    assert [r["path"] for r in recs] == sorted(r["path"] for r in recs)
    reasons = {s["path"].rsplit("/", 1)[1]: s["kind"] for s in rep["skipped"]}
    assert reasons == {"IM-0100-0001.jpeg": "corrupt or truncated", "person200_bacteria_1.jpeg": "empty file",
                       "person301_virus_3.dcm": "lateral view"}
    errors = []
    for w in (1, 4):
        with pytest.raises(LabelError, match="patient9.jpeg") as e:
            scan_dataset(tmp_path, labels="subtype", workers=w)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert warnings.filters == filters
    with pytest.raises(ValueError, match="workers"):
        scan_dataset(tmp_path, workers=0)
    monkeypatch.setenv("CXR_SCAN_WORKERS", "many")
    with pytest.raises(ValueError, match="CXR_SCAN_WORKERS"):
        scan_dataset(tmp_path)


def test_first_patient_salt_is_one_salt_under_threads(tmp_path, monkeypatch):
    """On a machine without a salt file, threads (and processes) asking for it at once all get the same, non-empty
    salt; the scan hashes every DICOM with it (a race once skipped a file with FileExistsError or hashed with '')."""
    import hashlib
    import stat
    import threading

    from chest_xray.io import site_salt

    monkeypatch.delenv("CXR_PATIENT_SALT", raising=False)
    for trial in range(10):
        home = tmp_path / f"cfg{trial}"
        monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
        barrier, got, errors = threading.Barrier(8), [], []

        def ask():
            barrier.wait()
            try:
                got.append(site_salt())
            except Exception as e:  # noqa: BLE001 -- collected and asserted below
                errors.append(repr(e))

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        f = home / "cxr-hfl" / "patient_salt"
        assert errors == [] and len(got) == 8
        assert set(got) == {f.read_text()} and len(got[0]) == 32
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert sorted(p.name for p in f.parent.iterdir()) == ["patient_salt"]  # no temporary file left
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "fresh"))
    for i in range(16):
        write_dicom(tmp_path / f"data/NORMAL/IM{i:04d}", rows=16, cols=24)
    recs, rep = scan_dataset(tmp_path / "data", workers=8, verify=False)
    salt = (tmp_path / "fresh/cxr-hfl/patient_salt").read_text()
    expected = "dcm-" + hashlib.sha256((salt + "\x00" + "SECRET-12345").encode()).hexdigest()[:16]
    assert rep["skipped"] == [] and [r["patient_id"] for r in recs] == [expected] * 16


def test_unusable_patient_salt_stops_the_scan_with_one_line(tmp_path, monkeypatch):
    """An empty salt file (an interrupted older version) is replaced, never used as the salt ''; a salt that cannot
    be created stops the scan with an error naming the file (not every DICOM skipped as 'unreadable')."""
    from chest_xray.io import PatientSaltError, site_salt
    from nvflare_jobs.cli import main

    monkeypatch.delenv("CXR_PATIENT_SALT", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    (tmp_path / "cfg/cxr-hfl").mkdir(parents=True)
    (tmp_path / "cfg/cxr-hfl/patient_salt").write_text("")
    s = site_salt()
    assert len(s) == 32 and (tmp_path / "cfg/cxr-hfl/patient_salt").read_text() == s
    (tmp_path / "blocker").write_text("a file where the config folder should be")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "blocker"))
    write_dicom(tmp_path / "data/NORMAL/IM0001", rows=16, cols=24)
    _jpeg(tmp_path / "data/PNEUMONIA/person1_virus_1.jpeg")
    for w in (1, 4):
        with pytest.raises(PatientSaltError, match="blocker/cxr-hfl/patient_salt.*CXR_PATIENT_SALT"):
            scan_dataset(tmp_path / "data", workers=w)
    assert main(["partition", "--data", str(tmp_path / "data"), "--sites", "1", "--out", str(tmp_path / "p")]) == 2
    assert not (tmp_path / "p").exists()


def test_first_dicom_read_in_a_thread_leaves_no_stray_warning_on_the_console(tmp_path):
    """pydicom's first import (pydicom.data -> requests -> urllib3) adds a warnings filter and relies on it; done in
    a scan thread while another thread sat in a warnings scope, the filter was swapped out and urllib3's SOCKS
    DependencyWarning appeared in the middle of `cxr-hfl site check` (4 reader threads, 7 of 8 runs). Here one
    thread enters and leaves warnings scopes (as JPEG opens do) while the main thread reads the first DICOM of a
    fresh interpreter: stderr stays empty, and the DICOM reads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    dcm = write_dicom(tmp_path / "IM0001", rows=16, cols=24)
    code = f"""
import sys, threading
sys.setswitchinterval(1e-6)  # threads take turns every few bytecodes: the race shows in (nearly) every run
from chest_xray.io import warnings_scope, read_image
stop = threading.Event()
def churn():
    while not stop.is_set():
        with warnings_scope():
            pass
t = threading.Thread(target=churn)
t.start()
try:
    img, meta = read_image({str(dcm)!r})
finally:
    stop.set()
    t.join()
print(meta["format"], img.shape)
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "CXR_PATIENT_SALT": "x"}
    env.pop("PYTHONWARNINGS", None)
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                           timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "DICOM (16, 24)", r.stderr[-2000:]
        assert r.stderr == ""
