"""Safety: no DICOM patient field, image path or image file name of a site ever reaches the server.

A small simulator job runs on data that includes the three real DICOM files of ../shared/data/dicom (they carry
patient names); afterwards every file of the server's workspace (its logs, the results it received, the job
config) is searched for the patient names and IDs, the DICOM file names and the data folders."""
from __future__ import annotations

import csv
import json

import pytest

from tests.deploy_helpers import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_dicom_patient_fields_never_reach_the_server(tmp_path, data_root):
    pydicom = pytest.importorskip("pydicom")
    from chest_xray import read_image

    dicoms = sorted((data_root / "dicom").glob("*.dcm"))
    if not dicoms:
        pytest.skip(f"no DICOM files in {data_root / 'dicom'}")
    secrets = set()
    for f in dicoms:
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        for tag in ("PatientName", "PatientID", "OtherPatientNames", "PatientBirthDate"):
            v = str(ds.get(tag, "") or "").strip()
            if len(v) >= 6:
                secrets.add(v)
                secrets.update(part for part in v.split("^") if len(part) >= 6)
        secrets.add(f.stem)  # file names (one is a SOP instance UID)
        img, meta = read_image(f)  # the site can read every one of them
        assert img.ndim == 2 and meta["format"] == "DICOM"
    assert any("^" in s or len(s) > 20 for s in secrets), secrets

    # a CSV data root (path,label): 40 real JPEGs + the 3 DICOMs
    base = data_root / "chest_xray_224" / "train"
    rows = [(p, "NORMAL") for p in sorted((base / "NORMAL").glob("*.jpeg"))[:20]]
    rows += [(p, "PNEUMONIA") for p in sorted((base / "PNEUMONIA").glob("*.jpeg"))[:20]]
    rows += [(f, "PNEUMONIA" if i % 2 else "NORMAL") for i, f in enumerate(dicoms)]
    data_csv = tmp_path / "data.csv"
    with data_csv.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        w.writerows((str(p), lab) for p, lab in rows)

    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "local", "--data", str(data_csv), "--sites", "2", "--rounds", "1",
                "--local-epochs", "1", "--input-sizes", "32", "--batch-size", "8", "--out", str(run), timeout=360)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]

    # the DICOMs were really used by a site (they are in the sites' manifests)
    used = set()
    for man in (run / "partition" / "sites").glob("*.csv"):
        used |= {row["path"] for row in csv.DictReader(man.open())}
    assert {str(f.resolve()) for f in dicoms} <= used
    m = json.loads((run / "metrics.json").read_text())
    for site, b in m["sites"].items():  # both sites trained and evaluated (the DICOM site included)
        assert b["n_train"] and b["test"] and b["test"]["n"] == b["n_test"] > 0, site

    # (error reasons a site sends are redacted too: the site manifests' folder must not appear either)
    forbidden = secrets | {str(data_root), str((data_root / "dicom").resolve()), str(base), str(data_csv),
                           str(run / "partition")}
    server_ws = run / "workspace" / "server"
    files = [p for p in server_ws.rglob("*") if p.is_file()]
    assert any(p.name == "server_results.json" for p in files)
    leaks = []
    for p in files:
        blob = p.read_bytes()
        for s in forbidden:
            if s.encode() in blob:
                leaks.append(f"{p.relative_to(server_ws)}: {s}")
    assert not leaks, "patient data reached the server:\n" + "\n".join(leaks)
    # the run folder a coordinator reads (assembled from what the server received) is clean too
    for name in ("metrics.json", "sites.csv", "rounds.csv", "test_predictions.csv"):
        if (run / name).is_file():
            text = (run / name).read_text(errors="replace")
            assert not [s for s in secrets if s in text], name
