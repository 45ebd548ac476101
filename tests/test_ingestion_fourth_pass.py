"""Ingestion, fourth pass: raw lossless JPEG frames saved as ``.jpg``, decoders that crash, near duplicates that
cross a site or split, and patient folders of one counter series (Horos / OsiriX exports).

Every case is built in ``tmp_path`` from the shared real images; nothing enters the repository. Reading a case
that used to kill the interpreter runs in a child process, so that a regression fails the test instead of the
test run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chest_xray import scan_dataset
from tests import jpeg_frames as J
from tests.test_ingestion_field import _real_jpegs

REPO = Path(__file__).resolve().parents[1]
NATIVE = "jpeg_lossless_sv1_reference_native.dcm"
LOSSLESS = "jpeg_lossless_sv1.dcm"


def _child(code: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter of this repository (argv[1:] = ``args``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _lossless_8_bit(data_root: Path, dest: Path) -> tuple[Path, np.ndarray]:
    """A real Kermany radiograph (grey, 1/4 size) as an 8-bit JPEG Lossless frame, and its pixels."""
    from PIL import Image

    src = _real_jpegs(data_root, "NORMAL", 1, "chest_xray_original")[0]
    with Image.open(src) as im:
        a = np.asarray(im.convert("L"))[::4, ::4].copy()
    return J.gdcm_frame(a, dest, 8), a


def _lossless_12_bit(cases: Path, dest: Path) -> tuple[Path, np.ndarray]:
    """The field case's JPEG Lossless (SV1) frame, 12-bit, as it sits in the DICOM file, and its native pixels."""
    import pydicom

    for name in (LOSSLESS, NATIVE):
        if not (cases / name).is_file():
            pytest.skip(f"field case not found: {cases / name}")
    return J.dicom_frame(cases / LOSSLESS, dest), pydicom.dcmread(cases / NATIVE).pixel_array


_READ = r'''
import sys, numpy as np
from chest_xray.io import read_image
a, m = read_image(sys.argv[1], target_size=int(sys.argv[3]) or None)
np.save(sys.argv[2], a)
print(m["format"], m["bit_depth"], m["original_width"], m["original_height"], m.get("jpeg_process"))
'''


@pytest.mark.parametrize("bits", [8, 12])
def test_a_lossless_jpeg_frame_saved_as_jpg_reads_exactly_in_a_process_that_survives(data_root, tmp_path, bits):
    from tests.conftest import find_cases_root

    if bits == 8:
        f, ref = _lossless_8_bit(data_root, tmp_path / "frame8.jpg")
    else:
        f, ref = _lossless_12_bit(find_cases_root(), tmp_path / "frame12.jpg")
    assert f.read_bytes()[:4] == b"\xff\xd8\xff\xc3"  # SOI, then the lossless frame header (SOF3)
    for target in (0, 64):  # the scan's and training's target sizes: no draft scaling of a lossless frame
        r = _child(_READ, f, tmp_path / "out.npy", target)
        assert r.returncode == 0, r.stderr[-500:]
        assert r.stdout.split() == ["JPEG", str(bits), str(ref.shape[1]), str(ref.shape[0]), "lossless"]
        got = np.load(tmp_path / "out.npy")
        np.testing.assert_array_equal(np.rint(got * (2**bits - 1)).astype(np.int64), ref.astype(np.int64))


def test_the_strict_jpeg_check_never_sees_a_lossless_frame(data_root, tmp_path):
    f, _ = _lossless_8_bit(data_root, tmp_path / "frame8.jpg")
    r = _child("import sys\nfrom pathlib import Path\nfrom chest_xray.io import jpeg_entropy_problem\n"
               "print(jpeg_entropy_problem(Path(sys.argv[1])))", f)
    assert r.returncode == 0 and r.stdout.strip() == "(None, None)", (r.returncode, r.stderr[-300:])


def test_without_gdcm_a_lossless_frame_is_refused_by_name(data_root, tmp_path):
    f, _ = _lossless_8_bit(data_root, tmp_path / "frame8.jpg")
    code = ("import sys, json\nsys.modules['gdcm'] = None  # import gdcm -> ImportError\n"
            "from pathlib import Path\nfrom chest_xray.io import ImageReadError, pil_size, read_image\nout = []\n"
            "for call in (read_image, pil_size):\n"
            "    try:\n        call(Path(sys.argv[1])); out.append(None)\n"
            "    except ImageReadError as e:\n        out.append([e.kind, str(e)])\n"
            "print(json.dumps(out))")
    r = _child(code, f)
    assert r.returncode == 0, r.stderr[-300:]
    for kind, text in json.loads(r.stdout):
        assert kind == "no decoder" and text.startswith(str(f)) and "lossless JPEG not supported" in text


def test_a_lossless_frame_cut_short_is_refused_as_truncated_not_read_grey(data_root, tmp_path):
    f, _ = _lossless_8_bit(data_root, tmp_path / "frame8.jpg")
    data = f.read_bytes()
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(data[: len(data) // 2] + b"\xff\xd9")  # an interrupted copy that still "ends"
    r = _child("import sys\nfrom chest_xray.io import ImageReadError, read_image\ntry:\n    read_image(sys.argv[1])\n"
               "except ImageReadError as e:\n    print(e.kind + '|' + e.reason)", cut)
    assert r.returncode == 0, r.stderr[-300:]
    kind, reason = r.stdout.strip().split("|", 1)
    assert kind == "corrupt or truncated" and "premature end" in reason.lower()


def test_scan_keeps_lossless_frames_with_their_sizes_verified_or_not(data_root, tmp_path):
    from tests.conftest import find_cases_root

    root = tmp_path / "site"
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        for src in _real_jpegs(data_root, cls, 2):
            (root / cls / src.name).write_bytes(src.read_bytes())
    f8, a8 = _lossless_8_bit(data_root, root / "NORMAL" / "frame8.jpg")
    f12, a12 = _lossless_12_bit(find_cases_root(), root / "PNEUMONIA" / "frame12.jpg")
    code = ("import sys, json\nfrom chest_xray import scan_dataset\n"
            "recs, rep = scan_dataset(sys.argv[1], verify=sys.argv[2] == '1')\n"
            "print(json.dumps({'recs': recs, 'skipped': rep['skipped']}))")
    for verify in ("1", "0"):
        r = _child(code, root, verify)
        assert r.returncode == 0, r.stderr[-500:]
        out = json.loads(r.stdout)
        assert out["skipped"] == []
        size = {Path(x["path"]).name: (x["width"], x["height"]) for x in out["recs"]}
        assert size["frame8.jpg"] == (a8.shape[1], a8.shape[0]) and size["frame12.jpg"] == (a12.shape[1], a12.shape[0])
        assert len(size) == 6


# ------------------------------------------------------------------------------------- no decoder takes a site down
def _sleep_on_negative(x: int) -> int:
    import time

    if x < 0:
        time.sleep(60)
    return x * 2


def _die_on_three(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), 11)  # SIGSEGV, as a decoder's bad pointer
    return x + 1


def test_map_isolated_survives_a_crash_and_a_hang_and_names_only_those_items():
    from chest_xray.io.worker import Crash, map_isolated

    out = map_isolated(_die_on_three, list(range(7)), workers=2)
    assert [o for k, o in enumerate(out) if k != 3] == [1, 2, 3, 5, 6, 7]
    assert isinstance(out[3], Crash) and out[3].kind == "decoder crash" and "SIGSEGV" in out[3].reason
    out = map_isolated(_sleep_on_negative, [1, -1, 2], workers=1, timeout_s=1.0)
    assert out[0] == 2 and out[2] == 4 and isinstance(out[1], Crash) and out[1].kind == "decoder timeout"
    with pytest.raises(ZeroDivisionError):  # an ordinary exception is the caller's, not a crash
        map_isolated(lambda x: 1 // x, [1, 0], workers=1)


_CRASHING_SCAN = r'''
import sys, json
from pathlib import Path
import simplejpeg
from chest_xray import dataset, scan_dataset
real = dataset._scan_file

def strict_first(path, *a, **kw):  # today's strict check, before any routing: a lossless frame crashes it
    simplejpeg.decode_jpeg(Path(path).read_bytes(), colorspace="GRAY", min_factor=8, min_height=1, min_width=1,
                           strict=True) \
        if path.name == "crasher.jpg" else None
    return real(path, *a, **kw)

dataset._scan_file = strict_first
recs, rep = scan_dataset(sys.argv[1], workers=int(sys.argv[2]))
print(json.dumps({"recs": [r["path"] for r in recs], "skipped": rep["skipped"]}))
'''


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in relies on fork inheriting a patched module")
@pytest.mark.parametrize("workers", [1, 2])  # the real decoder crash: libjpeg-turbo's strict decode of an SOF3 frame
def test_a_file_that_crashes_the_decoder_is_one_skip_naming_it_and_the_scan_goes_on(data_root, tmp_path, workers):
    root = tmp_path / "site"
    for cls in ("NORMAL", "PNEUMONIA"):
        (root / cls).mkdir(parents=True)
        for src in _real_jpegs(data_root, cls, 3):
            (root / cls / src.name).write_bytes(src.read_bytes())
    bad, _ = _lossless_8_bit(data_root, root / "NORMAL" / "crasher.jpg")
    r = _child(_CRASHING_SCAN, root, workers)
    assert r.returncode == 0, r.stderr[-500:]
    out = json.loads(r.stdout)
    assert len(out["recs"]) == 6 and str(bad) not in out["recs"]
    [skip] = out["skipped"]
    assert skip["path"] == str(bad) and skip["kind"] == "decoder crash" and "crashed" in skip["reason"]


@pytest.mark.slow  # site check builds the model: ~40 s on a shared 2-core machine
def test_site_check_names_a_file_that_crashes_the_decoder_and_writes_its_report(data_root, tmp_path, monkeypatch):
    import csv

    import yaml

    from nvflare_jobs import site_check

    files = _real_jpegs(data_root, "NORMAL", 3) + _real_jpegs(data_root, "PNEUMONIA", 3)
    crasher = tmp_path / "crasher.jpeg"
    crasher.write_bytes(files[0].read_bytes())
    man = tmp_path / "site.csv"
    with open(man, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k, f in enumerate(files + [crasher]):
            w.writerow([f, int(k >= 3), ("train", "val", "test")[k % 3], f"P{k}"])
    cfg = tmp_path / "site.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"manifest": str(man)}, "model": {"family": "cnn", "depth": "shallow"}}))
    real = site_check._read_one

    def read_or_die(row, size):  # a stand-in for a decoder that segfaults on this one file (inherited by fork)
        if row["path"].endswith("crasher.jpeg"):
            os.kill(os.getpid(), 11)
        return real(row, size)

    if sys.platform != "linux":
        pytest.skip("the stand-in relies on fork inheriting a patched module")
    monkeypatch.setattr(site_check, "_read_one", read_or_die)
    rep = site_check.check_site(cfg)
    [bad] = rep["unreadable"]
    assert bad["path"] == str(crasher) and "crashed" in bad["reason"] and bad["line"] == 8
    screen = site_check.format_report(rep)
    assert sum(str(crasher) in ln for ln in screen.splitlines()) == 1 and "result: FAILED" in screen


# ------------------------------------------------------------------------------ Horos / OsiriX: one folder per patient
def _horos_export(data_root: Path, root: Path, per_class: int = 6, per_patient: int = 2, flat: bool = False) -> dict:
    """``root/<class>/<patient folder>/IM-0001-000N.jpeg`` (``flat``: straight in the class folder, the names
    repeating), from distinct real radiographs; returns {path: patient folder}."""
    out = {}
    for cls in ("NORMAL", "PNEUMONIA"):
        src = iter(_real_jpegs(data_root, cls, per_class * per_patient))
        for p in range(per_class):
            folder = root / cls if flat else root / cls / f"{cls[:1]}{p:02d}^Doe"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(per_patient):
                f = folder / (f"IM-0001-{p:02d}{n + 1:02d}.jpeg" if flat else f"IM-0001-{n + 1:04d}.jpeg")
                f.write_bytes(next(src).read_bytes())
                out[str(f)] = f"{cls}/{p}"
    return out


def test_a_horos_export_gets_one_patient_per_folder_and_splits_them(data_root, tmp_path):
    from chest_xray import partition_records

    truth = _horos_export(data_root, tmp_path / "export")
    recs, rep = scan_dataset(tmp_path / "export")
    assert len(recs) == 24 and rep["n_patients"] == 12
    pid = {r["path"]: r["patient_id"] for r in recs}
    for a in truth:  # same folder <=> same id
        assert all((pid[a] == pid[b]) == (truth[a] == truth[b]) for b in truth)
    assert not any("Doe" in p for p in pid.values())  # the folder name (often the patient's) is not the id
    assert any(f["kind"] == "patient folders" and f["count"] == 12 for f in rep["findings"])
    res = partition_records(recs, 1, "dirichlet", seed=0, min_per_site=1)
    splits = {r["split"] for r in res.sites["site-1"]}
    assert splits == {"train", "val", "test"}  # not one patient "IM-0001" all in train


def test_a_file_name_id_under_both_classes_is_not_one_patient(data_root, tmp_path):
    _horos_export(data_root, tmp_path / "flat", per_class=3, per_patient=2, flat=True)
    recs, rep = scan_dataset(tmp_path / "flat")
    ids = {r["patient_id"] for r in recs}
    assert len(recs) == 12 and len(ids) == 12  # untrusted: one group per image, never one patient of both classes
    [f] = [f for f in rep["findings"] if f["kind"] == "untrusted patient id"]
    assert "a file-name id under NORMAL and PNEUMONIA" in f["text"] and f["count"] == 1


def test_kermany_names_keep_their_patients(data_root):
    recs, rep = scan_dataset(data_root / "chest_xray_original", labels="subtype", verify=False)
    assert rep["n_patients"] == 774 and not any(f["kind"] in ("patient folders", "untrusted patient id")
                                               for f in rep["findings"])


# -------------------------------------------------------- a CD export: DICOM originals and the viewer's JPEG copies
def _cd_export(data_root: Path, cases: Path, root: Path, n_pairs: int = 6) -> list[tuple[str, str]]:
    """``root/<class>/DICOM/IM00000k`` (a 12-bit CR original, its own PatientID) and ``root/<class>/JPEG/IMG000k.jpg``
    (the disc viewer's copy: 8-bit, quality 85) for ``n_pairs`` films, plus 10 other films per class. Returns the
    (original, copy) path pairs."""
    from PIL import Image

    from tests import ingestion_kinds as K

    nat = K.native_dicom(cases)
    pairs = []
    for c, cls in enumerate(("NORMAL", "PNEUMONIA")):
        src = _real_jpegs(data_root, cls, n_pairs // 2 + 10)
        for d in ("DICOM", "JPEG", "other"):
            (root / cls / d).mkdir(parents=True)
        for k, f in enumerate(src[: n_pairs // 2]):
            dcm = K.dicom_from_jpeg(nat, f, root / cls / "DICOM" / f"IM{c}{k:05d}", PatientID=f"CD{c}{k}",
                                    StudyInstanceUID=f"1.2.3.{c}.{k}")
            jpg = root / cls / "JPEG" / f"IMG{c}{k:03d}.jpg"
            with Image.open(f) as im:
                im.convert("L").save(jpg, "JPEG", quality=85)
            pairs.append((str(dcm), str(jpg)))
        for f in src[n_pairs // 2:]:
            (root / cls / "other" / f.name).write_bytes(f.read_bytes())
    return pairs


def test_every_near_pair_a_partition_puts_across_sites_or_splits_is_reported(data_root, tmp_path, capsys):
    from chest_xray import partition_records
    from chest_xray.partition import crossing_pairs
    from nvflare_jobs.cli import main
    from tests.conftest import find_cases_root

    pairs = _cd_export(data_root, find_cases_root(), tmp_path / "cd")
    os.environ.setdefault("CXR_PATIENT_SALT", "test-salt")
    recs, rep = scan_dataset(tmp_path / "cd")
    found = {frozenset(p[:2]) for p in rep["near_pairs"]}
    assert {frozenset(p) for p in pairs} <= found  # all six originals and copies, found through the index
    assert all(p[2] >= 0.99 for p in rep["near_pairs"])
    for seed in range(4):
        res = partition_records(recs, 2, "dirichlet", seed=seed, min_per_site=1)
        where = {r["path"]: (s, r["split"]) for s, rows in res.sites.items() for r in rows}
        expect = {frozenset(p) for p in pairs if where[p[0]] != where[p[1]]}
        assert {frozenset((c["a"], c["b"])) for c in crossing_pairs(res, rep["near_pairs"])} == expect
    out = tmp_path / "part"
    assert main(["partition", "--data", str(tmp_path / "cd"), "--sites", "2", "--scheme", "dirichlet",
                 "--min-per-site", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    crossing = json.loads((out / "scan_report.json").read_text())["near_pairs_crossing"]
    assert crossing, "with 2 sites some of the six pairs land apart (seed 0)"
    [line] = [ln for ln in err.splitlines() if "near duplicates across sites or splits" in ln]
    assert f"{len(crossing)} pair(s)" in line
    assert json.loads((out / "partition.json").read_text())["near_pairs_crossing"] == len(crossing)
