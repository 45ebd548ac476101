"""Scanning a data root into records: labels, patient ids and image sizes, with a report of skipped files.

Three layouts are understood:

- Kaggle: ``ROOT/{train,val,test}/{NORMAL,PNEUMONIA}/*`` (the original split is ignored; sites re-split);
- class folders: ``ROOT/NORMAL/``, ``ROOT/PNEUMONIA/`` (and, for the subtype scheme, optionally
  ``ROOT/BACTERIAL/``, ``ROOT/VIRAL/``);
- a CSV manifest (``ROOT`` is the ``.csv`` file) with columns ``path`` (relative to the CSV's folder, or absolute)
  and ``label`` (a class name or an integer index), optionally ``patient_id``; as spreadsheets save it (BOM,
  CRLF, ``;`` or tab delimiters: :func:`read_csv_rows`). A repeated row, every row of a file listed with
  different labels, and an empty path are listed in the report with their CSV line, not used.

Split and class folder names match in any case (``train/Normal``, ``pneumonia/``). A folder beside them that is
no class folder (``COVID/``) and an image lying outside the class folders are listed (kind ``not in a class
folder``); other files there (README, MANIFEST.csv) are documentation and are not. A file carrying the DICOM
``DICM`` marker is read as DICOM whatever its name (``IM000001``, a UID, ``x.jpg``), with the modality / view
checks and its hashed PatientID.

Folders are walked following symbolic links to sub-folders (each real folder once: a link cycle is listed, not
followed), and a link to a file is kept under its own name (Hugging Face hub caches, git-annex and DataLad
datasets link suffix-less blobs). Every file is either a record or listed in the report's ``skipped`` by name with
a reason; operating-system debris (``Thumbs.db``, ``desktop.ini``, ``.DS_Store``, ``._*``, ``__MACOSX/``) is listed
as junk.
"""
from __future__ import annotations

import hashlib
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

from .grouping import (
    content_findings,
    file_sha256,
    group_records,
    meta_notes,
    near_duplicate_signature,
    note_findings,
    public_summary,
    skip_findings,
)
from ._manifest import manifest_candidates
from ._walk import SPLIT_DIRS, detect_layout, iter_candidates, junk_reason, skip_entry
from .io import (
    DICOM_SUFFIXES,
    SUPPORTED_SUFFIXES,
    ImageReadError,
    PatientSaltError,
    dicom_grouping_ids,
    dicom_header,
    dicom_skip,
    header_notes,
    is_placeholder_id,
    pil_size,
    read_image,
    sniff_dicom,
)
from .io.worker import Crash, map_isolated
from .labels import CLASS_NAMES  # class names per label scheme; owner: chest_xray.labels

_KERMANY_PATIENT = re.compile(r"^(NORMAL2-IM-\d+|IM-\d+|person\d+)", re.IGNORECASE)
#: File-name ids that are a counter (``IM-0001`` of ``IM-0001-0003``: an export's series number, the same in every
#: patient folder of a Horos / OsiriX export), not a patient's own number (``person12``).
_COUNTER_ID = re.compile(r"^(NORMAL2-)?IM-\d+$", re.IGNORECASE)
#: Longest side (pixels) the scan decodes a JPEG to at least (draft mode): the near-duplicate signature reduces it
#: to 32 x 32.
SIGNATURE_MIN_SIDE = 64
_SUBTYPE = re.compile(r"_(bacteria|virus)_", re.IGNORECASE)



class LabelError(ValueError):
    """A file's label cannot be determined under the requested scheme (the message names the file)."""


def patient_id_from_name(path: str | os.PathLike) -> str:
    """Patient id from a Kermany file name, else the file stem (each such image is its own patient).

    ``person1003_virus_1685.jpeg`` -> ``person1003``; ``IM-0656-0001-0002.jpeg`` -> ``IM-0656``;
    ``NORMAL2-IM-0383-0001.jpeg`` -> ``NORMAL2-IM-0383``.
    """
    stem = Path(path).stem
    m = _KERMANY_PATIENT.match(stem)
    return m.group(1) if m else stem


def label_index(class_name: str, path: str | os.PathLike, labels: str = "binary") -> int:
    """Integer label of a file under a label scheme.

    Args:
        class_name: the file's class as given by its folder or manifest: NORMAL / PNEUMONIA (any case), or
            BACTERIAL / VIRAL, or an integer index as a string.
        path: the file; under ``subtype`` a PNEUMONIA image's subtype comes from its Kermany name
            (``personN_bacteria_M`` / ``personN_virus_M``).
        labels: ``"binary"`` (NORMAL=0, PNEUMONIA=1) or ``"subtype"`` (NORMAL=0, BACTERIAL=1, VIRAL=2).

    Raises:
        LabelError: unknown class name or index, or a PNEUMONIA file without a recognisable subtype.
        ValueError: unknown label scheme.
    """
    if labels not in CLASS_NAMES:
        raise ValueError(f"unknown label scheme {labels!r}; expected one of {sorted(CLASS_NAMES)}")
    names = CLASS_NAMES[labels]
    c = str(class_name).strip().upper()
    if c.lstrip("-").isdigit():
        k = int(c)
        if not 0 <= k < len(names):
            raise LabelError(f"{path}: label index {k} out of range for the {labels} scheme {names}")
        return k
    if labels == "binary":
        if c in ("BACTERIAL", "VIRAL", "BACTERIA", "VIRUS"):
            return 1
        if c in names:
            return names.index(c)
        raise LabelError(f"{path}: unknown class {class_name!r} for the binary scheme {names}")
    # subtype
    if c in ("BACTERIA", "VIRUS"):
        c = {"BACTERIA": "BACTERIAL", "VIRUS": "VIRAL"}[c]
    if c in names:
        return names.index(c)
    if c == "PNEUMONIA":
        m = _SUBTYPE.search(Path(path).name)
        if not m:
            raise LabelError(
                f"{path}: PNEUMONIA image without a subtype in its name (expected personN_bacteria_M or "
                "personN_virus_M) under the subtype scheme"
            )
        return names.index("BACTERIAL" if m.group(1).lower() == "bacteria" else "VIRAL")
    raise LabelError(f"{path}: unknown class {class_name!r} for the subtype scheme {names}")


def scan_workers() -> int:
    """Default number of worker processes :func:`scan_dataset` verifies files with: ``$CXR_SCAN_WORKERS`` when set
    (an integer >= 1), else ``min(4, os.cpu_count())``.

    Raises:
        ValueError: ``CXR_SCAN_WORKERS`` is set but not an integer >= 1 (the message names the variable).
    """
    env = os.environ.get("CXR_SCAN_WORKERS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"CXR_SCAN_WORKERS must be an integer >= 1, got {env!r}")
        return n
    return max(1, min(4, os.cpu_count() or 1))


def scan_dataset(
    root: str | os.PathLike,
    labels: str = "binary",
    *,
    verify: bool = True,
    salt: str | None = None,
    allow_any_modality: bool = False,
    allow_lateral: bool = False,
    workers: int | None = None,
    near_duplicates: bool = False,
    keep_for_processing: bool = False,
    skip_other_body_parts: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Scan a data root into one record per usable image.

    Args:
        root: a Kaggle-layout folder, a class-folder layout, or a CSV manifest file (see the module docstring).
        labels: label scheme, ``"binary"`` or ``"subtype"`` (see :data:`CLASS_NAMES`).
        verify: decode every image (JPEGs in 1/8-scale draft mode, ~3 ms each) so that truncated or corrupt files
            are caught here rather than in training; with False only the header is read (sizes, DICOM tags).
        salt: site-local salt for DICOM patient-id hashing (see :func:`chest_xray.io.site_salt`).
        allow_any_modality: keep DICOM objects whose Modality is not CR/DX/DR.
        allow_lateral: keep DICOM objects with a lateral ViewPosition.
        workers: worker processes that read / verify files side by side; None = :func:`scan_workers`
            (``$CXR_SCAN_WORKERS``, else ``min(4, os.cpu_count())``); 1 = one file after the other. The decoders
            run only in these processes: a file that crashes or hangs one is skipped by name (kind ``decoder
            crash`` / ``decoder timeout``) and the scan goes on. The records, report and errors do not depend on
            the number.
        near_duplicates: (with ``verify``) group near duplicates (the same radiograph re-encoded or resized) as
            one patient, as exact duplicates always are (:mod:`chest_xray.grouping`). With ``verify`` they are
            found either way (an index, not all pairs) and listed in the report's ``near_pairs``.
        keep_for_processing: keep DICOM "For Processing" images (skipped by default); skip_other_body_parts: skip
            DICOM objects whose header names another body part (noted by default). See
            :func:`chest_xray.io.dicom_skip`.

    Returns:
        ``(records, report)``. ``records`` is a list sorted by path of dicts ``path`` (absolute str), ``label``
        (int index into ``CLASS_NAMES[labels]``), ``patient_id`` (str: manifest value, else Kermany name prefix,
        else salted DICOM PatientID hash, else the file stem; then regrouped: an untrusted id gives way to a study
        or accession id or one group per image, and exact duplicates share one id, see
        :mod:`chest_xray.grouping`), ``width``, ``height`` (int pixels, original), ``sha256`` (the file's content
        hash). ``report`` is a JSON-safe dict: ``root``, ``layout``, ``labels``, ``class_names``, ``n_files``,
        ``n_records``, ``per_class`` (name -> count), ``n_patients``, ``skipped`` (list of ``{"path", "reason",
        "kind"}``), ``skipped_by_reason`` (kind -> count), ``notes`` (list of ``{"path", "note", "kind"}``: a VOI
        fallback, a grey-scale rule applied, a harmless decoder warning, a manifest name matched after Unicode
        normalisation), ``duplicates`` and ``patient_ids`` (counts of the content-hash index and the trust rule)
        , ``findings`` (list of ``{"kind", "count", "examples", "text"}``: one per unusual fact, examples by file
        name, never a patient field; ``text`` is the one line ``partition`` and ``site check`` print) and
        ``near_pairs`` (``[path, path, similarity]`` of every near-duplicate pair; :func:`chest_xray.partition.
        crossing_pairs` finds those a partition puts in two sites or splits).

    Raises:
        FileNotFoundError, ValueError: the root is missing or not a recognised layout, or the label scheme is
            unknown.
        LabelError: a file's label cannot be determined (e.g. a PNEUMONIA file without subtype under
            ``subtype``, an unknown or empty class in a manifest); a labelling problem is a data-set error, not a
            file to skip silently. Raised after the whole scan, once: the message gives how many files and names
            the first three, so that one run shows what to fix.
        chest_xray.io.PatientSaltError: a DICOM's patient id needs the site salt and its file cannot be read or
            created (an ``OSError`` naming the file; set ``$CXR_PATIENT_SALT``).
    """
    if labels not in CLASS_NAMES:
        raise ValueError(f"unknown label scheme {labels!r}; expected one of {sorted(CLASS_NAMES)}")
    r = Path(os.path.abspath(root))  # not resolved: a linked data root keeps its own path
    layout = detect_layout(r)
    skipped: list[dict[str, str]] = []
    walk_notes: list[dict[str, str]] = []
    if layout == "manifest":
        candidates = manifest_candidates(r, skipped, walk_notes, label_key=partial(label_index, labels=labels))
    else:
        candidates = iter_candidates(r, layout, skipped)
    n_walk_skipped = len(skipped)

    one = partial(_scan_candidate, layout=layout, labels=labels, verify=verify, salt=salt,
                  allow_any_modality=allow_any_modality, allow_lateral=allow_lateral,
                  dicom_rules={"keep_for_processing": keep_for_processing,
                               "skip_other_body_parts": skip_other_body_parts})
    records, notes = _collect(_run_scan(candidates, one, workers), skipped, labels)
    notes = walk_notes + notes
    records, summary = _group(records, r, layout, skipped, near_duplicates and verify)
    return records, _report(r, layout, labels, len(candidates) + n_walk_skipped, records, skipped, notes, summary)


def _report(root: Path, layout: str, labels: str, n_files: int, records: list[dict[str, Any]],
            skipped: list[dict[str, str]], notes: list[dict[str, str]], summary: dict[str, Any]) -> dict[str, Any]:
    """The scan report (see :func:`scan_dataset`)."""
    names = CLASS_NAMES[labels]
    return {
        "root": str(root),
        "layout": layout,
        "labels": labels,
        "class_names": list(names),
        "n_files": n_files,
        "n_records": len(records),
        "per_class": {n: sum(1 for x in records if x["label"] == k) for k, n in enumerate(names)},
        "n_patients": len({x["patient_id"] for x in records}),
        "skipped": sorted(skipped, key=lambda s: s["path"]),
        "skipped_by_reason": count_by_kind(skipped),
        "notes": notes,
        **public_summary(summary),
        "findings": content_findings(summary) + note_findings(notes) + skip_findings(skipped),
        "near_pairs": summary["duplicates"]["paths"].get("near_pairs", []),
    }


def _group(records: list[dict[str, Any]], root: Path, layout: str, skipped: list[dict[str, str]],
           near_duplicates: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The trust rule and the content-hash index over the scan's records (:mod:`chest_xray.grouping`); skipped
    contradictory duplicates are appended to ``skipped``. Records keep their content hash as ``sha256``."""
    info = []
    from_folders = patient_folder_ids(records, root, layout)
    for rec in records:
        g = rec.pop("_grouping")
        top = Path(rec["path"]).relative_to(root).parts[0].lower() if layout == "kaggle" else None
        info.append({**g, "split": top if top in SPLIT_DIRS else None})
        rec["sha256"] = g["sha256"]
    kept, dup_skips, summary = group_records(records, info, near_duplicates=near_duplicates)
    summary["patient_folders"] = from_folders
    skipped.extend(dup_skips)
    return kept, summary


def patient_folder_ids(records: list[dict[str, Any]], root: Path, layout: str) -> dict[str, Any]:
    """Patient ids from patient folders, in place: an export with one folder per patient (Horos / OsiriX) names
    every patient's files ``IM-0001-0001``, ``IM-0001-0002``, ..., so the file-name rule
    (:func:`patient_id_from_name`) would make all of them one patient ``IM-0001``.

    A patient folder is a folder below a class folder (neither a class nor a split folder) whose images all have
    the same counter id from their names (:data:`_COUNTER_ID`: one counter series). Its images get an id made from
    the folder's path below the class folder (``dir-`` + 16 hex digits of its SHA-256: a folder is often named after
    the patient, and the name never enters a manifest; the same folder name under two classes is one patient), and
    that id is judged by the trust rule like a manifest's (:mod:`chest_xray.grouping`). Records of a manifest, of DICOM
    files and of names that are not counters are left as they are.

    Args:
        records: scan records with ``"_grouping"`` (``from_name`` marks an id taken from the file name).

    Returns:
        ``{"folders": number of patient folders, "images": their images, "paths": those images' paths}``.
    """
    if layout == "manifest":
        return {"folders": 0, "images": 0, "paths": []}
    depth = 2 if layout == "kaggle" else 1  # the class folder's depth below the root
    by_dir: dict[Path, list[dict[str, Any]]] = {}
    for rec in records:
        if rec["_grouping"].get("from_name"):
            by_dir.setdefault(Path(rec["path"]).parent, []).append(rec)
    n, paths = 0, []
    for d, recs in sorted(by_dir.items()):
        below = d.relative_to(root).parts[depth:]
        ids = {r["patient_id"].upper() for r in recs}
        if not below or len(ids) != 1 or not _COUNTER_ID.match(next(iter(ids))):
            continue
        n += 1
        for r in recs:
            digest = hashlib.sha256("/".join(below).encode("utf-8", "surrogateescape")).hexdigest()
            r["patient_id"] = "dir-" + digest[:16]
            r["_grouping"].update(judged=True, from_name=False)
            paths.append(r["path"])
    return {"folders": n, "images": len(paths), "paths": paths}



def _run_scan(candidates: list, one, workers: int | None) -> list:
    """``one(candidate)`` for every candidate, in order, in ``workers`` worker processes (None:
    :func:`scan_workers`) that a crashing or hanging decoder does not take down: such a file becomes a skip naming
    it (:func:`chest_xray.io.worker.map_isolated`)."""
    n_workers = scan_workers() if workers is None else int(workers)
    if n_workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    out = map_isolated(one, candidates, n_workers)
    return [(None, skip_entry(c[0], r.reason, r.kind), [], None) if isinstance(r, Crash) else r
            for c, r in zip(candidates, out)]


def _scan_candidate(candidate: tuple[Path, str, str | None], **kw):
    """:func:`_scan_file` of one ``(path, class, manifest patient id)`` candidate (a worker process's task)."""
    path, cls, pid = candidate
    return _scan_file(path, cls, pid, **kw)


def _collect(results: list, skipped: list[dict[str, str]], labels: str
             ) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """``(records, notes)`` from :func:`_scan_file` results; skips are appended to ``skipped``.

    Raises:
        LabelError: one or more files have an unusable label (one message: the count and the first three).
    """
    records: list[dict[str, Any]] = []
    notes: list[dict[str, str]] = []
    label_errors: list[str] = []
    for record, skip, file_notes, label_error in results:
        notes.extend(file_notes)
        if label_error is not None:
            label_errors.append(label_error)
        elif skip is not None:
            skipped.append(skip)
        else:
            records.append(record)
    if label_errors:
        shown = "; ".join(" ".join(m.split()) for m in label_errors[:3])
        more = f"; and {len(label_errors) - 3} more" if len(label_errors) > 3 else ""
        raise LabelError(f"{len(label_errors)} file(s) have a label that cannot be used under the {labels} scheme "
                         f"(fix the class folders or the manifest): {shown}{more}")
    return records, notes

def _scan_file(
    path: Path,
    cls: str,
    pid: str | None,
    *,
    layout: str,
    labels: str,
    verify: bool,
    salt: str | None,
    allow_any_modality: bool,
    allow_lateral: bool,
    dicom_rules: dict[str, bool] | None = None,
) -> tuple[dict[str, Any] | None, dict[str, str] | None, list[dict[str, str]], str | None]:
    """What :func:`scan_dataset` makes of one candidate file (it reads only this file; safe to run in a thread).

    Returns:
        ``(record, skip, notes, label_error)``: exactly one of ``record`` (the file's record), ``skip`` (its
        ``{"path", "reason", "kind"}`` entry) or ``label_error`` (the :class:`LabelError` message) is not None;
        ``notes`` are the file's report notes (kept even when a later step skips the file). A record carries
        ``"_grouping"`` (content hash, near-duplicate signature, salted DICOM ids) for :func:`_group`.
    """
    notes: list[dict[str, str]] = []
    # the path as found (a symbolic link keeps its own name): it gives the type, the label's subtype and the
    # patient id; only the bytes are read through the link
    why = junk_reason(path) if layout != "manifest" else None
    if why:
        return None, skip_entry(path, why, "junk"), notes, None
    if path.is_dir():  # a manifest row naming a folder
        return None, skip_entry(path, "a folder, not an image file", "not a regular file"), notes, None
    if path.exists() and not path.is_file():  # a pipe, socket or device (a manifest row): opening it could block
        return None, skip_entry(path, "not a regular file (a named pipe, socket or device)",
                                "not a regular file"), notes, None
    suffix = path.suffix.lower()
    # the DICOM marker wins over the suffix: a DICOM object exported as IMG0001 or x.jpg still gets the
    # modality / view checks and its (hashed) PatientID, so a patient's images stay in one split
    is_dicom = suffix in DICOM_SUFFIXES or sniff_dicom(path)
    if suffix not in SUPPORTED_SUFFIXES and not is_dicom:
        return None, skip_entry(path, f"unsupported file type {path.suffix or '(no suffix, not DICOM)'}",
                           "unsupported file type"), notes, None
    try:
        label = label_index(cls, path, labels)
    except LabelError as e:  # collected: one error naming every such file, not the first only
        return None, None, notes, str(e)
    try:
        if is_dicom:
            skip, width, height, image, group = _scan_dicom(path, verify, salt, allow_any_modality, allow_lateral,
                                                            notes, **(dicom_rules or {}))
            if skip is not None:
                return None, skip, notes, None
            group["judged"] = bool(pid) or group.get("patient") is not None
            group["placeholder"] = is_placeholder_id(pid) if pid else group["placeholder"]
            pid = pid or group.get("patient") or path.stem
        else:
            width, height, image = _scan_pil(path, verify, notes)
            group = {"judged": bool(pid), "placeholder": bool(pid) and is_placeholder_id(pid), "from_name": not pid}
            pid = pid or patient_id_from_name(path)
        group["sha256"] = file_sha256(path)
        # every verified image: the near pairs are reported whether or not they are grouped
        group["signature"] = near_duplicate_signature(image) if image is not None else None
    except ImageReadError as e:
        return None, skip_entry(path, e.reason, e.kind), notes, None
    except PatientSaltError:  # the site's salt, not this file: every DICOM would be skipped for it
        raise
    except Exception as e:  # noqa: BLE001 -- one bad file never aborts a scan
        return None, skip_entry(path, f"cannot read ({type(e).__name__}: {' '.join(str(e).split())[:200]})",
                           "unreadable"), notes, None
    record = {"path": str(path), "label": label, "patient_id": str(pid), "width": int(width), "height": int(height),
              "_grouping": group}
    return record, None, notes, None


def _scan_dicom(path: Path, verify: bool, salt: str | None, allow_any_modality: bool, allow_lateral: bool,
                notes: list[dict[str, str]], keep_for_processing: bool = False, skip_other_body_parts: bool = False):
    """``(skip or None, width, height, decoded image or None, grouping ids)`` of a DICOM candidate; the header's
    notes (another body part, a For Processing image kept) are appended to ``notes``."""
    if path.stat().st_size == 0:  # as for any other image, not "not a valid DICOM file"
        raise ImageReadError(path, "empty file (0 bytes)", "empty file")
    hdr = dicom_header(path)
    skip = dicom_skip(hdr, allow_any_modality, allow_lateral, keep_for_processing, skip_other_body_parts)
    if skip:
        return skip_entry(path, *skip), 0, 0, None, {}
    notes += [{"path": str(path), **n} for n in header_notes(hdr)]
    width, height, image = hdr["columns"], hdr["rows"], None
    if verify:
        image, meta = read_image(path)
        width, height = meta["original_width"], meta["original_height"]
        notes += meta_notes(path, meta)
    elif hdr.get("voi_fallback"):
        notes += meta_notes(path, {"voi_fallback": hdr["voi_fallback"]})
    return None, width, height, image, dicom_grouping_ids(path, salt)


def _scan_pil(path: Path, verify: bool, notes: list[dict[str, str]]):
    """``(width, height, decoded image or None)`` of a JPEG / PNG candidate (upright sizes)."""
    if not verify:
        return (*pil_size(path), None)
    # the smallest draft scale that keeps >= SIGNATURE_MIN_SIDE px: a full but cheap decode (1/8 of a 2,000-px film),
    # and enough pixels for the near-duplicate signature of a small (224-px) export
    image, meta = read_image(path, target_size=SIGNATURE_MIN_SIDE)
    notes += meta_notes(path, meta)
    return meta["original_width"], meta["original_height"], image


def count_by_kind(entries: list[dict[str, str]]) -> dict[str, int]:
    """Number of scan-report entries per ``kind`` (most frequent first, then by name)."""
    c: dict[str, int] = {}
    for s in entries:
        k = s.get("kind") or "unreadable"
        c[k] = c.get(k, 0) + 1
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))
