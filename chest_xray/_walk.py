"""Walking a folder layout: class / split folder names, junk, symbolic links, and the candidate files of a scan."""
from __future__ import annotations

import os
from pathlib import Path

from .io import DIRECTORY_INDEX_REASON, SUPPORTED_SUFFIXES, sniff_dicom
from .labels import CLASS_NAMES

#: Split folder names (lower case) a Kaggle layout may hold; matched in any case (``Train/``).
SPLIT_DIRS = ("train", "val", "test")

#: Class folder names (upper case) a folder layout may hold; matched in any case (``normal/``, ``Pneumonia/``).
CLASS_DIRS = tuple(dict.fromkeys(CLASS_NAMES["binary"] + CLASS_NAMES["subtype"]))


def _named_subdirs(folder: Path, names) -> list[tuple[Path, str]]:
    """``(path, canonical name)`` of each sub-folder of ``folder`` (links followed) whose name is one of ``names``
    in any case, sorted by name; the canonical name is the one in ``names``."""
    wanted = {n.lower(): n for n in names}
    out: list[tuple[Path, str]] = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return out
    for e in entries:
        try:
            if e.name.lower() in wanted and e.is_dir(follow_symlinks=True):
                out.append((Path(e.path), wanted[e.name.lower()]))
        except OSError:
            continue
    return out


def detect_layout(root: str | os.PathLike) -> str:
    """``"manifest"``, ``"classes"`` or ``"kaggle"``. Class and split folder names match in any case
    (``normal/``, ``Pneumonia/``, ``Train/``).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: ``root`` is none of the three layouts.
    """
    r = Path(root)
    if not r.exists():
        raise FileNotFoundError(f"{r}: data root does not exist")
    if r.is_file():
        if r.suffix.lower() == ".csv":
            return "manifest"
        raise ValueError(f"{r}: a data root file must be a CSV manifest")
    if _named_subdirs(r, CLASS_DIRS):
        return "classes"
    if any(_named_subdirs(d, CLASS_DIRS) for d, _ in _named_subdirs(r, SPLIT_DIRS)):
        return "kaggle"
    raise ValueError(
        f"{r}: unrecognised data root; expected {{train,val,test}}/{{NORMAL,PNEUMONIA}}/, NORMAL/ and PNEUMONIA/, "
        "or a CSV manifest with path,label[,patient_id] columns"
    )


#: File names that operating systems, file managers and archivers leave in exported folders (lower case): never
#: images; listed in the scan report as junk.
JUNK_FILE_NAMES = ("thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini", ".ds_store", ".localized",
                   "icon\r", ".directory")
#: Folders of such debris (lower case), never scanned: Mac zip resource forks, macOS volume metadata, Windows
#: recycle bin, Synology thumbnails, Jupyter checkpoints.
JUNK_DIR_NAMES = ("__macosx", ".trashes", ".spotlight-v100", ".fseventsd", "$recycle.bin", "@eadir",
                  ".ipynb_checkpoints")


def junk_reason(path: str | os.PathLike, is_dir: bool = False) -> str | None:
    """Why a file or folder is operating-system / archive debris rather than data, or None.

    ``Thumbs.db``, ``desktop.ini``, ``.DS_Store`` and the like (:data:`JUNK_FILE_NAMES`), Mac resource forks
    ``._*``, other hidden names (leading dot), and the folders in :data:`JUNK_DIR_NAMES`.
    """
    name = os.fsdecode(Path(path).name)
    low = name.lower()
    if is_dir:
        if low in JUNK_DIR_NAMES:
            return f"operating-system / archive debris folder {name}, not scanned"
        if name.startswith("."):
            return f"hidden folder {name}, not scanned"
        return None
    if low in JUNK_FILE_NAMES:
        return f"operating-system junk file {name!r}"
    if name.startswith("._"):
        return "Mac resource fork (._*), not an image"
    if name.startswith("."):
        return "hidden file"
    return None


def skip_entry(path, reason: str, kind: str) -> dict[str, str]:
    """A scan report's ``skipped`` entry: ``{"path", "reason", "kind"}`` (``kind`` one of the report's skip
    kinds, e.g. ``"junk"``, ``"unreadable"``)."""
    return {"path": str(path), "reason": reason, "kind": kind}


def dir_key(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of a folder (links followed), or None when it cannot be stat'ed: the key
    :func:`walk_files` marks visited folders by."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _other_class(cls: str | None, name: str) -> str | None:
    """The class a sub-folder of class folder ``cls`` is named after when that contradicts ``cls`` (``PNEUMONIA/``
    inside ``NORMAL/``; ``BACTERIAL/`` inside ``PNEUMONIA/`` agrees with it), else None."""
    other = name.upper()
    if cls is None or other not in CLASS_DIRS or other == cls:
        return None
    pneumonia = {"PNEUMONIA", "BACTERIAL", "VIRAL"}
    return None if "PNEUMONIA" in (cls, other) and {cls, other} <= pneumonia else other


def walk_files(top: Path, skipped: list[dict[str, str]], seen: set[tuple[int, int]],
                blocked: set[tuple[int, int]] = frozenset(), cls: str | None = None) -> list[Path]:
    """Every file under ``top``, following symbolic links to folders, each real folder visited once.

    The paths returned are the paths *as found* (through the links, never resolved). A folder reached a second
    time (a symbolic-link cycle, or two links to one folder) is listed in ``skipped`` once per extra path and not
    scanned again, so no image is counted twice. A link to a folder in ``blocked`` (the data root, its parent
    folders, the other class folders) is listed and not followed: following it would loop or give another class's
    images this folder's label. Junk folders and broken links are listed in ``skipped``, and so is a sub-folder
    named after a class that contradicts ``cls`` (``NORMAL/PNEUMONIA/``): its images' label is ambiguous.
    """
    out: list[Path] = []
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            st = os.stat(d)
        except OSError as e:
            skipped.append(skip_entry(d, f"cannot open folder ({e.strerror or e})", "unreadable"))
            continue
        key = (st.st_dev, st.st_ino)
        if d is not top and key in blocked:
            skipped.append(skip_entry(d, f"symbolic link to {os.path.realpath(d)}, the data root, one of its parent "
                                    "folders or another class folder: not followed (a cycle, or images of another "
                                    "class)", "symbolic-link cycle"))
            continue
        if key in seen:
            skipped.append(skip_entry(d, f"folder already scanned through another path (symbolic-link cycle or a "
                                    f"second link to {os.path.realpath(d)})", "symbolic-link cycle"))
            continue
        seen.add(key)
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            skipped.append(skip_entry(d, f"cannot list folder ({e.strerror or e})", "unreadable"))
            continue
        subdirs = []
        for e in entries:
            p = Path(e.path)
            try:
                is_dir = e.is_dir(follow_symlinks=True)
                is_file = e.is_file(follow_symlinks=True)
                is_link = e.is_symlink()
            except OSError as err:
                skipped.append(skip_entry(p, f"cannot stat ({err.strerror or err})", "unreadable"))
                continue
            if is_dir:
                why, other = junk_reason(p, is_dir=True), _other_class(cls, e.name)
                if why:
                    skipped.append(skip_entry(p, why, "junk"))
                elif other:
                    skipped.append(skip_entry(p, f"folder named {other} inside the {cls} class folder: its images' "
                                                 "label is ambiguous, not scanned (move them to the right class "
                                                 "folder)", "ambiguous class folder"))
                else:
                    subdirs.append(p)
            elif is_file:
                out.append(p)
            elif is_link:
                skipped.append(skip_entry(p, f"broken symbolic link (its target {os.readlink(p)} does not exist)",
                                     "broken symbolic link"))
            else:
                skipped.append(skip_entry(p, "not a regular file", "not a regular file"))
        stack.extend(reversed(subdirs))
    return out


def _list_outside(folder: Path, accepted: set[str], expected: str, skipped: list[dict[str, str]]) -> None:
    """List in ``skipped`` what a folder layout does not scan at this level: every sub-folder whose name is not in
    ``accepted`` (lower case), and every image file (by suffix or DICOM marker). Other files (README,
    MANIFEST.csv, licences) are documentation and are not listed."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        skipped.append(skip_entry(folder, f"cannot list folder ({e.strerror or e})", "unreadable"))
        return
    for e in entries:
        p = Path(e.path)
        try:
            is_dir = e.is_dir(follow_symlinks=True)
        except OSError:
            is_dir = False
        if is_dir:
            if e.name.lower() in accepted:
                continue
            why = junk_reason(p, is_dir=True)
            skipped.append(skip_entry(p, why, "junk") if why else skip_entry(
                p, f"folder {e.name!r} is not {expected}: not scanned (its images have no label)",
                "not in a class folder"))
        elif p.suffix.lower() in SUPPORTED_SUFFIXES or sniff_dicom(p):
            if junk_reason(p):
                skipped.append(skip_entry(p, junk_reason(p), "junk"))
            elif e.name.upper() == "DICOMDIR":  # a DICOM export's index, at any level: never an image
                skipped.append(skip_entry(p, DIRECTORY_INDEX_REASON, "directory index"))
            else:
                skipped.append(skip_entry(p, f"image not inside {expected}: not scanned (no label)",
                                     "not in a class folder"))


def iter_candidates(root: Path, layout: str, skipped: list[dict[str, str]]) -> list[tuple[Path, str, None]]:
    """(file, class name, None) of a folder layout (``"classes"`` or ``"kaggle"``), sorted by path; junk, cycles,
    broken links and images outside the class folders go to ``skipped``. (A manifest's rows:
    :func:`chest_xray._manifest.manifest_candidates`.)"""
    out: list[tuple[Path, str, None]] = []
    class_list = " / ".join(CLASS_DIRS)
    if layout == "classes":
        dirs = [root]
    else:
        dirs = [d for d, _ in _named_subdirs(root, SPLIT_DIRS)]
        _list_outside(root, set(SPLIT_DIRS), f"a split folder ({' / '.join(SPLIT_DIRS)})", skipped)
    class_dirs: list[tuple[Path, str]] = []
    for d in dirs:
        found = _named_subdirs(d, CLASS_DIRS)
        _list_outside(d, {c.lower() for c in CLASS_DIRS}, f"a class folder ({class_list})", skipped)
        class_dirs.extend(found)
    seen: set[tuple[int, int]] = set()
    # never entered through a link: the data root and every folder above it, the split and class folders
    real = Path(os.path.realpath(root))
    blocked = {k for k in map(dir_key, [real, *real.parents, *dirs, *(cd for cd, _ in class_dirs)]) if k}
    for cd, c in class_dirs:
        out.extend((f, c, None) for f in walk_files(cd, skipped, seen, blocked, c))
    return sorted(out, key=lambda t: str(t[0]))
