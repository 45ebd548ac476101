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
import unicodedata
from pathlib import Path

import numpy as np
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
    spellings = ("PAT01", "pat01", " PAT01 ", "Pat01\t", "MÜLLER 02", unicodedata.normalize("NFD", "müller  02"))
    for k, f in enumerate(n[:6]):  # six NORMAL images of two patients, spelled six ways
        shutil.copy(f, img / f.name)
        rows.append([str(img / f.name), "NORMAL", spellings[k]])
    for k, f in enumerate(n[6:] + p):  # others: one patient each
        shutil.copy(f, img / f.name)
        rows.append([str(img / f.name), "NORMAL" if k < 6 else "PNEUMONIA", f"Q{k}"])
    recs, rep = scan_dataset(_manifest(tmp_path / "m.csv", rows))
    pid = {Path(r["path"]).name: r["patient_id"] for r in recs}
    assert len({pid[f.name] for f in n[:4]}) == 1 and len({pid[f.name] for f in n[4:6]}) == 1
    assert pid[n[0].name] == "PAT01" and pid[n[4].name] == "MÜLLER 02"  # the first spelling is kept
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


# ------------------------------------------------------------------------------------ VOI LUT variants
def _with_lut(src: Path, dest: Path, descriptor, data, vr: str = "US", **attrs) -> Path:
    """The native case with one VOI LUT item (``data`` as US values, OW words, or OW bytes when ``vr`` is
    ``"OW8"``: one byte per entry, as some 8-bit LUTs are written) and the given attributes."""
    import pydicom
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    ds = pydicom.dcmread(src)
    for k, v in attrs.items():
        setattr(ds, k, v)
    item = Dataset()
    item.LUTDescriptor = list(descriptor)
    a = np.asarray(data)
    item.LUTData = (a.astype(np.uint8).tobytes() if vr == "OW8" else a.astype(np.uint16).tobytes() if vr == "OW"
                    else [int(x) for x in a])
    item["LUTData"].VR = "OW" if vr.startswith("OW") else "US"
    ds.VOILUTSequence = Sequence([item])
    ds.save_as(dest)
    return dest


def _by_hand(values: np.ndarray, first: int, lut: np.ndarray, top: int) -> np.ndarray:
    """PS3.3 C.11.2.1.1: values below the first mapped value take the first entry, above the last the last."""
    return lut[np.clip(values - first, 0, len(lut) - 1)] / float(top)


@pytest.mark.parametrize("vr", ["US", "OW", "OW8"])
def test_8_bit_voi_lut_reaches_the_full_grey_range(ingestion_cases, tmp_path, vr):
    """An 8-bit LUT (entries 0..255) was read 4x too dark through pydicom, or failed when packed one byte per
    entry; the standard's mapping by hand is the reference."""
    import pydicom

    from chest_xray import read_image

    nat = K.native_dicom(ingestion_cases)
    raw = pydicom.dcmread(nat).pixel_array.astype(np.int64)
    lut = np.round(np.sqrt(np.arange(4096) / 4095.0) * 255).astype(np.int64)
    f = _with_lut(nat, tmp_path / f"lut8_{vr}.dcm", [4096, 0, 8], lut, vr)
    img, meta = read_image(f)
    assert meta["voi"] == "lut" and meta["voi_fallback"] is None
    assert np.abs(np.asarray(img, np.float64) - _by_hand(raw, 0, lut, 255)).max() <= 1.0 / 255


@pytest.mark.parametrize("bits", [12, 16])
def test_voi_lut_after_a_negative_rescale_intercept_maps_from_its_signed_first_value(ingestion_cases, tmp_path, bits):
    """Rescale Slope 2, Intercept -1000: the LUT's first mapped value -1000 written as US (64536). With a
    descriptor matching its data the image came out black."""
    import pydicom

    from chest_xray import read_image

    nat = K.native_dicom(ingestion_cases)
    raw = pydicom.dcmread(nat).pixel_array.astype(np.int64)
    lut = np.round(np.sqrt(np.arange(8192) / 8191.0) * 4095).astype(np.int64)
    f = _with_lut(nat, tmp_path / f"rescaled_{bits}.dcm", [8192, 65536 - 1000, bits], lut,
                  RescaleSlope=2, RescaleIntercept=-1000)
    img, meta = read_image(f)
    want = _by_hand(raw * 2 - 1000, -1000, lut, 4095)
    assert meta["voi"] == "lut" and np.abs(np.asarray(img, np.float64) - want).max() <= 1.0 / 255
    assert np.asarray(img).std() > 0.05  # not a blank image


def test_the_same_bytes_under_three_classes_are_all_skipped_with_each_other_copy_named(data_root, tmp_path):
    """Subtype labels: one image copied under NORMAL, BACTERIAL and VIRAL is one contradictory group of three."""
    n = _real_jpegs(data_root, "NORMAL", 5)
    p = _real_jpegs(data_root, "PNEUMONIA", 40)
    bac = [f for f in p if "bacteria" in f.name][:4]
    vir = [f for f in p if "virus" in f.name][:4]
    if len(bac) < 4 or len(vir) < 4:
        pytest.skip("subtype file names not found")
    root = tmp_path / "d"
    for cls, files in (("NORMAL", n[:4]), ("BACTERIAL", bac), ("VIRAL", vir)):
        (root / cls).mkdir(parents=True)
        for f in files:
            shutil.copy(f, root / cls / f.name)
    copies = {"NORMAL": "same_n.jpeg", "BACTERIAL": "same_b.jpeg", "VIRAL": "same_v.jpeg"}
    for cls, name in copies.items():
        shutil.copy(n[4], root / cls / name)
    recs, rep = scan_dataset(root, labels="subtype")
    assert len(recs) == 12
    why = {Path(s["path"]).name: s["reason"] for s in rep["skipped"]}
    assert set(why) == set(copies.values())
    for name, reason in why.items():
        others = set(copies.values()) - {name}
        assert all(o in reason for o in others) and "two classes" not in reason
    assert rep["duplicates"]["contradictory_groups"] == 1 and rep["duplicates"]["contradictory_images"] == 3


# ------------------------------------------------------------------------ special files never opened
_SCAN = ("import json, sys; from chest_xray import scan_dataset; recs, rep = scan_dataset(sys.argv[1], verify=False); "
         "print(json.dumps({'n': len(recs), 'skipped': rep['skipped']}))")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_named_pipes_and_devices_are_skipped_without_being_opened(data_root, tmp_path):
    """A FIFO listed in a manifest, or lying beside the class folders without a suffix, was opened to sniff for
    DICOM: the scan blocked for ever (and the threads ignored SIGTERM). Run in a subprocess with a time limit."""
    import subprocess
    import sys

    n, p = _real_jpegs(data_root, "NORMAL", 4), _real_jpegs(data_root, "PNEUMONIA", 4)
    img = tmp_path / "img"
    img.mkdir()
    rows = []
    for k, f in enumerate(n + p):
        shutil.copy(f, img / f.name)
        rows.append([str(img / f.name), "NORMAL" if k < 4 else "PNEUMONIA", f"P{k}"])
    os.mkfifo(img / "pipe.jpeg")
    os.mkfifo(img / "pipe_no_suffix")
    rows += [[str(img / "pipe.jpeg"), "NORMAL", "Q1"], [str(img / "pipe_no_suffix"), "NORMAL", "Q2"]]
    if os.path.exists("/dev/zero"):
        rows.append(["/dev/zero", "NORMAL", "Q3"])
    layouts = {"manifest": _manifest(tmp_path / "m.csv", rows)}
    root = tmp_path / "folders"  # a class-folder layout with a pipe beside and inside the class folders
    for cls, files in (("NORMAL", n), ("PNEUMONIA", p)):
        (root / cls).mkdir(parents=True)
        for f in files:
            shutil.copy(f, root / cls / f.name)
    os.mkfifo(root / "pipe_at_root")
    os.mkfifo(root / "NORMAL" / "pipe_in_class")
    layouts["folders"] = root
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for name, target in layouts.items():
        try:
            done = subprocess.run([sys.executable, "-c", _SCAN, str(target)], capture_output=True, text=True,
                                  timeout=90, env=env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: the scan blocked on a named pipe")
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["n"] == 8, (name, out)
        kinds = {Path(s["path"]).name: s["kind"] for s in out["skipped"]}
        pipes = {k: v for k, v in kinds.items() if "pipe" in k or k == "zero"}
        assert pipes and set(pipes.values()) <= {"not a regular file"}, (name, kinds)


def test_a_16_bit_voi_lut_shorter_than_its_descriptor_is_read_as_words_and_noted(ingestion_cases, tmp_path):
    """OW LUT data holding fewer words than the descriptor's count were read one byte per entry (an 8-bit LUT):
    a sawtooth of low and high bytes. The words it holds are the LUT; the mismatch is noted."""
    import pydicom

    from chest_xray import read_image

    nat = K.native_dicom(ingestion_cases)
    raw = pydicom.dcmread(nat).pixel_array.astype(np.int64)
    lut = np.round(np.sqrt(np.arange(2048) / 2047.0) * 4095).astype(np.int64)  # 2048 words, descriptor says 4096
    img, meta = read_image(_with_lut(nat, tmp_path / "short.dcm", [4096, 0, 12], lut, "OW"))
    assert np.abs(np.asarray(img, np.float64) - _by_hand(raw, 0, lut, 4095)).max() <= 1.0 / 255
    kinds = [n["kind"] for n in meta["grayscale_notes"]]
    assert kinds == ["VOI LUT length"] and "2048" in meta["grayscale_notes"][0]["note"]


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_an_uncompressed_dicom_cut_short_says_so_in_one_short_line(ingestion_cases, tmp_path, keep):
    """pydicom's paragraph ("The number of bytes of pixel data is less than expected ... the dataset may be
    corrupted, have an invalid group 0028 element value, or the transfer syntax may be incorrect") was cut to
    300 characters; the reason now says how much of the pixel data arrived."""
    from chest_xray import ImageReadError, read_image

    nat = K.native_dicom(ingestion_cases)
    data = nat.read_bytes()
    f = tmp_path / f"cut_{keep}.dcm"
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ImageReadError) as ei:
        read_image(f)
    e = ei.value
    assert e.kind == "corrupt or truncated" and e.reason.startswith("truncated DICOM file")
    assert len(e.reason) < 100 and "\n" not in str(e) and str(f) in str(e)


# ------------------------------------------------------------------------------ a class inside another class
def test_a_folder_named_after_another_class_inside_a_class_folder_is_not_given_its_label(data_root, tmp_path):
    """``NORMAL/PNEUMONIA/`` (an export copied into the wrong folder) gave pneumonia images the NORMAL label with
    no word. Such a folder, at any depth, is listed and not scanned; a folder agreeing with its class
    (``PNEUMONIA/VIRAL/``, ``NORMAL/normal/``) and any other name are scanned as before."""
    n, p = _real_jpegs(data_root, "NORMAL", 9), _real_jpegs(data_root, "PNEUMONIA", 10)
    root = tmp_path / "d"
    placed = {"NORMAL": n[:4], "PNEUMONIA": p[:4], "NORMAL/PNEUMONIA": p[4:7], "PNEUMONIA/old/Normal": n[4:6],
              "PNEUMONIA/VIRAL": p[7:9], "NORMAL/normal": n[6:8], "NORMAL/batch 2": n[8:9]}
    for folder, files in placed.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy(f, root / folder / f.name)
    recs, rep = scan_dataset(root, verify=False)
    got = {Path(r["path"]).relative_to(root).parent.as_posix(): r["label"] for r in recs}
    assert got == {"NORMAL": 0, "PNEUMONIA": 1, "PNEUMONIA/VIRAL": 1, "NORMAL/normal": 0, "NORMAL/batch 2": 0}
    assert len(recs) == 4 + 4 + 2 + 2 + 1
    amb = {Path(s["path"]).relative_to(root).as_posix() for s in rep["skipped"] if s["kind"] == "ambiguous class folder"}
    assert amb == {"NORMAL/PNEUMONIA", "PNEUMONIA/old/Normal"}
    assert any(f["text"].startswith("skipped: ambiguous class folder: 2") for f in rep["findings"])


def test_a_zero_byte_file_is_an_empty_file_whatever_its_suffix(data_root, tmp_path):
    """A zero-byte ``.dcm`` was "not a valid DICOM file" (kind "not an image") while a zero-byte ``.jpeg`` was an
    empty file: an interrupted copy reads the same whatever the format."""
    n, p = _real_jpegs(data_root, "NORMAL", 3), _real_jpegs(data_root, "PNEUMONIA", 3)
    root = tmp_path / "d"
    for cls, files in (("NORMAL", n), ("PNEUMONIA", p)):
        (root / cls).mkdir(parents=True)
        for f in files:
            shutil.copy(f, root / cls / f.name)
    for name in ("zero.dcm", "zero.DICOM", "zero.jpeg", "zero.png"):
        (root / "NORMAL" / name).write_bytes(b"")
    recs, rep = scan_dataset(root, verify=False)
    assert len(recs) == 6
    assert {Path(s["path"]).name: s["kind"] for s in rep["skipped"]} == dict.fromkeys(
        ("zero.dcm", "zero.DICOM", "zero.jpeg", "zero.png"), "empty file")


@pytest.mark.parametrize("keep", [2, 3, 20, 120])
def test_a_jpeg_cut_inside_its_header_is_truncated_not_an_unknown_format(data_root, tmp_path, keep):
    """A copy interrupted after a few bytes still starts with the JPEG marker: it is "corrupt or truncated", not
    "not a recognised image format"."""
    n, p = _real_jpegs(data_root, "NORMAL", 3), _real_jpegs(data_root, "PNEUMONIA", 3)
    root = tmp_path / "d"
    for cls, files in (("NORMAL", n), ("PNEUMONIA", p)):
        (root / cls).mkdir(parents=True)
        for f in files:
            shutil.copy(f, root / cls / f.name)
    (root / "NORMAL" / "cut.jpeg").write_bytes(n[0].read_bytes()[:keep])
    recs, rep = scan_dataset(root, verify=False)
    assert len(recs) == 6
    assert [(Path(s["path"]).name, s["kind"]) for s in rep["skipped"]] == [("cut.jpeg", "corrupt or truncated")]
    from chest_xray import ImageReadError, read_image  # the reader site check and training use says the same

    with pytest.raises(ImageReadError) as ei:
        read_image(root / "NORMAL" / "cut.jpeg")
    assert ei.value.kind == "corrupt or truncated"


def test_a_manifest_saved_in_windows_1252_finds_utf8_file_names(data_root, tmp_path):
    """Spreadsheet software in Western Europe saves CSV in Windows-1252: "Röntgen" arrives as the byte 0xF6, the
    disk holds UTF-8. Every row was "No such file"; the name is matched and the note says why."""
    n, p = _real_jpegs(data_root, "NORMAL", 4), _real_jpegs(data_root, "PNEUMONIA", 4)
    img = tmp_path / "Aufnahmen_Thorax_ä"
    img.mkdir()
    lines = ["path;label;patient_id"]
    for k, f in enumerate(n + p):
        name = f"Röntgen_Säugling_{k}.jpeg"
        shutil.copy(f, img / name)
        lines.append(f"{img / name};{'NORMAL' if k < 4 else 'PNEUMONIA'};P{k}")
    m = tmp_path / "m.csv"
    m.write_bytes(("\r\n".join(lines) + "\r\n").encode("cp1252"))
    recs, rep = scan_dataset(m, verify=False)
    assert sorted(Path(r["path"]).name for r in recs) == sorted(f"Röntgen_Säugling_{k}.jpeg" for k in range(8))
    assert all(Path(r["path"]).is_file() for r in recs) and rep["skipped"] == []
    assert len(rep["notes"]) == 8 and all("Windows-1252" in x["note"] for x in rep["notes"])


def test_a_symbolic_link_loop_in_a_manifest_is_named_a_loop(data_root, tmp_path):
    """A link to itself was "broken symbolic link (its target ... does not exist)": the target exists, as a loop."""
    from chest_xray import ImageReadError, read_image

    loop = tmp_path / "loop.jpeg"
    os.symlink("loop.jpeg", loop)
    gone = tmp_path / "gone.jpeg"
    os.symlink("nowhere.jpeg", gone)
    for f, word in ((loop, "symbolic-link loop"), (gone, "does not exist")):
        with pytest.raises(ImageReadError) as ei:
            read_image(f)
        assert word in ei.value.reason and ei.value.kind == "missing file"
