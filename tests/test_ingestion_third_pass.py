"""Ingestion, third pass: variants of the second pass's families that a fresh tester found open.

- File names holding control characters (a newline, a carriage return, a terminal escape) or undecodable bytes
  must not break the "one line per file" rule of ``partition`` and ``site check``, nor reach a terminal raw.
- Patient ids that differ only in letter case or whitespace (``PAT01``, ``pat01``, `` PAT01 ``; in a manifest or
  in DICOM PatientID) name one patient: they are grouped together, never split, and the constant-id rule sees
  them as one id.

Every case is built in ``tmp_path`` from the shared real images; nothing enters the repository.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from chest_xray import scan_dataset
from tests import ingestion_kinds as K
from tests.test_ingestion_field import _real_jpegs

ODD = ("cut\nfake line: OK.jpeg", "cut\x1b[31mred.jpeg", "cut\rback.jpeg")


def _one_line_each(text: str, names) -> None:
    """Every line mentioning a case names it escaped; no raw control character reaches the screen."""
    assert "\x1b" not in text and "\r" not in text
    assert not any(ln.startswith("fake line") for ln in text.splitlines())
    for esc in ("cut\\nfake line: OK.jpeg", "cut\\x1b[31mred.jpeg", "cut\\rback.jpeg"):
        assert sum(esc in ln for ln in text.splitlines()) >= 1, (esc, text)


@pytest.mark.skipif(os.name == "nt", reason="POSIX file names")
def test_control_characters_in_file_names_stay_on_one_escaped_line(data_root, tmp_path, capsys):
    import yaml

    from nvflare_jobs.cli import main
    from nvflare_jobs.site_check import check_site, format_report

    n, p = _real_jpegs(data_root, "NORMAL", 7), _real_jpegs(data_root, "PNEUMONIA", 6)
    root = tmp_path / "export"
    for cls, files in (("NORMAL", n[:5]), ("PNEUMONIA", p[:5])):
        (root / cls).mkdir(parents=True)
        for f in files:
            shutil.copy(f, root / cls / f.name)
    data = n[5].read_bytes()
    for name in ODD:  # cut short: skipped, listed by name
        (root / "NORMAL" / name).write_bytes(data[: len(data) // 2])
    shutil.copy(n[6], root / "NORMAL" / "dup\rx.jpeg")  # the same bytes under two classes: named in the reason
    shutil.copy(n[6], root / "PNEUMONIA" / "dup\x1b[2Jy.jpeg")
    out = tmp_path / "part"
    assert main(["partition", "--data", str(root), "--sites", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    _one_line_each(err, ODD)
    assert "dup\\rx.jpeg" in err and "dup\\x1b[2Jy.jpeg" in err
    rep = json.loads((out / "scan_report.json").read_text())
    assert {Path(s["path"]).name for s in rep["skipped"]} == {*ODD, "dup\rx.jpeg", "dup\x1b[2Jy.jpeg"}
    # site check on a manifest listing the damaged files: one escaped line per unreadable file
    site_csv = out / "sites" / "site-1.csv"
    with open(site_csv, "a", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        for k, name in enumerate(ODD):
            w.writerow([str(root / "NORMAL" / name), 0, "test", f"Z{k}", 0, 0])
    cfg = tmp_path / "site-1.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"manifest": str(site_csv)}, "model": {"family": "cnn", "depth": "shallow"}}))
    screen = format_report(check_site(cfg))
    _one_line_each(screen, ODD)
    assert sum(ln.strip().startswith("line ") for ln in screen.splitlines()) == len(ODD)


def _manifest(path: Path, rows) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "patient_id"])
        w.writerows(rows)
    return path


def test_manifest_patient_ids_differing_in_case_or_whitespace_are_one_patient(data_root, tmp_path):
    n, p = _real_jpegs(data_root, "NORMAL", 12), _real_jpegs(data_root, "PNEUMONIA", 12)
    img = tmp_path / "img"
    img.mkdir()
    rows = []
    spellings = ("PAT01", "pat01", " PAT01 ", "Pat01\t", "PAT 02", "pat  02")
    for k, f in enumerate(n[:6]):  # six NORMAL images of two patients, spelled six ways
        shutil.copy(f, img / f.name)
        rows.append([str(img / f.name), "NORMAL", spellings[k]])
    for k, f in enumerate(n[6:] + p):  # others: one patient each
        shutil.copy(f, img / f.name)
        rows.append([str(img / f.name), "NORMAL" if k < 6 else "PNEUMONIA", f"Q{k}"])
    recs, rep = scan_dataset(_manifest(tmp_path / "m.csv", rows))
    pid = {Path(r["path"]).name: r["patient_id"] for r in recs}
    assert len({pid[f.name] for f in n[:4]}) == 1 and len({pid[f.name] for f in n[4:6]}) == 1
    assert pid[n[0].name] == "PAT01" and pid[n[4].name] == "PAT 02"  # the first spelling is kept
    assert rep["n_patients"] == 2 + 18
    # one id on 5 NORMAL and 5 PNEUMONIA images, spelled in two cases: the constant-id rule sees one id
    rows2 = [[str(img / f.name), "NORMAL", "ab12"] for f in n[:5]] + \
            [[str(img / f.name), "PNEUMONIA", "AB12"] for f in p[:5]]
    recs2, rep2 = scan_dataset(_manifest(tmp_path / "m2.csv", rows2))
    assert rep2["patient_ids"]["untrusted_ids"] == 1 and rep2["patient_ids"]["per_image"] == 10
    assert len({r["patient_id"] for r in recs2}) == 10
    assert "ab12" not in json.dumps(rep2).lower()


def test_dicom_patient_ids_differing_in_case_or_whitespace_are_one_patient(ingestion_cases, data_root, tmp_path):
    nat = K.native_dicom(ingestion_cases)
    n = _real_jpegs(data_root, "NORMAL", 6)
    p = _real_jpegs(data_root, "PNEUMONIA", 3)
    root = tmp_path / "d"
    (root / "NORMAL").mkdir(parents=True)
    (root / "PNEUMONIA").mkdir()
    for k, src in enumerate(n):  # one patient, three spellings, three studies
        K.dicom_from_jpeg(nat, src, root / "NORMAL" / f"c{k}.dcm", PatientID=("hosp123", "HOSP123", "Hosp 123")[k % 3]
                          if k < 4 else "hosp123", StudyInstanceUID=f"1.2.3.{k}", PatientName="DOE^JANE")
    for k, src in enumerate(p):
        K.dicom_from_jpeg(nat, src, root / "PNEUMONIA" / f"q{k}.dcm", PatientID=f"Q{k}", StudyInstanceUID=f"1.2.4.{k}")
    recs, rep = scan_dataset(root, salt="s")
    pid = {Path(r["path"]).name: r["patient_id"] for r in recs}
    assert len({pid[f"c{k}.dcm"] for k in (0, 1, 3, 4, 5)}) == 1  # hosp123 / HOSP123 one patient
    assert pid["c2.dcm"] != pid["c0.dcm"]  # "Hosp 123" is another spelling: inner whitespace counts
    text = json.dumps(rep)
    assert "hosp123" not in text.lower() and "DOE" not in text
