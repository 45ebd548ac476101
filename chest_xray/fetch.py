"""Select the project's two Kermany image sets from downloaded archives and verify them against committed hashes.

The chest X-rays are Kermany, Zhang and Goldbaum (2018), *Labeled Optical Coherence Tomography (OCT) and Chest X-Ray
Images for Classification*, Mendeley Data v2, doi:10.17632/rscbjbr9sj.2, licence CC BY 4.0 (archive
``ChestXRay2017.zip``: ``chest_xray/{train,test}/{NORMAL,PNEUMONIA}/*.jpeg``). The project uses two subsets of its
``train`` split, each listed with its files' SHA-256 in ``chest_xray/splits/files_<set>.csv``:

* ``chest_xray_original`` (850 images at their original pixel size): each file is accepted as the archive's original
  (``original_sha256``) or as the project's development copy of it (``sha256``: the same image re-encoded as JPEG
  quality 75 to save space; dimensions and mode unchanged).
* ``chest_xray_224`` (2,770 further images of that split, patient-disjoint from the first set): a third party's
  224 x 224 RGB resize (aspect ratio not kept), accepted only as those exact files (``sha256``). It is not rebuilt
  here: a resize of the originals would be other pixels. Its committed ``probe`` / ``tuning`` / ``evaluation`` parts
  (:mod:`chest_xray.splits`) are file lists into it and are checked to lie inside it.

:func:`fetch` looks in every archive (a ``.zip`` file, or a folder, searched with the ``.zip`` files inside it) for
members whose path ends in a listed ``train/<LABEL>/<file>``, keeps the first whose SHA-256 is an accepted one, and
writes ``OUT/<set>/train/<LABEL>/<file>``. A set is written only when every listed file was found and verified
(into a hidden folder first, renamed when complete), so nothing half-done is left under its name; a set already in
``OUT`` is verified, never overwritten.
"""
from __future__ import annotations

import csv
import hashlib
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

SETS = ("chest_xray_original", "chest_xray_224")
SOURCE = "Kermany, Zhang, Goldbaum (2018), Mendeley Data v2, doi:10.17632/rscbjbr9sj.2, CC BY 4.0"
_DIR = Path(__file__).with_name("splits")
_CHUNK = 1 << 20


class FetchError(ValueError):
    """An archive that cannot be read, a set that is incomplete or does not verify, or an output in the way; the
    message names the archive, set or folder."""


@dataclass(frozen=True)
class ListedFile:
    """One file of a committed list: ``path`` relative to the set's root (``train/NORMAL/IM-0115-0001.jpeg``) and
    the SHA-256 digests accepted for it (``kinds``: digest -> ``original`` or ``copy``)."""

    path: str
    kinds: dict = field(hash=False)


def file_list(name: str) -> list[ListedFile]:
    """The committed file list of set ``name`` (one of :data:`SETS`), in file order.

    Raises:
        FetchError: unknown set, or its list is missing or lacks the ``path`` / ``sha256`` columns.
    """
    if name not in SETS:
        raise FetchError(f"unknown image set {name!r}; choose from {', '.join(SETS)}")
    f = _DIR / f"files_{name}.csv"
    try:
        with f.open(newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as e:
        raise FetchError(f"{f}: cannot read the committed file list ({e.strerror or e})") from None
    if not rows or not {"path", "sha256"} <= set(rows[0]):
        raise FetchError(f"{f}: not a file list (expected the columns path, sha256)")
    return [ListedFile(r["path"], {r["sha256"]: "copy" if r.get("original_sha256") else "file",
                                   **({r["original_sha256"]: "original"} if r.get("original_sha256") else {})})
            for r in rows]


def sha256_file(f: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _key(member: str) -> str | None:
    """``train/<LABEL>/<file>`` of an archive member path, or None when it is not an image of a ``train`` split."""
    p = PurePosixPath(member.replace("\\", "/"))
    if len(p.parts) < 3 or p.parts[-3] != "train" or p.name.startswith("."):
        return None
    return "/".join(p.parts[-3:])


def _members(archive: Path) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """``(key, read)`` for each image member of a ``train`` split in ``archive`` (a zip file or a folder searched
    recursively, zip files inside it included); ``read()`` returns the member's bytes."""
    if archive.is_dir():
        for f in sorted(archive.rglob("*")):
            if f.suffix.lower() == ".zip" and f.is_file():
                yield from _members(f)
            elif f.is_file() and (k := _key(f.relative_to(archive).as_posix())):
                yield k, f.read_bytes
        return
    try:
        zf = zipfile.ZipFile(archive)
    except (OSError, zipfile.BadZipFile) as e:
        raise FetchError(f"--archive {archive}: not a readable zip file or folder ({e})") from None
    with zf:
        for info in zf.infolist():
            if not info.is_dir() and "__MACOSX" not in info.filename and (k := _key(info.filename)):
                yield k, (lambda i=info: zf.read(i))


@dataclass
class SetReport:
    """What :func:`fetch` did for one set: ``found`` files verified of ``listed``, how many were the archive's
    originals and how many the development copies, the files found with other contents (``mismatched``, e.g. the
    original where the 224 x 224 resize is listed) and those not found at all (``missing``)."""

    name: str
    listed: int
    found: int = 0
    originals: int = 0
    copies: int = 0
    mismatched: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    status: str = ""

    def line(self) -> str:
        """One line for the user."""
        head = f"{self.name}: {self.found} of {self.listed} files verified"
        if self.originals or self.copies:
            head += f" ({self.originals} archive originals, {self.copies} development copies)"
        tail = []
        if self.mismatched:
            tail.append(f"{len(self.mismatched)} found with other contents (first: {self.mismatched[0]})")
        if self.missing:
            tail.append(f"{len(self.missing)} not in any archive (first: {self.missing[0]})")
        return head + (f"; {'; '.join(tail)}" if tail else "") + f": {self.status}"


def verify_folder(root: Path, name: str) -> SetReport:
    """Check an existing ``root`` (a set's folder) against the committed list of ``name``: every listed file
    present with an accepted SHA-256. Returns the report (``status`` ``verified`` or ``incomplete``)."""
    rep = SetReport(name, 0)
    for lf in file_list(name):
        rep.listed += 1
        f = root / lf.path
        if not f.is_file():
            rep.missing.append(lf.path)
            continue
        kind = lf.kinds.get(sha256_file(f))
        if kind is None:
            rep.mismatched.append(lf.path)
            continue
        rep.found += 1
        rep.originals += kind == "original"
        rep.copies += kind == "copy"
    rep.status = "verified" if rep.found == rep.listed else "incomplete"
    return rep


def _check_parts(name: str) -> None:
    """Raise :class:`FetchError` when a committed part of ``chest_xray_224`` lists a file its file list lacks."""
    if name != "chest_xray_224":
        return
    from chest_xray.splits import PARTS, split_rows

    listed = {lf.path for lf in file_list(name)}
    for part in PARTS:
        extra = [r["path"] for r in split_rows(part) if r["path"] not in listed]
        if extra:
            raise FetchError(f"the committed {part} part lists {len(extra)} file(s) outside the {name} file list "
                             f"(first: {extra[0]})")


def _not_there_yet(out: Path, sets, reports: dict) -> list[str]:
    """The sets of ``sets`` not in ``out`` yet; each one already there is verified into ``reports``. Raises
    FetchError for one there that does not verify (it is left as it is)."""
    todo = []
    for name in sets:
        dest = out / name
        if not dest.exists():
            todo.append(name)
            continue
        rep = verify_folder(dest, name) if dest.is_dir() else None
        if rep is None or rep.status != "verified":
            raise FetchError(f"--out {out}: {dest} exists and is not a verified {name} "
                             f"({rep.line() if rep else 'a file'}); move it away to fetch it again")
        rep.status = "already there, verified"
        reports[name] = rep
    return todo


def fetch(archives: list[str | Path], out: str | Path, sets: tuple[str, ...] = SETS,
          log: Callable[[str], None] = print) -> dict[str, SetReport]:
    """Select and verify ``sets`` from ``archives`` into ``out`` (module docstring).

    Args:
        archives: zip files or folders holding the Kermany layout (``.../train/<LABEL>/<file>``), e.g. the Mendeley
            ``ChestXRay2017.zip`` and the archive of the 224 x 224 resize; searched in order.
        out: the data root to write (``OUT/<set>/train/<LABEL>/<file>``); the project reads it with ``--data OUT``
            or ``CXR_DATA=OUT``.
        sets: which sets to select (default both).
        log: receives one line per set.

    Returns:
        ``{set: SetReport}``; ``status`` is ``written``, ``already there, verified`` or ``incomplete`` (nothing
        written for that set).

    Raises:
        FetchError: an archive that does not exist or is not a zip file or folder; an unknown set; ``out`` or a
            set's folder in it that is a file, or a set's folder that exists and does not verify (it is left as it
            is).
    """
    paths = [Path(a) for a in archives]
    for a in paths:
        if not a.exists():
            raise FetchError(f"--archive {a}: no such file or folder")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FetchError(f"--out {out}: is a file, not a folder")
    wanted = {name: {lf.path: lf for lf in file_list(name)} for name in sets}
    for name in sets:
        _check_parts(name)
    reports: dict[str, SetReport] = {}
    todo = _not_there_yet(out, sets, reports)
    found: dict[str, dict[str, str]] = {n: {} for n in todo}  # set -> {key: "original" | "copy" | "file"}
    mismatched: dict[str, set] = {n: set() for n in todo}
    index: dict[str, list] = {}  # key -> [(set, ListedFile)]
    for n in todo:
        for k, lf in wanted[n].items():
            index.setdefault(k, []).append((n, lf))
    partial = {n: out / f".{n}.partial" for n in todo}  # written as verified, renamed when complete
    for n in todo:
        if partial[n].exists():
            shutil.rmtree(partial[n])
    for a in paths:
        for key, read in _members(a):
            targets = [(n, lf) for n, lf in index.get(key, ()) if key not in found[n]]
            if not targets:
                continue
            data = read()
            digest = hashlib.sha256(data).hexdigest()
            for n, lf in targets:
                if digest not in lf.kinds:
                    mismatched[n].add(key)
                    continue
                f = partial[n] / key
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(data)
                found[n][key] = lf.kinds[digest]
                mismatched[n].discard(key)
    for n in todo:
        kinds = list(found[n].values())
        rep = SetReport(n, len(wanted[n]), found=len(kinds), originals=kinds.count("original"),
                        copies=kinds.count("copy"), mismatched=sorted(mismatched[n]),
                        missing=sorted(set(wanted[n]) - set(found[n]) - mismatched[n]))
        if rep.found == rep.listed:
            partial[n].rename(out / n)
            rep.status = "written"
        else:
            if partial[n].exists():
                shutil.rmtree(partial[n])
            rep.status = "incomplete, nothing written"
        reports[n] = rep
    for n in sets:
        log(reports[n].line())
    return reports


def write_file_list(root: str | Path, name: str, dest: str | Path,
                    originals: dict[str, str] | None = None) -> int:
    """Write the file list of the set at ``root`` (every ``train/<LABEL>/<file>``, sorted) with each file's SHA-256
    to ``dest``; ``originals`` (path -> SHA-256 of the archive's original, for a set whose files are re-encoded
    copies) adds the ``original_sha256`` column. Returns the number of files. Lists and hashes only: no image is
    copied."""
    root = Path(root)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and _key(p.relative_to(root).as_posix()))
    cols = ["path", "sha256"] + (["original_sha256"] if originals is not None else [])
    with open(dest, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(cols)
        for p in files:
            w.writerow([p, sha256_file(root / p)] + ([originals[p]] if originals is not None else []))
    return len(files)
