"""``cxr-hfl data fetch`` (:mod:`chest_xray.fetch`): the two image sets are selected from archives in the Kermany
layout and verified against the committed file lists and SHA-256 hashes. The end-to-end test builds fake archives
from the shared development images (skipped without ``../shared/data``); the others use tiny lists made here."""
from __future__ import annotations

import csv
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from chest_xray import fetch as F

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CXR_DATA") or REPO.parent / "shared" / "data")


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """Committed lists replaced by two tiny sets: ``chest_xray_original`` (two files, each listed with the archive
    original's hash and a development copy's) and ``chest_xray_224`` (one file)."""
    lists = tmp_path / "lists"
    lists.mkdir()
    orig = {"train/NORMAL/IM-1.jpeg": (b"orig-normal", b"copy-normal"),
            "train/PNEUMONIA/person1_virus_1.jpeg": (b"orig-virus", b"copy-virus")}
    small = {"train/NORMAL/IM-9.jpeg": b"resized-224"}
    with open(lists / "files_chest_xray_original.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "sha256", "original_sha256"])
        for p, (o, c) in orig.items():
            w.writerow([p, _sha(c), _sha(o)])
    with open(lists / "files_chest_xray_224.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "sha256"])
        for p, b in small.items():
            w.writerow([p, _sha(b)])
    monkeypatch.setattr(F, "_DIR", lists)
    monkeypatch.setattr(F, "_check_parts", lambda name: None)  # the committed parts name the real files
    return orig, small


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_originals_and_copies_are_accepted_and_the_test_split_and_junk_ignored(tmp_path, tiny):
    orig, small = tiny
    a = _zip(tmp_path / "ChestXRay2017.zip", {
        "chest_xray/train/NORMAL/IM-1.jpeg": orig["train/NORMAL/IM-1.jpeg"][0],  # the archive's original
        "chest_xray/train/PNEUMONIA/person1_virus_1.jpeg": orig["train/PNEUMONIA/person1_virus_1.jpeg"][1],  # a copy
        "chest_xray/test/NORMAL/IM-1.jpeg": b"another image of the test split",
        "__MACOSX/chest_xray/train/NORMAL/._IM-1.jpeg": b"resource fork",
        "chest_xray/train/NORMAL/IM-unlisted.jpeg": b"not in the list"})
    b = _zip(tmp_path / "resized.zip", {"x/chest_xray_224/train/NORMAL/IM-9.jpeg": small["train/NORMAL/IM-9.jpeg"]})
    lines = []
    rep = F.fetch([a, b], tmp_path / "data", log=lines.append)
    assert rep["chest_xray_original"].status == "written" and rep["chest_xray_224"].status == "written"
    assert (rep["chest_xray_original"].originals, rep["chest_xray_original"].copies) == (1, 1)
    out = tmp_path / "data"
    assert (out / "chest_xray_original/train/NORMAL/IM-1.jpeg").read_bytes() == b"orig-normal"
    assert (out / "chest_xray_224/train/NORMAL/IM-9.jpeg").read_bytes() == b"resized-224"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "chest_xray_224/train/NORMAL/IM-9.jpeg", "chest_xray_original/train/NORMAL/IM-1.jpeg",
        "chest_xray_original/train/PNEUMONIA/person1_virus_1.jpeg"]
    assert lines[0].startswith("chest_xray_original: 2 of 2 files verified (1 archive originals, 1 development")
    again = F.fetch([a], out, log=lines.append)  # a second run verifies what is there and writes nothing
    assert {r.status for r in again.values()} == {"already there, verified"}


def test_a_set_with_a_changed_or_missing_file_is_not_written_and_the_report_names_it(tmp_path, tiny):
    orig, _ = tiny
    a = _zip(tmp_path / "a.zip", {"chest_xray/train/NORMAL/IM-1.jpeg": b"orig-normal, one byte changed",
                                  "chest_xray/train/PNEUMONIA/person1_virus_1.jpeg": b"orig-virus"})
    rep = F.fetch([a], tmp_path / "data", log=lambda _: None)
    r = rep["chest_xray_original"]
    assert r.status == "incomplete, nothing written" and r.found == 1
    assert r.mismatched == ["train/NORMAL/IM-1.jpeg"] and r.missing == []
    assert rep["chest_xray_224"].missing == ["train/NORMAL/IM-9.jpeg"]
    assert "1 found with other contents (first: train/NORMAL/IM-1.jpeg)" in r.line()
    assert not list((tmp_path / "data").iterdir())  # no set folder and no partial folder left


def test_the_224_resize_is_not_taken_from_the_originals(tmp_path, tiny):
    """The Mendeley archive holds the original of a file the 224 list names: other contents, so not accepted."""
    a = _zip(tmp_path / "a.zip", {"chest_xray/train/NORMAL/IM-9.jpeg": b"the original, not the 224 x 224 resize"})
    r = F.fetch([a], tmp_path / "data", sets=("chest_xray_224",), log=lambda _: None)["chest_xray_224"]
    assert r.found == 0 and r.mismatched == ["train/NORMAL/IM-9.jpeg"]


def test_cli_exit_codes_and_one_line_errors(tmp_path, tiny, capsys):
    from nvflare_jobs.cli import main

    orig, small = tiny
    good = _zip(tmp_path / "a.zip", {"c/train/NORMAL/IM-1.jpeg": b"orig-normal",
                                     "c/train/PNEUMONIA/person1_virus_1.jpeg": b"orig-virus"})
    out = tmp_path / "data"
    assert main(["data", "fetch", "--archive", str(good), "--out", str(out)]) == 1  # the 224 set is not in it
    err = capsys.readouterr().err
    assert "chest_xray_224 incomplete: nothing written for it" in err and (out / "chest_xray_original").is_dir()
    junk = _zip(tmp_path / "j.zip", {"c/train/NORMAL/other.jpeg": b"not listed"})  # neither set: one sentence
    assert main(["data", "fetch", "--archive", str(junk), "--out", str(tmp_path / "o3")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("cxr-hfl data fetch: chest_xray_original and chest_xray_224 incomplete: nothing written for "
                   "them; give the archives that hold them with more --archive options")
    assert main(["data", "fetch", "--archive", str(tmp_path / "none.zip"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"cxr-hfl data fetch: --archive {tmp_path / 'none.zip'}: no such file or folder"
    (tmp_path / "bad.zip").write_bytes(b"not a zip")
    assert main(["data", "fetch", "--archive", str(tmp_path / "bad.zip"), "--out", str(tmp_path / "o2")]) == 2
    assert "bad.zip: not a readable zip file or folder" in capsys.readouterr().err
    (out / "chest_xray_original" / "train" / "NORMAL" / "IM-1.jpeg").write_bytes(b"edited")
    assert main(["data", "fetch", "--archive", str(good), "--out", str(out), "--sets", "chest_xray_original"]) == 2
    assert "exists and is not a verified chest_xray_original" in capsys.readouterr().err
    assert (out / "chest_xray_original" / "train" / "NORMAL" / "IM-1.jpeg").read_bytes() == b"edited"  # left as is
    assert main(["data", "fetch", "--archive", str(good), "--out", str(out), "--sets", "chest_x"]) == 2
    assert "unknown image set 'chest_x'" in capsys.readouterr().err


def test_the_committed_parts_of_chest_xray_224_lie_inside_its_file_list():
    from chest_xray.splits import PARTS, split_rows

    listed = [lf.path for lf in F.file_list("chest_xray_224")]
    parts = [r["path"] for p in PARTS for r in split_rows(p)]
    assert len(listed) == len(set(listed)) == 2770 and sorted(parts) == sorted(listed)
    assert len(F.file_list("chest_xray_original")) == 850
    assert all(len(lf.kinds) == 2 for lf in F.file_list("chest_xray_original"))


needs_data = pytest.mark.skipif(not (SHARED / "chest_xray_original").is_dir() or not (SHARED / "chest_xray_224").is_dir(),
                                reason=f"no shared images at {SHARED} (set CXR_DATA)")


@needs_data
def test_the_committed_hashes_are_those_of_the_shared_development_images():
    for name in F.SETS:
        rep = F.verify_folder(SHARED / name, name)
        assert rep.status == "verified", rep.line()
    assert F.verify_folder(SHARED / "chest_xray_original", "chest_xray_original").copies == 850


@needs_data
def test_the_readme_command_on_a_fake_archive_built_from_the_shared_images(tmp_path, capsys):
    """The README's command, run on a zip in the Kermany layout (``chest_xray/train/<LABEL>/<file>``, with a test
    split and macOS junk beside it) and a second zip holding the 224 x 224 set: both sets are selected, verified and
    written, byte for byte the shared files; nothing of the images is in the repository."""
    import re
    import shlex

    from nvflare_jobs.cli import main

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Get the data", 1)[1].split("\n## ", 1)[0]
    line = next(ln for ln in re.findall(r"```bash\n(.*?)```", section, re.S)[0].splitlines() if "data fetch" in ln)
    argv = shlex.split(line.split(" #")[0].split("cxr-hfl ", 1)[1])
    a = tmp_path / "ChestXRay2017.zip"
    with zipfile.ZipFile(a, "w") as z:  # stored, not compressed: the JPEGs are compressed already
        for f in sorted((SHARED / "chest_xray_original" / "train").rglob("*.jpeg")):
            z.write(f, f"chest_xray/train/{f.parent.name}/{f.name}")
        z.writestr("chest_xray/test/NORMAL/IM-0001-0001.jpeg", b"a test-split image")
        z.writestr("__MACOSX/chest_xray/._train", b"junk")
    b = tmp_path / "chest_xray_224.zip"
    with zipfile.ZipFile(b, "w") as z:
        for f in sorted((SHARED / "chest_xray_224" / "train").rglob("*.jpeg")):
            z.write(f, f"chest_xray_224/train/{f.parent.name}/{f.name}")
    archives = [x for i, x in enumerate(argv) if i and argv[i - 1] == "--archive"]
    assert archives and argv[argv.index("--out") + 1]
    rest = [x for i, x in enumerate(argv) if x != "--archive" and (not i or argv[i - 1] != "--archive")]
    rest[rest.index("--out") + 1] = str(tmp_path / "data")
    assert main([*rest, "--archive", str(a), "--archive", str(b)]) == 0
    out = capsys.readouterr().out
    assert "chest_xray_original: 850 of 850 files verified" in out and "chest_xray_224: 2770 of 2770" in out
    for name in F.SETS:
        for f in (SHARED / name / "train").rglob("*.jpeg"):
            got = tmp_path / "data" / name / f.relative_to(SHARED / name)
            assert got.read_bytes() == f.read_bytes()
